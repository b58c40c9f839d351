"""Compiling a run's functions ahead of time, and reusing them in-process.

:func:`compile_program` jits and compiles :mod:`train.loop.train_steps`'
functions (and :func:`train.loop.train_state.create_train_state`) for a run's
config, mesh and shapes into a :class:`Program`; compiling ahead of time keeps
compilation out of the epoch times. Programs are cached in the process, keyed on
all that decides them (:func:`_program_context`), so that runs of the same
shapes (tests, sweeps in a notebook, a resumed run) compile once.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gbn_jax._selection import config as selection_config
from gbn_jax._selection import native as selection_native
from train import configs
from train.loop import sharding
from train.loop import train_state
from train.loop import train_steps
from train.model import activations
from train.native import convolution


@dataclasses.dataclass(frozen=True)
class Program:
  """The compiled functions of one run (reused by runs of the same shapes).

  Attributes:
    init: ``init(key) -> TrainState``, replicated.
    prepare: ``prepare(images, labels, key) -> (images, labels)``: one
      epoch's shuffled, augmented batches (see
      :func:`train.loop.train_steps.prepare_epoch`).
    step: ``step(state, images, labels, index) -> (state, metrics)``.
    evaluate: ``evaluate(state, images, labels, mask) -> sums``.
    steps: Batches per epoch.
    precise: With ``--precise-stats``, ``precise(state, epoch_images,
      images, labels, mask) -> sums`` (see
      :func:`train.loop.train_steps.precise_eval_model`).
  """

  init: Callable[..., Any]
  prepare: Callable[..., Any]
  step: Callable[..., Any]
  evaluate: Callable[..., Any]
  steps: int
  precise: Callable[..., Any] | None = None


#: The functions compile_program jits, by name, and the Program field of each.
PROGRAM_FUNCTIONS = {
    "create_train_state": "init",
    "prepare_epoch": "prepare",
    "train_step": "step",
    "eval_model": "evaluate",
    "precise_eval_model": "precise",
}


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
    train_data: sharding.Placed,
    test_data: sharding.Placed,
    num_classes: int,
    record: activations.ActivationRecording | None = None,
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
      config.replace(seed=0, epochs=1, steps=None, eval_every=1),
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
      train_state.create_train_state,
      train_steps.prepare_epoch,
      train_steps.train_step,
      train_steps.eval_model,
      train_steps.precise_eval_model,
  )
  if key in _PROGRAM_CACHE:
    return _PROGRAM_CACHE[key], True

  replicated = NamedSharding(mesh, P())
  batched = NamedSharding(mesh, P(None, sharding.DATA_AXIS))
  model = train_state.create_model(config, num_classes)
  init = jax.jit(
      functools.partial(
          train_state.create_train_state,
          model=model,
          image_shape=tuple(image_shape),
          tx=train_state.create_optimizer(config),
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
          train_steps.prepare_epoch,
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
      functools.partial(
          train_steps.train_step, dataset=config.dataset, record=record
      ),
      out_shardings=(replicated, replicated),
      donate_argnums=(0,) if donate else (),
  )
  step = step.lower(
      state, *batches, jax.ShapeDtypeStruct((), jnp.int32)
  ).compile()
  evaluate = jax.jit(
      functools.partial(train_steps.eval_model, dataset=config.dataset),
      out_shardings=replicated,
  )
  evaluate = evaluate.lower(
      state, test_data.images, test_data.labels, test_data.mask
  ).compile()
  precise = None
  if precise_stats:
    plain = train_state.create_model(config.replace(renorm=False), num_classes)
    precise = jax.jit(
        functools.partial(
            train_steps.precise_eval_model,
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
