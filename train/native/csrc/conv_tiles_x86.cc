// The register tiles (conv_tiles.h) in one x86 instruction set, as the
// Tiles<Set> that conv_isa.h declares. train/native/build.py compiles this
// file twice, with -mavx2 -mfma (AVX2 + FMA: 16 ymm registers, 6 rows x 2
// vectors of accumulators) and with -mavx512f (AVX-512: 32 zmm registers,
// 12 rows x 2 vectors), and conv_cpu.cc calls the set the CPU has at run
// time. A target flag for the whole file, not a target attribute per
// function: a template cannot take its attributes from its parameters.
// Nothing here but Tiles' members has external linkage (the traits are in an
// unnamed namespace, so are the templates' instances, and no function of a
// standard header is used): an inline function compiled for AVX-512 here
// could otherwise be the copy the linker keeps for the plain code too.
#include "conv_isa.h"

#ifdef GBN_CONV_X86
#include <immintrin.h>

#include <cstdint>

#include "conv_tiles.h"

namespace gbn_train {
namespace {

#if defined(__AVX512F__)
using ThisSet = Avx512;
struct Isa {
  using Vec = __m512;
  static constexpr int kLanes = 16, kMaxRows = 12;
  static Vec Zero() { return _mm512_setzero_ps(); }
  static Vec Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vec MulAdd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
};
#elif defined(__AVX2__) && defined(__FMA__)
// Like the AVX-512 Isa above: the same traits, each set's own intrinsics and
// widths.
using ThisSet = Avx2;
struct Isa {
  using Vec = __m256;
  static constexpr int kLanes = 8, kMaxRows = 6;
  static Vec Zero() { return _mm256_setzero_ps(); }
  static Vec Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec MulAdd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
};
#else
#error "conv_tiles_x86.cc is compiled with -mavx512f or with -mavx2 -mfma"
#endif

}  // namespace

// Isa is this file's set: Tiles<ThisSet> is the one instance made here.
template <class Set>
void Tiles<Set>::AddTile(const float* x, const int64_t* at, int64_t count, const Window& w, const float* grad,
                         int64_t f, float* sum) {
  tiles::AddTile<Isa>(x, at, count, w, grad, f, sum);
}

template <class Set>
void Tiles<Set>::ForwardTile(const float* x, int64_t step, int64_t count, const Window& w, const float* k,
                             int64_t f, float* out) {
  tiles::ForwardTile<Isa>(x, step, count, w, k, f, out);
}

template struct Tiles<ThisSet>;

}  // namespace gbn_train
#endif  // GBN_CONV_X86
