"""``python -m train.curvature``: the Hessian's eigenvalues and trace and the
gradient noise scale against a dense computation, and the CLI on a run.

The dense Hessian is ``jax.hessian`` of the sample's mean loss over the
flattened parameters of a tiny network with a norm layer per measure (the
quick tier's measures; every measure in the full run), its spectrum
``numpy.linalg.eigvalsh``'s; the noise scale is recomputed with numpy from
per-batch gradients taken with ``jax.grad``.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
from pathlib import Path
import struct

import flax
import flax.linen as nn
import jax
from jax import flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from train import configs
from train import mnist
from train.curvature import cli as curvature
from train.curvature import hessian as hessian_lib
from train.loop import checkpointing
from train.loop import train_state
from train.loop import train_steps
from train.model import models

from tests.helpers import tiers
from tests.helpers.process import forced_host_devices
from tests.helpers.process import run_python

BATCHES, BATCH, FEATURES, CLASSES = 3, 8, 4, 3
WEIGHT_DECAY = 0.01


def _layer(measure: str) -> gbn_jax.GBatchNorm:
  required = gbn_jax.MEASURES[measure].required
  return gbn_jax.GBatchNorm(
      use_running_average=False,
      measure=measure,
      alpha=0.3 if "alpha" in required else None,
      # Some features pass the ReLU whatever the centre (wcd's is the max).
      bias_init=nn.initializers.constant(0.5),
  )


class _Tiny(nn.Module):
  """Per measure, dense -> norm -> relu; then one dense over them all."""

  measures: tuple[str, ...]

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train  # always batch statistics, as in training
    branches = [nn.relu(_layer(m)(nn.Dense(1)(x))) for m in self.measures]
    return nn.Dense(CLASSES)(jnp.concatenate(branches, axis=-1))


def _problem(*measures: str):
  """The model's loss, parameters, statistics and sample."""
  model = _Tiny(measures)
  keys = jax.random.split(jax.random.key(0), 4)
  images = jax.random.normal(keys[0], (BATCHES, BATCH, FEATURES))
  labels = jax.random.randint(keys[1], (BATCHES, BATCH), 0, CLASSES)
  # Random values of init's shapes: an eager init would run every measure
  # op by op. Training mode reads no running average.
  shapes = jax.eval_shape(model.init, keys[2], images[0])
  leaves, tree = jax.tree.flatten(shapes)
  variables = jax.tree.unflatten(
      tree,
      [
          0.5 * jax.random.normal(key, leaf.shape)
          for key, leaf in zip(jax.random.split(keys[3], len(leaves)), leaves)
      ],
  )
  loss = curvature.training_loss(model, WEIGHT_DECAY)
  return loss, variables["params"], variables["batch_stats"], images, labels


def _dense(loss, params, stats, images, labels):
  """The sample's dense Hessian (symmetrized) and per-batch gradients, flat,
  in float64."""
  flat, unravel = flatten_util.ravel_pytree(params)

  def batch_losses(w):
    # vmap keeps each batch's statistics its own.
    return jax.vmap(lambda x, y: loss(unravel(w), stats, x, y))(images, labels)

  def both(w):
    return jax.hessian(lambda w: jnp.mean(batch_losses(w)))(w), jax.jacrev(
        batch_losses
    )(w)

  hessian, grads = (np.asarray(a, np.float64) for a in jax.jit(both)(flat))
  return (hessian + hessian.T) / 2, grads


def _network(*measures: str):
  """A network with a layer of each of ``measures`` (one compilation for
  all), its dense Hessian and per-batch gradients, and its
  :class:`SampleHessian`."""
  problem = _problem(*measures)
  return problem, *_dense(*problem), hessian_lib.SampleHessian(*problem)


@pytest.fixture(scope="module")
def every_measure():
  return _network(*gbn_jax.MEASURES)


@pytest.fixture(scope="module")
def quick_measures():
  """The quick tier's network: a layer of each of its measures."""
  return _network(*sorted(tiers.QUICK_MEASURES))


def _check_against_dense(dense, hessian) -> None:
  size = hessian.size
  scale = np.abs(dense).max()
  columns = np.stack([hessian.matvec(e) for e in np.eye(size)], axis=1)
  np.testing.assert_allclose(columns, dense, atol=1e-5 * scale)
  # With as many iterations as parameters, Lanczos finds the whole spectrum.
  ritz, residuals = hessian_lib.lanczos(
      hessian.matvec, size, size, np.random.default_rng(0)
  )
  exact = np.linalg.eigvalsh(dense)
  np.testing.assert_allclose(ritz, exact, atol=1e-5 * scale)
  assert residuals.max() < 1e-5 * scale
  settings = hessian_lib.Settings(
      batches=BATCHES, eigenvalues=4, iterations=size, probes=2
  )
  result = hessian_lib.measure(hessian, settings, BATCH)
  np.testing.assert_allclose(
      result["eigenvalues"], exact[::-1][:4], atol=1e-5 * scale
  )
  assert result["parameters"] == size


@pytest.mark.parametrize(
    "network",
    ["quick_measures", pytest.param("every_measure", marks=pytest.mark.slow)],
)
def test_products_and_eigenvalues_equal_the_dense_hessian(network, request):
  _, dense, _, hessian = request.getfixturevalue(network)
  _check_against_dense(dense, hessian)


def test_hutchinson_trace_is_within_its_standard_error(quick_measures):
  _, dense, _, hessian = quick_measures
  probes = 400
  settings = hessian_lib.Settings(
      batches=BATCHES, eigenvalues=1, iterations=2, probes=probes, seed=3
  )
  result = hessian_lib.measure(hessian, settings, BATCH)
  # Var(z^T H z) over Rademacher z is 2 * sum of the squared off-diagonal.
  variance = 2 * (np.sum(dense**2) - np.sum(np.diag(dense) ** 2))
  exact_stderr = math.sqrt(variance / probes)
  # The reported standard error estimates this one: its relative error is
  # about sqrt(kurtosis / probes), well inside a factor 2 here.
  assert 0.5 * exact_stderr < result["trace_stderr"] < 2 * exact_stderr
  error = abs(result["trace"] - np.trace(dense))
  assert error < 4 * exact_stderr, (error, exact_stderr)
  assert error < 4 * result["trace_stderr"]


def test_noise_scale_equals_numpy_from_per_batch_gradients(quick_measures):
  _, _, grads, hessian = quick_measures
  settings = hessian_lib.Settings(
      batches=BATCHES, eigenvalues=1, iterations=2, probes=2
  )
  result = hessian_lib.measure(hessian, settings, BATCH)
  # McCandlish et al. appendix A, with B_small = BATCH and B_big the sample.
  small = np.mean(np.sum(grads**2, axis=1))
  big_size = BATCHES * BATCH
  big = np.sum(grads.mean(axis=0) ** 2)
  norm_sq = (big_size * big - BATCH * small) / (big_size - BATCH)
  trace = (small - big) / (1 / BATCH - 1 / big_size)
  assert norm_sq > 0
  np.testing.assert_allclose(result["gradient_norm_sq"], norm_sq, rtol=1e-5)
  np.testing.assert_allclose(
      result["gradient_variance_trace"], trace, rtol=1e-5
  )
  np.testing.assert_allclose(result["noise_scale"], trace / norm_sq, rtol=1e-5)
  # Equal per-batch gradients: no noise.
  same = hessian_lib.noise_scale(np.stack([grads[0]] * 3), BATCH)
  assert same["noise_scale"] == 0.0


def test_settings_and_lanczos_sizes_are_checked():
  with pytest.raises(ValueError, match="--batches"):
    hessian_lib.Settings(batches=1).validate()
  with pytest.raises(ValueError, match="--iterations"):
    hessian_lib.Settings(eigenvalues=5, iterations=4).validate()
  with pytest.raises(ValueError, match=r"\[1, 3\]"):
    hessian_lib.lanczos(lambda v: v, 3, 4, np.random.default_rng(0))


def _write_tiny_mnist(folder: Path) -> Path:
  """64 training and 16 test images as gzipped IDX files."""
  rng = np.random.default_rng(0)
  folder.mkdir(parents=True)
  for prefix, n in (("train", 64), ("t10k", 16)):
    labels = rng.integers(0, 10, n).astype(np.uint8)
    images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
    for i, k in enumerate(labels):  # a learnable bright patch per class
      images[i, 2 + 6 * (k // 4) :][:4, 2 + 6 * (k % 4) :][:, :4] = 250
    for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
      header = bytes([0, 0, 8, array.ndim]) + b"".join(
          struct.pack(">i", size) for size in array.shape
      )
      path = folder / f"{prefix}-{kind}-ubyte.gz"
      path.write_bytes(gzip.compress(header + array.tobytes()))
  return folder


def _saved_run(run: Path, config: configs.Config, devices: int = 1) -> None:
  """A run folder as training leaves it, with one checkpoint (epoch 1) of
  the initial state, saved as the trainer saves its epochs (replicated on
  ``devices`` devices): the CLI reads the folder, not the training."""
  checkpointing.write_config(run, config)
  state = train_state.create_train_state(
      train_steps.init_key(config.seed),
      train_state.create_model(config, 10),
      (28, 28, 1),
      train_state.create_optimizer(config),
  )
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  saved = jax.device_put(train_state.state_dict(state), replicated)
  checkpointer = checkpointing.Checkpointer(run)
  try:
    checkpointer.save(1, saved, [{"epoch": 1}])
  finally:
    checkpointer.close()


def test_cli_measures_each_checkpoint_once_and_resumes_quick(tmp_path, capsys):
  data = _write_tiny_mnist(tmp_path / "data")
  run = tmp_path / "run"
  _saved_run(run, configs.MNIST.replace(epochs=2, batch_size=16, norm="rbd"))
  small = ["--data-dir", str(data), "--batches", "2", "--batch-size", "8",
           "--eigenvalues", "2", "--iterations", "3", "--probes", "2",
           "--no-progress"]  # fmt: skip
  assert curvature.main([str(run), *small]) == 0
  lines = curvature.read_lines(run)
  assert [(line["epoch"], line["step"]) for line in lines] == [(1, 4)]
  (line,) = lines
  assert line["settings"] == {
      "batches": 2, "batch_size": 8, "eigenvalues": 2, "iterations": 3,
      "probes": 2, "seed": 0,
  }  # fmt: skip
  assert line["batch_hvps"] == 2 * (3 + 2)
  assert line["weight_decay"] == 5e-4
  assert len(line["eigenvalues"]) == 2
  assert line["eigenvalues"][0] >= line["eigenvalues"][1]
  assert all(math.isfinite(line[k]) for k in ("trace", "trace_stderr"))
  assert line["gradient_variance_trace"] > 0
  assert "epoch 1: top eigenvalue" in capsys.readouterr().out

  # Measured checkpoints are skipped; epoch 0 (the initial state, from the
  # config) or new settings are added.
  text = (run / curvature.CURVATURE_FILE).read_text()
  assert curvature.main([str(run), *small]) == 0
  assert (run / curvature.CURVATURE_FILE).read_text() == text
  assert curvature.main([str(run), *small, "--checkpoints", "0,1"]) == 0
  assert curvature.main([str(run), *small, "--checkpoints", "last",
                         "--seed", "1"]) == 0  # fmt: skip
  lines = curvature.read_lines(run)
  assert [(line["epoch"], line["settings"]["seed"]) for line in lines] == [
      (1, 0), (0, 0), (1, 1),
  ]  # fmt: skip
  assert json.loads(text.splitlines()[0]) == lines[0]

  capsys.readouterr()
  assert curvature.main([str(run), *small, "--checkpoints", "7"]) == 1
  assert "no checkpoint of epoch 7; its checkpoints: 1" in (
      capsys.readouterr().err
  )


@pytest.mark.slow  # a subprocess on two host devices
def test_cli_measures_a_run_saved_from_several_devices(tmp_path, capsys):
  # Training replicates its state over every device; measuring runs on one.
  data = _write_tiny_mnist(tmp_path / "data")
  run = tmp_path / "run"
  config = configs.MNIST.replace(epochs=2, batch_size=16, norm="rbd")
  run_python(
      "import json, sys; from pathlib import Path; from train import configs; "
      "from tests.train.test_curvature import _saved_run; "
      "config = configs.Config.from_json(json.loads(sys.argv[2])); "
      "_saved_run(Path(sys.argv[1]), config, devices=2)",
      env=forced_host_devices(2),
      args=(str(run), json.dumps(config.to_json())),
  )
  small = ["--data-dir", str(data), "--batches", "2", "--batch-size", "8",
           "--eigenvalues", "1", "--iterations", "2", "--probes", "2",
           "--no-progress"]  # fmt: skip
  assert curvature.main([str(run), *small]) == 0, capsys.readouterr().err
  (line,) = curvature.read_lines(run)
  assert line["epoch"] == 1 and math.isfinite(line["eigenvalues"][0])


@pytest.mark.slow
def test_cli_measures_each_checkpoint_once_and_resumes(tmp_path, capsys):
  data = _write_tiny_mnist(tmp_path / "data")
  run = tmp_path / "run"
  trained = mnist.main([
      "--data-dir", str(data), "--workdir", str(run), "--batch-size", "16",
      "--epochs", "2", "--norm", "rbd", "--no-progress",
  ])  # fmt: skip
  assert trained == 0
  small = ["--data-dir", str(data), "--batches", "2", "--batch-size", "8",
           "--eigenvalues", "2", "--iterations", "3", "--probes", "2",
           "--no-progress"]  # fmt: skip
  assert curvature.main([str(run), *small]) == 0
  lines = curvature.read_lines(run)
  assert [line["epoch"] for line in lines] == [1, 2]
  assert [line["step"] for line in lines] == [4, 8]  # 64 images, batch 16
  for line in lines:
    assert line["settings"] == {
        "batches": 2, "batch_size": 8, "eigenvalues": 2, "iterations": 3,
        "probes": 2, "seed": 0,
    }  # fmt: skip
    assert line["batch_hvps"] == 2 * (3 + 2)
    assert line["weight_decay"] == 5e-4
    assert len(line["eigenvalues"]) == 2
    assert line["eigenvalues"][0] >= line["eigenvalues"][1]
    assert all(math.isfinite(line[k]) for k in ("trace", "trace_stderr"))
    assert line["gradient_variance_trace"] > 0
  assert "epoch 2: top eigenvalue" in capsys.readouterr().out

  # Measured checkpoints are skipped; new settings or epoch 0 are added.
  text = (run / curvature.CURVATURE_FILE).read_text()
  assert curvature.main([str(run), *small]) == 0
  assert (run / curvature.CURVATURE_FILE).read_text() == text
  assert curvature.main([str(run), *small, "--checkpoints", "0,2"]) == 0
  assert curvature.main([str(run), *small, "--checkpoints", "last",
                         "--seed", "1"]) == 0  # fmt: skip
  lines = curvature.read_lines(run)
  assert [(line["epoch"], line["settings"]["seed"]) for line in lines] == [
      (1, 0), (2, 0), (0, 0), (2, 1),
  ]  # fmt: skip
  assert json.loads(text.splitlines()[0]) == lines[0]

  capsys.readouterr()
  assert curvature.main([str(run), *small, "--checkpoints", "7"]) == 1
  assert "no checkpoint of epoch 7; its checkpoints: 1, 2" in (
      capsys.readouterr().err
  )


def test_cli_refuses_a_run_without_checkpoints(tmp_path, capsys):
  fresh = tmp_path / "fresh"
  checkpointing.write_config(fresh, configs.MNIST)
  assert curvature.main([str(fresh), "--no-progress"]) == 1
  err = capsys.readouterr().err
  assert "has no checkpoints" in err and "--checkpoints 0" in err
  assert not (fresh / checkpointing.CHECKPOINT_DIR).exists()
  assert not (fresh / curvature.CURVATURE_FILE).exists()
  assert curvature.main([str(tmp_path / "nothing")]) == 1
  assert "config.json does not exist" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    curvature.main([str(fresh), "--checkpoints", "x"])


@pytest.mark.slow  # ResNet20's Hessian-vector products compiled
def test_a_resnets_products_go_through_its_convolutions():
  # ResNet's CPU convolution has reverse-mode rules only; the model the
  # tool builds swaps in nn.Conv, the same parameters and function.
  model = models.ResNet(
      num_classes=2,
      norm=models.make_norm("rbd"),
      blocks_per_stage=1,
      stage_features=(2,),
  )
  twice = models.with_forward_mode(model)
  assert twice.conv is flax.linen.Conv and model.conv is None
  x = jax.random.normal(jax.random.key(0), (2, 4, 6, 6, 1))
  variables = jax.jit(functools.partial(twice.init, train=False))(
      jax.random.key(1), x[0]
  )
  hessian = hessian_lib.SampleHessian(
      curvature.training_loss(twice, 0.0),
      variables["params"],
      variables["batch_stats"],
      x,
      jnp.zeros((2, 4), jnp.int32),
  )
  product = hessian.matvec(np.ones(hessian.size))
  assert product.shape == (hessian.size,) and np.isfinite(product).all()
