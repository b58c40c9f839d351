"""gbn-jax: Generalized Batch Normalization for JAX and Flax.

GBN normalizes each feature by ``(x - S(x)) / D(x)`` over the batch, where
``D`` is a generalized deviation measure and ``S`` its natural statistic
(Yuan, Feng, Norton, Li, AAAI 2019). Layers: :class:`GBatchNorm` (linen) and
``gbn_jax.nnx.GBatchNorm``; measures: :func:`get_measure` (with
``calibration='normal'``, D = sigma for Gaussian data), :data:`MEASURES`,
:func:`register_measure` (with the capabilities a measure declares) and
:func:`parse_measure_name` (``'sqd:0.9'``); exact order statistics and the
pooled reductions a measure is built from: :func:`quantile`,
:func:`superquantile`, :func:`extreme`, :func:`mean` (backend scoped by
:func:`selection_config`); running statistics recomputed over many batches:
:func:`precise_batch_stats`; serializing a model with :mod:`jax.export`:
:func:`export_disabled_checks`, :func:`register_native_kernels`.
"""

from gbn_jax._export import export_disabled_checks
from gbn_jax._export import register_native_kernels
from gbn_jax._selection.dispatch import selection_config
from gbn_jax.linen import GBatchNorm
from gbn_jax.measures import MEASURES
from gbn_jax.measures import FixedParamsError
from gbn_jax.measures import Measure
from gbn_jax.measures import MeasureSpec
from gbn_jax.measures import get_measure
from gbn_jax.measures import parse_measure_name
from gbn_jax.measures import register_measure
from gbn_jax.precise import precise_batch_stats
from gbn_jax.quantiles import extreme
from gbn_jax.quantiles import mean
from gbn_jax.quantiles import quantile
from gbn_jax.quantiles import quantile_rank
from gbn_jax.quantiles import superquantile

__version__ = "0.1.0"


def __getattr__(name: str):
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
    "extreme",
    "get_measure",
    "mean",
    "parse_measure_name",
    "precise_batch_stats",
    "quantile",
    "quantile_rank",
    "register_measure",
    "register_native_kernels",
    "selection_config",
    "superquantile",
]
