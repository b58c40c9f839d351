"""train.loop.host_devices: one XLA host device per core, set before JAX."""

import os

import pytest

from train import cifar
from train import cli_flags
from train import configs
from train import mnist
from train.loop import host_devices

from tests.helpers.process import run_python


def test_choose():
  assert host_devices.choose(cores=6, setting="auto") == 6
  assert host_devices.choose(cores=6, setting="1") == 1
  assert host_devices.choose(cores=2, setting=" 3 ") == 3
  for bad in ("0", "-2", "two"):
    with pytest.raises(SystemExit, match="GBN_HOST_DEVICES"):
      host_devices.choose(cores=2, setting=bad)


def _devices_seen(env_extra, batch):
  code = (
      "import sys; from train.loop import host_devices;"
      "host_devices.configure(); import jax; from train.loop import sharding;"
      f"print(jax.device_count(), len(sharding.data_parallel_devices({batch})))"
  )
  out = run_python(code, env_extra, drop=["XLA_FLAGS"])
  return tuple(int(v) for v in out.split())


@pytest.mark.slow
def test_configure_splits_the_cpu_and_the_loop_uses_a_divisor():
  assert _devices_seen({"GBN_HOST_DEVICES": "3"}, batch=12) == (3, 3)
  assert _devices_seen({"GBN_HOST_DEVICES": "3"}, batch=10) == (3, 2)
  assert _devices_seen({"GBN_HOST_DEVICES": "1"}, batch=10) == (1, 1)
  # an explicit XLA_FLAGS setting wins
  assert _devices_seen(
      {
          "GBN_HOST_DEVICES": "3",
          "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
      },
      batch=8,
  ) == (2, 2)


def test_auto_keeps_one_device_models_on_one():
  assert host_devices.choose(cores=2, setting="auto", model="resnet20") == 1
  assert host_devices.choose(cores=2, setting="auto", model="lenet") == 2
  assert host_devices.choose(cores=2, setting="2", model="resnet20") == 2


def test_model_from_argv_reads_the_model_as_the_cli_parser_does():
  read = host_devices.model_from_argv
  assert read([], "resnet20") == "resnet20"
  assert read(["--norm", "sqd2", "--model", "lenet"], "resnet20") == "lenet"
  assert read(["--model=lenet", "--epochs", "3"], "resnet20") == "lenet"
  assert read(["--model"], "resnet20") == "resnet20"  # the CLI reports it
  for argv in (["--model", "lenet"], ["--model=resnet20"], ["--mod", "lenet"]):
    parsed = cli_flags.build_parser(configs.CIFAR, "prog").parse_args(argv)
    assert parsed.model == read(argv, cifar.DEFAULT_MODEL)


def test_each_clis_default_model_is_its_configs():
  assert cifar.DEFAULT_MODEL == configs.CIFAR.model
  assert mnist.DEFAULT_MODEL == configs.MNIST.model


@pytest.mark.slow
def test_resnet20_gets_one_device_and_lenet_every_core_before_jax_starts():
  code = (  # what train.cifar does before JAX starts
      "import sys; from train.loop import host_devices;"
      "host_devices.configure(host_devices.model_from_argv(sys.argv[1:],"
      f" {cifar.DEFAULT_MODEL!r})); import jax; print(jax.device_count())"
  )

  def devices(*argv):
    env = {"GBN_HOST_DEVICES": "auto"}
    out = run_python(code, env, drop=["XLA_FLAGS"], args=argv)
    return int(out.split()[-1])

  assert devices() == 1
  assert devices("--model", "lenet") == (os.cpu_count() or 1)
