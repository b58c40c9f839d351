"""Existing models on GBN: flax's BatchNorm layers computing GBN in place.

Two ways, one per flax API, both keeping the model's own variables:

* nnx: :func:`convert_batchnorm` returns the model with every
  ``nnx.BatchNorm`` replaced by a :class:`gbn_jax.nnx.GBatchNorm` (exported
  as ``gbn_jax.nnx.convert_batchnorm``).
* linen: :func:`batchnorm_as_gbn`, a context manager under which every
  ``nn.BatchNorm`` call computes GBN on its own ``params`` and
  ``batch_stats`` (exported as ``gbn_jax.linen.batchnorm_as_gbn``); the
  model's code and variables are unchanged.

``gbn_jax.linen`` and ``gbn_jax.nnx`` import this module to re-export it,
so it imports their GBatchNorm classes when a function runs (both modules
are loaded by then), not at the top: that would be an import cycle. flax.nnx
too is imported by the nnx functions only: ``import gbn_jax`` (linen) does
not load it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import contextlib
import dataclasses
from typing import Any, TypeVar

import flax.linen as nn

from gbn_jax import _layer
from gbn_jax.measures import MeasureFn

Node = TypeVar("Node")

# flax's BatchNorm.__call__ as written, before linen wraps it: what the
# interceptor replaces, whichever module (a subclass calling super()
# included) runs it. GBatchNorm's own __call__ is another function.
_LINEN_BATCHNORM_CALL = nn.BatchNorm.__call__.__wrapped__


def _gbn_fields(
    measure: str | MeasureFn,
    alpha: float | None,
    calibration: str | None,
    renorm: bool,
    renorm_clipping: Mapping[str, float] | None,
) -> dict[str, Any]:
  """The GBN fields, checked as the layers check them (so a bad measure fails
  before any model is touched), with the clipping frozen."""
  renorm_clipping = _layer.validate(
      measure, alpha, True, calibration, renorm, renorm_clipping
  )
  return dict(
      measure=measure,
      alpha=alpha,
      calibration=calibration,
      renorm=renorm,
      renorm_clipping=renorm_clipping,
  )


# Alike gbn_jax/nnx.py::GBatchNorm.__init__: the GBN keywords it passes on.
def convert_batchnorm(
    model: Node,
    measure: str | MeasureFn = "sd",
    *,
    alpha: float | None = None,
    calibration: str | None = None,
    renorm: bool = False,
    renorm_clipping: Mapping[str, float] | None = None,
) -> Node:
  """An nnx model with every ``nnx.BatchNorm`` replaced by a GBatchNorm.

  nnx's answer to torch's ``convert_sync_batchnorm``. Each
  ``nnx.BatchNorm`` anywhere in ``model`` (in attributes, lists, tuples,
  dicts, ``nnx.List``/``nnx.Dict``, or ``model`` itself) becomes a
  :class:`gbn_jax.nnx.GBatchNorm` with the GBN arguments given here and
  everything else the layer's own: its fields (``num_features``,
  ``use_running_average``, ``axis``, ``momentum``, ``epsilon``, ``dtype``,
  ``param_dtype``, ``use_bias``, ``use_scale``, ``axis_name``,
  ``axis_index_groups``, ``use_fast_variance``, ``promote_dtype``) and its
  ``scale``/``bias`` ``nnx.Param`` and ``mean``/``var`` ``nnx.BatchStat``
  Variables, metadata included. A layer shared between several places is
  replaced by one GBatchNorm, shared the same way.

  As ``nnx.view`` and ``nnx.with_attributes`` do, it returns a new graph
  and leaves ``model`` as it was (its layers still ``nnx.BatchNorm``); the
  two share their Variables, so training either updates both. Take
  ``nnx.clone`` of the result for a model of its own, or reassign:
  ``model = convert_batchnorm(model, 'sqd2')``.

  Args:
    model: an nnx module, or a list, dict or tuple of them.
    measure: the GBN measure: a name from :data:`gbn_jax.MEASURES` or a
      callable, as :class:`gbn_jax.nnx.GBatchNorm`'s. ``'sd'`` computes
      what ``nnx.BatchNorm`` does.
    alpha: the probability level of ``'sqd'``.
    calibration: ``None`` or ``'normal'``.
    renorm: generalized batch renormalization in training.
    renorm_clipping: ``None`` or a dict with keys ``'rmax'``, ``'rmin'``,
      ``'dmax'``.

  Returns:
    The converted model (the GBatchNorm itself when ``model`` is an
    ``nnx.BatchNorm``).

  Raises:
    ValueError: a bad ``measure``/``alpha``/``calibration``/
      ``renorm_clipping`` (before anything is converted), or ``model``
      holds no ``nnx.BatchNorm`` to convert (GBatchNorm layers are left as
      they are).
    TypeError: ``model`` is not an nnx graph (a linen module: use
      :func:`gbn_jax.linen.batchnorm_as_gbn`), or it holds a subclass of
      ``nnx.BatchNorm`` other than GBatchNorm, whose own behaviour a
      conversion would drop.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import gbn_jax.nnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=rngs),
    ...                        nnx.BatchNorm(3, momentum=0.9, rngs=rngs))
    >>> model = gbn_jax.nnx.convert_batchnorm(model, measure='sqd2')
    >>> norm = model.layers[1]
    >>> type(norm).__name__, norm.measure, norm.momentum
    ('GBatchNorm', 'sqd2', 0.9)
  """
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  from flax.nnx import graphlib

  from gbn_jax import nnx as gbn_nnx

  # pylint: enable=g-import-not-at-top
  fields = _gbn_fields(measure, alpha, calibration, renorm, renorm_clipping)
  if isinstance(model, nn.Module):
    raise TypeError(
        f"model is a linen module ({type(model).__name__}): linen modules"
        " hold no layers to replace; run it under"
        " gbn_jax.linen.batchnorm_as_gbn(...) instead."
    )
  if graphlib.get_node_impl(model) is None:
    raise TypeError(
        f"model must be an nnx.Module (or a list, dict or tuple of them),"
        f" not {type(model).__name__}."
    )
  converted = 0

  def convert(path: tuple[Any, ...], node: Any) -> Any:
    nonlocal converted
    if not isinstance(node, nnx.BatchNorm) or isinstance(
        node, gbn_nnx.GBatchNorm
    ):
      return node
    if type(node) is not nnx.BatchNorm:
      where = "/".join(map(str, path)) or "<model>"
      raise TypeError(
          f"model holds {type(node).__name__} at {where!r}, a subclass of"
          " nnx.BatchNorm: converting it would drop what the subclass"
          " changes. Replace it by gbn_jax.nnx.GBatchNorm yourself."
      )
    converted += 1
    return _to_gbn(gbn_nnx.GBatchNorm, node, fields)

  result = _map_graph(convert, model)
  if not converted:
    raise ValueError(
        f"model ({type(model).__name__}) holds no nnx.BatchNorm to convert"
        " (GBatchNorm layers are left as they are)."
    )
  return result


def _to_gbn(cls: type[Any], layer: Any, fields: Mapping[str, Any]) -> Any:
  """A ``cls`` (nnx GBatchNorm) with ``layer``'s (an ``nnx.BatchNorm``)
  fields and Variables and the GBN ``fields``."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  norm = cls(
      layer.num_features,
      param_dtype=layer.param_dtype,
      use_bias=layer.use_bias,
      use_scale=layer.use_scale,
      # Only allocates a scale and bias that the layer's replace below.
      rngs=nnx.Rngs(0),
      **fields,
  )
  # Every public attribute nnx.BatchNorm sets (its fields and its four
  # Variables, shared rather than copied, as nnx.view shares them); the
  # private ones are nnx's bookkeeping of each object.
  for name, value in vars(layer).items():
    if not name.startswith("_"):
      setattr(norm, name, value)
  return norm


def _map_graph(f, node: Any) -> Any:
  """``nnx.recursive_map(f, node)`` that also rebuilds tuples.

  nnx's own refuses to replace a child of an immutable pytree (a tuple of
  layers); here the tuple is rebuilt and set on its parent instead.
  """
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  from flax.nnx import graphlib

  # pylint: enable=g-import-not-at-top
  node = nnx.clone(node, variables=False)
  # id -> (the node, its result): holding the node keeps its id from being
  # reused by an object made later (a rebuilt tuple replaces its original).
  done: dict[int, tuple[Any, Any]] = {}

  def visit(path: tuple[Any, ...], current: Any) -> Any:
    key = id(current)
    if key in done:
      return done[key][1]
    original = current
    impl = graphlib.get_node_impl(current)
    if impl is not None:
      done[key] = (original, current)  # a cycle back to here keeps the node
      children = impl.node_dict(current)
      new = {k: visit((*path, k), v) for k, v in children.items()}
      changed = [k for k in children if new[k] is not children[k]]
      if changed and impl.set_key is not None:
        for k in changed:
          impl.set_key(current, k, new[k])
      elif changed:
        nodes, aux = impl.flatten(current)
        current = impl.unflatten(
            [(k, new[k]) if k in new else (k, v) for k, v in nodes], aux
        )
    done[key] = (original, f(path, current))
    return done[key][1]

  return visit((), node)


# Alike gbn_jax/_convert.py::convert_batchnorm: the GBN arguments, per API.
def batchnorm_as_gbn(
    measure: str | MeasureFn = "sd",
    *,
    alpha: float | None = None,
    calibration: str | None = None,
    renorm: bool = False,
    renorm_clipping: Mapping[str, float] | None = None,
) -> contextlib.AbstractContextManager[None]:
  """Every linen ``nn.BatchNorm`` computes GBN while the context is open.

  Runs an existing linen model, unchanged, with GBN in place of BatchNorm: a
  method interceptor (``flax.linen.intercept_methods``) replaces each
  ``nn.BatchNorm`` call with :class:`gbn_jax.GBatchNorm`'s, on the same
  variables (``params`` ``scale``/``bias``, ``batch_stats`` ``mean``/``var``,
  created as flax's when initializing) with the same fields
  (``use_running_average``, ``axis``, ``momentum``, ``epsilon``, dtypes,
  ``axis_name``, ``axis_index_groups``, ``use_fast_variance``,
  ``force_float32_reductions``, initializers) and call arguments
  (``use_running_average``, ``mask``). So the running ``mean``/``var`` become
  the running ``S``/``D^2``, and a checkpoint of the model loads as it is.
  ``measure='sd'`` computes what flax's layer does. GBatchNorm layers in the
  model are left as they are.

  The interception happens where the model is traced: wrap the
  ``init``/``apply`` call (or the ``jax.jit``-ed function's first call, which
  traces it; a function compiled outside the context keeps BatchNorm).

  Args:
    measure: the GBN measure: a name from :data:`gbn_jax.MEASURES` or a
      callable, as :class:`gbn_jax.GBatchNorm`'s.
    alpha: the probability level of ``'sqd'``.
    calibration: ``None`` or ``'normal'``.
    renorm: generalized batch renormalization in training.
    renorm_clipping: ``None`` or a dict with keys ``'rmax'``, ``'rmin'``,
      ``'dmax'``.

  Returns:
    A context manager.

  Raises:
    ValueError: a bad ``measure``, ``alpha``, ``calibration`` or
      ``renorm_clipping``, when called (before any model runs).

  Example::

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import gbn_jax.linen
    >>> model = nn.BatchNorm(use_running_average=False)
    >>> x = jax.random.normal(jax.random.key(0), (8, 3))
    >>> variables = model.init(jax.random.key(1), x)
    >>> with gbn_jax.linen.batchnorm_as_gbn(measure='sqd2'):
    ...   y, updates = model.apply(variables, x, mutable=['batch_stats'])
    >>> float((jax.nn.relu(y) == 0).mean())  # centered on the median
    0.5
  """
  from gbn_jax import linen as gbn_linen  # pylint: disable=g-import-not-at-top

  fields = _gbn_fields(measure, alpha, calibration, renorm, renorm_clipping)
  return _intercepting(gbn_linen.GBatchNorm, fields)


@contextlib.contextmanager
def _intercepting(
    cls: type[nn.BatchNorm], fields: Mapping[str, Any]
) -> Iterator[None]:
  layer_fields = [
      f.name
      for f in dataclasses.fields(nn.BatchNorm)
      if f.init and f.name not in ("parent", "name")
  ]

  def interceptor(next_fun, args, kwargs, context):
    orig = context.orig_method
    if getattr(orig, "func", None) is not _LINEN_BATCHNORM_CALL:
      return next_fun(*args, **kwargs)
    module = context.module
    # Bound to the layer's own scope, GBatchNorm reads, creates and updates
    # exactly the variables flax's layer would, with the collections'
    # mutability of this apply.
    norm = cls(
        **{name: getattr(module, name) for name in layer_fields},
        **fields,
        parent=module.scope,
    )
    return norm(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield
