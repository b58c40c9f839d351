"""train.model.norms: the CLI's norm names go through the library's parser;
the group norms (``gn``, ``gn:<measure>``) are flax's and gbn_jax's.

The parser itself (``gbn_jax.parse_measure_name``) is tested in
tests/gbn_jax/test_measures_capabilities.py, ``GGroupNorm`` in tests/gbn_jax.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax import linen as gbn_linen
from train.model import models
from train.model import norms

from tests.helpers.training import FORMULATION_MODELS


def test_training_cli_uses_the_parser(monkeypatch):
  seen = []
  real = norms.parse_measure_name
  monkeypatch.setattr(
      norms, "parse_measure_name", lambda t: seen.append(t) or real(t)
  )
  assert norms.parse_norm("sqd:0.4") == norms.NormSpec("sqd", 0.4)
  assert seen == ["sqd:0.4"]


# --- group norms: gn, gn:<measure> -------------------------------------------


def _hand_group_norm(groups):
  """flax's GroupNorm as a model calls a norm, written out by hand."""

  def norm(use_running_average=None, **fields):
    del use_running_average  # a group norm has no running statistics
    return nn.GroupNorm(num_groups=groups, **fields)

  return norm


def _logits(model, variables, x):
  return jax.jit(
      lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])[0]
  )(variables, x)


@pytest.mark.parametrize(
    "name,groups,shape",
    [("lenet", 5, (3, 32, 32, 3)), ("resnet8", 4, (2, 8, 8, 3))],
)
def test_gn_is_flax_group_norm(name, groups, shape):
  norm = models.make_norm("gn", groups=groups)
  module = norm(use_running_average=True)
  assert isinstance(module, nn.GroupNorm)
  assert not isinstance(module, gbn_linen.GGroupNorm)
  assert module.num_groups == groups
  ours = FORMULATION_MODELS[name](num_classes=10, norm=norm)
  # No remat for the hand-written model (a plain function is no Module
  # class to rematerialize); ours keeps the CPU's, the same function.
  hand = FORMULATION_MODELS[name](
      num_classes=10,
      norm=_hand_group_norm(groups),
      **({"recompute_norm": False} if name == "resnet8" else {}),
  )
  x = jax.random.normal(jax.random.key(1), shape)
  # One compiled program for both initializations: each compilation has
  # its overhead.
  variables, hand_variables = jax.jit(
      lambda: [
          model.init(jax.random.key(0), x[:1], train=False)
          for model in (ours, hand)
      ]
  )()
  assert "batch_stats" not in variables
  jax.tree.map(np.testing.assert_array_equal, variables, hand_variables)
  # Random norm parameters, so that scale and bias count too. Drawn by
  # numpy: jax's draws, op by op, compile a program per parameter shape.
  rng = np.random.default_rng(2)
  variables = jax.tree.map(
      lambda leaf: leaf + 0.1 * rng.standard_normal(leaf.shape, np.float32),
      jax.device_get(variables),
  )
  # Within rounding: XLA:CPU compiles the two traces (their source
  # locations differ) into programs that may sum in another order.
  np.testing.assert_allclose(
      _logits(ours, variables, x),
      _logits(hand, variables, x),
      rtol=1e-4,
      atol=1e-5,
  )


def test_gn_sd_equals_gn():
  x = jax.random.normal(jax.random.key(3), (4, 32, 32, 3))
  logits = []
  for spec in ("gn", "gn:sd"):
    model = models.create_model(
        "lenet", num_classes=10, norm=models.make_norm(spec)
    )
    variables = model.init(jax.random.key(0), x[:1], train=False)
    logits.append(_logits(model, variables, x))
  np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-5)
  assert not np.allclose(
      logits[0],
      _logits(
          models.create_model(
              "lenet", num_classes=10, norm=models.make_norm("gn:sqd2")
          ),
          variables,
          x,
      ),
      atol=1e-3,
  )


def _sqd_group_norm_reference(x, groups, alpha, scale, bias, epsilon):
  """Each (example, group) of ``x`` normalized by sqd, from its definition.

  ``S`` is the ``ceil(alpha N)``-th smallest of the group's ``N`` values,
  ``D = qbar - mean`` with the superquantile
  ``qbar = q + mean((v - q)^+) / (1 - alpha)``.
  """
  b, *_, c = x.shape
  y = np.empty_like(x)
  x = x.reshape(b, -1, groups, c // groups)
  out = y.reshape(x.shape)
  for i in range(b):
    for g in range(groups):
      v = x[i, :, g, :]
      ordered = np.sort(v.ravel())
      q = ordered[math.ceil(alpha * ordered.size) - 1]
      qbar = q + np.maximum(v - q, 0).mean() / (1 - alpha)
      d = qbar - v.mean()
      out[i, :, g, :] = (v - q) / np.sqrt(d * d + epsilon)
  return y * scale + bias


@pytest.mark.parametrize("spec,alpha", [("gn:sqd2", 0.5), ("gn:sqd:0.3", 0.3)])
def test_gn_sqd_normalizes_each_example_and_group(spec, alpha):
  groups, epsilon = 5, 1e-3
  norm = models.make_norm(spec, groups=groups, epsilon=epsilon)(
      use_running_average=False
  )
  assert isinstance(norm, gbn_linen.GGroupNorm)
  rng = np.random.default_rng(0)
  # 3x3x4 = 36 values per group: ceil(0.3 * 36) = 11 is no whole product.
  x = rng.standard_normal((3, 3, 3, 20)).astype(np.float32)
  x[1] = rng.exponential(size=x[1].shape)  # skewed: S, D unlike sd's
  scale = rng.uniform(0.5, 2, 20).astype(np.float32)
  bias = rng.standard_normal(20).astype(np.float32)
  y = norm.apply({"params": {"scale": scale, "bias": bias}}, x)
  expected = _sqd_group_norm_reference(
      x.astype(np.float64), groups, alpha, scale, bias, epsilon
  )
  np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


def test_gn_calibration_and_settings():
  norm = models.make_norm(
      "gn:rsd", calibration="normal", epsilon=1e-3, bias=1.0, groups=10
  )
  module = norm(use_running_average=False)
  assert module.calibration == "normal" and module.measure == "rsd"
  assert module.num_groups == 10 and module.epsilon == 1e-3
  params = module.init(jax.random.key(0), jnp.zeros((1, 2, 2, 20)))
  np.testing.assert_array_equal(params["params"]["bias"], np.ones(20))
  assert models.make_norm("gn:rsd").keywords.get("calibration") is None
  # As for GBatchNorm: sd's constant is 1, gn none of GGroupNorm's.
  assert (
      "calibration"
      not in models.make_norm("gn:sd", calibration="normal").keywords
  )
  assert models.make_norm("gn", calibration="normal").func is norms.GroupNorm


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("gn", norms.NormSpec(None, group=True)),
        ("gn:sqd2", norms.NormSpec("sqd2", group=True)),
        ("gn:sqd:0.9", norms.NormSpec("sqd", 0.9, group=True)),
        (" gn:rsd ", norms.NormSpec("rsd", group=True)),
    ],
)
def test_parse_group_norms(spec, expected):
  assert norms.parse_norm(spec) == expected
  # The batch norm of the same measure differs in the group flag alone.
  batch = spec.strip()[len("gn:") :] or "bn"
  assert norms.parse_norm(batch) == dataclasses.replace(expected, group=False)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("gn:bn", "a group norm takes a GBN measure"),
        ("gn:gn", "a group norm takes a GBN measure"),
        ("gn:bn_gain:rsd", "a group norm takes a GBN measure"),
        ("bn_gain:gn:rsd", "the gain must be that of a GBN measure"),
        ("gn:sqd", "needs a quantile level"),
        ("gn:foo", "unknown norm 'foo'"),
        ("gn:", "unknown norm"),
    ],
)
def test_parse_group_norm_errors(spec, message):
  with pytest.raises(ValueError, match=message):
    norms.parse_norm(spec)


def test_group_norm_names_and_renorm_refusal():
  names = norms.norm_names()
  assert "gn" in names and "gn:<measure>" in names
  with pytest.raises(ValueError, match="--renorm is batch renormalization"):
    models.make_norm("gn:rsd", renorm_clipping={"rmax": 3.0, "dmax": 5.0})
  # Renormalization of a batch norm still builds.
  assert models.make_norm("rsd", renorm_clipping={"rmax": 3.0}).keywords[
      "renorm"
  ]


@pytest.mark.parametrize("spec", ["gn", "gn:sqd2"])
def test_norm_groups_that_do_not_divide_name_the_flag(spec):
  model = models.create_model(
      "resnet20", num_classes=10, norm=models.make_norm(spec, groups=5)
  )
  with pytest.raises(
      ValueError,
      match=r"--norm-groups 5 does not divide the 16 channels of norm layer "
      r"'norm1'; pass --norm-groups N .*\(for this one: 1, 2, 4, 8, 16\)",
  ):
    jax.eval_shape(
        lambda: model.init(
            jax.random.key(0), jnp.zeros((1, 8, 8, 3)), train=False
        )
    )
  # The default divides LeNet's channels.
  lenet = models.create_model(
      "lenet", num_classes=10, norm=models.make_norm(spec)
  )
  jax.eval_shape(
      lambda: lenet.init(
          jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False
      )
  )
