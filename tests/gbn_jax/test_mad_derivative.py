"""``mad``'s derivatives against the plain ``jnp.abs`` formula's.

``mad`` differentiates ``|x - E x|`` through its own tangent rule; these
tests hold it to what JAX's rule for ``jnp.abs`` gives, value by value, at
ties, zeros, ``-0.0``, tiny batches and under masks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import deviations
from gbn_jax._selection.reductions import global_mean
from gbn_jax._selection.reductions import prepare_reduction
from gbn_jax.linen import GGroupNorm


def _abs_mad(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  # The formula with jnp.abs differentiated by JAX's own rule.
  x, axes, where = prepare_reduction(x, axis, where, allow_complex=True)
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  centered = x - jnp.expand_dims(mean, axes)
  dev = global_mean(
      jnp.abs(centered), axes, where, axis_name, axis_index_groups
  )
  return mean, dev


def _inputs(kind, shape, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  if kind == "ties":
    x = np.round(x * 2) / 2
  elif kind == "zeros":
    x = np.where(rng.random(shape) < 0.5, np.float32(0), x)
  elif kind == "negative_zeros":
    x = np.where(rng.random(shape) < 0.5, np.float32(-0.0), np.float32(0))
  elif kind == "constant":
    x = np.full(shape, 1.25, np.float32)
  elif kind == "tiny":
    x = (x * np.float32(1e-38)).astype(np.float32)
  return x


_KINDS = ["normal", "ties", "zeros", "negative_zeros", "constant", "tiny"]
_CASES = [
    ((7, 5), 0),
    ((1, 3), 0),
    ((2, 3), 0),
    ((4, 6, 3), (1, 2)),
    ((3, 4, 2, 5), (1, 3)),
]


def _mask(shape, seed):
  mask = np.random.default_rng(seed + 100).random(shape) < 0.7
  mask.reshape(-1)[0] = True
  return mask


def _both(fn, *args):
  return fn(deviations.mad, *args), fn(_abs_mad, *args)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape,axis", _CASES)
@pytest.mark.parametrize("kind", _KINDS)
def test_value_grad_and_jvp_match_abs(kind, shape, axis, masked):
  seed = len(shape) * 10 + _KINDS.index(kind)
  x = jnp.asarray(_inputs(kind, shape, seed))
  where = jnp.asarray(_mask(shape, seed)) if masked else None
  rng = np.random.default_rng(seed + 1)

  def value(measure, v):
    return measure(v, axis, where=where)

  got, want = _both(value, x)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(
        np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32)
    )

  cot = jnp.asarray(rng.standard_normal(want[1].shape).astype(np.float32))
  # The deviation's cotangent alone, and with a zero one (its sign of zero
  # may differ; assert_array_equal holds -0.0 == 0.0).
  for dev_cot in (cot, jnp.zeros_like(cot)):

    def loss(measure, v, dev_cot=dev_cot):
      mean, dev = measure(v, axis, where=where)
      return jnp.sum(mean * 0.5) + jnp.sum(dev * dev_cot)

    got, want = _both(lambda m, v: jax.grad(lambda u: loss(m, u))(v), x)
    np.testing.assert_array_equal(got, want)

  tangent = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  got, want = _both(
      lambda m, v: jax.jvp(lambda u: value(m, u), (v,), (tangent,))[1], x
  )
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("shape,axis", [((6, 3), 0), ((2, 5, 4), (1,))])
def test_second_order_matches_abs(shape, axis):
  # Untied normal values: away from the kink both have the same curvature
  # (that of the mean's dependence on x), which must survive.
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  v = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  w = jnp.asarray(rng.standard_normal(shape).astype(np.float32))

  def scalar(measure, u):
    mean, dev = measure(u * u, axis)
    return jnp.sum(dev * jnp.arange(1, dev.size + 1).reshape(dev.shape)) + (
        jnp.sum(mean**2)
    )

  def hvp(measure, u):
    return jax.jvp(jax.grad(lambda t: scalar(measure, t)), (u,), (v,))[1]

  got, want = _both(hvp, x)
  np.testing.assert_array_equal(got, want)
  got, want = _both(lambda m, u: jax.hessian(lambda t: scalar(m, t))(u), x)
  np.testing.assert_array_equal(got, want)
  # Forward over forward: the tangent rule is itself differentiable.
  got, want = _both(
      lambda m, u: jax.jvp(
          lambda t: jax.jvp(lambda s: scalar(m, s), (t,), (v,))[1], (u,), (w,)
      )[1],
      x,
  )
  np.testing.assert_array_equal(got, want)


def test_complex_input_keeps_the_modulus():
  rng = np.random.default_rng(3)
  x = jnp.asarray(
      (rng.standard_normal((5, 2)) + 1j * rng.standard_normal((5, 2))).astype(
          np.complex64
      )
  )
  got, want = _both(lambda m, v: m(v, 0), x)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  got, want = _both(lambda m, v: jax.grad(lambda u: jnp.sum(m(u, 0)[1]))(v), x)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros"])
def test_group_norm_layer_gradients_match_abs(kind):
  # The grouped (per-example, per-group) layout the layer reduces over.
  x = jnp.asarray(_inputs(kind, (3, 4, 4, 8), 11))
  rng = np.random.default_rng(12)
  cot = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32))
  results = []
  with gbn_jax.registered_measure(
      "mad_with_jnp_abs", _abs_mad, supports_mask=True, pools_devices=True
  ):
    for measure in ("mad", "mad_with_jnp_abs"):
      norm = GGroupNorm(num_groups=2, measure=measure)
      params = norm.init(jax.random.key(0), x)

      def loss(p, v, norm=norm):
        return jnp.sum(norm.apply(p, v) * cot)

      out = norm.apply(params, x)
      grads = jax.grad(loss, argnums=(0, 1))(params, x)
      results.append((out, grads))
  (out, grads), (want_out, want_grads) = results
  np.testing.assert_array_equal(
      np.asarray(out).view(np.uint32), np.asarray(want_out).view(np.uint32)
  )
  jax.tree.map(np.testing.assert_array_equal, grads, want_grads)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("keeps_leading", [False, True])
def test_tangent_convention_at_zero_signed_zero_and_nan(keeps_leading, jit):
  # abs's own rule takes the tangent as it is where x >= 0 (so at -0.0)
  # and negated elsewhere (so at NaN). Both forms of the value (abs, and the
  # select used where the reduction keeps the leading axis) are abs's.
  x = jnp.array(
      [0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0, 1e-45, -1e-45],
      jnp.float32,
  )
  abs_real = lambda v: deviations._abs_real(v, keeps_leading)  # pylint: disable=protected-access
  jvp = lambda f: (lambda v, t: jax.jvp(f, (v,), (t,)))
  got_jvp, want_jvp = jvp(abs_real), jvp(jnp.abs)
  if jit:
    got_jvp, want_jvp = jax.jit(got_jvp), jax.jit(want_jvp)
  # Where XLA treats subnormals as zero (on CPU), the select compares a
  # subnormal as zero and returns 0 - x, flushed to +0.0; the sums it feeds
  # flush them alike (the "tiny" inputs above).
  subnormal = np.abs(np.asarray(x)) < np.finfo(np.float32).tiny
  subnormal &= np.asarray(x) != 0
  for t in (1.5, -1.5, 0.0, -0.0):
    tangent = jnp.full_like(x, t)
    got = got_jvp(x, tangent)
    want = want_jvp(x, tangent)
    if keeps_leading:
      value = np.asarray(got[0])[subnormal]
      assert np.all((value == 0) | (value == np.abs(np.asarray(x)[subnormal])))
      got = (jnp.where(subnormal, want[0], got[0]), got[1])
    for g, w in zip(got, want):
      np.testing.assert_array_equal(
          np.asarray(g).view(np.uint32)[~np.isnan(g)],
          np.asarray(w).view(np.uint32)[~np.isnan(w)],
      )
      np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
