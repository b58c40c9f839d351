"""How a :class:`train.configs.Config` field is declared.

Each field carries a :class:`FieldSpec` (its check, flag, help and run-name
prefix) in its metadata, set with :func:`declared`; the checks and argparse
types here are the building blocks of those declarations. Nothing here knows
a field: :mod:`train.configs` declares them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import enum
import math
from typing import Any


def is_int(value: Any) -> bool:
  """An ``int`` that is no ``bool``."""
  return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
  """A finite ``int`` or ``float`` that is no ``bool``."""
  return (
      isinstance(value, (int, float))
      and not isinstance(value, bool)
      and math.isfinite(value)
  )


def one_of(choices: Sequence[str]) -> Callable[[Any], str | None]:
  """A check: the value is one of ``choices``."""
  return (
      lambda v: None
      if v in choices
      else (f"{v!r} is not one of: {', '.join(choices)}")
  )


def integer(
    minimum: int, maximum: int | None = None, maximum_text: str | None = None
) -> Callable[[Any], str | None]:
  """A check: an integer in ``[minimum, maximum)`` (``maximum_text``: how
  the message writes ``maximum``)."""
  if maximum is None:
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
  else:
    what = f"an integer in [{minimum}, {maximum_text or maximum})"
  return (
      lambda v: None
      if (is_int(v) and v >= minimum and (maximum is None or v < maximum))
      else f"must be {what}, got {v!r}"
  )


def real(
    requirement: str, valid: Callable[[float], bool]
) -> Callable[[Any], str | None]:
  """A check: a finite number for which ``valid`` holds, else
  ``requirement``."""
  return (
      lambda v: None
      if is_real(v) and valid(v)
      else (f"{requirement}, got {v!r}")
  )


def boolean(v: Any) -> str | None:
  """The check of a true/false field."""
  return None if isinstance(v, bool) else f"must be true or false, got {v!r}"


class Flag(enum.Enum):
  """How a field's flag reads its value."""

  VALUE = "value"  # --flag VALUE, parsed by ``FieldSpec.parse``
  SWITCH = "switch"  # --flag sets True
  ON_OFF = "on_off"  # --flag / --no-flag; absent keeps the default (None)


@dataclasses.dataclass(frozen=True)
class FieldSpec:
  """Everything about one config field besides its type and default.

  The CLI's flags (``train.cli_flags.build_parser``), the config they give
  (``train.cli_flags.config_from_args``), ``train.configs.validate``, the
  sweep's run names (``train.sweep.grid.run_name``) and the loading of older
  ``config.json`` files all follow from these, so a new field is one
  declaration in ``train.configs.Config``.

  Attributes:
    check: ``check(value)`` is ``None`` for a valid value, else what is wrong
      (shown after the flag, or the field's name when it has no flag).
    flag: Its command-line flag, ``None`` for a field set only in code.
    help: The flag's help.
    kind: How the flag reads its value.
    parse: The flag's argparse ``type`` (``Flag.VALUE``).
    choices: The flag's allowed values, for argparse.
    run_name: Its prefix in sweep run names; ``None``: never in a name.
      Named fields appear where their value differs from the sweep's
      defaults, in field order, except where ``train.sweep.grid.run_name``
      says.
    added: Newer than the first ``config.json`` files: an older file lacks
      it and means its default.
  """

  check: Callable[[Any], str | None]
  flag: str | None = None
  help: str = ""
  kind: Flag = Flag.VALUE
  parse: Callable[[str], Any] | None = None
  choices: tuple[str, ...] | None = None
  run_name: str | None = None
  added: bool = False

  @property
  def dest(self) -> str | None:
    """The flag's attribute on the parsed namespace."""
    return self.flag[2:].replace("-", "_") if self.flag else None


def declared(default: Any, spec: FieldSpec) -> Any:
  """A dataclass field with ``default`` that carries ``spec``."""
  return dataclasses.field(default=default, metadata={"spec": spec})


def parse_int_at_least(minimum: int) -> Callable[[str], int]:
  """An argparse type: an integer >= ``minimum``."""

  def parse(value: str) -> int:
    try:
      number = int(value)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < minimum:
      raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {number}")
    return number

  return parse


parse_positive_int = parse_int_at_least(1)
parse_nonnegative_int = parse_int_at_least(0)
