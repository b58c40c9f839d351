"""What the convolution tests share: cases and float64 references.

The references are numpy in float64, written from the definition of
``lax.conv_general_dilated(x, k, strides, pads, ('NHWC', 'HWIO', 'NHWC'))``:
the input zero-padded, each output the sum over the window and the input
channels of input times kernel; the kernel gradient the sum over images and
output positions of the shifted input times the output gradient; the input
gradient each output gradient spread back over its window.
"""

from __future__ import annotations

from jax import lax
import numpy as np

DIMENSIONS = ("NHWC", "HWIO", "NHWC")

CASES = [
    # (x shape, kernel size, strides, padding, features)
    ((4, 8, 8, 16), (3, 3), 1, "SAME", 16),  # ResNet20's stage 1, small
    ((3, 9, 7, 16), (3, 3), 2, "SAME", 32),  # strided, odd sizes
    ((2, 8, 8, 32), (3, 3), 2, "SAME", 64),
    ((2, 6, 6, 3), (3, 3), 1, "SAME", 16),  # the stem: 27 rows, 4 blocks + 3
    ((1, 5, 5, 3), (5, 3), (1, 2), ((2, 1), (0, 3)), 8),  # asymmetric
    ((2, 7, 7, 5), (3, 3), 1, "VALID", 24),  # 8 + 16 features
    ((2, 7, 7, 5), (3, 3), 3, "SAME", 13),  # plain loops
    ((2, 4, 4, 2), (1, 1), 1, "VALID", 1),
    ((1, 2, 2, 4), (3, 3), 1, "SAME", 8),  # window larger than the image
    ((5, 3, 11, 7), (2, 4), (2, 1), "SAME", 40),
    ((1, 1, 1, 1), (1, 1), 1, "VALID", 1),
    # Output rows longer than a block (6 positions in AVX2, 12 in AVX-512),
    # 32 + 16 features:
    ((2, 5, 29, 16), (3, 3), 1, "SAME", 48),
    ((2, 9, 30, 16), (3, 3), 2, "SAME", 32),  # 15 positions a row
]


def pads_of(shape, kernel_size, strides, padding):
  """``padding`` as ``((top, bottom), (left, right))`` for NHWC ``shape``."""
  if isinstance(padding, str):
    return lax.padtype_to_pads(shape[1:3], kernel_size, strides, padding)
  return padding


def _windows(kh, kw, sh, sw, p, q):
  """Per kernel offset (i, j), the rows and columns of the padded input
  that it meets, one per output position."""
  for i in range(kh):
    for j in range(kw):
      rows = slice(i, i + sh * (p - 1) + 1, sh)
      cols = slice(j, j + sw * (q - 1) + 1, sw)
      yield i, j, rows, cols


def _padded(x, pads):
  (top, bottom), (left, right) = pads
  return np.pad(
      np.asarray(x, np.float64), ((0, 0), (top, bottom), (left, right), (0, 0))
  )


def kernel_gradient_reference(x, g, kernel_size, strides, pads):
  """float64 d(sum(conv(x, k) * g))/dk, from the definition."""
  xp, g = _padded(x, pads), np.asarray(g, np.float64)
  out = np.zeros((*kernel_size, xp.shape[-1], g.shape[-1]))
  for i, j, rows, cols in _windows(*kernel_size, *strides, *g.shape[1:3]):
    out[i, j] = np.einsum("nhwc,nhwf->cf", xp[:, rows, cols], g)
  return out


def forward_reference(x, k, strides, pads):
  """float64 conv(x, k), from the definition."""
  xp, k = _padded(x, pads), np.asarray(k, np.float64)
  kh, kw = k.shape[:2]
  p = (xp.shape[1] - kh) // strides[0] + 1
  q = (xp.shape[2] - kw) // strides[1] + 1
  out = np.zeros((x.shape[0], p, q, k.shape[-1]))
  for i, j, rows, cols in _windows(kh, kw, *strides, p, q):
    out += np.einsum("npqc,cf->npqf", xp[:, rows, cols], k[i, j])
  return out


def input_gradient_reference(x, k, g, strides, pads):
  """float64 d(sum(conv(x, k) * g))/dx, from the definition."""
  k, g = np.asarray(k, np.float64), np.asarray(g, np.float64)
  (top, bottom), (left, right) = pads
  h, w = x.shape[1:3]
  dxp = np.zeros((x.shape[0], h + top + bottom, w + left + right, x.shape[3]))
  for i, j, rows, cols in _windows(*k.shape[:2], *strides, *g.shape[1:3]):
    dxp[:, rows, cols] += np.einsum("npqf,cf->npqc", g, k[i, j])
  return dxp[:, top : top + h, left : left + w]


def conv_case(shape, kernel_size, strides, padding, features, kind, seed=0):
  """float32 ``(x, k, g, strides, pads)`` for a case of :data:`CASES`.

  ``kind='repeated'``: half-integers and integers, whose products and sums
  are exact in float32, so any summation order gives the definition's value.
  """
  strides = (strides,) * 2 if isinstance(strides, int) else strides
  pads = pads_of(shape, kernel_size, strides, padding)
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape)
  k = rng.standard_normal((*kernel_size, shape[-1], features))
  if kind == "repeated":
    x, k = np.round(x * 2) / 2, np.round(k)
  y = forward_reference(x, k, strides, pads)
  g = rng.standard_normal(y.shape)
  if kind == "repeated":
    g = np.round(g)
  cast = lambda a: a.astype(np.float32)
  return cast(x), cast(k), cast(g), strides, pads
