"""Gradients of the quantile measures for bfloat16 and float16 inputs.

The selection behind a quantile runs in float32 whatever the input's dtype, so
with ``force_float32_reductions=False`` the quantile's custom JVP
(``quantiles._tie_split``) sees a half-precision input but returns a float32
value; its tangent must be float32 too, or JAX rejects the rule (and the layer
cannot even be initialized, since its forward pass linearizes the measure).

Each low-precision gradient is checked against the same computation done in
float32 on the input rounded to the low precision, written here in plain JAX
(the order statistic located with the numpy definitions of ``reference.py``,
no fused backward pass, nothing of gbn_jax's arithmetic) and differentiated by
autodiff, so that a wrong gradient fails as well as a mistyped one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
import gbn_jax.nnx as gnnx

from tests.helpers import reference as ref

# The sqd family at several levels: every measure built on a quantile.
QUANTILE_MEASURES = ["sqd1", "sqd2", "sqd3", "sqd:0.3", "sqd:0.9"]
# Built on max/min, differentiated by the same custom JVP as the quantile.
EXTREME_MEASURES = ["rbd", "wcd"]
DTYPES = [jnp.bfloat16, jnp.float16]
SHAPE = (64, 8)
EPSILON = 1e-5  # GBatchNorm's default


def _tolerance(dtype: Any) -> float:
  """Relative error allowed for the norm of a gradient computed in ``dtype``.

  With ``force_float32_reductions=False`` the statistics ``S`` and ``D^2``,
  the output cotangent and ``x - S`` are each rounded to ``dtype`` before the
  backward pass combines them, so a few roundings of relative size
  ``eps = finfo(dtype).eps`` (2**-7 for bfloat16, 2**-10 for float16) reach
  the gradient; the errors measured here stay below ``eps`` (at most 6.2e-3
  for bfloat16, 8.8e-4 for float16). ``2.5 eps`` (bfloat16: 2e-2, float16:
  2.4e-3) leaves room for other backends' rounding, while a wrong gradient is
  off by far more: with the quantile's tangent dropped or doubled, or not
  split among ties (bfloat16 rounding makes ties), the errors were 8e-2 to 1.
  """
  return 2.5 * float(jnp.finfo(dtype).eps)


def _parse(name: str) -> tuple[str, float | None]:
  """``'sqd:0.3'`` -> ``('sqd', 0.3)``; a plain name -> ``(name, None)``."""
  measure, params = gbn_jax.parse_measure_name(name)
  return measure, params.get("alpha")


def _measure(name: str) -> gbn_jax.Measure:
  """The registered measure ``name`` (``'sqd:0.3'``: ``sqd`` at 0.3)."""
  measure, alpha = _parse(name)
  params = {} if alpha is None else {"alpha": alpha}
  return gbn_jax.get_measure(measure, **params)


def _inputs(
    dtype: Any, masked: bool
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """``(x, mask, w)``: ``x`` in ``dtype``, a mask or None, float32 weights."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(SHAPE) * 1.5 + 0.3, dtype)
  mask = jnp.asarray(rng.random(SHAPE) < 0.7) if masked else None
  w = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  return x, mask, w


def _params() -> dict[str, jax.Array]:
  """Non-trivial float32 scale and bias, so that their gradients are tested."""
  ramp = jnp.linspace(-0.5, 0.5, SHAPE[-1], dtype=jnp.float32)
  return {"scale": 1.0 + ramp, "bias": 0.3 * ramp}


def _relative_error(got: jax.Array, want: jax.Array) -> float:
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _reference_measure(
    name: str, x: jax.Array, mask: jax.Array | None
) -> Callable[[jax.Array], tuple[jax.Array, jax.Array]]:
  """``(S, D)`` of ``name`` near ``x``, as a plain float32 function.

  The order statistic is located with the numpy definitions of
  ``reference.py`` and differentiated by the documented rule (its tangent is
  the mean tangent of the elements equal to it) by writing it as that mean.
  """
  # Only the definition (which function, which alpha) from the registry.
  bound = _measure(name)
  measure, alpha = bound.fn.__name__, dict(bound.params).get("alpha")
  x64 = np.asarray(x, np.float64)
  mask64 = None if mask is None else np.asarray(mask)
  if measure == "sqd":
    (selected,) = ref.per_feature(
        lambda r: (ref.quantile_1d(r, alpha),), x64, (0,), mask64
    )
  else:
    hi_value, lo_value = ref.per_feature(
        lambda r: (r.max(), r.min()), x64, (0,), mask64
    )
  keep = jnp.ones(x.shape, bool) if mask is None else mask

  def fn(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    v = v.astype(jnp.float32)
    count = jnp.sum(keep, 0)
    mean = jnp.sum(jnp.where(keep, v, 0), 0) / count

    def tied_mean(value: np.ndarray) -> jax.Array:
      hit = keep & (v == jnp.asarray(value, jnp.float32))
      return jnp.sum(jnp.where(hit, v, 0), 0) / jnp.sum(hit, 0)

    if measure == "sqd":
      q = tied_mean(selected)
      excess = jnp.where(keep & (v > q), v - q, 0)
      return q, q + jnp.sum(excess, 0) / count / (1 - alpha) - mean
    hi = tied_mean(hi_value)
    if measure == "wcd":
      return hi, hi - mean
    lo = tied_mean(lo_value)
    return (hi + lo) / 2, hi - lo

  return fn


def _reference_grads(
    name: str,
    x: jax.Array,
    mask: jax.Array | None,
    w: jax.Array,
    params: dict[str, jax.Array],
) -> tuple[dict[str, jax.Array], jax.Array]:
  """Gradients of ``vdot(w, layer(x))`` in float32, at ``x`` as rounded."""
  measure = _reference_measure(name, x, mask)

  def loss(p, v):
    s, d = measure(v)
    y = (v - s) * jax.lax.rsqrt(jnp.square(d) + EPSILON)
    return jnp.vdot(w, y * p["scale"] + p["bias"])

  return jax.grad(loss, argnums=(0, 1))(params, x.astype(jnp.float32))


def _linen_layer(
    name: str, force_float32_reductions: bool
) -> gbn_jax.GBatchNorm:
  measure, alpha = _parse(name)
  return gbn_jax.GBatchNorm(
      use_running_average=False,
      measure=measure,
      alpha=alpha,
      force_float32_reductions=force_float32_reductions,
  )


def _assert_grads(
    grads: tuple[dict[str, jax.Array], jax.Array],
    x: jax.Array,
    params: dict[str, jax.Array],
) -> None:
  """Finite, input gradient of ``x``'s dtype, parameter gradients of theirs."""
  grad_params, grad_x = grads
  assert grad_x.dtype == x.dtype
  for key, value in params.items():
    assert grad_params[key].dtype == value.dtype, key
  for leaf in jax.tree.leaves(grads):
    assert np.isfinite(np.asarray(leaf, np.float32)).all()


# (force_float32_reductions, masked): a mask only where the statistics are
# reduced in the input's dtype, the case the bug was in (each configuration
# costs seconds of op-by-op compilation; float32 with a mask is tested in
# test_linen.py).
@pytest.mark.parametrize(
    "force_float32_reductions,masked",
    [(True, False), (False, False), (False, True)],
    ids=["f32red", "lowred", "lowred-masked"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", QUANTILE_MEASURES)
def test_linen_gradients(name, dtype, force_float32_reductions, masked):
  layer = _linen_layer(name, force_float32_reductions)
  x, mask, w = _inputs(dtype, masked)
  # The reported reproduction: it failed in init already, then in grad.
  variables = layer.init(jax.random.key(1), x, mask=mask)
  apply = lambda p, inp: layer.apply(
      {**variables, "params": p}, inp, mask=mask, mutable=["batch_stats"]
  )[0]
  params = variables["params"]
  repro_loss = lambda p, inp: jnp.sum(apply(p, inp).astype(jnp.float32) ** 2)
  _assert_grads(jax.grad(repro_loss, argnums=(0, 1))(params, x), x, params)

  # Values: a generic linear loss (the squared one is nearly flat for a
  # normalized output, its gradient a cancellation) at non-trivial parameters.
  params = _params()
  loss = lambda p, inp: jnp.vdot(w, apply(p, inp).astype(jnp.float32))
  got = jax.grad(loss, argnums=(0, 1))(params, x)
  _assert_grads(got, x, params)
  want = _reference_grads(name, x, mask, w, params)
  tol = _tolerance(dtype)
  for label, a, b in (
      ("x", got[1], want[1]),
      ("scale", got[0]["scale"], want[0]["scale"]),
      ("bias", got[0]["bias"], want[0]["bias"]),
  ):
    err = _relative_error(a, b)
    assert err < tol, f"{label}: relative error {err:.2e} >= {tol:.2e}"


@pytest.mark.parametrize(
    "layer_dtype", [None, jnp.bfloat16], ids=["dtype_none", "dtype_bf16"]
)
@pytest.mark.parametrize("name", ["sqd2", "sqd:0.3"])
def test_nnx_gradients(name, layer_dtype):
  measure, alpha = _parse(name)
  dtype = jnp.bfloat16
  x, mask, w = _inputs(dtype, masked=True)
  layer = gnnx.GBatchNorm(
      SHAPE[-1],
      measure=measure,
      alpha=alpha,
      dtype=layer_dtype,
      rngs=nnx.Rngs(0),
  )
  params = _params()
  layer.scale[...] = params["scale"]
  layer.bias[...] = params["bias"]

  def loss(model, inp):
    return jnp.vdot(w, model(inp, mask=mask).astype(jnp.float32))

  grad_model, grad_x = nnx.grad(loss, argnums=(0, 1))(layer, x)
  got = ({"scale": grad_model.scale[...], "bias": grad_model.bias[...]}, grad_x)
  _assert_grads(got, x, params)
  want = _reference_grads(name, x, mask, w, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _relative_error(a, b) < _tolerance(dtype)


@pytest.mark.parametrize(
    "name,dtype,masked",
    [
        (name, dtype, masked)
        for name in QUANTILE_MEASURES
        for dtype in DTYPES
        for masked in (False, True)
    ]
    # max/min share the custom JVP; their selection keeps the input's dtype.
    + [(name, jnp.bfloat16, True) for name in EXTREME_MEASURES],
    ids=lambda v: getattr(v, "__name__", None) or str(v),
)
def test_measure_jvp_and_vjp(name, dtype, masked):
  # The measures themselves, on half-precision input (what the layers pass
  # them with force_float32_reductions=False): forward and reverse mode.
  fn = _measure(name)
  x, mask, w = _inputs(dtype, masked)
  reduction = {} if mask is None else {"where": mask}
  tangent = w.astype(dtype)
  f = lambda v: fn(v, 0, **reduction)

  primals, tangents = jax.jvp(f, (x,), (tangent,))
  for p, t in zip(primals, tangents):
    assert t.dtype == p.dtype
  want_primals, want_tangents = jax.jvp(
      _reference_measure(name, x, mask),
      (x.astype(jnp.float32),),
      (tangent.astype(jnp.float32),),
  )
  for a, b in zip(tangents, want_tangents):
    assert _relative_error(a, b) < _tolerance(dtype)
  for a, b in zip(primals, want_primals):
    assert _relative_error(a, b) < _tolerance(dtype)

  out, pullback = jax.vjp(f, x)
  cotangent = tuple(
      jnp.linspace(-1.0, 2.0, o.size).reshape(o.shape).astype(o.dtype)
      for o in out
  )
  (grad_x,) = pullback(cotangent)
  assert grad_x.dtype == x.dtype
  # The VJP transposes the JVP checked above: <c, J t> = <J^T c, t>, to the
  # rounding of J^T c to the input's dtype.
  as64 = lambda a: np.asarray(a, np.float64).ravel()
  forward = sum(np.dot(as64(c), as64(t)) for c, t in zip(cotangent, tangents))
  backward = np.dot(as64(grad_x), as64(tangent))
  scale = np.dot(np.abs(as64(grad_x)), np.abs(as64(tangent)))
  assert abs(forward - backward) < _tolerance(dtype) * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("kind", ["quantile", "superquantile"])
def test_functional_api_grads(kind, dtype):
  # The public functions select in float32 and return the input's dtype.
  fn = getattr(gbn_jax, kind)
  x, mask, w = _inputs(dtype, masked=True)
  f = lambda v: fn(v, 0.3, axis=0, where=mask)
  value, tangent = jax.jvp(f, (x,), (w.astype(dtype),))
  assert value.dtype == tangent.dtype == dtype
  grad_x = jax.grad(lambda v: jnp.vdot(w[0], f(v).astype(jnp.float32)))(x)
  assert grad_x.dtype == dtype

  measure = _reference_measure("sqd:0.3", x, mask)

  def want_f(v):
    q, deviation = measure(v)
    if kind == "quantile":
      return q
    return deviation + jnp.sum(jnp.where(mask, v, 0), 0) / jnp.sum(mask, 0)

  want = jax.grad(lambda v: jnp.vdot(w[0], want_f(v)))(x.astype(jnp.float32))
  assert _relative_error(grad_x, want) < _tolerance(dtype)
