"""benchmarks/layer/bench_gbn.py, rehearsed with tiny shapes and one run.

The rows it writes and their keys are checked, never how fast this machine
is: every ratio is finite and positive, whatever it is.
"""

from __future__ import annotations

import json
import math

import flax.linen as nn
import pytest

from benchmarks.layer import bench_gbn
from benchmarks.layer import cases
from gbn_jax import linen

pytestmark = pytest.mark.slow  # a few compilations

FAMILY_KEYS = {
    "layer",
    "shape",
    "groups",
    "measure",
    "flax_ms",
    "gbn_ms",
    "ratio",
    "target",
}


def _rehearse(tmp_path, *flags):
  out = tmp_path / "bench.json"
  flags = ["--runs", "1", "--warmup", "1", "--out", str(out), *flags]
  returned = bench_gbn.main(flags)
  written = json.loads(out.read_text())
  assert written["complete"] and written == returned
  return written


def _finite(row, *keys):
  return all(math.isfinite(row[k]) and row[k] > 0 for k in keys)


def test_family_rows_beside_batchnorms(tmp_path):
  result = _rehearse(
      tmp_path,
      *("--shapes", "8x4x4x3", "--measures", "sd", "--train-steps"),
      *("--family", "group:2x4x4x8:4", "layer:2x3x16", "instance:2x4x4x3"),
      *("--family-measures", "sd", "mad", "sqd2"),
  )
  (bn_row,) = result["layers"]
  assert bn_row["measure"] == "sd" and _finite(bn_row, "bn_ms", "ratio")
  assert result["train_steps"] == []
  family = result["family"]
  assert [(r["layer"], r["measure"]) for r in family] == [
      (kind, m)
      for kind in ("group", "layer", "instance")
      for m in ("sd", "mad", "sqd2")
  ]
  for row in family:
    assert set(row) == FAMILY_KEYS
    assert _finite(row, "flax_ms", "gbn_ms", "ratio")
    assert row["target"] == bench_gbn.target_for(row["measure"])
  assert {r["shape"]: r["groups"] for r in family} == {
      "2x4x4x8": 4,
      "2x3x16": None,
      "2x4x4x3": None,
  }
  assert [r["target"] for r in family[:3]] == [1.05, 1.3, 1.5]


def test_empty_flags_skip_their_rows(tmp_path):
  result = _rehearse(
      tmp_path,
      *("--measures", "--train-steps", "--family", "layer:2x8"),
      *("--family-measures", "rsd"),
  )
  assert result["layers"] == [] and result["train_steps"] == []
  (row,) = result["family"]
  assert (row["layer"], row["measure"]) == ("layer", "rsd")
  result = _rehearse(tmp_path, "--measures", "--train-steps", "--family")
  assert result["layers"] == result["family"] == result["train_steps"] == []


def test_the_default_family_cases():
  assert [cases.parse_family(c) for c in cases.DEFAULT_FAMILY] == [
      ("group", (256, 32, 32, 64), 32),
      ("layer", (64, 128, 768), None),
  ]


@pytest.mark.parametrize(
    "text", ["group:8x4", "layer:8x4:2", "batch:8x4", "layer"]
)
def test_bad_family_cases_are_refused(text):
  with pytest.raises(ValueError, match="family case"):
    cases.parse_family(text)


def test_family_modules_are_flaxs_layers_and_their_drop_ins():
  assert type(cases.make_family_module("group", "flax", 4)) is nn.GroupNorm
  module = cases.make_family_module("group", "sqd:0.25", 4)
  assert isinstance(module, linen.GGroupNorm)
  assert (module.num_groups, module.measure, module.alpha) == (4, "sqd", 0.25)
  assert type(cases.make_family_module("layer", "flax")) is nn.LayerNorm
  assert cases.make_family_module("layer", "rbd").measure == "rbd"
