"""``python -m train.gain RUN_DIR...``: the gain sigma/D each norm layer meets.

A norm layer divides its input by ``D``; relative to BatchNorm it multiplies
the feature by the *gain* ``sigma/D`` (``sigma``: the feature's standard
deviation over the same elements). For a Gaussian feature the gain is a
constant of the measure (``1/Measure.normal_constant``: 2.5 for ``rsd``,
about 0.1 for ``rbd``), which is what ``calibration='normal'`` removes. Real
pre-normalization activations are not Gaussian, so this tool measures the
gain as actually met: it runs one training-mode forward pass of a run's
model on the first ``--images`` training images (in file order, the same for
every run), captures every norm layer's input, and per feature takes
``sigma`` and the layer's own ``D`` (its measure, ``alpha`` and calibration,
exactly as the layer computes them, over the same axes).

It does this twice: with the parameters the run started from (``init``: the
run's seed, as ``train.loop.train_steps.init_key`` gives) and with its last
checkpoint (``final``; left out, with a note, when the run directory has none,
as the committed ``results/`` runs have not). Each run directory gets
``gain.json``::

  {"norm": "sqd1", "calibration": null, "images": 1000,
   "init":  {"layers": {"norm1": {"median": 2.31, "q25": 2.2, "q75": 2.4,
                                  "gaussian": 2.36, "n": 150528}, ...},
             "overall": 2.33,
             "measures": {"sd": 1.0, "mad": 1.27, ...}},
   "final": {... as init ..., "epoch": 5}}

``median``/``q25``/``q75`` are over the layer's features; ``gaussian`` is the
gain the same layer would have on Gaussian data of the same size; ``overall``
is the median over layers of the layer medians; ``measures`` gives, for every
built-in measure, the overall *raw* (uncalibrated) gain on the same
activations, which says how far real activations are from the Gaussian
constants whatever the run's own norm. ``bn`` (flax's BatchNorm) has gain 1
by definition and is measured as ``sd``.

``--norm-layers`` writes only ``norm_layers.json`` (each norm layer's ``n``
and Gaussian gain, see :mod:`train.loop.capture`), which training records since
it exists, for older runs; it needs no data.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
from pathlib import Path
import sys
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import gbn_jax
from gbn_jax import measures as measures_lib
from train.data import input_pipeline
from train.data import subset as data_subset
from train.loop import capture
from train.loop import checkpointing
from train.loop import train_state
from train.loop import train_steps
from train.loop import trainer as train_lib

_PROG = "python -m train.gain"
GAIN_FILE = "gain.json"
#: The registered measures whose raw gain is reported for every run (``sqd``
#: itself needs an ``alpha``: its named levels stand for it).
RAW_MEASURES = tuple(name for name in gbn_jax.MEASURES if name != "sqd")


def _layer_measure(module: nn.Module) -> measures_lib.MeasureFn:
  """What the layer divides by, as the layer computes it."""
  if isinstance(module, gbn_jax.GBatchNorm):
    return measures_lib.resolve_measure(
        module.measure, module.calibration, alpha=module.alpha
    )
  return measures_lib.get_measure("sd")  # flax's BatchNorm


def capture_norm_inputs(
    model: nn.Module, variables: dict[str, Any], images: jax.Array
) -> dict[str, tuple[nn.Module, np.ndarray]]:
  """Every norm layer's input in one training-mode forward pass.

  Returns:
    ``{layer path: (the bound module, its input as float32 numpy)}``, in call
    order. Norm layers are flax ``BatchNorm`` and ``gbn_jax.GBatchNorm``.
  """
  with capture.capture_calls() as captured:
    model.apply(variables, images, train=True, mutable=["batch_stats"])
  return {
      name: (call.module, np.asarray(call.input, np.float32))
      for name, call in captured.items()
  }


def _feature_gains(
    x: np.ndarray, measure: measures_lib.MeasureFn, feature_axis: int
) -> np.ndarray:
  """``sigma / D`` per feature; ``x`` reduced over all other axes."""
  feature_axis %= x.ndim
  axes = tuple(a for a in range(x.ndim) if a != feature_axis)
  x64 = x.astype(np.float64)
  sigma = np.sqrt(
      np.mean(np.square(x64 - x64.mean(axis=axes, keepdims=True)), axis=axes)
  )
  _, d = measure(jnp.asarray(x), axes)
  d = np.asarray(d, np.float64).reshape(sigma.shape)
  with np.errstate(divide="ignore", invalid="ignore"):
    return sigma / d


def _summary(gains: np.ndarray) -> dict[str, float]:
  finite = gains[np.isfinite(gains)]
  if finite.size == 0:
    return {"median": float("nan"), "q25": float("nan"), "q75": float("nan")}
  q25, median, q75 = np.percentile(finite, [25, 50, 75])
  return {"median": float(median), "q25": float(q25), "q75": float(q75)}


def layer_gains(
    captured: dict[str, tuple[nn.Module, np.ndarray]],
) -> dict[str, Any]:
  """One stage's entry of ``gain.json`` from :func:`capture_norm_inputs`."""
  layers, raw = {}, {name: [] for name in RAW_MEASURES}
  for name, (module, x) in captured.items():
    axis = module.axis if isinstance(module.axis, int) else -1
    measure = _layer_measure(module)
    n = capture.statistic_size(module, x.shape)
    entry = _summary(_feature_gains(x, measure, axis))
    if isinstance(measure, measures_lib.Measure) and (
        measure.normal_scale is not None
    ):
      constant = float(measure.normal_constant(n))
      if measure.calibration == "normal":
        constant = 1.0  # D is already divided by its Gaussian value
      entry["gaussian"] = 1.0 / constant
    entry["n"] = int(n)
    layers[name] = entry
    for raw_name in RAW_MEASURES:
      raw[raw_name].append(
          _summary(_feature_gains(x, measures_lib.get_measure(raw_name), axis))[
              "median"
          ]
      )
  medians = [entry["median"] for entry in layers.values()]
  return {
      "layers": layers,
      "overall": float(np.median(medians)) if medians else float("nan"),
      "measures": {
          name: float(np.median(values))
          for name, values in raw.items()
          if values
      },
  }


def _first_images(
    config, data_dir: str | None, count: int
) -> tuple[jax.Array, int]:
  # The images the run trained on: its subset when it had one.
  dataset = data_subset.for_config(
      input_pipeline.load_dataset(config.dataset, data_dir=data_dir), config
  )
  if count > len(dataset.train_images):
    raise ValueError(
        f"--images {count} is more than the "
        f"{len(dataset.train_images)} training images"
    )
  return input_pipeline.normalize_images(
      jnp.asarray(dataset.train_images[:count]), config.dataset
  ), (dataset.num_classes)


def run_gains(
    workdir: str | Path,
    *,
    data_dir: str | None = None,
    images: int | None = None,
) -> dict[str, Any]:
  """``gain.json``'s content for one run directory (see the module doc).

  Args:
    workdir: A run directory (``config.json``; ``checkpoints/`` for the final
      stage).
    data_dir: Where the dataset's files are (as the training CLI's).
    images: How many of the first training images (default: the run's batch
      size, so each statistic has the size it had in training).

  Raises:
    checkpointing.RunDirError: No readable ``config.json``.
    checkpointing.CheckpointError: The latest checkpoint is unreadable.
    ValueError: ``images`` is not a positive count within the training set.
  """
  workdir = Path(workdir)
  config = train_lib.resolve(checkpointing.read_config(workdir))
  count = config.batch_size if images is None else images
  if count < 1:
    raise ValueError(f"--images must be positive, got {count}")
  x, num_classes = _first_images(config, data_dir, count)
  model = train_state.create_model(config, num_classes)
  state = train_state.create_train_state(
      train_steps.init_key(config.seed),
      model,
      tuple(x.shape[1:]),
      train_state.create_optimizer(config),
  )
  state = jax.tree.map(jnp.asarray, state)  # as jitted training makes it
  result: dict[str, Any] = {
      "norm": config.norm,
      "calibration": config.calibration,
      "images": count,
  }

  def stage(state) -> dict[str, Any]:
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    return layer_gains(capture_norm_inputs(model, variables, x))

  result["init"] = stage(state)
  result["final"] = None
  result["note"] = "no checkpoint: only the initial gain"
  # A Checkpointer would create checkpoints/ in a run directory without one.
  if (workdir / checkpointing.CHECKPOINT_DIR).is_dir():
    checkpointer = checkpointing.Checkpointer(workdir)
    try:
      last = checkpointer.latest_epoch()
      if last is not None:
        restored, _ = checkpointer.restore(last, train_state.state_dict(state))
        final = flax.serialization.from_state_dict(state, restored)
        result["final"] = {**stage(final), "epoch": int(last)}
        del result["note"]
    finally:
      checkpointer.close()
  return result


def record_norm_layers(workdir: str | Path) -> Path:
  """Writes ``capture.NORM_LAYERS_FILE`` for a run trained before training
  wrote it; returns its path. Needs no data, only the dataset's shape.

  Raises:
    checkpointing.RunDirError: No readable ``config.json``.
  """
  config = train_lib.resolve(checkpointing.read_config(workdir))
  info = input_pipeline.dataset_info(config.dataset)
  return capture.write_norm_layers(
      workdir,
      config,
      train_state.create_model(config, info.num_classes),
      (config.batch_size, *info.image_shape),
  )


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog=_PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1]
  )
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument(
      "--data-dir", default=None, help="the dataset's folder, as for training"
  )
  parser.add_argument(
      "--images",
      type=int,
      default=None,
      help="first training images to use (default: the " "run's batch size)",
  )
  parser.add_argument(
      "--norm-layers",
      action="store_true",
      help=f"only write {capture.NORM_LAYERS_FILE} (each norm layer's n "
      "and Gaussian gain, which training records since it exists) for "
      "older runs; needs no data",
  )
  args = parser.parse_args(argv)
  if args.norm_layers:
    for run_dir in args.run_dirs:
      print(record_norm_layers(run_dir))
    return 0
  for run_dir in args.run_dirs:
    result = run_gains(run_dir, data_dir=args.data_dir, images=args.images)
    path = Path(run_dir) / GAIN_FILE
    checkpointing.atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    final = result["final"]
    print(
        f"{path}: {result['norm']}"
        f"{' (calibrated)' if result['calibration'] == 'normal' else ''} gain "
        f"{result['init']['overall']:.3f} at init"
        + (
            f", {final['overall']:.3f} after epoch {final['epoch']}"
            if final
            else " (no checkpoint)"
        )
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
