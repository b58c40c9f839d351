"""One trace, one lowering per platform: export for CPU, GPUs and TPUs from here.

The selection picks its backend per lowering (``lax.platform_dependent``),
not per process: a GPU or TPU lowering made on this CPU holds none of the
CPU-only kernels, a CPU lowering keeps them (and its speed), and a forced
method that cannot run says so. Plus the warning for a compiled extension
that is found but does not load.
"""

from __future__ import annotations

import json
import math
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax._selection import dispatch
from gbn_jax._selection import native

from tests.helpers import reference as ref
from tests.helpers.process import run_python

needs_native = pytest.mark.skipif(
    not native.available(), reason="C++ selection kernel not built"
)
try:
  import flatbuffers  # pylint: disable=unused-import  # noqa: F401

  _SERIALIZABLE = True
except ImportError:  # jax.export's (de)serialization needs it
  _SERIALIZABLE = False
needs_serialization = pytest.mark.skipif(
    not _SERIALIZABLE, reason="flatbuffers (jax.export serialization) absent"
)

# 80 * 16 * 16 = 20480 rows: above the native kernel's sampled-bracket
# threshold and the pure-JAX default's adaptive one.
SHAPE = (80, 16, 16, 4)
AXES = (0, 1, 2)
ACCELERATORS = ("cuda", "rocm", "tpu")
_TARGET = re.compile(r"gbn_(kth|conv)_\w+")


def _data() -> np.ndarray:
  # ReLU-like: heavy ties at zero, where the tie counts matter.
  return ref.relu_like(np.random.default_rng(0), SHAPE) - 0.25


def _train_step():
  """A GBatchNorm (sqd2) train step: outputs, batch stats and gradients."""
  model = gbn_jax.GBatchNorm(use_running_average=False, measure="sqd2")
  variables = model.init(jax.random.key(0), jnp.zeros(SHAPE, jnp.float32))

  def step(params, stats, x):
    def loss(params, x):
      y, updates = model.apply(
          {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
      )
      weights = jnp.arange(1.0, 1.0 + SHAPE[-1])
      return jnp.sum(jnp.maximum(y, 0) * weights) / y.size, (y, updates)

    (_, (y, updates)), grads = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True
    )(params, x)
    return y, updates["batch_stats"], grads

  return jax.jit(step), (variables["params"], variables["batch_stats"])


def _export(platforms, disabled_checks=()):
  step, (params, stats) = _train_step()
  x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
  return jax.export.export(
      step, platforms=platforms, disabled_checks=list(disabled_checks)
  )(params, stats, x)


@pytest.mark.parametrize(
    "platforms", [[p] for p in ACCELERATORS] + [["cuda", "rocm", "tpu"]]
)
def test_accelerator_lowerings_hold_no_cpu_kernel(platforms):
  # No flags: nothing in these modules needs a disabled safety check.
  exported = _export(platforms)
  assert exported.platforms == tuple(platforms)
  text = exported.mlir_module()
  assert not _TARGET.search(text), _TARGET.search(text).group(0)
  # The selection is in there (its sorts), not left out altogether.
  assert "stablehlo.sort" in text


@needs_native
def test_cpu_lowering_keeps_the_native_kernel_and_needs_the_checks():
  with pytest.raises(ValueError, match="gbn_kth_smallest"):
    _export(["cpu"])
  text = _export(["cpu"], gbn_jax.export_disabled_checks()).mlir_module()
  assert "gbn_kth_smallest_sums_f32" in text


@needs_native
def test_plain_cpu_jit_compiles_only_the_cpu_branch():
  # A single-platform lowering keeps one branch and XLA inlines it: the CPU
  # runs the native kernel, with no conditional on the platform left.
  step, (params, stats) = _train_step()
  x = jnp.asarray(_data())
  hlo = step.lower(params, stats, x).compile().as_text()
  assert "gbn_kth_smallest_sums_f32" in hlo
  assert "conditional" not in hlo


def _numpy_sqd2(x):
  """Per feature ``(q_0.5, qbar_0.5 - mean)`` from the definitions (float64)."""
  cols = np.moveaxis(np.asarray(x, np.float64), -1, 0).reshape(x.shape[-1], -1)
  n = cols.shape[1]
  q = np.sort(cols, axis=1)[:, math.ceil(0.5 * n) - 1]
  d = [ref.superquantile_1d(c, 0.5) - c.mean() for c in cols]
  return q, np.asarray(d)


@pytest.mark.parametrize("platforms", [["cpu"], ["cpu", "cuda"]])
def test_cpu_export_round_trip_matches_jit_and_numpy(platforms):
  step, (params, stats) = _train_step()
  x = jnp.asarray(_data())
  # On the CPU device, whatever the default backend: a CPU-only export
  # cannot run anywhere else.
  params, stats, x = jax.device_put((params, stats, x), jax.devices("cpu")[0])
  exported = _export(platforms, gbn_jax.export_disabled_checks())
  assert ("gbn_kth" in exported.mlir_module()) == native.available()
  if _SERIALIZABLE:
    exported = jax.export.deserialize(exported.serialize())
  got = exported.call(params, stats, x)
  want = step(params, stats, x)
  jax.tree.map(
      lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7),
      got,
      want,
  )
  q, d = _numpy_sqd2(_data())
  np.testing.assert_allclose(
      got[0], ref.normalize(_data(), q, d, AXES), rtol=1e-4, atol=1e-4
  )


_FRESH_PROCESS = textwrap.dedent("""
    import sys, jax, numpy as np, gbn_jax
    assert gbn_jax.register_native_kernels()
    exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    x = np.load(sys.argv[2])
    print(float(np.asarray(exported.call(x)).sum()))
""")


@needs_native
@needs_serialization
def test_cpu_export_runs_in_a_fresh_process(tmp_path):
  # There nothing traced registers the kernels: register_native_kernels does.
  def f(x):
    return gbn_jax.superquantile(x, 0.5, axis=0)

  x = _data().reshape(-1, SHAPE[-1])
  exported = jax.export.export(
      jax.jit(f),
      platforms=["cpu"],
      disabled_checks=gbn_jax.export_disabled_checks(),
  )(jax.ShapeDtypeStruct(x.shape, jnp.float32))
  assert "gbn_kth" in exported.mlir_module()
  (tmp_path / "f.bin").write_bytes(exported.serialize())
  np.save(tmp_path / "x.npy", x)
  out = run_python(
      _FRESH_PROCESS, args=[str(tmp_path / "f.bin"), str(tmp_path / "x.npy")]
  )
  want = sum(ref.superquantile_1d(c, 0.5) for c in x.T)
  assert float(out) == pytest.approx(want, rel=1e-5)


def test_disabled_checks_name_every_compiled_target():
  # The library's kernel only: the training suite's convolutions list their
  # own (train.native.convolution.export_disabled_checks).
  checks = gbn_jax.export_disabled_checks()
  assert len(checks) == len(native.TARGETS) == 2
  for target, check in zip(native.TARGETS, checks):
    assert check == jax.export.DisabledSafetyCheck.custom_call(target)


# --- methods forced per platform ----------------------------------------


def test_forced_native_with_axis_name_raises():
  x = jnp.ones((8, 2))
  with pytest.raises(ValueError, match="axis_name='b'"):
    dispatch.kth_smallest(x, 1, (0,), axis_name="b", method="native")
  with gbn_jax.selection.selection_config(method="native"):
    with pytest.raises(ValueError, match="cannot pool"):
      jax.pmap(
          lambda v: gbn_jax.quantile(v, 0.5, axis=0, axis_name="b"),
          axis_name="b",
      )(x[None])


def test_forced_native_without_the_kernel_raises(monkeypatch):
  monkeypatch.setattr(native, "available", lambda: False)
  with pytest.raises(ValueError, match="not built"):
    dispatch.kth_smallest(jnp.ones((8, 2)), 1, (0,), method="native")


@needs_native
def test_forced_native_runs_on_the_cpu_and_the_default_elsewhere():
  # Documented: a lowering for several platforms runs the kernel on the CPU
  # and each other platform's default method there.
  x = _data().reshape(-1, SHAPE[-1])
  f = jax.jit(lambda v: dispatch.kth_smallest(v, 777, (0,), method="native"))
  spec = jax.ShapeDtypeStruct(x.shape, jnp.float32)
  checks = gbn_jax.export_disabled_checks()
  both = jax.export.export(f, platforms=["cpu", "cuda"], disabled_checks=checks)
  assert "gbn_kth_smallest_f32" in both(spec).mlir_module()
  assert (
      "gbn_kth"
      not in jax.export.export(f, platforms=["cuda"])(spec).mlir_module()
  )
  np.testing.assert_array_equal(
      both(spec).call(x), np.sort(x, axis=0)[776] + 0.0
  )


# --- a compiled extension that does not load ----------------------------

_BROKEN = textwrap.dedent("""
    import json, sys, warnings
    from gbn_jax._selection import native
    native.library_path = lambda: sys.argv[1]
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      loaded = [native.available(), native.available()]
    print(json.dumps({"loaded": loaded, "warnings": [
        [w.category.__name__, str(w.message)] for w in caught]}))
""")


def test_a_broken_extension_warns_once_naming_path_and_error(tmp_path):
  bogus = tmp_path / "_kth_cpu.so"
  bogus.write_bytes(b"")  # found, but not a shared object
  out = json.loads(
      run_python(_BROKEN, args=[str(bogus)], drop=[native.LIBRARY_ENV])
  )
  assert out["loaded"] == [False] * 2
  assert len(out["warnings"]) == 1, out  # once, however often it is asked
  ((category, message),) = out["warnings"]
  assert category == "RuntimeWarning"
  assert "selection kernel" in message and str(bogus) in message
  assert "not load (" in message and "too short" in message  # dlopen's error
