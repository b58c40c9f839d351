// The register tiles of conv_cpu.cc's two matrix products, written once for
// every vector instruction set. conv_cpu.cc includes this file once per set
// (hence no include guard), inside a namespace of its own that defines:
//   GBN_TILE: the set's function attributes (a target attribute);
//   Vec and kLanes, a vector register and the floats it holds;
//   kMaxRows, the rows a block keeps in registers (accumulators, the
//     kernel's or gradient's vectors and one broadcast must fit);
//   Zero(), Load(p), Store(p, v), Broadcast(p), MulAdd(a, b, c) (a * b + c,
//     rounded once) and Add(a, b).
// and, before it, Window (conv_cpu.cc). The products read the windows
// straight from a padded image: no copy of the patches. Each output is one
// lane of one accumulator, summed term by term in the same order whatever
// the set, the block or the lane: every set gives the same bits.

// sum[r, :] += sum over t < count of x[at[t] + r] * grad[t, :], for R rows
// of the kernel gradient (consecutive floats of one window row) and V
// vectors of outputs.
template <int R, int V>
GBN_TILE __attribute__((always_inline)) inline void AddBlock(const float* x, const int64_t* at, int64_t count,
                                                             const float* grad, int64_t f, float* sum) {
  Vec acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = Zero();
  for (int64_t t = 0; t < count; ++t, grad += f) {
    const float* window = x + at[t];
    Vec b[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) b[v] = Load(grad + kLanes * v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec a = Broadcast(window + r);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = MulAdd(a, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      float* out = sum + r * f + kLanes * v;
      Store(out, Add(Load(out), acc[r][v]));
    }
}

// out[r, :] = the window at x + r * step, dotted with k, for R positions
// and V vectors of outputs; summed over the window in (row, column, channel)
// order, the kernel's.
template <int R, int V>
GBN_TILE __attribute__((always_inline)) inline void ForwardBlock(const float* x, int64_t step, const Window& w,
                                                                 const float* k, int64_t f, float* out) {
  Vec acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = Zero();
  for (int64_t i = 0; i < w.rows; ++i, x += w.row_step) {
    for (int64_t e = 0; e < w.width; ++e, k += f) {
      Vec b[V];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) b[v] = Load(k + kLanes * v);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Vec a = Broadcast(x + r * step + e);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) acc[r][v] = MulAdd(a, b[v], acc[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) Store(out + r * f + kLanes * v, acc[r][v]);
}

// R rows of the kernel gradient, all f outputs (f a multiple of kLanes).
template <int R>
GBN_TILE void AddRows(const float* x, const int64_t* at, int64_t count, const float* grad, int64_t f, float* sum) {
  int64_t k = 0;
  for (; k + 2 * kLanes <= f; k += 2 * kLanes) AddBlock<R, 2>(x, at, count, grad + k, f, sum + k);
  if (k < f) AddBlock<R, 1>(x, at, count, grad + k, f, sum + k);
}

// R positions of the forward, all f outputs (f a multiple of kLanes).
template <int R>
GBN_TILE void ForwardRows(const float* x, int64_t step, const Window& w, const float* k, int64_t f, float* out) {
  int64_t j = 0;
  for (; j + 2 * kLanes <= f; j += 2 * kLanes) ForwardBlock<R, 2>(x, step, w, k + j, f, out + j);
  if (j < f) ForwardBlock<R, 1>(x, step, w, k + j, f, out + j);
}

// AddRows<rest> for a rest below R (a block size known when compiled).
template <int R>
GBN_TILE void AddLastRows(int64_t rest, const float* x, const int64_t* at, int64_t count, const float* grad,
                          int64_t f, float* sum) {
  if constexpr (R > 0) {
    if (rest == R) return AddRows<R>(x, at, count, grad, f, sum);
    AddLastRows<R - 1>(rest, x, at, count, grad, f, sum);
  }
}

template <int R>
GBN_TILE void ForwardLastRows(int64_t rest, const float* x, int64_t step, const Window& w, const float* k,
                              int64_t f, float* out) {
  if constexpr (R > 0) {
    if (rest == R) return ForwardRows<R>(x, step, w, k, f, out);
    ForwardLastRows<R - 1>(rest, x, step, w, k, f, out);
  }
}

// sum (w.rows * w.width, f) += the windows at x + at[t] (t < count), as
// rows, transposed, times grad (count, f), for f a multiple of kLanes:
// kMaxRows rows of a window row at a time, then the rest.
GBN_TILE void AddTile(const float* x, const int64_t* at, int64_t count, const Window& w, const float* grad,
                      int64_t f, float* sum) {
  for (int64_t i = 0; i < w.rows; ++i, x += w.row_step, sum += w.width * f) {
    int64_t e = 0;
    for (; e + kMaxRows <= w.width; e += kMaxRows) AddRows<kMaxRows>(x + e, at, count, grad, f, sum + e * f);
    AddLastRows<kMaxRows - 1>(w.width - e, x + e, at, count, grad, f, sum + e * f);
  }
}

// out (count, f) = the windows at x + t * step (t < count), as rows, times
// k (w.rows * w.width, f), for f a multiple of kLanes: kMaxRows positions at
// a time, then the rest.
GBN_TILE void ForwardTile(const float* x, int64_t step, int64_t count, const Window& w, const float* k, int64_t f,
                          float* out) {
  int64_t t = 0;
  for (; t + kMaxRows <= count; t += kMaxRows) ForwardRows<kMaxRows>(x + t * step, step, w, k, f, out + t * f);
  ForwardLastRows<kMaxRows - 1>(count - t, x + t * step, step, w, k, f, out + t * f);
}
