"""The subprocesses of ``bench_lenet_step``: its children and its torch peer.

Each child (``python -m benchmarks.step.bench_lenet_step --child KIND SPEC``, run
by :func:`benchmarks.step.step_children.run_child`) times or profiles the LeNet
step in a fresh interpreter; :func:`torch_step` times the PyTorch peer's LeNet
step in its own.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from benchmarks.step import step_children
from benchmarks.step import step_profile
from benchmarks.step.lenet_profile import hlo_index
from benchmarks.step.lenet_profile import layer_costs
from benchmarks.step.lenet_setup import Setup
from benchmarks.step.step_setup import time_variants
from benchmarks.timing import machine_info

MODULE = "benchmarks.step.bench_lenet_step"
#: The flag sets (of :data:`benchmarks.step.step_children.FLAG_SETS`) timed by
#: default.
DEFAULT_FLAG_SETS = (
    "ynn_off",
    "ynn_no_conv",
    "ynn_no_dot",
    "ynn_plus_eltwise",
    "onednn_dot",
    "eigen_1thread",
    "no_concurrency_sched",
    "vector_512",
    "fast_math",
    "nproc1",
    "nproc4",
)


def child_time(spec: dict[str, Any]) -> dict[str, Any]:
  """Times ``spec['variants']`` for each norm in one process.

  ``spec``: norms, variants, batch, runs, warmup, and optionally
  ``adaptive``: time all variants for the first norm, then only base and the
  ``adaptive`` fastest ones for the others.
  """
  out = {"machine": machine_info(), "norms": {}}
  variants = list(spec["variants"])
  for k, norm in enumerate(spec["norms"]):
    names = variants
    if k and spec.get("adaptive"):
      first = out["norms"][spec["norms"][0]]["variants"]
      ranked = sorted(
          (v for v in first if v != "base" and "median_ms" in first[v]),
          key=lambda v: first[v]["median_ms"],
      )
      names = ["base"] + ranked[: spec["adaptive"]]
    setup = Setup(norm, spec["batch"])
    out["norms"][norm] = time_variants(
        setup, names, spec["runs"], spec["warmup"]
    )
  return out


def child_profile(spec: dict[str, Any]) -> dict[str, Any]:
  """Profiles ``spec['variants']`` for each norm, and times the layers alone.

  ``spec``: norms, variants, batch, warmup, steps (traced), and ``layers``
  (time each layer alone: every one for the first norm, the norm layers for
  the others) with ``layer_runs``.
  """
  out = {"machine": machine_info(), "profiles": {}}
  for norm in spec["norms"]:
    setup = Setup(norm, spec["batch"])
    for variant in spec["variants"]:
      try:
        compiled, state, _ = setup.compile(variant)
        run = setup.runner(compiled, state)
        for _ in range(spec["warmup"]):
          jax.block_until_ready(run())
        out["profiles"][f"{norm}/{variant}"] = step_profile.profile_compiled(
            hlo_index(compiled.as_text()), run, spec["steps"]
        )
      except Exception as e:  # pylint: disable=broad-except
        out["profiles"][f"{norm}/{variant}"] = {
            "error": f"{type(e).__name__}: {e}"[:500]
        }
    if spec.get("layers"):  # the other norms: only their norm layers
      out.setdefault("layers", {})[norm] = layer_costs(
          norm,
          spec["batch"],
          spec["layer_runs"],
          spec["warmup"],
          names=None if norm == spec["norms"][0] else ("norm1", "norm2"),
      )
  return out


#: ``--child KIND``'s function.
CHILDREN = {"time": child_time, "profile": child_profile}
child_main = functools.partial(step_children.child_main, CHILDREN)


_TORCH_CHILD = r"""
import json, os, sys, time, statistics
import torch, torch.nn as nn, torch.nn.functional as F
peer_path, runs, warm, threads, norms, alpha, batch = sys.argv[1:8]
sys.path.insert(0, os.path.dirname(peer_path))
peer = __import__(os.path.splitext(os.path.basename(peer_path))[0])
if int(threads):
  torch.set_num_threads(int(threads))
dev = torch.device("cpu")
torch.manual_seed(0)
x = torch.randn(int(batch), 1, 28, 28, device=dev)
y = torch.randint(0, 10, (int(batch),), device=dev)
res = {"torch": torch.__version__, "threads": torch.get_num_threads(),
       "batch": int(batch)}
for name in norms.split(","):
  norm = nn.BatchNorm2d if name == "bn" else (lambda c: peer.SQD(c, float(alpha)))
  model = peer.lenet(norm).to(dev)
  opt = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=5e-4)
  def f():
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
  res[name + "_ms"] = peer.timed(f, dev, int(runs), int(warm))
print("RESULT " + json.dumps(res))
"""


def torch_step(args) -> dict[str, Any]:
  """The peer's LeNet step ms (``bn_ms``, ``sqd_ms``) in ``--torch-python``."""
  norms = "bn,sqd" if args.torch_sqd else "bn"
  warmup = max(args.warmup, 3)
  argv = [
      "-c",
      _TORCH_CHILD,
      *map(str, (args.torch_peer, args.torch_runs, warmup, args.torch_threads)),
      *(norms, "0.5", str(args.batch)),
  ]
  return step_children.run_torch(args.torch_python, argv, timeout=900)
