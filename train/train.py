"""The training loop: data-parallel SGD with per-epoch checkpoints.

Data parallelism: one 1-D mesh ``('data',)`` over all devices (of all hosts).
The train state is replicated, every batch is sharded along its batch axis,
and the steps are plain ``jax.jit`` functions. XLA's SPMD partitioner then
reduces over the whole batch wherever the model does, so the GBN statistics
(means, quantiles, maxima...) are those of the GLOBAL batch, exactly as on
one device; no ``axis_name`` is needed. The mesh is built with
``AxisType.Auto``: ``jax.make_mesh`` now defaults to ``Explicit`` axes,
under which the sort of the quantile measures (``sqd*``) over the sharded
batch axis is rejected ("Arguments to sort must be unsharded over the
sorting dimension"), while with ``Auto`` XLA inserts the communication.

Data stays on the devices: the uint8 training set is replicated on each
device once, and each epoch one jitted call shuffles it (a permutation drawn
from ``(seed, epoch)``), drops the last partial batch, applies augmentation
(keys from ``(seed, epoch, step)``) and returns the epoch's batches, sharded.
That call is timed on its own (``data_seconds``); normalization to float is
fused into the train step. The test set is padded to whole batches and
evaluated with a mask, with the norms' running averages, so the test error
is over exactly all test images. On several hosts every host loads the same
files and supplies only its own devices' parts of each array
(``jax.make_array_from_callback``), and each device holds only its shard
of each batch.

Rows of ``metrics.jsonl``: ``epoch``, ``train_loss`` (mean over the epoch's
steps, in training mode), ``train_error``, ``test_loss``, ``test_error``
(``None`` on epochs without evaluation), ``best_test_error`` (so far),
``seconds`` (data + training + evaluation; compilation happens before the
first epoch and checkpointing after the timing), ``train_seconds`` (data +
training), ``data_seconds``, ``eval_seconds``, ``images_per_sec`` (training
images / ``train_seconds``) and ``elapsed_seconds`` (cumulative ``seconds``,
across resumptions).

Precise statistics (``--precise-stats N``): before each evaluation, the
norms' statistics are also recomputed as equal-weight averages over the
first ``N`` batches of the epoch just trained, with the parameters frozen
(:func:`gbn_jax.precise_batch_stats`, PreciseBN), inside one jitted call, and
the test set is evaluated with them too: ``test_loss_precise``,
``test_error_precise`` and ``precise_seconds`` (not part of ``seconds``) join
the row. The train state's running averages are not changed, and
``test_error`` is still the running-average one.

Activation recording (``--record-activations K``, the paper's Figure 1): every
``K`` steps the train step also returns a few percentiles of one feature
(channel) of one norm layer's input and output over the batch, captured with
``flax.linen.intercept_methods`` inside the jitted step, so any model and any
norm can be recorded without changing the model. Rows go to
``activations.jsonl``; recording does not change training.

Every random number is a function of ``(seed, epoch, step)``, and
checkpoints hold the whole train state plus the metrics history, so a run
resumed after a kill ends with the same metrics as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import json
import math
from pathlib import Path
import sys
import time
from typing import Any

import flax
import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import tqdm

import gbn_jax
from gbn_jax._selection import config as selection_config
from gbn_jax._selection import native as selection_native
from train import capture
from train import checkpointing
from train import configs
from train import convolution
from train import health
from train import input_pipeline
from train import models

DATA_AXIS = "data"
# fold_in tags that keep the random streams apart.
_INIT, _EPOCH, _PERMUTE, _AUGMENT = 0, 1, 0, 1


class NonFiniteLossError(RuntimeError):
  """The training loss became NaN or infinite."""


class TrainState(train_state.TrainState):
  batch_stats: Any


@dataclasses.dataclass(frozen=True)
class Placed:
  """A dataset split laid out on the mesh for training or evaluation.

  Attributes:
    images: uint8 images; ``(N, H, W, C)`` replicated (train) or
      ``(steps, batch, H, W, C)`` sharded along ``batch`` (test).
    labels: int32 labels shaped like ``images.shape[:-3]``.
    mask: For the test split, which entries are real images (not padding).
  """

  images: jax.Array
  labels: jax.Array
  mask: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class ActivationRecording:
  """What to record of one norm layer's activations during training.

  Attributes:
    every: Record at global steps 0, K, 2K, ...
    layer: The norm layer's module path, ``/``-separated (``norm2``: LeNet's
      second; ``stage2_block1/norm1`` in ResNet20).
    feature: Which channel (last axis) of the layer's input and output.
    percentiles: Percentiles (0-100) taken over the batch and any spatial
      axes; each is the ``ceil(p/100 * N)``-th smallest value
      (:func:`gbn_jax.quantile`).
  """

  every: int
  layer: str = "norm2"
  feature: int = 0
  percentiles: tuple[float, ...] = (5.0, 15.0, 50.0, 85.0, 95.0)


ACTIVATIONS_FILE = "activations.jsonl"


def resolve(config: configs.Config) -> configs.Config:
  """Fills ``augment=None`` with the dataset's default, then validates."""
  configs.validate(config)
  if config.augment is None:
    info = input_pipeline.dataset_info(config.dataset)
    config = config.replace(augment=bool(info.augment_by_default))
  return configs.validate(config)


def make_mesh(devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A 1-D data-parallel mesh over ``devices`` (default: all devices)."""
  devices = jax.devices() if devices is None else list(devices)
  return jax.make_mesh(
      (len(devices),),
      (DATA_AXIS,),
      axis_types=(jax.sharding.AxisType.Auto,),
      devices=devices,
  )


def data_parallel_devices(batch_size: int) -> list[jax.Device]:
  """All devices, or on one host the most that split the batch evenly.

  ``python -m train.*`` splits the CPU into one device per core
  (:mod:`train.host_devices`); a batch size that some of them do not divide
  then runs on fewer rather than failing. Several hosts always use them all.
  """
  devices = jax.devices()
  if jax.process_count() > 1:
    return devices
  count = max(d for d in range(1, len(devices) + 1) if batch_size % d == 0)
  return devices[:count]


def init_key(seed: int) -> jax.Array:
  """The key a run of ``seed`` initializes its parameters with."""
  return jax.random.fold_in(jax.random.key(seed), _INIT)


def epoch_key(seed: int, epoch: int) -> jax.Array:
  """The key of ``epoch``: a function of ``(seed, epoch)`` only."""
  return jax.random.fold_in(
      jax.random.fold_in(jax.random.key(seed), _EPOCH), epoch
  )


def create_model(config: configs.Config, num_classes: int) -> nn.Module:
  """The config's model with the config's norm (the one norm factory)."""
  clipping = (
      {"rmax": config.renorm_rmax, "dmax": config.renorm_dmax}
      if config.renorm
      else None
  )
  norm = models.make_norm(
      config.norm,
      momentum=config.norm_momentum,
      epsilon=config.norm_epsilon,
      renorm_clipping=clipping,
      calibration=config.calibration,
  )
  return models.create_model(config.model, num_classes=num_classes, norm=norm)


def create_optimizer(config: configs.Config) -> optax.GradientTransformation:
  """SGD (momentum optional) at a constant rate, with coupled L2 decay."""
  return optax.chain(
      optax.add_decayed_weights(config.weight_decay),
      optax.sgd(config.learning_rate, momentum=config.momentum or None),
  )


def create_train_state(
    rng: jax.Array,
    model: nn.Module,
    image_shape: tuple[int, ...],
    tx: optax.GradientTransformation,
) -> TrainState:
  """Initializes parameters, norm statistics and optimizer state."""
  variables = model.init(
      rng, jnp.zeros((1, *image_shape), jnp.float32), train=False
  )
  return TrainState.create(
      apply_fn=model.apply,
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      tx=tx,
  )


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-example softmax cross-entropy with integer labels."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def _percentiles(values: jax.Array, percentiles: Sequence[float]) -> jax.Array:
  flat = jax.lax.stop_gradient(values).reshape(-1)
  return jnp.stack(
      [gbn_jax.quantile(flat, p / 100, axis=0) for p in percentiles]
  )


def train_step(
    state: TrainState,
    images: jax.Array,
    labels: jax.Array,
    step: jax.Array,
    *,
    dataset: str,
    record: ActivationRecording | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One SGD step on batch ``step`` of the epoch's batches.

  Args:
    state: The train state.
    images: The epoch's uint8 batches, ``(steps, batch, H, W, C)``.
    labels: The epoch's labels, ``(steps, batch)``.
    step: Which batch.
    dataset: Dataset name, for its normalization constants.
    record: Also return percentiles of one norm layer's input and output.

  Returns:
    The new state and the batch's mean ``loss`` and ``errors`` count (and,
    with ``record``, ``before``/``after`` percentiles).

  Raises:
    ValueError: If ``record.layer`` is not a module of the model.
  """
  x = input_pipeline.normalize_images(images[step], dataset)
  y = labels[step]

  def loss_fn(params):
    captured = {}
    apply = functools.partial(
        state.apply_fn,
        {"params": params, "batch_stats": state.batch_stats},
        x,
        train=True,
        mutable=["batch_stats"],
    )
    if record is None:
      logits, updates = apply()
    else:
      with capture.capture_calls(
          lambda module: capture.module_path(module) == record.layer
      ) as calls:
        logits, updates = apply()
      for call in calls.values():
        captured["before"] = _percentiles(
            call.input[..., record.feature], record.percentiles
        )
        captured["after"] = _percentiles(
            call.output[..., record.feature], record.percentiles
        )
      if not captured:
        raise ValueError(
            f"--record-layer {record.layer!r} is not a layer of the model; "
            "norm layers: "
            + ", ".join(
                "/".join(str(k.key) for k in path[:-1])
                for path, _ in jax.tree_util.tree_flatten_with_path(
                    state.batch_stats
                )[0]
                if str(path[-1].key) == "mean"
            )
        )
    return jnp.mean(cross_entropy(logits, y)), (logits, updates, captured)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, (logits, updates, captured)), grads = grad_fn(state.params)
  state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
  errors = jnp.sum(jnp.argmax(logits, -1) != y)
  return state, {"loss": loss, "errors": errors, **captured}


def eval_model(
    state: TrainState,
    images: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
    *,
    dataset: str,
) -> dict[str, jax.Array]:
  """Summed test loss and errors over all masked-in images.

  Uses the norms' running averages, so padding can't affect the result.
  """

  def body(carry, batch):
    x, y, m = batch
    logits = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats},
        input_pipeline.normalize_images(x, dataset),
        train=False,
    )
    loss = jnp.sum(jnp.where(m, cross_entropy(logits, y), 0.0))
    errors = jnp.sum(m & (jnp.argmax(logits, -1) != y))
    return (carry[0] + loss, carry[1] + errors), None

  zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
  (loss, errors), _ = jax.lax.scan(body, zero, (images, labels, mask))
  return {"loss_sum": loss, "errors": errors, "count": jnp.sum(mask)}


def precise_eval_model(
    state: TrainState,
    images: jax.Array,
    test_images: jax.Array,
    test_labels: jax.Array,
    test_mask: jax.Array,
    *,
    dataset: str,
    batches: int,
    apply_fn: Callable[..., Any] | None = None,
) -> dict[str, jax.Array]:
  """:func:`eval_model` with statistics recomputed over training batches.

  Args:
    state: The train state; its ``batch_stats`` are not changed.
    images: The epoch's uint8 batches, ``(steps, batch, H, W, C)``; the
      first ``batches`` of them are used.
    test_images: As for :func:`eval_model`.
    test_labels: As for :func:`eval_model`.
    test_mask: As for :func:`eval_model`.
    dataset: Dataset name, for its normalization constants.
    batches: How many batches to average the statistics over.
    apply_fn: The model to recompute the statistics with (default: the
      state's). A batch-renormalized model passes its plain twin: a renorm
      layer's training output reads the running averages, so each layer's
      batch statistics are those of the layers normalizing by the batch's.

  Returns:
    :func:`eval_model`'s sums, with :func:`gbn_jax.precise_batch_stats`
    in place of the running averages.
  """

  def model_apply(variables, x):
    return (apply_fn or state.apply_fn)(
        variables,
        input_pipeline.normalize_images(x, dataset),
        train=True,
        mutable=["batch_stats"],
    )

  stats = gbn_jax.precise_batch_stats(
      model_apply,
      {"params": state.params, "batch_stats": state.batch_stats},
      images[:batches],
      stacked=True,
  )
  return eval_model(
      state.replace(batch_stats=stats),
      test_images,
      test_labels,
      test_mask,
      dataset=dataset,
  )


def prepare_epoch(
    images: jax.Array,
    labels: jax.Array,
    key: jax.Array,
    *,
    steps: int,
    batch_size: int,
    augment: bool,
) -> tuple[jax.Array, jax.Array]:
  """Shuffles, batches (dropping the remainder) and augments one epoch.

  Args:
    images: The whole uint8 training set, ``(N, H, W, C)``.
    labels: Its labels, ``(N,)``.
    key: :func:`epoch_key` of this epoch.
    steps: Batches per epoch (``N // batch_size``).
    batch_size: Global batch size.
    augment: Whether to apply ``input_pipeline.augment``.

  Returns:
    Images ``(steps, batch_size, H, W, C)`` and labels ``(steps,
    batch_size)``.
  """
  n = images.shape[0]
  order = jax.random.permutation(jax.random.fold_in(key, _PERMUTE), n)
  order = order[: steps * batch_size].reshape(steps, batch_size)
  x, y = images[order], labels[order]
  if augment:
    aug_key = jax.random.fold_in(key, _AUGMENT)
    step_keys = jax.vmap(functools.partial(jax.random.fold_in, aug_key))(
        jnp.arange(steps)
    )
    x = jax.vmap(input_pipeline.augment)(step_keys, x)
  return x, y


def _place(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """Builds a global array; each process supplies only its devices' parts."""
  return jax.make_array_from_callback(
      array.shape, sharding, lambda index: array[index]
  )


def place_train(
    dataset: input_pipeline.Dataset, mesh: jax.sharding.Mesh
) -> Placed:
  """Replicates the uint8 training set on every device."""
  replicated = NamedSharding(mesh, P())
  return Placed(
      images=_place(np.asarray(dataset.train_images, np.uint8), replicated),
      labels=_place(np.asarray(dataset.train_labels, np.int32), replicated),
  )


def place_test(
    dataset: input_pipeline.Dataset, mesh: jax.sharding.Mesh, batch_size: int
) -> Placed:
  """Pads the test set to whole batches and shards each batch."""
  images = np.asarray(dataset.test_images, np.uint8)
  labels = np.asarray(dataset.test_labels, np.int32)
  n = images.shape[0]
  steps = max(1, math.ceil(n / batch_size))
  pad = steps * batch_size - n
  mask = np.concatenate([np.ones(n, bool), np.zeros(pad, bool)])
  images = np.concatenate(
      [images, np.zeros((pad, *images.shape[1:]), np.uint8)]
  )
  labels = np.concatenate([labels, np.zeros(pad, np.int32)])
  batched = NamedSharding(mesh, P(None, DATA_AXIS))
  reshape = lambda a: a.reshape(steps, batch_size, *a.shape[1:])
  return Placed(
      images=_place(reshape(images), batched),
      labels=_place(reshape(labels), batched),
      mask=_place(reshape(mask), batched),
  )


def state_dict(state: TrainState) -> dict[str, Any]:
  """The pytree a checkpoint holds: ``Checkpointer.restore``'s target."""
  return flax.serialization.to_state_dict(state)


def _raise_nonfinite(
    losses: Sequence[jax.Array],
    epoch: int,
    last_good: int | None,
    workdir: Path,
) -> None:
  """Raises NonFiniteLossError naming the first bad step of ``losses``."""
  values = np.asarray(jax.device_get(list(losses)), np.float64)
  step = int(np.flatnonzero(~np.isfinite(values))[0])
  kept = (
      f"the last good checkpoint (epoch {last_good}) is kept in "
      f"{workdir / checkpointing.CHECKPOINT_DIR}"
      if last_good
      else "no checkpoint was written"
  )
  raise NonFiniteLossError(
      f"training loss became {values[step]} at epoch {epoch}, step {step}: "
      f"the run diverged; {kept}. Try a smaller --lr."
  )


def _validate_sizes(
    config: configs.Config, dataset: input_pipeline.Dataset, num_devices: int
) -> None:
  if dataset.name != config.dataset:
    raise ValueError(
        f"the dataset given is {dataset.name!r}, but the config "
        f"asks for {config.dataset!r}"
    )
  n_train = len(dataset.train_images)
  if config.batch_size > n_train:
    raise ValueError(
        f"--batch-size {config.batch_size} is larger than the training set "
        f"of {config.dataset} ({n_train} images)"
    )
  if config.batch_size % num_devices:
    raise ValueError(
        f"--batch-size {config.batch_size} is not divisible by the "
        f"{num_devices} devices the batch is split over"
    )
  if len(dataset.test_images) == 0:
    raise ValueError(f"the test set of {config.dataset} is empty")


def _validate_precise_stats(batches: int, steps: int) -> None:
  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
    raise ValueError(
        f"--precise-stats must be a whole number >= 0, got " f"{batches!r}"
    )
  if batches > steps:
    raise ValueError(
        f"--precise-stats {batches} is more than the {steps} "
        "batches of an epoch"
    )


def _summary_line(row: dict[str, Any], epochs: int) -> str:
  test = (
      ""
      if row["test_error"] is None
      else f" test loss {row['test_loss']:.4f} error "
      f"{100 * row['test_error']:.2f}%"
  )
  if row.get("test_error_precise") is not None:
    test += f" (precise stats {100 * row['test_error_precise']:.2f}%)"
  return (
      f"epoch {row['epoch']}/{epochs}: train loss "
      f"{row['train_loss']:.4f} error {100 * row['train_error']:.2f}%"
      f"{test} | {row['seconds']:.1f}s, "
      f"{row['images_per_sec']:.0f} img/s, data "
      f"{100 * row['data_seconds'] / row['seconds']:.1f}%"
  )


@dataclasses.dataclass(frozen=True)
class Program:
  """The compiled functions of one run (reused by runs of the same shapes).

  Attributes:
    init: ``init(key) -> TrainState``, replicated.
    prepare: ``prepare(images, labels, key) -> (images, labels)``: one
      epoch's shuffled, augmented batches (see :func:`prepare_epoch`).
    step: ``step(state, images, labels, index) -> (state, metrics)``.
    evaluate: ``evaluate(state, images, labels, mask) -> sums``.
    steps: Batches per epoch.
    precise: With ``--precise-stats``, ``precise(state, epoch_images,
      images, labels, mask) -> sums`` (see :func:`precise_eval_model`).
  """

  init: Callable[..., Any]
  prepare: Callable[..., Any]
  step: Callable[..., Any]
  evaluate: Callable[..., Any]
  steps: int
  precise: Callable[..., Any] | None = None


# Compiling takes seconds; runs in one process (tests, sweeps in a notebook,
# a resumed run after a short one) often repeat the same program.
_PROGRAM_CACHE: dict[Any, Program] = {}
_PROGRAM_CACHE_SIZE = 4


def _program_context() -> tuple[Any, ...]:
  """What, beyond the run's shapes and config, decides the compiled program.

  JAX keys its own jit caches on its trace context: its config flags
  (``jax_enable_x64``, the default matmul precision, ...) and user contexts
  such as :func:`gbn_jax.selection.selection_config`, which picks the selection method
  at trace time. A program compiled under one of them must not serve a run
  under another, so the key holds the same context; the selection setting is
  also named on its own in case a JAX release moves the private accessor.
  The backend and whether the compiled CPU kernels load decide which
  implementations are traced (tests patch the latter).
  """
  try:
    # pylint: disable-next=g-import-not-at-top
    from jax._src import config as jax_config

    trace_context = jax_config.trace_context()
  except (ImportError, AttributeError):
    trace_context = (
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
    )
  return (
      trace_context,
      selection_config.current(),
      jax.default_backend(),
      convolution.native_available(),
      selection_native.available(),
  )


def compile_program(
    config: configs.Config,
    mesh: jax.sharding.Mesh,
    train_data: Placed,
    test_data: Placed,
    num_classes: int,
    record: ActivationRecording | None = None,
    precise_stats: int = 0,
) -> tuple[Program, bool]:
  """Compiles (or fetches from the in-process cache) a run's functions.

  Compiling ahead of time also keeps compilation out of the epoch times.
  ``precise_stats > 0`` also compiles ``Program.precise`` over that many
  batches.

  Returns:
    The program, and whether it came from the cache.
  """
  n_train, *image_shape = train_data.images.shape
  steps = n_train // config.batch_size  # the last partial batch is dropped
  donate = jax.default_backend() != "cpu"  # the CPU backend can't donate
  key = (
      config.replace(seed=0, epochs=1, eval_every=1),
      n_train,
      tuple(image_shape),
      test_data.images.shape,
      num_classes,
      tuple(d.id for d in mesh.devices.flat),
      donate,
      record,
      precise_stats,
      _program_context(),
      # The functions themselves, so that a patched one is recompiled.
      create_train_state,
      prepare_epoch,
      train_step,
      eval_model,
      precise_eval_model,
  )
  if key in _PROGRAM_CACHE:
    return _PROGRAM_CACHE[key], True

  replicated = NamedSharding(mesh, P())
  batched = NamedSharding(mesh, P(None, DATA_AXIS))
  model = create_model(config, num_classes)
  init = jax.jit(
      functools.partial(
          create_train_state,
          model=model,
          image_shape=tuple(image_shape),
          tx=create_optimizer(config),
      ),
      out_shardings=replicated,
  )
  sample_key = jax.random.key(0)
  state = jax.eval_shape(init, sample_key)
  init = init.lower(sample_key).compile()
  state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
      state,
  )
  prepare = jax.jit(
      functools.partial(
          prepare_epoch,
          steps=steps,
          batch_size=config.batch_size,
          augment=config.augment,
      ),
      out_shardings=(batched, batched),
  )
  prepare = prepare.lower(
      train_data.images, train_data.labels, sample_key
  ).compile()
  batches = (
      jax.ShapeDtypeStruct(
          (steps, config.batch_size, *image_shape), jnp.uint8, sharding=batched
      ),
      jax.ShapeDtypeStruct(
          (steps, config.batch_size), jnp.int32, sharding=batched
      ),
  )
  step = jax.jit(
      functools.partial(train_step, dataset=config.dataset, record=record),
      out_shardings=(replicated, replicated),
      donate_argnums=(0,) if donate else (),
  )
  step = step.lower(
      state, *batches, jax.ShapeDtypeStruct((), jnp.int32)
  ).compile()
  evaluate = jax.jit(
      functools.partial(eval_model, dataset=config.dataset),
      out_shardings=replicated,
  )
  evaluate = evaluate.lower(
      state, test_data.images, test_data.labels, test_data.mask
  ).compile()
  precise = None
  if precise_stats:
    plain = create_model(config.replace(renorm=False), num_classes)
    precise = jax.jit(
        functools.partial(
            precise_eval_model,
            dataset=config.dataset,
            batches=precise_stats,
            apply_fn=plain.apply,
        ),
        out_shardings=replicated,
    )
    precise = precise.lower(
        state, batches[0], test_data.images, test_data.labels, test_data.mask
    ).compile()
  program = Program(
      init=init,
      prepare=prepare,
      step=step,
      evaluate=evaluate,
      steps=steps,
      precise=precise,
  )
  while len(_PROGRAM_CACHE) >= _PROGRAM_CACHE_SIZE:
    del _PROGRAM_CACHE[next(iter(_PROGRAM_CACHE))]
  _PROGRAM_CACHE[key] = program
  return program, False


def train_and_evaluate(
    config: configs.Config,
    workdir: str | Path,
    *,
    dataset: input_pipeline.Dataset | None = None,
    data_dir: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    record: ActivationRecording | None = None,
    on_first_epoch: Callable[..., Sequence[str]] | None = None,
    precise_stats: int = 0,
    checkpoint_every: int = 1,
) -> list[dict[str, Any]]:
  """Trains ``config`` in ``workdir``, resuming from its last checkpoint.

  Args:
    config: The run's config (``augment=None`` picks the dataset default).
    workdir: Run directory (see :mod:`train.checkpointing`).
    dataset: Use this dataset instead of loading ``config.dataset``.
    data_dir: Where ``input_pipeline.load_dataset`` looks for files.
    overwrite: Start over, deleting an existing run in ``workdir``.
    progress: Show a tqdm progress bar on stderr.
    log: Receives one line per epoch (default: stderr).
    record: Record percentiles of one norm layer's activations every
      ``record.every`` steps into ``workdir/activations.jsonl``.
    on_first_epoch: Called as ``on_first_epoch(config, seconds, devices,
      epoch=epoch)`` after the first epoch this call trains (``epoch``: its
      number, past 1 after a resume); the lines it returns are logged (the
      CLI's time estimate).
    precise_stats: Also evaluate with the norms' statistics recomputed over
      this many of the epoch's training batches (0: off); adds
      ``test_loss_precise``, ``test_error_precise`` and ``precise_seconds``
      to the rows.
    checkpoint_every: Save a checkpoint every this many epochs (and after
      the last). ``metrics.jsonl`` still gets every epoch's row; a resume
      restarts from the last checkpoint, rewrites the rows after it and
      retrains those epochs (with the same results). On an accelerator,
      where an epoch can take less than a save, this keeps long runs from
      spending their time in orbax.

  Returns:
    The metrics history: one dict per epoch (what ``metrics.jsonl`` holds).

  Raises:
    ValueError: Bad config or sizes.
    checkpointing.RunDirError: ``workdir`` holds an incompatible run.
    checkpointing.CheckpointError: The latest checkpoint is unreadable.
    NonFiniteLossError: The loss became NaN/inf (earlier checkpoints kept).
    input_pipeline.DataNotFoundError: The dataset files are missing.
  """
  config = resolve(config)
  if (
      isinstance(checkpoint_every, bool)
      or not isinstance(checkpoint_every, int)
      or checkpoint_every < 1
  ):
    raise ValueError(
        f"checkpoint_every must be a positive integer, got "
        f"{checkpoint_every!r}"
    )
  workdir = Path(workdir)
  primary = jax.process_index() == 0
  if not primary:  # one host reports for all
    log, progress = (lambda line: None), False
  elif log is None:
    log = lambda line: tqdm.tqdm.write(line, file=sys.stderr)
  # Refuse an incompatible workdir before spending time on data.
  checkpointing.prepare_workdir(
      workdir, config, overwrite=overwrite, is_primary=primary
  )
  if dataset is None:
    # No data folder given: what no source has is downloaded (train.download).
    dataset = input_pipeline.load_dataset(
        config.dataset, data_dir=data_dir, fetch=True
    )
  mesh = make_mesh(data_parallel_devices(config.batch_size))
  _validate_sizes(config, dataset, mesh.size)
  _validate_precise_stats(
      precise_stats, len(dataset.train_images) // config.batch_size
  )
  train_data = place_train(dataset, mesh)
  test_data = place_test(dataset, mesh, config.batch_size)
  t0 = time.perf_counter()
  program, cached = compile_program(
      config,
      mesh,
      train_data,
      test_data,
      dataset.num_classes,
      record,
      precise_stats,
  )
  n_train = len(dataset.train_images)
  dropped = n_train - program.steps * config.batch_size
  batches = f"{program.steps} batches of {config.batch_size}" + (
      f", the last {dropped} dropped" if dropped else ""
  )
  log(
      f"{config.model}/{config.norm} on {config.dataset}: {n_train} train "
      f"images ({batches}), "
      f"{len(dataset.test_images)} test images, {mesh.size} device(s); "
      + (
          "compiled program reused"
          if cached
          else f"compiled in {time.perf_counter() - t0:.1f}s"
      )
  )
  log(f"data: {dataset.source}")
  state = program.init(init_key(config.seed))

  checkpointer = checkpointing.Checkpointer(workdir)
  try:
    last = checkpointer.latest_epoch()
    history: list[dict[str, Any]] = []
    if last is not None:
      restored, history = checkpointer.restore(last, state_dict(state))
      state = flax.serialization.from_state_dict(state, restored)
    if primary:
      checkpointing.write_config(workdir, config)
      checkpointing.write_metrics(workdir, history)
      # The report reads each norm layer's n from here: it imports no jax.
      capture.write_norm_layers(
          workdir,
          config,
          create_model(config, dataset.num_classes),
          (config.batch_size, *dataset.train_images.shape[1:]),
      )
    if last is not None:
      log(f"resumed from {checkpointer.directory / str(last)}")
    if primary and record is not None:
      _keep_activations(workdir, last or 0)
    if primary and (last or 0) < config.epochs:
      checkpointing.append_data_source(workdir, (last or 0) + 1, dataset.source)
    _train_epochs(
        config,
        workdir,
        program,
        train_data,
        test_data,
        state,
        history,
        checkpointer,
        start=(last or 0) + 1,
        progress=progress,
        log=log,
        primary=primary,
        record=record,
        on_first_epoch=on_first_epoch,
        devices=list(mesh.devices.flat),
        checkpoint_every=checkpoint_every,
    )
  finally:
    checkpointer.close()
  return history


def _keep_activations(workdir: Path, last_epoch: int) -> None:
  """Drops recorded rows of epochs after the checkpoint resumed from."""
  path = workdir / ACTIVATIONS_FILE
  if path.exists():
    rows = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["epoch"] <= last_epoch
    ]
    path.write_text("".join(line + "\n" for line in rows))


def _append_activations(
    workdir: Path,
    record: ActivationRecording,
    epoch: int,
    recorded: Sequence[tuple[int, jax.Array, jax.Array]],
) -> None:
  values = jax.device_get([(before, after) for _, before, after in recorded])
  with open(workdir / ACTIVATIONS_FILE, "a") as f:
    for (step, _, _), (before, after) in zip(recorded, values):
      f.write(
          json.dumps(
              {
                  "step": step,
                  "epoch": epoch,
                  "layer": record.layer,
                  "feature": record.feature,
                  "percentiles": list(record.percentiles),
                  "before": [float(v) for v in before],
                  "after": [float(v) for v in after],
              }
          )
          + "\n"
      )


def _train_epochs(
    config: configs.Config,
    workdir: Path,
    program: Program,
    train_data: Placed,
    test_data: Placed,
    state: TrainState,
    history: list[dict[str, Any]],
    checkpointer: checkpointing.Checkpointer,
    *,
    start: int,
    progress: bool,
    log: Callable[[str], None],
    primary: bool,
    record: ActivationRecording | None = None,
    on_first_epoch: Callable[..., Sequence[str]] | None = None,
    devices: Sequence[jax.Device] = (),
    checkpoint_every: int = 1,
) -> None:
  """Runs epochs ``start..config.epochs``, appending rows to ``history``."""
  steps = program.steps
  elapsed = history[-1]["elapsed_seconds"] if history else 0.0
  best = history[-1]["best_test_error"] if history else None
  last_good = start - 1 if start > 1 else None
  watch = health.DeadTrainingWatch(config)
  for epoch in range(start, config.epochs + 1):
    t_start = time.perf_counter()
    images, labels = program.prepare(
        train_data.images, train_data.labels, epoch_key(config.seed, epoch)
    )
    jax.block_until_ready((images, labels))
    data_seconds = time.perf_counter() - t_start

    losses, errors, recorded = [], [], []
    bar = tqdm.tqdm(
        total=steps,
        desc=f"epoch {epoch}/{config.epochs}",
        file=sys.stderr,
        leave=False,
        disable=not progress,
        dynamic_ncols=True,
    )
    with bar:
      for step in range(steps):
        state, metrics = program.step(state, images, labels, np.int32(step))
        losses.append(metrics["loss"])
        errors.append(metrics["errors"])
        global_step = (epoch - 1) * steps + step
        if record is not None and global_step % record.every == 0:
          recorded.append((global_step, metrics["before"], metrics["after"]))
        bar.update(1)
        # Check the previous step's loss: it is (nearly) done, so reading it
        # barely stalls the asynchronous dispatch.
        if step % 10 == 1 or step == steps - 1:
          loss = float(losses[step if step == steps - 1 else step - 1])
          if not math.isfinite(loss):
            _raise_nonfinite(losses, epoch, last_good, workdir)
          bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
    losses_np = np.asarray(jax.device_get(losses), np.float64)
    errors_np = np.asarray(jax.device_get(errors), np.int64)
    train_seconds = time.perf_counter() - t_start
    if not np.isfinite(losses_np).all():
      _raise_nonfinite(losses, epoch, last_good, workdir)

    test_loss = test_error = None
    t_eval = time.perf_counter()
    if epoch % config.eval_every == 0 or epoch == config.epochs:
      result = jax.device_get(
          program.evaluate(
              state, test_data.images, test_data.labels, test_data.mask
          )
      )
      count = int(result["count"])
      test_loss = float(result["loss_sum"]) / count
      test_error = int(result["errors"]) / count
      best = test_error if best is None else min(best, test_error)
    eval_seconds = time.perf_counter() - t_eval
    seconds = time.perf_counter() - t_start
    elapsed += seconds
    precise = {}
    if program.precise is not None:
      # Timed apart, so that `seconds` means the same with or without it.
      t_precise = time.perf_counter()
      precise = {"test_loss_precise": None, "test_error_precise": None}
      if test_error is not None:
        result = jax.device_get(
            program.precise(
                state,
                images,
                test_data.images,
                test_data.labels,
                test_data.mask,
            )
        )
        count = int(result["count"])
        precise = {
            "test_loss_precise": float(result["loss_sum"]) / count,
            "test_error_precise": int(result["errors"]) / count,
        }
      precise["precise_seconds"] = time.perf_counter() - t_precise
    row = {
        "epoch": epoch,
        "train_loss": float(losses_np.mean()),
        "train_error": float(errors_np.sum() / (steps * config.batch_size)),
        "test_loss": test_loss,
        "test_error": test_error,
        "best_test_error": best,
        "seconds": seconds,
        "train_seconds": train_seconds,
        "data_seconds": data_seconds,
        "eval_seconds": eval_seconds,
        "images_per_sec": steps * config.batch_size / train_seconds,
        "elapsed_seconds": elapsed,
        **precise,
    }
    history.append(row)
    if primary and record is not None:  # before the save: see _keep_activations
      _append_activations(workdir, record, epoch, recorded)
    if epoch % checkpoint_every == 0 or epoch == config.epochs:
      checkpointer.save(epoch, state_dict(state), history)
      last_good = epoch
    if primary:
      checkpointing.write_metrics(workdir, history)
    log(_summary_line(row, config.epochs))
    if on_first_epoch is not None and epoch == start:
      for line in on_first_epoch(config, seconds, list(devices), epoch=epoch):
        log(line)
    note = watch.after_epoch(epoch, losses_np)  # once: loss at chance level
    if note:
      log(note)
