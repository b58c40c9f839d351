"""The conversions' ``kinds``: flax's LayerNorm, GroupNorm and InstanceNorm
converted by gbn_jax.nnx.convert_batchnorm and computed as GBN under
gbn_jax.linen.batchnorm_as_gbn.

References: the original flax model itself (``measure='sd'``: its outputs,
bit for bit eagerly, and gradients, to rounding (GBN's derivative is
written out); its variables, names and initializers)
and numpy written from the definitions (``tests/helpers/reference.py``) for
another measure. Models no one here wrote, from the installed flax's sdist
(fetched as ``tests/gbn_jax/test_convert.py`` fetches it; offline they
skip, unless ``GBN_FLAX_SDIST`` or ``GBN_FLAX_SRC`` names a copy): linen,
the decoder-only ``TransformerLM`` of ``examples/lm1b/models.py``; nnx, the
encoder-decoder transformer of ``docs_nnx/examples/machine_translation.md``
(its model's code cells, run as written).
"""

from __future__ import annotations

import pathlib
import re

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax.linen
import gbn_jax.nnx

from tests.helpers import reference as ref
from tests.helpers.flax_sdist import load_module
from tests.helpers.flax_sdist import unpacked_flax_sdist

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE_KINDS = ("LayerNorm", "GroupNorm", "InstanceNorm")
GBN_NAMES = ("GBatchNorm", "GLayerNorm", "GGroupNorm", "GInstanceNorm")


def _some_quick(values, quick):
  """``values`` as parameters, those not in ``quick`` marked slow."""
  return [
      v if v in quick else pytest.param(v, marks=pytest.mark.slow)
      for v in values
  ]


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _assert_trees_close(a, b, rtol=2e-5):
  # Gradients: GBN's derivative is written out, flax's is autodiff's, so
  # they round differently (on the tree's scale: a gradient that cancels
  # to about zero keeps its terms' rounding).
  assert jax.tree.structure(a) == jax.tree.structure(b)
  leaves = [np.asarray(y, np.float64) for y in jax.tree.leaves(b)]
  scale = max([1.0] + [float(np.abs(y).max()) for y in leaves if y.size])
  for x, y in zip(jax.tree.leaves(a), leaves):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * scale)


def _perturbed(tree, seed=1, size=0.3):
  # Away from the initializers (zeros and ones), so that every scale and
  # bias shows in the output.
  leaves = jax.tree.leaves(tree)
  keys = iter(jax.random.split(jax.random.key(seed), len(leaves)))
  return jax.tree.map(
      lambda a: a + size * jax.random.normal(next(keys), a.shape, a.dtype),
      tree,
  )


def _inputs(shape=(4, 5, 6, 8), seed=0):
  x = jax.random.normal(jax.random.key(seed), shape) * 2 + 1
  mask = jax.random.uniform(jax.random.key(seed + 1), shape) < 0.7
  return x, mask.at[..., :1, :].set(True)


def numpy_norm(kind, x, measure, scale, bias, eps, fields, mask=None):
  """A per-example layer's output from the definitions, in float64: ``(S,
  D)`` of each example's values (or group's), ``(x - S) / sqrt(D^2 + eps)
  * scale + bias``. ``fields`` are the layer's axes and groups."""
  x = np.asarray(x, np.float64)
  ndim = x.ndim
  mask = None if mask is None else np.broadcast_to(mask, x.shape)
  view = x
  if kind == "LayerNorm":
    axes = fields["reduction_axes"]
    feature_axes = fields["feature_axes"]
  elif kind == "InstanceNorm":
    feature_axes = fields["feature_axes"]
    axes = tuple(a for a in range(1, ndim) if a not in feature_axes)
  else:  # GroupNorm: the channels as (groups, size), reduced over all but
    # the examples and the groups.
    size = fields["group_size"]
    view = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    mask = None if mask is None else mask.reshape(view.shape)
    axes = (*range(1, ndim - 1), ndim)
    feature_axes = (ndim - 1,)
  s, d = ref.per_feature(
      lambda row: ref.measure_1d(measure, row), view, axes, mask
  )
  y = ref.normalize(view, s, d, axes, eps=eps).reshape(x.shape)
  param_shape = [x.shape[a] if a in feature_axes else 1 for a in range(ndim)]
  if scale is not None:
    y = y * np.reshape(scale, param_shape)
  if bias is not None:
    y = y + np.reshape(bias, param_shape)
  return y


# ------------------------------------------------------------------- linen

# Each kind with fields of its own (axes, groups, epsilon, initializers,
# use_bias/use_scale, the variance's pass), and those the numpy reference
# reads.
LINEN_FIELDS = {
    "LayerNorm": dict(
        epsilon=1e-3,
        reduction_axes=(1, 2),
        feature_axes=(3,),
        use_fast_variance=False,
        scale_init=nn.initializers.constant(1.5),
    ),
    "GroupNorm": dict(
        num_groups=None,
        group_size=2,
        epsilon=1e-4,
        use_bias=False,
        scale_init=nn.initializers.normal(0.5),
    ),
    "InstanceNorm": dict(
        feature_axes=(1, 3),
        epsilon=1e-2,
        use_scale=False,
        bias_init=nn.initializers.constant(0.25),
    ),
}


class _LinenInner(nn.Module):
  kind: str

  @nn.compact
  def __call__(self, x):
    return getattr(nn, self.kind)(**LINEN_FIELDS[self.kind])(jnp.tanh(x))


class _LinenNet(nn.Module):
  """Dense, the norm, a submodule with another norm (auto-named both), and
  a BatchNorm that only the default kinds convert."""

  kind: str

  @nn.compact
  def __call__(self, x, mask=None):
    x = nn.Dense(8)(x)
    x = getattr(nn, self.kind)(**LINEN_FIELDS[self.kind])(x, mask=mask)
    x = _LinenInner(self.kind)(x)
    return nn.BatchNorm(use_running_average=True)(x)


def _perturbed_params(variables):
  return {**variables, "params": _perturbed(variables["params"])}


def _gbn_types_run(fn):
  """``fn()``, and the names of the GBN layers that ran in it."""
  seen = []

  def record(next_fun, args, kwargs, context):
    name = type(context.module).__name__
    if context.method_name == "__call__" and name in GBN_NAMES:
      seen.append(name)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    out = fn()
  return out, seen


@pytest.mark.parametrize("kind", _some_quick(EXAMPLE_KINDS, {"LayerNorm"}))
def test_linen_sd_is_flax(kind):
  model = _LinenNet(kind)
  x, mask = _inputs()
  # A fresh jit per call, traced in its own context.
  init = lambda: jax.jit(lambda x: model.init(jax.random.key(1), x))(x)
  expected = init()
  with gbn_jax.linen.batchnorm_as_gbn("mad", kinds=(kind,)):
    got, types = _gbn_types_run(init)
  # Flax's names, shapes and initializers: a checkpoint loads as it is.
  _assert_trees_equal(got, expected)
  assert types.count(f"G{kind}") == 2 and "GBatchNorm" not in types, types

  variables = _perturbed_params(expected)
  loss = lambda v, x: jnp.sum(jnp.sin(model.apply(v, x, mask=mask)) * x)
  # The outputs op by op; the gradients, compared to rounding only, jitted.
  grad = lambda: jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, x)
  y = model.apply(variables, x, mask=mask)
  grads = grad()
  with gbn_jax.linen.batchnorm_as_gbn("sd", kinds=[getattr(nn, kind)]):
    (y_gbn, grads_gbn), types = _gbn_types_run(
        lambda: (model.apply(variables, x, mask=mask), grad())
    )
    y_jit = jax.jit(lambda v, x: model.apply(v, x, mask=mask))(variables, x)
  assert f"G{kind}" in types
  # Op by op, as flax's: bit for bit; the gradients to rounding.
  np.testing.assert_array_equal(y_gbn, y)
  _assert_trees_close(grads_gbn, grads)
  np.testing.assert_allclose(y_jit, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("measure", _some_quick(["rsd", "sqd2"], {"rsd"}))
@pytest.mark.parametrize("kind", EXAMPLE_KINDS)
def test_linen_layer_vs_numpy(kind, measure):
  fields = LINEN_FIELDS[kind]
  layer = getattr(nn, kind)(**fields)
  x, mask = _inputs()
  params = _perturbed(layer.init(jax.random.key(0), x))["params"]
  with gbn_jax.linen.batchnorm_as_gbn(measure, kinds=kind):
    y = layer.apply({"params": params}, x, mask=mask)
  expected = numpy_norm(
      kind,
      x,
      measure,
      params.get("scale"),
      params.get("bias"),
      fields["epsilon"],
      fields,
      mask=np.asarray(mask),
  )
  np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5)


def test_linen_default_converts_batchnorm_only():
  model = _LinenNet("LayerNorm")
  x, _ = _inputs()
  variables = _perturbed_params(model.init(jax.random.key(1), x))
  expected = model.apply(variables, x)
  with gbn_jax.linen.batchnorm_as_gbn("wcd"):
    got, types = _gbn_types_run(lambda: model.apply(variables, x))
  # The BatchNorm ran as GBN (on its running statistics: flax's result),
  # the LayerNorms as flax's.
  assert types == ["GBatchNorm"], types
  np.testing.assert_array_equal(got, expected)
  with gbn_jax.linen.batchnorm_as_gbn("wcd", kinds=("BatchNorm", "LayerNorm")):
    both, types = _gbn_types_run(lambda: model.apply(variables, x))
  assert sorted(types) == ["GBatchNorm", "GLayerNorm", "GLayerNorm"], types
  assert np.abs(np.asarray(both) - np.asarray(expected)).max() > 1e-3


@pytest.mark.slow
def test_linen_every_kind_at_once_sd_is_flax():
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x, train):
      x = nn.Conv(8, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
      x = nn.GroupNorm(num_groups=4)(x)
      x = nn.InstanceNorm()(nn.relu(x))
      return nn.LayerNorm(name="head_norm")(x.mean((1, 2)))

  x, _ = _inputs((4, 6, 6, 3))
  model = Net()
  variables = _perturbed_params(model.init(jax.random.key(1), x, False))
  run = lambda: model.apply(variables, x, True, mutable=["batch_stats"])
  expected = run()
  with gbn_jax.linen.batchnorm_as_gbn(
      "sd", kinds=("BatchNorm", *EXAMPLE_KINDS)
  ):
    got, types = _gbn_types_run(run)
  assert sorted(set(types)) == [
      "GBatchNorm",
      "GGroupNorm",
      "GInstanceNorm",
      "GLayerNorm",
  ]
  _assert_trees_equal(got, expected)


# --------------------------------------------------------------------- nnx

NNX_FIELDS = {
    "LayerNorm": dict(
        epsilon=1e-3,
        reduction_axes=(1, 2),
        feature_axes=(3,),
        use_fast_variance=False,
        scale_init=nnx.initializers.constant(1.5),
        scale_metadata={"note": "kept"},
    ),
    "GroupNorm": dict(
        num_groups=None,
        group_size=2,
        epsilon=1e-4,
        use_bias=False,
        param_dtype=jnp.float16,
    ),
    "InstanceNorm": dict(
        feature_axes=-1,
        epsilon=1e-2,
        use_scale=False,
        dtype=jnp.float32,
    ),
}


class _NnxNet(nnx.Module):
  """Linear, the norm, another reached from two places, a BatchNorm."""

  def __init__(self, kind: str, rngs: nnx.Rngs):
    norm = lambda: getattr(nnx, kind)(8, **NNX_FIELDS[kind], rngs=rngs)
    self.linear = nnx.Linear(8, 8, rngs=rngs)
    self.norms = nnx.List([norm(), norm()])
    self.again = self.norms[1]
    self.batch_norm = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)

  def __call__(self, x, mask=None):
    x = self.norms[0](self.linear(x), mask=mask)
    return self.batch_norm(self.again(jnp.tanh(x)))


def _of_type(model, cls):
  return {p: n for p, n in nnx.iter_graph(model) if isinstance(n, cls)}


@pytest.mark.parametrize("kind", EXAMPLE_KINDS)
def test_nnx_convert_keeps_each_layer(kind):
  model = _NnxNet(kind, nnx.Rngs(0))
  flax_cls, gbn_cls = getattr(nnx, kind), getattr(gbn_jax.nnx, f"G{kind}")
  before = _of_type(model, flax_cls)
  converted = gbn_jax.nnx.convert_batchnorm(
      model, "sqd", alpha=0.8, calibration="normal", kinds=kind
  )
  after = _of_type(converted, flax_cls)
  assert set(after) == set(before) and len(after) == 2
  for path, norm in after.items():
    old = before[path]
    assert type(norm) is gbn_cls, path
    assert (norm.measure, norm.alpha, norm.calibration) == (
        "sqd",
        0.8,
        "normal",
    )
    # Every field and Variable of flax's layer, the Variables shared.
    public = {k: v for k, v in vars(old).items() if not k.startswith("_")}
    assert public and all(getattr(norm, k) is v for k, v in public.items())
  assert converted.again is converted.norms[1]
  assert type(converted.batch_norm) is nnx.BatchNorm
  assert all(type(n) is flax_cls for n in _of_type(model, flax_cls).values())
  if kind == "LayerNorm":
    assert converted.norms[0].scale.get_metadata("note") == "kept"
  if kind == "GroupNorm":
    assert converted.norms[0].num_groups == 4
    assert converted.norms[0].scale[...].dtype == jnp.float16


@pytest.mark.parametrize("kind", EXAMPLE_KINDS)
def test_nnx_sd_is_the_original(kind):
  model = _NnxNet(kind, nnx.Rngs(0))
  nnx.update(model, _perturbed(nnx.state(model, nnx.Param)))
  converted = gbn_jax.nnx.convert_batchnorm(model, "sd", kinds=[kind])
  x, mask = _inputs((4, 5, 6, 8))
  loss = lambda m, x: jnp.sum(jnp.sin(m(x, mask=mask)) * x)
  # Op by op, bit for bit; the gradients to rounding.
  np.testing.assert_array_equal(converted(x, mask=mask), model(x, mask=mask))
  grad = lambda m: nnx.grad(loss, argnums=(0, 1))(m, x)
  _assert_trees_close(grad(converted), grad(model))
  jitted = nnx.jit(lambda m, x: m(x, mask=mask))
  np.testing.assert_allclose(
      jitted(converted, x), model(x, mask=mask), rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize("kind", EXAMPLE_KINDS)
def test_nnx_layer_vs_numpy(kind):
  fields = dict(NNX_FIELDS[kind], param_dtype=jnp.float32)
  layer = getattr(nnx, kind)(8, **fields, rngs=nnx.Rngs(0))
  nnx.update(layer, _perturbed(nnx.state(layer, nnx.Param)))
  norm = gbn_jax.nnx.convert_batchnorm(layer, "rsd", kinds=kind)
  x, mask = _inputs()
  # NNX_FIELDS' axes and groups, as numpy_norm reads them.
  reference_fields = {
      "reduction_axes": (1, 2),
      "feature_axes": (3,),
      "group_size": 2,
  }
  expected = numpy_norm(
      kind,
      x,
      "rsd",
      None if norm.scale is None else norm.scale[...],
      None if norm.bias is None else norm.bias[...],
      fields["epsilon"],
      reference_fields,
      mask=np.asarray(mask),
  )
  np.testing.assert_allclose(norm(x, mask=mask), expected, rtol=2e-5, atol=2e-5)


def test_nnx_default_converts_batchnorm_only():
  model = _NnxNet("GroupNorm", nnx.Rngs(0))
  converted = gbn_jax.nnx.convert_batchnorm(model, "sqd2")
  assert type(converted.batch_norm) is gbn_jax.nnx.GBatchNorm
  assert all(type(n) is nnx.GroupNorm for n in converted.norms)
  no_batchnorm = nnx.Sequential(nnx.LayerNorm(3, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="holds no nnx.BatchNorm"):
    gbn_jax.nnx.convert_batchnorm(no_batchnorm, "sqd2")
  with pytest.raises(ValueError, match="no nnx.GroupNorm or nnx.InstanceNorm"):
    gbn_jax.nnx.convert_batchnorm(
        no_batchnorm, "sqd2", kinds=("InstanceNorm", nnx.GroupNorm)
    )


@pytest.mark.slow
def test_nnx_every_kind_at_once():
  rngs = nnx.Rngs(0)
  model = nnx.Sequential(
      nnx.Conv(3, 8, (3, 3), rngs=rngs),
      nnx.BatchNorm(8, momentum=0.8, rngs=rngs),
      nnx.GroupNorm(8, num_groups=4, rngs=rngs),
      nnx.InstanceNorm(8, rngs=rngs),
      nnx.LayerNorm(8, rngs=rngs),
  )
  nnx.update(model, _perturbed(nnx.state(model, nnx.Param)))
  original = nnx.clone(model)
  converted = gbn_jax.nnx.convert_batchnorm(
      model, "sd", kinds=("BatchNorm", *EXAMPLE_KINDS)
  )
  assert [type(m).__name__ for m in converted.layers[1:]] == [
      "GBatchNorm",
      "GGroupNorm",
      "GInstanceNorm",
      "GLayerNorm",
  ]
  x, _ = _inputs((4, 6, 6, 3))
  np.testing.assert_array_equal(converted(x), original(x))
  _assert_trees_equal(nnx.state(converted), nnx.state(original))


# ----------------------------------------------------------------- errors


def test_kinds_errors():
  bn = lambda: nnx.BatchNorm(3, rngs=nnx.Rngs(0))
  for convert in (
      lambda **kw: gbn_jax.nnx.convert_batchnorm(bn(), **kw),
      gbn_jax.linen.batchnorm_as_gbn,
  ):
    with pytest.raises(ValueError, match="unknown layer kind 'RMSNorm'"):
      convert(kinds=("BatchNorm", "RMSNorm"))
    with pytest.raises(ValueError, match="at least one"):
      convert(kinds=())
    with pytest.raises(ValueError, match="BatchNorm layers only"):
      convert(kinds="LayerNorm", renorm=True)
  with pytest.raises(TypeError, match="pass nnx.LayerNorm"):
    gbn_jax.nnx.convert_batchnorm(bn(), kinds=nn.LayerNorm)
  with pytest.raises(TypeError, match="pass nn.GroupNorm"):
    gbn_jax.linen.batchnorm_as_gbn(kinds=[nnx.GroupNorm])
  with pytest.raises(ValueError, match="unknown layer kind"):
    gbn_jax.linen.batchnorm_as_gbn(kinds=[gbn_jax.linen.GLayerNorm])

  class MyNorm(nnx.LayerNorm):
    pass

  model = nnx.List([MyNorm(2, rngs=nnx.Rngs(0))])
  with pytest.raises(TypeError, match="MyNorm at '0', a subclass of nnx.Lay"):
    gbn_jax.nnx.convert_batchnorm(model, kinds="LayerNorm")
  # GBN layers are left as they are.
  ours = nnx.List([gbn_jax.nnx.GLayerNorm(2, measure="mad", rngs=nnx.Rngs(0))])
  with pytest.raises(ValueError, match="holds no nnx.LayerNorm"):
    gbn_jax.nnx.convert_batchnorm(ours, kinds="LayerNorm")


# ------------------------------------------- models no one here wrote (sdist)


@pytest.fixture(scope="module")
def flax_src(tmp_path_factory) -> pathlib.Path:
  """The unpacked sdist of the installed flax version."""
  return unpacked_flax_sdist(tmp_path_factory.mktemp("flax_sdist"))


def _source(src: pathlib.Path, relative: str) -> pathlib.Path:
  path = src / relative
  if not path.exists():
    pytest.skip(f"{relative} is not in this flax's sdist")
  return path


def _lm1b(flax_src):
  """flax's ``TransformerLM`` (lm1b), small, deterministic; its tokens."""
  models = load_module(
      "gbn_test_flax_lm1b_models",
      _source(flax_src, "examples/lm1b/models.py"),
  )
  config = models.TransformerConfig(
      vocab_size=32,
      output_vocab_size=32,
      emb_dim=16,
      num_heads=2,
      num_layers=2,
      qkv_dim=16,
      mlp_dim=32,
      max_len=16,
      deterministic=True,
  )
  tokens = jax.random.randint(jax.random.key(3), (3, 10), 1, 32)
  return models.TransformerLM(config), tokens.at[2, 7:].set(0)


def _lm1b_loss(model):
  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(log_p, tokens[..., None], -1).mean()

  return loss


@pytest.mark.slow
def test_linen_lm1b_sd_is_flax(flax_src):
  model, tokens = _lm1b(flax_src)
  init = lambda: model.init(jax.random.key(1), tokens)
  expected = init()
  with gbn_jax.linen.batchnorm_as_gbn("sqd2", kinds=("LayerNorm",)):
    got, types = _gbn_types_run(init)
  assert types.count("GLayerNorm") == 5, types
  # The names, shapes, values and logical partitioning of flax's params.
  _assert_trees_equal(got, expected)
  assert isinstance(
      expected["params"]["decoder"]["encoderdecoder_norm"]["scale"],
      nn.Partitioned,
  )
  params = _perturbed(nn.unbox(expected)["params"])
  loss = _lm1b_loss(model)
  logits = model.apply({"params": params}, tokens)
  grads = jax.grad(loss)(params, tokens)
  with gbn_jax.linen.batchnorm_as_gbn("sd", kinds="LayerNorm"):
    (got_logits, got_grads), types = _gbn_types_run(
        lambda: (
            model.apply({"params": params}, tokens),
            jax.grad(loss)(params, tokens),
        )
    )
    jit_logits = jax.jit(lambda p: model.apply({"params": p}, tokens))(params)
  assert types == ["GLayerNorm"] * 10, types
  # Op by op, as flax's: bit for bit; the gradients to rounding.
  np.testing.assert_array_equal(got_logits, logits)
  _assert_trees_close(got_grads, grads)
  np.testing.assert_allclose(jit_logits, logits, rtol=1e-5, atol=1e-5)


def test_linen_lm1b_rsd_each_layernorm_is_numpy(flax_src):
  model, tokens = _lm1b(flax_src)
  init = jax.jit(lambda tokens: model.init(jax.random.key(1), tokens))
  params = _perturbed(nn.unbox(init(tokens))["params"])

  def run(params, tokens):
    # Each LayerNorm's path, input and output (GBN's layer, bound to the
    # LayerNorm's scope), out of the jitted function.
    seen = {}

    def record(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if type(context.module) is gbn_jax.linen.GLayerNorm and (
          context.method_name == "__call__"
      ):
        seen["/".join(context.module.scope.path)] = (args[0], out)
      return out

    with nn.intercept_methods(record):
      logits = model.apply({"params": params}, tokens)
    return logits, seen

  with gbn_jax.linen.batchnorm_as_gbn("rsd", kinds=["LayerNorm"]):
    logits, seen = jax.jit(run)(params, tokens)
  assert len(seen) == 5
  for path, (x, y) in seen.items():
    layer = params
    for name in path.split("/"):
      layer = layer[name]
    expected = numpy_norm(
        "LayerNorm",
        x,
        "rsd",
        layer["scale"],
        layer["bias"],
        1e-6,
        {"reduction_axes": (2,), "feature_axes": (2,)},
    )
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5)
  assert np.all(np.isfinite(logits))


_TRANSLATION_CLASSES = (
    "TransformerEncoder",
    "PositionalEmbedding",
    "TransformerDecoder",
    "TransformerModel",
)


def _translation_transformer(flax_src):
  """nnx's machine-translation tutorial's ``TransformerModel``, from its
  code cells; small, without dropout; two token batches."""
  page = _source(flax_src, "docs_nnx/examples/machine_translation.md")
  cells = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
  found = {}
  for cell in cells:
    match = re.match(r"class (\w+)\(nnx\.Module\)", cell)
    if match and match.group(1) in _TRANSLATION_CLASSES:
      found[match.group(1)] = cell
  if set(found) != set(_TRANSLATION_CLASSES):
    pytest.skip(f"the tutorial's model cells changed: found {sorted(found)}")
  namespace = {"jax": jax, "jnp": jnp, "nnx": nnx, "np": np}
  for name in _TRANSLATION_CLASSES:
    exec(found[name], namespace)  # pylint: disable=exec-used
  model = namespace["TransformerModel"](
      sequence_length=12,
      vocab_size=40,
      embed_dim=16,
      latent_dim=24,
      num_heads=2,
      dropout_rate=0.0,
      rngs=nnx.Rngs(0),
  )
  nnx.update(model, _perturbed(nnx.state(model, nnx.Param), size=0.1))
  source = jax.random.randint(jax.random.key(4), (3, 12), 1, 40)
  target = jax.random.randint(jax.random.key(5), (3, 12), 1, 40)
  return model, source, target


class _Recorder(nnx.Module):
  """Calls ``layer``, handing its input and output to ``seen``."""

  def __init__(self, layer, path, seen):
    self.layer = layer
    self.path = path
    self.seen = seen

  def __call__(self, x):
    y = self.layer(x)
    self.seen(self.path, x, y)
    return y


@pytest.mark.slow
def test_nnx_translation_transformer(flax_src):
  model, source, target = _translation_transformer(flax_src)
  assert len(_of_type(model, nnx.LayerNorm)) == 5
  converted = gbn_jax.nnx.convert_batchnorm(model, "sd", kinds="LayerNorm")
  norms = _of_type(converted, nnx.LayerNorm)
  assert {type(n) for n in norms.values()} == {gbn_jax.nnx.GLayerNorm}
  assert len(norms) == 5
  _assert_trees_equal(
      nnx.state(converted, nnx.Param), nnx.state(model, nnx.Param)
  )
  # Op by op, bit for bit; the gradients to rounding.
  np.testing.assert_array_equal(
      converted(source, target), model(source, target)
  )
  loss = lambda m: jnp.mean(jax.nn.log_softmax(m(source, target))[..., 0])
  _assert_trees_close(nnx.grad(loss)(converted), nnx.grad(loss)(model))

  # 'rsd': each LayerNorm is numpy's per-token definition on its input.
  rsd = gbn_jax.nnx.convert_batchnorm(
      nnx.clone(model), "rsd", kinds=nnx.LayerNorm
  )
  seen = []
  record = lambda path, x, y: seen.append((path, x, y))
  for path, norm in _of_type(rsd, gbn_jax.nnx.GLayerNorm).items():
    parent = rsd
    for name in path[:-1]:
      parent = getattr(parent, name)
    setattr(parent, path[-1], _Recorder(norm, path, record))
  logits = rsd(source, target)
  assert len(seen) == 5
  for path, x, y in seen:
    norm = _of_type(rsd, gbn_jax.nnx.GLayerNorm)[(*path, "layer")]
    expected = numpy_norm(
        "LayerNorm",
        x,
        "rsd",
        norm.scale[...],
        norm.bias[...],
        1e-6,
        {"reduction_axes": (2,), "feature_axes": (2,)},
    )
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5)
  assert np.abs(np.asarray(logits - model(source, target))).max() > 1e-3
