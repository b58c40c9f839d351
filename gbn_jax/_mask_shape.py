"""The check that a mask broadcasts to the input, with a message that says
how to fix one that does not."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def check_mask_shape(mask_shape: Any, x_shape: Any) -> None:
  """Raises ValueError unless a mask of ``mask_shape`` broadcasts to
  ``x_shape`` (numpy's rule, as flax's ``BatchNorm`` applies it).

  Decided from the static shapes while tracing; a symbolic dimension (shape
  polymorphic export) is compared as jax broadcasts it. The message names
  the shape the mask needs: a one-flag-per-example mask of shape
  ``(batch,)`` is the usual mistake, which broadcasting aligns with x's
  last axis, not its first.
  """
  mask_shape, x_shape = tuple(mask_shape), tuple(x_shape)
  if _broadcasts_to(mask_shape, x_shape):
    return
  message = (
      f"mask of shape {mask_shape} does not broadcast to x's shape {x_shape}"
  )
  extra = len(x_shape) - len(mask_shape)
  leading = mask_shape + (1,) * extra
  if extra > 0 and _broadcasts_to(leading, x_shape):
    index = ", ".join([":"] * len(mask_shape) + ["None"] * extra)
    purpose = " (for one flag per example)" if len(mask_shape) == 1 else ""
    raise ValueError(
        f"{message}: broadcasting aligns the mask's last axes with x's. To"
        f" align them with x's first axes instead{purpose}, pass"
        f" mask[{index}] (shape {leading})."
    )
  trailing = mask_shape[-extra:] if extra < 0 else ()
  if (
      extra < 0
      and all(n == 1 for n in mask_shape[:-extra])
      and _broadcasts_to(trailing, x_shape)
  ):
    raise ValueError(
        f"{message}: it has {len(mask_shape)} axes, x {len(x_shape)}; drop"
        f" its leading axes of size 1, e.g. mask.reshape({trailing})."
    )
  axes = "axis" if len(x_shape) == 1 else "axes"
  rank = f" (it has {len(mask_shape)})" if extra < 0 else ""
  examples = f"{x_shape} for one flag per element"
  if len(x_shape) > 1:
    per_example = x_shape[:1] + (1,) * (len(x_shape) - 1)
    examples = f"{per_example} for one flag per example, or {examples}"
  raise ValueError(
      f"{message}: a mask needs at most {len(x_shape)} {axes}{rank}, each of"
      f" size 1 or the size of the axis of x it aligns with, counting from"
      f" the last; e.g. shape {examples}."
  )


def _broadcasts_to(shape: tuple[Any, ...], target: tuple[Any, ...]) -> bool:
  try:
    return jnp.broadcast_shapes(shape, target) == target
  except ValueError:
    return False
