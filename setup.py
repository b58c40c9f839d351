"""Builds the optional C++ CPU kernels; everything else is in pyproject.toml.

``gbn_jax._kth_cpu`` (the k-th smallest) and ``gbn_jax._conv_cpu`` (a
convolution's kernel gradient) are XLA FFI handlers (not Python modules)
that ``gbn_jax._selection.native`` and ``gbn_jax.convolution`` load with
ctypes. ``optional=True``: without a C++17 compiler the install still
succeeds and gbn_jax uses its pure-JAX selection and XLA's kernel gradient.
The XLA FFI headers are vendored (gbn_jax/csrc/third_party), so the build
needs no jaxlib.
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


setup(
    ext_modules=[
        _kernel("gbn_jax._kth_cpu", "kth_smallest_cpu.cc"),
        _kernel("gbn_jax._conv_cpu", "conv_cpu.cc"),
    ]
)
