"""The quick tier's rules (tests/helpers/tiers.py) name real tests and keep
some of each: a typo there would move a test out of the quick tier, or
keep nothing of a function, without a word."""

import fnmatch
import os

import pytest

from tests.helpers import tiers
from tests.helpers.process import REPO
from tests.helpers.process import run_pytest


def test_is_thorough_on_made_up_ids():
  function = next(f for f, kept in tiers.THOROUGH.items() if kept)
  kept = tiers.THOROUGH[function][0].replace("*", "x")
  assert not tiers.is_thorough(f"{function}[{kept}]")
  assert tiers.is_thorough(f"{function}[no_such_id]")
  whole = next(f for f, kept in tiers.THOROUGH.items() if not kept)
  assert tiers.is_thorough(whole)
  # The measure rule: any id part naming a measure outside the quick set.
  assert tiers.is_thorough("tests/gbn_jax/test_x.py::test_y[sqd3-mask]")
  assert tiers.is_thorough("tests/gbn_jax/test_x.py::test_y[bpoe]")
  assert not tiers.is_thorough("tests/gbn_jax/test_x.py::test_y[sqd2-mask]")
  assert not tiers.is_thorough("tests/gbn_jax/test_x.py::test_y[sqd:0.99]")
  assert not tiers.is_thorough("tests/gbn_jax/test_x.py::test_y")
  # The method rule, in the dispatch's tests only.
  dispatch = tiers.METHOD_TESTS + "test_y"
  assert tiers.is_thorough(f"{dispatch}[normal-bisect]")
  assert not tiers.is_thorough(f"{dispatch}[normal-native]")
  assert not tiers.is_thorough("tests/gbn_jax/test_x.py::test_y[sort]")


def test_quick_measures_and_methods_are_the_librarys():
  # pylint: disable=g-import-not-at-top
  from gbn_jax import measures
  from gbn_jax._selection import dispatch

  assert tiers.QUICK_MEASURES < tiers.ALL_MEASURES
  assert tiers.ALL_MEASURES <= set(measures.MEASURES)
  assert tiers.QUICK_METHODS < tiers.ALL_METHODS
  assert tiers.ALL_METHODS <= set(dispatch.METHODS) | {"adaptive"}


@pytest.mark.slow  # collects every file the rules name
def test_every_rule_names_collected_tests_and_keeps_what_it_says():
  files = sorted({f.split("::")[0] for f in tiers.THOROUGH})
  for f in files:
    assert os.path.isfile(os.path.join(REPO, f)), f
  out = run_pytest("--collect-only", "-o", "addopts=", *files).stdout
  ids = [line for line in out.splitlines() if "::" in line]
  for function, kept in tiers.THOROUGH.items():
    params = [
        i[len(function) + 1 : -1]
        for i in ids
        if i == function or i.startswith(function + "[")
    ]
    assert params or any(i == function for i in ids), f"no test {function}"
    for pattern in kept:
      matched = [p for p in params if fnmatch.fnmatchcase(p, pattern)]
      assert matched, f"{function}: {pattern!r} keeps nothing"
    if kept:
      # Something goes to the full run, else the entry is not needed.
      assert any(tiers.is_thorough(f"{function}[{p}]") for p in params)
