"""The public surface (issue 39): what each ``__all__`` lists is documented
and public, the moved names warn from their old home, and measure
registrations can be undone and scoped."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import pkgutil
import re
import types
from typing import Any
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import measures
from gbn_jax import reductions
from gbn_jax import selection
from gbn_jax._selection import config as config_lib

from measure_helpers import BUILTIN_MEASURES

API_RST = pathlib.Path(__file__).parent.parent / "docs" / "api.rst"

# The modules users import from; every other module of the package must be
# private (underscore-named). The package is normalization only (issue 39):
# the training suite's convolutions are train.native.convolution.
PUBLIC_MODULES = [
    "gbn_jax",
    "gbn_jax.bound_measure",
    "gbn_jax.calibration",
    "gbn_jax.deviations",
    "gbn_jax.linen",
    "gbn_jax.measures",
    "gbn_jax.nnx",
    "gbn_jax.precise",
    "gbn_jax.quantiles",
    "gbn_jax.reductions",
    "gbn_jax.selection",
]
# ALL-CAPS names that are documented API, not internal constants.
PUBLIC_CONSTANTS = {"MEASURES", "METHODS", "CALIBRATIONS"}


def _resolve(dotted: str) -> Any:
  """The object at ``dotted``: the longest importable module prefix, then
  attributes."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      obj = getattr(obj, attr)
    return obj
  raise ImportError(dotted)


def _documented() -> dict[str, Any]:
  """Each fully qualified name docs/api.rst documents (an ``auto*``
  directive or an ``autosummary`` entry), to the object it names."""
  current, names, in_summary = "gbn_jax", [], False
  for line in API_RST.read_text().splitlines():
    if m := re.match(r"\.\. currentmodule:: (\S+)", line):
      current, in_summary = m.group(1), False
    elif line.startswith(".. autosummary::"):
      in_summary = True
    elif m := re.match(r"\.\. auto\w+:: (\S+)", line):
      names.append(m.group(1))
      in_summary = False
    elif (
        in_summary
        and line.startswith("   ")
        and not line.strip().startswith(":")
    ):
      names.append(line.strip())
    elif in_summary and line and not line.startswith(" "):
      in_summary = False
    if names and not names[-1].startswith("gbn_jax"):
      names[-1] = f"{current}.{names[-1]}"
  return {n: _resolve(n) for n in names}


def _registry() -> dict[str, measures.MeasureSpec]:
  return dict(gbn_jax.MEASURES)


def _spread(x, axis):
  return jnp.mean(x, axis), jnp.max(x, axis) - jnp.min(x, axis)


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


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_name_in_all_is_documented_in_the_api_page(module_name):
  documented = _documented()
  module = importlib.import_module(module_name)
  missing = []
  for name in module.__all__:
    obj = getattr(module, name)
    qualified = f"{module_name}.{name}"
    # A re-export counts as documented where its defining module's is.
    if qualified not in documented and not any(
        d is obj for d in documented.values()
    ):
      missing.append(qualified)
  assert not missing, f"not in docs/api.rst: {missing}"


def test_the_api_page_documents_only_what_resolves():
  documented = _documented()  # raises on a stale name
  assert "gbn_jax.reductions.mean" in documented
  assert "gbn_jax.selection.selection_config" in documented
  assert "gbn_jax.measures.MEASURE_CONTRACT" not in documented


def test_internal_helpers_are_not_exported():
  internals = {
      "gbn_jax.calibration": ["INV_SQRT_2_PI", "check_calibration"],
      "gbn_jax.quantiles": ["validate_alpha"],
      "gbn_jax.deviations": ["COMPLEX_OK", "check_real"],
      "gbn_jax.measures": ["MEASURE_CONTRACT"],
      "gbn_jax.bound_measure": ["MEASURE_CONTRACT"],
      "gbn_jax": ["mean", "extreme", "selection_config"],
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
      reductions.quantile(x, 0.3, 0),
      np.quantile(x, 0.3, axis=0, method="inverted_cdf"),
  )
  # qbar_alpha = q + E[(x - q)+] / (1 - alpha), from the definition.
  q = np.quantile(x, 0.75, axis=0, method="inverted_cdf")
  qbar = q + np.maximum(x - q, 0).mean(0) / 0.25
  np.testing.assert_allclose(
      reductions.superquantile(x, 0.75, 0), qbar, rtol=1e-5
  )
  assert reductions.quantile_rank(0.3, 37) == int(np.ceil(0.3 * 37))


@pytest.mark.parametrize(
    "name,new",
    [
        ("mean", "gbn_jax.reductions.mean"),
        ("extreme", "gbn_jax.reductions.extreme"),
        ("selection_config", "gbn_jax.selection.selection_config"),
    ],
)
def test_moved_names_warn_and_still_work(name, new):
  with pytest.warns(DeprecationWarning, match=re.escape(new)):
    old = getattr(gbn_jax, name)
  assert old is _resolve(new)
  with pytest.warns(DeprecationWarning, match=re.escape(new)):
    exec(f"from gbn_jax import {name}", {})  # pylint: disable=exec-used


def test_the_new_paths_do_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert gbn_jax.reductions.mean is reductions.mean
    assert gbn_jax.selection.selection_config is selection.selection_config
    assert gbn_jax.quantile is reductions.quantile
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
