"""PyTorch peer: BatchNorm against an SQD layer as a PyTorch user would write it.

This script is the reference point of the repository's performance numbers
(``benchmarks/device/device_check.sh``'s ``torch`` step, ``benchmarks/
bench_lenet_step.py --torch-python``): it times forward + backward of
``torch.nn.BatchNorm2d``/``BatchNorm1d`` against a superquantile-deviation
(SQD, alpha) GBN layer written with ``torch.kthvalue`` (``S`` = the alpha
quantile, ``D`` = superquantile - mean, autograd through both), on the layer
shapes of ``benchmarks/layer/bench_gbn.py`` (NHWC there, NCHW here), plus one SGD
step of a LeNet (batch 1000, 28x28x1) with either norm. Each time is the
median of timed runs after a warm-up, BatchNorm and SQD interleaved per
shape so that drift cancels in their ratio. CPU or CUDA.

torch is *not* a dependency of gbn-jax: this file lies outside the package
and needs a separate environment with torch, e.g.::

  python -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch
  /tmp/torchvenv/bin/python peers/torch_sqd.py --threads 2 --out torch_sqd.json

Options: ``--device cpu|cuda`` (default: cuda if available), ``--threads N``
(torch's intra-op threads; 0 keeps torch's default), ``--runs R`` (timed
runs per case, default 21), ``--alpha A`` (default 0.5), ``--out FILE.json``.
The JSON holds ``torch`` (version), ``device``, ``threads``, ``alpha``,
``layers`` (per shape: ``shape``, ``bn_ms``, ``sqd_ms``, ``ratio``) and
``train_step`` (``model``, ``batch``, ``bn_ms``, ``sqd_ms``, ``ratio``).

Importing the module has no side effect and works without torch (``SQD`` and
``lenet`` then raise); ``benchmarks/step/bench_lenet_step.py`` imports it for
``SQD``, ``lenet`` and ``timed``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import json
import platform
import statistics
import sys
import time
from typing import Any

try:
  import torch
  from torch import nn
  from torch.nn import functional as F
except ImportError:  # torch is no dependency of gbn-jax; see the docstring
  torch = nn = F = None

#: Layer shapes, NCHW (``benchmarks/layer/bench_gbn.py``'s, there NHWC).
LAYER_SHAPES = (
    (256, 16, 32, 32),
    (1024, 16, 32, 32),
    (1000, 50, 8, 8),
    (512, 256),
)
_NO_TORCH = (
    "peers/torch_sqd.py needs PyTorch, which gbn-jax does not "
    "depend on: run it with a python that has torch installed "
    "(pip install torch in a separate venv)."
)


def _require_torch() -> None:
  if torch is None:
    raise ImportError(_NO_TORCH)


def _quantile_rank(alpha: float, m: int) -> int:
  """1-based rank of the alpha quantile of ``m`` values: ceil(alpha m)."""
  return min(m, max(1, -int(-alpha * m // 1)))


class SQD(nn.Module if nn is not None else object):
  """GBN with the superquantile deviation, over all axes but channels (1).

  ``y = (x - q) / sqrt(D^2 + eps) * weight + bias`` per channel, with ``q``
  the alpha quantile (``kthvalue``), ``D = qbar - mean`` and the
  superquantile ``qbar = q + mean(relu(x - q)) / (1 - alpha)``.
  """

  def __init__(self, channels: int, alpha: float = 0.5, eps: float = 1e-5):
    _require_torch()
    super().__init__()
    if not 0.0 < alpha < 1.0:
      raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    self.alpha, self.eps = alpha, eps
    self.weight = nn.Parameter(torch.ones(channels))
    self.bias = nn.Parameter(torch.zeros(channels))

  def forward(self, x):  # pylint: disable=missing-function-docstring
    channels = x.shape[1]
    flat = x.transpose(0, 1).reshape(channels, -1)
    k = _quantile_rank(self.alpha, flat.shape[1])
    q = flat.kthvalue(k, dim=1).values
    qbar = q + F.relu(flat - q[:, None]).mean(1) / (1 - self.alpha)
    d = qbar - flat.mean(1)
    shape = (1, channels) + (1,) * (x.dim() - 2)
    y = (x - q.view(shape)) / torch.sqrt(d * d + self.eps).view(shape)
    return y * self.weight.view(shape) + self.bias.view(shape)


def lenet(norm: Callable[[int], Any]):
  """LeNet for 28x28x1 (the repository's ``train.model.models`` LeNet's layers)."""
  _require_torch()
  return nn.Sequential(
      nn.Conv2d(1, 20, 5, bias=False),
      norm(20),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Conv2d(20, 50, 5, bias=False),
      norm(50),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Flatten(),
      nn.Linear(800, 500),
      nn.ReLU(),
      nn.Linear(500, 10),
  )


def _sync(device) -> None:
  if device.type == "cuda":
    torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device, runs: int, warm: int = 3) -> float:
  """Median milliseconds of ``runs`` calls of ``fn`` after ``warm`` calls."""
  for _ in range(warm):
    fn()
  _sync(device)
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    fn()
    _sync(device)
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def layer_case(
    shape: Sequence[int], device, runs: int, alpha: float
) -> dict[str, Any]:
  """Forward + backward of BatchNorm and SQD on one input shape."""
  channels = shape[1]
  bn = (
      nn.BatchNorm2d(channels) if len(shape) == 4 else nn.BatchNorm1d(channels)
  ).to(device)
  sqd = SQD(channels, alpha).to(device)
  x = torch.randn(*shape, device=device, requires_grad=True)
  grad = torch.randn(*shape, device=device)

  def step(module):
    def fn():
      x.grad = None
      module(x).backward(grad)

    return fn

  bn_ms, sqd_ms = [], []
  for _ in range(3):  # interleaved, so that drift cancels in the ratio
    bn_ms.append(timed(step(bn), device, max(1, runs // 3)))
    sqd_ms.append(timed(step(sqd), device, max(1, runs // 3)))
  b, s = statistics.median(bn_ms), statistics.median(sqd_ms)
  return {
      "shape": "x".join(map(str, shape)),
      "bn_ms": b,
      "sqd_ms": s,
      "ratio": s / b,
  }


def step_case(device, runs: int, alpha: float) -> dict[str, Any]:
  """One SGD step (lr 0.01, weight decay 5e-4) of LeNet, batch 1000."""
  x = torch.randn(1000, 1, 28, 28, device=device)
  y = torch.randint(0, 10, (1000,), device=device)
  ms = {}
  for name, norm in (("bn", nn.BatchNorm2d), ("sqd", lambda c: SQD(c, alpha))):
    model = lenet(norm).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=5e-4)

    def fn(model=model, opt=opt):
      opt.zero_grad(set_to_none=True)
      F.cross_entropy(model(x), y).backward()
      opt.step()

    ms[name] = timed(fn, device, runs)
  return {
      "model": "lenet",
      "batch": 1000,
      "bn_ms": ms["bn"],
      "sqd_ms": ms["sqd"],
      "ratio": ms["sqd"] / ms["bn"],
  }


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python peers/torch_sqd.py",
      description="Times PyTorch BatchNorm against a kthvalue SQD layer "
      "(layers and a LeNet step); see the module docstring.",
  )
  parser.add_argument(
      "--device", default=None, help="cpu or cuda (default: cuda if available)"
  )
  parser.add_argument(
      "--threads",
      type=int,
      default=0,
      help="torch intra-op threads (0: torch's default)",
  )
  parser.add_argument("--runs", type=int, default=21)
  parser.add_argument("--alpha", type=float, default=0.5)
  parser.add_argument("--out", help="write the results as JSON here")
  args = parser.parse_args(argv)
  if torch is None:
    print(f"error: {_NO_TORCH}", file=sys.stderr)
    return 1
  if args.threads:
    torch.set_num_threads(args.threads)
  device = torch.device(
      args.device or ("cuda" if torch.cuda.is_available() else "cpu")
  )
  rows = [layer_case(s, device, args.runs, args.alpha) for s in LAYER_SHAPES]
  step = step_case(device, args.runs, args.alpha)
  name = (
      torch.cuda.get_device_name(device)
      if device.type == "cuda"
      else platform.processor() or platform.machine()
  )
  result = {
      "torch": torch.__version__,
      "device": name,
      "threads": torch.get_num_threads(),
      "alpha": args.alpha,
      "layers": rows,
      "train_step": step,
  }
  for r in rows:
    print(
        f"{r['shape']:>16}: BatchNorm {r['bn_ms']:.3f} ms, kthvalue-SQD "
        f"{r['sqd_ms']:.3f} ms ({r['ratio']:.2f}x)"
    )
  print(
      f"LeNet b1000 step: BatchNorm {step['bn_ms']:.2f} ms, SQD "
      f"{step['sqd_ms']:.2f} ms ({step['ratio']:.2f}x)"
  )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
