// The register tiles of conv_cpu.cc's matrix products, written once for
// every vector instruction set as templates on a traits struct Isa, which
// defines:
//   Vec and kLanes, a vector register and the floats it holds;
//   kMaxRows, the rows a block keeps in registers (accumulators, the
//     kernel's or gradient's vectors and one broadcast must fit);
//   Zero(), Load(p), Store(p, v), Broadcast(p), MulAdd(a, b, c) (a * b + c,
//     rounded once) and Add(a, b).
// conv_tiles_x86.cc instantiates them for AVX2 + FMA and for AVX-512, in a
// translation unit compiled for each set. The products read the windows
// straight from a padded image: no copy of the patches. AddTile is the
// kernel gradient's; ForwardTile the forward pass's and, with the output
// gradient's rows as the windows and the kernel transposed, the input
// gradient's at any stride. Each output is one lane of one accumulator,
// summed term by term in the same order whatever the set, the block or the
// lane: every set gives the same bits.
#ifndef GBN_TRAIN_CSRC_CONV_TILES_H_
#define GBN_TRAIN_CSRC_CONV_TILES_H_

#include <cstdint>

#include "conv_isa.h"

namespace gbn_train::tiles {

// acc = 0, the R x V accumulators of a block.
template <class Isa, int R, int V>
__attribute__((always_inline)) inline void ZeroBlock(typename Isa::Vec (&acc)[R][V]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = Isa::Zero();
}

// acc[r, :] += a[r * a_step + a_offset] * b[:] for r < R: one term of every
// output of a block, the V vectors of b loaded once and each a broadcast once.
template <class Isa, int R, int V>
__attribute__((always_inline)) inline void MulAddBlock(const float* a, int64_t a_step, int64_t a_offset,
                                                       const float* b, typename Isa::Vec (&acc)[R][V]) {
  typename Isa::Vec row[V];
#pragma GCC unroll 2
  for (int v = 0; v < V; ++v) row[v] = Isa::Load(b + Isa::kLanes * v);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const typename Isa::Vec broadcast = Isa::Broadcast(a + r * a_step + a_offset);
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = Isa::MulAdd(broadcast, row[v], acc[r][v]);
  }
}

// sum[r, :] += sum over t < count of x[at[t] + r] * grad[t, :], for R rows
// of the kernel gradient (consecutive floats of one window row) and V
// vectors of outputs.
template <class Isa, int R, int V>
__attribute__((always_inline)) inline void AddBlock(const float* x, const int64_t* at, int64_t count, const float* grad,
                                                    int64_t f, float* sum) {
  typename Isa::Vec acc[R][V];
  ZeroBlock<Isa, R, V>(acc);
  for (int64_t t = 0; t < count; ++t, grad += f) MulAddBlock<Isa, R, V>(x + at[t], 1, 0, grad, acc);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      float* out = sum + r * f + Isa::kLanes * v;
      Isa::Store(out, Isa::Add(Isa::Load(out), acc[r][v]));
    }
}

// out[r, :] = the window at x + r * step, dotted with k, for R positions
// and V vectors of outputs; summed over the window in (row, column, channel)
// order, the kernel's.
template <class Isa, int R, int V>
__attribute__((always_inline)) inline void ForwardBlock(const float* x, int64_t step, const Window& w, const float* k,
                                                        int64_t f, float* out) {
  typename Isa::Vec acc[R][V];
  ZeroBlock<Isa, R, V>(acc);
  for (int64_t i = 0; i < w.rows; ++i, x += w.row_step) {
    for (int64_t e = 0; e < w.width; ++e, k += f) MulAddBlock<Isa, R, V>(x, step, e, k, acc);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) Isa::Store(out + r * f + Isa::kLanes * v, acc[r][v]);
}

// R rows of the kernel gradient, all f outputs (f a multiple of Isa::kLanes).
template <class Isa, int R>
void AddRows(const float* x, const int64_t* at, int64_t count, const float* grad, int64_t f, float* sum) {
  int64_t k = 0;
  for (; k + 2 * Isa::kLanes <= f; k += 2 * Isa::kLanes) AddBlock<Isa, R, 2>(x, at, count, grad + k, f, sum + k);
  if (k < f) AddBlock<Isa, R, 1>(x, at, count, grad + k, f, sum + k);
}

// R positions of the forward, all f outputs (f a multiple of Isa::kLanes).
template <class Isa, int R>
void ForwardRows(const float* x, int64_t step, const Window& w, const float* k, int64_t f, float* out) {
  int64_t j = 0;
  for (; j + 2 * Isa::kLanes <= f; j += 2 * Isa::kLanes) ForwardBlock<Isa, R, 2>(x, step, w, k + j, f, out + j);
  if (j < f) ForwardBlock<Isa, R, 1>(x, step, w, k + j, f, out + j);
}

// AddRows<rest> for a rest below R (a block size known when compiled).
template <class Isa, int R>
void AddLastRows(int64_t rest, const float* x, const int64_t* at, int64_t count, const float* grad, int64_t f,
                 float* sum) {
  if constexpr (R > 0) {
    if (rest == R) return AddRows<Isa, R>(x, at, count, grad, f, sum);
    AddLastRows<Isa, R - 1>(rest, x, at, count, grad, f, sum);
  }
}

template <class Isa, int R>
void ForwardLastRows(int64_t rest, const float* x, int64_t step, const Window& w, const float* k, int64_t f,
                     float* out) {
  if constexpr (R > 0) {
    if (rest == R) return ForwardRows<Isa, R>(x, step, w, k, f, out);
    ForwardLastRows<Isa, R - 1>(rest, x, step, w, k, f, out);
  }
}

// sum (w.rows * w.width, f) += the windows at x + at[t] (t < count), as
// rows, transposed, times grad (count, f), for f a multiple of Isa::kLanes:
// Isa::kMaxRows rows of a window row at a time, then the rest.
template <class Isa>
void AddTile(const float* x, const int64_t* at, int64_t count, const Window& w, const float* grad, int64_t f,
             float* sum) {
  for (int64_t i = 0; i < w.rows; ++i, x += w.row_step, sum += w.width * f) {
    int64_t e = 0;
    for (; e + Isa::kMaxRows <= w.width; e += Isa::kMaxRows)
      AddRows<Isa, Isa::kMaxRows>(x + e, at, count, grad, f, sum + e * f);
    AddLastRows<Isa, Isa::kMaxRows - 1>(w.width - e, x + e, at, count, grad, f, sum + e * f);
  }
}

// out (count, f) = the windows at x + t * step (t < count), as rows, times
// k (w.rows * w.width, f), for f a multiple of Isa::kLanes: Isa::kMaxRows
// positions at a time, then the rest.
template <class Isa>
void ForwardTile(const float* x, int64_t step, int64_t count, const Window& w, const float* k, int64_t f,
                 float* out) {
  int64_t t = 0;
  for (; t + Isa::kMaxRows <= count; t += Isa::kMaxRows)
    ForwardRows<Isa, Isa::kMaxRows>(x + t * step, step, w, k, f, out + t * f);
  ForwardLastRows<Isa, Isa::kMaxRows - 1>(count - t, x + t * step, step, w, k, f, out + t * f);
}

}  // namespace gbn_train::tiles

#endif  // GBN_TRAIN_CSRC_CONV_TILES_H_
