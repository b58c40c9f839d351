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
// (rare) is selected whole. Work is spread over XLA's intra-op thread pool.
//
// Inputs: x (N, F) float32, k (F,) int32 (1-based, clamped to [1, N]).
// Outputs: (F,) int32, the signed key (unsigned key ^ 0x80000000) of the
// answer, which is what gbn_jax._select works with; (F,) int32, how many
// elements equal the answer as float comparisons in the caller's code see it
// (denormals read as zero where the CPU's DAZ flag is set, as XLA:CPU sets
// it; -1 for a zero or denormal answer where this code cannot read the flag);
// (F,) int32, the path each column took (a Path), for tests and diagnostics.
// The sums entry point adds, per column, E[x], E[(x - answer)^+] and
// #{not x <= answer} (as the ties). Sums are float32 within blocks of rows
// and float64 across.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GBN_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

enum Path : int32_t { kWholeColumn = 0, kSingleKey = 1, kGathered = 2, kMissedBracket = 3 };

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

// Runs fn(i) for i in [0, n_items) on the caller and the pool's threads.
// Items are claimed from a shared counter and the caller waits only for items
// already started, so it cannot deadlock on a busy pool; a pool task that
// starts after the handler returned finds no items left and touches nothing
// but the shared counters.
struct WorkCounters {
  explicit WorkCounters(int n) : total(n) {}
  const int total;
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  std::mutex mutex;
  std::condition_variable finished;
};

template <class Pool, class Fn>
void ParallelFor(Pool& pool, int n_items, const Fn& fn) {
  if (n_items <= 0) return;
  const int helpers = int(std::min<int64_t>(n_items - 1, pool.num_threads()));
  if (helpers <= 0) {
    for (int i = 0; i < n_items; ++i) fn(i);
    return;
  }
  auto counters = std::make_shared<WorkCounters>(n_items);
  auto work = [counters, fn_ptr = &fn]() {
    for (int i; (i = counters->next.fetch_add(1)) < counters->total;) {
      (*fn_ptr)(i);
      if (counters->done.fetch_add(1) + 1 == counters->total) {
        std::lock_guard<std::mutex> lock(counters->mutex);
        counters->finished.notify_all();
      }
    }
  };
  for (int h = 0; h < helpers; ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  std::unique_lock<std::mutex> lock(counters->mutex);
  counters->finished.wait(lock, [&] { return counters->done.load() == counters->total; });
}

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

// A finite reference point near a bracket's low key, for sums of x - lo that
// do not cancel: lo's float, or 0 where that is infinite or NaN.
inline double Offset(uint32_t lo_key) {
  const float v = FloatOf(lo_key);
  return std::isfinite(v) ? double(v) : 0.0;
}

// Over keys that hold every key of a column equal to or above the answer
// (the whole column, or the keys of a bracket that holds the answer's equal
// keys): the sum of their floats, how many are NaN, the sum of (x - q) over
// those above the answer, and the answer's counts among them. Float sums
// within blocks of kSumBlock keys, double across.
constexpr int64_t kSumBlock = 2048;

struct Summary {
  double total = 0, excess = 0;
  int64_t nan = 0;
  Counts counts;
};

Summary SummarizeScalar(const uint32_t* keys, int64_t n, uint32_t answer, const EqualKeys& e) {
  const double q = FloatOf(answer);
  const uint32_t span = e.hi - e.lo, not_above_span = e.hi - kNegInfKey;
  Summary s;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = keys[i];
    const double v = FloatOf(key);
    s.total += v;
    s.excess += key > answer ? v - q : 0.0;
    s.nan += v != v;
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

__attribute__((target("avx2"))) Summary SummarizeAvx2(const uint32_t* keys, int64_t n,
                                                      uint32_t answer, const EqualKeys& e) {
  const __m256i answer_v = _mm256_set1_epi32(int32_t(answer)), one = _mm256_set1_epi32(1);
  const __m256i equal_lo = _mm256_set1_epi32(int32_t(e.lo));
  const __m256i equal_span = _mm256_set1_epi32(int32_t(e.hi - e.lo));
  const __m256i neg_inf = _mm256_set1_epi32(int32_t(kNegInfKey));
  const __m256i not_above_span = _mm256_set1_epi32(int32_t(e.hi - kNegInfKey));
  const __m256 q = _mm256_set1_ps(FloatOf(answer));
  alignas(32) double totals[8] = {0}, excesses[8] = {0};
  __m256i nan = _mm256_setzero_si256(), equal = nan, not_above = nan;
  int64_t i = 0;
  while (i + 8 <= n) {
    const int64_t block_end = std::min(n - n % 8, i + kSumBlock);
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
    AddToDoubles(total, totals);
    AddToDoubles(excess, excesses);
  }
  Summary s = SummarizeScalar(keys + i, n - i, answer, e);
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
  // With sums, per column: sum of all floats; sum of (x - Offset(lo)) and
  // count of the keys beyond the bracket; count of NaNs, and of those with
  // the sign bit (their keys lie below every number's).
  std::vector<double> total, beyond_excess;
  std::vector<int64_t> beyond, nan, neg_nan;
};

template <bool kSums>
void SweepScalar(const float* data, int64_t r0, int64_t r1, int64_t F,
                 const uint32_t* lo, const uint32_t* width, const uint8_t* gather,
                 Sweep& out) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = data + r * F;
    for (int64_t f = 0; f < F; ++f) {
      const uint32_t key = Key(row[f]);
      const bool below = key < lo[f];
      out.below[f] += below;
      if (InRange(key, lo[f], width[f] - 1)) {
        out.inside[f]++;
        if (gather[f]) out.keys[f].push_back(key);
      } else if (kSums && !below) {
        out.beyond[f]++;
        out.beyond_excess[f] += double(row[f]) - Offset(lo[f]);
      }
      if (kSums) {
        out.total[f] += row[f];
        out.nan[f] += row[f] != row[f];
        out.neg_nan[f] += key < kNegInfKey;
      }
    }
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
    const uint32_t* lo, const uint32_t* width, const uint8_t* gather, Sweep& out) {
  const int64_t groups = items.count();
  const int64_t block = std::max<int64_t>(8, 16384 / F);
  std::vector<uint32_t> n_below(8 * groups, 0), n_inside(8 * groups, 0);
  std::vector<uint32_t> n_beyond(8 * groups, 0), n_nan(8 * groups, 0), n_neg_nan(8 * groups, 0);
  std::vector<double> totals(8 * groups, 0.0), excesses(8 * groups, 0.0);
  std::vector<float> offsets(8 * groups);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t lane = 0; lane < 8; ++lane)
      offsets[8 * g + lane] = float(Offset(lo[items.first(int(g)) + lane]));
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
      // Sums within a block in floats (a block is at most 2048 rows), added
      // to doubles after it: converting every element would cost more.
      __m256 total = _mm256_setzero_ps(), excess = _mm256_setzero_ps();
      const __m256 offset = _mm256_loadu_ps(offsets.data() + slot);
      int gather_lanes = 0;  // only the group's own lanes are gathered
      for (int64_t lane = items.skip(int(g)); lane < 8; ++lane)
        gather_lanes |= (gather[c + lane] ? 1 : 0) << lane;
      std::vector<uint32_t>& keys = out.group_keys[g];
      std::vector<uint8_t>& lanes = out.group_lanes[g];
      int64_t size = out.group_size[g];
      if (int64_t(keys.size()) < size + 8 * (b1 - b0)) {
        const size_t room = size_t(std::max<int64_t>(2 * int64_t(keys.size()), size + 8 * (b1 - b0)));
        keys.resize(room);
        lanes.resize(room + 8);
      }
      uint32_t* keys_out = keys.data();
      uint8_t* lanes_out = lanes.data();
      for (int64_t r = b0; r < b1; ++r) {
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
          excess = _mm256_add_ps(excess, _mm256_and_ps(_mm256_castsi256_ps(beyond), _mm256_sub_ps(v, offset)));
        }
      }
      out.group_size[g] = size;
      _mm256_storeu_si256((__m256i*)(n_below.data() + slot), below_acc);
      _mm256_storeu_si256((__m256i*)(n_inside.data() + slot), inside_acc);
      if (kSums) {
        _mm256_storeu_si256((__m256i*)(n_beyond.data() + slot), beyond_acc);
        _mm256_storeu_si256((__m256i*)(n_nan.data() + slot), nan_acc);
        _mm256_storeu_si256((__m256i*)(n_neg_nan.data() + slot), neg_nan_acc);
        AddToDoubles(total, totals.data() + slot);
        AddToDoubles(excess, excesses.data() + slot);
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

void WriteSums(const Outputs& o, int64_t f, int64_t N, double total, double excess, int64_t nan) {
  o.mean[f] = float(total / double(N));
  o.mean_excess[f] = nan > 0 ? std::numeric_limits<float>::quiet_NaN() : float(excess / double(N));
}

// Counts over column f of the input itself: for answers whose equal keys
// reach outside the bracket (zeros and denormals read as zero).
Counts CountsStrided(const float* data, int64_t N, int64_t F, int64_t f, const EqualKeys& e) {
  Counts c;
  if (e.empty()) return c;
  const uint32_t span = e.hi - e.lo, not_above_span = e.hi - kNegInfKey;
  for (int64_t r = 0; r < N; ++r) {
    const uint32_t key = Key(data[r * F + f]);
    c.equal += InRange(key, e.lo, span);
    c.not_above += InRange(key, kNegInfKey, not_above_span);
  }
  return c;
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
  std::vector<uint8_t> gather(F);
  ParallelFor(pool, int(F), [&](int f) {
    const uint32_t* sample = samples.data() + f * sample_stride;
    std::vector<uint32_t> scratch(size_t(2 * M));
    const double p = (double(k[f]) - 0.5) / double(N), centre = p * double(M);
    const double half = bracket_sigmas * std::sqrt(double(M) * p * (1.0 - p)) + 2.0;
    const int64_t a = int64_t(std::floor(centre - half));
    const int64_t b = int64_t(std::ceil(centre + half));
    uint32_t low = 0, high = 0xFFFFFFFFu;
    if (a >= 0) low = SelectKth(sample, M, a + 1, scratch.data(), scratch.data() + M);
    if (b < M) {
      const uint32_t top = SelectKth(sample, M, b + 1, scratch.data(), scratch.data() + M);
      // The top sample value itself falls inside: with repeated values (an
      // atom such as ReLU's zeros) the target is often that very value.
      high = top == 0xFFFFFFFFu ? top : top + 1;
    }
    // One value across the bracket (an atom): [v, v + 1) holds just that key.
    width[f] = high > low ? high - low : 1;
    lo[f] = low;
    gather[f] = width[f] > 1;
  });

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
        SweepAvx2<true>(data, r0, r1, F, items, lo.data(), width.data(), gather.data(), s);
      else
        SweepAvx2<false>(data, r0, r1, F, items, lo.data(), width.data(), gather.data(), s);
      return;
    }
#endif
    for (int64_t f = 0; f < F; ++f)
      if (gather[f]) s.keys[f].reserve(size_t((r1 - r0) / 16 + 16));
    if (sums)
      SweepScalar<true>(data, r0, r1, F, lo.data(), width.data(), gather.data(), s);
    else
      SweepScalar<false>(data, r0, r1, F, lo.data(), width.data(), gather.data(), s);
  });

  ParallelFor(pool, items.count(), [&](int item) {
    const int64_t c = items.first(item), n_columns = items.width();
    std::vector<int64_t> below(n_columns, 0), inside(n_columns, 0);
    for (const Sweep& s : sweeps)
      for (int64_t j = 0; j < n_columns; ++j) {
        below[j] += s.below[c + j];
        inside[j] += s.inside[c + j];
      }
    // The gathered keys of each column, unpacked from the group buffers.
    std::vector<std::vector<uint32_t>> keys(n_columns);
    for (int64_t j = items.skip(item); j < n_columns; ++j)
      if (gather[c + j]) keys[j].reserve(size_t(inside[j]));
    for (const Sweep& s : sweeps) {
      if (items.grouped) {
        const uint32_t* group_keys = s.group_keys[item].data();
        const uint8_t* lanes = s.group_lanes[item].data();
        for (int64_t i = 0; i < s.group_size[item]; ++i) keys[lanes[i]].push_back(group_keys[i]);
      } else {
        keys[0].insert(keys[0].end(), s.keys[c].begin(), s.keys[c].end());
      }
    }
    std::vector<uint32_t> scratch;
    for (int64_t j = items.skip(item); j < n_columns; ++j) {
      const int64_t f = c + j, rank = k[f] - below[j];
      const bool hit = rank >= 1 && rank <= inside[j];
      uint32_t answer;
      if (!hit) {  // the bracket missed: select over the whole column
        std::vector<uint32_t> column(N);
        Columns(data, N, F, f, 1, N, column.data());
        scratch.resize(2 * N);
        answer = SelectKth(column.data(), N, k[f], scratch.data(), scratch.data() + N);
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
      // Every copy of the answer lies inside the bracket: a single key where
      // the bracket holds just one, else among the gathered keys.
      const std::vector<uint32_t>& column = keys[j];
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
        counts = CountsStrided(data, N, F, f, equal);
      } else if (!equal.empty()) {
        counts = gathered.counts;
        counts.not_above += below[j] - neg_nan;
      }
      WriteCounts(o, f, N, equal, counts);
      if (sums) {
        // Keys beyond the bracket are above the answer: their sum of (x - q)
        // is their sum of (x - offset) less (q - offset) each (none: no term,
        // since an infinite q times zero would be NaN).
        double excess = gathered.excess;
        if (beyond > 0) excess += beyond_excess - (double(FloatOf(answer)) - Offset(lo[f])) * double(beyond);
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
  if (!(bracket_sigmas >= 0.0)) return ffi::Error::InvalidArgument("bracket_sigmas must be >= 0");
  Outputs o{result->typed_data(), ties->typed_data(), path->typed_data()};
  if (kSums) {
    o.mean = mean->typed_data();
    o.mean_excess = mean_excess->typed_data();
    o.above = above->typed_data();
  }
  SelectKeys(pool, x.typed_data(), N, F, k_buffer.typed_data(), bracket_sigmas, o);
  return ffi::Error::Success();
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
