"""Shared numpy oracle, data and tests of the selection backends' tests.

The oracle is written from the definition: per feature, ``np.sort`` of the
masked-in elements, index ``k - 1``; tie and "above" counts are numpy's IEEE
compares (no denormal flushing, ``-0.0 == +0.0``), which is what integer keys
give. Values must match bit for bit (``-0.0`` is expected back as ``+0.0``).

:class:`ExactnessSuite` holds the tests every drop-in backend (radix, bracket)
must pass; a test module subclasses it with its backend's ``check`` and
``value``. The ``assert_*`` functions below it are checks that more than one
backend's module runs on its own entry point.
"""

from __future__ import annotations

from collections.abc import Callable
import re
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax._selection import common
from gbn_jax._selection import dispatch
from gbn_jax._selection import sort

from tests.helpers.process import run_pytest

TINY = np.finfo(np.float32).tiny


def columns(x, axis, where=None):
  """``x`` (and the mask) as ``(N, F)`` columns: reduced axes first, flattened."""
  x = np.asarray(x, np.float32)
  kept = [d for d in range(x.ndim) if d not in axis]
  perm = list(axis) + kept
  n_cols = int(np.prod([x.shape[d] for d in kept]))
  cols = np.transpose(x, perm).reshape(-1, n_cols)
  mask = np.ones(cols.shape, bool)
  if where is not None:
    mask = np.transpose(np.broadcast_to(where, x.shape), perm).reshape(
        cols.shape
    )
  return cols, mask, [x.shape[d] for d in kept]


def numpy_kth(x, k, axis, where=None):
  """k-th smallest, ``#{x == it}`` and ``#{not x <= it}`` per kept position."""
  cols, mask, kept_shape = columns(x, axis, where)
  ks = np.broadcast_to(np.asarray(k), kept_shape).reshape(-1)
  value = np.full(cols.shape[1], np.nan, np.float32)
  ties = np.zeros(cols.shape[1], np.int64)
  above = np.zeros(cols.shape[1], np.int64)
  for f in range(cols.shape[1]):
    kept = cols[mask[:, f], f]
    if not 1 <= ks[f] <= kept.size:
      continue
    # np.sort orders denormals exactly and -0.0 == 0.0; IEEE compares (numpy
    # flushes nothing) count ties and elements above the same way.
    v = np.sort(kept)[ks[f] - 1]
    value[f] = 0.0 if v == 0 else v
    ties[f] = np.sum(kept == v)
    above[f] = np.sum(~(kept <= v))
  return tuple(a.reshape(kept_shape) for a in (value, ties, above))


def eqns_in(jaxpr, loop_length: int | None = None):
  """Every equation of ``jaxpr`` and of its sub-jaxprs, in order, each with
  the length of the innermost ``scan`` it runs in (None outside one).

  A Pallas kernel's own jaxpr (not a closed one) is not entered.
  """
  for eqn in jaxpr.eqns:
    yield eqn, loop_length
    inner = eqn.params.get("length", loop_length)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from eqns_in(sub.jaxpr, inner)


def loops_in(jaxpr) -> list[tuple[str, int | None]]:
  """``(primitive, length)`` of every loop and conditional, nested ones too."""
  return [
      (eqn.primitive.name, eqn.params.get("length"))
      for eqn, _ in eqns_in(jaxpr)
      if eqn.primitive.name in ("scan", "while", "cond")
  ]


def assert_static_loops(fn, args, expected):
  """``fn``'s loops and conditionals are ``expected``; every loop's trip count static.

  The point: no data-dependent loop, hence no host sync per radix pass, and
  the passes after the first are one ``fori_loop`` body (a ``scan`` of
  static length), not unrolled. XLA knows the trip count of each
  loop it keeps (XLA:GPU then runs the body without reading a predicate back
  to the host); it may unroll one.
  """
  assert loops_in(jax.make_jaxpr(fn)(*args).jaxpr) == expected
  lengths = sorted(n for name, n in expected if name == "scan")
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  loops = re.findall(r"= .*\bwhile\(.*", hlo)
  assert len(loops) <= len(lengths), loops
  for loop in loops:
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop)
    assert trip and int(trip.group(1)) in lengths, loop


TRITON_TARGET = "__gpu$xla.gpu.triton"

#: The card a CUDA lowering targets on a host without one: Triton needs its
#: compute capability, which newer JAX asks for instead of assuming one.
ABSTRACT_GPU = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100", num_cores=None, platform="gpu"
)


def abstract_gpu(axis_sizes=(1,), axis_names=("gpu",)):
  """A context that lowers for `ABSTRACT_GPU` (``jax.sharding.use_abstract_mesh``)."""
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh(
          axis_sizes, axis_names, abstract_device=ABSTRACT_GPU
      )
  )


def cuda_text(fn, *specs) -> str:
  """StableHLO of ``jit(fn)`` lowered for CUDA (its Triton kernels allowed),
  or a skip where this jaxlib cannot lower Pallas for CUDA."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)]
  try:
    with abstract_gpu():
      exported = jax.export.export(
          jax.jit(fn), platforms=["cuda"], disabled_checks=checks
      )(*specs)
  except ImportError as e:  # a jaxlib without the Triton dialect
    pytest.skip(f"Pallas's Triton lowering is unavailable: {e}")
  return exported.mlir_module()


def assert_bitwise(got, want):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def assert_backend_ties(ties, x, value, gpu_compares):
  """``kth_smallest(..., return_ties=True)``'s counts from a fixed-pass backend.

  Where compares keep denormals (a GPU), the backend's own key counts;
  elsewhere (XLA:CPU and TPUs flush denormals in compares) counted by float
  compares: either way as ``x == value`` counts them (``x`` without
  denormals here).
  """
  del gpu_compares  # the same counts, from two places
  np.testing.assert_array_equal(
      np.asarray(ties), np.sum(x == np.asarray(value), axis=0)
  )


def ranks(n):
  wanted = {1, 2, n // 4, n // 2, (n + 1) // 2, (3 * n) // 4, n - 1, n}
  return sorted(k for k in wanted if 1 <= k <= n)


def rank_matrix(n, n_cols, seed=0):
  """Per-feature ranks: every rank of ``ranks(n)`` plus random ones."""
  rng = np.random.default_rng(seed)
  fixed = ranks(n)
  extra = rng.integers(1, n + 1, max(0, n_cols - len(fixed)))
  return np.concatenate([fixed, extra])[:n_cols].astype(np.int32)


def data(kind, shape, seed=0, *, wide_log_range=(-87, 88)):
  """Random float32 data of one of :data:`KINDS` (ties, infinities, denormals).

  Args:
    kind: One of :data:`KINDS`.
    shape: The array's shape.
    seed: The numpy generator's seed.
    wide_log_range: ``kind="wide"``: magnitudes ``exp(U(lo, hi))``. The
      default spans the normal float32 range; a narrower one keeps float32
      means of ``|x|`` finite (``tests/gbn_jax/selection/test_dispatch.py``'s superquantile
      tests scale their tolerance by one).

  Returns:
    A float32 numpy array of ``shape``.
  """
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  if kind == "relu":  # half the data exactly zero
    x = np.maximum(x, 0)
  elif kind == "halves":  # few distinct values
    x = np.round(x * 2) / 2
  elif kind == "tiny_set":
    x = rng.choice(np.float32([-1.5, 0.0, 2.0, 7.0]), size=shape)
  elif kind == "constant":
    x = np.full(shape, -3.25, np.float32)
  elif kind == "inf":
    x[rng.random(shape) < 0.15] = np.inf
    x[rng.random(shape) < 0.15] = -np.inf
  elif kind == "signed_zero":
    x = rng.choice(
        np.float32([-0.0, 0.0, -1.0, 1.0]), size=shape, p=[0.3, 0.3, 0.2, 0.2]
    )
  elif kind == "denormal":
    # Denormals of both signs among zeros and normals: distinct integer keys.
    pool = np.float32(
        [-3e-39, -1e-45, -0.0, 0.0, 1e-45, 2e-45, 5e-39, TINY, -TINY, 1.0]
    )
    x = rng.choice(pool, size=shape)
  elif kind == "wide":  # magnitudes over the whole float range
    lo, hi = wide_log_range
    x = (np.sign(x) * np.exp(rng.uniform(lo, hi, shape))).astype(np.float32)
  elif kind == "huge":
    big = np.float32(
        [np.finfo(np.float32).max, -np.finfo(np.float32).max, 3e38, -1e38]
    )
    x = np.where(rng.random(shape) < 0.5, rng.choice(big, size=shape), x)
  return np.asarray(x, np.float32)


KINDS = [
    "normal",
    "relu",
    "halves",
    "tiny_set",
    "constant",
    "inf",
    "signed_zero",
    "denormal",
    "wide",
    "huge",
]


def masked_halves(features: int) -> tuple[np.ndarray, np.ndarray]:
  """``"halves"`` data of shape ``(40, 50, features)`` and a mask on it.

  Feature 0 keeps about 60% of its elements, feature 1 a single one, feature
  2 about 2% (sparse); features from 3 on about 60%.
  """
  rng = np.random.default_rng(3)
  x = data("halves", (40, 50, features), seed=3)
  where = rng.random(x.shape) < 0.6
  where[:, :, 1] = False
  where[7, 3, 1] = True  # a feature with a single masked-in element
  where[:, :, 2] = rng.random((40, 50)) < 0.02  # a sparse feature
  return x, where


class ExactnessSuite:
  """Exactness tests shared by the drop-in backends (collected via subclasses).

  Subclasses set two static methods: ``check(x, k, axis, where=None)``, which
  asserts the backend's value (and whatever counts it returns) against
  :func:`numpy_kth` for per-position ranks ``k``; and ``value(x, k, axis,
  where=None)``, the backend's k-th smallest (``k`` an int32 array).
  """

  check = None
  value = None

  @pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 20000])
  def test_row_counts_per_feature_k(self, n):
    # 13 features (not a multiple of 8), a different rank in each.
    x = data("normal", (n, 13), seed=n)
    k = rank_matrix(n, 13, seed=n)
    self.check(x, k, (0,))
    got = self.value(x, jnp.asarray(k), (0,))
    assert_bitwise(got, sort.kth_smallest_reference(x, k, (0,)))

  @pytest.mark.parametrize("kind", KINDS)
  def test_nhwc_data_kinds_and_counts(self, kind):
    # NHWC over (0, 1, 2): 1024 rows, 3 features; every rank of ranks(n).
    x = data(kind, (4, 16, 16, 3), seed=KINDS.index(kind))
    for k in ranks(4 * 16 * 16):
      self.check(x, np.full(3, k), (0, 1, 2))

  @pytest.mark.parametrize(
      "kind", ["relu", "tiny_set", "signed_zero", "denormal"]
  )
  def test_repeated_values_at_every_target(self, kind):
    # Ranks at both ends of every run of tied values, and inside it.
    x = data(kind, (300, 4), seed=3 + len(kind))
    ordered = np.sort(x, axis=0)
    ends = set()
    for f in range(4):
      change = np.flatnonzero(ordered[1:, f] != ordered[:-1, f]) + 1
      ends.update(change.tolist())
      ends.update((change + 1).tolist())
    for k in sorted(e for e in ends if 1 <= e <= 300):
      self.check(x, np.full(4, k), (0,))

  @pytest.mark.parametrize(
      "shape,axis",
      [((30, 4, 70), (0, 2)), ((5, 600), (1,)), ((3, 40, 50), (0, 1, 2))],
  )
  def test_other_axes(self, shape, axis):
    x = data("normal", shape, seed=5)
    n = int(np.prod([shape[a] for a in axis]))
    for k in (1, (n + 1) // 2, n):
      self.check(x, k, axis)

  def test_masks_per_feature_k_and_empty_features(self):
    x, where = masked_halves(5)
    where[:, :, 4] = False  # all masked out: NaN
    x[~where] = -np.inf  # masked-out values must not matter (smaller than all)
    n = where.sum(axis=(0, 1))
    axis = (0, 1)
    for alpha in (
        0.0,
        0.1,
        0.25,
        0.5,
        0.9,
        1.0,
    ):  # k = ceil(alpha * n), alpha*n whole too
      k = np.maximum(np.ceil(alpha * n), 1).astype(np.int32)
      self.check(x, k, axis, where)
      value = np.asarray(self.value(x, jnp.asarray(k), axis, where))
      assert np.isnan(value[4]) and not np.isnan(value[:4]).any()

  def test_out_of_range_k_gives_nan(self):
    x = data("normal", (50, 4), seed=1)
    value = self.value(x, jnp.asarray([0, -3, 51, 50], jnp.int32), (0,))
    assert np.isnan(np.asarray(value[:3])).all()
    assert_bitwise(value[3], np.max(x[:, 3]))
    row_mask = np.arange(50)[:, None] < 20  # broadcast mask: n = 20
    value = self.value(x, jnp.full((4,), 21, jnp.int32), (0,), row_mask)
    assert np.isnan(np.asarray(value)).all()


def assert_local_ties(select_local_ties, x, ks) -> None:
  """``select_local_ties(x, k, (0,))`` -> ``(value, ties)`` without an
  ``axis_name``: the k-th smallest and this device's float32 count of it,
  for each rank in ``ks`` (the same for every feature of ``x``)."""
  for k in ks:
    value, ties = select_local_ties(
        x, jnp.full(x.shape[1:], k, jnp.int32), (0,)
    )
    want_value, want_ties, _ = numpy_kth(x, k, (0,))
    assert_bitwise(value, want_value)
    assert ties.dtype == jnp.float32
    np.testing.assert_array_equal(ties, want_ties)


def assert_vmap_and_axis_name_pooling(kth_smallest, rows, k, pooled_k):
  """A backend's ``kth_smallest(x, k, axis, where=, axis_name=, return_ties=)``
  under ``vmap``: per member without ``axis_name``, pooled over the members
  with it (as devices along ``axis_name`` pool theirs).

  Args:
    kth_smallest: The backend's entry point.
    rows: Rows per member (4 members, 3 features of ``"relu"`` data).
    k: The rank per member, unpooled.
    pooled_k: Three ranks, one per feature, among the pooled masked-in rows
      (about ``0.7 * 4 * rows`` of them).
  """
  x = data("relu", (4, rows, 3), seed=6)
  got = jax.jit(jax.vmap(lambda v: kth_smallest(v, k, (0,))))(x)
  assert_bitwise(got, np.stack([numpy_kth(v, k, (0,))[0] for v in x]))
  where = np.random.default_rng(6).random(x.shape) < 0.7
  pooled_k = jnp.asarray(pooled_k, jnp.int32)
  pooled = jax.jit(
      jax.vmap(
          lambda v, m: kth_smallest(
              v, pooled_k, (0,), where=m, axis_name="b", return_ties=True
          ),
          axis_name="b",
      )
  )(x, where)
  want_value, want_ties, _ = numpy_kth(
      x.reshape(-1, 3), pooled_k, (0,), where.reshape(-1, 3)
  )
  for d in range(4):
    assert_bitwise(pooled[0][d], want_value)
  local_ties = np.asarray(pooled[1])  # each member's own rows
  np.testing.assert_array_equal(local_ties.sum(axis=0), want_ties)
  for d in range(4):
    np.testing.assert_array_equal(
        local_ties[d], ((x[d] == want_value[None]) & where[d]).sum(axis=0)
    )


def assert_half_precision_and_zero_gradient(kth_smallest):
  """bfloat16 input selects as its float32 values do; the k-th smallest of
  float32 input has a zero gradient (it is piecewise constant)."""
  x16 = jnp.asarray(data("normal", (4, 8, 8, 5), seed=9), jnp.bfloat16)
  want = numpy_kth(np.asarray(x16.astype(jnp.float32)), 100, (0, 1, 2))[0]
  got = jax.jit(lambda v: kth_smallest(v, 100, (0, 1, 2)))(x16)
  assert_bitwise(got, want)
  x = jnp.asarray(data("normal", (300, 2), seed=7))
  g = jax.jit(jax.grad(lambda v: jnp.sum(kth_smallest(v, 70, (0,)))))(x)
  assert g.shape == x.shape and not np.any(np.asarray(g))


def assert_dispatch_with_ties(method, monkeypatch, gpu_compares):
  """``dispatch.kth_smallest(..., method=method, return_ties=True)`` under
  jit equals numpy's sort, its ties counted as :func:`assert_backend_ties`
  says, with the compares of a GPU (``gpu_compares``) or of a CPU."""
  # Both answers on any backend: the GPU's compares keep denormals.
  monkeypatch.setattr(common, "compares_keep_denormals", lambda: gpu_compares)
  rng = np.random.default_rng(7)
  x = rng.standard_normal((3000, 5)).astype(np.float32)
  x[::3, 1] = 0.0  # ties at the target
  got, ties = jax.jit(
      lambda v: dispatch.kth_smallest(
          v, 900, (0,), method=method, return_ties=True
      )
  )(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), np.sort(x, axis=0)[899])
  assert_backend_ties(ties, x, got, gpu_compares)


def count_calls(monkeypatch, owner: ModuleType, name: str) -> list[int]:
  """Wraps ``owner.name`` to append 1 to the returned list on every call
  (at trace time, for a traced function), then call through."""
  calls = []
  original: Callable = getattr(owner, name)

  def counted(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(owner, name, counted)
  return calls


def assert_passes_on_portable_kernel(test_file: str, keyword: str) -> None:
  """Runs ``test_file``'s tests selected by ``-k keyword`` in a fresh process
  with ``GBN_KTH_SCALAR=1`` (the native kernel's portable, non-AVX2 code,
  read once per process); some must run and all must pass."""
  proc = run_pytest(
      test_file, "-k", keyword, env={"GBN_KTH_SCALAR": "1"}, timeout=900
  )
  assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
  assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[
      -2000:
  ]
