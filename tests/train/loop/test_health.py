"""Tests of train.loop.health: telling the user that training is dead, and why.

The decision is checked on synthetic loss sequences against chance level
written out here (``math.log`` of the class count); one short training run
on images that carry no information checks that the epoch loop says it once.
The probe of the norm layers' outputs is checked against measures of the
test's own whose centering fixes the fraction of positive outputs, and the
advice for a measure centered on the maximum by following it: flags read
from the note, parsed by the CLI's parser, train.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from train import cli_flags
from train import configs
from train.data import input_pipeline
from train.loop import health
from train.loop import trainer as train

from tests.helpers import training

LN10 = math.log(10)


def _flat(value: float, steps: int = 60) -> np.ndarray:
  return np.full(steps, value)


def _learning(steps: int = 60) -> np.ndarray:
  # A healthy first epoch: from chance down to well below it.
  return LN10 * np.exp(-np.linspace(0, 1.5, steps))


# ---------------------------------------------------------------------------
# at_chance.


def test_flat_at_chance_is_dead_and_learning_is_not():
  assert health.at_chance(_flat(LN10), 10)
  assert not health.at_chance(_learning(), 10)
  assert health.at_chance(_flat(math.log(100)), 100)
  assert not health.at_chance(_flat(LN10), 100)  # ln 10 is not chance for 100


def test_tolerance_is_one_percent_of_ln_classes():
  assert health.at_chance(_flat(LN10 * 1.009), 10)
  assert health.at_chance(_flat(LN10 * 0.991), 10)
  assert not health.at_chance(_flat(LN10 * 1.011), 10)
  assert not health.at_chance(_flat(LN10 * 0.989), 10)
  assert health.at_chance(_flat(LN10 * 1.03), 10, tolerance=0.05)


def test_noisy_steps_count_by_their_parts_means():
  rng = np.random.default_rng(0)
  # Each batch's loss is noisy (±5 %), the network still at chance.
  noisy = LN10 * (1 + rng.choice([-0.05, 0.05], size=200))
  noisy[1::2] = 2 * LN10 - noisy[::2]  # pairs average to chance exactly
  assert np.abs(noisy / LN10 - 1).max() > 0.04
  assert health.at_chance(noisy, 10)
  # One tenth of the epoch that learns is enough to say it is not dead.
  late = _flat(LN10, 200)
  late[-20:] = 1.5
  assert not health.at_chance(late, 10)
  early = _flat(LN10, 200)
  early[:20] = 1.5
  assert not health.at_chance(early, 10)


def test_too_few_steps_or_non_finite_say_nothing():
  assert not health.at_chance(_flat(LN10, health.MIN_STEPS - 1), 10)
  assert health.at_chance(_flat(LN10, health.MIN_STEPS), 10)
  with_nan = _flat(LN10)
  with_nan[5] = np.nan
  assert not health.at_chance(with_nan, 10)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(losses=_flat(LN10), num_classes=1), "num_classes"),
        (dict(losses=_flat(LN10), num_classes=10.0), "num_classes"),
        (dict(losses=_flat(LN10), num_classes=True), "num_classes"),
        (dict(losses=np.ones((5, 5)), num_classes=10), "losses"),
        (dict(losses=_flat(LN10), num_classes=10, tolerance=-1), "tolerance"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
  with pytest.raises(ValueError, match=name):
    health.at_chance(**kwargs)


# ---------------------------------------------------------------------------
# dead_training_note.


def _note(norm, calibration="none", losses=None, lr=0.1, **kwargs):
  return health.dead_training_note(
      _flat(LN10) if losses is None else losses,
      epoch=3,
      num_classes=10,
      norm=norm,
      learning_rate=lr,
      calibration=calibration,
      **kwargs,
  )


def _layers(*fractions):
  """LeNet's two norm layers' probe results, ``(positive, above_bias, bias)``
  each."""
  return {
      f"norm{i}": health.LayerOutputs(*f)
      for i, f in enumerate(fractions, start=1)
  }


# Each norm layer passes half its values (BatchNorm's, a median's).
ALIVE = _layers((0.5, 0.5, 0.0), (0.5, 0.5, 0.0))
# Centered at the maximum: nothing above the bias, and the bias is 0.
CENTERED_AT_MAX = _layers((0.0, 0.0, 0.0), (0.0, 0.0, 0.0))
# Centered inside the data, below a negative bias; norm2 then sees only
# norm1's zeros, a constant, and outputs exactly its bias.
BIAS_TOO_LOW = _layers((0.0, 0.5, -5.0), (0.0, 0.0, -5.0))


@pytest.mark.parametrize("norm", ["bn", "sd", "sqd2", "sqd:0.3", "bn_gain:rsd"])
def test_no_note_while_learning(norm):
  assert _note(norm, losses=_learning()) is None


def test_gbn_note_names_the_gain_and_both_fixes():
  note = _note("sqd2")
  assert "epoch 3" in note and "chance" in note and "ln 10 = 2.3026" in note
  assert "sqd2's gain" in note and "--lr 0.1" in note
  assert "--calibration normal" in note
  assert "smaller --lr (e.g. 0.01)" in note


@pytest.mark.parametrize("norm", ["bn", "sd"])
def test_batchnorm_note_blames_the_learning_rate_only(norm):
  note = _note(norm, lr=0.5)
  assert "--lr 0.5 is too large" in note and "e.g. 0.05" in note
  assert "calibration" not in note and "gain" not in note


def test_calibrated_or_gain_runs_are_not_told_to_calibrate():
  calibrated = _note("sqd1", calibration="normal")
  assert "--calibration normal" not in calibrated
  assert "smaller --lr" in calibrated and "already BatchNorm's" in calibrated
  gain = _note("bn_gain:rbd")
  assert "--calibration" not in gain and "smaller --lr" in gain


def _cause_and_fix(note):
  return note.split("Likely cause: ")[1]


def test_each_kind_of_dead_training_has_its_own_cause_and_fix():
  centered = _note("wcd", norm_outputs=CENTERED_AT_MAX)
  low_bias = _note("bn", norm_outputs=BIAS_TOO_LOW, norm_bias=-5.0)
  gain = _note("wcd", norm_outputs=ALIVE, norm_bias=1.0)
  rate = _note("bn", norm_outputs=ALIVE)
  causes = [_cause_and_fix(n) for n in (centered, low_bias, gain, rate)]
  assert len(set(causes)) == 4, causes
  # A measure centered at the maximum: the ReLU's zeros, not gain or rate.
  assert "norm1, norm2" in centered and "only zeros" in centered
  assert "at most the layer's bias (--norm-bias 0)" in centered
  assert "Fix: --norm-bias 1" in centered
  assert "--lr" not in centered and "--calibration" not in centered
  # A bias below every normalized value: back to the default.
  assert "--norm-bias -5 pulls every normalized value of norm1" in low_bias
  assert "Fix: --norm-bias 0" in low_bias and "--lr" not in low_bias
  # With its outputs alive, wcd's trouble is its gain, bn's the rate.
  assert "wcd's gain" in gain and "--calibration normal" in gain
  assert "--norm-bias" not in gain and "--norm-bias" not in rate
  assert "--lr 0.1 is too large" in rate


def test_calibration_does_not_hide_a_measure_centered_at_the_max():
  # Following the gain advice (--calibration normal) keeps the layers
  # centered at the maximum: the note must still say so, not blame --lr.
  note = _note("wcd", calibration="normal", norm_outputs=CENTERED_AT_MAX)
  assert "Fix: --norm-bias 1" in note and "smaller --lr" not in note
  # The same for a measure of the user's own: the probe decides, not the
  # name.
  note = _note("my_top", norm_outputs=CENTERED_AT_MAX)
  assert "my_top centers each feature" in note
  assert "Fix: --norm-bias 1" in note
  # Never the bias the run already has.
  note = _note("my_top", norm_outputs=CENTERED_AT_MAX, norm_bias=1.0)
  assert "Fix: a --norm-bias above 1," in note


def test_help_gives_wcd_its_bias():
  parser = cli_flags.build_parser(configs.MNIST, "train.mnist")
  # argparse's own record of its options.
  actions = parser._actions  # pylint: disable=protected-access
  helps = {a.option_strings[-1]: a.help for a in actions}
  assert re.search(r"wcd[^;.]* needs a positive --norm-bias", helps["--norm"])
  assert "--norm-bias" in helps and "--norm-bias" in parser.format_help()


def _probe(measure):
  with gbn_jax.registered_measure("test_health_probe", measure):
    config = configs.MNIST.replace(norm="test_health_probe")
    return health.probe_norm_outputs(config, 10, (28, 28, 1))


def test_probe_sees_a_measure_of_ones_own_centered_at_the_max():
  outputs = _probe(lambda x, axis: (jnp.max(x, axis), jnp.std(x, axis)))
  assert list(outputs) == ["norm1", "norm2"]
  for layer in outputs.values():
    assert layer.positive == 0 and layer.above_bias == 0 and layer.bias == 0
  assert "Fix: --norm-bias 1" in _note("top", norm_outputs=outputs)


def test_probe_counts_what_a_quantile_centering_leaves_above_it():
  # Centered on the 90th percentile: a tenth of each feature is above it.
  outputs = _probe(
      lambda x, axis: (jnp.quantile(x, 0.9, axis=axis), jnp.std(x, axis))
  )
  for name, layer in outputs.items():
    assert layer.positive == pytest.approx(0.1, abs=0.01), name
    assert layer.above_bias == layer.positive, name
  note = _note("q90", norm_outputs=outputs, calibration="normal")
  assert "--lr 0.1 is too large" in note


# ---------------------------------------------------------------------------
# DeadTrainingWatch and the epoch loop.


def test_watch_speaks_once():
  watch = health.DeadTrainingWatch(
      configs.CIFAR.replace(norm="sqd1"), probe=lambda: ALIVE
  )
  assert watch.after_epoch(1, _learning()) is None
  first = watch.after_epoch(2, _flat(LN10))
  assert first is not None and "epoch 2" in first and "sqd1" in first
  assert watch.after_epoch(3, _flat(LN10)) is None
  # CIFAR-100's chance level is ln 100.
  watch = health.DeadTrainingWatch(
      configs.CIFAR.replace(dataset="cifar100", norm="bn"), probe=lambda: ALIVE
  )
  assert watch.after_epoch(1, _flat(LN10)) is None
  assert "ln 100" in watch.after_epoch(2, _flat(math.log(100)))


def _blank_dataset(n_train: int, n_test: int) -> input_pipeline.Dataset:
  """Identical images, classes in turn: nothing to learn from the input.

  Every norm then outputs exactly its bias (zero) for every image, so the
  logits are the last layer's bias and the loss stays at ln 10.
  """
  shape = input_pipeline.dataset_info("mnist").image_shape
  return input_pipeline.Dataset(
      name="mnist",
      train_images=np.full((n_train, *shape), 128, np.uint8),
      train_labels=(np.arange(n_train) % 10).astype(np.int32),
      test_images=np.full((n_test, *shape), 128, np.uint8),
      test_labels=(np.arange(n_test) % 10).astype(np.int32),
      num_classes=10,
      source="blank",
  )


def test_epoch_loop_says_it_once(tmp_path):
  config = configs.MNIST.replace(
      epochs=2, batch_size=10, learning_rate=0.01, norm="sqd2"
  )
  steps = health.MIN_STEPS
  lines = []
  history = train.train_and_evaluate(
      config,
      tmp_path / "run",
      dataset=_blank_dataset(steps * config.batch_size, 10),
      progress=False,
      log=lines.append,
  )
  assert len(history) == 2
  for row in history:  # the premise: both epochs sat at chance
    assert abs(row["train_loss"] - LN10) <= 0.01 * LN10, row
  notes = [line for line in lines if "sat at chance level" in line]
  assert len(notes) == 1, lines
  assert notes[0].startswith("warning: epoch 1's") and "sqd2" in notes[0]


def _cli_run(argv, workdir, dataset):
  """A run of the config ``train.mnist`` would make of ``argv``: its history
  and the notes it logged."""
  parser = cli_flags.build_parser(configs.MNIST, "train.mnist")
  config = cli_flags.config_from_args(parser.parse_args(argv), configs.MNIST)
  lines = []
  history = train.train_and_evaluate(
      config, workdir, dataset=dataset, progress=False, log=lines.append
  )
  return history, [line for line in lines if "sat at chance level" in line]


@pytest.mark.slow  # two runs, each compiling its own program
def test_wcd_sits_at_chance_and_the_advice_trains(tmp_path):
  dataset = training.synthetic_dataset(health.MIN_STEPS * 16, 37)
  argv = ["--norm", "wcd", "--batch-size", "16", "--epochs", "1"]
  history, notes = _cli_run(argv, tmp_path / "default", dataset)
  assert abs(history[0]["train_loss"] - LN10) <= 0.01 * LN10, history
  assert len(notes) == 1 and "wcd centers each feature" in notes[0], notes
  # The first fix the note gives, as flags: what a user would type.
  fix = notes[0].split("Fix: ")[1].split(",")[0].split(" (")[0]
  advised = fix.split()
  assert re.fullmatch(r"--[a-z-]+ \S+", fix) and "--lr" not in advised, fix
  history, notes = _cli_run(argv + advised, tmp_path / "advised", dataset)
  assert history[0]["train_loss"] < 0.95 * LN10, (advised, history)
  assert not notes, notes
