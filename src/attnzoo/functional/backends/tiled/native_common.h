// What attnzoo's compiled kernels share (native_window.cpp, native_nsa.cpp): BLAS sgemm (the sgemm_
// that torch's x86 CPU wheels export from MKL) and the denormal guard of their parallel regions.
#pragma once
#include <algorithm>
#include <cmath>
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

}  // namespace attnzoo_native
