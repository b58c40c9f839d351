"""The pooled reductions a custom measure is built from, besides quantiles.

Both take the arguments of :func:`gbn_jax.quantile`: ``(x, ..., axis, *,
where, axis_name, axis_index_groups)``. A boolean mask ``where`` restricts a
reduction to the masked-in elements, and ``axis_name`` pools the elements of
every device along a named axis, exactly (under ``jax.shard_map`` and
``jax.pmap``). A custom measure that declares ``pools_devices=True``
(:func:`gbn_jax.register_measure`) reduces with these and with
:func:`gbn_jax.quantile` and :func:`gbn_jax.superquantile`.

* :func:`extreme`: the maximum or the minimum, with the order statistics'
  gradient convention (ties share the cotangent);
* :func:`mean`: the (masked, pooled) mean.

>>> import jax.numpy as jnp
>>> from gbn_jax import reductions
>>> x = jnp.array([[0.], [1.], [2.], [7.]])
>>> reductions.mean(x, axis=0), reductions.extreme(x, 0, largest=True)
(Array([2.5], dtype=float32), Array([7.], dtype=float32))
"""

from gbn_jax._quantiles import extreme
from gbn_jax._quantiles import mean

__all__ = ["extreme", "mean"]
