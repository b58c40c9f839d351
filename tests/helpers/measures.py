"""The measure names the tests run over, read from the library's registry.

A test that means "every measure" takes its names from here, so a measure
added to the registry is tested without anyone editing a list. The registry
is read when this module is imported: pytest imports every test module before
it runs any test, and tests that register a measure of their own restore the
registry afterwards (conftest's ``restore_registry``), so what is read is the
built-ins.
"""

from __future__ import annotations

import gbn_jax

#: Every built-in name, in registration order ('sd', 'mad', ..., 'bpoe').
BUILTIN_MEASURES: tuple[str, ...] = tuple(gbn_jax.MEASURES)

#: The built-in names a layer takes alone, with no parameter: all but those
#: that require one ('sqd' requires ``alpha``; 'sqd1'..'sqd3' bind it).
COMPLETE_MEASURES: tuple[str, ...] = tuple(
    name for name in BUILTIN_MEASURES if not gbn_jax.MEASURES[name].required
)

_SQD2 = gbn_jax.MEASURES["sqd2"]

#: The built-in names with one per compiled program: 'sqd' (``alpha`` a
#: field), 'sqd1' and 'sqd3' compile sqd2's program with another rank, so
#: they are left out. For the matrices of transforms, whose cost is
#: compiling each program; the values at each rank are tested over every name.
PROGRAM_MEASURES: tuple[str, ...] = tuple(
    name
    for name in BUILTIN_MEASURES
    if name == "sqd2" or gbn_jax.MEASURES[name].fn is not _SQD2.fn
)
