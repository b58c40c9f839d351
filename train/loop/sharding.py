"""Data parallelism: the mesh, and the data laid out on it.

One 1-D mesh ``('data',)`` (:data:`DATA_AXIS`) over the devices that split the
batch (:func:`make_mesh`, :func:`data_parallel_devices`); :func:`place_train`
replicates the uint8 training set on every device, :func:`place_test` pads
the test set to whole batches and shards each batch along it. On several
hosts each process supplies only its own devices' parts. Why the axis is
``AxisType.Auto`` and how the GBN statistics stay those of the global batch:
:mod:`train.loop.trainer`.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from train.data import input_pipeline

DATA_AXIS = "data"


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
  (:mod:`train.loop.host_devices`); a batch size that some of them do not divide
  then runs on fewer rather than failing. Several hosts always use them all.
  """
  devices = jax.devices()
  if jax.process_count() > 1:
    return devices
  count = max(d for d in range(1, len(devices) + 1) if batch_size % d == 0)
  return devices[:count]


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
