// Two parts of a 2-D NHWC x HWIO -> NHWC float32 convolution as XLA FFI
// handlers for the CPU, used by gbn_jax/convolution.py when they are built:
// the forward convolution and the kernel gradient. Both gather the input
// windows ("patches") of tiles of consecutive output positions into a small
// row-major (T, KH*KW*C) buffer and multiply it, 6 x 16 outputs in AVX2
// registers at a time (AVX2 + FMA where the CPU has them, plain loops
// otherwise), on a fixed split of the positions into tasks on XLA's intra-op
// thread pool.
//
// Kernel gradient: dk[i, j, c, f] = sum over (n, p, q) of
// x[n, p*s_h + i - top, q*s_w + j - left, c] * g[n, p, q, f], positions
// outside x contributing nothing. XLA:CPU computes it as a convolution whose
// contracted dimension is the batch, which needs batch-minor copies of x and
// g and runs far below the forward convolution's speed. Here it is what it
// is, a matrix product over the output positions: a tile's patches,
// transposed, times the tile of g (contiguous rows in NHWC) is added into a
// per-task (KH*KW*C, F) sum; the tasks' sums are added in task order, so the
// result does not depend on the thread count or scheduling. Each tile is
// summed from zero before it is added, which keeps float32 rounding well
// below a sequential sum's.
//
// Forward: y[n, p, q, f] = sum over (i, j, c) of the same window times
// k[i, j, c, f]: a tile's patches times the kernel, (T, KH*KW*C) x
// (KH*KW*C, F), written straight into the tile's rows of y (each output is
// one dot product, summed in (i, j, c) order).
//
// Inputs: x (N, H, W, C) and g (N, P, Q, F), or x and k (KH, KW, C, F);
// attributes: strides (s_h, s_w) and the padding before the first row and
// column (top, left) as int64. Output: dk (KH, KW, C, F), or y (N, P, Q, F).

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

#ifdef GBN_X86
// out[r, :] = patches[r, :] . k for R rows, V vectors of 8 outputs in
// registers, over the rows' length.
template <int R, int V>
__attribute__((target("avx2,fma"), always_inline)) inline void ForwardBlockAvx2(
    const float* patches, const float* k, int64_t rows, int64_t f, float* out) {
  __m256 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t e = 0; e < rows; ++e, k += f) {
    __m256 b[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) b[v] = _mm256_loadu_ps(k + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(patches + r * rows + e);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(a, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + r * f + 8 * v, acc[r][v]);
}

template <int R>
__attribute__((target("avx2,fma"))) void ForwardRowsAvx2(const float* patches, const float* k, int64_t rows,
                                                         int64_t f, float* out) {
  int64_t j = 0;
  for (; j + 16 <= f; j += 16) ForwardBlockAvx2<R, 2>(patches, k + j, rows, f, out + j);
  if (j < f) ForwardBlockAvx2<R, 1>(patches, k + j, rows, f, out + j);
}

// ForwardTileScalar for f a multiple of 8: 6 positions at a time, then the
// rest.
__attribute__((target("avx2,fma"))) void ForwardTileAvx2(const float* patches, const float* k, int64_t count,
                                                         int64_t rows, int64_t f, float* out) {
  int64_t t = 0;
  for (; t + 6 <= count; t += 6) ForwardRowsAvx2<6>(patches + t * rows, k, rows, f, out + t * f);
  patches += t * rows, out += t * f;
  switch (count - t) {
    case 5: return ForwardRowsAvx2<5>(patches, k, rows, f, out);
    case 4: return ForwardRowsAvx2<4>(patches, k, rows, f, out);
    case 3: return ForwardRowsAvx2<3>(patches, k, rows, f, out);
    case 2: return ForwardRowsAvx2<2>(patches, k, rows, f, out);
    case 1: return ForwardRowsAvx2<1>(patches, k, rows, f, out);
  }
}
#endif

// out[t, :] = patches[t, :] . k for t < count.
void ForwardTileScalar(const float* patches, const float* k, int64_t count, int64_t rows, int64_t f,
                       float* out) {
  for (int64_t t = 0; t < count; ++t, out += f) {
    std::fill(out, out + f, 0.0f);
    const float* a = patches + t * rows;
    for (int64_t e = 0; e < rows; ++e) {
      const float* b = k + e * f;
      for (int64_t j = 0; j < f; ++j) out[j] += a[e] * b[j];
    }
  }
}

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

// Positions a forward tile takes (its patches stay in the core's L2).
constexpr int64_t kForwardTile = 96;

void Forward(ffi::ThreadPool& pool, const float* x, const float* k, const Geometry& g, float* y) {
  const int64_t rows = g.rows(), positions = g.positions();
  const bool avx2 = UseAvx2(g.f);
  ParallelFor(pool, kTasks, [&](int task) {
    const int64_t begin = positions * task / kTasks, end = positions * (task + 1) / kTasks;
    std::vector<float> patches(size_t(kForwardTile * rows));
    for (int64_t first = begin; first < end; first += kForwardTile) {
      const int64_t count = std::min(kForwardTile, end - first);
      GatherPatches(x, g, first, count, patches.data());
      float* out = y + first * g.f;
#ifdef GBN_X86
      if (avx2) {
        ForwardTileAvx2(patches.data(), k, count, rows, g.f, out);
        continue;
      }
#endif
      ForwardTileScalar(patches.data(), k, count, rows, g.f, out);
    }
  });
}

// The geometry of x (N, H, W, C), a kernel-shaped (KH, KW, C, F) and an
// output-shaped (N, P, Q, F) buffer, or an error saying what disagrees.
ffi::ErrorOr<Geometry> MakeGeometry(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> kd,
                                    ffi::Span<const int64_t> yd, int64_t stride_h, int64_t stride_w,
                                    int64_t top, int64_t left) {
  if (xd.size() != 4 || kd.size() != 4 || yd.size() != 4)
    return ffi::Unexpected(ffi::Error::InvalidArgument("x, the kernel and the output (gradient) must have rank 4"));
  const Geometry g{xd[0], xd[1], xd[2], xd[3], yd[1], yd[2], yd[3], kd[0], kd[1], stride_h, stride_w, top, left};
  if (yd[0] != g.n || kd[2] != g.c || kd[3] != g.f)
    return ffi::Unexpected(ffi::Error::InvalidArgument("shapes (N,H,W,C), (KH,KW,C,F) and (N,P,Q,F) do not agree"));
  if (stride_h < 1 || stride_w < 1) return ffi::Unexpected(ffi::Error::InvalidArgument("strides must be positive"));
  return g;
}

// Runs a kernel, its C++ exceptions turned into FFI errors.
template <typename Kernel>
ffi::Error Guarded(Kernel&& kernel) {
  try {
    kernel();
    return ffi::Error::Success();
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "gbn_jax convolution: out of memory");
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kInternal, "gbn_jax convolution failed");
  }
}

ffi::Error ConvKernelGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> grad,
                              int64_t stride_h, int64_t stride_w, int64_t top, int64_t left,
                              ffi::ResultBuffer<ffi::F32> dk) {
  const auto g = MakeGeometry(x.dimensions(), dk->dimensions(), grad.dimensions(), stride_h, stride_w, top, left);
  if (g.has_error()) return g.error();
  return Guarded([&] { KernelGradient(pool, x.typed_data(), grad.typed_data(), g.value(), dk->typed_data()); });
}

ffi::Error ConvForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> k, int64_t stride_h,
                       int64_t stride_w, int64_t top, int64_t left, ffi::ResultBuffer<ffi::F32> y) {
  const auto g = MakeGeometry(x.dimensions(), k.dimensions(), y->dimensions(), stride_h, stride_w, top, left);
  if (g.has_error()) return g.error();
  return Guarded([&] { Forward(pool, x.typed_data(), k.typed_data(), g.value(), y->typed_data()); });
}

// Both handlers' signature: the thread pool, two operands, the strides and
// leading pads, one result.
auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Attr<int64_t>("stride_h")
      .Attr<int64_t>("stride_w")
      .Attr<int64_t>("top")
      .Attr<int64_t>("left")
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GbnConvKernelGradF32, ConvKernelGradient, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GbnConvForwardF32, ConvForward, Binding());
