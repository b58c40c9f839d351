"""The Hessian of a loss over a sample of batches: its products, the top
eigenvalues (Lanczos), the trace (Hutchinson) and the gradient noise scale.

What :mod:`train.curvature.cli` measures at each checkpoint, for any loss of
``(params, aux, images, labels)``; see there for the quantities and the cost.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import math
from typing import Any

import jax
from jax import flatten_util
import jax.numpy as jnp
import numpy as np

# Seed streams of the batch sample, the Lanczos start and the probes.
SAMPLE, _LANCZOS, _PROBES = 0, 1, 2
# A Lanczos residual this small against the operator's scale means the Krylov
# space is invariant: the next vector is then a fresh random one.
_RESTART_TOLERANCE = 1e-8

#: ``loss(params, aux, images, labels)``: one batch's scalar loss, ``aux``
#: (norm statistics, say) held fixed.
BatchLoss = Callable[[Any, Any, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a measurement used (a line's ``settings``).

  Attributes:
    batches: Batches in the sample (at least two, for the noise scale).
    batch_size: Images per batch; ``None``: the run's batch size, so that
      each norm statistic has the size it had in training.
    eigenvalues: How many of the largest eigenvalues to report.
    iterations: Lanczos steps (at least ``eigenvalues``).
    probes: Hutchinson probes (at least two, for the standard error).
    seed: Seeds the sample, the Lanczos start and the probes.
  """

  batches: int = 4
  batch_size: int | None = None
  eigenvalues: int = 5
  iterations: int = 20
  probes: int = 10
  seed: int = 0

  def validate(self) -> Settings:
    for name, least in (("batches", 2), ("eigenvalues", 1), ("probes", 2)):
      if getattr(self, name) < least:
        raise ValueError(f"--{name} must be at least {least}")
    if self.batch_size is not None and self.batch_size < 1:
      raise ValueError("--batch-size must be positive")
    if self.iterations < self.eigenvalues:
      raise ValueError("--iterations must be at least --eigenvalues")
    return self


@functools.partial(jax.jit, static_argnums=0)
def _batch_terms(loss, params, aux, tangent, images, labels, index):
  """Batch ``index``'s loss, gradient and Hessian-vector product (flat)."""
  flat, unravel = flatten_util.ravel_pytree(params)

  def batch_loss(w):
    return loss(unravel(w), aux, images[index], labels[index])

  (value, grad), (_, hvp) = jax.jvp(
      jax.value_and_grad(batch_loss), (flat,), (tangent,)
  )
  return value, grad, hvp


class SampleHessian:
  """The Hessian of the mean of ``loss`` over a sample of batches.

  Args:
    loss: One batch's loss; the same object for every checkpoint of a run,
      so that the products compile once.
    params: The parameters (a pytree of float32 arrays).
    aux: Held fixed (the norms' running averages).
    images: The batches, ``(batches, batch_size, ...)``.
    labels: Their labels, ``(batches, batch_size)``.
    on_batch: Called with each batch product's (pending) loss.
  """

  def __init__(
      self,
      loss: BatchLoss,
      params: Any,
      aux: Any,
      images: jax.Array,
      labels: jax.Array,
      on_batch: Callable[[jax.Array], None] = lambda loss: None,
  ):
    self._call = functools.partial(_batch_terms, loss, params, aux)
    self._data = (images, labels)
    self._on_batch = on_batch
    self.batches = int(images.shape[0])
    self.size = int(flatten_util.ravel_pytree(params)[0].size)
    self.loss: float | None = None
    self.gradients: np.ndarray | None = None

  def matvec(self, vector: np.ndarray) -> np.ndarray:
    """``H @ vector`` in float64; the first call also keeps the sample's
    mean loss and per-batch gradients (``loss``, ``gradients``)."""
    tangent = jnp.asarray(vector, jnp.float32)
    total, values, grads = 0.0, [], []
    for index in range(self.batches):
      value, grad, hvp = self._call(tangent, *self._data, np.int32(index))
      self._on_batch(value)
      total = total + hvp
      if self.gradients is None:
        values.append(value)
        grads.append(grad)
    if self.gradients is None:
      self.loss = float(np.mean(jax.device_get(values)))
      self.gradients = np.asarray(jax.device_get(grads), np.float64)
    return np.asarray(total, np.float64) / self.batches


def _orthogonalized(w: np.ndarray, basis: np.ndarray) -> np.ndarray:
  for _ in range(2):  # twice is enough in floating point (Kahan, Parlett)
    w = w - basis.T @ (basis @ w)
  return w


def lanczos(
    matvec: Callable[[np.ndarray], np.ndarray],
    size: int,
    iterations: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
  """Ritz values of a symmetric operator, ascending, with residual bounds.

  Each Ritz value ``theta_i`` is within ``residual_i`` of an eigenvalue.
  With ``iterations == size`` they are all the eigenvalues, multiplicities
  included (each invariant subspace found restarts the iteration).

  Raises:
    ValueError: ``iterations`` is not in ``[1, size]``.
  """
  if not 1 <= iterations <= size:
    raise ValueError(
        f"--iterations must be in [1, {size}] (the parameter count), "
        f"got {iterations}"
    )
  basis = np.zeros((iterations, size))
  alphas, betas = np.zeros(iterations), np.zeros(iterations)
  q = rng.standard_normal(size)
  q /= np.linalg.norm(q)
  for j in range(iterations):
    basis[j] = q
    w = matvec(q)
    alphas[j] = q @ w
    w = _orthogonalized(w, basis[: j + 1])
    betas[j] = np.linalg.norm(w)
    if j == iterations - 1:
      break
    scale = max(np.abs(alphas[: j + 1]).max(), betas[: j + 1].max())
    if betas[j] <= _RESTART_TOLERANCE * scale:
      betas[j] = 0.0
      w = _orthogonalized(rng.standard_normal(size), basis[: j + 1])
    q = w / np.linalg.norm(w)
  tridiagonal = (
      np.diag(alphas) + np.diag(betas[:-1], 1) + np.diag(betas[:-1], -1)
  )
  ritz, vectors = np.linalg.eigh(tridiagonal)
  return ritz, np.abs(betas[-1] * vectors[-1])


def noise_scale(gradients: np.ndarray, batch_size: int) -> dict[str, Any]:
  """``B_simple`` from per-batch gradients ``(batches, parameters)``.

  The mean of the ``n`` batch gradients is a gradient over ``n *
  batch_size`` examples; from the two sizes, ``tr(Sigma) = batch_size * sum
  |g_i - g|^2 / (n - 1)`` and ``|G|^2 = |g|^2 - tr(Sigma) / (n *
  batch_size)`` are unbiased.
  """
  n = gradients.shape[0]
  mean = gradients.mean(axis=0)
  trace = batch_size * np.sum((gradients - mean) ** 2) / (n - 1)
  norm_sq = float(mean @ mean - trace / (n * batch_size))
  return {
      "noise_scale": float(trace / norm_sq) if norm_sq > 0 else None,
      "gradient_norm_sq": norm_sq,
      "gradient_variance_trace": float(trace),
  }


def measure(
    hessian: SampleHessian, settings: Settings, batch_size: int
) -> dict[str, Any]:
  """One checkpoint's eigenvalues, trace and noise scale (see the module
  doc); ``settings.batches`` is ``hessian``'s."""
  seeds = [
      np.random.default_rng([settings.seed, s]) for s in (_LANCZOS, _PROBES)
  ]
  ritz, residuals = lanczos(
      hessian.matvec, hessian.size, settings.iterations, seeds[0]
  )
  top = np.argsort(ritz)[::-1][: settings.eigenvalues]
  quadratic = []
  for _ in range(settings.probes):
    z = seeds[1].choice(np.array([-1.0, 1.0]), hessian.size)
    quadratic.append(z @ hessian.matvec(z))
  return {
      "loss": hessian.loss,
      "eigenvalues": ritz[top].tolist(),
      "eigenvalue_residuals": residuals[top].tolist(),
      "trace": float(np.mean(quadratic)),
      "trace_stderr": float(
          np.std(quadratic, ddof=1) / math.sqrt(len(quadratic))
      ),
      **noise_scale(hessian.gradients, batch_size),
      "parameters": hessian.size,
  }
