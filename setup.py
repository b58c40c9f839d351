"""Builds the optional C++ CPU kernel; everything else is in pyproject.toml.

``gbn_jax._kth_cpu`` (the k-th smallest) is an XLA FFI handler (not a Python
module) that ``gbn_jax._selection.native`` loads with ctypes.
``optional=True``: without a C++17 compiler the install still succeeds and
gbn_jax uses its pure-JAX selection. The XLA FFI headers are vendored
(gbn_jax/csrc/third_party), so the build needs no jaxlib. (The training
suite's convolution kernels, train/native/csrc, are no part of the library: they
are compiled on first use, see train/native/build.py.)
"""

from setuptools import Extension
from setuptools import setup


def _kernel(name: str, source: str) -> Extension:
  """An optional C++17 XLA FFI kernel built from ``gbn_jax/csrc/SOURCE``."""
  return Extension(
      name,
      sources=[f"gbn_jax/csrc/{source}"],
      include_dirs=["gbn_jax/csrc/third_party"],
      language="c++",
      extra_compile_args=["-std=c++17", "-O3"],
      extra_link_args=["-pthread"],
      optional=True,
  )


setup(ext_modules=[_kernel("gbn_jax._kth_cpu", "kth_smallest_cpu.cc")])
