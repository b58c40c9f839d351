"""The public surface: each public name has one home, the module whose
``__all__`` lists it (tests/project/test_api_page.py: and under which
docs/api.rst documents it); measure registrations can be undone and scoped."""

from __future__ import annotations

import doctest
import importlib
import os
import pathlib
import pkgutil
import types

import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import measures
from gbn_jax import reductions
from gbn_jax import selection
from gbn_jax._selection import config as config_lib

from tests.helpers.measures import BUILTIN_MEASURES
from tests.helpers.process import REPO

# The modules users import from; every other module of the package must be
# private (underscore-named). The package is normalization only: the training
# suite's convolutions are train.native.convolution.
PUBLIC_MODULES = [
    "gbn_jax",
    "gbn_jax.calibration",
    "gbn_jax.deviations",
    "gbn_jax.linen",
    "gbn_jax.measures",
    "gbn_jax.nnx",
    "gbn_jax.reductions",
    "gbn_jax.selection",
]
# ALL-CAPS names that are documented API, not internal constants.
PUBLIC_CONSTANTS = {"MEASURES", "METHODS", "CALIBRATIONS"}


def _registry() -> dict[str, measures.MeasureSpec]:
  return dict(gbn_jax.MEASURES)


def _spread(x, axis):
  return jnp.mean(x, axis), jnp.max(x, axis) - jnp.min(x, axis)


# --- the package under test --------------------------------------------------


def test_the_package_under_test_is_the_expected_one():
  # .ci/newest_jax.sh runs these tests on the installed wheel, from a copy
  # of tests/ away from the checkout, and names the folder it installed into;
  # from a checkout they test the checkout's package.
  folder = pathlib.Path(gbn_jax.__file__).resolve().parent
  expected = os.environ.get("GBN_EXPECT_PACKAGE_IN")
  if expected:
    assert folder == pathlib.Path(expected).resolve() / "gbn_jax", folder
  else:
    assert folder == pathlib.Path(REPO).resolve() / "gbn_jax", folder


# --- __all__ -----------------------------------------------------------------


def test_every_public_module_lists_its_api():
  for name in PUBLIC_MODULES:
    assert isinstance(
        getattr(importlib.import_module(name), "__all__", None), list
    ), name


def test_modules_outside_the_public_list_are_underscore_named():
  public = {m.rsplit(".", 1)[-1] for m in PUBLIC_MODULES[1:]}
  found = {m.name for m in pkgutil.iter_modules(gbn_jax.__path__)}
  assert not found - public - {n for n in found if n.startswith("_")}
  assert public <= found


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_lists_no_internal_name(module_name):
  module = importlib.import_module(module_name)
  private = [n for n in module.__all__ if n.startswith("_")]
  constants = [
      n
      for n in module.__all__
      if n.isupper() and len(n) > 1 and n not in PUBLIC_CONSTANTS
  ]
  assert not private and not constants, (private, constants)
  assert len(set(module.__all__)) == len(module.__all__), module.__all__


def test_each_public_object_has_one_home():
  homes: dict[int, list[str]] = {}
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      obj = getattr(module, name)
      homes.setdefault(id(obj), []).append(f"{module_name}.{name}")
  shared = [names for names in homes.values() if len(names) > 1]
  assert not shared, f"listed in more than one __all__: {shared}"


def test_documented_conversions_are_exported():
  # The conversions the getting-started guide presents.
  assert "convert_batchnorm" in gbn_jax.nnx.__all__
  assert "batchnorm_as_gbn" in gbn_jax.linen.__all__


def test_internal_helpers_are_not_exported():
  internals = {
      "gbn_jax.calibration": ["INV_SQRT_2_PI", "check_calibration"],
      "gbn_jax.deviations": ["COMPLEX_OK", "check_real"],
      "gbn_jax.measures": ["MEASURE_CONTRACT"],
  }
  for name, hidden in internals.items():
    exported = set(importlib.import_module(name).__all__)
    assert not exported & set(hidden), (name, exported & set(hidden))


# --- reductions and selection ----------------------------------------------


def test_reductions_agree_with_numpy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((37, 3)).astype(np.float32)
  np.testing.assert_allclose(reductions.mean(x, 0), x.mean(0), rtol=1e-6)
  np.testing.assert_array_equal(
      reductions.extreme(x, 0, largest=False), x.min(0)
  )
  np.testing.assert_array_equal(
      gbn_jax.quantile(x, 0.3, 0),
      np.quantile(x, 0.3, axis=0, method="inverted_cdf"),
  )
  # qbar_alpha = q + E[(x - q)+] / (1 - alpha), from the definition.
  q = np.quantile(x, 0.75, axis=0, method="inverted_cdf")
  qbar = q + np.maximum(x - q, 0).mean(0) / 0.25
  np.testing.assert_allclose(gbn_jax.superquantile(x, 0.75, 0), qbar, rtol=1e-5)
  assert gbn_jax.quantile_rank(0.3, 37) == int(np.ceil(0.3 * 37))


def test_unknown_attributes_raise():
  with pytest.raises(AttributeError, match="no_such_name"):
    gbn_jax.no_such_name  # pylint: disable=pointless-statement


def test_selection_config_scopes_and_nests():
  assert selection.SelectionConfig is config_lib.SelectionConfig
  default = config_lib.current()
  with selection.selection_config(method="sort") as outer:
    assert outer == selection.SelectionConfig("sort", default.bracket_sigmas)
    with selection.selection_config(bracket_sigmas=0.0) as inner:
      # The method left out keeps the enclosing block's value.
      assert inner == selection.SelectionConfig("sort", 0.0)
      assert config_lib.current() == inner
    assert config_lib.current() == outer
  assert config_lib.current() == default
  assert "sort" in selection.METHODS


def test_selection_config_rejects_bad_arguments():
  with pytest.raises(ValueError, match="method must be one of"):
    with selection.selection_config(method="no_such_method"):
      pass
  with pytest.raises(ValueError, match="bracket_sigmas"):
    with selection.selection_config(bracket_sigmas=-1.0):
      pass


# --- scoped registration ----------------------------------------------------


def test_unregister_removes_a_registration():
  before = _registry()
  gbn_jax.register_measure("test_surface_spread", _spread)
  assert "test_surface_spread" in gbn_jax.MEASURES
  gbn_jax.unregister_measure("test_surface_spread")
  assert _registry() == before
  with pytest.raises(ValueError, match="test_surface_spread"):
    gbn_jax.unregister_measure("test_surface_spread")


@pytest.mark.parametrize("name", BUILTIN_MEASURES)
def test_builtins_cannot_be_unregistered(name):
  before = _registry()
  with pytest.raises(ValueError, match=f"{name!r} is built in"):
    gbn_jax.unregister_measure(name)
  assert _registry() == before


def test_registered_measure_lasts_for_the_block():
  before = _registry()
  with gbn_jax.registered_measure(
      "test_surface_p9", measures.sqd, alpha=0.9
  ) as spec:
    assert gbn_jax.MEASURES["test_surface_p9"] is spec
    assert spec.params == (("alpha", 0.9),) and spec.supports_mask
    x = np.arange(20, dtype=np.float32)[:, None]
    s, _ = gbn_jax.get_measure("test_surface_p9")(x, 0)
    np.testing.assert_array_equal(
        s, np.quantile(x, 0.9, axis=0, method="inverted_cdf")
    )
  assert _registry() == before


def test_registered_measure_restores_on_an_exception():
  before = _registry()
  with pytest.raises(RuntimeError, match="inside"):
    with gbn_jax.registered_measure("test_surface_boom", _spread):
      assert "test_surface_boom" in gbn_jax.MEASURES
      raise RuntimeError("inside")
  assert _registry() == before


def test_registered_measure_gives_a_shadowed_name_back():
  before = _registry()
  with gbn_jax.registered_measure("sd", _spread, overwrite=True):
    assert gbn_jax.MEASURES["sd"].fn is _spread
  assert _registry() == before
  assert gbn_jax.MEASURES["sd"] is before["sd"]
  # A taken name without overwrite is refused and changes nothing.
  with pytest.raises(ValueError, match="already registered"):
    with gbn_jax.registered_measure("sd", _spread):
      pass
  assert _registry() == before


def test_measures_doctests_leave_the_registry_as_they_found_it():
  before = _registry()
  finder = doctest.DocTestFinder()
  tests = finder.find(measures, globs=dict(vars(measures)))
  # The doctests do register measures (else this test checks nothing).
  assert any("register_measure(" in e.source for t in tests for e in t.examples)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  for test in tests:
    runner.run(test)
  assert runner.summarize(verbose=False).failed == 0
  assert _registry() == before


def test_registry_is_a_read_only_view():
  assert isinstance(gbn_jax.MEASURES, types.MappingProxyType)
  with pytest.raises(TypeError):
    gbn_jax.MEASURES["x"] = None  # type: ignore[index]
