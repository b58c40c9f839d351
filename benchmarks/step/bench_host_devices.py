"""Train-step time on 1 host device vs one XLA host device per core (CPU).

Each setting runs in its own subprocess (the device count is fixed when JAX
starts); the settings alternate for --repeats rounds and the medians are
compared.

  python -m benchmarks.step.bench_host_devices --model lenet --norm bn \\
      --batch 1000 --out results/benchmarks/host_devices_lenet.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import sys, time, statistics
import jax, optax
from jax.sharding import NamedSharding, PartitionSpec as P
from train.model import models, sharding
model_name, norm, batch, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
shape = (28, 28, 1) if model_name == "lenet" else (32, 32, 3)
model = models.create_model(model_name, num_classes=10, norm=models.make_norm(norm))
mesh = sharding.make_mesh(sharding.data_parallel_devices(batch))
put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
x = put(jax.random.normal(jax.random.key(3), (batch, *shape)))
y = put(jax.random.randint(jax.random.key(4), (batch,), 0, 10))
v = model.init(jax.random.key(0), x[:2], train=False)
tx = optax.sgd(0.01)
@jax.jit
def step(p, bs, o, x, y):
  def loss(p):
    logits, u = model.apply({"params": p, "batch_stats": bs}, x, train=True, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), u
  (l, u), g = jax.value_and_grad(loss, has_aux=True)(p)
  c, o = tx.update(g, o, p)
  return optax.apply_updates(p, c), u["batch_stats"], o, l
args = (v["params"], v["batch_stats"], tx.init(v["params"]))
for _ in range(3):
  jax.block_until_ready(step(*args, x, y))
times = []
for _ in range(runs):
  t = time.perf_counter(); jax.block_until_ready(step(*args, x, y)); times.append(time.perf_counter() - t)
print(mesh.size, statistics.median(times))
"""


def run_once(devices: int, args) -> tuple[int, float]:
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
  )
  out = subprocess.run(
      [
          sys.executable,
          "-c",
          _CHILD,
          args.model,
          args.norm,
          str(args.batch),
          str(args.runs),
      ],
      env=env,
      capture_output=True,
      text=True,
      check=True,
  )
  used, seconds = out.stdout.split()
  return int(used), float(seconds)


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--model", default="lenet", choices=["lenet", "resnet20"])
  parser.add_argument("--norm", default="bn")
  parser.add_argument("--batch", type=int, default=1000)
  parser.add_argument(
      "--runs", type=int, default=8, help="timed steps per subprocess"
  )
  parser.add_argument(
      "--repeats", type=int, default=2, help="alternating rounds"
  )
  parser.add_argument("--devices", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  samples = {1: [], args.devices: []}
  used = {}
  for _ in range(args.repeats):
    for n in samples:
      used[n], seconds = run_once(n, args)
      samples[n].append(seconds)
  med = {n: statistics.median(s) for n, s in samples.items()}
  for n, s in samples.items():
    print(
        f"{args.model} {args.norm} batch {args.batch}: {n} host device(s) (using {used[n]})"
        f" step {med[n] * 1e3:.0f} ms  (runs: {', '.join(f'{v * 1e3:.0f}' for v in s)})"
    )
  print(f"speed-up x{med[1] / med[args.devices]:.2f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
          {"args": vars(args), "seconds": samples, "used": used}, f, indent=2
      )


if __name__ == "__main__":
  main()
