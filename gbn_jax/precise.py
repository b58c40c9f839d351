"""Precise batch statistics (PreciseBN, Wu & Johnson 2021).

The running averages that batch normalization layers keep are exponential
moving averages taken while the parameters changed, dominated by the last few
batches. :func:`precise_batch_stats` replaces them by equal-weight averages
over many batches with the parameters frozen. It works on the variables
pytree and a training-mode ``model_apply``, for :class:`gbn_jax.GBatchNorm`
(any measure) and ``flax.linen.BatchNorm`` layers alike: every leaf named
``mean`` or ``var`` in ``batch_stats`` is taken as a norm layer's running
``S`` or ``D^2``. ``gbn_jax.nnx.precise_batch_stats`` does the same for an
nnx model, in place, on the framework-free core
:func:`average_batch_statistics`.

In training mode every layer normalizes with its own batch's statistics, so
one pass over the batches serves all layers. Each layer's batch statistic
``s`` is backed out of its running-average update ``new = m * old + (1 - m) *
s``, whose momentum ``m`` this module does not need to be told (see
:func:`precise_batch_stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection.common import varying_axes

__all__ = ["precise_batch_stats"]

Array = jax.Array
PyTree = Any

STATISTIC_NAMES = ("mean", "var")

# Decimal places tried when recovering the momentum the layer was given.
_MAX_DIGITS = 7


def _key_name(entry: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _path(path: tuple[Any, ...]) -> tuple[str, ...]:
  return tuple(_key_name(entry) for entry in path)


def _statistic_paths(batch_stats: PyTree) -> list[tuple[str, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(batch_stats)[0]
  return [_path(p) for p, _ in leaves if _key_name(p[-1]) in STATISTIC_NAMES]


def _pick(tree: PyTree, paths: list[tuple[str, ...]]) -> list[Array]:
  """The leaves of ``tree`` at ``paths`` (dict or FrozenDict alike)."""
  found = {
      _path(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
  }
  missing = [p for p in paths if p not in found]
  if missing:
    raise ValueError(
        "model_apply did not update the running statistics "
        + ", ".join("/".join(p) for p in missing)
        + "; is the model in training mode, with mutable=['batch_stats']?"
    )
  return [found[p] for p in paths]


def _replace(
    tree: PyTree, paths: list[tuple[str, ...]], values: list[Array]
) -> PyTree:
  """``tree`` with the leaves at ``paths`` replaced by ``values``."""
  new = dict(zip(paths, values))
  return jax.tree_util.tree_map_with_path(
      lambda p, leaf: new.get(_path(p), leaf), tree
  )


def _probe(dtype: Any) -> float:
  """A power of two ``B`` for which ``fl(m B + c s) = m B`` in practice.

  ``m B`` is exact (a power of two), and its rounding unit, about ``m B *
  2^-24`` in float32 (``B = 2^64``), swallows any realistic ``c s``.
  """
  return 2.0 ** (jnp.finfo(dtype).maxexp // 2)


def _complement(momentum: Array) -> Array:
  """``1 - m`` as the layer computed it, from ``m`` rounded to its dtype.

  Layers compute ``1 - momentum`` from a Python float and round it to the
  statistics' dtype once; the update only shows ``fl(m)``. When ``fl(m)`` is
  the rounding of a decimal with up to 7 places (0.9, 0.99, 0.999, 0.9997),
  that decimal is taken for ``m``, giving ``1 - m`` exactly as the layer's
  ``fl(1 - m)``: ``(10^k - n) / 10^k`` is one correctly rounded division of
  exact integers. Otherwise, and for float64 statistics (where ``fl(m)`` is
  ``m``), ``1 - fl(m)``.
  """
  dtype = momentum.dtype
  if jnp.finfo(dtype).bits >= 64:
    return 1 - momentum
  m = momentum.astype(jnp.float32)
  complement = 1 - m
  found = jnp.zeros(m.shape, bool)
  for digits in range(1, _MAX_DIGITS + 1):
    scale = np.float32(10.0**digits)
    numerator = jnp.round(m * scale)
    hit = ~found & ((numerator / scale).astype(dtype) == momentum)
    complement = jnp.where(hit, (scale - numerator) / scale, complement)
    found = found | hit
  return complement.astype(dtype)


def _same_outputs(a: PyTree, b: PyTree) -> Array:
  """Whether two training-mode outputs agree (to float rounding)."""
  agree = [jnp.asarray(True)]
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = jnp.asarray(x), jnp.asarray(y)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      agree.append(
          jnp.all(jnp.isclose(x, y, rtol=1e-4, atol=1e-6, equal_nan=True))
      )
    else:
      agree.append(jnp.all(x == y))
  return jnp.all(jnp.stack(agree))


def precise_batch_stats(
    model_apply: Callable[[PyTree, Any], tuple[Any, PyTree]],
    variables: PyTree,
    batches: Iterable[Any] | PyTree,
    *,
    stacked: bool = False,
) -> PyTree:
  """Equal-weight averages of every norm layer's batch ``S`` and ``D^2``.

  For a linen model (for nnx, :func:`gbn_jax.nnx.precise_batch_stats`).

  Args:
    model_apply: ``model_apply(variables, batch) -> (outputs, mutated)``, as
      ``model.apply(variables, batch, mutable=['batch_stats'])`` returns it,
      with the model in training mode.
    variables: the model's variables, with a ``batch_stats`` collection; not
      modified, and nothing but ``batch_stats`` is changed for the calls.
    batches: an iterable of batches, each passed to ``model_apply`` as is;
      or, with ``stacked=True`` (implied for a single array), one pytree
      whose leaves stack the batches along their first axis, which is
      scanned with ``jax.lax.scan`` so that ``jit`` traces the model once.
    stacked: see ``batches``.

  Returns:
    A new ``batch_stats`` tree: each ``mean``/``var`` leaf is the average over
    the batches of that layer's batch statistic; other leaves are kept.

  Raises:
    ValueError: no batches; no ``mean``/``var`` leaves; a statistic left
      unchanged by its update (a layer with momentum 1, or run with
      ``use_running_average=True``); a model whose training-mode output
      reads its running statistics (see below). Under ``jit`` (or ``scan``,
      ``shard_map``) these are decided while tracing, from the program: also
      an update whose momentum is not a constant of it.

  How the statistics are read: each layer updates ``new = m * old + (1 - m)
  * s`` with a momentum ``m`` this function is not told. The first batch is
  run twice, with every ``mean``/``var`` set to ``0`` and to ``B = 2^64``
  (float32), giving ``new_0 = fl((1 - m) s)`` exactly and ``fl(m B + (1 - m)
  s) = m B`` exactly, hence ``fl(m)``; every other batch runs once, with
  zeros. ``(1 - m)`` is recovered from ``fl(m)`` exactly for momenta written
  with up to 7 decimals (:func:`_complement`), so each backed-out ``s =
  new_0 / (1 - m)`` is the layer's own float32 ``s`` to two roundings (at
  most 2 ulps); with any other momentum, to about ``2^-25 / (1 - m)``
  relative.

  That probing needs a training-mode output that does not read the running
  statistics (true of BatchNorm and GBN, not of ``renorm=True``). The
  outputs of the two probe calls are compared: if they differ, this raises
  ``ValueError``. Under ``jit`` the same is decided while tracing: the
  outputs must not depend on the running statistics in the program at all
  (so ``renorm=True`` is refused even where its clipping makes the
  dependence vanish), and the momentum is read off the program as the
  update's derivative in the old statistic.

  Example: one GBN layer (a model of many, flax's BatchNorm among them, is
  no different)::

    >>> import jax, jax.numpy as jnp
    >>> from gbn_jax import GBatchNorm, precise_batch_stats
    >>> model = GBatchNorm(use_running_average=False, measure='mad',
    ...                    momentum=0.99)
    >>> batches = [jnp.arange(4.).reshape(4, 1) + shift for shift in (0, 10)]
    >>> variables = model.init(jax.random.key(0), batches[0])
    >>> apply = lambda v, b: model.apply(v, b, mutable=['batch_stats'])
    >>> stats = precise_batch_stats(apply, variables, batches)
    >>> stats['mean'], stats['var']  # means 1.5 and 11.5; MAD 1 both times
    (Array([6.5], dtype=float32), Array([1.], dtype=float32))
  """
  batch_stats = variables["batch_stats"]
  paths = _statistic_paths(batch_stats)
  if not paths:
    raise ValueError(
        "variables['batch_stats'] holds no 'mean'/'var' leaves: no norm"
        " layer statistics to recompute."
    )

  def run(stats, batch):
    outputs, mutated = model_apply(
        {**variables, "batch_stats": _replace(batch_stats, paths, stats)},
        batch,
    )
    return outputs, _pick(mutated["batch_stats"], paths)

  means = average_batch_statistics(
      run,
      _pick(batch_stats, paths),
      batches,
      stacked=stacked,
      names=["/".join(p) for p in paths],
  )
  return _replace(batch_stats, paths, means)


def average_batch_statistics(
    run: Callable[[list[Array], Any], tuple[Any, list[Array]]],
    old: list[Array],
    batches: Iterable[Any] | PyTree,
    *,
    stacked: bool,
    names: list[str],
) -> list[Array]:
  """The framework-free core of the precise statistics (linen and nnx).

  Args:
    run: ``run(stats, batch) -> (outputs, new_stats)``: one training-mode
      call with the norm layers' running statistics set to the list
      ``stats`` (in the order of ``old``), returning the model's outputs and
      the layers' updated statistics, in the same order.
    old: the current running statistics (their shapes and dtypes).
    batches: as :func:`precise_batch_stats`'s.
    stacked: as :func:`precise_batch_stats`'s (implied for a single array).
    names: a name for each statistic, for the error messages.

  Returns:
    The average over the batches of each statistic's batch value, in the
    dtype of ``old``.

  Raises:
    ValueError: no batches; a statistic that the calls did not update, or
      outputs that depend on the running statistics; under a trace, also a
      momentum that is not a constant of the program (see
      :func:`precise_batch_stats`).
  """
  zeros = [jnp.zeros_like(v) for v in old]
  probe_values = [_probe(jnp.result_type(v)) for v in old]
  probes = [jnp.full_like(v, b) for v, b in zip(old, probe_values)]

  stacked = stacked or isinstance(batches, (jax.Array, np.ndarray))
  if stacked:
    count = {np.shape(leaf)[0] for leaf in jax.tree.leaves(batches)}
    if len(count) != 1 or 0 in count:
      raise ValueError(
          "stacked batches need one non-zero leading (batch index) axis"
          f" length over all leaves, got {sorted(count)}."
      )
    (count,) = count
    first = jax.tree.map(lambda a: a[0], batches)
    rest = jax.tree.map(lambda a: a[1:], batches)
  else:
    iterator = iter(batches)
    try:
      first = next(iterator)
    except StopIteration:
      raise ValueError(
          "precise_batch_stats needs at least one batch."
      ) from None

  outputs_zero, new_zero = run(zeros, first)
  outputs_probe, new_probe = run(probes, first)
  complements = [
      _complement((p - z) / b)
      for z, p, b in zip(new_zero, new_probe, probe_values)
  ]
  # Traced (jit, scan, shard_map), the probes' values are unknown until run:
  # the same refusals are decided from the program instead.
  traced = not _check_updated(complements, names)
  if traced:
    _check_program(run, old, first, names)

  def statistics(new):
    return [n / c for n, c in zip(new, complements)]

  def add(total, batch):
    return [t + s for t, s in zip(total, statistics(run(zeros, batch)[1]))]

  total = statistics(new_zero)
  if stacked:
    total, _ = jax.lax.scan(lambda t, b: (add(t, b), None), total, rest)
  else:
    count = 1
    for batch in iterator:
      total = add(total, batch)
      count += 1
  means = [(t / count).astype(v.dtype) for t, v in zip(total, old)]

  if traced:  # _check_program found the outputs free of the statistics
    return means
  consistent = _same_outputs(outputs_zero, outputs_probe)
  varying = varying_axes(consistent)
  if varying:  # under shard_map: all devices must agree
    consistent = jax.lax.pmin(consistent.astype(jnp.int32), varying) > 0
  try:
    consistent = bool(consistent)
  except jax.errors.ConcretizationTypeError:
    _check_program(run, old, first, names)
  else:
    if not consistent:
      raise ValueError(_READS_RUNNING)
  return means


_READS_RUNNING = (
    "the model's training-mode output depends on its running statistics"
    " (e.g. GBatchNorm(renorm=True)), so their batch statistics cannot be"
    " read off their updates."
)


def _check_updated(complements: list[Array], names: list[str]) -> bool:
  """Raises for statistics whose update left them unchanged (``m = 1``).

  Such a statistic holds no batch value to back out: the layer ran with its
  running statistics, or has momentum 1.

  Returns:
    Whether it could tell: False where ``complements`` are traced.
  """
  try:
    stale = [n for n, c in zip(names, complements) if bool((c == 0).any())]
  except jax.errors.ConcretizationTypeError:
    return False
  if stale:
    raise ValueError(
        "the running statistics "
        + ", ".join(stale)
        + " were not updated by the training-mode call (a layer that ran"
        " with use_running_average=True, or momentum 1): no batch statistic"
        " to read off them."
    )
  return True


def _check_program(
    run: Callable[[list[Array], Any], tuple[Any, list[Array]]],
    old: list[Array],
    batch: Any,
    names: list[str],
) -> None:
  """The refusals of the eager probes, decided while tracing.

  Under a trace the probe calls' values are unknown, but what they would
  show is a property of the model's program, read here from a jaxpr of one
  training-mode call and its pullback in the statistics (so a misuse raises
  while tracing rather than returning NaN): the outputs read the running
  statistics iff they depend on them (dead-code elimination keeps those
  inputs; a dependence that the clipping of ``renorm`` makes numerically
  void is refused too), and a layer's momentum ``m`` is the derivative of
  its update ``m * old + (1 - m) * s`` in ``old``, a constant of the
  program, evaluated at trace time (``m = 1``: not updated).

  Raises:
    ValueError: as the eager checks; or when an update's derivative in the
      old statistic is not a constant of the program, so that ``m`` can't
      be told while tracing.
  """
  # pylint: disable-next=g-import-not-at-top
  from jax._src.interpreters import partial_eval as pe

  def outputs_and_slopes(stats, cotangents):
    # The pullback (not a jvp) also goes through custom_vjp layers.
    _, pullback, outputs = jax.vjp(
        lambda s: run(s, batch)[::-1], stats, has_aux=True
    )
    return outputs, pullback(cotangents)[0]

  closed = jax.make_jaxpr(outputs_and_slopes)(old, old)
  n_consts, n_stats = len(closed.jaxpr.constvars), len(old)
  jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
  n_outputs = len(jaxpr.outvars) - n_stats
  # Inputs: closed-over values, then the statistics, then the cotangents.
  slopes_jaxpr, used = pe.dce_jaxpr(
      jaxpr, [False] * n_outputs + [True] * n_stats
  )
  if any(used[: n_consts + n_stats]):
    unknown = [
        name
        for i, name in enumerate(names)
        if any(
            pe.dce_jaxpr(
                jaxpr, [False] * n_outputs + [j == i for j in range(n_stats)]
            )[1][: n_consts + n_stats]
        )
    ]
    raise ValueError(
        "under a JAX transformation (jit, scan, shard_map) the updates of the"
        " running statistics " + ", ".join(unknown) + " have a derivative in"
        " the old statistic that is not a constant of the program, so their"
        " momentum can't be told while tracing; call precise_batch_stats"
        " outside the transformation."
    )
  ones = [
      np.ones(v.shape, jnp.result_type(v))
      for v, u in zip(old, used[n_consts + n_stats :])
      if u
  ]
  with jax.ensure_compile_time_eval():
    slopes = jax.core.eval_jaxpr(slopes_jaxpr, [], *ones)
    complements = [
        _complement(jnp.asarray(m, v.dtype)) for m, v in zip(slopes, old)
    ]
    _check_updated(complements, names)
  _, used = pe.dce_jaxpr(jaxpr, [True] * n_outputs + [False] * n_stats)
  if any(used[n_consts : n_consts + n_stats]):
    raise ValueError(_READS_RUNNING)
