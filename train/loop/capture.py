"""What a model's norm layers see: their calls, sizes and Gaussian gains.

:func:`capture_calls` is the one ``nn.intercept_methods`` interceptor of the
training package: ``train.loop.train_steps`` records one layer's activations
with it, ``train.gain`` every norm layer's input and :func:`norm_layer_sizes`
the shapes. Training writes :data:`NORM_LAYERS_FILE` beside ``metrics.jsonl``::

  {"dataset": "fashion_mnist", "model": "lenet", "batch_size": 1000,
   "norm": "rbd", "calibration": "none",
   "layers": {"norm1": {"n": 576000, "gaussian": 0.1052},
              "norm2": {"n": 64000, "gaussian": 0.1167}}}

``n`` is the number of values each statistic of the layer reduces over
(batch x spatial positions) and ``gaussian`` the gain ``sigma/D`` the layer
gives a Gaussian feature of that size (:func:`gaussian_gain`), so that
``python -m train.report`` reads them with numpy alone. Runs trained before
the file existed get it from ``python -m train.gain --norm-layers RUN...``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import gbn_jax
from train import configs
from train.loop import checkpointing
from train.model import models

NORM_LAYERS_FILE = "norm_layers.json"


def module_path(module: nn.Module) -> str:
  """The module's path in its model, ``/``-joined (``""`` when unbound)."""
  return "/".join(module.scope.path) if module.scope is not None else ""


def is_norm_layer(module: nn.Module) -> bool:
  """flax's ``BatchNorm`` or ``gbn_jax.GBatchNorm``."""
  return isinstance(module, (nn.BatchNorm, gbn_jax.GBatchNorm))


@dataclasses.dataclass(frozen=True)
class Call:
  """One ``__call__`` of a captured module.

  Attributes:
    module: The bound module (its fields say how it normalizes).
    input: Its first positional argument (a tracer inside a transform).
    output: What it returned.
  """

  module: nn.Module
  input: Any
  output: Any


@contextlib.contextmanager
def capture_calls(
    select: Callable[[nn.Module], bool] = is_norm_layer,
) -> Iterator[dict[str, Call]]:
  """Records the ``__call__`` of every selected module applied inside.

  Args:
    select: Which modules to record (default: the norm layers).

  Yields:
    ``{module path: Call}``, filled in call order while the block runs (a
    module called twice keeps its last call).
  """
  captured: dict[str, Call] = {}

  def intercept(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and select(context.module):
      captured[module_path(context.module)] = Call(context.module, args[0], out)
    return out

  with nn.intercept_methods(intercept):
    yield captured


def statistic_size(module: nn.Module, shape: Sequence[int]) -> int:
  """Values per statistic of a norm layer whose input has ``shape``."""
  axis = module.axis if isinstance(module.axis, int) else -1
  return math.prod(shape) // shape[axis]


def norm_layer_sizes(
    model: nn.Module, input_shape: Sequence[int]
) -> dict[str, int]:
  """``{norm layer: n}`` of ``model`` on a float32 input of ``input_shape``.

  Only shapes are traced (``jax.eval_shape``): nothing is computed, and a
  norm layer's output has its input's shape, so the sizes are exact.
  """
  images = jax.ShapeDtypeStruct(tuple(input_shape), jnp.float32)
  with capture_calls() as captured:
    jax.eval_shape(
        lambda x: model.init(jax.random.key(0), x, train=True), images
    )
  return {
      name: statistic_size(call.module, call.input.shape)
      for name, call in captured.items()
  }


def gaussian_gain(norm: str, calibration: str | None, n: int) -> float:
  """The gain ``sigma/D`` a norm layer gives a Gaussian feature of ``n`` values.

  1 for BatchNorm (``bn``, ``sd``) and for a calibrated measure (its ``D``
  is divided by exactly its Gaussian value); ``1 / normal_constant(n)`` of
  the measure (``gbn_jax``'s, what ``calibration='normal'`` divides by) for
  a raw one and for ``bn_gain:<measure>`` (BatchNorm's sigma times that
  constant).

  Raises:
    ValueError: ``norm`` is no ``--norm`` value.
  """
  spec = models.parse_norm(norm)
  target = spec.gain_of
  if target is None:
    if spec.measure in (None, "sd") or calibration == "normal":
      return 1.0
    target = spec
  measure = gbn_jax.get_measure(
      target.measure,
      **({} if target.alpha is None else {"alpha": target.alpha}),
  )
  return 1.0 / float(measure.normal_constant(n))


def norm_layer_record(
    config: configs.Config, model: nn.Module, input_shape: Sequence[int]
) -> dict[str, Any]:
  """:data:`NORM_LAYERS_FILE`'s content for a run of ``config`` (module doc).

  Args:
    config: The run's config (the fields that set the record).
    model: The run's model, built from ``config``.
    input_shape: One training batch's shape, batch first.
  """
  sizes = norm_layer_sizes(model, input_shape)
  return {
      "dataset": config.dataset,
      "model": config.model,
      "batch_size": int(input_shape[0]),
      "norm": config.norm,
      "calibration": config.calibration,
      "layers": {
          name: {
              "n": n,
              "gaussian": gaussian_gain(config.norm, config.calibration, n),
          }
          for name, n in sizes.items()
      },
  }


def write_norm_layers(
    workdir: str | Path,
    config: configs.Config,
    model: nn.Module,
    input_shape: Sequence[int],
) -> Path:
  """Writes :data:`NORM_LAYERS_FILE` into the run directory ``workdir``."""
  path = Path(workdir) / NORM_LAYERS_FILE
  record = norm_layer_record(config, model, input_shape)
  checkpointing.atomic_write_text(path, json.dumps(record, indent=1) + "\n")
  return path
