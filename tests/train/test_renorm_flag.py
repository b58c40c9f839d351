"""The training suite's --renorm: a renormalized run trains, old configs load.

Batch renormalization itself (the layers) is tested in
tests/gbn_jax/test_renorm.py.
"""

import numpy as np
import pytest

import gbn_jax
from train import configs
from train.loop import train_state
from train.loop import trainer as train

from tests.helpers.training import TINY
from tests.helpers.training import run_quiet
from tests.helpers.training import small_dataset


@pytest.mark.slow
def test_training_cli_renorm_trains_and_precise_stats_are_finite(tmp_path):
  config = train.resolve(TINY.replace(norm="bn", renorm=True, epochs=2))
  model = train_state.create_model(config, 10)
  norm = model.norm(use_running_average=False)
  assert isinstance(norm, gbn_jax.GBatchNorm) and norm.measure == "sd"
  assert norm.renorm and dict(norm.renorm_clipping) == {
      "rmax": 3.0,
      "dmax": 5.0,
  }
  history = train.train_and_evaluate(
      config,
      tmp_path / "run",
      dataset=small_dataset(),
      progress=False,
      log=lambda line: None,
      precise_stats=2,
  )
  for row in history:
    assert np.isfinite(row["train_loss"])
    assert 0 <= row["test_error_precise"] <= 1
  plain = run_quiet(
      config.replace(renorm=False), tmp_path / "plain", dataset=small_dataset()
  )
  assert plain[-1]["train_loss"] != history[-1]["train_loss"]
  # config.json written before renorm existed still loads, as renorm off.
  data = config.to_json()
  for field in configs.ADDED_FIELDS:
    del data[field]
  assert configs.Config.from_json(data) == config.replace(renorm=False)
  with pytest.raises(ValueError, match="missing fields"):
    configs.Config.from_json({k: v for k, v in data.items() if k != "seed"})
  with pytest.raises(ValueError, match="--renorm-rmax must be >= 1"):
    configs.validate(config.replace(renorm_rmax=0.5))
