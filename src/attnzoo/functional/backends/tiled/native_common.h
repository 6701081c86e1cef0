// What attnzoo's compiled kernels share (native_window.cpp, native_nsa.cpp): BLAS sgemm (the sgemm_
// that torch's x86 CPU wheels export from MKL) and the denormal guard of their parallel regions.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <xmmintrin.h>

extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*, const int*);

namespace attnzoo_native {

// Column-major BLAS: C = alpha op(A) op(B) + beta C.
inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                 int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Denormal results of exp2f (scores far below their row's maximum, e.g. under ALiBi) cost ~100 cycles
// each on x86: flushed to zero while a kernel's thread runs (a shared library is not linked with
// -ffast-math's start-up code that would set this), the thread's previous mode restored after.
struct FlushDenormals {
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// 2^x for x clamped to [-127, 127]: glibc's vectorised exp2f leaves SIMD for a scalar fallback on every
// lane out of that range (a row's scores far below its maximum, e.g. under ALiBi, or a softcap's
// saturated tanh); 2^-127 is a denormal that FlushDenormals turns into 0, 2^127 saturates the tanh.
inline float exp2_clamped(float x) { return exp2f(std::min(std::max(x, -120.f), 120.f)); }

// Whether x[0 .. n - 1] hold an inf or a NaN, read from their bits: under -ffast-math the compiler may
// assume neither exists and fold float tests (x != x, isnan) away, and the clamp above turns a NaN
// into a finite number. A row whose scores are not all finite (a NaN or inf in its query or in a
// key it sees, or an overflowing product) is returned as NaN, as docs/conventions.md asks.
inline bool any_nonfinite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    bad |= (uint32_t)((b & 0x7f800000u) == 0x7f800000u);
  }
  return bad != 0;
}

// A quiet NaN from its bits (a NaN constant is not trusted under -ffast-math).
inline float nan_value() {
  const uint32_t b = 0x7fc00000u;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

}  // namespace attnzoo_native
