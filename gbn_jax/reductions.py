"""The pooled reductions a measure is built from, in one namespace.

Exact order statistics and their companions, all with the arguments
``(x, ..., axis, *, where, axis_name, axis_index_groups)``: a boolean mask
``where`` restricts a reduction to the masked-in elements, and ``axis_name``
pools the elements of every device along a named axis, exactly (under
``jax.shard_map`` and ``jax.pmap``). A custom measure that declares
``pools_devices=True`` (:func:`gbn_jax.register_measure`) reduces with these.

* :func:`quantile` and :func:`superquantile`: ``q_alpha`` and
  ``qbar_alpha`` (conventions and gradients in :mod:`gbn_jax.quantiles`);
* :func:`extreme`: the maximum or the minimum;
* :func:`mean`: the (masked, pooled) mean;
* :func:`quantile_rank`: the rank ``ceil(alpha * n)`` that ``q_alpha``
  selects among ``n`` values.

The selection backend behind them is scoped by
:func:`gbn_jax.selection.selection_config` (for benchmarks and tests: every
backend is exact).

>>> import jax.numpy as jnp
>>> from gbn_jax import reductions
>>> x = jnp.array([[0.], [1.], [2.], [7.]])
>>> reductions.quantile(x, 0.5, axis=0), reductions.extreme(x, 0, largest=True)
(Array([1.], dtype=float32), Array([7.], dtype=float32))
"""

from gbn_jax.quantiles import extreme
from gbn_jax.quantiles import mean
from gbn_jax.quantiles import quantile
from gbn_jax.quantiles import quantile_rank
from gbn_jax.quantiles import superquantile

# Alike gbn_jax/quantiles.py::__all__ (and measures.py's, in shape): these
# names re-exported for custom measures; quantiles' list may grow apart.
__all__ = [
    "extreme",
    "mean",
    "quantile",
    "quantile_rank",
    "superquantile",
]
