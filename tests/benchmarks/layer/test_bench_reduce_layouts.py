"""benchmarks/layer/bench_reduce_layouts.py, rehearsed on a tiny shape.

The rows and the forms' sums are checked, never how fast this machine is.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks.layer import bench_reduce_layouts


def test_rows_cover_every_layout_and_form(tmp_path):
  out = tmp_path / "layouts.json"
  flags = ["--shape", "3x4x5x2", "--runs", "1", "--warmup", "1"]
  returned = bench_reduce_layouts.main([*flags, "--out", str(out)])
  written = json.loads(out.read_text())
  assert written == returned and written["complete"]
  got = {(row["layout"], row["form"]) for row in written["rows"]}
  want = {
      (layout, form)
      for layout in ("per_feature", "per_example")
      for form in bench_reduce_layouts.FORMS
  }
  assert got == want
  assert all(
      math.isfinite(row["ms"]) and row["ms"] > 0 for row in written["rows"]
  )


def test_forms_are_what_they_say():
  x = np.array([-2.0, -0.0, 0.0, 1.5, np.inf, -np.inf], np.float32)
  forms = bench_reduce_layouts.FORMS
  np.testing.assert_array_equal(forms["abs"](x), np.abs(x))
  np.testing.assert_array_equal(forms["select"](x), np.abs(x))
  np.testing.assert_array_equal(forms["square"](x), x * x)


def test_layout_axes():
  assert bench_reduce_layouts.layout_axes("per_feature", 4) == (0, 1, 2)
  assert bench_reduce_layouts.layout_axes("per_example", 4) == (1, 2)
  with pytest.raises(ValueError, match="unknown layout"):
    bench_reduce_layouts.layout_axes("rows", 4)
