"""The CLI's persistent compilation cache: compiled programs kept between runs.

Compiling a run's train and eval steps takes seconds (ResNet20: tens of
seconds on a CPU); JAX can keep the compiled programs on disk and read them
back when a later run compiles the same program (same shapes, flags, JAX and
jaxlib). The CLI (:mod:`train.main`) turns that cache on in a folder of the
user's (:func:`default_dir`) unless ``--no-compile-cache`` or
``GBN_COMPILE_CACHE=0`` says not to. A cache folder set by the user
(``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) wins, with the user's other
cache settings (the test suite sets one in ``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
import os
from pathlib import Path

#: Set to 0 (or false, no, off) to turn the cache off; 1 (true, yes, on) or
#: unset keeps it on.
ENV = "GBN_COMPILE_CACHE"
#: JAX's own variable for the cache folder; a user-set value wins.
JAX_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
# Programs that took less than this to compile are not written: the tiny
# ones of eager jnp calls. Low enough that a small model's train and eval
# steps are kept, which JAX's default threshold would skip on a fast machine.
MIN_COMPILE_SECONDS = 0.1

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "")


def enabled_by_env(env: Mapping[str, str] | None = None) -> bool:
  """Whether ``GBN_COMPILE_CACHE`` leaves the cache on (the default).

  Raises:
    ValueError: a value that is neither on nor off.
  """
  env = os.environ if env is None else env
  value = env.get(ENV, "").strip().lower()
  if value in _OFF:
    return False
  if value in _ON:
    return True
  raise ValueError(
      f"{ENV} must be one of {', '.join(_OFF + _ON[:-1])} (or unset), got"
      f" {env[ENV]!r}."
  )


def user_cache_root(env: Mapping[str, str] | None = None) -> Path:
  """``$XDG_CACHE_HOME/gbn_jax``, else ``~/.cache/gbn_jax``: the training
  suite's per-user caches (compiled programs, compiled C++ kernels) below it."""
  env = os.environ if env is None else env
  base = env.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache"
  )
  return Path(base) / "gbn_jax"


def default_dir(env: Mapping[str, str] | None = None) -> Path:
  """``$XDG_CACHE_HOME/gbn_jax/jax_cache``, else ``~/.cache/gbn_jax/jax_cache``."""
  return user_cache_root(env) / "jax_cache"


def choose_dir(
    disabled_by_flag: bool,
    env: Mapping[str, str] | None = None,
    configured: str | None = None,
) -> Path | None:
  """The folder this module would set, or None where it leaves JAX alone.

  Args:
    disabled_by_flag: ``--no-compile-cache`` was given.
    env: The environment (default ``os.environ``).
    configured: The cache folder already in ``jax.config``, if any.

  Returns:
    None when the flag or ``GBN_COMPILE_CACHE`` turns the cache off, or the
    user set a folder (``JAX_COMPILATION_CACHE_DIR`` or ``configured``):
    theirs is used as they set it. Else :func:`default_dir`.

  Raises:
    ValueError: a bad ``GBN_COMPILE_CACHE``.
  """
  env = os.environ if env is None else env
  enabled = enabled_by_env(env)  # checked even where a flag overrides it
  if disabled_by_flag or not enabled:
    return None
  if env.get(JAX_DIR_ENV) or configured:
    return None
  return default_dir(env)


def configure(disabled_by_flag: bool = False) -> Path | None:
  """Turns on JAX's persistent compilation cache in :func:`choose_dir`'s folder.

  Call before the first compilation; it creates the folder.

  Returns:
    The folder set, or None where nothing was changed.

  Raises:
    ValueError: a bad ``GBN_COMPILE_CACHE``.
  """
  import jax  # pylint: disable=g-import-not-at-top

  folder = choose_dir(
      disabled_by_flag, configured=jax.config.jax_compilation_cache_dir
  )
  if folder is None:
    return None
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError:
    # An unwritable home (a read-only container) costs compile time, never
    # the run.
    return None
  jax.config.update("jax_compilation_cache_dir", str(folder))
  jax.config.update(
      "jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS
  )
  return folder
