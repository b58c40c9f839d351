"""The functions a run's compiled program is made of, and their random keys.

:func:`prepare_epoch` shuffles, batches and augments one epoch on the devices;
:func:`train_step` is one SGD step (recording one norm layer's activations if
asked, :mod:`train.model.activations`); :func:`eval_model` sums the test loss
and errors with the norms' running averages, :func:`precise_eval_model` with
statistics recomputed over training batches (PreciseBN). Every random number
is a function of ``(seed, epoch, step)``: :func:`init_key`, :func:`epoch_key`.
:mod:`train.loop.programs` compiles these functions and
:mod:`train.loop.trainer` runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

import gbn_jax
from train.data import input_pipeline
from train.loop import capture
from train.loop import train_state
from train.model import activations

# fold_in tags that keep the random streams apart.
_INIT, _EPOCH, _PERMUTE, _AUGMENT = 0, 1, 0, 1


def init_key(seed: int) -> jax.Array:
  """The key a run of ``seed`` initializes its parameters with."""
  return jax.random.fold_in(jax.random.key(seed), _INIT)


def epoch_key(seed: int, epoch: int) -> jax.Array:
  """The key of ``epoch``: a function of ``(seed, epoch)`` only."""
  return jax.random.fold_in(
      jax.random.fold_in(jax.random.key(seed), _EPOCH), epoch
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
    state: train_state.TrainState,
    images: jax.Array,
    labels: jax.Array,
    step: jax.Array,
    *,
    dataset: str,
    record: activations.ActivationRecording | None = None,
) -> tuple[train_state.TrainState, dict[str, jax.Array]]:
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
  # A group norm's model has no batch_stats, so updates has none.
  state = state.apply_gradients(
      grads=grads, batch_stats=updates.get("batch_stats", {})
  )
  errors = jnp.sum(jnp.argmax(logits, -1) != y)
  return state, {"loss": loss, "errors": errors, **captured}


def eval_model(
    state: train_state.TrainState,
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
    state: train_state.TrainState,
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
