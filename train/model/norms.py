"""The ``--norm`` values and the single norm factory that every model uses.

A model builds every normalization layer through its ``norm`` field, a
factory from :func:`make_norm`: a ``functools.partial`` of
``flax.linen.BatchNorm`` (``--norm bn``, the baseline) or of
``gbn_jax.GBatchNorm(measure=...)``, or for a group norm of
:class:`GroupNorm` (``--norm gn``, flax's ``GroupNorm``) or of
:class:`GGroupNorm` (``--norm gn:<measure>``). That factory is the only thing
that differs between norms (see `train.model.models`). :func:`parse_norm` reads a
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
from gbn_jax import linen as gbn_linen
from gbn_jax import parse_measure_name

ModuleDef = Callable[..., nn.Module]

#: The ``--norm`` value that selects ``flax.linen.BatchNorm`` itself.
BASELINE_NORM = "bn"
#: ``bn_gain:<measure>``: BatchNorm's statistics, with D scaled to the gain
#: that ``<measure>`` gives a Gaussian feature (the gain without the shape).
GAIN_NORM = "bn_gain"
#: ``gn`` is ``flax.linen.GroupNorm``; ``gn:<measure>`` is
#: ``gbn_jax.linen.GGroupNorm`` with that measure.
GROUP_NORM = "gn"
#: ``--norm-groups``' default: it divides LeNet's 20 and 50 channels.
DEFAULT_GROUPS = 5
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
    group: A group norm (``gn``, ``gn:<measure>``): each example's channel
      groups are normalized with their own statistics, and ``measure`` is
      ``None`` for ``flax.linen.GroupNorm`` itself.
  """

  measure: str | None
  alpha: float | None = None
  gain_of: "NormSpec | None" = None
  group: bool = False


def norm_names() -> tuple[str, ...]:
  """Returns the accepted ``--norm`` spellings (``sqd`` as ``sqd:<alpha>``)."""
  names = [BASELINE_NORM]
  for name, spec in MEASURES.items():
    names.append(f"{name}:<alpha>" if "alpha" in spec.required else name)
  names.append(f"{GAIN_NORM}:<norm>")
  names += [GROUP_NORM, f"{GROUP_NORM}:<measure>"]
  return tuple(names)


def parse_norm(spec: str) -> NormSpec:
  """Parses a ``--norm`` value such as ``bn``, ``mad``, ``sqd:0.9`` or ``gn:rsd``.

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
  # The norm's own words (bn, bn_gain:<norm>, gn, gn:<measure>) first; a measure's name and
  # its alpha are read by gbn_jax.parse_measure_name.
  head, sep, rest = spec.strip().partition(":")
  choices = ", ".join(norm_names())
  if head == BASELINE_NORM and not sep:
    return NormSpec(measure=None)
  if head == GROUP_NORM:
    if not sep:
      return NormSpec(measure=None, group=True)
    try:
      target = parse_norm(rest)
    except ValueError as e:
      raise ValueError(f"norm {spec!r}: {e}") from None
    if target.measure is None or target.gain_of is not None or target.group:
      raise ValueError(
          f"{spec!r}: a group norm takes a GBN measure, "
          f"{GROUP_NORM}:<measure> (e.g. {GROUP_NORM}:rsd, "
          f"{GROUP_NORM}:sqd:0.9), not {rest!r}; choose one of: {choices}"
      )
    return dataclasses.replace(target, group=True)
  if head == GAIN_NORM:
    if not sep:
      raise ValueError(
          f"norm {head!r} needs a norm whose gain to take: write "
          f"{head}:<norm>, e.g. {head}:sqd1"
      )
    target = parse_norm(rest)
    if target.measure is None or target.gain_of is not None or target.group:
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
    groups: int = DEFAULT_GROUPS,
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
    groups: A group norm's number of channel groups (``num_groups``); it
      must divide every norm layer's channels. Batch norms ignore it.

  Returns:
    A partial of ``flax.linen.BatchNorm``, ``gbn_jax.GBatchNorm``,
    :class:`GroupNorm` or :class:`GGroupNorm` that the models call as
    ``norm(use_running_average=..., name=...)``.

  Raises:
    ValueError: An unknown norm or calibration, or renormalization asked
      of a group norm.
  """
  if isinstance(spec, str):
    spec = parse_norm(spec)
  if calibration not in (None, *CALIBRATIONS):
    raise ValueError(
        f"calibration {calibration!r} is not one of: "
        f"{', '.join(CALIBRATIONS)}"
    )
  if spec.group:
    if renorm_clipping is not None:
      raise ValueError(RENORM_REFUSAL)
    return _group_norm(spec, epsilon, calibration, bias, groups)
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


#: Why ``--renorm`` and a group norm don't go together.
RENORM_REFUSAL = (
    "--renorm is batch renormalization: it corrects batch statistics with "
    "running ones, and a group norm (gn, gn:<measure>) has neither; leave "
    "out --renorm, or choose a batch norm (bn or a measure)"
)


class _GroupsCheck:
  """What the CLI's group norms add to flax's: the models' call and a check.

  The models call every norm as ``norm(use_running_average=...)``; a group
  norm keeps no running statistics, so the field is accepted and unused. The
  check names the flag that sets ``num_groups``, which flax's and gbn_jax's
  own errors cannot.
  """

  def _check_groups(self, x):
    channels = x.shape[-1]
    if self.num_groups and channels % self.num_groups:
      divisors = [g for g in range(1, channels + 1) if channels % g == 0]
      raise ValueError(
          f"--norm-groups {self.num_groups} does not divide the {channels} "
          f"channels of norm layer {'/'.join(self.scope.path)!r}; pass "
          "--norm-groups N with N dividing every norm layer's channels (for "
          f"this one: {', '.join(map(str, divisors))})"
      )


class GroupNorm(_GroupsCheck, nn.GroupNorm):
  """``flax.linen.GroupNorm``, called as the models call every norm.

  Attributes:
    use_running_average: Accepted and unused (no running statistics).
  """

  use_running_average: bool | None = None

  def __call__(self, x, *args, **kwargs):
    self._check_groups(x)
    return super().__call__(x, *args, **kwargs)


class GGroupNorm(_GroupsCheck, gbn_linen.GGroupNorm):
  """``gbn_jax.linen.GGroupNorm``, called as the models call every norm.

  Attributes:
    use_running_average: Accepted and unused (no running statistics).
  """

  use_running_average: bool | None = None

  def __call__(self, x, *args, **kwargs):
    self._check_groups(x)
    return super().__call__(x, *args, **kwargs)


def _group_norm(
    spec: NormSpec,
    epsilon: float,
    calibration: str | None,
    bias: float,
    groups: int,
) -> ModuleDef:
  """:func:`make_norm`'s factory for ``gn`` and ``gn:<measure>``."""
  common = dict(num_groups=groups, epsilon=epsilon)
  if bias:
    common["bias_init"] = nn.initializers.constant(bias)
  if spec.measure is None:
    return functools.partial(GroupNorm, **common)
  if calibration == "normal" and spec.measure != "sd":
    # As for GBatchNorm: sd's constant is 1, and gn:sd stays the module
    # without calibration.
    common["calibration"] = "normal"
  return functools.partial(
      GGroupNorm, measure=spec.measure, alpha=spec.alpha, **common
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
