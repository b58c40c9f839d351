"""Existing models on GBN: flax's normalization layers computing GBN in place.

Two ways, one per flax API, both keeping the model's own variables; each
converts the flax layer kinds it is given (``kinds``: BatchNorm by default,
and any of LayerNorm, GroupNorm and InstanceNorm):

* nnx: :func:`convert_batchnorm` returns the model with every
  ``nnx.BatchNorm`` (``nnx.LayerNorm``, ...) replaced by a
  :class:`gbn_jax.nnx.GBatchNorm` (:class:`gbn_jax.nnx.GLayerNorm`, ...)
  (exported as ``gbn_jax.nnx.convert_batchnorm``).
* linen: :func:`batchnorm_as_gbn`, a context manager under which every
  ``nn.BatchNorm`` (``nn.LayerNorm``, ...) call computes GBN on its own
  variables (exported as ``gbn_jax.linen.batchnorm_as_gbn``); the model's
  code and variables are unchanged.

``gbn_jax.linen`` and ``gbn_jax.nnx`` import this module to re-export it,
so it imports their GBatchNorm classes when a function runs (both modules
are loaded by then), not at the top: that would be an import cycle. flax.nnx
too is imported by the nnx functions only: ``import gbn_jax`` (linen) does
not load it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import contextlib
import dataclasses
from typing import Any, TypeVar

import flax.linen as nn

from gbn_jax import _layer
from gbn_jax.measures import MeasureFn

Node = TypeVar("Node")

#: The flax layer kinds a conversion knows, by class name (the same in both
#: APIs), each with the name of its GBN layer in gbn_jax.linen/gbn_jax.nnx.
KINDS: dict[str, str] = {
    "BatchNorm": "GBatchNorm",
    "LayerNorm": "GLayerNorm",
    "GroupNorm": "GGroupNorm",
    "InstanceNorm": "GInstanceNorm",
}

# Each kind's flax __call__ as written, before linen wraps it: what the
# interceptor replaces, whichever module (a subclass calling super()
# included) runs it. The G-layers' own __call__ are other functions.
_LINEN_CALLS = {kind: getattr(nn, kind).__call__.__wrapped__ for kind in KINDS}


def _kinds(kinds: Any, api: Any, api_name: str) -> tuple[str, ...]:
  """``kinds`` (a name or flax class of ``api``, or a sequence of them) as
  names from :data:`KINDS`, in their order there."""
  if isinstance(kinds, (str, type)):
    kinds = (kinds,)
  if not isinstance(kinds, Sequence | set | frozenset) or not kinds:
    raise ValueError(
        f"kinds must name at least one of {tuple(KINDS)} (names or"
        f" {api_name} classes), not {kinds!r}."
    )
  names = set()
  for kind in kinds:
    if isinstance(kind, str) and kind in KINDS:
      names.add(kind)
    elif isinstance(kind, type) and any(
        kind is getattr(api, name) for name in KINDS
    ):
      names.add(kind.__name__)
    elif isinstance(kind, type) and kind.__name__ in KINDS:
      raise TypeError(
          f"kinds holds {kind.__module__}.{kind.__name__}, not the"
          f" {api_name} layer: pass {api_name}.{kind.__name__} or the name"
          f" {kind.__name__!r}."
      )
    else:
      raise ValueError(
          f"unknown layer kind {kind!r}: kinds are among {tuple(KINDS)}"
          f" (or the {api_name} classes of those names)."
      )
  return tuple(name for name in KINDS if name in names)


def _gbn_fields(
    measure: str | MeasureFn,
    alpha: float | None,
    calibration: str | None,
    renorm: bool,
    renorm_clipping: Mapping[str, float] | None,
    kinds: tuple[str, ...] = ("BatchNorm",),
) -> dict[str, dict[str, Any]]:
  """Each kind's GBN fields, checked as the layers check them (so a bad
  measure fails before any model is touched), with the clipping frozen;
  renormalization is BatchNorm's alone (the others keep no running
  statistics)."""
  renorm_clipping = _layer.validate(
      measure, alpha, True, calibration, renorm, renorm_clipping
  )
  if renorm and "BatchNorm" not in kinds:
    raise ValueError(
        f"renorm and renorm_clipping apply to BatchNorm layers only, and"
        f" kinds={kinds} converts none."
    )
  example = dict(measure=measure, alpha=alpha, calibration=calibration)
  return {
      kind: (
          dict(example, renorm=renorm, renorm_clipping=renorm_clipping)
          if kind == "BatchNorm"
          else example
      )
      for kind in kinds
  }


# Alike gbn_jax/nnx.py::GBatchNorm.__init__: the GBN keywords it passes on.
def convert_batchnorm(
    model: Node,
    measure: str | MeasureFn = "sd",
    *,
    alpha: float | None = None,
    calibration: str | None = None,
    renorm: bool = False,
    renorm_clipping: Mapping[str, float] | None = None,
    kinds: str | type[Any] | Sequence[str | type[Any]] = ("BatchNorm",),
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

  ``kinds`` names the layers converted, BatchNorm alone by default. With
  ``'LayerNorm'``, ``'GroupNorm'`` or ``'InstanceNorm'`` among them, each
  ``nnx.LayerNorm`` (``nnx.GroupNorm``, ``nnx.InstanceNorm``) becomes a
  :class:`gbn_jax.nnx.GLayerNorm` (:class:`~gbn_jax.nnx.GGroupNorm`,
  :class:`~gbn_jax.nnx.GInstanceNorm`) with ``measure``, ``alpha`` and
  ``calibration`` and, as above, the layer's own fields (its axes,
  ``epsilon``, groups, dtypes, ``use_bias``/``use_scale``,
  ``use_fast_variance``, ``axis_name``, ...) and ``scale``/``bias``
  Variables. Kinds not named are left as they are.

  As ``nnx.view`` and ``nnx.with_attributes`` do, it returns a new graph
  and leaves ``model`` as it was (its layers still flax's); the two share
  their Variables, so training either updates both. Take ``nnx.clone`` of
  the result for a model of its own, or reassign:
  ``model = convert_batchnorm(model, 'sqd2')``.

  Args:
    model: an nnx module, or a list, dict or tuple of them.
    measure: the GBN measure: a name from :data:`gbn_jax.MEASURES` or a
      callable, as :class:`gbn_jax.nnx.GBatchNorm`'s. ``'sd'`` computes
      what flax's layers do.
    alpha: the probability level of ``'sqd'``.
    calibration: ``None`` or ``'normal'``.
    renorm: generalized batch renormalization in training (BatchNorm
      layers only).
    renorm_clipping: ``None`` or a dict with keys ``'rmax'``, ``'rmin'``,
      ``'dmax'``.
    kinds: the flax layers to convert: names among ``'BatchNorm'``,
      ``'LayerNorm'``, ``'GroupNorm'`` and ``'InstanceNorm'``, or those nnx
      classes; one or a sequence. BatchNorm only by default.

  Returns:
    The converted model (the GBN layer itself when ``model`` is a layer
    it converts).

  Raises:
    ValueError: a bad ``measure``/``alpha``/``calibration``/
      ``renorm_clipping``/``kinds``, or ``renorm`` without BatchNorm among
      ``kinds`` (before anything is converted), or ``model`` holds no layer
      of ``kinds`` to convert (GBN layers are left as they are).
    TypeError: ``model`` is not an nnx graph (a linen module: use
      :func:`gbn_jax.linen.batchnorm_as_gbn`), ``kinds`` holds a linen
      class, or ``model`` holds a subclass of a flax layer of ``kinds``
      (other than the GBN layer), whose own behaviour a conversion would
      drop.

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

    A transformer block's LayerNorms (BatchNorm layers too, if it had
    any)::

    >>> block = nnx.Sequential(nnx.LayerNorm(8, epsilon=1e-5, rngs=rngs),
    ...                        nnx.Linear(8, 8, rngs=rngs))
    >>> block = gbn_jax.nnx.convert_batchnorm(
    ...     block, 'mad', kinds=('BatchNorm', 'LayerNorm'))
    >>> norm = block.layers[0]
    >>> type(norm).__name__, norm.measure, norm.epsilon
    ('GLayerNorm', 'mad', 1e-05)
  """
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  from flax.nnx import graphlib

  from gbn_jax import nnx as gbn_nnx

  # pylint: enable=g-import-not-at-top
  kinds = _kinds(kinds, nnx, "nnx")
  fields = _gbn_fields(
      measure, alpha, calibration, renorm, renorm_clipping, kinds
  )
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
  # flax's class -> (its kind, the GBN class).
  classes = {
      getattr(nnx, kind): (kind, getattr(gbn_nnx, KINDS[kind]))
      for kind in kinds
  }
  converted = 0

  def convert(path: tuple[Any, ...], node: Any) -> Any:
    nonlocal converted
    for flax_cls, (kind, cls) in classes.items():
      if not isinstance(node, flax_cls) or isinstance(node, cls):
        continue
      if type(node) is not flax_cls:
        where = "/".join(map(str, path)) or "<model>"
        raise TypeError(
            f"model holds {type(node).__name__} at {where!r}, a subclass of"
            f" nnx.{kind}: converting it would drop what the subclass"
            f" changes. Replace it by gbn_jax.nnx.{KINDS[kind]} yourself."
        )
      converted += 1
      return _to_gbn(cls, node, fields[kind])
    return node

  result = _map_graph(convert, model)
  if not converted:
    names = " or ".join(f"nnx.{kind}" for kind in kinds)
    raise ValueError(
        f"model ({type(model).__name__}) holds no {names} to convert"
        " (GBN layers are left as they are)."
    )
  return result


def _to_gbn(cls: type[Any], layer: Any, fields: Mapping[str, Any]) -> Any:
  """A ``cls`` (an nnx GBN layer) with ``layer``'s (flax's layer of that
  kind) fields and Variables and the GBN ``fields``."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if isinstance(layer, nnx.GroupNorm):
    # It keeps no num_features; both attributes hold the groups once built,
    # and the size alone fixes them (as the layer's own constructor checks).
    args = (layer.num_groups * layer.group_size, None, layer.group_size)
  else:
    args = (layer.num_features,)
  norm = cls(
      *args,
      param_dtype=layer.param_dtype,
      use_bias=layer.use_bias,
      use_scale=layer.use_scale,
      use_fast_variance=layer.use_fast_variance,
      # Only allocates a scale and bias that the layer's replace below.
      rngs=nnx.Rngs(0),
      **fields,
  )
  # Every public attribute flax's layer sets (its fields and its
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
    kinds: str | type[Any] | Sequence[str | type[Any]] = ("BatchNorm",),
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

  ``kinds`` names the layers converted, BatchNorm alone by default. With
  ``'LayerNorm'``, ``'GroupNorm'`` or ``'InstanceNorm'`` among them, each
  ``nn.LayerNorm`` (``nn.GroupNorm``, ``nn.InstanceNorm``) call is
  :class:`gbn_jax.linen.GLayerNorm`'s (:class:`~gbn_jax.linen.GGroupNorm`'s,
  :class:`~gbn_jax.linen.GInstanceNorm`'s) with ``measure``, ``alpha`` and
  ``calibration``, the layer's fields (axes, ``epsilon``, groups, dtypes,
  ``use_bias``/``use_scale``, initializers, ``use_fast_variance``,
  ``force_float32_reductions``, ``axis_name``, ...), its ``mask`` and its
  ``params`` ``scale``/``bias``, at their paths in the model. Kinds not
  named are left as they are.

  The interception happens where the model is traced: wrap the
  ``init``/``apply`` call (or the ``jax.jit``-ed function's first call, which
  traces it; a function compiled outside the context keeps flax's layers).

  Args:
    measure: the GBN measure: a name from :data:`gbn_jax.MEASURES` or a
      callable, as :class:`gbn_jax.GBatchNorm`'s.
    alpha: the probability level of ``'sqd'``.
    calibration: ``None`` or ``'normal'``.
    renorm: generalized batch renormalization in training (BatchNorm
      layers only).
    renorm_clipping: ``None`` or a dict with keys ``'rmax'``, ``'rmin'``,
      ``'dmax'``.
    kinds: the flax layers to convert: names among ``'BatchNorm'``,
      ``'LayerNorm'``, ``'GroupNorm'`` and ``'InstanceNorm'``, or those
      linen classes; one or a sequence. BatchNorm only by default.

  Returns:
    A context manager.

  Raises:
    ValueError: a bad ``measure``, ``alpha``, ``calibration``,
      ``renorm_clipping`` or ``kinds``, or ``renorm`` without BatchNorm
      among ``kinds``, when called (before any model runs).
    TypeError: ``kinds`` holds an nnx class.

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

    A model's LayerNorms, on its own parameters::

    >>> norm = nn.LayerNorm()
    >>> x = jax.random.normal(jax.random.key(0), (2, 8))
    >>> params = norm.init(jax.random.key(1), x)
    >>> with gbn_jax.linen.batchnorm_as_gbn('sqd2', kinds=['LayerNorm']):
    ...   y = norm.apply(params, x)
    >>> [int((y[i] > 0).sum()) for i in range(2)]  # each token's median
    [4, 4]
  """
  from gbn_jax import linen as gbn_linen  # pylint: disable=g-import-not-at-top

  kinds = _kinds(kinds, nn, "nn")
  fields = _gbn_fields(
      measure, alpha, calibration, renorm, renorm_clipping, kinds
  )
  return _intercepting(
      {kind: (getattr(gbn_linen, KINDS[kind]), fields[kind]) for kind in kinds}
  )


@contextlib.contextmanager
def _intercepting(
    conversions: Mapping[str, tuple[type[nn.Module], Mapping[str, Any]]],
) -> Iterator[None]:
  """Intercepts each kind's flax ``__call__``: ``conversions`` maps a kind
  to its GBN class and GBN fields."""
  # flax's __call__ -> (the GBN class, its fields: the layer's, then GBN's).
  calls = {
      _LINEN_CALLS[kind]: (
          cls,
          [
              f.name
              for f in dataclasses.fields(getattr(nn, kind))
              if f.init and f.name not in ("parent", "name")
          ],
          fields,
      )
      for kind, (cls, fields) in conversions.items()
  }

  def interceptor(next_fun, args, kwargs, context):
    conversion = calls.get(getattr(context.orig_method, "func", None))
    if conversion is None:
      return next_fun(*args, **kwargs)
    cls, layer_fields, fields = conversion
    module = context.module
    # Bound to the layer's own scope, the GBN layer reads, creates and
    # updates exactly the variables flax's layer would, with the
    # collections' mutability of this apply.
    norm = cls(
        **{name: getattr(module, name) for name in layer_fields},
        **fields,
        parent=module.scope,
    )
    return norm(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield
