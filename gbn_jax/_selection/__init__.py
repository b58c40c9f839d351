"""Exact k-th smallest selection: the machinery under :mod:`gbn_jax._quantiles`.

Layers, imports pointing down only (``tests/project/test_structure.py`` checks it):

* :mod:`.dispatch`: the entry point :func:`.dispatch.kth_smallest` and the
  choice of backend (scoped by :func:`gbn_jax.selection.selection_config`,
  above this package).
* :mod:`.fused`: a superquantile's sums in the selection's own sweep, where a
  backend offers that (native kernel, radix select), with their JVPs.
* Backends, one module each: :mod:`.sort` (the sort-based reference),
  :mod:`.loop` (pure-JAX counting and folding passes, ``"adaptive"`` and
  ``"bisect"``), :mod:`.radix` (fixed radix passes), :mod:`.bracket` (sampled
  bracket and one compaction pass), :mod:`.native` (the C++ FFI kernel of
  ``gbn_jax/csrc``).
* Shared bottom: :mod:`.reductions` (masked means, counts and ranks pooled over
  devices) on :mod:`.common` (keys, row layout, the device communicator,
  validation, axis helpers) and :mod:`.config` (the trace-scoped tunables).

A new backend is one module with a ``kth_smallest``-compatible entry point and
one entry in ``dispatch._BACKENDS``.
"""
