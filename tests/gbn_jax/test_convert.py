"""Existing models on GBN: gbn_jax.nnx.convert_batchnorm and
gbn_jax.linen.batchnorm_as_gbn.

linen runs on a model no one here wrote: the ResNet of flax's own
``examples/imagenet/models.py``, read from the installed flax's sdist at test
time, as ``tools/flax_batchnorm_suite.py`` gets it (its ``_unpack``: ``pip
download``, which pip's HTTP cache serves after the first time). Offline it
skips, unless ``GBN_FLAX_SDIST`` (the ``.tar.gz``) or ``GBN_FLAX_SRC`` (an
unpacked tree) names a copy. References: flax's own layers (``measure='sd'``
must give their results bit for bit on the CPU) and the numpy definitions of
``tests/helpers/reference.py``.
"""

from __future__ import annotations

import functools
import pathlib

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax import GBatchNorm
import gbn_jax.linen
import gbn_jax.nnx

from tests.helpers import reference as ref
from tests.helpers.backend import assert_flax_bits
from tests.helpers.flax_sdist import load_module
from tests.helpers.flax_sdist import unpacked_flax_sdist

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def flax_models(tmp_path_factory):
  """flax's ``examples/imagenet/models.py``, of the installed flax version."""
  src = unpacked_flax_sdist(tmp_path_factory.mktemp("flax_sdist"))
  path = src / "examples" / "imagenet" / "models.py"
  if not path.exists():
    pytest.skip(f"{path} is not in this flax's sdist")
  return load_module("gbn_test_flax_imagenet_models", path)


@pytest.fixture(scope="module")
def resnet(flax_models):
  """flax's small ResNet and its variables, as flax initializes them.

  Initialized once for the module: the values depend on the key and the
  images' shape only, the same in every test here.
  """
  model = flax_models._ResNet1(num_classes=5, num_filters=8)  # pylint: disable=protected-access
  x = _images((4, 32, 32, 3))
  return model, jax.jit(lambda x: model.init(jax.random.key(1), x))(x)


def _images(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def _perturbed(tree, seed=1, size=0.3):
  # Away from the initializers (zeros and ones, a zero scale in each
  # block's last norm), so that every scale and bias shows in the output.
  keys = iter(
      jax.random.split(jax.random.key(seed), len(jax.tree.leaves(tree)))
  )
  return jax.tree.map(
      lambda a: a + size * jax.random.normal(next(keys), a.shape, a.dtype),
      tree,
  )


def _per_device(fn):
  # flax's ResNet pools its statistics over axis 'batch' (train.py pmaps
  # it); two vmapped members of four images each stand for two devices.
  return jax.vmap(fn, in_axes=(None, 0), axis_name="batch")


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


# --------------------------------------------------------------------- linen


def test_linen_init_is_flax(resnet):
  model, expected = resnet
  x = _images((4, 32, 32, 3))
  with gbn_jax.linen.batchnorm_as_gbn(measure="sqd2"):
    got = jax.jit(lambda x: model.init(jax.random.key(1), x))(x)
  # Same names, shapes and initializers (the zero scale_init of each
  # block's last norm included), and no statistics update while
  # initializing.
  _assert_trees_equal(got, expected)
  assert not np.any(expected["params"]["ResNetBlock_0"]["BatchNorm_1"]["scale"])


def _resnet_sd_training_step(resnet, jit: bool):
  """flax's ResNet's training step, as flax wrote it and on GBN ``'sd'``.

  Args:
    resnet: The fixture's model and variables.
    jit: Whether the step runs under one ``jax.jit`` or op by op.

  Returns:
    ``(model, variables, x, flax's (y, updates), GBN's (y, updates))``.
  """
  model, variables = resnet
  x = _images((2, 4, 32, 32, 3))
  variables = _perturbed(variables)
  # A jitted function is traced on its first call: a new one in the context.
  step = lambda: jax.jit(_train_step(model)) if jit else _train_step(model)
  expected = step()(variables, x)
  with gbn_jax.linen.batchnorm_as_gbn(measure="sd"):
    got = step()(variables, x)
  return model, variables, x, expected, got


def _train_step(model):
  """``model`` in training mode on each device's images: ``(y, updates)``."""
  return _per_device(
      lambda variables, x: model.apply(
          variables, x, train=True, mutable=["batch_stats"]
      )
  )


def test_linen_sd_is_flax_bit_for_bit(resnet):
  # Op by op: under one jit, XLA fuses flax's program and GBN's differently
  # (see test_linen_sd_matches_flax_under_jit).
  model, variables, x, (y, updates), (y_gbn, updates_gbn) = (
      _resnet_sd_training_step(resnet, jit=False)
  )
  np.testing.assert_array_equal(y_gbn, y)
  _assert_trees_equal(updates_gbn, updates)
  # Both members hold the statistics of the whole (pooled) batch.
  jax.tree.map(lambda a: np.testing.assert_array_equal(a[0], a[1]), updates)

  def evaluate(variables, x):
    return model.apply(variables, x, train=False)

  trained = {
      **variables,
      "batch_stats": jax.tree.map(lambda a: a[0], updates["batch_stats"]),
  }
  expected = _per_device(evaluate)(trained, x)
  with gbn_jax.linen.batchnorm_as_gbn(measure="sd"):
    got = _per_device(evaluate)(trained, x)
  np.testing.assert_array_equal(got, expected)
  # Once the context is closed the model is flax's again.
  np.testing.assert_array_equal(_train_step(model)(variables, x)[0], y)


def test_linen_sd_matches_flax_under_jit(resnet):
  _, _, _, (y, updates), (y_gbn, updates_gbn) = _resnet_sd_training_step(
      resnet, jit=True
  )
  # Measured: 2.4e-6 at most (float32 rounding of differently fused code).
  np.testing.assert_allclose(y_gbn, y, rtol=1e-5, atol=1e-5)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      updates_gbn,
      updates,
  )


def test_linen_sqd2_trains(resnet):
  model, variables = resnet
  x = _images((2, 4, 32, 32, 3))
  labels = jax.random.randint(jax.random.key(2), (2, 4), 0, 5)

  def loss_fn(params, batch_stats, x, labels):
    logits, updates = model.apply(
        {"params": params, "batch_stats": batch_stats},
        x,
        train=True,
        mutable=["batch_stats"],
    )
    log_p = jax.nn.log_softmax(logits)
    loss = -jnp.take_along_axis(log_p, labels[:, None], axis=1).mean()
    return jax.lax.pmean(loss, "batch"), updates["batch_stats"]

  def step(params, batch_stats, x, labels):
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch_stats, x, labels
    )
    grads = jax.lax.pmean(grads, "batch")
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params, batch_stats, loss

  with gbn_jax.linen.batchnorm_as_gbn(measure="sqd2"):
    step = jax.jit(
        jax.vmap(
            step,
            in_axes=(None, None, 0, 0),
            out_axes=(None, None, 0),
            axis_name="batch",
        )
    )
    params, batch_stats = variables["params"], variables["batch_stats"]
    losses = []
    for _ in range(5):
      params, batch_stats, loss = step(params, batch_stats, x, labels)
      losses.append(float(loss[0]))
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < losses[0], losses
  for leaf in jax.tree.leaves((params, batch_stats)):
    assert np.all(np.isfinite(leaf))
  # The running statistics moved away from their initial zeros and ones.
  init_mean = variables["batch_stats"]["bn_init"]["mean"]
  assert np.any(batch_stats["bn_init"]["mean"] != init_mean)
  # GBN, not BatchNorm, trained: the same model differs from flax's. A
  # fresh jit per call, as each traces the model in its own context.
  forward = lambda: jax.jit(
      _per_device(
          lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])[0]
      )
  )
  flax_y = forward()(variables, x)
  with gbn_jax.linen.batchnorm_as_gbn(measure="sqd2"):
    gbn_y = forward()(variables, x)
  assert np.abs(np.asarray(gbn_y) - np.asarray(flax_y)).max() > 1e-3


@pytest.mark.parametrize("measure", ["sqd2", "mad"])
def test_linen_layer_vs_numpy(measure):
  # One nn.BatchNorm with fields of its own, pooled over axis 'batch'
  # across two members and given a mask, then with use_running_average=True
  # at the call: every piece of the layer's call reaches GBN.
  layer = nn.BatchNorm(momentum=0.8, epsilon=1e-3, axis_name="batch")
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((12, 3)) * 2 + 1, jnp.float32)
  mask = rng.random((12, 1)) < 0.7
  variables = _perturbed(layer.init(jax.random.key(0), x, False))
  params = variables["params"]

  # Under jit: what is checked is the values, not op-by-op execution.
  with gbn_jax.linen.batchnorm_as_gbn(measure=measure):
    y, updates = jax.jit(
        jax.vmap(
            lambda v, x, m: layer.apply(
                v, x, False, mask=m, mutable=["batch_stats"]
            ),
            in_axes=(None, 0, 0),
            axis_name="batch",
        )
    )(variables, x.reshape(2, 6, 3), jnp.asarray(mask).reshape(2, 6, 1))
  y = y.reshape(12, 3)
  updates = jax.tree.map(lambda a: a[0], updates)
  s, d = ref.per_feature(
      lambda row: ref.measure_1d(measure, row),
      x,
      (0,),
      np.broadcast_to(mask, x.shape),
  )
  expected = ref.normalize(
      x, s, d, (0,), params["scale"], params["bias"], eps=1e-3
  )
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  stats = variables["batch_stats"]
  np.testing.assert_allclose(
      updates["batch_stats"]["mean"],
      0.8 * stats["mean"] + 0.2 * s,
      rtol=1e-5,
      atol=1e-6,
  )
  np.testing.assert_allclose(
      updates["batch_stats"]["var"],
      0.8 * stats["var"] + 0.2 * d**2,
      rtol=1e-5,
      atol=1e-6,
  )

  with gbn_jax.linen.batchnorm_as_gbn(measure=measure):
    y_eval = jax.jit(
        jax.vmap(
            lambda v, x: layer.apply(v, x, use_running_average=True),
            in_axes=(None, 0),
            axis_name="batch",
        )
    )(variables, x.reshape(2, 6, 3)).reshape(12, 3)
  expected_eval = ref.normalize(
      x,
      stats["mean"],
      np.sqrt(stats["var"]),
      (0,),
      params["scale"],
      params["bias"],
      eps=1e-3,
  )
  np.testing.assert_allclose(y_eval, expected_eval, rtol=1e-5, atol=1e-5)


def test_linen_leaves_gbatchnorm_as_it_is():
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = GBatchNorm(use_running_average=False, measure="mad")(x)
      return gbn_jax.linen.BatchNorm(use_running_average=False)(x)

  x = _images((8, 3))
  variables = Net().init(jax.random.key(0), x)
  expected = Net().apply(variables, x, mutable=["batch_stats"])
  with gbn_jax.linen.batchnorm_as_gbn(measure="sqd2"):
    got = Net().apply(variables, x, mutable=["batch_stats"])
  _assert_trees_equal(got, expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"measure": "nope"}, "unknown measure 'nope'"),
        ({"measure": "sqd", "alpha": 2.0}, "alpha"),
        (
            {"renorm": True, "renorm_clipping": {"rmax": 0.5}},
            "renorm_clipping",
        ),
    ],
)
def test_bad_arguments_fail_before_any_model_runs(kwargs, match):
  with pytest.raises(ValueError, match=match):
    gbn_jax.linen.batchnorm_as_gbn(**kwargs)
  with pytest.raises(ValueError, match=match):
    gbn_jax.nnx.convert_batchnorm(nnx.BatchNorm(3, rngs=nnx.Rngs(0)), **kwargs)


# ----------------------------------------------------------------------- nnx


class _Block(nnx.Module):

  def __init__(self, cin: int, cout: int, rngs: nnx.Rngs, norm):
    self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
    self.norm = norm(cout, momentum=0.9, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.norm(self.conv(x)))


class _Net(nnx.Module):
  """conv + norm + relu blocks nested in lists, a tuple and a dict, and a
  norm layer reached from two attributes; ``norm`` is the norm class."""

  def __init__(self, rngs: nnx.Rngs, norm=nnx.BatchNorm):
    self.stages = nnx.List(
        [
            nnx.List([_Block(3, 8, rngs, norm), _Block(8, 8, rngs, norm)]),
            nnx.data([_Block(8, 16, rngs, norm)]),
        ]
    )
    self.norms = nnx.data(
        (norm(16, epsilon=1e-3, use_fast_variance=False, rngs=rngs),)
    )
    self.heads = nnx.Dict({"norm": norm(16, momentum=0.8, rngs=rngs)})
    self.shared = self.heads["norm"]
    self.out = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    for stage in self.stages:
      for block in stage:
        x = block(x)
    x = self.norms[0](x)
    x = self.heads["norm"](x.mean(axis=(1, 2)))
    return self.out(x)


def _norms(model):
  return {
      path: node
      for path, node in nnx.iter_graph(model)
      if isinstance(node, nnx.BatchNorm)
  }


_FIELDS = (
    "num_features",
    "use_running_average",
    "axis",
    "momentum",
    "epsilon",
    "dtype",
    "param_dtype",
    "use_bias",
    "use_scale",
    "axis_name",
    "axis_index_groups",
    "use_fast_variance",
    "promote_dtype",
)


def test_nnx_convert_replaces_every_layer_and_keeps_it():
  model = _Net(nnx.Rngs(0))
  before = _norms(model)
  assert len(before) == 5  # the shared one once
  converted = gbn_jax.nnx.convert_batchnorm(model, "sqd2")
  after = _norms(converted)
  assert set(after) == set(before)
  for path, norm in after.items():
    old = before[path]
    assert type(norm) is gbn_jax.nnx.GBatchNorm, path
    assert norm.measure == "sqd2"
    for field in _FIELDS:
      assert getattr(norm, field) == getattr(old, field), (path, field)
    # The Variables themselves, shared as nnx.view shares them.
    for name in ("scale", "bias", "mean", "var"):
      assert getattr(norm, name) is getattr(old, name), (path, name)
  assert converted.shared is converted.heads["norm"]
  assert isinstance(converted.norms, tuple)
  # The model given is left as it was.
  assert all(type(n) is nnx.BatchNorm for n in _norms(model).values())


def test_nnx_convert_keeps_every_field():
  layer = nnx.BatchNorm(
      4,
      use_running_average=True,
      axis=1,
      momentum=0.7,
      epsilon=1e-2,
      dtype=jnp.bfloat16,
      param_dtype=jnp.float16,
      use_bias=False,
      axis_name="devices",
      axis_index_groups=[[0, 1]],
      use_fast_variance=False,
      scale_metadata={"note": "kept"},
      rngs=nnx.Rngs(0),
  )
  norm = gbn_jax.nnx.convert_batchnorm(
      layer, "sqd", alpha=0.9, calibration="normal"
  )
  assert type(norm) is gbn_jax.nnx.GBatchNorm
  for field in _FIELDS:
    assert getattr(norm, field) == getattr(layer, field), field
  assert (norm.measure, norm.alpha, norm.calibration) == ("sqd", 0.9, "normal")
  assert norm.bias is None
  assert norm.scale.get_metadata("note") == "kept"
  assert norm.scale[...].dtype == jnp.float16


@pytest.mark.parametrize("measure", ["mad", "sqd2"])
def test_nnx_converted_layer_vs_numpy(measure):
  layer = nnx.BatchNorm(3, momentum=0.6, rngs=nnx.Rngs(0))
  layer.scale[...] = jnp.asarray([0.5, 1.5, -1.0])
  layer.bias[...] = jnp.asarray([0.1, -0.2, 0.3])
  norm = gbn_jax.nnx.convert_batchnorm(layer, measure)
  x = np.random.default_rng(1).standard_normal((10, 3)).astype(np.float32)
  y = norm(jnp.asarray(x))
  s, d = ref.per_feature(lambda row: ref.measure_1d(measure, row), x, (0,))
  expected = ref.normalize(x, s, d, (0,), [0.5, 1.5, -1.0], [0.1, -0.2, 0.3])
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(norm.mean[...], 0.4 * s, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      norm.var[...], 0.6 + 0.4 * d**2, rtol=1e-5, atol=1e-6
  )
  # The Variables are the layer's: it sees the update.
  np.testing.assert_array_equal(layer.mean[...], norm.mean[...])


def test_nnx_sd_is_the_original():
  model = _Net(nnx.Rngs(0))
  nnx.update(model, _perturbed(nnx.state(model, nnx.Param)))
  original = nnx.clone(model)
  converted = gbn_jax.nnx.convert_batchnorm(nnx.clone(model), "sd")
  # The same network written with GBatchNorm: the conversion must be it,
  # bit for bit.
  direct = _Net(nnx.Rngs(0), functools.partial(gbn_jax.nnx.GBatchNorm))
  nnx.update(direct, _perturbed(nnx.state(direct, nnx.Param)))
  _assert_trees_equal(nnx.state(direct), nnx.state(original))
  forward = nnx.jit(lambda m, x: m(x))

  def check(x, call):
    y = call(converted, x)
    np.testing.assert_array_equal(y, call(direct, x))
    # And flax's own nnx.BatchNorm network, eager and jitted.
    assert_flax_bits(y, call(original, x))
    for a, b, c in zip(
        *(
            jax.tree.leaves(nnx.state(m, nnx.BatchStat))
            for m in (converted, direct, original)
        )
    ):
      np.testing.assert_array_equal(a, b)
      assert_flax_bits(a, c)

  for call in (lambda m, x: m(x), forward):
    for seed in (3, 4):
      check(_images((8, 12, 12, 3), seed=seed), call)
  for m in (original, converted, direct):
    m.eval()
  assert all(n.use_running_average for n in _norms(converted).values())
  check(_images((8, 12, 12, 3), seed=5), forward)


def test_nnx_sqd2_trains():
  model = gbn_jax.nnx.convert_batchnorm(_Net(nnx.Rngs(0)), "sqd2")
  x = _images((8, 12, 12, 3))
  labels = jax.random.randint(jax.random.key(2), (8,), 0, 4)
  before = nnx.clone(nnx.state(model, nnx.BatchStat))

  def loss_fn(model, x, labels):
    log_p = jax.nn.log_softmax(model(x))
    return -jnp.take_along_axis(log_p, labels[:, None], axis=1).mean()

  @nnx.jit
  def step(model, x, labels):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, labels)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return loss

  losses = [float(step(model, x, labels)) for _ in range(5)]
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < losses[0], losses
  after = nnx.state(model, nnx.BatchStat)
  for leaf in jax.tree.leaves(nnx.state(model)):
    assert np.all(np.isfinite(leaf))
  moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after)
  assert all(jax.tree.leaves(moved))


def test_nnx_convert_errors():
  with pytest.raises(TypeError, match="linen module.*batchnorm_as_gbn"):
    gbn_jax.nnx.convert_batchnorm(nn.BatchNorm(), "sqd2")
  with pytest.raises(TypeError, match="model must be an nnx.Module"):
    gbn_jax.nnx.convert_batchnorm(3, "sqd2")
  with pytest.raises(ValueError, match="holds no nnx.BatchNorm"):
    gbn_jax.nnx.convert_batchnorm(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "sqd2")
  already = gbn_jax.nnx.GBatchNorm(2, measure="mad", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="holds no nnx.BatchNorm"):
    gbn_jax.nnx.convert_batchnorm(nnx.List([already]), "sqd2")

  class MyNorm(nnx.BatchNorm):
    pass

  model = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])
  model.append(MyNorm(2, rngs=nnx.Rngs(0)))
  with pytest.raises(TypeError, match="MyNorm at '1'"):
    gbn_jax.nnx.convert_batchnorm(model, "sqd2")
