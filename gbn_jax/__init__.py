"""gbn-jax: Generalized Batch Normalization for JAX and Flax.

GBN normalizes each feature by ``(x - S(x)) / D(x)`` over the batch, where
``D`` is a generalized deviation measure and ``S`` its natural statistic
(Yuan, Feng, Norton, Li, AAAI 2019). Layers: :class:`GBatchNorm` (linen) and
``gbn_jax.nnx.GBatchNorm``; measures: :func:`get_measure` (with
``calibration='normal'``, D = sigma for Gaussian data), :data:`MEASURES`,
:func:`register_measure` (with the capabilities a measure declares),
:func:`unregister_measure` and :func:`registered_measure` (a registration
scoped to a ``with`` block) and :func:`parse_measure_name` (``'sqd:0.9'``);
exact order statistics and the pooled reductions a measure is built from:
:mod:`gbn_jax.reductions` (:func:`quantile`, :func:`superquantile` and
:func:`quantile_rank` also here), their backend scoped by
:func:`gbn_jax.selection.selection_config`; running statistics recomputed
over many batches: :func:`precise_batch_stats`; serializing a model with
:mod:`jax.export`: :func:`export_disabled_checks`,
:func:`register_native_kernels`.
"""

from typing import Any
import warnings

from gbn_jax import reductions
from gbn_jax import selection
from gbn_jax._export import export_disabled_checks
from gbn_jax._export import register_native_kernels
from gbn_jax.linen import GBatchNorm
from gbn_jax.measures import MEASURES
from gbn_jax.measures import FixedParamsError
from gbn_jax.measures import Measure
from gbn_jax.measures import MeasureSpec
from gbn_jax.measures import get_measure
from gbn_jax.measures import parse_measure_name
from gbn_jax.measures import register_measure
from gbn_jax.measures import registered_measure
from gbn_jax.measures import unregister_measure
from gbn_jax.precise import precise_batch_stats
from gbn_jax.reductions import quantile
from gbn_jax.reductions import quantile_rank
from gbn_jax.reductions import superquantile

__version__ = "0.1.0"

# Names that moved, to their new home; kept working for one release.
_DEPRECATED = {
    "extreme": (reductions, "gbn_jax.reductions.extreme"),
    "mean": (reductions, "gbn_jax.reductions.mean"),
    "selection_config": (selection, "gbn_jax.selection.selection_config"),
}


def __getattr__(name: str) -> Any:
  # ``gbn_jax.nnx`` after a plain ``import gbn_jax``, imported on first use
  # so that linen-only users don't pay for importing flax.nnx.
  if name == "nnx":
    import importlib  # pylint: disable=g-import-not-at-top

    return importlib.import_module("gbn_jax.nnx")
  if name in _DEPRECATED:
    module, new = _DEPRECATED[name]
    warnings.warn(
        f"gbn_jax.{name} is deprecated and will be removed in the next"
        f" release; use {new}.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(module, name)
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
