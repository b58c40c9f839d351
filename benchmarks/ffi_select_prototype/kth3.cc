// Exact k-th smallest per column of a row-major (N, F) float32 array.
// One pass in the common case: a strided sample's order statistics bracket the
// target rank; a single sweep counts keys below the bracket and gathers the
// keys inside it (a few % of the data); the gathered keys are radix-selected.
// If a bracket misses (rare), the exact two-pass radix select runs instead.
// Output: int32 keys (order-preserving image of the floats, see Key()).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <immintrin.h>
#include <chrono>
#include <cstdio>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static inline uint32_t Key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

template <class Fn>
static void ParallelFor(int n_threads, Fn fn) {
  if (n_threads <= 1) { fn(0); return; }
  std::vector<std::thread> ts;
  for (int t = 1; t < n_threads; ++t) ts.emplace_back(fn, t);
  fn(0);
  for (auto& th : ts) th.join();
}

// k-th smallest (1-based) of `keys` by LSD-free radix levels (11, 11, 10 bits).
static uint32_t RadixSelect(std::vector<uint32_t> keys, int64_t k) {
  const int shifts[3] = {21, 10, 0};
  const int widths[3] = {11, 11, 10};
  std::vector<uint32_t> tmp;
  for (int level = 0; level < 3 && keys.size() > 1; ++level) {
    int shift = shifts[level];
    uint32_t mask = (1u << widths[level]) - 1;
    std::vector<int64_t> hist(size_t(mask) + 1, 0);
    for (uint32_t key : keys) hist[(key >> shift) & mask]++;
    int64_t cum = 0;
    uint32_t b = 0;
    for (; b < mask; ++b) {
      if (cum + hist[b] >= k) break;
      cum += hist[b];
    }
    k -= cum;
    tmp.clear();
    tmp.reserve(hist[b]);
    for (uint32_t key : keys)
      if (((key >> shift) & mask) == b) tmp.push_back(key);
    keys.swap(tmp);
  }
  return keys[0];
}

static ffi::Error KthImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> kbuf,
                          ffi::ResultBuffer<ffi::S32> out) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must be 2-D (N, F)");
  const int64_t N = dims[0], F = dims[1];
  const float* data = x.typed_data();
  const int32_t* kk = kbuf.typed_data();
  int32_t* res = out->typed_data();
  int n_threads = int(std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()),
                                        std::max<int64_t>(1, N * F / (1 << 16))));
  auto rows_of = [&](int t, int64_t& r0, int64_t& r1) {
    r0 = N * t / n_threads;
    r1 = N * (t + 1) / n_threads;
  };
  auto T0 = std::chrono::steady_clock::now();
  // Bracket [lo, hi) per column from a strided sample of M rows.
  const int64_t M = std::min<int64_t>(N, 4096);
  std::vector<uint32_t> lo(F), hi(F);
  std::vector<int64_t> kcol(F);
  {
    std::vector<uint32_t> s(M);
    for (int64_t f = 0; f < F; ++f) {
      int64_t k = std::clamp<int64_t>(kk[f], 1, N);
      kcol[f] = k;
      for (int64_t i = 0; i < M; ++i) s[i] = Key(data[(i * N / M) * F + f]);
      double p = (k - 0.5) / N, c = p * M, h = 4.0 * std::sqrt(M * p * (1 - p)) + 2;
      int64_t a = int64_t(std::floor(c - h)), b = int64_t(std::ceil(c + h));
      if (a < 0) lo[f] = 0; else { std::nth_element(s.begin(), s.begin() + a, s.end()); lo[f] = s[a]; }
      if (b >= M) hi[f] = 0xFFFFFFFFu; else { std::nth_element(s.begin(), s.begin() + b, s.end()); hi[f] = s[b]; }
      if (hi[f] <= lo[f]) hi[f] = lo[f] + 1;  // one-key bracket: [v, v+1)
      if (hi[f] == 0xFFFFFFFFu) hi[f] = 0xFFFFFFFFu;  // includes up to the max key - 1
    }
  }
  auto T1 = std::chrono::steady_clock::now();
  // One sweep: count below, gather inside (AVX2 for 8 columns at a time;
  // the rare in-bracket lanes are appended from a movemask).
  std::vector<std::vector<int64_t>> below(n_threads, std::vector<int64_t>(F, 0));
  std::vector<std::vector<std::vector<uint32_t>>> inside(n_threads, std::vector<std::vector<uint32_t>>(F));
  std::vector<uint32_t> width(F);
  for (int64_t f = 0; f < F; ++f) width[f] = hi[f] - lo[f];
  ParallelFor(n_threads, [&](int t) {
    int64_t r0, r1;
    rows_of(t, r0, r1);
    auto& in = inside[t];
    for (int64_t f = 0; f < F; ++f) in[f].reserve(size_t((r1 - r0) / 16 + 16));
    const int64_t F8 = F / 8 * 8;
    std::vector<__m256i> acc(F8 / 8, _mm256_setzero_si256());
    const __m256i sign = _mm256_set1_epi32(int(0x80000000u)), ones = _mm256_set1_epi32(-1);
    std::vector<__m256i> vlo(F8 / 8), vw(F8 / 8);
    for (int64_t g = 0; g < F8 / 8; ++g) {
      // Unsigned compares as signed compares of sign-flipped values.
      vlo[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(lo.data() + 8 * g)), sign);
      vw[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(width.data() + 8 * g)), sign);
    }
    int64_t* bl = below[t].data();
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = data + r * F;
      for (int64_t g = 0; g < F8 / 8; ++g) {
        __m256i u = _mm256_loadu_si256((const __m256i*)(row + 8 * g));
        // key = u < 0 ? ~u : u | sign  (as unsigned); flipped for signed compare: key ^ sign
        __m256i neg = _mm256_srai_epi32(u, 31);
        __m256i key = _mm256_xor_si256(u, _mm256_or_si256(neg, sign));  // ~u if neg, u^sign otherwise
        __m256i ks = _mm256_xor_si256(key, sign);
        acc[g] = _mm256_sub_epi32(acc[g], _mm256_cmpgt_epi32(vlo[g], ks));  // += key < lo
        __m256i d = _mm256_xor_si256(_mm256_sub_epi32(key, _mm256_xor_si256(vlo[g], sign)), sign);
        int m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(vw[g], d)));  // d < width
        while (m) {
          int lane = __builtin_ctz(m);
          m &= m - 1;
          alignas(32) uint32_t tmp[8];
          _mm256_store_si256((__m256i*)tmp, key);
          in[8 * g + lane].push_back(tmp[lane]);
        }
      }
      for (int64_t f = F8; f < F; ++f) {
        uint32_t key = Key(row[f]);
        bl[f] += key < lo[f];
        if (key - lo[f] < width[f]) in[f].push_back(key);
      }
    }
    for (int64_t g = 0; g < F8 / 8; ++g) {
      alignas(32) int32_t tmp[8];
      _mm256_store_si256((__m256i*)tmp, acc[g]);
      for (int l = 0; l < 8; ++l) bl[8 * g + l] += uint32_t(tmp[l]);
    }
  });
  auto T2 = std::chrono::steady_clock::now();
  bool all_hit = true;
  std::vector<int64_t> rank(F);
  for (int64_t f = 0; f < F; ++f) {
    int64_t b = 0, w = 0;
    for (int t = 0; t < n_threads; ++t) { b += below[t][f]; w += int64_t(inside[t][f].size()); }
    rank[f] = kcol[f] - b;
    if (rank[f] < 1 || rank[f] > w) all_hit = false;
  }
  if (all_hit) {
    ParallelFor(n_threads, [&](int t) {
      for (int64_t f = t; f < F; f += n_threads) {
        std::vector<uint32_t> keys;
        for (int u = 0; u < n_threads; ++u) keys.insert(keys.end(), inside[u][f].begin(), inside[u][f].end());
        std::nth_element(keys.begin(), keys.begin() + (rank[f] - 1), keys.end());
        res[f] = int32_t(keys[rank[f] - 1] ^ 0x80000000u);
      }
    });
    auto T3 = std::chrono::steady_clock::now();
    if (getenv("KTH_TIMING")) fprintf(stderr, "threads %d sample %.2f sweep %.2f finish %.2f\n", n_threads, std::chrono::duration<double, std::milli>(T1-T0).count(), std::chrono::duration<double, std::milli>(T2-T1).count(), std::chrono::duration<double, std::milli>(T3-T2).count());
    return ffi::Error::Success();
  }
  // Fallback: exact radix select over each whole column.
  ParallelFor(n_threads, [&](int t) {
    std::vector<uint32_t> col(N);
    for (int64_t f = t; f < F; f += n_threads) {
      for (int64_t r = 0; r < N; ++r) col[r] = Key(data[r * F + f]);
      res[f] = int32_t(RadixSelect(col, kcol[f]) ^ 0x80000000u);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GbnKthSmallest, KthImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
