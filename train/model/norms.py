"""The ``--norm`` values and the single norm factory that every model uses.

A model builds every normalization layer through its ``norm`` field, a
factory from :func:`make_norm`: a ``functools.partial`` of
``flax.linen.BatchNorm`` (``--norm bn``, the baseline) or of
``gbn_jax.GBatchNorm(measure=...)``. That factory is the only thing that
differs between norms (see `train.model.models`). :func:`parse_norm` reads a
``--norm`` value, :func:`gain_measure` builds ``bn_gain:<norm>``'s measure,
and :func:`recompute_elementwise` makes a factory's backward pass recompute
its elementwise work.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import math

import flax.linen as nn

from gbn_jax import MEASURES
from gbn_jax import GBatchNorm
from gbn_jax import Measure
from gbn_jax import get_measure as gbn_get_measure
from gbn_jax import parse_measure_name

ModuleDef = Callable[..., nn.Module]

#: The ``--norm`` value that selects ``flax.linen.BatchNorm`` itself.
BASELINE_NORM = "bn"
#: ``bn_gain:<measure>``: BatchNorm's statistics, with D scaled to the gain
#: that ``<measure>`` gives a Gaussian feature (the gain without the shape).
GAIN_NORM = "bn_gain"
#: ``--calibration`` values: ``none``, or ``normal`` for GBatchNorm's
#: ``calibration='normal'``.
CALIBRATIONS = ("none", "normal")


@dataclasses.dataclass(frozen=True)
class NormSpec:
  """A parsed ``--norm`` value.

  Attributes:
    measure: ``None`` for ``flax.linen.BatchNorm``, else a GBN measure name.
    alpha: The quantile level for ``sqd``, else ``None``.
    gain_of: For ``bn_gain:<norm>``, that norm's own spec (``measure`` is
      then ``'sd'``): BatchNorm's ``D = sigma`` times the ``D`` that
      ``<norm>`` gives a standard normal feature.
  """

  measure: str | None
  alpha: float | None = None
  gain_of: "NormSpec | None" = None


def norm_names() -> tuple[str, ...]:
  """Returns the accepted ``--norm`` spellings (``sqd`` as ``sqd:<alpha>``)."""
  names = [BASELINE_NORM]
  for name, spec in MEASURES.items():
    names.append(f"{name}:<alpha>" if "alpha" in spec.required else name)
  names.append(f"{GAIN_NORM}:<norm>")
  return tuple(names)


def parse_norm(spec: str) -> NormSpec:
  """Parses a ``--norm`` value such as ``bn``, ``mad`` or ``sqd:0.9``.

  Args:
    spec: The value to parse.

  Returns:
    The parsed specification.

  Raises:
    ValueError: If ``spec`` names no known norm, or an alpha is missing,
      unexpected, not a number or outside (0, 1).
  """
  if not isinstance(spec, str):
    raise ValueError(f"norm must be a string, got {spec!r}")
  # The norm's own words (bn, bn_gain:<norm>) first; a measure's name and
  # its alpha are read by gbn_jax.parse_measure_name.
  head, sep, rest = spec.strip().partition(":")
  choices = ", ".join(norm_names())
  if head == BASELINE_NORM and not sep:
    return NormSpec(measure=None)
  if head == GAIN_NORM:
    if not sep:
      raise ValueError(
          f"norm {head!r} needs a norm whose gain to take: write "
          f"{head}:<norm>, e.g. {head}:sqd1"
      )
    target = parse_norm(rest)
    if target.measure is None or target.gain_of is not None:
      raise ValueError(
          f"{spec!r}: the gain must be that of a GBN measure "
          f"(not {rest!r}); choose one of: {choices}"
      )
    return NormSpec(measure="sd", gain_of=target)
  if head not in MEASURES:
    raise ValueError(f"unknown norm {spec!r}; choose one of: {choices}")
  try:
    name, params = parse_measure_name(spec)
  except ValueError as e:
    raise ValueError(f"norm {spec!r}: {e} Choose one of: {choices}") from None
  if "alpha" in MEASURES[name].required and "alpha" not in params:
    raise ValueError(
        f"norm {name!r} needs a quantile level: write {name}:<alpha> with "
        f"0 < alpha < 1, e.g. {name}:0.9 (sqd1/sqd2/sqd3 are alpha "
        "0.25/0.5/0.75)"
    )
  return NormSpec(measure=name, alpha=params.get("alpha"))


def make_norm(
    spec: str | NormSpec,
    *,
    momentum: float = 0.9,
    epsilon: float = 1e-5,
    axis_name: str | None = None,
    renorm_clipping: dict[str, float] | None = None,
    calibration: str | None = None,
    bias: float = 0.0,
) -> ModuleDef:
  """The single norm factory used by every model.

  Args:
    spec: A ``--norm`` string or a parsed :class:`NormSpec`.
    momentum: Running-average momentum (flax convention: new = momentum *
      old + (1 - momentum) * batch).
    epsilon: Added to D(x)^2 before the square root.
    axis_name: Mapped axis to reduce statistics over; only needed inside
      ``shard_map``/``pmap`` (under ``jit`` over a sharded batch XLA already
      computes global-batch statistics).
    renorm_clipping: If given, batch renormalization with these limits
      (``gbn_jax.GBatchNorm``'s ``renorm_clipping``); ``bn`` then means
      ``GBatchNorm(measure='sd')``, which computes BatchNorm's statistics.
    calibration: ``None``/``'none'``, or ``'normal'``: GBN layers get
      ``calibration='normal'``. ``bn`` ignores it and stays
      ``flax.linen.BatchNorm`` (BatchNorm's constant is 1), as does ``sd``
      in effect.
    bias: Every layer's initial bias (``bias_init``, a constant). A measure
      centered at the maximum (``wcd``) needs a positive one: its normalized
      values are at most the bias, so with a zero bias the ReLU after the
      layer outputs only zeros.

  Returns:
    A partial of ``flax.linen.BatchNorm`` or ``gbn_jax.GBatchNorm`` that the
    models call as ``norm(use_running_average=..., name=...)``.
  """
  if isinstance(spec, str):
    spec = parse_norm(spec)
  if calibration not in (None, *CALIBRATIONS):
    raise ValueError(
        f"calibration {calibration!r} is not one of: "
        f"{', '.join(CALIBRATIONS)}"
    )
  common = dict(momentum=momentum, epsilon=epsilon, axis_name=axis_name)
  if bias:
    # Left out at zero: the factory is then exactly flax's default one.
    common["bias_init"] = nn.initializers.constant(bias)
  if renorm_clipping is not None:
    common.update(renorm=True, renorm_clipping=renorm_clipping)
    if spec.measure is None:
      spec = NormSpec(measure="sd")
  if spec.measure is None:
    return functools.partial(nn.BatchNorm, **common)
  if spec.gain_of is not None:
    # The gain study's converse: BatchNorm given another measure's gain.
    # Calibration would undo exactly that gain, so it does not apply.
    return functools.partial(
        GBatchNorm, measure=gain_measure(spec.gain_of), **common
    )
  if calibration == "normal" and spec.measure != "sd":
    # Left out for sd (constant 1): the module is then exactly the one
    # without calibration, as bn's (above) is.
    common["calibration"] = "normal"
  return functools.partial(
      GBatchNorm, measure=spec.measure, alpha=spec.alpha, **common
  )


@functools.lru_cache(maxsize=None)
def gain_measure(target: NormSpec) -> Measure:
  """BatchNorm's ``(mean, sigma)`` with ``sigma`` times ``target``'s Gaussian ``D``.

  For Gaussian data this layer has the gain of ``target`` and BatchNorm's
  shape (centering on the mean, a symmetric deviation). The constant is
  ``gbn_jax.get_measure(target).normal_constant(n)`` for the ``n`` values
  per statistic, a static count, so the measure takes no mask (the error
  says why). It does not pool devices, so under
  ``axis_name`` the layer gathers the global batch for it (and ``n`` is the
  global count). One measure per target (cached), so that jit reuses its
  traces.

  Args:
    target: the norm whose Gaussian ``D`` gives the gain.

  Returns:
    The measure, for ``GBatchNorm(measure=...)``.

  >>> import jax.numpy as jnp
  >>> import numpy as np
  >>> x = jnp.asarray(np.random.default_rng(0).standard_normal((4000, 2)))
  >>> _, d = gain_measure(parse_norm("rsd"))(x, (0,))
  >>> [round(float(v), 2) for v in d]  # about 1/sqrt(2 pi)
  [0.4, 0.4]
  """
  sd = gbn_get_measure("sd")
  reference = gbn_get_measure(
      target.measure,
      **({} if target.alpha is None else {"alpha": target.alpha}),
  )

  def measure(x, axis):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    n = math.prod(x.shape[a] for a in axes)
    mean, sigma = sd(x, axes)
    return mean, sigma * reference.normal_constant(n)

  name = f"{GAIN_NORM}:{target.measure}"
  if target.alpha is not None:
    name += f":{target.alpha}"
  return Measure(
      name,
      measure,
      mask_refusal="its constant needs the static number of values",
  )


#: Primitives that act element by element (and the broadcasts and reshapes
#: around them): cheap to recompute, and on XLA:CPU costly to store.
_ELEMENTWISE_PRIMITIVES = frozenset(
    "abs add and bitcast_convert_type broadcast_in_dim ceil clamp copy copy_p "
    "convert_element_type div eq exp expand_dims expm1 floor ge gt integer_pow "
    "is_finite le log log1p lt max min mul ne neg not or pow reshape round "
    "rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign "
    "sqrt square squeeze stop_gradient sub xor".split()
)


def _save_all_but_elementwise(prim, *_, **__) -> bool:
  return prim.name not in _ELEMENTWISE_PRIMITIVES


def recompute_elementwise(norm: ModuleDef) -> ModuleDef:
  """``norm`` whose backward pass recomputes its elementwise work.

  Under :func:`flax.linen.remat` with this policy the layer keeps only its
  input and what is not elementwise (the statistics, a selection), and the
  backward pass recomputes the rest inside its own fusions. The function,
  parameters and ``batch_stats`` are unchanged, and so are the values up to
  float rounding (the same operations, fused differently).

  Args:
    norm: A norm factory (:func:`make_norm`'s): a Module class or a
      ``functools.partial`` of one.

  Returns:
    The same factory over the rematerialized class.

  Raises:
    TypeError: If ``norm`` is neither.
  """
  if isinstance(norm, functools.partial):
    return functools.partial(
        recompute_elementwise(norm.func), *norm.args, **norm.keywords
    )
  if isinstance(norm, type) and issubclass(norm, nn.Module):
    # Autodiff would keep what the backward pass needs, x - S(x) among it,
    # as arrays the size of the activations, which XLA:CPU then writes and
    # reads once more: a visible share of a ResNet20 step's op time
    # (benchmarks/step/bench_resnet_step.py's profile, docs/performance.md).
    return nn.remat(norm, policy=_save_all_but_elementwise)
  raise TypeError(
      f"expected a Module class or a functools.partial of one, got {norm!r}"
  )
