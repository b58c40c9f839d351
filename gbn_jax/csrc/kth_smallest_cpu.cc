// Exact k-th smallest per column of a row-major (N, F) float32 array: an XLA
// FFI handler for the CPU, used by gbn_jax/_select.py when it is built.
//
// Keys are the order-preserving unsigned image of the float bits (-0.0 sorts
// just below +0.0, NaN beyond +-inf), so every comparison is an exact integer
// one; XLA:CPU's float compares flush denormals, ours do not.
//
// Every selection in a contiguous array of keys is SelectKth: a Floyd-Rivest
// style select whose rounds are one branch-free (AVX2 where the CPU has it)
// pass each. Short columns (at most kDirectRows) are transposed into such
// arrays, eight at a time. Longer ones take one sweep over the data in the
// common case: the order statistics of a sample of rows bracket each
// column's target rank, the sweep counts the keys below the bracket and packs
// those inside it (a few per cent of the data), and SelectKth finishes on
// them. A bracket holding a single key (an atom such as the zeros after a
// ReLU) is counted, not gathered. A column whose bracket misses the target
// (rare) is selected whole. A bracket that holds more than a share of its
// column (it spans a large atom the sample did not resolve) stops gathering
// and is selected by histogram passes over the column instead, so that
// memory stays a fraction of the input's. Work is spread over XLA's
// intra-op thread pool; an exception in any task (std::bad_alloc) is carried
// to the handler, which returns it as an FFI error.
//
// Inputs: x (N, F) float32 (N < 2^31), k (F,) int32 (1-based, clamped to
// [1, N]).
// Outputs: (F,) int32, the signed key (unsigned key ^ 0x80000000) of the
// answer, which is what gbn_jax._select works with; (F,) int32, how many
// elements equal the answer as float comparisons in the caller's code see it
// (denormals read as zero where the CPU's DAZ flag is set, as XLA:CPU sets
// it; -1 for a zero or denormal answer where this code cannot read the flag);
// (F,) int32, the path each column took (a Path), for tests and diagnostics.
// The sums entry point adds, per column, E[x], E[(x - answer)^+] and
// #{not x <= answer} (as the ties). Sums are float32 within blocks of rows
// (sums of non-negative terms for the excess: x less a reference at or above
// the answer), float64 across; a block whose float sum is not finite is
// summed again in float64.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernel.h"

namespace {

using gbn_jax::ParallelFor;

constexpr uint32_t kSign = 0x80000000u;
// Sample rows: N / kSampleFraction within [kMinSample, kMaxSample]. A larger
// sample narrows the bracket (fewer keys to gather) but costs its selection.
constexpr int64_t kSampleFraction = 32;
constexpr int64_t kMinSample = 4096;
constexpr int64_t kMaxSample = 16384;
constexpr int64_t kDirectRows = 16384;
constexpr double kGolden = 0.6180339887498949;
constexpr int64_t kElementsPerTask = 1 << 17;
constexpr int64_t kElementsPerSampleTask = 1 << 15;

// kHistogram: the bracket held the target but too many keys to gather.
enum Path : int32_t {
  kWholeColumn = 0,
  kSingleKey = 1,
  kGathered = 2,
  kMissedBracket = 3,
  kHistogram = 4
};
// Largest N: the outputs count elements in int32.
constexpr int64_t kMaxRows = 0x7FFFFFFF;
// Largest bracket_sigmas accepted (the bracket spans the sample long before).
constexpr double kMaxBracketSigmas = 1e6;

inline uint32_t Key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & kSign) ? ~u : (u | kSign);
}

inline float FloatOf(uint32_t key) {
  const uint32_t bits = (key & kSign) ? (key ^ kSign) : ~key;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Whether key lies in [lo, lo + span]: one unsigned compare.
inline bool InRange(uint32_t key, uint32_t lo, uint32_t span) { return key - lo <= span; }

// Keys of -inf and +inf: smaller keys are negative NaNs, larger positive ones.
constexpr uint32_t kNegInfKey = 0x007FFFFFu;
// Keys of the largest denormal of each sign: all zeros and denormals lie
// between them.
constexpr uint32_t kNegTinyKey = 0x7F800000u, kPosTinyKey = 0x807FFFFFu;

// How float comparisons treat denormal inputs on the thread that runs the
// handler: as zero (XLA:CPU sets the DAZ flag while it runs), as themselves,
// or unknown (architectures whose flag this code does not read).
enum class Denormals { kZero, kExact, kUnknown };

Denormals DenormalMode() {
#ifdef GBN_X86
  return (_mm_getcsr() & 0x40) ? Denormals::kZero : Denormals::kExact;
#else
  return Denormals::kUnknown;
#endif
}

// The keys that a float comparison finds equal to the answer's value, a key
// range [lo, hi]: empty (lo > hi) for NaN; every zero and denormal when
// denormals are read as zero; -0.0 and +0.0 otherwise for a zero. `known` is
// false for a zero or denormal under an unknown mode.
struct EqualKeys {
  EqualKeys(uint32_t answer, Denormals mode) : lo(answer), hi(answer), known(true) {
    const float v = FloatOf(answer);
    if (v != v) {
      lo = 1;
      hi = 0;
    } else if (answer >= kNegTinyKey && answer <= kPosTinyKey) {
      if (mode == Denormals::kZero) {
        lo = kNegTinyKey;
        hi = kPosTinyKey;
      } else if (mode == Denormals::kExact && v == 0.0f) {
        lo = Key(-0.0f);
        hi = Key(0.0f);
      } else {
        known = mode == Denormals::kExact;
      }
    }
  }
  bool empty() const { return lo > hi; }
  bool within(uint32_t a, uint32_t b) const { return empty() || (a <= lo && hi <= b); }
  uint32_t lo, hi;
  bool known;
};

// Per column, #{x == q} and #{x <= q} as the float comparisons of the
// caller's JAX code count them (NaN is neither).
struct Counts {
  int64_t equal = 0, not_above = 0;
};

// Whether to run the AVX2 code: the CPU has it and GBN_KTH_SCALAR (which
// lets tests check the portable code on any machine) is unset or "0".
bool HasAvx2() {
#ifdef GBN_X86
  static const bool has = [] {
    const char* scalar = std::getenv("GBN_KTH_SCALAR");
    return __builtin_cpu_supports("avx2") && !(scalar && std::strcmp(scalar, "0") != 0);
  }();
  return has;
#else
  return false;
#endif
}

// ----------------------------------------------------------------------------
// Selection in a contiguous array of keys.

// Copies the keys in [lo, hi], in order, to out (room for n keys; it may
// not alias keys) and returns how many. Branch-free.
int64_t PackScalar(const uint32_t* keys, int64_t n, uint32_t lo, uint32_t hi, uint32_t* out) {
  const uint32_t span = hi - lo;
  int64_t inside = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = keys[i];
    out[inside] = key;
    inside += InRange(key, lo, span);
  }
  return inside;
}

#ifdef GBN_X86
// Per 8-bit lane mask, the lanes it selects in order (then padding): the
// permutation that packs them to the front of a vector.
struct CompressTable {
  alignas(32) uint32_t lanes[256][8];
  uint64_t lane_bytes[256];  // the same as eight bytes
  CompressTable() {
    for (int mask = 0; mask < 256; ++mask) {
      int n = 0;
      lane_bytes[mask] = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if (mask & (1 << lane)) {
          lanes[mask][n] = uint32_t(lane);
          lane_bytes[mask] |= uint64_t(lane) << (8 * n);
          ++n;
        }
      }
      for (; n < 8; ++n) lanes[mask][n] = 0;
    }
  }
};
const CompressTable kCompress;

// Unsigned a > b for eight lanes: a signed compare of sign-flipped values.
__attribute__((target("avx2"))) inline __m256i GreaterU32(__m256i a, __m256i b) {
  const __m256i sign = _mm256_set1_epi32(int32_t(kSign));
  return _mm256_cmpgt_epi32(_mm256_xor_si256(a, sign), _mm256_xor_si256(b, sign));
}

// Lanes whose key lies outside [lo, lo + span] (all ones there).
__attribute__((target("avx2"))) inline __m256i OutsideRange(__m256i key, __m256i lo, __m256i span) {
  return GreaterU32(_mm256_sub_epi32(key, lo), span);
}

// The sum of eight int32 lanes.
__attribute__((target("avx2"))) inline int64_t SumOf(__m256i counts) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256((__m256i*)lanes, counts);
  int64_t total = 0;
  for (int32_t count : lanes) total += count;
  return total;
}

// The order-preserving keys of eight floats.
__attribute__((target("avx2"))) inline __m256i KeysOf(__m256i bits) {
  const __m256i sign = _mm256_set1_epi32(int32_t(kSign));
  return _mm256_xor_si256(bits, _mm256_or_si256(_mm256_srai_epi32(bits, 31), sign));
}

__attribute__((target("avx2"))) int64_t PackAvx2(const uint32_t* keys, int64_t n, uint32_t lo,
                                                  uint32_t hi, uint32_t* out) {
  const __m256i lo_v = _mm256_set1_epi32(int32_t(lo));
  const __m256i span_v = _mm256_set1_epi32(int32_t(hi - lo));
  int64_t inside = 0, i = 0;
  // out[inside .. inside + 8) never passes keys[i + 8): inside <= i.
  for (; i + 8 <= n; i += 8) {
    const __m256i key = _mm256_loadu_si256((const __m256i*)(keys + i));
    const __m256i outside = OutsideRange(key, lo_v, span_v);
    const int mask = ~_mm256_movemask_ps(_mm256_castsi256_ps(outside)) & 0xFF;
    const __m256i perm = _mm256_load_si256((const __m256i*)kCompress.lanes[mask]);
    _mm256_storeu_si256((__m256i*)(out + inside), _mm256_permutevar8x32_epi32(key, perm));
    inside += __builtin_popcount(unsigned(mask));
  }
  return inside + PackScalar(keys + i, n - i, lo, hi, out + inside);
}
#endif

int64_t Pack(const uint32_t* keys, int64_t n, uint32_t lo, uint32_t hi, uint32_t* out) {
#ifdef GBN_X86
  if (HasAvx2()) return PackAvx2(keys, n, lo, hi, out);
#endif
  return PackScalar(keys, n, lo, hi, out);
}

// How many keys lie in [lo, hi] (none if lo > hi).
int64_t CountInScalar(const uint32_t* keys, int64_t n, uint32_t lo, uint32_t hi) {
  if (lo > hi) return 0;
  const uint32_t span = hi - lo;
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += InRange(keys[i], lo, span);
  return count;
}

#ifdef GBN_X86
__attribute__((target("avx2"))) int64_t CountInAvx2(const uint32_t* keys, int64_t n, uint32_t lo,
                                                    uint32_t hi) {
  if (lo > hi) return 0;
  const __m256i lo_v = _mm256_set1_epi32(int32_t(lo));
  const __m256i span_v = _mm256_set1_epi32(int32_t(hi - lo));
  __m256i outside = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i key = _mm256_loadu_si256((const __m256i*)(keys + i));
    outside = _mm256_sub_epi32(outside, OutsideRange(key, lo_v, span_v));
  }
  return i - SumOf(outside) + CountInScalar(keys + i, n - i, lo, hi);
}
#endif

int64_t CountIn(const uint32_t* keys, int64_t n, uint32_t lo, uint32_t hi) {
#ifdef GBN_X86
  if (HasAvx2()) return CountInAvx2(keys, n, lo, hi);
#endif
  return CountInScalar(keys, n, lo, hi);
}

// The keys equal to the answer among keys that hold all of them (not_above
// left at 0: only the sums entry point needs it, from Summarize).
Counts EqualCount(const uint32_t* keys, int64_t n, const EqualKeys& e) {
  Counts c;
  c.equal = CountIn(keys, n, e.lo, e.hi);  // none for a NaN answer (lo > hi)
  return c;
}

// Below this many keys, nth_element finishes a selection.
constexpr int64_t kSmallSelect = 64;
// Bits of the key offset each histogram round resolves.
constexpr int kDigitBits = 8;

// Smallest and largest of n >= 1 keys.
std::pair<uint32_t, uint32_t> MinMaxScalar(const uint32_t* keys, int64_t n) {
  uint32_t lo = keys[0], hi = keys[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, keys[i]);
    hi = std::max(hi, keys[i]);
  }
  return {lo, hi};
}

#ifdef GBN_X86
__attribute__((target("avx2"))) std::pair<uint32_t, uint32_t> MinMaxAvx2(const uint32_t* keys,
                                                                         int64_t n) {
  if (n < 8) return MinMaxScalar(keys, n);
  __m256i lo_v = _mm256_loadu_si256((const __m256i*)keys), hi_v = lo_v;
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    const __m256i key = _mm256_loadu_si256((const __m256i*)(keys + i));
    lo_v = _mm256_min_epu32(lo_v, key);
    hi_v = _mm256_max_epu32(hi_v, key);
  }
  alignas(32) uint32_t los[8], his[8];
  _mm256_store_si256((__m256i*)los, lo_v);
  _mm256_store_si256((__m256i*)his, hi_v);
  uint32_t lo = *std::min_element(los, los + 8), hi = *std::max_element(his, his + 8);
  if (i < n) {
    const auto rest = MinMaxScalar(keys + i, n - i);
    lo = std::min(lo, rest.first);
    hi = std::max(hi, rest.second);
  }
  return {lo, hi};
}
#endif

std::pair<uint32_t, uint32_t> MinMax(const uint32_t* keys, int64_t n) {
#ifdef GBN_X86
  if (HasAvx2()) return MinMaxAvx2(keys, n);
#endif
  return MinMaxScalar(keys, n);
}

// The k-th smallest (1-based, 1 <= k <= n) of keys[0, n), which it leaves
// alone; scratch_a and scratch_b have room for n keys each. Radix select on
// the offset from the smallest key: each round histograms the top kDigitBits
// bits of the offsets still in range, one branch-free pass packs the keys of
// the target's bin, and the range shrinks 2^kDigitBits-fold, so a handful of
// rounds at most (usually one or two) before nth_element finishes.
uint32_t SelectKth(const uint32_t* keys, int64_t n, int64_t k, uint32_t* scratch_a,
                   uint32_t* scratch_b) {
  uint32_t* buffers[2] = {scratch_a, scratch_b};
  const uint32_t* current = keys;
  int next = 0;
  auto [lo, hi] = MinMax(keys, n);  // every key in play lies in [lo, hi]
  uint32_t counts[1 << kDigitBits];
  while (n > kSmallSelect && lo != hi) {
    const int shift = std::max(0, 32 - __builtin_clz(hi - lo) - kDigitBits);
    std::memset(counts, 0, sizeof(counts));
    for (int64_t i = 0; i < n; ++i) counts[(current[i] - lo) >> shift]++;
    int64_t below = 0;
    uint32_t digit = 0;
    while (below + counts[digit] < k) below += counts[digit++];
    const uint32_t bin_lo = lo + (digit << shift);
    const uint32_t bin_hi = uint32_t(std::min<uint64_t>(hi, uint64_t(bin_lo) + ((uint64_t(1) << shift) - 1)));
    uint32_t* out = buffers[next];
    n = Pack(current, n, bin_lo, bin_hi, out);  // counts[digit] keys
    k -= below;
    lo = bin_lo;
    hi = bin_hi;
    current = out;
    next ^= 1;
  }
  if (lo == hi) return lo;
  uint32_t* work = buffers[next];
  std::copy(current, current + n, work);
  std::nth_element(work, work + (k - 1), work + n);
  return work[k - 1];
}

// ----------------------------------------------------------------------------
// Columns of the row-major (N, F) input.

// Column arrays written side by side are spaced this many keys apart: N
// rounded up to whole cache lines plus one, since a power-of-two spacing puts
// every column in the same cache set.
int64_t ColumnStride(int64_t N) { return (N + 15) / 16 * 16 + 16; }

// Keys of columns [c, c + width) into columns[j * stride + r].
void ColumnsScalar(const float* data, int64_t N, int64_t F, int64_t c, int64_t width,
                   int64_t stride, uint32_t* columns) {
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < width; ++j) columns[j * stride + r] = Key(data[r * F + c + j]);
}

#ifdef GBN_X86
// Keys of the eight columns [c, c + 8), transposed eight rows at a time.
__attribute__((target("avx2"))) void ColumnsAvx2(const float* data, int64_t N, int64_t F,
                                                 int64_t c, int64_t stride, uint32_t* columns) {
  int64_t r = 0;
  for (; r + 8 <= N; r += 8) {
    __m256 v[8];
    for (int i = 0; i < 8; ++i) {
      const __m256i bits = _mm256_loadu_si256((const __m256i*)(data + (r + i) * F + c));
      v[i] = _mm256_castsi256_ps(KeysOf(bits));
    }
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    const __m256 w[8] = {
        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps((float*)(columns + j * stride + r), w[j]);
  }
  for (; r < N; ++r)
    for (int64_t j = 0; j < 8; ++j) columns[j * stride + r] = Key(data[r * F + c + j]);
}
#endif

// Work items over columns: where the AVX2 code runs (and F >= 8), groups of
// eight columns [first, first + 8), of which lanes [skip, 8) are the item's:
// when 8 does not divide F the last group overlaps the one before rather
// than leave a few columns to slow scalar code. Otherwise single columns.
struct ColumnItems {
  ColumnItems(int64_t F, bool avx2) : F(F), grouped(avx2 && F >= 8) {}
  int64_t F;
  bool grouped;
  int count() const { return int(grouped ? (F + 7) / 8 : F); }
  int64_t first(int item) const { return grouped ? std::min<int64_t>(8 * item, F - 8) : item; }
  int64_t width() const { return grouped ? 8 : 1; }
  int64_t skip(int item) const { return grouped ? 8 * item - first(item) : 0; }
};

void Columns(const float* data, int64_t N, int64_t F, int64_t c, int64_t width, int64_t stride,
             uint32_t* columns) {
#ifdef GBN_X86
  if (width == 8 && HasAvx2()) return ColumnsAvx2(data, N, F, c, stride, columns);
#endif
  ColumnsScalar(data, N, F, c, width, stride, columns);
}

// ----------------------------------------------------------------------------
// Sums for the superquantile, taken in the same passes as the selection.

// The reference point of the excess of the keys beyond a bracket [lo, lo +
// width): the float of its top key. The target lies in the bracket, so
// x - top >= 0 for every key beyond it and top - q >= 0: sum_beyond (x - q) =
// sum_beyond (x - top) + (top - q) * #beyond adds non-negative terms only, and
// nothing cancels however far the bracket reaches (down to key 0 for a small
// k). 0 where top is infinite or NaN: the keys beyond are then NaN, or the
// answer is -inf (then top - q is +inf), and the excess NaN or +inf anyway.
inline float ExcessOffset(uint32_t lo_key, uint32_t width) {
  const float top = FloatOf(lo_key + (width - 1));
  return std::isfinite(top) ? top : 0.0f;
}

// Over keys that hold every key of a column equal to or above the answer
// (the whole column, or the keys of a bracket that holds the answer's equal
// keys): the sum of their floats, how many are NaN, the sum of (x - q) over
// those above the answer, and the answer's counts among them. Float sums
// within blocks of kSumBlock keys, double across; a block whose float sums
// are not finite (an overflow, or an inf or NaN among its keys) is summed
// again in doubles.
constexpr int64_t kSumBlock = 256;

struct Summary {
  double total = 0, excess = 0;
  int64_t nan = 0;
  Counts counts;
};

// The sums of a Summary alone, in doubles.
void AddSumsScalar(const uint32_t* keys, int64_t n, uint32_t answer, Summary& s) {
  const double q = FloatOf(answer);
  for (int64_t i = 0; i < n; ++i) {
    const double v = FloatOf(keys[i]);
    s.total += v;
    s.excess += keys[i] > answer ? v - q : 0.0;
  }
}

Summary SummarizeScalar(const uint32_t* keys, int64_t n, uint32_t answer, const EqualKeys& e) {
  const uint32_t span = e.hi - e.lo, not_above_span = e.hi - kNegInfKey;
  Summary s;
  AddSumsScalar(keys, n, answer, s);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = keys[i];
    s.nan += (key < kNegInfKey) || (key > ~kNegInfKey);  // NaN keys lie beyond +-inf
    if (!e.empty()) {
      s.counts.equal += InRange(key, e.lo, span);
      s.counts.not_above += InRange(key, kNegInfKey, not_above_span);
    }
  }
  return s;
}

#ifdef GBN_X86
// The floats behind eight keys (the inverse of KeysOf).
__attribute__((target("avx2"))) inline __m256 FloatsOf(__m256i key) {
  const __m256i flip = _mm256_or_si256(_mm256_andnot_si256(_mm256_srai_epi32(key, 31), _mm256_set1_epi32(-1)),
                                       _mm256_set1_epi32(int32_t(kSign)));
  return _mm256_castsi256_ps(_mm256_xor_si256(key, flip));
}

// sums[0, 8) += v, in doubles.
__attribute__((target("avx2"))) inline void AddToDoubles(__m256 v, double* sums) {
  const __m256d low = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  const __m256d high = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  _mm256_storeu_pd(sums, _mm256_add_pd(_mm256_loadu_pd(sums), low));
  _mm256_storeu_pd(sums + 4, _mm256_add_pd(_mm256_loadu_pd(sums + 4), high));
}

// A mask (bit per lane) of the lanes where a or b is infinite or NaN.
__attribute__((target("avx2"))) inline int NotFinite(__m256 a, __m256 b) {
  const __m256 zero_if_finite = _mm256_add_ps(_mm256_sub_ps(a, a), _mm256_sub_ps(b, b));
  return _mm256_movemask_ps(_mm256_cmp_ps(zero_if_finite, zero_if_finite, _CMP_UNORD_Q));
}

__attribute__((target("avx2"))) Summary SummarizeAvx2(const uint32_t* keys, int64_t n,
                                                      uint32_t answer, const EqualKeys& e) {
  const __m256i answer_v = _mm256_set1_epi32(int32_t(answer)), one = _mm256_set1_epi32(1);
  const __m256i equal_lo = _mm256_set1_epi32(int32_t(e.lo));
  const __m256i equal_span = _mm256_set1_epi32(int32_t(e.hi - e.lo));
  const __m256i neg_inf = _mm256_set1_epi32(int32_t(kNegInfKey));
  const __m256i not_above_span = _mm256_set1_epi32(int32_t(e.hi - kNegInfKey));
  const __m256 q = _mm256_set1_ps(FloatOf(answer));
  alignas(32) double totals[8] = {0}, excesses[8] = {0};
  Summary redone;  // the sums of blocks summed again in doubles
  __m256i nan = _mm256_setzero_si256(), equal = nan, not_above = nan;
  int64_t i = 0;
  while (i + 8 <= n) {
    const int64_t block_start = i, block_end = std::min(n - n % 8, i + kSumBlock);
    __m256 total = _mm256_setzero_ps(), excess = total;
    for (; i < block_end; i += 8) {
      const __m256i key = _mm256_loadu_si256((const __m256i*)(keys + i));
      const __m256 v = FloatsOf(key);
      total = _mm256_add_ps(total, v);
      const __m256 up = _mm256_castsi256_ps(GreaterU32(key, answer_v));
      excess = _mm256_add_ps(excess, _mm256_and_ps(up, _mm256_sub_ps(v, q)));
      nan = _mm256_sub_epi32(nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
      const __m256i off_equal = OutsideRange(key, equal_lo, equal_span);
      equal = _mm256_add_epi32(equal, _mm256_andnot_si256(off_equal, one));
      const __m256i off_not_above = OutsideRange(key, neg_inf, not_above_span);
      not_above = _mm256_add_epi32(not_above, _mm256_andnot_si256(off_not_above, one));
    }
    if (NotFinite(total, excess)) {
      AddSumsScalar(keys + block_start, block_end - block_start, answer, redone);
    } else {
      AddToDoubles(total, totals);
      AddToDoubles(excess, excesses);
    }
  }
  Summary s = SummarizeScalar(keys + i, n - i, answer, e);
  s.total += redone.total;
  s.excess += redone.excess;
  for (int lane = 0; lane < 8; ++lane) {
    s.total += totals[lane];
    s.excess += excesses[lane];
  }
  s.nan += SumOf(nan);
  if (!e.empty()) {
    s.counts.equal += SumOf(equal);
    s.counts.not_above += SumOf(not_above);
  }
  return s;
}
#endif

Summary Summarize(const uint32_t* keys, int64_t n, uint32_t answer, const EqualKeys& e) {
#ifdef GBN_X86
  if (HasAvx2()) return SummarizeAvx2(keys, n, answer, e);
#endif
  return SummarizeScalar(keys, n, answer, e);
}

// ----------------------------------------------------------------------------
// The sampled-bracket sweep over many rows.

// Row i of a sample of s rows out of n: one per stride at a jittered
// (golden-ratio) offset, so that it does not alias with periodic structure
// such as image rows.
inline int64_t SampleRow(int64_t i, int64_t s, int64_t n) {
  const double jitter = double(i) * kGolden - std::floor(double(i) * kGolden);
  return std::min(n - 1, int64_t((double(i) + jitter) * double(n) / double(s)));
}

// How many keys the sweep may gather per column: a bracket that holds more
// (it spans a large atom, e.g. a constant column at an extreme rank) stops
// gathering and its column is selected by histogram passes. Tasks add what
// they gathered to a shared total in batches (a few atomics per column, not
// one per block) and check a column's flag after each block, so a column
// overshoots its cap by at most a batch and a block per running task.
class GatherBudget {
 public:
  GatherBudget(int64_t F, int64_t cap, int64_t batch)
      : cap_(cap),
        batch_(batch),
        gathered_(new std::atomic<int64_t>[size_t(F)]()),
        stopped_(new std::atomic<uint8_t>[size_t(F)]()) {}

  // Whether column f has stopped gathering (in any task).
  bool Stopped(int64_t f) const { return stopped_[f].load(std::memory_order_relaxed) != 0; }

  // After a block: this task has gathered `gathered` keys of column f so far,
  // `reported` of them added to the shared total. Adds the rest once they
  // make a batch (or `last`); false once the column must stop gathering.
  bool Keep(int64_t f, int64_t gathered, int64_t& reported, bool last) {
    if (Stopped(f)) return false;
    const int64_t fresh = gathered - reported;
    if (fresh >= batch_ || (last && fresh > 0)) {
      reported = gathered;
      if (gathered_[f].fetch_add(fresh, std::memory_order_relaxed) + fresh > cap_) {
        stopped_[f].store(1, std::memory_order_relaxed);
        return false;
      }
    }
    return true;
  }

 private:
  const int64_t cap_, batch_;
  std::unique_ptr<std::atomic<int64_t>[]> gathered_;
  std::unique_ptr<std::atomic<uint8_t>[]> stopped_;
};

// One task's results of the sweep over rows [r0, r1).
struct Sweep {
  std::vector<int64_t> below;                // per column: #{key < lo}
  std::vector<int64_t> inside;               // per column: #{lo <= key < lo + width}
  std::vector<std::vector<uint32_t>> keys;   // per scalar-swept column: those keys
  // Per group of eight AVX2-swept columns, the keys inside (where gathered)
  // with their lane in the group, in row order.
  std::vector<std::vector<uint32_t>> group_keys;
  std::vector<std::vector<uint8_t>> group_lanes;
  std::vector<int64_t> group_size;
  // With sums, per column: sum of all floats; sum of (x - offset) (see
  // ExcessOffset) and count of the keys beyond the bracket; count of NaNs,
  // and of those with the sign bit (their keys lie below every number's).
  std::vector<double> total, beyond_excess;
  std::vector<int64_t> beyond, nan, neg_nan;
};

// Rows per block of the scalar sweep, between checks of the gather budget.
constexpr int64_t kScalarSweepBlock = 1024;
// Rows of the AVX2 sweep summed in floats before the sums go to doubles:
// short, so that a float sum's rounding stays well under a float's ulp.
constexpr int64_t kSweepSumRows = 32;

template <bool kSums>
void SweepScalar(const float* data, int64_t r0, int64_t r1, int64_t F, const uint32_t* lo,
                 const uint32_t* width, const float* offset, const uint8_t* gather,
                 GatherBudget& budget, Sweep& out) {
  std::vector<uint8_t> gathering(gather, gather + F);
  std::vector<int64_t> reported(F, 0);
  for (int64_t b0 = r0; b0 < r1; b0 += kScalarSweepBlock) {
    const int64_t b1 = std::min(r1, b0 + kScalarSweepBlock);
    for (int64_t r = b0; r < b1; ++r) {
      const float* row = data + r * F;
      for (int64_t f = 0; f < F; ++f) {
        const uint32_t key = Key(row[f]);
        const bool below = key < lo[f];
        out.below[f] += below;
        if (InRange(key, lo[f], width[f] - 1)) {
          out.inside[f]++;
          if (gathering[f]) out.keys[f].push_back(key);
        } else if (kSums && !below) {
          out.beyond[f]++;
          out.beyond_excess[f] += double(row[f]) - double(offset[f]);
        }
        if (kSums) {
          out.total[f] += row[f];
          out.nan[f] += row[f] != row[f];
          out.neg_nan[f] += key < kNegInfKey;
        }
      }
    }
    for (int64_t f = 0; f < F; ++f)
      if (gathering[f]) gathering[f] = budget.Keep(f, out.inside[f], reported[f], b1 == r1);
  }
}

#ifdef GBN_X86
// Every column, by the groups of `items` (grouped). Blocks of rows stay in
// cache while each group of eight columns sweeps them with its bounds and
// counters in registers; the keys inside are packed branch-free into the
// group's buffer with their lanes. Counters are per group slot (8 g + lane),
// so that overlapping groups do not count a column twice.
template <bool kSums>
__attribute__((target("avx2"))) void SweepAvx2(
    const float* data, int64_t r0, int64_t r1, int64_t F, const ColumnItems& items,
    const uint32_t* lo, const uint32_t* width, const float* offset, const uint8_t* gather,
    GatherBudget& budget, Sweep& out) {
  const int64_t groups = items.count();
  const int64_t block = std::max<int64_t>(8, 16384 / F);
  std::vector<uint32_t> n_below(8 * groups, 0), n_inside(8 * groups, 0);
  std::vector<uint32_t> n_beyond(8 * groups, 0), n_nan(8 * groups, 0), n_neg_nan(8 * groups, 0);
  std::vector<double> totals(8 * groups, 0.0), excesses(8 * groups, 0.0);
  std::vector<int64_t> reported(8 * groups, 0);
  // Per group, the lanes it gathers (its own lanes only, while in budget).
  std::vector<int> gathering(groups, 0);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t lane = items.skip(int(g)); lane < 8; ++lane)
      gathering[g] |= (gather[items.first(int(g)) + lane] ? 1 : 0) << lane;
  out.group_keys.resize(groups);
  out.group_lanes.resize(groups);
  out.group_size.assign(groups, 0);
  const __m256i one = _mm256_set1_epi32(1), neg_inf = _mm256_set1_epi32(int32_t(kNegInfKey));
  for (int64_t b0 = r0; b0 < r1; b0 += block) {
    const int64_t b1 = std::min(r1, b0 + block);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c = items.first(int(g)), slot = 8 * g;
      const __m256i lo_v = _mm256_loadu_si256((const __m256i*)(lo + c));
      // inside: key - lo < width, i.e. not (key - lo > width - 1)
      const __m256i last_v = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i*)(width + c)), one);
      __m256i below_acc = _mm256_loadu_si256((const __m256i*)(n_below.data() + slot));
      __m256i inside_acc = _mm256_loadu_si256((const __m256i*)(n_inside.data() + slot));
      __m256i beyond_acc = _mm256_loadu_si256((const __m256i*)(n_beyond.data() + slot));
      __m256i nan_acc = _mm256_loadu_si256((const __m256i*)(n_nan.data() + slot));
      __m256i neg_nan_acc = _mm256_loadu_si256((const __m256i*)(n_neg_nan.data() + slot));
      const __m256 offset_v = _mm256_loadu_ps(offset + c);
      const int gather_lanes = gathering[g];
      std::vector<uint32_t>& keys = out.group_keys[g];
      std::vector<uint8_t>& lanes = out.group_lanes[g];
      int64_t size = out.group_size[g];
      // Every row stores eight keys past the packed ones (only the hits count).
      const int64_t room = size + (gather_lanes ? 8 * (b1 - b0) : 8);
      if (int64_t(keys.size()) < room) {
        const size_t grown = size_t(std::max<int64_t>(2 * int64_t(keys.size()), room));
        keys.resize(grown);
        lanes.resize(grown + 8);
      }
      uint32_t* keys_out = keys.data();
      uint8_t* lanes_out = lanes.data();
      for (int64_t s0 = b0; s0 < b1; s0 += kSweepSumRows) {
        const int64_t s1 = std::min(b1, s0 + kSweepSumRows);
        // Sums over kSweepSumRows rows in floats, then added to doubles:
        // converting every element would cost more.
        __m256 total = _mm256_setzero_ps(), excess = _mm256_setzero_ps();
        for (int64_t r = s0; r < s1; ++r) {
          const __m256i bits = _mm256_loadu_si256((const __m256i*)(data + r * F + c));
          const __m256i key = KeysOf(bits);
          const __m256i below = GreaterU32(lo_v, key);
          below_acc = _mm256_sub_epi32(below_acc, below);
          const __m256i outside = OutsideRange(key, lo_v, last_v);
          const int in = ~_mm256_movemask_ps(_mm256_castsi256_ps(outside)) & 0xFF;
          inside_acc = _mm256_add_epi32(inside_acc, _mm256_andnot_si256(outside, one));
          const int hits = in & gather_lanes;
          const __m256i perm = _mm256_load_si256((const __m256i*)kCompress.lanes[hits]);
          _mm256_storeu_si256((__m256i*)(keys_out + size), _mm256_permutevar8x32_epi32(key, perm));
          std::memcpy(lanes_out + size, &kCompress.lane_bytes[hits], 8);
          size += __builtin_popcount(unsigned(hits));
          if (kSums) {
            const __m256 v = _mm256_castsi256_ps(bits);
            const __m256i beyond = _mm256_andnot_si256(below, outside);
            beyond_acc = _mm256_sub_epi32(beyond_acc, beyond);
            nan_acc = _mm256_sub_epi32(nan_acc, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
            neg_nan_acc = _mm256_sub_epi32(neg_nan_acc, GreaterU32(neg_inf, key));
            total = _mm256_add_ps(total, v);
            excess = _mm256_add_ps(excess, _mm256_and_ps(_mm256_castsi256_ps(beyond), _mm256_sub_ps(v, offset_v)));
          }
        }
        if (!kSums) continue;
        const int redo = NotFinite(total, excess);
        if (!redo) {
          AddToDoubles(total, totals.data() + slot);
          AddToDoubles(excess, excesses.data() + slot);
          continue;
        }
        // A float sum that overflowed (or met an inf or NaN): those lanes
        // are summed again in doubles.
        alignas(32) float part_totals[8], part_excesses[8];
        _mm256_store_ps(part_totals, total);
        _mm256_store_ps(part_excesses, excess);
        for (int64_t lane = 0; lane < 8; ++lane) {
          if (!(redo & (1 << lane))) {
            totals[slot + lane] += part_totals[lane];
            excesses[slot + lane] += part_excesses[lane];
            continue;
          }
          const int64_t f = c + lane;
          const double reference = offset[f];
          double lane_total = 0, lane_excess = 0;
          for (int64_t r = s0; r < s1; ++r) {
            const float v = data[r * F + f];
            const uint32_t key = Key(v);
            lane_total += v;
            if (key >= lo[f] && !InRange(key, lo[f], width[f] - 1)) lane_excess += double(v) - reference;
          }
          totals[slot + lane] += lane_total;
          excesses[slot + lane] += lane_excess;
        }
      }
      out.group_size[g] = size;
      _mm256_storeu_si256((__m256i*)(n_below.data() + slot), below_acc);
      _mm256_storeu_si256((__m256i*)(n_inside.data() + slot), inside_acc);
      if (kSums) {
        _mm256_storeu_si256((__m256i*)(n_beyond.data() + slot), beyond_acc);
        _mm256_storeu_si256((__m256i*)(n_nan.data() + slot), nan_acc);
        _mm256_storeu_si256((__m256i*)(n_neg_nan.data() + slot), neg_nan_acc);
      }
      if (gather_lanes) {
        int still = gather_lanes;
        for (int64_t lane = 0; lane < 8; ++lane)
          if ((gather_lanes & (1 << lane)) &&
              !budget.Keep(c + lane, n_inside[slot + lane], reported[slot + lane], b1 == r1))
            still &= ~(1 << lane);
        gathering[g] = still;
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t lane = items.skip(int(g)); lane < 8; ++lane) {
      const int64_t f = items.first(int(g)) + lane, slot = 8 * g + lane;
      out.below[f] += n_below[slot];
      out.inside[f] += n_inside[slot];
      if (kSums) {
        out.beyond[f] += n_beyond[slot];
        out.nan[f] += n_nan[slot];
        out.neg_nan[f] += n_neg_nan[slot];
        out.total[f] += totals[slot];
        out.beyond_excess[f] += excesses[slot];
      }
    }
}
#endif

// Where SelectKeys writes, per column. The sums are optional (null).
struct Outputs {
  int32_t* key;                  // signed key of the answer
  int32_t* ties;                 // #{x == answer} as the caller's floats compare, or -1
  int32_t* path;                 // a Path
  float* mean = nullptr;         // E[x]
  float* mean_excess = nullptr;  // E[(x - answer)^+], NaN if any x is NaN
  int32_t* above = nullptr;      // #{not x <= answer} as the caller's floats compare, or -1
};

// The counts of the answer's column (-1: the denormal mode is unknown and the
// answer is a zero or denormal), and with sums the mean and excess.
void WriteCounts(const Outputs& o, int64_t f, int64_t N, const EqualKeys& e, const Counts& c) {
  o.ties[f] = e.known ? int32_t(c.equal) : -1;
  if (o.above) o.above[f] = e.known ? int32_t(N - c.not_above) : -1;
}

// A double as a float, +-inf beyond float's range (a plain conversion of an
// out-of-range value is undefined behaviour).
inline float ToFloat(double v) {
  constexpr double kMax = std::numeric_limits<float>::max();
  if (v > kMax) return std::numeric_limits<float>::infinity();
  if (v < -kMax) return -std::numeric_limits<float>::infinity();
  return float(v);
}

void WriteSums(const Outputs& o, int64_t f, int64_t N, double total, double excess, int64_t nan) {
  o.mean[f] = ToFloat(total / double(N));
  o.mean_excess[f] = nan > 0 ? std::numeric_limits<float>::quiet_NaN() : ToFloat(excess / double(N));
}

// ----------------------------------------------------------------------------
// Passes over one column of the input itself, in memory that does not grow
// with N: for columns whose keys are not gathered.

// Rows per task of a pass over one column.
constexpr int64_t kColumnTaskRows = 1 << 18;
// Bits of the key each histogram pass resolves: two passes settle any key.
constexpr int kColumnDigitBits = 16;
// A histogram bin with at most this many keys is gathered and selected.
constexpr int64_t kColumnGatherKeys = 1 << 20;

template <class Pool>
int ColumnTasks(Pool& pool, int64_t N) {
  return int(std::clamp<int64_t>(N / kColumnTaskRows, 1, pool.num_threads() + 1));
}

// The rank-th smallest (1-based) of the keys of column f that lie in [lo,
// hi], of which there are at least rank. Each pass histograms the next 16
// bits of the keys still in range (two settle any key) unless the target's
// bin holds few enough keys to gather and select.
template <class Pool>
uint32_t SelectInColumn(Pool& pool, const float* data, int64_t N, int64_t F, int64_t f,
                        uint32_t lo, uint32_t hi, int64_t rank) {
  const int n_tasks = ColumnTasks(pool, N);
  auto rows = [&](int t) { return std::make_pair(N * t / n_tasks, N * (t + 1) / n_tasks); };
  while (lo != hi) {
    const uint32_t span = hi - lo;
    const int shift = std::max(0, 32 - __builtin_clz(span) - kColumnDigitBits);
    const int64_t bins = int64_t(span >> shift) + 1;
    std::vector<uint32_t> counts(size_t(n_tasks * bins), 0);  // per task and bin
    ParallelFor(pool, n_tasks, [&](int t) {
      uint32_t* hist = counts.data() + t * bins;
      for (auto [r, r1] = rows(t); r < r1; ++r) {
        const uint32_t key = Key(data[r * F + f]);
        if (InRange(key, lo, span)) hist[(key - lo) >> shift]++;
      }
    });
    int64_t digit = 0, in_bin = 0;
    for (;; ++digit) {
      in_bin = 0;
      for (int t = 0; t < n_tasks; ++t) in_bin += counts[t * bins + digit];
      if (in_bin >= rank || digit + 1 == bins) break;
      rank -= in_bin;
    }
    const uint32_t bin_lo = lo + (uint32_t(digit) << shift);
    hi = uint32_t(std::min<uint64_t>(hi, uint64_t(bin_lo) + ((uint64_t(1) << shift) - 1)));
    lo = bin_lo;
    if (lo == hi || in_bin > kColumnGatherKeys) continue;
    // Few enough keys: each task packs its own into its share of one array.
    std::vector<int64_t> start(n_tasks + 1, 0);
    for (int t = 0; t < n_tasks; ++t) start[t + 1] = start[t] + counts[t * bins + digit];
    std::vector<uint32_t> keys(static_cast<size_t>(in_bin)), scratch(static_cast<size_t>(2 * in_bin));
    ParallelFor(pool, n_tasks, [&](int t) {
      uint32_t* out = keys.data() + start[t];
      for (auto [r, r1] = rows(t); r < r1; ++r) {
        const uint32_t key = Key(data[r * F + f]);
        if (InRange(key, lo, hi - lo)) *out++ = key;
      }
    });
    return SelectKth(keys.data(), in_bin, rank, scratch.data(), scratch.data() + in_bin);
  }
  return lo;
}

// A Summary of column f of the input (its counts only unless `sums`).
template <class Pool>
Summary SummarizeColumn(Pool& pool, const float* data, int64_t N, int64_t F, int64_t f,
                        uint32_t answer, const EqualKeys& e, bool sums) {
  const int n_tasks = ColumnTasks(pool, N);
  std::vector<Summary> parts(n_tasks);
  const uint32_t span = e.hi - e.lo, not_above_span = e.hi - kNegInfKey;
  const double q = FloatOf(answer);
  ParallelFor(pool, n_tasks, [&](int t) {
    Summary s;
    for (int64_t r = N * t / n_tasks, r1 = N * (t + 1) / n_tasks; r < r1; ++r) {
      const float x = data[r * F + f];
      const uint32_t key = Key(x);
      if (sums) {
        const double v = x;
        s.total += v;
        s.excess += key > answer ? v - q : 0.0;
        s.nan += x != x;
      }
      if (!e.empty()) {
        s.counts.equal += InRange(key, e.lo, span);
        s.counts.not_above += InRange(key, kNegInfKey, not_above_span);
      }
    }
    parts[t] = s;
  });
  Summary total;
  for (const Summary& s : parts) {
    total.total += s.total;
    total.excess += s.excess;
    total.nan += s.nan;
    total.counts.equal += s.counts.equal;
    total.counts.not_above += s.counts.not_above;
  }
  return total;
}

// The selection proper, for any pool with num_threads() and Schedule(task).
template <class Pool>
void SelectKeys(Pool& pool, const float* data, int64_t N, int64_t F, const int32_t* k_in,
                double bracket_sigmas, const Outputs& o) {
  if (F == 0) return;
  const bool sums = o.mean != nullptr;
  if (N == 0) {  // no answer exists; the caller turns k > n into NaN
    std::fill(o.key, o.key + F, 0);
    std::fill(o.ties, o.ties + F, 0);
    std::fill(o.path, o.path + F, kWholeColumn);
    if (sums) {
      std::fill(o.mean, o.mean + F, std::numeric_limits<float>::quiet_NaN());
      std::fill(o.mean_excess, o.mean_excess + F, std::numeric_limits<float>::quiet_NaN());
      std::fill(o.above, o.above + F, 0);
    }
    return;
  }
  const Denormals mode = DenormalMode();
  std::vector<int64_t> k(F);
  for (int64_t f = 0; f < F; ++f) k[f] = std::clamp<int64_t>(k_in[f], 1, N);
  const ColumnItems items(F, HasAvx2());

  if (N <= kDirectRows) {
    ParallelFor(pool, items.count(), [&](int item) {
      const int64_t c = items.first(item), width = items.width();
      const int64_t stride = ColumnStride(N);
      std::vector<uint32_t> columns(size_t(width * stride)), scratch(size_t(2 * N));
      Columns(data, N, F, c, width, stride, columns.data());
      for (int64_t j = items.skip(item); j < width; ++j) {
        const uint32_t* column = columns.data() + j * stride;
        const uint32_t answer = SelectKth(column, N, k[c + j], scratch.data(), scratch.data() + N);
        const EqualKeys equal(answer, mode);
        o.key[c + j] = int32_t(answer ^ kSign);
        o.path[c + j] = kWholeColumn;
        if (sums) {
          const Summary summary = Summarize(column, N, answer, equal);
          WriteCounts(o, c + j, N, equal, summary.counts);
          WriteSums(o, c + j, N, summary.total, summary.excess, summary.nan);
        } else {
          WriteCounts(o, c + j, N, equal, EqualCount(column, N, equal));
        }
      }
    });
    return;
  }
  // Bracket [lo, lo + width) per column from a sample of M rows (jittered
  // strides), +-bracket_sigmas binomial standard deviations around the target.
  const int64_t M = std::clamp(N / kSampleFraction, kMinSample, kMaxSample);
  const int64_t sample_stride = ColumnStride(M);
  std::vector<uint32_t> samples(size_t(F * sample_stride));
  const int sample_tasks = int(std::clamp<int64_t>(M * F / kElementsPerSampleTask, 1, 64));
  ParallelFor(pool, sample_tasks, [&](int t) {
    const int64_t i0 = M * t / sample_tasks, i1 = M * (t + 1) / sample_tasks;
    for (int64_t i = i0; i < i1; ++i) {
      // Scattered rows: fetch a few ahead, or each waits on memory in turn.
      if (i + 8 < i1) {
        const char* ahead = (const char*)(data + SampleRow(i + 8, M, N) * F);
        for (int64_t byte = 0; byte < F * 4; byte += 64) __builtin_prefetch(ahead + byte);
      }
      const float* row = data + SampleRow(i, M, N) * F;
      for (int64_t f = 0; f < F; ++f) samples[f * sample_stride + i] = Key(row[f]);
    }
  });
  std::vector<uint32_t> lo(F), width(F);
  std::vector<float> offset(F);
  std::vector<uint8_t> gather(F);
  ParallelFor(pool, int(F), [&](int f) {
    const uint32_t* sample = samples.data() + f * sample_stride;
    std::vector<uint32_t> scratch(size_t(2 * M));
    const double p = (double(k[f]) - 0.5) / double(N), centre = p * double(M);
    const double half = bracket_sigmas * std::sqrt(double(M) * p * (1.0 - p)) + 2.0;
    // Clamped before the conversions (which a huge half would overflow).
    const int64_t a = int64_t(std::floor(std::max(centre - half, -1.0)));
    const int64_t b = int64_t(std::ceil(std::min(centre + half, double(M))));
    uint32_t low = 0, high = 0xFFFFFFFFu, top = 0xFFFFFFFFu;
    if (a >= 0) low = SelectKth(sample, M, a + 1, scratch.data(), scratch.data() + M);
    if (b < M) {
      top = SelectKth(sample, M, b + 1, scratch.data(), scratch.data() + M);
      // The top sample value itself falls inside: with repeated values (an
      // atom such as ReLU's zeros) the target is often that very value.
      high = top == 0xFFFFFFFFu ? top : top + 1;
    }
    // One value across the bracket (an atom): [v, v + 1) holds just that key.
    bool single = high <= low || high - low == 1;
    // A bracket open at one end (a target rank near it) that the sample
    // fills with one value, an atom at the column's end (a constant column,
    // ReLU's zeros at a small alpha), would gather that whole atom: it is
    // that value alone. Should the target lie beyond it after all, the
    // bracket misses and the column is selected whole.
    if (!single && (a < 0) != (b >= M)) {
      const auto [smallest, largest] = MinMax(sample, M);
      if (a < 0 && smallest == top) {
        low = smallest;
        single = true;
      } else if (b >= M && largest == low) {
        single = true;
      }
    }
    width[f] = single ? 1 : high - low;
    lo[f] = low;
    offset[f] = ExcessOffset(low, width[f]);
    gather[f] = !single;
  });

  // The sweep gathers at most an eighth of a column's keys (more would take
  // several times that memory in buffers and selection scratch).
  const int64_t threads = pool.num_threads() + 1;
  GatherBudget budget(F, N / 8, std::max<int64_t>(256, N / (32 * threads)));
  const int n_tasks = int(std::clamp<int64_t>(N * F / kElementsPerTask, 1, 256));
  std::vector<Sweep> sweeps(n_tasks);
  ParallelFor(pool, n_tasks, [&](int t) {
    const int64_t r0 = N * t / n_tasks, r1 = N * (t + 1) / n_tasks;
    Sweep& s = sweeps[t];
    s.below.assign(F, 0);
    s.inside.assign(F, 0);
    s.keys.resize(F);
    if (sums) {
      s.total.assign(F, 0.0);
      s.beyond_excess.assign(F, 0.0);
      s.beyond.assign(F, 0);
      s.nan.assign(F, 0);
      s.neg_nan.assign(F, 0);
    }
#ifdef GBN_X86
    if (items.grouped) {
      if (sums)
        SweepAvx2<true>(data, r0, r1, F, items, lo.data(), width.data(), offset.data(),
                        gather.data(), budget, s);
      else
        SweepAvx2<false>(data, r0, r1, F, items, lo.data(), width.data(), offset.data(),
                         gather.data(), budget, s);
      return;
    }
#endif
    for (int64_t f = 0; f < F; ++f)
      if (gather[f]) s.keys[f].reserve(size_t((r1 - r0) / 16 + 16));
    if (sums)
      SweepScalar<true>(data, r0, r1, F, lo.data(), width.data(), offset.data(), gather.data(),
                        budget, s);
    else
      SweepScalar<false>(data, r0, r1, F, lo.data(), width.data(), offset.data(), gather.data(),
                         budget, s);
  });

  // A missed bracket's column is gathered whole (4 bytes a row, 8 more of
  // selection scratch) where that, for as many columns as run at once, stays
  // within the input's size (always with AVX2 groups: one column of eight at
  // a time); otherwise (few columns) it is selected by histogram passes.
  const bool gather_missed = 3 * std::min<int64_t>(items.count(), threads) <= F;
  ParallelFor(pool, items.count(), [&](int item) {
    const int64_t c = items.first(item), n_columns = items.width();
    std::vector<int64_t> below(n_columns, 0), inside(n_columns, 0);
    for (const Sweep& s : sweeps)
      for (int64_t j = 0; j < n_columns; ++j) {
        below[j] += s.below[c + j];
        inside[j] += s.inside[c + j];
      }
    // The gathered keys of each column, unpacked from the group buffers
    // (none of a column that ran out of budget).
    uint8_t take[8] = {0};
    std::vector<std::vector<uint32_t>> keys(n_columns);
    for (int64_t j = items.skip(item); j < n_columns; ++j) {
      take[j] = gather[c + j] && !budget.Stopped(c + j);
      if (take[j]) keys[j].reserve(size_t(inside[j]));
    }
    for (const Sweep& s : sweeps) {
      if (items.grouped) {
        const uint32_t* group_keys = s.group_keys[item].data();
        const uint8_t* lanes = s.group_lanes[item].data();
        for (int64_t i = 0; i < s.group_size[item]; ++i)
          if (take[lanes[i]]) keys[lanes[i]].push_back(group_keys[i]);
      } else if (take[0]) {
        keys[0].insert(keys[0].end(), s.keys[c].begin(), s.keys[c].end());
      }
    }
    std::vector<uint32_t> scratch;
    for (int64_t j = items.skip(item); j < n_columns; ++j) {
      const int64_t f = c + j, rank = k[f] - below[j];
      const bool hit = rank >= 1 && rank <= inside[j];
      if (!hit && gather_missed) {  // select over the whole column, gathered
        std::vector<uint32_t> column(N);
        Columns(data, N, F, f, 1, N, column.data());
        scratch.resize(2 * N);
        const uint32_t answer = SelectKth(column.data(), N, k[f], scratch.data(), scratch.data() + N);
        const EqualKeys equal(answer, mode);
        o.key[f] = int32_t(answer ^ kSign);
        o.path[f] = kMissedBracket;
        if (sums) {
          const Summary summary = Summarize(column.data(), N, answer, equal);
          WriteCounts(o, f, N, equal, summary.counts);
          WriteSums(o, f, N, summary.total, summary.excess, summary.nan);
        } else {
          WriteCounts(o, f, N, equal, EqualCount(column.data(), N, equal));
        }
        continue;
      }
      if (!hit || (gather[f] && !take[j])) {  // by passes over the column
        const uint32_t answer =
            hit ? SelectInColumn(pool, data, N, F, f, lo[f], lo[f] + (width[f] - 1), rank)
                : SelectInColumn(pool, data, N, F, f, 0, 0xFFFFFFFFu, k[f]);
        const EqualKeys equal(answer, mode);
        o.key[f] = int32_t(answer ^ kSign);
        o.path[f] = hit ? kHistogram : kMissedBracket;
        const Summary summary = SummarizeColumn(pool, data, N, F, f, answer, equal, sums);
        WriteCounts(o, f, N, equal, summary.counts);
        if (sums) WriteSums(o, f, N, summary.total, summary.excess, summary.nan);
        continue;
      }
      // Every copy of the answer lies inside the bracket: a single key where
      // the bracket holds just one, else among the gathered keys.
      const std::vector<uint32_t>& column = keys[j];
      uint32_t answer;
      if (gather[f]) {
        scratch.resize(2 * column.size());
        answer = SelectKth(column.data(), int64_t(column.size()), rank, scratch.data(),
                           scratch.data() + column.size());
      } else {
        answer = lo[f];
      }
      const EqualKeys equal(answer, mode);
      o.key[f] = int32_t(answer ^ kSign);
      o.path[f] = gather[f] ? kGathered : kSingleKey;
      int64_t beyond = 0, nan = 0, neg_nan = 0;
      double total = 0, beyond_excess = 0;
      if (sums)
        for (const Sweep& s : sweeps) {
          total += s.total[f];
          beyond_excess += s.beyond_excess[f];
          beyond += s.beyond[f];
          nan += s.nan[f];
          neg_nan += s.neg_nan[f];
        }
      // Keys below the bracket are below every equal key and keys beyond it
      // above, unless the equal keys reach outside it (zeros and denormals
      // read as zero): then count over the column.
      const bool equal_inside = equal.within(lo[f], lo[f] + (width[f] - 1));
      Summary gathered;  // over the keys inside the bracket
      if (gather[f] && sums) {
        gathered = Summarize(column.data(), int64_t(column.size()), answer, equal);
      } else if (gather[f] && equal_inside) {
        gathered.counts = EqualCount(column.data(), int64_t(column.size()), equal);
      } else if (!gather[f] && !equal.empty()) {
        gathered.counts = Counts{inside[j], inside[j]};  // every one is the answer
      }
      Counts counts;
      if (!equal_inside) {
        counts = SummarizeColumn(pool, data, N, F, f, answer, equal, false).counts;
      } else if (!equal.empty()) {
        counts = gathered.counts;
        // The keys below the bracket are at most the answer, bar negative
        // NaNs: all of them where the bracket starts at -inf or above, and
        // only such where it starts among them (then they are all below).
        if (lo[f] >= kNegInfKey) counts.not_above += below[j] - neg_nan;
      }
      WriteCounts(o, f, N, equal, counts);
      if (sums) {
        // Keys beyond the bracket are above the answer: their sum of (x - q)
        // is their sum of (x - offset) plus (offset - q) >= 0 each (no term
        // where there are none: an infinite difference times zero is NaN).
        double excess = gathered.excess;
        if (beyond > 0)
          excess += beyond_excess + (double(offset[f]) - double(FloatOf(answer))) * double(beyond);
        WriteSums(o, f, N, total, excess, nan);
      }
    }
  });
}

template <bool kSums>
ffi::Error KthSmallest(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::S32> k_buffer, double bracket_sigmas,
                       ffi::ResultBuffer<ffi::S32> result, ffi::ResultBuffer<ffi::S32> ties,
                       ffi::ResultBuffer<ffi::S32> path, ffi::ResultBuffer<ffi::F32> mean,
                       ffi::ResultBuffer<ffi::F32> mean_excess,
                       ffi::ResultBuffer<ffi::S32> above) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must have shape (N, F)");
  const int64_t N = dims[0], F = dims[1];
  const size_t n_results = kSums ? F : 0;
  if (k_buffer.element_count() != size_t(F) || result->element_count() != size_t(F) ||
      ties->element_count() != size_t(F) || path->element_count() != size_t(F) ||
      mean->element_count() != n_results || mean_excess->element_count() != n_results ||
      above->element_count() != n_results)
    return ffi::Error::InvalidArgument("k and the results must have shape (F,)");
  if (!(bracket_sigmas >= 0.0 && bracket_sigmas <= kMaxBracketSigmas))
    return ffi::Error::InvalidArgument("bracket_sigmas must lie in [0, 1e6]");
  if (N > kMaxRows)
    return ffi::Error::InvalidArgument("x may have at most 2**31 - 1 rows (int32 counts)");
  Outputs o{result->typed_data(), ties->typed_data(), path->typed_data()};
  if (kSums) {
    o.mean = mean->typed_data();
    o.mean_excess = mean_excess->typed_data();
    o.above = above->typed_data();
  }
  // Every task has finished when SelectKeys returns or throws (ParallelFor
  // waits for them), so an exception leaves nothing running.
  const char* failure;
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  std::string detail;
  try {
    SelectKeys(pool, x.typed_data(), N, F, k_buffer.typed_data(), bracket_sigmas, o);
    return ffi::Error::Success();
  } catch (const std::bad_alloc&) {
    code = ffi::ErrorCode::kResourceExhausted;
    failure = "gbn_jax k-th smallest kernel: out of memory";
  } catch (const std::exception& e) {
    failure = "gbn_jax k-th smallest kernel failed";
    try {
      detail = e.what();
    } catch (...) {
    }
  } catch (...) {
    failure = "gbn_jax k-th smallest kernel failed";
  }
  try {
    return ffi::Error(code, detail.empty() ? std::string(failure) : std::string(failure) + ": " + detail);
  } catch (...) {
    return ffi::Error(code, std::string());
  }
}

}  // namespace

#define GBN_BIND_KTH_SMALLEST                        \
  ffi::Ffi::Bind()                                   \
      .Ctx<ffi::ThreadPool>()                        \
      .Arg<ffi::Buffer<ffi::F32>>()                  \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Attr<double>("bracket_sigmas")                \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::F32>>()                  \
      .Ret<ffi::Buffer<ffi::F32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()

// Outputs: key, ties, path, and three empty (0,) buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(GbnKthSmallestF32, KthSmallest<false>, GBN_BIND_KTH_SMALLEST);
// Outputs: key, ties, path, mean, mean_excess, above (all (F,)).
XLA_FFI_DEFINE_HANDLER_SYMBOL(GbnKthSmallestSumsF32, KthSmallest<true>, GBN_BIND_KTH_SMALLEST);

// 1 where the tie and above counts are never -1 (this code reads the CPU's
// denormal mode), so that gbn_jax._native can drop JAX's fallback counting.
extern "C" int GbnKthCountsAlwaysKnown() {
#ifdef GBN_X86
  return 1;
#else
  return 0;
#endif
}
