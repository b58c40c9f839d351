"""Every JAX transform flax's BatchNorm takes, for every measure's program.

'sqd' (``alpha`` a field), 'sqd1' and 'sqd3' compile sqd2's program with
another rank (``PROGRAM_MEASURES``): they run only against finite
differences.

The transform matrix, training mode (batch statistics), linen and nnx:

* forward mode (``jvp``, ``jacfwd``, ``linearize``) against reverse mode
  (``vjp``, ``jacrev``) on every path: one device, ``axis_name`` (per-example
  ``vmap``), masks, batch renormalization, calibration and half precision;
* forward mode against central finite differences in float64;
* ``hessian`` (forward over reverse) against reverse over reverse, and the
  Hessian-vector product against finite differences of the gradient;
* ``jit``, ``grad``, ``vmap`` over stacked models, ``remat`` and ``scan``
  over layers against the untransformed computation;
* ``shard_map`` and ``pmap`` against the unsharded call (one device here;
  the four-device form is tests/gbn_jax/test_layer_transforms_multidevice.py);
* for ``sd``, each transform against the same transform of flax's own
  BatchNorm.

Export is tested in tests/gbn_jax/test_export_lowering.py. Measure names come from the
registry.
"""

from __future__ import annotations

import inspect

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import GBatchNorm
import gbn_jax.nnx

from tests.helpers.flax_compat import per_example
from tests.helpers.measures import PROGRAM_MEASURES

MEASURES = sorted(PROGRAM_MEASURES)
FEATURES = 3


def _fields(measure: str) -> dict:
  """``alpha`` for a registered measure that takes one and binds none."""
  spec = gbn_jax.MEASURES[measure]
  takes = inspect.signature(spec.fn).parameters.get("alpha")
  if takes is not None and "alpha" not in dict(spec.params):
    return {"alpha": 0.3}
  return {}


def _batch(n=12, f=FEATURES, seed=0, dtype=jnp.float32):
  # Distinct, well separated values: every order statistic is untied, so the
  # layer is differentiable at x and finite differences apply.
  rng = np.random.default_rng(seed)
  x = rng.permutation(n * f).reshape(n, f) / (n * f) * 4 - 2
  x = x + 0.01 * rng.standard_normal((n, f))
  return jnp.asarray(x, dtype)


def _variables(f=FEATURES, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.key(3))
  return {
      "params": {
          "scale": (1 + 0.5 * jax.random.normal(k1, (f,))).astype(dtype),
          "bias": jax.random.normal(k2, (f,)).astype(dtype),
      },
      "batch_stats": {
          "mean": jnp.full((f,), 0.1, jnp.float32),
          "var": jnp.full((f,), 1.3, jnp.float32),
      },
  }


def _linen(measure, variables=None, mask=None, **kw):
  """``x -> y`` of a linen GBatchNorm in training mode."""
  variables = variables or _variables()
  layer = GBatchNorm(use_running_average=False, measure=measure, **kw)

  def f(x):
    return layer.apply(variables, x, mask=mask, mutable=["batch_stats"])[0]

  return f


def _nnx(measure, mask=None, **kw):
  """``x -> y`` of an nnx GBatchNorm in training mode, as a pure function."""
  layer = gbn_jax.nnx.GBatchNorm(
      FEATURES, measure=measure, rngs=nnx.Rngs(0), **kw
  )
  params = _variables()["params"]
  layer.scale[...], layer.bias[...] = params["scale"], params["bias"]
  return _pure(layer, mask=mask)


def _pure(module, **call_kw):
  """``x -> module(x)`` with the module rebuilt from fresh arrays per trace:
  a module whose variables were made outside a transform can't be mutated
  (its running statistics) inside it."""
  graphdef, state = nnx.split(module)
  return lambda x: nnx.merge(graphdef, jax.tree.map(jnp.asarray, state))(
      x, **call_kw
  )


def _per_example(measure, **kw):
  """The same layer as :func:`_linen`, applied per example under ``vmap``
  with ``axis_name``: the statistics pool the vmapped axis."""
  layer = per_example(GBatchNorm, measure=measure, **kw)
  variables = _variables()
  return lambda x: layer.apply(variables, x, mutable=["batch_stats"])[0]


def _mask(x):
  # A third of each feature's elements masked out, none of the first four.
  rows = np.arange(x.shape[0])[:, None] + np.arange(x.shape[1])
  return jnp.asarray((rows % 3 != 2) | (np.arange(x.shape[0])[:, None] < 4))


def _assert_close(actual, desired, rtol=2e-5):
  actual, desired = np.asarray(actual, np.float64), np.asarray(
      desired, np.float64
  )
  scale = max(float(np.abs(desired).max()), 1e-30)
  np.testing.assert_allclose(actual, desired, rtol=rtol, atol=rtol * scale)


def _check_forward_equals_reverse(f, x, rtol=2e-5):
  """``jacfwd``, ``jvp`` and ``linearize`` against ``jacrev`` and ``vjp``.

  All under one ``jit``: what is compared is the transforms, eager dispatch
  of their many tiny ops is slow, and each compilation has its overhead.
  Each transform traces ``f`` on its own, so one program still holds every
  transform's derivative."""
  v = jax.random.normal(jax.random.key(7), x.shape).astype(x.dtype)
  u = jax.random.normal(jax.random.key(8), x.shape).astype(x.dtype)

  def transforms(a, t, c):
    y, y_dot = jax.jvp(f, (a,), (t,))
    y_lin, f_lin = jax.linearize(f, a)
    return {
        "jacfwd": jax.jacfwd(f)(a),
        "jacrev": jax.jacrev(f)(a),
        "jvp": (y, y_dot),
        "linearize": (y_lin, f_lin(t)),
        "vjp": jax.vjp(f, a)[1](c)[0],
    }

  out = jax.jit(transforms)(x, v, u)
  j_rev = out["jacrev"]
  _assert_close(out["jacfwd"], j_rev, rtol)
  y, y_dot = out["jvp"]
  j = np.asarray(j_rev, np.float64).reshape(y.size, x.size)
  _assert_close(
      y_dot.reshape(-1), j @ np.asarray(v, np.float64).reshape(-1), rtol
  )
  y_lin, lin_v = out["linearize"]
  _assert_close(y_lin, y)
  _assert_close(lin_v, y_dot, rtol)
  # <u, J v> = <J^T u, v>: the transpose JAX derives from the JVP rule.
  vjp_u = out["vjp"]
  as64 = lambda a: np.asarray(a, np.float64).reshape(-1)
  np.testing.assert_allclose(
      as64(u) @ as64(y_dot),
      as64(vjp_u) @ as64(v),
      rtol=50 * rtol,
      atol=50 * rtol * np.abs(as64(y_dot)).max() * np.abs(as64(u)).max(),
  )


# ------------------------------------------------ forward against reverse

PATHS = {
    "one_device": lambda m, x: _linen(m, **_fields(m)),
    "axis_name": lambda m, x: _per_example(m, **_fields(m)),
    "mask": lambda m, x: _linen(m, mask=_mask(x), **_fields(m)),
    "renorm": lambda m, x: _linen(
        m, renorm=True, renorm_clipping={"rmax": 1.5, "dmax": 0.5}, **_fields(m)
    ),
    "calibration": lambda m, x: _linen(m, calibration="normal", **_fields(m)),
    "nnx": lambda m, x: _nnx(m, **_fields(m)),
    "nnx_mask": lambda m, x: _nnx(m, mask=_mask(x), **_fields(m)),
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("measure", MEASURES)
def test_forward_mode_equals_reverse_mode(measure, path):
  x = _batch()
  _check_forward_equals_reverse(PATHS[path](measure, x), x)


@pytest.mark.parametrize("measure", MEASURES)
def test_forward_mode_half_precision(measure):
  # bfloat16 input and parameters, statistics in float32: the JVP's tangent
  # is bfloat16 like the output, so compare at bfloat16's resolution.
  x = _batch(dtype=jnp.bfloat16)
  f = _linen(
      measure,
      _variables(dtype=jnp.bfloat16),
      dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16,
      **_fields(measure),
  )
  assert f(x).dtype == jnp.bfloat16
  _check_forward_equals_reverse(f, x, rtol=2e-2)


@pytest.mark.parametrize("measure", MEASURES)
def test_forward_mode_of_parameters(measure):
  x = _batch()
  variables = _variables()
  layer = GBatchNorm(
      use_running_average=False, measure=measure, **_fields(measure)
  )

  def f(params):
    return layer.apply(
        {**variables, "params": params}, x, mutable=["batch_stats"]
    )[0]

  fwd = jax.jit(jax.jacfwd(f))(variables["params"])
  rev = jax.jit(jax.jacrev(f))(variables["params"])
  jax.tree.map(_assert_close, fwd, rev)


# ------------------------------------------------ finite differences, float64


@pytest.mark.parametrize("measure", sorted(gbn_jax.MEASURES))
def test_forward_mode_equals_finite_differences(measure):
  with jax.enable_x64(True):
    x = _batch(dtype=jnp.float64)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), _variables())
    f = _linen(measure, variables, **_fields(measure))
    v = jax.random.normal(jax.random.key(9), x.shape, jnp.float64)
    _, y_dot = jax.jit(lambda a, t: jax.jvp(f, (a,), (t,)))(x, v)
    h = 1e-6
    f = jax.jit(f)
    fd = (f(x + h * v) - f(x - h * v)) / (2 * h)
    _assert_close(y_dot, fd, rtol=1e-6)


@pytest.mark.parametrize("measure", MEASURES)
def test_hessian(measure):
  w = jax.random.normal(jax.random.key(4), (12, FEATURES))

  def loss_of(f):
    return lambda x: jnp.sum(jnp.sin(f(x)) * w)

  loss = loss_of(_linen(measure, **_fields(measure)))
  x = _batch()
  both = jax.jit(
      lambda a: (jax.hessian(loss)(a), jax.jacrev(jax.jacrev(loss))(a))
  )
  _assert_close(*both(x), rtol=1e-4)
  # float32 on the default path (on a CPU the compiled kernel, whose sums
  # feed sqd) and on the radix select's fused sums, against differences of
  # the gradient: steps far below the gaps between the values.
  v = jax.random.normal(jax.random.key(10), x.shape)
  h = 1e-3
  for method in (None, "accelerator"):
    with gbn_jax.selection.selection_config(method=method):
      grad = jax.jit(jax.grad(loss))
      _, hvp = jax.jvp(grad, (x,), (v,))
      fd = (grad(x + h * v) - grad(x - h * v)) / (2 * h)
    _assert_close(hvp, fd, rtol=2e-2)
  with jax.enable_x64(True):
    x64 = _batch(dtype=jnp.float64)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), _variables())
    loss64 = loss_of(_linen(measure, variables, **_fields(measure)))
    v = jnp.asarray(v, jnp.float64)
    # Hessian-vector product, forward over reverse, against differences of
    # the gradient.
    grad = jax.jit(jax.grad(loss64))
    _, hvp = jax.jit(lambda a, t: jax.jvp(grad, (a,), (t,)))(x64, v)
    h = 1e-6
    fd = (grad(x64 + h * v) - grad(x64 - h * v)) / (2 * h)
    _assert_close(hvp, fd, rtol=1e-5)


# ------------------------------------------------ sd is flax's BatchNorm

_FLAX = {
    "jvp": lambda f, x, v: jax.jvp(f, (x,), (v,))[1],
    "jacfwd": lambda f, x, v: jax.jacfwd(f)(x),
    "jacrev": lambda f, x, v: jax.jacrev(f)(x),
    "linearize": lambda f, x, v: jax.linearize(f, x)[1](v),
    "hessian": lambda f, x, v: jax.hessian(lambda a: jnp.sum(jnp.sin(f(a))))(x),
    "grad": lambda f, x, v: jax.grad(lambda a: jnp.sum(jnp.sin(f(a)) * v))(x),
    "jit": lambda f, x, v: jax.jit(f)(x),
    "remat": lambda f, x, v: jax.grad(
        lambda a: jnp.sum(jnp.sin(jax.checkpoint(f)(a)) * v)
    )(x),
}


def _jit_transform(transform, f, x, v):
  # Both sides under jit: the subject is the transform, not eager dispatch.
  return jax.jit(lambda a, t: _FLAX[transform](f, a, t))(x, v)


@pytest.mark.parametrize("transform", sorted(_FLAX))
def test_sd_transforms_equal_flax_batchnorm(transform):
  x, variables = _batch(), _variables()
  v = jax.random.normal(jax.random.key(5), x.shape)
  flax_layer = nn.BatchNorm(use_running_average=False)
  flax_f = lambda a: flax_layer.apply(variables, a, mutable=["batch_stats"])[0]
  ours = _jit_transform(transform, _linen("sd", variables), x, v)
  _assert_close(ours, _jit_transform(transform, flax_f, x, v), rtol=1e-5)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_sd_transforms_equal_flax_batchnorm_nnx(transform):
  x = _batch()
  v = jax.random.normal(jax.random.key(5), x.shape)
  theirs = nnx.BatchNorm(FEATURES, rngs=nnx.Rngs(0))
  params = _variables()["params"]
  theirs.scale[...], theirs.bias[...] = params["scale"], params["bias"]
  flax_f = _pure(theirs)
  _assert_close(
      _jit_transform(transform, _nnx("sd"), x, v),
      _jit_transform(transform, flax_f, x, v),
      rtol=1e-5,
  )


# ------------------------------------------------ structural transforms


class _Block(nn.Module):
  measure: str
  fields: tuple = ()

  @nn.compact
  def __call__(self, x, _):
    x = nn.Dense(FEATURES)(x)
    x = GBatchNorm(
        use_running_average=False, measure=self.measure, **dict(self.fields)
    )(x)
    return nn.relu(x), None


class _Scanned(nn.Module):
  measure: str
  fields: tuple = ()
  layers: int = 3

  @nn.compact
  def __call__(self, x):
    scanned = nn.scan(
        _Block,
        variable_axes={"params": 0, "batch_stats": 0},
        split_rngs={"params": True},
        length=self.layers,
    )
    return scanned(self.measure, self.fields)(x, None)[0]


class _Unrolled(nn.Module):
  measure: str
  fields: tuple = ()

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = _Block(self.measure, self.fields)(x, None)[0]
    return x


@pytest.mark.parametrize("measure", MEASURES)
@pytest.mark.slow
def test_scan_over_layers_and_remat(measure):
  fields = tuple(_fields(measure).items())
  x = _batch()
  scanned = _Scanned(measure, fields)
  variables = scanned.init(jax.random.key(0), x)
  # The unrolled model with the scanned model's weights, layer by layer.
  only = lambda tree: tree[next(iter(tree))]  # the one scanned submodule
  unrolled_vars = {
      col: {
          f"_Block_{i}": jax.tree.map(lambda a: a[i], only(tree))
          for i in range(3)
      }
      for col, tree in variables.items()
  }
  v = jax.random.normal(jax.random.key(6), x.shape)

  def run(module, variables, remat=False):
    def f(params, a):
      apply = lambda p, a: module.apply(
          {**variables, "params": p}, a, mutable=["batch_stats"]
      )[0]
      if remat:
        apply = jax.checkpoint(apply)
      return apply(params, a)

    loss = lambda p, a: jnp.sum(jnp.sin(f(p, a)) * v)

    # One program for the three: each compilation has its overhead.
    def outputs(p, a):
      y_dot = jax.jvp(lambda b: f(p, b), (a,), (v,))[1]
      return f(p, a), jax.grad(loss, argnums=1)(p, a), y_dot

    return jax.jit(outputs)(variables["params"], x)

  reference = run(_Unrolled(measure, fields), unrolled_vars)
  for got in (
      run(scanned, variables),
      run(scanned, variables, remat=True),
      run(_Unrolled(measure, fields), unrolled_vars, remat=True),
  ):
    for a, b in zip(got, reference):
      _assert_close(a, b, rtol=1e-4)


@pytest.mark.parametrize("measure", MEASURES)
def test_vmap_over_stacked_models(measure):
  x = _batch()
  layer = GBatchNorm(
      use_running_average=False, measure=measure, **_fields(measure)
  )
  stacked = jax.tree.map(
      lambda a: jnp.stack([a, 2 * a + 0.5, -a]), _variables()
  )
  xs = jnp.stack([x, x[::-1] * 1.5, x + 1])

  def apply(variables, a):
    return layer.apply(variables, a, mutable=["batch_stats"])

  def tangent(var, a, t):
    return jax.jvp(lambda b: apply(var, b)[0], (a,), (t,))[1]

  ys, updates = jax.jit(jax.vmap(apply))(stacked, xs)
  v = jax.random.normal(jax.random.key(2), xs.shape)
  y_dots = jax.jit(jax.vmap(tangent))(stacked, xs, v)
  apply, tangent = jax.jit(apply), jax.jit(tangent)
  for i in range(3):
    one = jax.tree.map(lambda a: a[i], stacked)
    y, update = apply(one, xs[i])
    _assert_close(ys[i], y)
    jax.tree.map(lambda a, b: _assert_close(a[i], b), updates, update)
    _assert_close(y_dots[i], tangent(one, xs[i], v[i]))


@pytest.mark.parametrize("measure", MEASURES)
def test_jit_and_grad_equal_eager(measure):
  x = _batch()
  f = _linen(measure, **_fields(measure))
  w = jax.random.normal(jax.random.key(1), x.shape)
  loss = lambda a: jnp.sum(jnp.sin(f(a)) * w)
  _assert_close(jax.jit(f)(x), f(x))
  _assert_close(jax.jit(jax.grad(loss))(x), jax.grad(loss)(x))
  _assert_close(
      jax.jit(lambda a, t: jax.jvp(f, (a,), (t,))[1])(x, w),
      jax.jvp(f, (x,), (w,))[1],
  )


@pytest.mark.parametrize("measure", MEASURES)
@pytest.mark.slow
def test_shard_map_and_pmap(measure):
  # The statistics pooled over a named axis: under shard_map and pmap the
  # layer (with axis_name) must equal the plain call, forward and both
  # derivatives. One device here; four in test_layer_transforms_multidevice.py.
  x = _batch()
  variables = _variables()
  fields = _fields(measure)
  named = GBatchNorm(
      use_running_average=False, measure=measure, axis_name="d", **fields
  )
  plain = _linen(measure, variables, **fields)
  f_named = lambda a: named.apply(variables, a, mutable=["batch_stats"])[0]
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  sharded = jax.shard_map(f_named, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  pmapped = lambda a: jax.pmap(f_named, axis_name="d")(a[None])[0]
  v = jax.random.normal(jax.random.key(3), x.shape)
  loss = lambda g: lambda a: jnp.sum(jnp.sin(g(a)) * v)
  jvp = lambda g: lambda a: jax.jvp(g, (a,), (v,))[1]
  want = (
      jax.jit(plain)(x),
      jax.jit(jvp(plain))(x),
      jax.jit(jax.grad(loss(plain)))(x),
  )
  for g, under_jit in ((sharded, jax.jit), (pmapped, lambda h: h)):
    _assert_close(under_jit(g)(x), want[0])
    _assert_close(under_jit(jvp(g))(x), want[1])
    _assert_close(under_jit(jax.grad(loss(g)))(x), want[2])


@pytest.mark.parametrize("measure", ["sqd2", "rsd", "sd"])
def test_forward_mode_large_batch(measure):
  # Past 16384 rows the native kernel's sampled sweep (and its fused sums for
  # sqd) serves the selection on a CPU: forward mode goes through it too.
  x = jax.random.normal(jax.random.key(0), (20000, 2))
  f = _linen(measure, _variables(2))
  v = jax.random.normal(jax.random.key(1), x.shape)
  u = jax.random.normal(jax.random.key(2), x.shape)
  y_dot = jax.jit(lambda a, t: jax.jvp(f, (a,), (t,))[1])(x, v)
  (vjp_u,) = jax.jit(lambda a, c: jax.vjp(f, a)[1](c))(x, u)
  as64 = lambda a: np.asarray(a, np.float64).reshape(-1)
  lhs, rhs = as64(u) @ as64(y_dot), as64(vjp_u) @ as64(v)
  np.testing.assert_allclose(lhs, rhs, rtol=1e-3)


@pytest.mark.parametrize("measure", ["sd", "sqd2", "rbd"])
def test_export_of_derivatives(measure):
  # jvp, grad and a Hessian-vector product of a layer, exported for a CPU
  # and a GPU at once (the CPU's compiled kernels need the disabled checks)
  # and for a GPU alone (no CPU kernel in it): the CPU artifact computes
  # what the jitted function does. tests/gbn_jax/test_export_lowering.py has the rest.
  x = _batch()
  f = _linen(measure, **_fields(measure))
  loss = lambda a, t: jnp.sum(jnp.sin(f(a)) * t)
  programs = {
      "jvp": lambda a, t: jax.jvp(f, (a,), (t,))[1],
      "grad": jax.grad(loss),
      "hvp": lambda a, t: jax.jvp(lambda b: jax.grad(loss)(b, t), (a,), (t,))[
          1
      ],
  }
  v = jax.random.normal(jax.random.key(11), x.shape)
  for name, program in programs.items():
    both = jax.export.export(
        jax.jit(program),
        platforms=["cpu", "cuda"],
        disabled_checks=gbn_jax.export_disabled_checks(),
    )(x, v)
    _assert_close(both.call(x, v), jax.jit(program)(x, v), rtol=1e-6)
    gpu = jax.export.export(jax.jit(program), platforms=["cuda"])(x, v)
    assert "gbn_kth" not in gpu.mlir_module(), name
