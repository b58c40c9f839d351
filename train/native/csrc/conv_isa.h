// What conv_cpu.cc calls in each x86 instruction set: the register tiles of
// its two matrix products (conv_tiles.h), compiled once per set in
// conv_tiles_x86.cc (with -mavx2 -mfma, and with -mavx512f). GBN_CONV_X86 is
// defined where the compiler targets x86-64; elsewhere only conv_cpu.cc's
// plain loops exist.
#ifndef GBN_TRAIN_CSRC_CONV_ISA_H_
#define GBN_TRAIN_CSRC_CONV_ISA_H_

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#define GBN_CONV_X86 1
#endif

namespace gbn_train {

// A window in a padded image: rows of width consecutive floats (KW*C),
// row_step floats apart.
struct Window {
  int64_t rows, width, row_step;
};

#ifdef GBN_CONV_X86
// The instruction sets the tiles are compiled for.
struct Avx2 {};    // AVX2 + FMA
struct Avx512 {};  // AVX-512F

// The tiles in one set (f a multiple of its vector width, 8 floats in AVX2,
// 16 in AVX-512):
//   AddTile: sum (w.rows * w.width, f) += the windows at x + at[t]
//     (t < count), as rows, transposed, times grad (count, f);
//   ForwardTile: out (count, f) = the windows at x + t * step (t < count),
//     as rows, times k (w.rows * w.width, f).
// Instantiated in conv_tiles_x86.cc, once per set; hidden, so that
// conv_cpu.cc calls them directly, as when they were one file.
template <class Set>
struct __attribute__((visibility("hidden"))) Tiles {
  static void AddTile(const float* x, const int64_t* at, int64_t count, const Window& w, const float* grad, int64_t f,
                      float* sum);
  static void ForwardTile(const float* x, int64_t step, int64_t count, const Window& w, const float* k, int64_t f,
                          float* out);
};
extern template struct Tiles<Avx2>;
extern template struct Tiles<Avx512>;
#endif

}  // namespace gbn_train

#endif  // GBN_TRAIN_CSRC_CONV_ISA_H_
