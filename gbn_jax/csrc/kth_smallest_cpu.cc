// Exact k-th smallest per column of a row-major (N, F) float32 array: an XLA
// FFI handler for the CPU, used by gbn_jax/_select.py when it is built.
//
// Keys are the order-preserving unsigned image of the float bits (-0.0 sorts
// just below +0.0, NaN beyond +-inf), so every comparison is an exact integer
// one; XLA:CPU's float compares flush denormals, ours do not.
//
// Short columns (at most kDirectRows) are gathered whole and nth_element
// picks the answer. Otherwise one sweep over the data in the common case: the
// order statistics of a sample of rows bracket each column's target rank, the
// sweep counts the keys below the bracket and gathers those inside it (a few
// per cent of the data), and nth_element finishes on the gathered keys. A
// bracket holding a single key (an atom such as the zeros after a ReLU) is
// counted, not gathered. A column whose bracket misses the target (rare) gets
// an exact radix select. Work is spread over XLA's intra-op thread pool.
//
// Inputs: x (N, F) float32, k (F,) int32 (1-based, clamped to [1, N]).
// Outputs: (F,) int32, the signed key (unsigned key ^ 0x80000000) of the
// answer, which is what gbn_jax._select works with; (F,) int32, how many
// elements equal the answer when it is a normal nonzero float (where float
// equality is bit equality, whatever a compiler does with denormals), else -1;
// (F,) int32, the path each column took (a Path), for tests and diagnostics.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
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

enum Path : int32_t { kWholeColumn = 0, kSingleKey = 1, kGathered = 2, kRadixFallback = 3 };

inline uint32_t Key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & kSign) ? ~u : (u | kSign);
}

// Whether the float behind a key is normal and nonzero (not 0, denormal,
// inf or NaN): its exponent bits are neither all zeros nor all ones.
inline bool NormalNonzero(uint32_t key) {
  const uint32_t bits = (key & kSign) ? (key ^ kSign) : ~key;
  const uint32_t exponent = (bits >> 23) & 0xFFu;
  return exponent != 0 && exponent != 0xFFu;
}

template <class It>
int32_t TiesOf(uint32_t answer, It begin, It end) {
  if (!NormalNonzero(answer)) return -1;
  return int32_t(std::count(begin, end, answer));
}

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

// k-th smallest (1-based, 1 <= k <= keys.size()) by three radix levels.
uint32_t RadixSelect(std::vector<uint32_t> keys, int64_t k) {
  const int shifts[3] = {21, 10, 0};
  const int widths[3] = {11, 11, 10};
  std::vector<uint32_t> kept;
  for (int level = 0; level < 3 && keys.size() > 1; ++level) {
    const uint32_t mask = (1u << widths[level]) - 1;
    std::vector<int64_t> hist(size_t(mask) + 1, 0);
    for (uint32_t key : keys) hist[(key >> shifts[level]) & mask]++;
    uint32_t digit = 0;
    for (; digit < mask && hist[digit] < k; ++digit) k -= hist[digit];
    kept.clear();
    kept.reserve(size_t(hist[digit]));
    for (uint32_t key : keys)
      if (((key >> shifts[level]) & mask) == digit) kept.push_back(key);
    keys.swap(kept);
  }
  return keys[0];
}

// One task's results of the sweep over rows [r0, r1).
struct Sweep {
  std::vector<int64_t> below;                // #{key < lo}
  std::vector<int64_t> inside;               // #{lo <= key < lo + width}
  std::vector<std::vector<uint32_t>> keys;   // those keys, unless not gathered
};

void SweepScalar(const float* data, int64_t r0, int64_t r1, int64_t f0, int64_t F,
                 const uint32_t* lo, const uint32_t* width, const uint8_t* gather,
                 Sweep& out) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = data + r * F;
    for (int64_t f = f0; f < F; ++f) {
      const uint32_t key = Key(row[f]);
      out.below[f] += key < lo[f];
      if (key - lo[f] < width[f]) {
        out.inside[f]++;
        if (gather[f]) out.keys[f].push_back(key);
      }
    }
  }
}

#ifdef GBN_X86
// Columns [0, F8) eight at a time; returns F8 (the scalar loop does the rest).
// Blocks of rows stay in cache while each group of eight columns sweeps them
// with its bounds and counters in registers (no __m256i crosses a call: this
// function alone is compiled for AVX2).
__attribute__((target("avx2"))) int64_t SweepAvx2(
    const float* data, int64_t r0, int64_t r1, int64_t F, const uint32_t* lo,
    const uint32_t* width, const uint8_t* gather, Sweep& out) {
  const int64_t groups = F / 8;
  if (groups == 0) return 0;
  const int64_t block = std::max<int64_t>(8, 16384 / F);
  const __m256i sign = _mm256_set1_epi32(int32_t(kSign));
  std::vector<uint32_t> n_below(8 * groups, 0), n_inside(8 * groups, 0);
  alignas(32) uint32_t lanes[8];
  for (int64_t b0 = r0; b0 < r1; b0 += block) {
    const int64_t b1 = std::min(r1, b0 + block);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c = 8 * g;
      // Unsigned compares are signed compares of sign-flipped values.
      const __m256i lo_u = _mm256_loadu_si256((const __m256i*)(lo + c));
      const __m256i lo_s = _mm256_xor_si256(lo_u, sign);
      const __m256i width_s = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(width + c)), sign);
      __m256i below_acc = _mm256_loadu_si256((const __m256i*)(n_below.data() + c));
      __m256i inside_acc = _mm256_loadu_si256((const __m256i*)(n_inside.data() + c));
      int gather_lanes = 0;
      for (int lane = 0; lane < 8; ++lane) gather_lanes |= (gather[c + lane] ? 1 : 0) << lane;
      for (int64_t r = b0; r < b1; ++r) {
        const __m256i u = _mm256_loadu_si256((const __m256i*)(data + r * F + c));
        // key = negative ? ~u : u | sign
        const __m256i key = _mm256_xor_si256(u, _mm256_or_si256(_mm256_srai_epi32(u, 31), sign));
        below_acc = _mm256_sub_epi32(below_acc, _mm256_cmpgt_epi32(lo_s, _mm256_xor_si256(key, sign)));
        const __m256i offset = _mm256_sub_epi32(key, lo_u);
        const __m256i in = _mm256_cmpgt_epi32(width_s, _mm256_xor_si256(offset, sign));
        inside_acc = _mm256_sub_epi32(inside_acc, in);
        int hits = _mm256_movemask_ps(_mm256_castsi256_ps(in)) & gather_lanes;
        if (hits) {
          _mm256_store_si256((__m256i*)lanes, key);
          while (hits) {
            const int lane = __builtin_ctz(hits);
            hits &= hits - 1;
            out.keys[c + lane].push_back(lanes[lane]);
          }
        }
      }
      _mm256_storeu_si256((__m256i*)(n_below.data() + c), below_acc);
      _mm256_storeu_si256((__m256i*)(n_inside.data() + c), inside_acc);
    }
  }
  for (int64_t f = 0; f < 8 * groups; ++f) {
    out.below[f] += n_below[f];
    out.inside[f] += n_inside[f];
  }
  return 8 * groups;
}
#endif

// The selection proper, for any pool with num_threads() and Schedule(task).
template <class Pool>
void SelectKeys(Pool& pool, const float* data, int64_t N, int64_t F, const int32_t* k_in,
                double bracket_sigmas, int32_t* out, int32_t* ties, int32_t* path) {
  if (F == 0) return;
  if (N == 0) {  // no answer exists; the caller turns k > n into NaN
    std::fill(out, out + F, 0);
    std::fill(ties, ties + F, -1);
    std::fill(path, path + F, kWholeColumn);
    return;
  }
  std::vector<int64_t> k(F);
  for (int64_t f = 0; f < F; ++f) k[f] = std::clamp<int64_t>(k_in[f], 1, N);

  if (N <= kDirectRows) {
    ParallelFor(pool, int(F), [&](int f) {
      std::vector<uint32_t> column(N);
      for (int64_t r = 0; r < N; ++r) column[r] = Key(data[r * F + f]);
      std::nth_element(column.begin(), column.begin() + (k[f] - 1), column.end());
      const uint32_t answer = column[k[f] - 1];
      out[f] = int32_t(answer ^ kSign);
      ties[f] = TiesOf(answer, column.begin(), column.end());
      path[f] = kWholeColumn;
    });
    return;
  }

  // Bracket [lo, lo + width) per column from a sample of M rows, one from each
  // of M equal strides at a jittered (golden-ratio) offset so that it does not
  // alias with periodic structure such as image rows; +-bracket_sigmas
  // binomial standard deviations around the target.
  const int64_t M = std::clamp(N / kSampleFraction, kMinSample, kMaxSample);
  std::vector<int64_t> sample_rows(M);
  for (int64_t i = 0; i < M; ++i) {
    const double jitter = double(i) * kGolden - std::floor(double(i) * kGolden);
    sample_rows[i] = std::min(N - 1, int64_t((double(i) + jitter) * double(N) / double(M)));
  }
  std::vector<uint32_t> lo(F), width(F);
  std::vector<uint8_t> gather(F);
  ParallelFor(pool, int(F), [&](int f) {
    std::vector<uint32_t> sample(M);
    for (int64_t i = 0; i < M; ++i) sample[i] = Key(data[sample_rows[i] * F + f]);
    const double p = (double(k[f]) - 0.5) / double(N), centre = p * double(M);
    const double half = bracket_sigmas * std::sqrt(double(M) * p * (1.0 - p)) + 2.0;
    const int64_t a = int64_t(std::floor(centre - half));
    const int64_t b = int64_t(std::ceil(centre + half));
    uint32_t low = 0, high = 0xFFFFFFFFu;
    auto first = sample.begin();
    if (a >= 0) {
      std::nth_element(sample.begin(), sample.begin() + a, sample.end());
      low = sample[a];
      first = sample.begin() + a + 1;
    }
    if (b < M) {
      std::nth_element(first, sample.begin() + b, sample.end());
      // The top sample value itself falls inside: with repeated values (an
      // atom such as ReLU's zeros) the target is often that very value.
      high = sample[b] == 0xFFFFFFFFu ? sample[b] : sample[b] + 1;
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
    for (int64_t f = 0; f < F; ++f)
      if (gather[f]) s.keys[f].reserve(size_t((r1 - r0) / 16 + 16));
    int64_t done = 0;
#ifdef GBN_X86
    if (__builtin_cpu_supports("avx2"))
      done = SweepAvx2(data, r0, r1, F, lo.data(), width.data(), gather.data(), s);
#endif
    SweepScalar(data, r0, r1, done, F, lo.data(), width.data(), gather.data(), s);
  });

  ParallelFor(pool, int(F), [&](int f) {
    int64_t below = 0, inside = 0;
    for (const Sweep& s : sweeps) {
      below += s.below[f];
      inside += s.inside[f];
    }
    const int64_t rank = k[f] - below;
    uint32_t answer;
    if (rank >= 1 && rank <= inside && !gather[f]) {
      answer = lo[f];  // every key in the bracket is this one
      ties[f] = NormalNonzero(answer) ? int32_t(inside) : -1;
      path[f] = kSingleKey;
    } else if (rank >= 1 && rank <= inside) {
      // Every copy of the answer lies inside the bracket, so among these keys.
      std::vector<uint32_t> keys;
      keys.reserve(size_t(inside));
      for (const Sweep& s : sweeps) keys.insert(keys.end(), s.keys[f].begin(), s.keys[f].end());
      std::nth_element(keys.begin(), keys.begin() + (rank - 1), keys.end());
      answer = keys[rank - 1];
      ties[f] = TiesOf(answer, keys.begin(), keys.end());
      path[f] = kGathered;
    } else {  // the bracket missed: exact select over the whole column
      std::vector<uint32_t> keys(N);
      for (int64_t r = 0; r < N; ++r) keys[r] = Key(data[r * F + f]);
      answer = RadixSelect(keys, k[f]);
      ties[f] = TiesOf(answer, keys.begin(), keys.end());
      path[f] = kRadixFallback;
    }
    out[f] = int32_t(answer ^ kSign);
  });
}

ffi::Error KthSmallest(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::S32> k_buffer, double bracket_sigmas,
                       ffi::ResultBuffer<ffi::S32> result, ffi::ResultBuffer<ffi::S32> ties,
                       ffi::ResultBuffer<ffi::S32> path) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must have shape (N, F)");
  const int64_t N = dims[0], F = dims[1];
  if (k_buffer.element_count() != size_t(F) || result->element_count() != size_t(F) ||
      ties->element_count() != size_t(F) || path->element_count() != size_t(F))
    return ffi::Error::InvalidArgument("k and the results must have shape (F,)");
  if (!(bracket_sigmas >= 0.0)) return ffi::Error::InvalidArgument("bracket_sigmas must be >= 0");
  SelectKeys(pool, x.typed_data(), N, F, k_buffer.typed_data(), bracket_sigmas,
             result->typed_data(), ties->typed_data(), path->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GbnKthSmallestF32, KthSmallest,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<double>("bracket_sigmas")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
