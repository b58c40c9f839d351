"""gbn-jax: Generalized Batch Normalization for JAX and Flax.

GBN normalizes each feature by ``(x - S(x)) / D(x)`` over the batch, where
``D`` is a generalized deviation measure and ``S`` its natural statistic
(Yuan, Feng, Norton, Li, AAAI 2019).

Here: the linen layer :class:`GBatchNorm`; the measures, by name
(:func:`get_measure`, :data:`MEASURES`, :func:`register_measure`,
:func:`unregister_measure`, :func:`registered_measure`,
:func:`parse_measure_name`); the exact order statistics :func:`quantile`,
:func:`superquantile` and :func:`quantile_rank`; running statistics
recomputed over many batches (:func:`precise_batch_stats`); and serializing a
model with :mod:`jax.export` (:func:`export_disabled_checks`,
:func:`register_native_kernels`).

Elsewhere: the nnx layer and converters (:mod:`gbn_jax.nnx`,
:mod:`gbn_jax.linen`), the built-in measures (:mod:`gbn_jax.deviations`) and
their normal constants (:mod:`gbn_jax.calibration`), the reductions a custom
measure pools with (:mod:`gbn_jax.reductions`), and the selection backend
(:mod:`gbn_jax.selection`).
"""

from typing import Any

# Submodules reachable after a plain ``import gbn_jax``.
from gbn_jax import reductions  # noqa: F401
from gbn_jax import selection  # noqa: F401
from gbn_jax._bound_measure import Measure
from gbn_jax._export import export_disabled_checks
from gbn_jax._export import register_native_kernels
from gbn_jax._precise import precise_batch_stats
from gbn_jax._quantiles import quantile
from gbn_jax._quantiles import quantile_rank
from gbn_jax._quantiles import superquantile
from gbn_jax.linen import GBatchNorm
from gbn_jax.measures import MEASURES
from gbn_jax.measures import FixedParamsError
from gbn_jax.measures import MeasureSpec
from gbn_jax.measures import get_measure
from gbn_jax.measures import parse_measure_name
from gbn_jax.measures import register_measure
from gbn_jax.measures import registered_measure
from gbn_jax.measures import unregister_measure

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
  # ``gbn_jax.nnx`` after a plain ``import gbn_jax``, imported on first use
  # so that linen-only users don't pay for importing flax.nnx.
  if name == "nnx":
    import importlib  # pylint: disable=g-import-not-at-top

    return importlib.import_module("gbn_jax.nnx")
  raise AttributeError(f"module 'gbn_jax' has no attribute {name!r}")


__all__ = [
    "FixedParamsError",
    "GBatchNorm",
    "MEASURES",
    "Measure",
    "MeasureSpec",
    "export_disabled_checks",
    "get_measure",
    "parse_measure_name",
    "precise_batch_stats",
    "quantile",
    "quantile_rank",
    "register_measure",
    "register_native_kernels",
    "registered_measure",
    "superquantile",
    "unregister_measure",
]
