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
s``, whose momentum ``m`` this module reads from the layer's public
``momentum`` field as the layer is called (:class:`LayerCall`), or else
probes, without being told (see :func:`precise_batch_stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["precise_batch_stats"]

Array = jax.Array
PyTree = Any

STATISTIC_NAMES = ("mean", "var")

# Decimal places tried when recovering the momentum the layer was given.
_MAX_DIGITS = 7


@dataclasses.dataclass(frozen=True)
class LayerCall:
  """What a norm layer's call does to its running statistics.

  Read off the layer's public configuration as it is called, so it is known
  while tracing, when the values are not: flax's and gbn_jax's BatchNorm
  layers update ``momentum * old + (1 - momentum) * batch`` with their
  ``momentum`` field, in training mode (``use_running_average`` false, as
  the field or the call's argument), and a GBN layer's training-mode output
  reads its running statistics iff ``renorm``.

  Attributes:
    momentum: the layer's ``momentum``, as the layer holds it.
    updates: whether the call moves the running statistics towards the
      batch's (training mode and a momentum other than 1).
    reads_running: whether the call's output reads the running statistics.
  """

  momentum: Any
  updates: bool
  reads_running: bool

  @classmethod
  def of(cls, layer: Any, use_running_average: bool | None) -> LayerCall:
    """The call of ``layer`` with that ``use_running_average`` argument."""
    if use_running_average is None:
      use_running_average = layer.use_running_average
    batch = not use_running_average
    return cls(
        momentum=layer.momentum,
        updates=batch and layer.momentum != 1,
        reads_running=batch and bool(getattr(layer, "renorm", False)),
    )

  def merge(self, other: LayerCall | None) -> LayerCall | None:
    """One layer called twice (or through another module on its variables,
    as ``gbn_jax.linen.batchnorm_as_gbn`` does); ``None`` if the momenta
    differ."""
    if other is None or other.momentum != self.momentum:
      return None
    return LayerCall(
        self.momentum,
        self.updates and other.updates,
        self.reads_running or other.reads_running,
    )

  def complement(self, dtype: Any) -> Array:
    """``1 - momentum`` rounded as the update rounds it: the layer computes
    ``(1 - momentum) * batch``, a Python number times an array of
    ``dtype``, which rounds the number to ``dtype`` once."""
    return jnp.asarray(1 - self.momentum, dtype)


def _record_linen_call(
    calls: dict[tuple[str, ...], LayerCall | None],
    next_fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: Any,
) -> Any:
  """A ``flax.linen.intercept_methods`` interceptor: each ``nn.BatchNorm``
  (GBN included) call's :class:`LayerCall`, by the layer's path."""
  module = context.module
  if isinstance(module, nn.BatchNorm) and context.method_name == "__call__":
    given = kwargs.get(
        "use_running_average", args[1] if len(args) > 1 else None
    )
    call = LayerCall.of(module, given)
    path = tuple(str(name) for name in module.path)
    calls[path] = call.merge(calls[path]) if path in calls else call
  return next_fun(*args, **kwargs)


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
      ``shard_map``) these are decided while tracing, from the layers'
      configuration; there, also a statistic of a layer that is no
      ``flax.linen.BatchNorm`` (:class:`gbn_jax.GBatchNorm` included).

  How the statistics are read: each layer updates ``new = m * old + (1 - m)
  * s``. Every batch runs with every ``mean``/``var`` set to ``0``, giving
  ``new_0 = fl((1 - m) s)`` exactly, and ``s = new_0 / (1 - m)`` is the
  layer's own float32 ``s`` to two roundings (at most 2 ulps). ``m`` is the
  ``momentum`` field of the layer that holds the statistic, read as
  ``model_apply`` calls it, through flax's public method interception
  (``flax.linen.intercept_methods``; a ``jax.jit``-ed ``model_apply``
  already compiled for these shapes is not traced again, so it is not
  seen), together with the call's ``use_running_average`` and GBN's
  ``renorm``. A statistic of any other module (momentum unknown) is probed
  instead, outside a trace: the first batch runs again with the statistics
  set to ``B = 2^64`` (float32), and ``fl(m B + (1 - m) s) = m B`` gives
  ``fl(m)``, from which ``(1 - m)`` is recovered exactly for momenta written
  with up to 7 decimals (:func:`_complement`), else to about ``2^-25 / (1 -
  m)`` relative.

  Each batch also runs from ``B``: a statistic that this leaves at ``B`` was
  kept by its layer (a masked feature with no masked-in element in that
  batch), and that batch does not count for it; a feature that no batch
  holds keeps its running value. So every batch costs two calls.

  This needs a training-mode output that does not read the running
  statistics (true of BatchNorm and GBN, not of ``renorm=True``). Outside a
  trace, the outputs of the first batch's two calls are compared, and
  differing outputs raise ``ValueError``; under a trace, a layer called with
  ``renorm=True`` raises it.

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
    calls = {}
    with nn.intercept_methods(functools.partial(_record_linen_call, calls)):
      outputs, mutated = model_apply(
          {**variables, "batch_stats": _replace(batch_stats, paths, stats)},
          batch,
      )
    layer_calls = [calls.get(path[:-1]) for path in paths]
    return outputs, _pick(mutated["batch_stats"], paths), layer_calls

  means = average_batch_statistics(
      run,
      _pick(batch_stats, paths),
      batches,
      stacked=stacked,
      names=["/".join(p) for p in paths],
  )
  return _replace(batch_stats, paths, means)


def average_batch_statistics(
    run: Callable[[list[Array], Any], tuple[Any, list[Array], list[Any]]],
    old: list[Array],
    batches: Iterable[Any] | PyTree,
    *,
    stacked: bool,
    names: list[str],
) -> list[Array]:
  """The framework-free core of the precise statistics (linen and nnx).

  Args:
    run: ``run(stats, batch) -> (outputs, new_stats, calls)``: one
      training-mode call with the norm layers' running statistics set to the
      list ``stats`` (in the order of ``old``), returning the model's
      outputs, the layers' updated statistics in the same order, and for
      each statistic the :class:`LayerCall` of the layer that holds it, or
      ``None`` where no such layer was seen.
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
      statistic of no layer that ``run`` reported (see
      :func:`precise_batch_stats`).
  """
  zeros = [jnp.zeros_like(v) for v in old]
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

  outputs_zero, new_zero, calls = run(zeros, first)
  if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(new_zero)):
    # Traced (jit, scan, shard_map), the probes' values are unknown until
    # run: what they would show is taken from the layers' calls instead.
    complements = _reported_complements(calls, new_zero, names)
  else:
    complements = _probed_complements(
        run, old, first, outputs_zero, new_zero, calls, names
    )

  # A masked layer keeps a feature's statistic where its batch has no
  # masked-in element: such a batch holds no value of it, and is told by a
  # second run from ``B``, which an update always moves (momentum < 1).
  limits = [jnp.full_like(v, _probe(jnp.result_type(v))) for v in old]

  def add(totals, counts, new, batch):
    moved = [n != b for n, b in zip(run(limits, batch)[1], limits)]
    totals = [
        t + jnp.where(m, n / c, 0)
        for t, m, n, c in zip(totals, moved, new, complements)
    ]
    counts = [k + m for k, m in zip(counts, moved)]
    return totals, counts

  start = (
      [jnp.zeros_like(n / c) for n, c in zip(new_zero, complements)],
      [jnp.zeros(v.shape, jnp.int32) for v in old],
  )
  state = add(*start, new_zero, first)
  if stacked:
    state, _ = jax.lax.scan(
        lambda c, b: (add(*c, run(zeros, b)[1], b), None), state, rest
    )
  else:
    for batch in iterator:
      state = add(*state, run(zeros, batch)[1], batch)
  totals, counts = state
  # A feature that no batch holds keeps its running statistic.
  return [
      jnp.where(k > 0, t / jnp.maximum(k, 1), v).astype(v.dtype)
      for t, k, v in zip(totals, counts, old)
  ]


def _probed_complements(
    run: Callable[[list[Array], Any], tuple[Any, list[Array], list[Any]]],
    old: list[Array],
    batch: Any,
    outputs_zero: Any,
    new_zero: list[Array],
    calls: list[LayerCall | None],
    names: list[str],
) -> list[Array]:
  """Each statistic's ``fl(1 - m)``, and the refusals, from a second call.

  The first batch runs again with every statistic set to ``B``: an update
  that leaves it unchanged is refused, and so are outputs that differ from
  the first call's. ``1 - m`` is the reported layer's where there is one,
  else recovered from the probe's ``fl(m)`` (:func:`_complement`).
  """
  probe_values = [_probe(jnp.result_type(v)) for v in old]
  probes = [jnp.full_like(v, b) for v, b in zip(old, probe_values)]
  outputs_probe, new_probe, _ = run(probes, batch)
  probed = [
      _complement((p - z) / b)
      for z, p, b in zip(new_zero, new_probe, probe_values)
  ]
  stale = [n for n, c in zip(names, probed) if bool((c == 0).any())]
  if stale:
    raise ValueError(_not_updated(stale))
  if not bool(_same_outputs(outputs_zero, outputs_probe)):
    raise ValueError(_READS_RUNNING)
  return [
      c if call is None else call.complement(n.dtype)
      for c, call, n in zip(probed, calls, new_zero)
  ]


def _reported_complements(
    calls: list[LayerCall | None], new: list[Array], names: list[str]
) -> list[Array]:
  """Each statistic's ``fl(1 - m)`` from its layer's call, or the refusal."""
  unknown = [n for n, call in zip(names, calls) if call is None]
  if unknown:
    raise ValueError(
        "under a JAX transformation (jit, scan, shard_map) the running"
        " statistics " + ", ".join(unknown) + " belong to no layer whose"
        " momentum precise_batch_stats can read: it reads flax's and"
        " gbn_jax's BatchNorm layers (subclasses included) as model_apply"
        " calls them while it is traced (a jitted model_apply already"
        " compiled for these shapes is not traced again); call"
        " precise_batch_stats outside the transformation."
    )
  stale = [n for n, call in zip(names, calls) if not call.updates]
  if stale:
    raise ValueError(_not_updated(stale))
  if any(call.reads_running for call in calls):
    raise ValueError(_READS_RUNNING)
  return [call.complement(n.dtype) for call, n in zip(calls, new)]


_READS_RUNNING = (
    "the model's training-mode output depends on its running statistics"
    " (e.g. GBatchNorm(renorm=True)), so their batch statistics cannot be"
    " read off their updates."
)


def _not_updated(names: list[str]) -> str:
  # Such a statistic holds no batch value to back out.
  return (
      "the running statistics "
      + ", ".join(names)
      + " were not updated by the training-mode call (a layer that ran"
      " with use_running_average=True, or momentum 1): no batch statistic"
      " to read off them."
  )
