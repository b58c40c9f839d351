// The kernel gradient of a 2-D NHWC x HWIO -> NHWC float32 convolution: an
// XLA FFI handler for the CPU, used by gbn_jax/convolution.py when it is
// built.
//
// dk[i, j, c, f] = sum over (n, p, q) of x[n, p*s_h + i - top, q*s_w + j - left, c]
// * g[n, p, q, f], positions outside x contributing nothing. XLA:CPU
// computes it as a convolution whose contracted dimension is the batch,
// which needs batch-minor copies of x and g and runs far below the forward
// convolution's speed. Here it is what it is, a matrix product over the
// output positions: tiles of consecutive positions (contiguous rows of g in
// NHWC) have their patches of x gathered into a row-major (T, KH*KW*C)
// buffer, whose transpose times the tile of g is added into a per-task
// (KH*KW*C, F) sum, 6 x 16 outputs in registers at a time (AVX2 + FMA where
// the CPU has them, plain loops otherwise). The positions are split into a
// fixed number of contiguous tasks on XLA's intra-op thread pool, and the
// tasks' sums are added in task order, so the result does not depend on the
// thread count or scheduling. Each tile is summed from zero before it is
// added, which keeps float32 rounding well below a sequential sum's.
//
// Inputs: x (N, H, W, C), g (N, P, Q, F); attributes: strides (s_h, s_w) and
// the padding before the first row and column (top, left) as int64.
// Output: dk (KH, KW, C, F).

#include <algorithm>
#include <cstdint>
#include <new>
#include <vector>

#include "cpu_kernel.h"

namespace {

using gbn_jax::ParallelFor;

// Tasks the output positions are split into (a constant, for a result that
// is the same on any number of threads), and the floats a tile's patches
// may take (a tile is at most kMaxTile positions).
constexpr int kTasks = 8;
constexpr int64_t kTileFloats = 1 << 15;
constexpr int64_t kMaxTile = 256;

struct Geometry {
  int64_t n, h, w, c;      // x
  int64_t p, q, f;         // g
  int64_t kh, kw;          // kernel window
  int64_t stride_h, stride_w, top, left;
  int64_t rows() const { return kh * kw * c; }
  int64_t positions() const { return n * p * q; }
};

// Patches of output positions [first, first + count) into patches (count x
// rows(), row-major, zero where the window leaves x).
void GatherPatches(const float* x, const Geometry& g, int64_t first, int64_t count, float* patches) {
  const int64_t rows = g.rows();
  for (int64_t t = 0; t < count; ++t) {
    const int64_t position = first + t;
    const int64_t col = position % g.q, row = (position / g.q) % g.p, image = position / (g.q * g.p);
    float* out = patches + t * rows;
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t y = row * g.stride_h + i - g.top;
      for (int64_t j = 0; j < g.kw; ++j, out += g.c) {
        const int64_t z = col * g.stride_w + j - g.left;
        // Loops, not memset/memcpy: a call per window row costs more than
        // the copy when channels are few (the stem's 3).
        if (y < 0 || y >= g.h || z < 0 || z >= g.w) {
          for (int64_t k = 0; k < g.c; ++k) out[k] = 0.0f;
        } else {
          const float* in = x + ((image * g.h + y) * g.w + z) * g.c;
          for (int64_t k = 0; k < g.c; ++k) out[k] = in[k];
        }
      }
    }
  }
}

// sum[r, f] += sum over t of patches[t, r] * grad[t, f], for t < count.
void AddTileScalar(const float* patches, const float* grad, int64_t count, int64_t rows, int64_t f,
                   float* sum, float* scratch) {
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(scratch, scratch + f, 0.0f);
    for (int64_t t = 0; t < count; ++t) {
      const float a = patches[t * rows + r];
      const float* b = grad + t * f;
      for (int64_t k = 0; k < f; ++k) scratch[k] += a * b[k];
    }
    for (int64_t k = 0; k < f; ++k) sum[r * f + k] += scratch[k];
  }
}

#ifdef GBN_X86
// R rows x V vectors of 8 outputs in registers, over the tile.
template <int R, int V>
__attribute__((target("avx2,fma"), always_inline)) inline void AddBlockAvx2(
    const float* patches, const float* grad, int64_t count, int64_t rows, int64_t f, float* sum) {
  __m256 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t t = 0; t < count; ++t, patches += rows, grad += f) {
    __m256 b[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) b[v] = _mm256_loadu_ps(grad + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(patches + r);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(a, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      float* out = sum + r * f + 8 * v;
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), acc[r][v]));
    }
}

// R rows (at most 6) of AddTileScalar, for f a multiple of 8.
template <int R>
__attribute__((target("avx2,fma"))) void AddRowsAvx2(const float* patches, const float* grad, int64_t count,
                                                     int64_t rows, int64_t f, float* sum) {
  int64_t k = 0;
  for (; k + 16 <= f; k += 16) AddBlockAvx2<R, 2>(patches, grad + k, count, rows, f, sum + k);
  if (k < f) AddBlockAvx2<R, 1>(patches, grad + k, count, rows, f, sum + k);
}

// AddTileScalar for f a multiple of 8: 6 rows at a time, then the rest.
__attribute__((target("avx2,fma"))) void AddTileAvx2(const float* patches, const float* grad, int64_t count,
                                                     int64_t rows, int64_t f, float* sum) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) AddRowsAvx2<6>(patches + r, grad, count, rows, f, sum + r * f);
  patches += r, sum += r * f;
  switch (rows - r) {
    case 5: return AddRowsAvx2<5>(patches, grad, count, rows, f, sum);
    case 4: return AddRowsAvx2<4>(patches, grad, count, rows, f, sum);
    case 3: return AddRowsAvx2<3>(patches, grad, count, rows, f, sum);
    case 2: return AddRowsAvx2<2>(patches, grad, count, rows, f, sum);
    case 1: return AddRowsAvx2<1>(patches, grad, count, rows, f, sum);
  }
}
#endif

bool UseAvx2(int64_t f) {
#ifdef GBN_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has && f % 8 == 0;
#else
  (void)f;
  return false;
#endif
}

void KernelGradient(ffi::ThreadPool& pool, const float* x, const float* grad, const Geometry& g, float* dk) {
  const int64_t rows = g.rows(), size = rows * g.f, positions = g.positions();
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(kMaxTile, kTileFloats / std::max<int64_t>(rows, 1)));
  const bool avx2 = UseAvx2(g.f);
  std::vector<float> sums(size_t(kTasks) * size, 0.0f);
  ParallelFor(pool, kTasks, [&](int task) {
    const int64_t begin = positions * task / kTasks, end = positions * (task + 1) / kTasks;
    std::vector<float> patches(size_t(tile * rows)), scratch(size_t(g.f));
    float* sum = sums.data() + size_t(task) * size;
    for (int64_t first = begin; first < end; first += tile) {
      const int64_t count = std::min(tile, end - first);
      GatherPatches(x, g, first, count, patches.data());
      const float* rows_of_grad = grad + first * g.f;
#ifdef GBN_X86
      if (avx2) {
        AddTileAvx2(patches.data(), rows_of_grad, count, rows, g.f, sum);
        continue;
      }
#endif
      AddTileScalar(patches.data(), rows_of_grad, count, rows, g.f, sum, scratch.data());
    }
  });
  for (int64_t e = 0; e < size; ++e) {
    float total = 0.0f;
    for (int task = 0; task < kTasks; ++task) total += sums[size_t(task) * size + e];
    dk[e] = total;
  }
}

ffi::Error ConvKernelGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> grad,
                              int64_t stride_h, int64_t stride_w, int64_t top, int64_t left,
                              ffi::ResultBuffer<ffi::F32> dk) {
  const auto xd = x.dimensions(), gd = grad.dimensions(), kd = dk->dimensions();
  if (xd.size() != 4 || gd.size() != 4 || kd.size() != 4)
    return ffi::Error::InvalidArgument("x, the output gradient and the kernel must have rank 4");
  const Geometry g{xd[0], xd[1], xd[2], xd[3], gd[1], gd[2], gd[3], kd[0], kd[1], stride_h, stride_w, top, left};
  if (gd[0] != g.n || kd[2] != g.c || kd[3] != g.f)
    return ffi::Error::InvalidArgument("shapes (N,H,W,C), (N,P,Q,F) and (KH,KW,C,F) do not agree");
  if (stride_h < 1 || stride_w < 1) return ffi::Error::InvalidArgument("strides must be positive");
  try {
    KernelGradient(pool, x.typed_data(), grad.typed_data(), g, dk->typed_data());
    return ffi::Error::Success();
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "gbn_jax convolution kernel gradient: out of memory");
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kInternal, "gbn_jax convolution kernel gradient failed");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GbnConvKernelGradF32, ConvKernelGradient,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("stride_h")
                                  .Attr<int64_t>("stride_w")
                                  .Attr<int64_t>("top")
                                  .Attr<int64_t>("left")
                                  .Ret<ffi::Buffer<ffi::F32>>());
