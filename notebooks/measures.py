# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of the deviation measures in gbn-jax
#
# Generalized Batch Normalization (GBN; Yuan, Feng, Norton & Li, AAAI 2019)
# normalizes every feature over the batch by a *statistic* $S$ and a
# *generalized deviation* $D$,
#
# $$\hat x = \frac{x - S(x)}{\sqrt{D(x)^2 + \epsilon}},$$
#
# followed by BatchNorm's learned scale and bias. BatchNorm itself is the pair
# (mean, standard deviation). The built-in pairs, with expectations taken over
# the batch ($1/N$, no Bessel correction):
#
# | name | statistic $S$ | deviation $D$ |
# |---|---|---|
# | `sd` | $E[x]$ | $\sqrt{E[(x - E x)^2]}$ |
# | `mad` | $E[x]$ | $E\lvert x - E x\rvert$ |
# | `rsd` | $E[x]$ | $E[(x - E x)^+]$ |
# | `sqd` (`alpha`) | $q_\alpha$ | $\bar q_\alpha - E[x]$ |
# | `sqd1`, `sqd2`, `sqd3` | `sqd` at $\alpha = .25, .5, .75$ | |
# | `rbd` | $(\max + \min)/2$ | $\max - \min$ |
# | `wcd` | $\max$ | $\max - E[x]$ |
# | `bpoe` | $E[x]$ | $E[x - E x \mid x > E x]$ (0 if no such $x$) |
#
# $q_\alpha$ is the $\lceil \alpha N \rceil$-th smallest element of the batch
# and $\bar q_\alpha = q_\alpha + E[(x - q_\alpha)^+] / (1 - \alpha)$ the
# superquantile (CVaR): the mean of the upper $1 - \alpha$ tail.
#
# This notebook looks at where each $S$ sits and how large each $D$ is on four
# kinds of batches, what GBN followed by ReLU makes of them, and checks two
# facts with `assert`s (besides every measure against numpy): SQD followed by
# ReLU zeroes a fraction $\alpha$ of the batch, and the bPOE identity.
# Executing it is part of the test suite (`tests/project/test_notebooks.py`). The last
# section, *Try it yourself*, has widgets to pick a batch (or type your own),
# a measure and $\alpha$, and see $S$, $D$ and the output.
#
# *Editing:* `notebooks/measures.py` (jupytext percent format) is the source of
# truth, paired with `measures.ipynb` by `notebooks/jupytext.toml`; the
# `.ipynb` is committed executed, with its outputs. After changing code, run
# `python -m notebooks.execute measures` from the repository root (it executes
# the `.py` and rewrites the `.ipynb`); after changing only markdown,
# `jupytext --sync notebooks/measures.py` is enough.

# %%
import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import gbn_jax

np.set_printoptions(precision=4, suppress=True)
# Modest PNGs: the committed .ipynb keeps its figures.
plt.rcParams["figure.dpi"] = 80

# %% [markdown]
# ## Four batches
#
# One feature, $N = 2000$ samples each, in float32 (the layer's dtype):
#
# * **skewed**: lognormal, a long right tail;
# * **heavy-tailed**: Student $t$ with 2 degrees of freedom (finite mean,
#   infinite variance), a few extreme values on both sides;
# * **bimodal**: a 70/30 mixture of two well separated normals;
# * **ReLU-like**: the output of a previous ReLU, over a third exact zeros.
#
# $N = 2000 = 2^4 5^3$ makes every $k/N$ a short decimal, which matters for
# the bPOE section below.

# %%
N = 2000
rng = np.random.default_rng(2019)
BATCHES = {
    "skewed": rng.lognormal(0.0, 0.75, N),
    "heavy-tailed": rng.standard_t(2.0, N),
    "bimodal": np.where(
        rng.random(N) < 0.7, rng.normal(-1.5, 0.5, N), rng.normal(2.0, 0.6, N)
    ),
    "ReLU-like": np.maximum(rng.normal(0.3, 1.0, N), 0.0),
}
BATCHES = {name: x.astype(np.float32) for name, x in BATCHES.items()}
# Features of one (N, 4) array: GBN normalizes each column on its own, so one
# call of a measure or a layer handles all four batches.
X = np.stack(list(BATCHES.values()), axis=1)
TIE_FREE = ["skewed", "heavy-tailed", "bimodal"]

for name in TIE_FREE:
  assert np.unique(BATCHES[name]).size == N, f"{name} has tied values"
relu_like = BATCHES["ReLU-like"]
N_ZEROS = int(np.sum(relu_like == 0))
assert np.unique(relu_like[relu_like > 0]).size == N - N_ZEROS
print(f"ReLU-like batch: {N_ZEROS} exact zeros out of {N} ({N_ZEROS / N:.1%})")

# %%
fig, axes = plt.subplots(1, 4, figsize=(13, 2.6), layout="constrained")
for ax, (name, x) in zip(axes, BATCHES.items()):
  lo, hi = np.quantile(x, [0.002, 0.998])
  ax.hist(x, bins=60, range=(lo, hi), color="0.6")
  ax.set_title(name)
  ax.set_yticks([])
fig.suptitle("the four batches (histograms of the central 99.6%)")
plt.show()

# %% [markdown]
# ## Where each S sits and how large each D is
#
# `gbn_jax.get_measure(name)` returns `measure(x, axis) -> (S, D)`, and
# `gbn_jax.GBatchNorm(measure=name)` is a drop-in for `flax.linen.BatchNorm`
# that normalizes with it. Its `batch_stats` collection keeps BatchNorm's
# names: `mean` holds the running $S$ and `var` the running $D^2$, updated as
# `momentum * old + (1 - momentum) * batch`. With `momentum=0` they are
# exactly this batch's $S$ and $D^2$, so one training-mode call gives the
# statistics and the normalized output together.
#
# The layer is jitted with `measure` and `alpha` static: quantile levels are
# compile-time constants, so each `(measure, alpha)` compiles once.

# %%
NAMES = [name for name in gbn_jax.MEASURES if name != "sqd"]
EPS = gbn_jax.GBatchNorm.epsilon
# One colour per measure, one line style per family (centred on the mean, on
# a quantile, on the extremes), the same in every figure.
FAMILY_STYLE = {"sd": "-", "mad": "-", "rsd": "-", "bpoe": "-", "sqd1": "--",
                "sqd2": "--", "sqd3": "--", "rbd": ":", "wcd": ":"}
STYLE = {name: {"color": f"C{i}", "ls": FAMILY_STYLE.get(name, "-.")}
         for i, name in enumerate(NAMES)}


@functools.partial(jax.jit, static_argnames=("measure", "alpha"))
def gbn(x: jax.Array, measure: str, alpha: float | None = None):
  """GBatchNorm in training mode: returns (output, S, D) of the batch x."""
  layer = gbn_jax.GBatchNorm(
      use_running_average=False, measure=measure, alpha=alpha, momentum=0.0
  )
  # Parameters and initial running statistics do not depend on the measure:
  # init with the cheap default ('sd') gives the same scale 1 and bias 0.
  variables = gbn_jax.GBatchNorm(use_running_average=False).init(
      jax.random.key(0), x
  )
  y, updates = layer.apply(variables, x, mutable=["batch_stats"])
  stats = updates["batch_stats"]
  return y, stats["mean"], jnp.sqrt(stats["var"])


# The measure on its own gives the same pair as the layer's batch_stats.
s, d = gbn_jax.get_measure("bpoe")(jnp.asarray(X), axis=0)
_, s_layer, d_layer = gbn(jnp.asarray(X), "bpoe")
np.testing.assert_allclose(s, s_layer, rtol=1e-6)
np.testing.assert_allclose(d, d_layer, rtol=1e-6)
print("bpoe (S, D) per batch:", np.asarray(s), np.asarray(d), sep="\n")

# %% [markdown]
# Every built-in measure (the registry `gbn_jax.MEASURES`; the general `'sqd'`
# needs an `alpha`, and its three named levels stand in for it), checked
# against a numpy transcription of the definitions above.

# %%
def np_quantile(x: np.ndarray, alpha: float) -> float:
  """The ceil(alpha*N)-th smallest, alpha read as the decimal it prints as."""
  k = -(-Fraction(repr(float(alpha))) * len(x) // 1)  # exact ceil
  return float(np.sort(x)[int(k) - 1])


def np_sqd(alpha: float):
  def measure(x):
    q = np_quantile(x, alpha)
    qbar = q + np.mean(np.maximum(x - q, 0.0)) / (1 - alpha)
    return q, qbar - x.mean()
  return measure


def np_bpoe(x):
  centered = x - x.mean()
  above = centered[centered > 0]
  return x.mean(), (above.mean() if above.size else 0.0)


NUMPY_MEASURES = {
    "sd": lambda x: (x.mean(), x.std()),
    "mad": lambda x: (x.mean(), np.abs(x - x.mean()).mean()),
    "rsd": lambda x: (x.mean(), np.maximum(x - x.mean(), 0.0).mean()),
    "sqd1": np_sqd(0.25),
    "sqd2": np_sqd(0.5),
    "sqd3": np_sqd(0.75),
    "rbd": lambda x: ((x.max() + x.min()) / 2, x.max() - x.min()),
    "wcd": lambda x: (x.max(), x.max() - x.mean()),
    "bpoe": np_bpoe,
}
assert set(NAMES) == set(NUMPY_MEASURES), (
    "new built-in measure: add its definition to NUMPY_MEASURES",
    sorted(set(NAMES) ^ set(NUMPY_MEASURES)),
)

# OUT[name] = relu(GBN(X)), shape (N, 4); STATS[name] = (S, D), shape (4,).
OUT, STATS = {}, {}
for name in NAMES:
  y, s, d = (np.asarray(a) for a in gbn(jnp.asarray(X), name))
  ref = np.array([NUMPY_MEASURES[name](col.astype(np.float64)) for col in X.T])
  np.testing.assert_allclose(s, ref[:, 0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(d, ref[:, 1], rtol=1e-4, atol=1e-5)
  # With scale 1 and bias 0 the layer outputs (x - S) / sqrt(D^2 + eps).
  by_hand = (X - ref[:, 0]) / np.sqrt(ref[:, 1] ** 2 + EPS)
  np.testing.assert_allclose(y, by_hand, rtol=1e-4, atol=1e-4)
  STATS[name], OUT[name] = (s, d), np.maximum(y, 0.0)

for j, batch in enumerate(BATCHES):
  print(f"\n{batch:>12}     S          D        S+D")
  for name in NAMES:
    s, d = STATS[name][0][j], STATS[name][1][j]
    print(f"{name:>12} {s:9.3f}  {d:9.3f}  {s + d:9.3f}")

# %% [markdown]
# Each panel below shares its x axis with the batch's histogram: the dot is
# $S$, the bar runs to $S + D$; values off the axis (which shows the central
# 99.6% of the batch) are arrows at its edge, with the value. Things to
# notice:
#
# * `sd`, `mad`, `rsd` and `bpoe` all center on the mean and differ only in
#   scale. `rsd` and `bpoe` only look above the mean: `rsd` averages the excess
#   over the whole batch, `bpoe` over the elements above the mean, so
#   `rsd` $= P(x > E x) \cdot$ `bpoe` (and `mad` $= 2\,$`rsd`).
# * `sqd` centers on a quantile, so it moves with $\alpha$ and ignores the
#   tails for its center, while its $D$ is the *tail mean* minus the mean.
# * `rbd` and `wcd` are built from the extremes: on the heavy-tailed batch one
#   sample decides both.

# %%
def _interval_panel(ax, s, d, lo, hi):
  """One row per measure: a dot at S and a bar to S + D, clipped to [lo, hi]."""
  for i, name in enumerate(NAMES):
    ends = np.array([s[name], s[name] + d[name]])
    a, b = np.clip(ends, lo, hi)
    ax.plot([a, b], [i, i], color=STYLE[name]["color"], lw=3,
            solid_capstyle="butt")
    if lo <= ends[0] <= hi:
      ax.plot([a], [i], "o", color=STYLE[name]["color"])
    # Off the axis: an arrow at the edge, labelled with the value(s).
    for right, off in ((False, ends[ends < lo]), (True, ends[ends > hi])):
      if off.size:
        edge = hi if right else lo
        ax.plot([edge], [i], ">" if right else "<", color="k", ms=5,
                clip_on=False)
        ax.annotate(" to ".join(f"{v:.3g}" for v in off), (edge, i),
                    xytext=(-6 if right else 6, 4), textcoords="offset points",
                    fontsize=7, ha="right" if right else "left", va="bottom")
  ax.set_yticks(range(len(NAMES)), NAMES)
  ax.set_ylim(len(NAMES) - 0.5, -0.7)
  ax.set_xlim(lo, hi)


fig, axes = plt.subplots(
    2, 4, figsize=(13, 5.5), sharex="col", layout="constrained",
    gridspec_kw={"height_ratios": [1, 2.2]},
)
for j, (batch, x) in enumerate(BATCHES.items()):
  lo, hi = np.quantile(x, [0.002, 0.998])
  pad = 0.08 * (hi - lo)
  lo, hi = lo - pad, hi + pad
  axes[0, j].hist(x, bins=60, range=(lo, hi), color="0.6")
  axes[0, j].set_title(batch)
  axes[0, j].set_yticks([])
  _interval_panel(
      axes[1, j],
      {name: STATS[name][0][j] for name in NAMES},
      {name: STATS[name][1][j] for name in NAMES},
      lo, hi,
  )
  if j:
    axes[1, j].set_yticklabels([])
fig.suptitle("statistic S (dot) and S + D (end of bar) of each measure;"
             " arrows: off the axis")
plt.show()

# %% [markdown]
# ## The output of GBN followed by ReLU
#
# With its initial scale 1 and bias 0 the layer outputs
# $(x - S)/\sqrt{D^2 + \epsilon}$ (checked above against the numpy $S$ and
# $D$). What does a ReLU keep of it? The table gives the fraction of zeros and
# the largest output per measure and batch.

# %%
print(f"{'zeros / max':>12}" + "".join(f"{b:>16}" for b in BATCHES))
for name in NAMES:
  frac_zeros, top = (OUT[name] == 0).mean(axis=0), OUT[name].max(axis=0)
  print(f"{name:>12}"
        + "".join(f"{z:>9.1%} /{t:5.2f}" for z, t in zip(frac_zeros, top)))

# %% [markdown]
# The curves are the empirical CDFs of the ReLU output: the dot at 0 is the
# fraction of zeros (`wcd`'s is at 1: it zeroes everything), and the spread to
# the right is the scale of the survivors. Line styles group the measures by
# what they centre on: the mean (solid), a quantile (dashed), the extremes
# (dotted).
#
# * Centering on the mean (`sd`, `mad`, `rsd`, `bpoe`) zeroes $P(x \le E x)$,
#   which depends on the shape: about two thirds of the right-skewed batch and
#   of the bimodal one (whose smaller mode is on the right), about half of the
#   symmetric heavy-tailed one.
# * `sqd1`/`sqd2`/`sqd3` zero 25%/50%/75% whatever the shape (except for ties,
#   below), and put the survivors on the scale of the upper tail.
# * `wcd` centers on the maximum, so with bias 0 the ReLU zeroes the whole
#   batch (a learned bias shifts that point); `rbd` divides by the range, so
#   one outlier squeezes everything else towards 0.

# %%
fig, axes = plt.subplots(1, 4, figsize=(13, 3.4), sharey=True,
                         layout="constrained")
for j, (batch, ax) in enumerate(zip(BATCHES, axes)):
  for name in NAMES:
    y = np.sort(OUT[name][:, j])
    zeros = np.mean(y == 0)
    # From the dot (the zeros) up the survivors' ECDF.
    survivors = y[y > 0]
    ax.step(np.r_[0.0, survivors],
            np.r_[zeros, zeros + np.arange(1, survivors.size + 1) / N],
            where="post", lw=1.4, label=name, **STYLE[name])
    ax.plot([0.0], [zeros], "o", ms=4, color=STYLE[name]["color"])
  ax.set_xlim(-0.1, 3.0)
  ax.set_ylim(-0.02, 1.04)
  ax.set_title(batch)
  ax.set_xlabel("relu(GBN(x))")
  ax.grid(True, alpha=0.3)
axes[0].set_ylabel("fraction of the batch <= value")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center",
           title="measure", fontsize=9)
fig.suptitle("empirical CDF of relu(GBN(x)), scale 1 and bias 0 (dot: the"
             " fraction of zeros)")
plt.show()

# %% [markdown]
# ## SQD + ReLU zeroes a fraction alpha
#
# With $S = q_\alpha$ the elements below the quantile map to negative values,
# those equal to it to exactly $0$ and those above it to positive values, so
# the ReLU zeroes $\#\{x \le q_\alpha\}$ elements. Without ties that is exactly
# $k = \lceil \alpha N \rceil$ (the rank of $q_\alpha$), so the fraction of zeros
# is $\lceil \alpha N \rceil / N \in [\alpha, \alpha + 1/N)$: $\alpha$ up to
# the granularity of the batch.
#
# **Ties.** If several elements equal $q_\alpha$, they all land on $0$, and
# the fraction becomes $P(x \le q_\alpha) \ge \lceil \alpha N \rceil / N$. The
# ReLU-like batch has an atom of exact zeros: for every $\alpha$ up to its
# share of zeros, $q_\alpha = 0$ and the ReLU zeroes the whole atom, so
# `sqd1` zeroes that share (over a third), not 25%. Inputs with such atoms are common in
# practice (GBN placed after a ReLU, dead units, quantized activations).
#
# Where $\alpha N$ is whole the fraction is exactly $\alpha$; at
# $\alpha = 0.31416$, $\alpha N = 628.32$ and the fraction is $629/2000$. The
# ceiling is taken of the decimal $\alpha$ prints as: in floating point
# `0.07 * 100` is `7.000000000000001`, whose ceiling is 8, not 7; gbn-jax, like
# the reference here, reads $\alpha$ as the decimal.

# %%
# Each level compiles the layer anew (quantile levels are static), so only a
# few: sqd1..sqd3 from above, 0.31416 (alpha N not whole, and below the
# ReLU-like batch's share of zeros, like 0.25), and P(x <= E x) of two of the
# batches (used again in the bPOE section below).
BPOE_BATCHES = ["skewed", "ReLU-like"]
ALPHA_STAR = {b: float(np.mean(BATCHES[b] <= BATCHES[b].astype(np.float64).mean()))
              for b in BPOE_BATCHES}
SWEEP = [0.31416, *ALPHA_STAR.values()]
counts = {a: (OUT[f"sqd{i}"] == 0).sum(axis=0)
          for i, a in ((1, 0.25), (2, 0.5), (3, 0.75))}
for a in SWEEP:
  y, _, _ = gbn(jnp.asarray(X), "sqd", a)
  counts[a] = (np.maximum(np.asarray(y), 0.0) == 0).sum(axis=0)
ALPHAS = np.array(sorted(counts))
zeros = np.array([counts[a] for a in ALPHAS])  # (levels, 4) counts of zeros
rank = np.array([int(-(-Fraction(repr(float(a))) * N // 1)) for a in ALPHAS])

for j, batch in enumerate(BATCHES):
  x = X[:, j]
  at_or_below = np.array([np.sum(x <= np_quantile(x, a)) for a in ALPHAS])
  assert np.array_equal(zeros[:, j], at_or_below), batch  # always #{x <= q}
  if batch in TIE_FREE:
    assert np.array_equal(zeros[:, j], rank), batch  # exactly ceil(alpha N)
    frac = zeros[:, j] / N
    assert np.all((frac >= ALPHAS) & (frac < ALPHAS + 1 / N)), batch
    whole = rank == ALPHAS * N
    assert np.array_equal(frac[whole], ALPHAS[whole]), batch
# The ReLU-like batch: its atom at 0 is zeroed whole, max(ceil(alpha N), #0s).
assert np.array_equal(zeros[:, 3], np.maximum(rank, N_ZEROS))
assert np.any(zeros[:, 3] > rank)  # the caveat does show up on this batch

print("fraction of zeros after GBN(sqd, alpha) + ReLU")
print(f"{'alpha':>8} {'ceil(aN)/N':>10}" + "".join(f"{b:>13}" for b in BATCHES))
for a, k, row in zip(ALPHAS, rank, zeros):
  print(f"{a:8.5f} {k / N:10.5f}" + "".join(f"{c / N:13.5f}" for c in row))

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
for j, batch in enumerate(BATCHES):
  ax0.plot(ALPHAS, zeros[:, j] / N, "o-", ms=3, lw=1, label=batch)
ax0.plot([0, 1], [0, 1], "k:", lw=1, label="alpha")
ax0.axhline(N_ZEROS / N, color="C3", lw=0.6, ls="--")
ax0.set(xlabel="alpha", ylabel="fraction of zeros",
        title="GBN(sqd, alpha) + ReLU")
ax0.legend(fontsize=8)
# Zoom on 0.31416: the tie-free batches sit on the staircase ceil(alpha N)/N.
grid = np.linspace(0.3138, 0.3145, 701)
ax1.step(grid, np.ceil(grid * N - 1e-9) / N, "k", where="post", lw=1,
         label="ceil(alpha N) / N")
ax1.plot(grid, grid, "k:", lw=1, label="alpha")
i = int(np.flatnonzero(ALPHAS == 0.31416)[0])
for j, batch in enumerate(TIE_FREE):
  ax1.plot(ALPHAS[i], zeros[i, j] / N, "o", ms=10 - 3 * j, label=batch)
ax1.set(xlabel="alpha", xlim=(grid[0], grid[-1]), title="zoom: one element")
ax1.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## bPOE: SQD at the level where the quantile meets the mean
#
# The buffered probability of exceedance (bPOE) of a threshold $z$ is
# $1 - \alpha$ for the level $\alpha$ at which the superquantile reaches $z$,
# $\bar q_\alpha = z$. The identity behind the `bpoe` measure: choose
# $\alpha^* = P(x \le E[x])$, so that $q_{\alpha^*}$ is (in the continuous
# case, exactly) the mean. Then the superquantile is the mean of the part
# above the mean, and SQD's deviation becomes
#
# $$\bar q_{\alpha^*} - E[x] = E[x - E x \mid x > E x],$$
#
# the `bpoe` measure's $D$. GBN with SQD at $\alpha^*$ followed by ReLU is then
# the empirical bPOE transform
#
# $$x \mapsto \frac{(x - E x)^+}{E[x - E x \mid x > E x]},$$
#
# which zeroes a fraction $\alpha^*$ of the batch and whose mean is
# $P(x > E x) = 1 - \alpha^*$, the bPOE of the threshold $\bar q_{\alpha^*}$.
# The `bpoe` measure computes exactly this pair,
# $(E[x],\ E[x - Ex \mid x > Ex])$.
#
# On a finite batch $q_{\alpha^*}$ is the largest element $\le E[x]$ rather
# than $E[x]$ itself. The tail above it is the same set (the elements
# $> E[x]$), so the deviation identity is exact, the zeros are the same, and
# the SQD output differs from the bPOE transform only by the constant
# $(E[x] - q_{\alpha^*})/D$ on the surviving elements: less than one gap
# between neighbouring samples, which vanishes as $N$ grows.
#
# The checks below use numpy in float64 for the references, on the skewed
# batch and on the ReLU-like one (whose atom at 0 lies below the mean).
# $\alpha^* = k/N$ is a short decimal because $N = 2000$, so
# $\lceil \alpha^* N \rceil = k$ selects precisely the largest element below
# the mean.

# %%
rows, BPOE_OUT = [], {}
for batch in BPOE_BATCHES:
  j = list(BATCHES).index(batch)
  x = X[:, j].astype(np.float64)
  mean = x.mean()
  # float32 (the layer) and float64 (here) must agree on which side of the
  # mean every element lies: no element within the worst-case error of a
  # float32 sum of N terms.
  assert np.min(np.abs(x - mean)) > N * 2.0**-24 * np.abs(x).mean(), batch
  above = x > mean
  k = int(np.sum(~above))
  alpha_star = k / N
  assert alpha_star == ALPHA_STAR[batch]  # the level used in the sweep above
  q = np.sort(x)[k - 1]  # the largest element <= E[x]
  qbar = q + np.mean(np.maximum(x - q, 0.0)) / (1 - alpha_star)
  d_bpoe = np.mean(x[above] - mean)  # E[x - Ex | x > Ex], from its definition

  # The identity, in float64 from the definitions.
  assert np.isclose(qbar - mean, d_bpoe, rtol=1e-12), batch

  # The layers and their (S, D), in float32 (on all four batches at once,
  # as in the sweep above, which already compiled them; we keep column j).
  y_sqd, s_sqd, d_sqd = (np.asarray(v)[..., j]
                         for v in gbn(jnp.asarray(X), "sqd", alpha_star))
  y_bp, s_bp, d_bp = (np.asarray(v)[..., j] for v in gbn(jnp.asarray(X), "bpoe"))
  assert s_sqd == np.float32(q), batch  # S of sqd at alpha*: that element
  np.testing.assert_allclose([d_sqd, d_bp], d_bpoe, rtol=1e-5)
  np.testing.assert_allclose(s_bp, mean, rtol=1e-5, atol=1e-6)

  # Followed by ReLU.
  y_sqd, y_bp = np.maximum(y_sqd, 0.0), np.maximum(y_bp, 0.0)
  transform = np.maximum(x - mean, 0.0) / d_bpoe  # the empirical bPOE transform
  assert np.isclose(transform.mean(), 1 - alpha_star, rtol=1e-12), batch
  to_layer = d_bpoe / np.sqrt(d_bpoe**2 + EPS)  # the layer divides by sqrt(D^2+eps)
  np.testing.assert_allclose(y_bp, transform * to_layer, rtol=1e-5, atol=1e-5)
  shift = (mean - q) / d_bpoe
  np.testing.assert_allclose(y_sqd, (transform + shift * above) * to_layer,
                             rtol=1e-5, atol=1e-5)
  assert np.array_equal(y_sqd == 0, ~above), batch
  assert np.array_equal(y_bp == 0, ~above), batch
  assert np.mean(y_sqd == 0) == alpha_star, batch
  BPOE_OUT[batch] = (alpha_star, y_sqd, y_bp)
  rows.append((batch, alpha_star, d_bpoe, d_sqd, shift,
               np.abs(y_sqd - transform).max()))

print(f"{'batch':>12} {'alpha*':>7} {'E[x-Ex|x>Ex]':>13} {'SQD D':>8}"
      f" {'shift':>9} {'max|sqd+relu - bPOE|':>21}")
for batch, a, d_ref, d, shift, err in rows:
  print(f"{batch:>12} {a:7.4f} {d_ref:13.5f} {d:8.5f} {shift:9.2e} {err:21.2e}")

# %% [markdown]
# The last column is the whole gap between `relu(GBN(sqd, alpha*))` and the
# textbook transform, $\epsilon$ included: about the shift, one sample gap at
# the mean divided by $D$. The plot shows both layers' outputs against the
# input for the skewed batch: the same hinge at the mean, the same slope
# $1/D$.

# %%
x = X[:, 0].astype(np.float64)
alpha_star, y_sqd, y_bp = BPOE_OUT["skewed"]
order = np.argsort(x)
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
ax.plot(x[order], y_bp[order], lw=3, alpha=0.4, label="relu(GBN(bpoe))")
ax.plot(x[order], y_sqd[order], "k--", lw=1,
        label=f"relu(GBN(sqd, alpha*={alpha_star:.4f}))")
ax.axvline(x.mean(), color="0.5", lw=0.8, ls=":", label="E[x]")
top = np.quantile(x, 0.99)
ax.set(xlabel="x (skewed batch)", ylabel="output", xlim=(0, top),
       ylim=(-0.1, 1.05 * y_bp[x <= top].max()),
       title="the empirical bPOE transform: sqd at alpha* and bpoe, + ReLU")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## Try it yourself
#
# Pick a batch (one of the four above, or type your own numbers, separated by
# commas, and choose *your own samples*), a measure (every name registered in
# `gbn_jax.MEASURES`) and, for the general `sqd`, the level $\alpha$. The left
# panel is the batch with its $S$ and $S + D$; the right one is what
# `GBatchNorm` with that measure (scale 1, bias 0) followed by a ReLU outputs:
# $S$ lands on 0 and $S + D$ on (just under) 1, everything below $S$ is zeroed.
#
# The widgets need a running kernel (`pip install -e '.[notebooks]'`, then
# `jupyter lab notebooks/measures.ipynb`); on a static page they show nothing,
# so the cell after them draws one choice without widgets.

# %%
import re

import ipywidgets as widgets

OWN = "your own samples"


def takes_alpha(measure: str) -> bool:
  """Whether the registered measure lets you choose alpha (only 'sqd')."""
  try:
    gbn_jax.get_measure(measure, alpha=0.5)
  except TypeError:  # sqd1..sqd3 fix it, the others take none
    return False
  return True


def parse_samples(text: str) -> np.ndarray:
  """Numbers separated by commas (or spaces, semicolons), as float32."""
  tokens = [t for t in re.split(r"[,;\s]+", text.strip()) if t]
  try:
    x = np.array([float(t) for t in tokens], np.float32)
  except ValueError as e:
    raise ValueError(f"not a number in {text!r}: {e}") from None
  if x.size < 2 or not np.all(np.isfinite(x)):
    raise ValueError("type at least two finite numbers, e.g. 0, 1, 2, 10")
  return x


def explore(distribution: str, measure: str, alpha: float, samples: str = ""):
  """Histograms of a batch before and after GBN(measure) + ReLU."""
  try:
    x = (parse_samples(samples) if distribution == OWN
         else BATCHES[distribution])
    # The slider's float, read as the 2-decimal level it shows.
    level = round(float(alpha), 2) if takes_alpha(measure) else None
    y, s, d = (np.asarray(v)[..., 0]
               for v in gbn(jnp.asarray(x)[:, None], measure, level))
  except (TypeError, ValueError) as e:
    print(f"cannot show this choice: {e}")
    return
  s, d, out = float(s), float(d), np.maximum(y, 0.0)
  name = f"{measure}, alpha={level}" if level is not None else measure

  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
  # Before: the central 99.6% of a large batch (all of a small one), widened
  # to S and S + D where they lie within the batch's range.
  lo, hi = (np.quantile(x, [0.002, 0.998]) if x.size >= 500
            else (x.min(), x.max()))
  marks = [v for v in (s, s + d) if x.min() <= v <= x.max()]
  lo, hi = min(lo, *marks), max(hi, *marks)
  pad = 0.05 * (hi - lo) or 0.5
  lo, hi = lo - pad, hi + pad
  ax0.hist(x, bins=int(np.clip(x.size // 20, 10, 60)), range=(lo, hi),
           color="0.6")
  ax0.axvspan(s, s + d, color="C0", alpha=0.15, label=f"D = {d:.4g}")
  ax0.axvline(s, color="C3", lw=2, label=f"S = {s:.4g}")
  ax0.axvline(s + d, color="C0", lw=2, ls="--", label=f"S + D = {s + d:.4g}")
  ax0.axvline(x.mean(), color="k", lw=1, ls=":", label=f"mean = {x.mean():.4g}")
  off = [t for t, v in (("S", s), ("S + D", s + d)) if not lo <= v <= hi]
  ax0.set(xlim=(lo, hi), yticks=[], xlabel="x",
          title=f"{distribution}: N = {x.size}"
          + (f" ({' and '.join(off)} off the axis)" if off else ""))
  ax0.legend(fontsize=8, loc="upper right")

  # After: the zeros as a number, the survivors as a histogram.
  zeros = np.mean(out == 0)
  survivors = out[out > 0]
  one = d / np.sqrt(d**2 + EPS)  # 1 unless D is about sqrt(eps) or less
  top = max(np.quantile(survivors, 0.998) if survivors.size >= 500
            else survivors.max(initial=0.0), one) * 1.08
  if survivors.size:
    ax1.hist(survivors, bins=int(np.clip(survivors.size // 20, 10, 60)),
             range=(0, top), color="C2", alpha=0.7,
             label=f"survivors: {1 - zeros:.1%}")
  ax1.axvline(0, color="C3", lw=2, label=f"S -> 0: {zeros:.1%} zeroed")
  ax1.axvline(one, color="C0", lw=2, ls="--", label=f"S + D -> {one:.3g}")
  top = top or 1.0  # nothing survives and D is 0
  ax1.set(xlim=(-0.04 * top, top), yticks=[], xlabel="relu(GBN(x))",
          title=f"after GBN({name}) + ReLU: mean {out.mean():.3g},"
          f" max {out.max():.3g}")
  ax1.legend(fontsize=8, loc="upper right")
  fig.suptitle(f"{name} on {distribution}: S = {s:.4g}, D = {d:.4g}")
  plt.show()


batch_w = widgets.Dropdown(options=[*BATCHES, OWN], value="skewed",
                           description="batch")
measure_w = widgets.Dropdown(options=list(gbn_jax.MEASURES), value="sqd",
                             description="measure")
alpha_w = widgets.FloatSlider(value=0.25, min=0.01, max=0.99, step=0.01,
                              description="alpha (sqd)",
                              continuous_update=False, readout_format=".2f")
samples_w = widgets.Text(value="0, 0, 0, 0.1, 0.4, 0.5, 0.9, 1.3, 2, 6",
                         description="samples",
                         placeholder="comma-separated numbers",
                         continuous_update=False, disabled=True,
                         layout=widgets.Layout(width="45%"))


def _enable(_=None):
  alpha_w.disabled = not takes_alpha(measure_w.value)
  samples_w.disabled = batch_w.value != OWN


batch_w.observe(_enable, "value")
measure_w.observe(_enable, "value")
_enable()
# Runs explore once now with these values (also headless, in the tests), and
# again on every change.
panel = widgets.interactive_output(explore, {
    "distribution": batch_w, "measure": measure_w, "alpha": alpha_w,
    "samples": samples_w})
display(widgets.VBox([widgets.HBox([batch_w, measure_w, alpha_w]), samples_w,
                      panel]))

# %% [markdown]
# The same panel without widgets, for one choice: `sqd` at $\alpha = 0.25$ on
# the ReLU-like batch. Its quantile $q_{0.25}$ is one of the exact zeros, so
# the ReLU zeroes the whole atom, over a third of the batch instead of a
# quarter (the caveat about ties above). And with $S = 0$ the deviation
# $\bar q_{0.25} - E[x] = E[x]/3$ is small, so the survivors come out large
# (compare `sd` on the same batch).

# %%
explore("ReLU-like", "sqd", 0.25)
