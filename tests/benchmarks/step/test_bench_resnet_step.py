"""benchmarks/step/bench_resnet_step.py: exact formulations, profile, plumbing.

Every convolution formulation the benchmark times must be ``nn.Conv``'s
function (forward and both gradients, float32 summation order aside), every
model variant the real model's (loss, gradients, batch statistics; checked
on the ResNet with one block per stage, which has every kind of layer of
ResNet20 with a third of the blocks to compile); the
profile must sort a step's ops into kinds and stages, and the parent must
run a section in a child process and set the step times against the
peer's (here a stand-in script) best BatchNorm step.
"""

import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.step import bench_resnet_step as bench
from train.model import models


@pytest.mark.parametrize("strides", [1, 2])
@pytest.mark.parametrize("name", list(bench.FORMULATIONS))
def test_formulations_are_flax_conv(name, strides):
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 4))
  kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 6))
  fn = lambda x, k: bench.FORMULATIONS[name](x, k, strides)
  want, want_vjp = jax.vjp(models.conv_same, x, kernel, strides)
  got, got_vjp = jax.vjp(fn, x, kernel)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  g = jax.random.normal(jax.random.key(2), want.shape)
  for a, b in zip(got_vjp(g), want_vjp(g)[:2]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # one ResNet compilation of every variant
def test_variants_are_the_real_model():
  # BatchNorm: every variant's gradients too. With a quantile norm another
  # forward rounding can move the quantile to another element, and with it
  # the gradient; the variants differ in their convolutions only.
  setup = bench.Setup("bn", 4, blocks_per_stage=1)
  x = jax.random.normal(jax.random.key(0), (4, *bench.IMAGE_SHAPE))
  variables = {"params": setup.state.params}
  variables["batch_stats"] = setup.state.batch_stats

  def outputs(variant):
    apply = setup.state_for(variant).apply_fn

    def loss(params):
      logits, updates = apply(
          {**variables, "params": params}, x, train=True, mutable=True
      )
      return jnp.sum(logits[:, 0] ** 2), updates

    return jax.value_and_grad(loss, has_aux=True)(variables["params"])

  names = list(bench.VARIANTS)
  results = dict(zip(names, jax.jit(lambda: [outputs(v) for v in names])()))
  (want_loss, want_stats), want_grads = results["base"]
  for name, ((loss, stats), grads) in results.items():
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4, err_msg=name)
    for a, b in zip(
        jax.tree.leaves((grads, stats)),
        jax.tree.leaves((want_grads, want_stats)),
    ):
      scale = float(jnp.max(jnp.abs(b))) or 1.0
      np.testing.assert_allclose(
          a, b, rtol=1e-3, atol=1e-4 * scale, err_msg=name
      )


def test_op_kinds_and_stages():
  kind = lambda ops, phase, size=10**6: bench.op_kind(
      {"opcodes": frozenset(ops), "phase": phase}, size
  )
  assert kind({"convolution"}, "forward") == "conv/dot forward"
  assert kind({"fusion", "convolution"}, "backward", 144) == (
      "conv/dot kernel grad"
  )
  assert kind({"dot"}, "backward") == "conv/dot input grad"
  assert kind({"fusion", "transpose", "add"}, "forward") == "transpose/copy"
  assert kind({"reduce", "transpose"}, "forward").startswith("reduce")
  assert kind({"add", "maximum"}, "backward") == "elementwise"
  stage = bench._stage
  assert stage("jit(train_step)/jvp(ResNet)/stage2_block1/conv1/x") == "stage2"
  assert stage("(gradient of stage3_block2, feeds add)") == "stage3"
  assert stage("jit(train_step)/jvp(ResNet)/norm1/sub") == "stem"
  assert stage("jit(train_step)/add") == "head/loss/update"
  assert stage(None) == "unattributed"


def test_torch_best_bn_takes_the_faster_layout():
  runs = [
      {"channels_last": False, "bn_ms": 400.0},
      {"channels_last": True, "bn_ms": 300.0},
      {"channels_last": False, "bn_ms": 420.0},
      {"channels_last": True, "bn_ms": 320.0},
      {"error": "failed"},
  ]
  assert bench.torch_best_bn(runs) == (310.0, "channels_last")
  assert bench.torch_best_bn([]) == (None, None)


def test_summary_without_the_peer_has_no_ratios():
  # No --torch-python: the rows keep their times and leave the ratios out.
  variants = {"norms": {"bn": {"variants": {"base": {"median_ms": 12.0}}}}}
  report = types.SimpleNamespace(data={"variants": variants})
  rows = bench._summary(report, types.SimpleNamespace(norms=["bn"]), [])  # pylint: disable=protected-access
  assert rows == [
      dict(
          devices=1,
          flags="default",
          norm="bn",
          variant="base",
          median_ms=12.0,
          ratio_to_torch_bn=None,
          meets_target=None,
      )
  ]
  assert report.data["torch_best_bn"] == {"ms": None, "layout": None}


@pytest.mark.slow  # a child process; a ResNet compilation per variant
def test_main_runs_sections_and_compares_with_the_peer(tmp_path):
  peer = tmp_path / "peer.py"
  peer.write_text(
      "import json, sys\n"
      "cl = '--channels-last' in sys.argv\n"
      "print('RESULT ' + json.dumps({'channels_last': cl, "
      "'bn_ms': 50.0 if cl else 80.0}))\n"
  )
  out = tmp_path / "out.json"
  data = bench.main([
      "--sections", "variants", "profile",
      "--norms", "bn",
      "--variants", "base", "flax",
      "--batch", "4", "--runs", "1", "--warmup", "1", "--profile-steps", "1",
      "--blocks-per-stage", "1",
      "--torch-python", sys.executable, "--torch-peer", str(peer),
      "--out", str(out),
  ])  # fmt: skip
  assert json.loads(out.read_text())["complete"]
  assert data["torch_best_bn"] == {"ms": 50.0, "layout": "channels_last"}
  rows = {r["variant"]: r for r in data["summary"]}
  assert set(rows) == {"base", "flax"}
  for row in rows.values():
    assert row["ratio_to_torch_bn"] == pytest.approx(row["median_ms"] / 50.0)
  assert rows["flax"]["median_ms"] > 0
  variants = data["variants"]["norms"]["bn"]["variants"]
  assert variants["flax"]["update_rel"] < 1e-4
  prof = data["profile"]["profiles"]["bn/base"]
  # Each share is rounded to 4 decimals, so their sum is 1 to ~1e-4 per kind.
  shares = [v["share"] for v in prof["by_kind"].values()]
  assert sum(shares) == pytest.approx(1, abs=1e-4 * len(shares))
  assert any(k.startswith("conv/dot") for k in prof["by_kind"])
  assert {"stage1", "stage2", "stage3"} <= set(prof["by_stage"])


def test_final_runs_each_norm_in_a_process_of_its_own(monkeypatch):
  calls = []

  def fake_child(module, kind, spec, *, devices, flag_set="default"):
    calls.append((module, kind, spec["norms"], devices, flag_set))
    (norm,) = spec["norms"]
    if norm == "sqd2":
      return {"error": "exited 1: boom", "wall_s": 2.0}
    row = {"variants": {"base": {"median_ms": 10.0}}}
    return {"norms": {norm: row}, "machine": {"cpu": "x"}, "wall_s": 1.0}

  monkeypatch.setattr(bench, "run_child", fake_child)
  spec = {"variants": ["base"], "runs": 1}
  merged = bench._per_norm_processes(spec, ["bn", "sqd2"], 2, "default")  # pylint: disable=protected-access
  assert calls == [
      ("benchmarks.step.bench_resnet_step", "time", ["bn"], 2, "default"),
      ("benchmarks.step.bench_resnet_step", "time", ["sqd2"], 2, "default"),
  ]
  assert set(merged["norms"]) == {"bn"}
  assert merged["wall_s"] == 3.0 and merged["machine"] == {"cpu": "x"}
  assert "sqd2: exited 1: boom" in merged["error"]
