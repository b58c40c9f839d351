"""benchmarks/compile/bench_compile.py: its HLO counters and its JSON.

The counters are checked on hand-written HLO and StableHLO text and on
programs whose contents are known by construction (a sort, a while loop, a
``lax.platform_dependent`` with branches of known sizes); the end-to-end test
runs the benchmark on LeNet at a tiny batch in fresh processes and checks
every field of its JSON.
"""

import json

import jax
from jax import lax
import jax.numpy as jnp
import pytest

from benchmarks.compile import bench_compile as bench

from tests.helpers.process import REPO
from tests.helpers.process import run_module

_HLO = """\
HloModule jit_f, entry_computation_layout={(f32[8]{0})->(f32[8]{0}, s32[])}

%region_0.1 (a: f32[], b: f32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %lt = pred[] compare(f32[] %a, f32[] %b), direction=LT
}

ENTRY %main.2 (x: f32[8]) -> (f32[8], s32[]) {
  %x = f32[8]{0} parameter(0)
  %s = f32[8]{0} sort(f32[8]{0} %x), dimensions={0}, to_apply=%region_0.1
  %c = (f32[8]{0}, s32[]) custom-call(f32[8]{0} %s), custom_call_target="my_kernel"
  %g = f32[8]{0} get-tuple-element((f32[8]{0}, s32[]) %c), index=0
  %n = s32[] get-tuple-element((f32[8]{0}, s32[]) %c), index=1
  ROOT %t = (f32[8]{0}, s32[]) tuple(f32[8]{0} %g, s32[] %n)
}
"""

_MLIR = """\
module @jit_f {
  func.func public @main(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %0 = "stablehlo.case"(%c) ({
      %1 = stablehlo.negate %arg0 : tensor<8xf32>
      stablehlo.return %1 : tensor<8xf32>
    }) : (tensor<i32>) -> tensor<8xf32>
    %2:2 = stablehlo.custom_call @k(%0) : (tensor<8xf32>) -> (tensor<8xf32>, tensor<i32>)
    return %2#0 : tensor<8xf32>
  }
}
"""


def test_count_hlo_on_handwritten_text():
  counts = bench.count_hlo(_HLO)
  # 3 in the comparator, 6 in the entry (tuple shapes included).
  assert counts["hlo_instructions"] == 9
  assert counts["hlo_computations"] == 2
  assert counts["sorts"] == 1
  assert counts["custom_calls"] == 1
  assert counts["custom_call_targets"] == {"my_kernel": 1}
  assert counts["while_loops"] == 0 and counts["scatters"] == 0
  assert counts["top_opcodes"]["get-tuple-element"] == 2


def test_count_stablehlo_on_handwritten_text():
  counts = bench.count_stablehlo(_MLIR)
  # constant, case, negate, its return, custom_call, the function's return.
  assert counts["stablehlo_ops"] == 6
  assert counts["stablehlo_cases"] == 1
  assert counts["stablehlo_custom_calls"] == 1


def test_count_hlo_finds_a_compiled_sort_and_loop():
  def f(x):
    y = jnp.sort(x)
    return lax.fori_loop(0, x.shape[0], lambda i, c: c * 0.5 + y[i], y)

  text = jax.jit(f).lower(jnp.ones(64)).compile().as_text()
  counts = bench.count_hlo(text)
  assert counts["sorts"] >= 1
  assert counts["while_loops"] >= 1
  assert counts["hlo_instructions"] >= counts["sorts"] + counts["while_loops"]


def test_count_jaxpr_separates_other_platforms():
  def f(x):
    return lax.platform_dependent(
        x,
        cpu=lambda x: x + 1.0,  # one equation
        default=lambda x: jnp.sin(jnp.cos(x * 2.0)),  # three
    )

  traced = jax.jit(f).trace(jnp.float32(1.0))
  cpu = bench.count_jaxpr(traced.jaxpr, "cpu")
  # platform_index, cond, and the 1 + 3 equations of the branches.
  assert cpu == {
      "jaxpr_eqns": 6,
      "jaxpr_eqns_traced": 6,
      "platform_conds": 1,
      "jaxpr_eqns_other_platforms": 3,
  }
  assert (
      bench.count_jaxpr(traced.jaxpr, "cuda")["jaxpr_eqns_other_platforms"] == 1
  )


def test_count_jaxpr_counts_a_shared_sub_program_traced_once():
  inner = jax.jit(lambda x: jnp.sin(jnp.cos(x)))  # two equations

  def f(x):
    return inner(inner(x) + 1.0)

  counts = bench.count_jaxpr(jax.jit(f).trace(jnp.float32(1.0)).jaxpr, "cpu")
  # Two calls and an add; the inner program at each call, traced once.
  assert counts["jaxpr_eqns"] == 3 + 2 * 2
  assert counts["jaxpr_eqns_traced"] == 3 + 2


def test_children_run_without_a_persistent_cache(monkeypatch):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
  env = bench._child_env(None)  # pylint: disable=protected-access
  assert "JAX_COMPILATION_CACHE_DIR" not in env
  assert env["GBN_COMPILE_CACHE"] == "0"
  cached = bench._child_env("/tmp/x")  # pylint: disable=protected-access
  assert cached["JAX_COMPILATION_CACHE_DIR"] == "/tmp/x"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--models", "vgg"], "--models"),
        (["--norms", ""], "--norms"),
        (["--batch", "0"], "--batch"),
        (["--train-images", "-3"], "--train-images"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag):
  with pytest.raises(SystemExit, match=flag):
    bench.main(argv)


def _positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


@pytest.mark.slow  # two fresh processes compiling LeNet's programs
def test_lenet_json_has_every_field(tmp_path):
  out = tmp_path / "compile.json"
  proc = run_module(
      "benchmarks.compile.bench_compile",
      "--models=lenet",
      "--norms=bn,sqd2",
      "--batch=8",
      "--train-images=32",
      "--test-images=16",
      f"--out={out}",
      env={"PYTHONPATH": REPO},
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert [(r["model"], r["norm"]) for r in result["rows"]] == [
      ("lenet", "bn"),
      ("lenet", "sqd2"),
  ]
  for row in result["rows"]:
    assert row["batch_size"] == 8 and row["train_images"] == 32
    assert row["persistent_cache"] is False
    assert set(row["programs"]) == {"init", "prepare", "step", "evaluate"}
    assert row["programs"]["step"]["norm_layers"] == 2  # LeNet's two norms
    for name, prog in row["programs"].items():
      missing = set(bench.PROGRAM_FIELDS) - set(prog)
      assert not missing, (row["norm"], name, missing)
      assert prog["compile_s"] > 0 and prog["lower_s"] > 0, (row, name)
      assert 0 < prog["trace_s"] <= prog["lower_s"]
      for key in ("hlo_instructions", "stablehlo_ops", "jaxpr_eqns"):
        assert _positive_int(prog[key]), (row["norm"], name, key, prog[key])
      for key in ("custom_calls", "while_loops", "sorts", "scatters"):
        assert isinstance(prog[key], int) and prog[key] >= 0
      assert prog["jaxpr_eqns_other_platforms"] <= prog["jaxpr_eqns"]
  ratios = result["ratios"]["lenet"]["sqd2/bn"]
  assert ratios["step"]["compile_s"] > 0
  assert isinstance(ratios["step_extra_hlo_per_norm_layer"], float)
  assert "lenet" in proc.stdout and "sqd2" in proc.stdout  # the table
