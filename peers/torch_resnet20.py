"""PyTorch peer: the project's CIFAR ResNet20 train step, BatchNorm vs SQD.

The reference point of issue 20 ("ResNet20 on a CPU at PyTorch's speed") and
of ``benchmarks/step/bench_resnet_step.py --torch-python``: He et al.'s CIFAR
ResNet20 as ``train.model.models.ResNet20`` builds it (3x3 convolutions without
bias, a norm after each, option-A shortcuts: subsampling and zero-padded
channels), batch 256 on 32x32x3, one plain SGD step (lr 0.1, weight decay
1e-4) with ``torch.nn.BatchNorm2d`` and with an SQD2 GBN layer written with
``torch.kthvalue`` (autograd through it). Prints the median ms per step
after warm-up. One difference that costs nothing: PyTorch pads a stride-2
convolution by 1 on both sides, flax's SAME by 0 and 1.

torch is *not* a dependency of gbn-jax: run this file in a separate
environment with torch, e.g.::

  /tmp/torchvenv/bin/python peers/torch_resnet20.py --threads 2
  /tmp/torchvenv/bin/python peers/torch_resnet20.py --channels-last --json

Options: ``--threads N`` (torch's intra-op threads, default 2), ``--runs R``
(timed steps, default 10), ``--warmup W`` (default 3), ``--batch B``
(default 256), ``--norms bn,sqd`` (default both), ``--alpha A`` (default
0.5), ``--channels-last`` (model and input in ``torch.channels_last``),
``--json`` (also print ``RESULT {...}``: ``torch``, ``threads``,
``channels_last``, ``batch``, ``bn_ms``, ``sqd_ms``). Importing the module
has no side effect and works without torch (``resnet20`` then raises).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

try:
  import torch
  from torch import nn
  from torch.nn import functional as F
except ImportError:  # torch is no dependency of gbn-jax; see the docstring
  torch = F = None
  nn = type("nn", (), {"Module": object})


class SQD(nn.Module):
  """SQD GBN: ``(x - q_alpha) / D`` with ``D`` the superquantile - mean."""

  def __init__(self, c, alpha=0.5, eps=1e-5):
    super().__init__()
    self.alpha, self.eps = alpha, eps
    self.weight = nn.Parameter(torch.ones(c))
    self.bias = nn.Parameter(torch.zeros(c))

  def forward(self, x):
    _, c, _, _ = x.shape
    flat = x.transpose(0, 1).reshape(c, -1)
    k = max(1, int(-(-self.alpha * flat.shape[1] // 1)))
    q = flat.kthvalue(k, dim=1).values
    mean = flat.mean(1)
    d = q + F.relu(flat - q[:, None]).mean(1) / (1 - self.alpha) - mean
    y = (x - q.view(1, c, 1, 1)) / torch.sqrt(d * d + self.eps).view(1, c, 1, 1)
    return y * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)


class Block(nn.Module):
  """conv -> norm -> ReLU -> conv -> norm, + option-A shortcut, ReLU."""

  def __init__(self, cin, cout, stride, norm):
    super().__init__()
    self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
    self.n1 = norm(cout)
    self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
    self.n2 = norm(cout)
    self.stride, self.extra = stride, cout - cin

  def forward(self, x):
    y = F.relu(self.n1(self.c1(x)))
    y = self.n2(self.c2(y))
    s = x[:, :, :: self.stride, :: self.stride] if self.stride != 1 else x
    if self.extra:
      s = F.pad(s, (0, 0, 0, 0, 0, self.extra))
    return F.relu(y + s)


def resnet20(norm, num_classes=10):
  """ResNet20 with ``norm(channels)`` after every convolution."""
  if torch is None:
    raise ImportError("resnet20 needs torch (see peers/torch_resnet20.py)")
  layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), norm(16), nn.ReLU()]
  cin = 16
  for stage, c in enumerate((16, 32, 64)):
    for b in range(3):
      stride = 2 if stage > 0 and b == 0 else 1
      layers.append(Block(cin, c, stride, norm))
      cin = c
  return nn.Sequential(
      *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)
  )


def time_step(model, *, batch, runs, warmup, channels_last) -> float:
  """Median ms of one SGD step (lr 0.1, weight decay 1e-4) of ``model``."""
  opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4)
  x = torch.randn(batch, 3, 32, 32)
  y = torch.randint(0, 10, (batch,))
  if channels_last:
    model = model.to(memory_format=torch.channels_last)
    x = x.to(memory_format=torch.channels_last)

  def step():
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()

  for _ in range(warmup):
    step()
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
      "threads_pos", nargs="?", type=int, help=argparse.SUPPRESS
  )
  parser.add_argument("runs_pos", nargs="?", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--norms", default="bn,sqd")
  parser.add_argument("--alpha", type=float, default=0.5)
  parser.add_argument("--channels-last", action="store_true")
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  threads = args.threads_pos or args.threads  # the original positional form
  runs = args.runs_pos or args.runs
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  norms = {"bn": nn.BatchNorm2d, "sqd": lambda c: SQD(c, args.alpha)}
  result = {
      "torch": torch.__version__,
      "threads": torch.get_num_threads(),
      "channels_last": args.channels_last,
      "batch": args.batch,
  }
  for name in args.norms.split(","):
    result[f"{name}_ms"] = time_step(
        resnet20(norms[name]),
        batch=args.batch,
        runs=runs,
        warmup=args.warmup,
        channels_last=args.channels_last,
    )
  times = ", ".join(
      f"{k[:-3]} {v:.1f} ms" for k, v in result.items() if k.endswith("_ms")
  )
  print(
      f"torch {torch.__version__} threads={threads} channels_last="
      f"{args.channels_last}: ResNet20 b{args.batch} step: {times}"
  )
  if args.json:
    print("RESULT " + json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
