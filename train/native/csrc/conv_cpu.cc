// A 2-D NHWC x HWIO -> NHWC float32 convolution and both its gradients as
// XLA FFI handlers for the CPU, used by train/native/convolution.py (which has
// train/native/build.py compile them on first use): the forward convolution,
// the kernel gradient, and the input gradient at any stride. All three are
// matrix products whose one operand is a window of an image ("patches");
// they read the windows where they lie, in a zero-padded copy of one image at
// a time (no copy of the patches, which would hold each input value KH*KW
// times), and multiply them in register tiles (conv_tiles.h, compiled per
// instruction set in conv_tiles_x86.cc: AVX-512, or AVX2 + FMA, where the
// CPU has them; plain loops here otherwise), on a fixed split of the work
// into tasks on XLA's intra-op thread pool.
//
// Kernel gradient: dk[i, j, c, f] = sum over (n, p, q) of
// x[n, p*s_h + i - top, q*s_w + j - left, c] * g[n, p, q, f], positions
// outside x contributing nothing. XLA:CPU computes it as a convolution whose
// contracted dimension is the batch, which needs batch-minor copies of x and
// g and runs far below the forward convolution's speed. Here it is what it
// is, a matrix product over the output positions: a tile's windows, as
// rows, transposed, times the tile of g (contiguous rows in NHWC) is added
// into a per-task (KH*KW*C, F) sum; the tasks' sums are added in task order,
// so the result does not depend on the thread count or scheduling. Each tile
// (positions of one image) is summed from zero before it is added, which
// keeps float32 rounding well below a sequential sum's.
//
// Forward: y[n, p, q, f] = sum over (i, j, c) of the same window times
// k[i, j, c, f], the windows of a run of positions in one output row times
// the kernel, written straight into the run's rows of y (each output is one
// dot product, summed in (i, j, c) order).
//
// Input gradient: dx[n, y, z, c] = sum over the windows that hold (y, z) of
// g[n, p, q, f] * k[i, j, c, f], each output row's g times the kernel
// transposed (the forward's tiles) added into a padded image (InputGradient).
//
// Inputs: x (N, H, W, C) and g (N, P, Q, F), x and k (KH, KW, C, F), or g
// and k; attributes: strides (s_h, s_w) and the padding before the first row
// and column (top, left) as int64. Output: dk (KH, KW, C, F), y (N, P, Q, F)
// or dx (N, H, W, C).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "conv_isa.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using gbn_train::ParallelFor;
using gbn_train::Window;
#ifdef GBN_CONV_X86
using gbn_train::Avx2;
using gbn_train::Avx512;
using gbn_train::Tiles;
#endif

// Tasks the output positions are split into (a constant, for a result that
// is the same on any number of threads), and the largest tile of the kernel
// gradient, in positions and in floats of g (the tile's rows of g stay in
// the core's L1 while every row of the kernel gradient passes over them).
constexpr int kTasks = 8;
constexpr int64_t kMaxTile = 256;
constexpr int64_t kTileFloats = 1 << 13;

struct Geometry {
  int64_t n, h, w, c;      // x
  int64_t p, q, f;         // g
  int64_t kh, kw;          // kernel window
  int64_t stride_h, stride_w, top, left;
  int64_t rows() const { return kh * kw * c; }
  int64_t positions() const { return n * p * q; }
  // One image zero-padded so that every window lies inside it: x's (y, z)
  // at (y + top, z + left) of (padded_h, padded_w).
  int64_t padded_h() const { return (p - 1) * stride_h + kh; }
  int64_t padded_w() const { return (q - 1) * stride_w + kw; }
  // Where the window of output (row, col) starts in the padded image.
  int64_t window_at(int64_t row, int64_t col) const { return (row * stride_h * padded_w() + col * stride_w) * c; }
};

Window WindowOf(const Geometry& g) { return {g.kh, g.kw * g.c, g.padded_w() * g.c}; }

// x's image into out (padded_h x padded_w x c), zeros outside x. Rows and
// columns of x that no window reaches are left out.
void PadImage(const float* x, const Geometry& g, int64_t image, float* out) {
  const int64_t width = g.padded_w() * g.c;
  const int64_t first = std::max<int64_t>(0, g.left), last = std::min(g.padded_w(), g.left + g.w);
  for (int64_t row = 0; row < g.padded_h(); ++row, out += width) {
    const int64_t y = row - g.top;
    if (y < 0 || y >= g.h || first >= last) {
      std::fill(out, out + width, 0.0f);
      continue;
    }
    const float* in = x + ((image * g.h + y) * g.w + (first - g.left)) * g.c;
    std::fill(out, out + first * g.c, 0.0f);
    std::copy(in, in + (last - first) * g.c, out + first * g.c);
    std::fill(out + last * g.c, out + width, 0.0f);
  }
}

// sum[e, :] += sum over t < count of x[at[t] + e] * grad[t, :] for the
// window's elements e, in plain loops.
void AddTileScalar(const float* x, const int64_t* at, int64_t count, const Window& w, const float* grad, int64_t f,
                   float* sum, float* scratch) {
  for (int64_t i = 0; i < w.rows; ++i, x += w.row_step) {
    for (int64_t e = 0; e < w.width; ++e, sum += f) {
      std::fill(scratch, scratch + f, 0.0f);
      for (int64_t t = 0; t < count; ++t) {
        const float a = x[at[t] + e];
        const float* b = grad + t * f;
        for (int64_t k = 0; k < f; ++k) scratch[k] += a * b[k];
      }
      for (int64_t k = 0; k < f; ++k) sum[k] += scratch[k];
    }
  }
}

// out[t, :] = the window at x + t * step, dotted with k, for t < count, in
// plain loops.
void ForwardTileScalar(const float* x, int64_t step, int64_t count, const Window& w, const float* k, int64_t f,
                       float* out) {
  for (int64_t t = 0; t < count; ++t, out += f) {
    std::fill(out, out + f, 0.0f);
    const float* row = x + t * step;
    const float* b = k;
    for (int64_t i = 0; i < w.rows; ++i, row += w.row_step)
      for (int64_t e = 0; e < w.width; ++e, b += f)
        for (int64_t j = 0; j < f; ++j) out[j] += row[e] * b[j];
  }
}

// The vector instructions a tile runs in, narrowest first.
enum class Isa { kScalar, kAvx2, kAvx512 };

// The widest set this CPU has, capped by the environment variable
// GBN_CONV_MAX_ISA ("scalar", "avx2" or "avx512"), which lets tests run each
// set on one machine; unset or empty: no cap. known is false for any other
// value (the handlers then fail).
struct CpuIsa {
  bool known;
  Isa isa;
};

CpuIsa DetectIsa() {
  Isa widest = Isa::kScalar;
#ifdef GBN_CONV_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) widest = Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f")) widest = Isa::kAvx512;
#endif
  const char* cap = std::getenv("GBN_CONV_MAX_ISA");
  if (cap == nullptr || *cap == '\0') return {true, widest};
  const std::pair<const char*, Isa> names[] = {{"scalar", Isa::kScalar}, {"avx2", Isa::kAvx2}, {"avx512", Isa::kAvx512}};
  for (const auto& [name, isa] : names)
    if (std::strcmp(cap, name) == 0) return {true, std::min(widest, isa)};
  return {false, widest};
}

ffi::ErrorOr<Isa> Cpu() {
  static const CpuIsa cpu = DetectIsa();
  if (!cpu.known)
    return ffi::Unexpected(ffi::Error::InvalidArgument("GBN_CONV_MAX_ISA must be scalar, avx2, avx512 or unset"));
  return cpu.isa;
}

// The set that computes f outputs per row: the widest whose vectors divide f.
Isa IsaFor(Isa cpu, int64_t f) {
  if (cpu >= Isa::kAvx512 && f % 16 == 0) return Isa::kAvx512;
  if (cpu >= Isa::kAvx2 && f % 8 == 0) return Isa::kAvx2;
  return Isa::kScalar;
}

void KernelGradient(ffi::ThreadPool& pool, Isa cpu, const float* x, const float* grad, const Geometry& g,
                    float* dk) {
  const int64_t size = g.rows() * g.f, positions = g.positions(), per_image = g.p * g.q;
  if (positions == 0) {
    std::fill(dk, dk + size, 0.0f);
    return;
  }
  const int64_t tile = std::clamp<int64_t>(kTileFloats / g.f, 1, kMaxTile);
  const Isa isa = IsaFor(cpu, g.f);
  const Window window = WindowOf(g);
  std::vector<float> sums(size_t(kTasks) * size, 0.0f);
  ParallelFor(pool, kTasks, [&](int task) {
    const int64_t begin = positions * task / kTasks, end = positions * (task + 1) / kTasks;
    std::vector<float> image(size_t(g.padded_h() * g.padded_w() * g.c)), scratch(size_t(g.f));
    std::vector<int64_t> at(static_cast<size_t>(tile));
    float* sum = sums.data() + size_t(task) * size;
    for (int64_t first = begin, padded = -1; first < end;) {
      const int64_t n = first / per_image;
      const int64_t count = std::min({tile, end - first, (n + 1) * per_image - first});
      if (n != padded) PadImage(x, g, padded = n, image.data());
      for (int64_t t = 0; t < count; ++t) {
        const int64_t in_image = first + t - n * per_image;
        at[t] = g.window_at(in_image / g.q, in_image % g.q);
      }
      const float* rows_of_grad = grad + first * g.f;
#ifdef GBN_CONV_X86
      if (isa == Isa::kAvx512) {
        Tiles<Avx512>::AddTile(image.data(), at.data(), count, window, rows_of_grad, g.f, sum);
      } else if (isa == Isa::kAvx2) {
        Tiles<Avx2>::AddTile(image.data(), at.data(), count, window, rows_of_grad, g.f, sum);
      } else
#endif
      {
        AddTileScalar(image.data(), at.data(), count, window, rows_of_grad, g.f, sum, scratch.data());
      }
      first += count;
    }
  });
  for (int64_t e = 0; e < size; ++e) {
    float total = 0.0f;
    for (int task = 0; task < kTasks; ++task) total += sums[size_t(task) * size + e];
    dk[e] = total;
  }
}

void Forward(ffi::ThreadPool& pool, Isa cpu, const float* x, const float* k, const Geometry& g, float* y) {
  const int64_t positions = g.positions(), per_image = g.p * g.q, step = g.stride_w * g.c;
  if (positions == 0) return;
  const Isa isa = IsaFor(cpu, g.f);
  const Window window = WindowOf(g);
  ParallelFor(pool, kTasks, [&](int task) {
    const int64_t begin = positions * task / kTasks, end = positions * (task + 1) / kTasks;
    std::vector<float> image(size_t(g.padded_h() * g.padded_w() * g.c));
    // A run of positions in one output row at a time: their windows are
    // step floats apart.
    for (int64_t first = begin, padded = -1; first < end;) {
      const int64_t n = first / per_image, in_image = first - n * per_image;
      const int64_t row = in_image / g.q, col = in_image % g.q;
      const int64_t count = std::min(end - first, g.q - col);
      if (n != padded) PadImage(x, g, padded = n, image.data());
      const float* windows = image.data() + g.window_at(row, col);
      float* out = y + first * g.f;
#ifdef GBN_CONV_X86
      if (isa == Isa::kAvx512) {
        Tiles<Avx512>::ForwardTile(windows, step, count, window, k, g.f, out);
      } else if (isa == Isa::kAvx2) {
        Tiles<Avx2>::ForwardTile(windows, step, count, window, k, g.f, out);
      } else
#endif
      {
        ForwardTileScalar(windows, step, count, window, k, g.f, out);
      }
      first += count;
    }
  });
}

// Input gradient at any stride: dx[n, y, z, c] = sum over the windows that
// hold (y, z) of g[n, p, q, f] * k[i, j, c, f]. Per image, per output row:
// the row's g times the kernel transposed gives each window's gradient
// (Q x KH*KW*C, the forward's product with one window row of F floats),
// which is added into a zero-padded image at the window; the image's inner
// part is dx's. An image is one task's, so the result does not depend on
// the threads either.
void InputGradient(ffi::ThreadPool& pool, Isa cpu, const float* grad, const float* k, const Geometry& g,
                   float* dx) {
  const int64_t rows = g.rows(), image_size = g.h * g.w * g.c;
  if (g.p * g.q == 0) {
    std::fill(dx, dx + g.n * image_size, 0.0f);
    return;
  }
  std::vector<float> transposed(size_t(rows * g.f));
  for (int64_t e = 0; e < rows; ++e)
    for (int64_t j = 0; j < g.f; ++j) transposed[size_t(j * rows + e)] = k[e * g.f + j];
  const Isa isa = IsaFor(cpu, rows);
  const Window window = WindowOf(g), row_of_grad{1, g.f, 0};
  const int items = int(std::min<int64_t>(kTasks, g.n));
  ParallelFor(pool, items, [&](int task) {
    std::vector<float> image(size_t(g.padded_h() * window.row_step)), windows(size_t(g.q * rows));
    for (int64_t n = g.n * task / items; n < g.n * (task + 1) / items; ++n) {
      std::fill(image.begin(), image.end(), 0.0f);
      for (int64_t row = 0; row < g.p; ++row) {
        const float* g_row = grad + (n * g.p + row) * g.q * g.f;
#ifdef GBN_CONV_X86
        if (isa == Isa::kAvx512) {
          Tiles<Avx512>::ForwardTile(g_row, g.f, g.q, row_of_grad, transposed.data(), rows, windows.data());
        } else if (isa == Isa::kAvx2) {
          Tiles<Avx2>::ForwardTile(g_row, g.f, g.q, row_of_grad, transposed.data(), rows, windows.data());
        } else
#endif
        {
          ForwardTileScalar(g_row, g.f, g.q, row_of_grad, transposed.data(), rows, windows.data());
        }
        for (int64_t col = 0; col < g.q; ++col) {
          float* to = image.data() + g.window_at(row, col);
          const float* from = windows.data() + col * rows;
          for (int64_t i = 0; i < window.rows; ++i, to += window.row_step, from += window.width)
            for (int64_t e = 0; e < window.width; ++e) to[e] += from[e];
        }
      }
      // dx's rows and columns that no window reaches get zeros.
      float* out = dx + n * image_size;
      for (int64_t y = 0; y < g.h; ++y)
        for (int64_t z = 0; z < g.w; ++z, out += g.c) {
          const int64_t row = y + g.top, col = z + g.left;
          if (row < g.padded_h() && col < g.padded_w()) {
            const float* from = image.data() + (row * g.padded_w() + col) * g.c;
            std::copy(from, from + g.c, out);
          } else {
            std::fill(out, out + g.c, 0.0f);
          }
        }
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
  if (top < 0 || left < 0)
    return ffi::Unexpected(ffi::Error::InvalidArgument("the padding before the first row and column must be >= 0"));
  return g;
}

// Runs a kernel, its C++ exceptions turned into FFI errors.
template <typename Kernel>
ffi::Error Guarded(Kernel&& kernel) {
  try {
    kernel();
    return ffi::Error::Success();
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "convolution kernel (train/native/csrc): out of memory");
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "convolution kernel (train/native/csrc) failed");
  }
}

ffi::Error ConvKernelGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> grad,
                              int64_t stride_h, int64_t stride_w, int64_t top, int64_t left,
                              ffi::ResultBuffer<ffi::F32> dk) {
  const auto g = MakeGeometry(x.dimensions(), dk->dimensions(), grad.dimensions(), stride_h, stride_w, top, left);
  if (g.has_error()) return g.error();
  const auto cpu = Cpu();
  if (cpu.has_error()) return cpu.error();
  return Guarded([&] { KernelGradient(pool, cpu.value(), x.typed_data(), grad.typed_data(), g.value(), dk->typed_data()); });
}

ffi::Error ConvForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> k, int64_t stride_h,
                       int64_t stride_w, int64_t top, int64_t left, ffi::ResultBuffer<ffi::F32> y) {
  const auto g = MakeGeometry(x.dimensions(), k.dimensions(), y->dimensions(), stride_h, stride_w, top, left);
  if (g.has_error()) return g.error();
  const auto cpu = Cpu();
  if (cpu.has_error()) return cpu.error();
  return Guarded([&] { Forward(pool, cpu.value(), x.typed_data(), k.typed_data(), g.value(), y->typed_data()); });
}

ffi::Error ConvInputGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> grad, ffi::Buffer<ffi::F32> k,
                             int64_t stride_h, int64_t stride_w, int64_t top, int64_t left,
                             ffi::ResultBuffer<ffi::F32> dx) {
  const auto g = MakeGeometry(dx->dimensions(), k.dimensions(), grad.dimensions(), stride_h, stride_w, top, left);
  if (g.has_error()) return g.error();
  const auto cpu = Cpu();
  if (cpu.has_error()) return cpu.error();
  return Guarded([&] { InputGradient(pool, cpu.value(), grad.typed_data(), k.typed_data(), g.value(), dx->typed_data()); });
}

// The handlers' signature: the thread pool, two operands, the strides and
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(GbnConvInputGradF32, ConvInputGradient, Binding());
