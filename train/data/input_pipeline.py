"""Input pipeline: datasets, per-channel normalisation and augmentation.

The loading side lives in `train.data.datasets` and is re-exported here, so the
training loop needs only this module:

  ds = load_dataset("cifar10", data_dir)     # uint8 NHWC numpy arrays
  batch = jnp.asarray(ds.train_images[idx])
  if dataset_info("cifar10").augment_by_default:
    batch = augment(rng, batch)              # crop with zero padding, flip
  x = normalize_images(batch, "cifar10")     # float32, (x/255 - mean)/std

`normalize_images`, `augment`, `sample_augment_params` and `apply_augment` are
pure JAX functions that can run inside ``jax.jit`` (``name`` and ``pad`` are
Python values fixed at trace time). Augmenting before normalising pads with
black pixels, as torchvision's ``RandomCrop(32, padding=4)`` does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from train.data.datasets import load_dataset
from train.data.info import DATASETS
from train.data.info import DataNotFoundError
from train.data.info import Dataset
from train.data.info import DatasetInfo
from train.data.info import MalformedDataError
from train.data.info import dataset_info
from train.data.locate import dataset_layout
from train.data.locate import search_locations

__all__ = [
    "DATASETS",
    "DataNotFoundError",
    "Dataset",
    "DatasetInfo",
    "MalformedDataError",
    "dataset_info",
    "dataset_layout",
    "load_dataset",
    "search_locations",
    "PAD",
    "normalize_images",
    "AugmentParams",
    "sample_augment_params",
    "apply_augment",
    "augment",
]

# Zero padding on each side for random crops (the standard CIFAR recipe).
PAD = 4


def normalize_images(images_uint8: jax.Array, name: str) -> jax.Array:
  """Scales uint8 pixels to ``(x / 255 - mean) / std`` per channel.

  Args:
    images_uint8: uint8 images, ``(..., H, W, C)``.
    name: The dataset whose training statistics (`dataset_info`) are used.

  Returns:
    float32 array of the same shape.

  Raises:
    TypeError: ``images_uint8`` is not uint8 (already scaled data would be
      scaled twice).
    ValueError: Unknown dataset, or the channel count does not match it.
  """
  info = dataset_info(name)
  images = jnp.asarray(images_uint8)
  if images.dtype != jnp.uint8:
    raise TypeError(
        f"normalize_images expects uint8 pixels in 0..255, got {images.dtype}"
    )
  if images.ndim < 3 or images.shape[-1] != len(info.mean):
    raise ValueError(
        f"{name} images have {len(info.mean)} channel(s) last; got shape"
        f" {images.shape}"
    )
  mean = jnp.asarray(info.mean, jnp.float32)
  std = jnp.asarray(info.std, jnp.float32)
  return (images.astype(jnp.float32) / 255.0 - mean) / std


class AugmentParams(NamedTuple):
  """The random choices of `augment` for one batch.

  Attributes:
    offsets: int32 ``(B, 2)``: row and column, in the image padded by ``pad``
      zeros on each side, of the top-left corner of each crop; in
      ``[0, 2 * pad]``. Output pixel ``(y, x)`` is input pixel
      ``(y + row - pad, x + col - pad)``, or zero outside the input.
    flips: bool ``(B,)``: whether each crop is then mirrored left-right.
  """

  offsets: jax.Array
  flips: jax.Array


def sample_augment_params(
    rng: jax.Array, batch_size: int, pad: int = PAD
) -> AugmentParams:
  """Draws crop offsets, uniform in ``[0, 2 * pad]``, and fair coin flips."""
  _check_pad(pad)
  offset_key, flip_key = jax.random.split(rng)
  offsets = jax.random.randint(
      offset_key, (batch_size, 2), 0, 2 * pad + 1, dtype=jnp.int32
  )
  flips = jax.random.bernoulli(flip_key, 0.5, (batch_size,))
  return AugmentParams(offsets, flips)


def apply_augment(
    images: jax.Array, params: AugmentParams, pad: int = PAD
) -> jax.Array:
  """Crops each image from its zero-padded copy, then maybe mirrors it.

  Args:
    images: ``(B, H, W, C)``, any dtype.
    params: Offsets and flips for the ``B`` images (see `AugmentParams`).
    pad: Zero padding on each side before cropping.

  Returns:
    Array of the same shape and dtype as ``images``.
  """
  _check_pad(pad)
  images = jnp.asarray(images)
  if images.ndim != 4:
    raise ValueError(f"expected NHWC images, got shape {images.shape}")
  batch, height, width, channels = images.shape
  if params.offsets.shape != (batch, 2) or params.flips.shape != (batch,):
    raise ValueError(
        f"params for {params.offsets.shape[0]} images, got {batch} images"
    )
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))

  def crop(image, offset):
    return lax.dynamic_slice(
        image, (offset[0], offset[1], 0), (height, width, channels)
    )

  crops = jax.vmap(crop)(padded, params.offsets)
  return jnp.where(params.flips[:, None, None, None], crops[:, :, ::-1], crops)


def augment(rng: jax.Array, images: jax.Array, pad: int = PAD) -> jax.Array:
  """Random crop with ``pad`` pixels of zero padding, then random flip.

  Each image of the batch gets its own crop offset and flip, drawn by
  `sample_augment_params` from ``rng`` and applied by `apply_augment`.

  Args:
    rng: A PRNG key.
    images: ``(B, H, W, C)``, uint8 or float.
    pad: Zero padding on each side before cropping.

  Returns:
    Array of the same shape and dtype as ``images``.
  """
  images = jnp.asarray(images)
  if images.ndim != 4:
    raise ValueError(f"expected NHWC images, got shape {images.shape}")
  params = sample_augment_params(rng, images.shape[0], pad)
  return apply_augment(images, params, pad)


def _check_pad(pad: int) -> None:
  if not isinstance(pad, int) or pad < 0:
    raise ValueError(f"pad must be a non-negative int, got {pad!r}")
