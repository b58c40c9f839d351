"""Says when training is dead: the loss sits at chance level for an epoch.

A classifier that predicts every class with equal probability has the
cross-entropy ``ln(num_classes)`` whatever its input. A training loss that
stays there for a whole epoch means the network learns nothing. The note
names the cause it can tell apart, in this order:

* A norm layer none of whose outputs is positive: the ReLU after it outputs
  only zeros and passes no gradient. A measure centered at or above every
  value (``wcd``: ``S`` is the maximum) does this at the default zero bias,
  since every normalized value is then at most the bias.
  :func:`probe_norm_outputs` finds such layers by running the run's own
  model, at its initial parameters, on a batch of random images, and
  counting the positive outputs of each norm layer. It measures what the
  layers do rather than reading a property of the built-in measures, so it
  also sees a measure of the user's own, and what renormalization and
  ``--norm-bias`` change.
* For an uncalibrated GBN measure, its gain: a raw deviation ``D`` is not
  the standard deviation (``rsd`` is 0.40σ for Gaussian data), so the swap
  multiplies every layer's gain σ/D at initialization, which acts like
  another learning rate, and a rate tuned for BatchNorm can be too large.
* Else (BatchNorm, a calibrated measure) the learning rate.

`dead_training_note` decides from one epoch's step losses and the probe's
result (a pure function); `DeadTrainingWatch` calls it after each epoch,
probes only an epoch at chance, and speaks once per command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from train import configs
from train.data import datasets
from train.data import input_pipeline
from train.loop import capture
from train.loop import train_state
from train.loop import train_steps

#: Relative distance to ``ln(num_classes)`` that counts as chance level.
TOLERANCE = 0.01

#: Fewer steps are no evidence: any network starts near chance, and tiny
#: test runs take a few steps an epoch.
MIN_STEPS = 20

#: The epoch is judged in this many consecutive parts, each by its mean loss:
#: the whole epoch must sit at chance, not just its average, and one noisy
#: batch does not decide.
PARTS = 10

#: Images in the batch that `probe_norm_outputs` runs the model on.
PROBE_IMAGES = 32

#: The ``--norm-bias`` that `dead_training_note` advises for a measure
#: centered at or above every value: with ``wcd`` (``D = max - mean``) the
#: values above the mean then pass the ReLU.
ADVISED_BIAS = 1.0

# Norms whose deviation is the standard deviation (BatchNorm's, or
# GroupNorm's per group): their gain is BatchNorm's, so only the learning
# rate (or the network) is left to blame.
_BATCHNORM_NORMS = ("bn", "sd", "gn", "gn:sd")
# bn_gain:<norm>: BatchNorm's statistics at another measure's gain, chosen on
# purpose (train.model.models.GAIN_NORM); calibration does not apply to it.
_GAIN_PREFIX = "bn_gain:"


def at_chance(
    losses: Sequence[float] | np.ndarray,
    num_classes: int,
    tolerance: float = TOLERANCE,
) -> bool:
  """Whether an epoch's step losses sat at chance level throughout.

  Args:
    losses: The training loss of each step of the epoch, in order.
    num_classes: Number of classes (chance level is ``ln(num_classes)``).
    tolerance: Relative distance to ``ln(num_classes)`` that still counts.

  Returns:
    True when there are at least `MIN_STEPS` losses and each of `PARTS`
    consecutive parts of the epoch has its mean loss within ``tolerance``
    of ``ln(num_classes)``.

  Raises:
    ValueError: ``num_classes`` below 2, a negative ``tolerance``, or
      ``losses`` not one-dimensional.
  """
  if isinstance(num_classes, bool) or not isinstance(num_classes, int):
    raise ValueError(f"num_classes: must be an integer, got {num_classes!r}")
  if num_classes < 2:
    raise ValueError(f"num_classes: must be >= 2, got {num_classes}")
  if not tolerance >= 0:
    raise ValueError(f"tolerance: must be >= 0, got {tolerance!r}")
  values = np.asarray(losses, np.float64)
  if values.ndim != 1:
    raise ValueError(
        f"losses: expected one loss per step, got shape {values.shape}"
    )
  if len(values) < MIN_STEPS:
    return False
  chance = math.log(num_classes)
  means = [part.mean() for part in np.array_split(values, PARTS)]
  # NaN fails the comparison: a non-finite loss is another error's business.
  return all(abs(m - chance) <= tolerance * chance for m in means)


@dataclasses.dataclass(frozen=True)
class LayerOutputs:
  """What one norm layer output on `probe_norm_outputs`'s batch.

  Attributes:
    positive: The fraction of its outputs above zero: what a ReLU after it
      passes.
    above_bias: The fraction above the layer's bias: none when its measure
      centers each feature at or above every value.
    bias: The layer's largest bias (its features' initial bias).
  """

  positive: float
  above_bias: float
  bias: float


def probe_norm_outputs(
    config: configs.Config,
    num_classes: int,
    image_shape: Sequence[int],
    images: int = PROBE_IMAGES,
) -> dict[str, LayerOutputs]:
  """Every norm layer's outputs in one training-mode forward pass.

  The model is the run's (``config``'s norm, calibration, renormalization
  and bias), at the parameters the run starts from; the batch is uniformly
  random pixels, normalized as training normalizes the dataset's images.

  Args:
    config: The run's config.
    num_classes: Number of classes of the dataset.
    image_shape: One image's shape (height, width, channels).
    images: How many images the batch has.

  Returns:
    ``{norm layer path: LayerOutputs}``, in call order.
  """
  model = train_state.create_model(config, num_classes)
  if hasattr(model, "recompute_norm"):
    # Its remat would trace the norm layers apart, and their outputs would
    # escape that trace; the parameters and function are the same without.
    model = model.clone(recompute_norm=False)
  shape = (images, *image_shape)
  variables = model.init(
      train_steps.init_key(config.seed),
      jnp.zeros((1, *image_shape), jnp.float32),
      train=False,
  )
  pixels = jax.random.randint(jax.random.key(0), shape, 0, 256, jnp.int32)
  batch = input_pipeline.normalize_images(
      pixels.astype(jnp.uint8), config.dataset
  )

  @jax.jit
  def fractions(variables, batch):
    with capture.capture_calls() as captured:
      model.apply(variables, batch, train=True, mutable=["batch_stats"])
    result = {}
    for name, call in captured.items():
      params = variables["params"]
      for part in name.split("/"):
        params = params.get(part, {})
      bias = params.get("bias", jnp.zeros(()))
      y = call.output.astype(jnp.float32)
      result[name] = (jnp.mean(y > 0), jnp.mean(y > bias), jnp.max(bias))
    return result

  return {
      name: LayerOutputs(*(float(v) for v in values))
      for name, values in jax.device_get(fractions(variables, batch)).items()
  }


def _layers_text(names: Sequence[str]) -> str:
  if len(names) <= 3:
    return ", ".join(names)
  return f"{', '.join(names[:2])} and {len(names) - 2} more norm layers"


def _dead_relu_cause(
    outputs: Mapping[str, LayerOutputs], norm: str, norm_bias: float
) -> str | None:
  """The cause and fix when a norm layer outputs nothing positive, if so."""
  dead = [name for name, o in outputs.items() if o.positive == 0]
  if not dead:
    return None
  # The first such layer decides: the layers after it may only be fed its
  # zeros (a constant feature normalizes to exactly the bias).
  head = (
      f"Likely cause: no output of {_layers_text(dead)} is positive (on a"
      " batch of random images, at the run's initial parameters), so the"
      " ReLU after each outputs only zeros and passes no gradient back."
  )
  if outputs[dead[0]].above_bias == 0:
    if norm_bias < ADVISED_BIAS:
      bias_fix = f"--norm-bias {ADVISED_BIAS:g}" + (
          " (wcd's D is max - mean: the values above the mean then pass)"
          if norm == "wcd"
          else ""
      )
    else:
      bias_fix = f"a --norm-bias above {norm_bias:g}"
    return (
        f"{head} {norm} centers each feature at or above every value"
        f"{' (S = max)' if norm == 'wcd' else ''}, so every normalized value"
        f" is at most the layer's bias (--norm-bias {norm_bias:g}). Fix:"
        f" {bias_fix}, or a measure centered inside the data (e.g. --norm"
        " bn)."
    )
  return (
      f"{head} --norm-bias {norm_bias:g} pulls every normalized value of"
      f" {dead[0]} below zero. Fix: --norm-bias 0 (the default)."
  )


def dead_training_note(
    losses: Sequence[float] | np.ndarray,
    *,
    epoch: int,
    num_classes: int,
    norm: str,
    learning_rate: float,
    calibration: str = "none",
    norm_bias: float = 0.0,
    norm_outputs: Mapping[str, LayerOutputs] | None = None,
) -> str | None:
  """What to tell the user about an epoch whose loss sat at chance, if so.

  Args:
    losses: The epoch's step losses, in order.
    epoch: The epoch's number, for the message.
    num_classes: Number of classes of the dataset.
    norm: The run's ``--norm`` (``bn``, a measure, ``bn_gain:<norm>``).
    learning_rate: The run's ``--lr``.
    calibration: The run's ``--calibration``.
    norm_bias: The run's ``--norm-bias``.
    norm_outputs: `probe_norm_outputs`'s result for the run; ``None``: not
      probed.

  Returns:
    ``None`` unless `at_chance`; else the message: the likely cause (a norm
    layer with no positive output; for an uncalibrated GBN measure its gain
    at this learning rate; else the learning rate) and the fixes.
  """
  if not at_chance(losses, num_classes):
    return None
  chance = math.log(num_classes)
  mean = float(np.mean(losses))
  head = (
      f"warning: epoch {epoch}'s training loss sat at chance level for the"
      f" whole epoch (mean {mean:.4f}; ln {num_classes} = {chance:.4f}): the"
      " network is not learning."
  )
  dead_relu = _dead_relu_cause(norm_outputs or {}, norm, norm_bias)
  if dead_relu is not None:
    return f"{head} {dead_relu}"
  smaller = f"a smaller --lr (e.g. {learning_rate / 10:g})"
  if norm in _BATCHNORM_NORMS:
    return (
        f"{head} Likely cause: --lr {learning_rate:g} is too large for this"
        f" network. Fix: {smaller}."
    )
  if norm.startswith(_GAIN_PREFIX):
    return (
        f"{head} Likely cause: the gain that {norm} sets, at --lr"
        f" {learning_rate:g} (an effective step unlike BatchNorm's at the"
        f" same rate). Fix: {smaller}, or --norm bn."
    )
  if calibration == "normal":
    return (
        f"{head} Likely cause: --lr {learning_rate:g} is too large for {norm}"
        " (calibrated: its gain at initialization is already BatchNorm's)."
        f" Fix: {smaller}."
    )
  return (
      f"{head} Likely cause: {norm}'s gain σ/D at --lr {learning_rate:g}: D"
      " is not the standard deviation, so the same rate makes another step"
      " than BatchNorm's (often too large a one). Fixes: --calibration"
      " normal (every measure starts at BatchNorm's gain, so a rate tuned"
      f" for BatchNorm fits), or {smaller}."
  )


class DeadTrainingWatch:
  """Checks each epoch of a run; says it once (see `dead_training_note`).

  Args:
    config: The run's config.
    probe: Returns the run's `probe_norm_outputs`; called only for an epoch
      at chance. Default: `probe_norm_outputs` of ``config``'s model.
  """

  def __init__(
      self,
      config: configs.Config,
      probe: Callable[[], Mapping[str, LayerOutputs]] | None = None,
  ):
    self._config = config
    info = datasets.dataset_info(config.dataset)
    self._num_classes = info.num_classes
    self._probe = probe or (
        lambda: probe_norm_outputs(config, info.num_classes, info.image_shape)
    )
    self._said = False

  def after_epoch(
      self, epoch: int, losses: Sequence[float] | np.ndarray
  ) -> str | None:
    """The note for this epoch, the first time one applies; else None."""
    if self._said or not at_chance(losses, self._num_classes):
      return None
    note = dead_training_note(
        losses,
        epoch=epoch,
        num_classes=self._num_classes,
        norm=self._config.norm,
        learning_rate=self._config.learning_rate,
        calibration=self._config.calibration,
        norm_bias=self._config.norm_bias,
        norm_outputs=self._probe(),
    )
    self._said = note is not None
    return note
