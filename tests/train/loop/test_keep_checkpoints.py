"""``--keep-checkpoints-every K``: every K-th epoch's checkpoint is kept.

The expected checkpoints are computed from the rule (the saved epochs'
latest ``MAX_TO_KEEP``, plus the multiples of K) with plain sets; a tiny
CLI run is then measured by ``python -m train.curvature`` at each of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from train import configs
from train import main as train_main
from train.curvature import cli as curvature
from train.loop import checkpointing

from tests.helpers.training import TINY
from tests.helpers.training import run_quiet
from tests.helpers.training import small_dataset
from tests.helpers.training import tiny_cli_args
from tests.helpers.training import write_tiny_mnist


def _on_disk(workdir) -> list[int]:
  folder = workdir / checkpointing.CHECKPOINT_DIR
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def _expected(saved: list[int], keep: int) -> list[int]:
  latest = set(sorted(saved)[-checkpointing.MAX_TO_KEEP :])
  return sorted(latest | {e for e in saved if e % keep == 0})


def test_checkpointer_keeps_the_multiples_and_the_latest(tmp_path):
  def state(epoch):
    return {"w": np.full(3, epoch, np.float32)}

  checkpointer = checkpointing.Checkpointer(tmp_path, keep_every=3)
  try:
    for epoch in range(1, 11):
      history = [{"epoch": e} for e in range(1, epoch + 1)]
      checkpointer.save(epoch, state(epoch), history)
    assert checkpointer.epochs() == _expected(list(range(1, 11)), 3)
    restored, history = checkpointer.restore(3, state(0))
  finally:
    checkpointer.close()
  assert _on_disk(tmp_path) == [3, 6, 8, 9, 10]
  np.testing.assert_array_equal(restored["w"], state(3)["w"])
  assert [row["epoch"] for row in history] == [1, 2, 3]
  # Without keep_every the latest alone stay.
  plain = checkpointing.Checkpointer(tmp_path / "plain")
  try:
    for epoch in range(1, 11):
      history = [{"epoch": e} for e in range(1, epoch + 1)]
      plain.save(epoch, state(epoch), history)
  finally:
    plain.close()
  assert _on_disk(tmp_path / "plain") == [8, 9, 10]


@pytest.mark.parametrize("every,keep", [(1, 2), (3, 2)])
def test_run_saves_and_keeps_every_kth_epoch(tmp_path, every, keep):
  ds = small_dataset()
  config = TINY.replace(epochs=7)
  history = run_quiet(
      config,
      tmp_path / "run",
      dataset=ds,
      checkpoint_every=every,
      keep_checkpoints_every=keep,
  )
  assert [row["epoch"] for row in history] == list(range(1, 8))
  # Saved at --checkpoint-every's epochs, the multiples of K and the last.
  saved = [e for e in range(1, 8) if e % every == 0 or e % keep == 0 or e == 7]
  assert _on_disk(tmp_path / "run") == _expected(saved, keep)
  assert _on_disk(tmp_path / "run") == (
      [2, 4, 5, 6, 7] if every == 1 else [2, 4, 6, 7]
  )


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_checkpoints_every_must_be_a_positive_integer(tmp_path, keep):
  with pytest.raises(ValueError, match="keep_checkpoints_every must be a"):
    run_quiet(
        TINY, tmp_path, dataset=small_dataset(), keep_checkpoints_every=keep
    )


def test_cli_flag_is_checked_and_explained(capsys):
  with pytest.raises(SystemExit) as exit_info:
    train_main.run(
        ["--keep-checkpoints-every", "0"], configs.MNIST, prog="train.mnist"
    )
  assert exit_info.value.code == 2
  assert "--keep-checkpoints-every: must be >= 1" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    train_main.run(["--help"], configs.CIFAR, prog="python -m train.cifar")
  text = " ".join(capsys.readouterr().out.split())
  assert "--keep-checkpoints-every K also save a checkpoint" in text
  assert "whatever --checkpoint-every" in text


def test_curvature_measures_each_kept_checkpoint(tmp_path, capsys):
  data = write_tiny_mnist(tmp_path / "data")
  run = tmp_path / "run"
  trained = train_main.run(
      tiny_cli_args(data, run, "--epochs", "6", "--norm", "bn",
                    "--checkpoint-every", "5", "--keep-checkpoints-every",
                    "2"),
      configs.MNIST,
      prog="train.mnist",
  )  # fmt: skip
  assert trained == 0
  assert _on_disk(run) == _expected([2, 4, 5, 6], 2) == [2, 4, 5, 6]
  small = ["--data-dir", str(data), "--batches", "2", "--batch-size", "8",
           "--eigenvalues", "2", "--iterations", "2", "--probes", "2",
           "--no-progress"]  # fmt: skip
  assert curvature.main([str(run), *small]) == 0
  lines = curvature.read_lines(run)
  assert [line["epoch"] for line in lines] == [2, 4, 5, 6]
  # 64 images in batches of 16: 4 steps an epoch.
  assert [line["step"] for line in lines] == [8, 16, 20, 24]
  # The checkpoints hold different parameters, so the measures differ.
  assert len({line["trace"] for line in lines}) == 4
  assert "epoch 6: top eigenvalue" in capsys.readouterr().out
