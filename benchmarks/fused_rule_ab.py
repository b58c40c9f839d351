"""The fused normalization rule's reverse mode: its former ``custom_vjp`` against today's JVP.

Issue 37 rewrote ``gbn_jax._normalization._fused_normalize`` as a
``jax.custom_jvp`` so that forward mode works; JAX transposes the JVP for
reverse mode. This times ``jit(grad)`` of both rules, the former one written
out below as it was (commit d27618c), in one process, interleaved, median
after warm-up, and prints the largest difference of their gradients::

  python -m benchmarks.fused_rule_ab sd,mad,rsd,sqd2 256x32x32x16,512x256 15

Arguments: measures, shapes (features last), timed runs.
"""

import functools
import statistics
import sys
import time

import jax
from jax import lax
import jax.numpy as jnp

from gbn_jax import _normalization


def _fused_forward(measure, reduction, x, scale, bias, mask):
  stats = lambda v: _normalization.batch_statistics(measure, v, mask, reduction)
  (statistic, deviation_sq), stats_vjp = jax.vjp(stats, x)
  y = _normalization.normalize(
      x, statistic, deviation_sq, scale, bias, reduction
  )
  return (y, statistic, deviation_sq), stats_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def old(measure, reduction, x, scale, bias, mask):
  return _fused_forward(measure, reduction, x, scale, bias, mask)[0]


def old_fwd(measure, reduction, x, scale, bias, mask):
  out, stats_vjp = _fused_forward(measure, reduction, x, scale, bias, mask)
  _, statistic, deviation_sq = out
  return out, (x, statistic, deviation_sq, scale, bias, mask, stats_vjp)


def old_bwd(measure, reduction, residuals, cotangents):
  x, statistic, deviation_sq, scale, bias, mask, stats_vjp = residuals
  g, g_statistic, g_deviation_sq = cotangents
  axes = reduction.reduction_axes
  expand = lambda v: jnp.expand_dims(v, axes)
  r = lax.rsqrt(deviation_sq + reduction.epsilon)
  g = g.astype(statistic.dtype)
  xhat = (x - expand(statistic)) * expand(r)
  sum_g = jnp.sum(g, axes)
  sum_g_xhat = jnp.sum(g * xhat, axes)
  gain = r if scale is None else r * scale.astype(r.dtype)
  g_statistic = g_statistic - gain * sum_g
  g_deviation_sq = g_deviation_sq - 0.5 * r * gain * sum_g_xhat
  (dx_stats,) = stats_vjp((g_statistic, g_deviation_sq))
  dx = (g * expand(gain) + dx_stats).astype(x.dtype)
  return (
      dx,
      None if scale is None else sum_g_xhat.astype(scale.dtype),
      None if bias is None else sum_g.astype(bias.dtype),
      None,
  )


old.defvjp(old_fwd, old_bwd)


def step_fn(rule, measure, red):
  def loss(x, scale, bias):
    y, s, d = rule(measure, red, x, scale, bias, None)
    return jnp.sum(y * y) + 0.0 * jnp.sum(s)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main(argv: list[str]) -> None:
  shapes = [tuple(int(v) for v in s.split('x')) for s in argv[1].split(',')]
  runs = int(argv[2]) if len(argv) > 2 else 30
  for shape in shapes:
    x = jax.random.normal(jax.random.key(0), shape)
    F = shape[-1]
    red = _normalization.Reduction(
        tuple(range(len(shape) - 1)), (len(shape) - 1,), None, 1e-5
    )
    for name in argv[0].split(','):
      m = _normalization.bind_measure(name, None, True)
      fs = {
          'old': step_fn(old, m, red),
          'new': step_fn(_normalization._fused_normalize, m, red),
      }
      args = (x, jnp.ones(F), jnp.zeros(F))
      outs = {k: f(*args) for k, f in fs.items()}
      err = max(
          float(jnp.max(jnp.abs(a - b)))
          for a, b in zip(
              jax.tree.leaves(outs['old']), jax.tree.leaves(outs['new'])
          )
      )
      for _ in range(3):
        for f in fs.values():
          jax.block_until_ready(f(*args))
      t = {k: [] for k in fs}
      for _ in range(runs):
        for k, f in fs.items():
          t0 = time.perf_counter()
          jax.block_until_ready(f(*args))
          t[k].append(time.perf_counter() - t0)
      mo, mn = (statistics.median(t[k]) * 1e3 for k in ('old', 'new'))
      print(
          f"{'x'.join(map(str, shape)):>16} {name:>5} old {mo:8.2f} ms new {mn:8.2f} ms new/old {mn/mo:5.2f} maxdiff {err:.2e}",
          flush=True,
      )


if __name__ == '__main__':
  main(sys.argv[1:])
