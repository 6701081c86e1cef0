// attnzoo's register-blocked attention block for AVX-512 (float32; softcap, ALiBi): the scores of a
// block of 32 queries are computed transposed, S^T [keys, 32], by a micro-kernel that keeps a tile of
// keys x 32 queries in registers (a key's element broadcast, the queries' column loaded), so that the
// softmax's maximum, exp2 and sum run across the 32 queries in two vectors, masked key tiles are
// skipped, and P V adds into the output rows with a second micro-kernel (a probability broadcast, a
// value row loaded). Used by native_window.cpp's attend_block where it applies; the sgemm form stays
// for the rest (and is what this is tested against, with the PyTorch reference).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native_common.h"

namespace attnzoo_native {

constexpr int FQ = 32;   // queries per sub-block: two vectors
constexpr int FKT = 12;  // keys per score tile: 24 accumulators

// 2^x for a vector (|error| ~1e-7 relative): x = t + f with t an integer, f in [-0.5, 0.5], 2^f by its
// degree-6 Taylor polynomial, times 2^t by vscalefps, which underflows to 0 (or a denormal that the
// kernels' FlushDenormals turns into 0) however negative t is, and overflows to inf however positive:
// no clamp needed.
inline __m512 exp2_v(__m512 x) {
  const __m512 t = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, t);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);  // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));   // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));   // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));     // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));     // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, t);
}

// qt[d * 32 + g * 16 + r] = alpha q[r * ldq + d] for the 16 rows r of group g (rows >= R: zeros) and
// d < D: 16 x 16 blocks transposed in registers (three rounds of shuffles, 64 for 256 values) instead
// of 2 scalar stores a value.
inline void pack_queries(const float* q, int ldq, int64_t R, int D, float alpha, float* qt) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int g = 0; g < FQ / 16; ++g) {
    for (int d0 = 0; d0 < D; d0 += 16) {
      const int nd = std::min(16, D - d0);
      const __mmask16 cols = (__mmask16)((1u << nd) - 1u);
      __m512 r[16], t[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = g * 16 + i;
        r[i] = row < R ? _mm512_mul_ps(_mm512_maskz_loadu_ps(cols, q + row * ldq + d0), a) : _mm512_setzero_ps();
      }
      for (int i = 0; i < 8; ++i) {  // 32-bit interleave of row pairs
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int j = 0; j < 4; ++j) {  // 64-bit interleave: r[4j + m] holds column 4l + m of rows 4j .. 4j + 3 in lane l
        const __m512d x0 = _mm512_castps_pd(t[4 * j]), x1 = _mm512_castps_pd(t[4 * j + 1]);
        const __m512d x2 = _mm512_castps_pd(t[4 * j + 2]), x3 = _mm512_castps_pd(t[4 * j + 3]);
        r[4 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, x2));
        r[4 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x2));
        r[4 * j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, x3));
        r[4 * j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, x3));
      }
      for (int m = 0; m < 4; ++m) {  // gather lane l of r[m], r[4 + m], r[8 + m], r[12 + m]: column 4l + m
        const __m512 c1 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88), c2 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);
        const __m512 e1 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88), e2 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
        const __m512 col[4] = {_mm512_shuffle_f32x4(c1, e1, 0x88), _mm512_shuffle_f32x4(c2, e2, 0x88),
                               _mm512_shuffle_f32x4(c1, e1, 0xdd), _mm512_shuffle_f32x4(c2, e2, 0xdd)};
        for (int l = 0; l < 4; ++l)
          if (4 * l + m < nd) _mm512_storeu_ps(qt + (int64_t)(d0 + 4 * l + m) * FQ + g * 16, col[l]);
      }
    }
  }
}

// The per-score transforms of a call, in log2 units: the softcap (cap > 0: x -> cap log2(e) tanh(x /
// cap), the scores having been scaled without log2 e) and ALiBi (slope2 = slope log2 e: minus slope2
// |i - j| for query i and key j).
struct ScoreMods {
  float cap = 0.f, slope2 = 0.f;
};

// tanh(x) as 1 - 2 / (2^(2 log2(e) x) + 1), the division by a reciprocal estimate and one Newton step.
inline __m512 tanh_v(__m512 x) {
  const __m512 e = _mm512_add_ps(exp2_v(_mm512_mul_ps(x, _mm512_set1_ps(2.8853900817779268f))), _mm512_set1_ps(1.f));
  __m512 r = _mm512_rcp14_ps(e);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(e, r, _mm512_set1_ps(2.f)));  // r (2 - e r)
  return _mm512_fnmadd_ps(_mm512_set1_ps(2.f), r, _mm512_set1_ps(1.f));
}

// Lanes holding an inf or a NaN (vfpclassps: QNaN 0x01, +inf 0x08, -inf 0x10, SNaN 0x80), which
// -ffast-math cannot fold away.
inline __mmask16 nonfinite_v(__m512 x) { return _mm512_fpclass_ps_mask(x, 0x01 | 0x08 | 0x10 | 0x80); }

// The queries (lanes) of a sub-block that see key c: r with i0 + r - left <= c <= i0 + r + right and
// r < R, as two masks.
struct Visible {
  __mmask16 lo, hi;
};
inline Visible visible_of(int64_t c, int64_t i0, int64_t R, int64_t left, int64_t right) {
  const int64_t a = std::max<int64_t>(0, c - right - i0), b = std::min<int64_t>(R, c + left - i0 + 1);  // r in [a, b)
  auto bits = [](int64_t from, int64_t to) -> uint32_t {  // bits from .. to - 1 of 32
    if (to <= from) return 0u;
    const uint64_t span = ((uint64_t)1 << (to - from)) - 1;
    return (uint32_t)(span << from);
  };
  const uint32_t m = bits(a, b);
  return {(__mmask16)(m & 0xffffu), (__mmask16)(m >> 16)};
}

// S^T rows c0 .. c0 + NR - 1 (keys at stride ldk) for the 32 queries of qt [D, 32]: stored into st
// [., 32] with invisible lanes set to `none`; the visible maxima folded into mx0/mx1, non-finite
// visible lanes into bad0/bad1. W says which vectors of queries are computed (1: lanes 0-15, 2: lanes
// 16-31, 3: both); the other is stored as `none` (a masked triangle of the band: no key of the tile is
// visible to it).
template <int NR, int W>
__attribute__((noinline)) void score_tile(const float* k, int ldk, const float* qt, int D, float* st, int64_t c_abs,
                                          int64_t i0, int64_t R, int64_t left, int64_t right, bool full, __m512& mx0,
                                          __m512& mx1, __mmask16& bad0, __mmask16& bad1, const ScoreMods& mods) {
  constexpr bool LO = (W & 1) != 0, HI = (W & 2) != 0;
  __m512 acc0[NR], acc1[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) { acc0[j] = _mm512_setzero_ps(); acc1[j] = _mm512_setzero_ps(); }
  const float* kr[NR];  // the keys' rows: one base register each, no index arithmetic in the loop
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) kr[j] = k + (int64_t)j * ldk;
  for (int64_t d = 0; d < D; ++d) {
    const float* qd = qt + d * FQ;
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const __m512 kb = _mm512_set1_ps(kr[j][d]);
      if constexpr (LO) acc0[j] = _mm512_fmadd_ps(kb, _mm512_loadu_ps(qd), acc0[j]);
      if constexpr (HI) acc1[j] = _mm512_fmadd_ps(kb, _mm512_loadu_ps(qd + 16), acc1[j]);
    }
  }
  const __m512 none = _mm512_set1_ps(-3.0e38f);
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
    __m512 s0 = LO ? acc0[j] : none, s1 = HI ? acc1[j] : none;
    if (full) {
      bad0 |= nonfinite_v(s0);
      bad1 |= nonfinite_v(s1);
    } else {
      const Visible vis = visible_of(c_abs + j, i0, R, left, right);
      if constexpr (LO) bad0 |= nonfinite_v(s0) & vis.lo;
      if constexpr (HI) bad1 |= nonfinite_v(s1) & vis.hi;
    }
    if (mods.cap > 0.f) {  // tested for inf / NaN first: the cap would bound them
      const __m512 inv = _mm512_set1_ps(1.f / mods.cap), c2 = _mm512_set1_ps(mods.cap * 1.4426950408889634f);
      if constexpr (LO) s0 = _mm512_mul_ps(c2, tanh_v(_mm512_mul_ps(s0, inv)));
      if constexpr (HI) s1 = _mm512_mul_ps(c2, tanh_v(_mm512_mul_ps(s1, inv)));
    }
    if (mods.slope2 != 0.f) {  // minus slope2 |i - j|: lane r is query i0 + r
      const __m512 at = _mm512_set1_ps((float)(i0 - (c_abs + j))), sl = _mm512_set1_ps(mods.slope2);
      const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      if constexpr (LO) s0 = _mm512_fnmadd_ps(sl, _mm512_abs_ps(_mm512_add_ps(lanes, at)), s0);
      if constexpr (HI) s1 = _mm512_fnmadd_ps(sl, _mm512_abs_ps(_mm512_add_ps(_mm512_add_ps(lanes, _mm512_set1_ps(16.f)), at)), s1);
    }
    if (!full) {
      const Visible vis = visible_of(c_abs + j, i0, R, left, right);
      if constexpr (LO) s0 = _mm512_mask_blend_ps(vis.lo, none, s0);
      if constexpr (HI) s1 = _mm512_mask_blend_ps(vis.hi, none, s1);
    }
    if constexpr (LO) mx0 = _mm512_max_ps(mx0, s0);
    if constexpr (HI) mx1 = _mm512_max_ps(mx1, s1);
    _mm512_storeu_ps(st + j * FQ, s0);
    _mm512_storeu_ps(st + j * FQ + 16, s1);
  }
}

template <int NR>
inline void score_tile_of(int w, const float* k, int ldk, const float* qt, int D, float* st, int64_t c_abs, int64_t i0,
                          int64_t R, int64_t left, int64_t right, bool full, __m512& mx0, __m512& mx1,
                          __mmask16& bad0, __mmask16& bad1, const ScoreMods& mods) {
  if (w == 3) score_tile<NR, 3>(k, ldk, qt, D, st, c_abs, i0, R, left, right, full, mx0, mx1, bad0, bad1, mods);
  else if (w == 1) score_tile<NR, 1>(k, ldk, qt, D, st, c_abs, i0, R, left, right, full, mx0, mx1, bad0, bad1, mods);
  else score_tile<NR, 2>(k, ldk, qt, D, st, c_abs, i0, R, left, right, full, mx0, mx1, bad0, bad1, mods);
}

// out rows 0 .. ROWS - 1 (stride ldo, NV vectors wide) += sum over keys c in [0, L) of P^T[c, r0 + i]
// v[c, :] (pt [., 32], v at stride ldv); beta = false starts the rows from zero.
template <int NV, int ROWS>
__attribute__((noinline)) void pv_tile(const float* pt, int r0, const float* v, int ldv, int64_t L, float* o, int ldo,
                                       bool beta) {
  __m512 acc[ROWS][NV];
#pragma GCC unroll 16
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[i][j] = beta ? _mm512_loadu_ps(o + i * ldo + 16 * j) : _mm512_setzero_ps();
  const float* p_c = pt + r0;  // P^T[c, r0 ..] and v[c, :], advanced a key at a time
  const float* v_c = v;
  for (int64_t c = 0; c < L; ++c, p_c += FQ, v_c += ldv) {
    __m512 vr[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) vr[j] = _mm512_loadu_ps(v_c + 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < ROWS; ++i) {
      const __m512 p = _mm512_set1_ps(p_c[i]);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(p, vr[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + i * ldo + 16 * j, acc[i][j]);
}

// Output rows per P V tile of NV vectors: 24 accumulators (6 rows of 64 values, 3 of 128), at most 12
// rows (measured on the AMX Xeon: 6 rows of 64 values 3-5% faster than 4, docs/performance.md).
template <int NV>
constexpr int pv_rows_of() { return NV >= 8 ? 3 : std::min(12, 24 / NV); }

template <int NV>
inline void pv_tile_n(int rows, const float* pt, int r0, const float* v, int ldv, int64_t L, float* o, int ldo,
                      bool beta) {
  constexpr int ROWS = pv_rows_of<NV>();
  static_assert(ROWS > 2, "tiles of 2 and 1 rows take the rest");
  if (rows == ROWS) pv_tile<NV, ROWS>(pt, r0, v, ldv, L, o, ldo, beta);
  else if (ROWS > 4 && rows == 4) pv_tile<NV, (ROWS > 4 ? 4 : 1)>(pt, r0, v, ldv, L, o, ldo, beta);
  else if (rows == 2) pv_tile<NV, 2>(pt, r0, v, ldv, L, o, ldo, beta);
  else pv_tile<NV, 1>(pt, r0, v, ldv, L, o, ldo, beta);
}

// Rows 0 .. R - 1 of out (NV vectors wide) += P^T V over keys [0, L) of a chunk: tiles of
// pv_rows_of<NV>() rows, the rest by four, two and one. Row r sees the chunk's keys r + base - left ..
// r + base + right (base: its first query minus the chunk's first key), and a tile runs over its rows'
// keys only (a band's masked triangles are skipped). Keys in blocks whose value rows (about 24 KB)
// stay in the L1 cache across the row tiles; beta = false starts the rows from zero.
template <int NV>
inline void pv_rows(const float* pt, int64_t R, const float* v, int ldv, int64_t L, float* o, int ldo, bool beta,
                    int64_t base, int64_t left, int64_t right) {
  constexpr int ROWS = pv_rows_of<NV>();
  constexpr int64_t KB = std::max(16, 384 / NV);
  int t_r[FQ], t_n[FQ], nt = 0;
  bool started[FQ];
  for (int r = 0; r < R;) {  // 32 rows of 64 values: 6, 6, 6, 6, 4, 4 (a 4-row tile is cheaper than 2 + 2)
    const int left_rows = (int)R - r;
    constexpr int FOUR = ROWS > 4 ? 4 : 0;  // a 4-row tile where it has fewer accumulators than ROWS
    const int n = left_rows == ROWS || left_rows >= ROWS + FOUR ? ROWS
                  : (FOUR && left_rows >= 4 ? 4 : (left_rows >= 2 ? 2 : 1));
    t_r[nt] = r;
    t_n[nt] = n;
    started[nt++] = beta;
    r += n;
  }
  for (int64_t c = 0; c < L; c += KB) {
    const int64_t c_end = std::min(L, c + KB);
    for (int t = 0; t < nt; ++t) {
      const int64_t lo = std::max(c, t_r[t] + base - left), hi = std::min(c_end, t_r[t] + t_n[t] + base + right);
      if (hi <= lo) continue;
      pv_tile_n<NV>(t_n[t], pt + lo * FQ, t_r[t], v + lo * ldv, ldv, hi - lo, o + t_r[t] * ldo, ldo, started[t]);
      started[t] = true;
    }
  }
  for (int t = 0; t < nt; ++t)  // rows that saw no key of the chunk and had nothing before
    if (!started[t])
      for (int i = 0; i < t_n[t]; ++i) std::fill(o + (t_r[t] + i) * ldo, o + (t_r[t] + i) * ldo + 16 * NV, 0.f);
}

// Per-thread buffers of fused_block: the transposed queries and scores, the running maximum / sum.
struct FusedScratch {
  std::vector<float> qt, st;
  alignas(64) float m[FQ], l[FQ], a[FQ];
  FusedScratch(int D, int64_t chunk) : qt((size_t)D * FQ), st((size_t)chunk * FQ) {}
};

// Whether fused_block serves a call: value width 16 .. 128 in vectors of 16.
inline bool fused_applies(int Dv) { return Dv % 16 == 0 && Dv >= 16 && Dv <= 128; }

// One sub-block of R <= 32 queries (query i0 + r: row r of q, stride ldq) against keys k_lo .. k_hi - 1
// (rows of k / v at strides ldk / ldv; query i sees keys i - left .. i + right, at least one of them),
// keys in chunks of `chunk` with a running maximum. Writes R output rows (stride ldo, Dv wide) and R
// natural-log LSEs; a row that saw an inf or a NaN score is NaN with its LSE. Returns whether every
// output value written is finite (a NaN value row that some row's probabilities reach shows here).
inline bool fused_block(const float* q, int ldq, const float* k, int ldk, const float* v, int ldv, float* o, int ldo,
                        float* lse, int64_t R, int64_t i0, int64_t k_lo, int64_t k_hi, int64_t left, int64_t right,
                        int D, int Dv, float alpha, int64_t chunk, FusedScratch& w, const ScoreMods& mods) {
  float* qt = w.qt.data();
  pack_queries(q, ldq, R, D, alpha, qt);
  const __m512 none = _mm512_set1_ps(-3.0e38f);
  __m512 m0 = none, m1 = none, l0 = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
  __mmask16 bad0 = 0, bad1 = 0;
  // keys any of the R queries sees
  const int64_t lo_all = std::max(k_lo, i0 - left), hi_all = std::min(k_hi, i0 + R + right);
  bool first = true;
  for (int64_t c0 = lo_all; c0 < hi_all; c0 += chunk) {
    const int64_t c1 = std::min(hi_all, c0 + chunk);
    float* st = w.st.data();  // st[(c - c0) * FQ]: key c of the chunk
    __m512 mx0 = none, mx1 = none;
    for (int64_t c = c0; c < c1; c += FKT) {
      const int nr = (int)std::min<int64_t>(FKT, c1 - c);
      // every lane r < R of the tile sees every key of it: no masking
      const bool full = c >= i0 + R - 1 - left && c + nr - 1 <= i0 + right && R == FQ;
      // the lanes some key of the tile is visible to: [c - right - i0, c + nr - 1 + left - i0]
      const int64_t lane_lo = c - right - i0, lane_hi = c + nr - 1 + left - i0;
      const int lanes = (lane_lo <= 15 && lane_hi >= 0 ? 1 : 0) | (R > 16 && lane_lo <= R - 1 && lane_hi >= 16 ? 2 : 0);
      if (lanes == 0) {  // no lane sees the tile (cannot happen for a band; kept exact)
        for (int j = 0; j < nr * FQ; ++j) st[(c - c0) * FQ + j] = -3.0e38f;
        continue;
      }
      const float* kc = k + (c - k_lo) * ldk;
      switch (nr) {
#define ATTNZOO_TILE(n) case n: score_tile_of<n>(lanes, kc, ldk, qt, D, st + (c - c0) * FQ, c, i0, R, left, right, full, mx0, mx1, bad0, bad1, mods); break;
        ATTNZOO_TILE(1) ATTNZOO_TILE(2) ATTNZOO_TILE(3) ATTNZOO_TILE(4) ATTNZOO_TILE(5) ATTNZOO_TILE(6)
        ATTNZOO_TILE(7) ATTNZOO_TILE(8) ATTNZOO_TILE(9) ATTNZOO_TILE(10) ATTNZOO_TILE(11) ATTNZOO_TILE(12)
#undef ATTNZOO_TILE
      }
    }
    // a lane with no visible key so far keeps `none` as its maximum: shifting by -1e38 instead turns
    // its scores (`none`) into 2^-2e38 = 0 rather than 2^0
    const __m512 floor = _mm512_set1_ps(-1.0e38f);
    const __m512 n0 = _mm512_max_ps(_mm512_max_ps(m0, mx0), floor), n1 = _mm512_max_ps(_mm512_max_ps(m1, mx1), floor);
    const __m512 a0 = exp2_v(_mm512_sub_ps(m0, n0)), a1 = exp2_v(_mm512_sub_ps(m1, n1));
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int64_t c = 0; c < c1 - c0; ++c) {  // an invisible lane's score `none` gives 2^(none - max) = 0
      const __m512 p0 = exp2_v(_mm512_sub_ps(_mm512_loadu_ps(st + c * FQ), n0));
      const __m512 p1 = exp2_v(_mm512_sub_ps(_mm512_loadu_ps(st + c * FQ + 16), n1));
      s0 = _mm512_add_ps(s0, p0);
      s1 = _mm512_add_ps(s1, p1);
      _mm512_storeu_ps(st + c * FQ, p0);
      _mm512_storeu_ps(st + c * FQ + 16, p1);
    }
    l0 = _mm512_fmadd_ps(l0, a0, s0);
    l1 = _mm512_fmadd_ps(l1, a1, s1);
    m0 = n0;
    m1 = n1;
    if (!first) {  // rescale the rows of the earlier chunks
      _mm512_store_ps(w.a, a0);
      _mm512_store_ps(w.a + 16, a1);
      for (int64_t r = 0; r < R; ++r)
        for (int c = 0; c < Dv; c += 16)
          _mm512_storeu_ps(o + r * ldo + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + c), _mm512_set1_ps(w.a[r])));
    }
    const float* vc = v + (c0 - k_lo) * ldv;
    const int64_t L = c1 - c0;
    switch (Dv / 16) {
      case 1: pv_rows<1>(st, R, vc, ldv, L, o, ldo, !first, i0 - c0, left, right); break;
      case 2: pv_rows<2>(st, R, vc, ldv, L, o, ldo, !first, i0 - c0, left, right); break;
      case 3: pv_rows<3>(st, R, vc, ldv, L, o, ldo, !first, i0 - c0, left, right); break;
      case 4: pv_rows<4>(st, R, vc, ldv, L, o, ldo, !first, i0 - c0, left, right); break;
      case 5: pv_rows<5>(st, R, vc, ldv, L, o, ldo, !first, i0 - c0, left, right); break;
      case 6: pv_rows<6>(st, R, vc, ldv, L, o, ldo, !first, i0 - c0, left, right); break;
      case 7: pv_rows<7>(st, R, vc, ldv, L, o, ldo, !first, i0 - c0, left, right); break;
      default: pv_rows<8>(st, R, vc, ldv, L, o, ldo, !first, i0 - c0, left, right);
    }
    first = false;
  }
  _mm512_store_ps(w.m, m0);
  _mm512_store_ps(w.m + 16, m1);
  _mm512_store_ps(w.l, l0);
  _mm512_store_ps(w.l + 16, l1);
  const uint32_t bad = (uint32_t)bad0 | ((uint32_t)bad1 << 16);
  __mmask16 nonfinite = 0;
  for (int64_t r = 0; r < R; ++r) {
    float* orow = o + r * ldo;
    if (bad >> r & 1u) {
      lse[r] = nan_value();
      std::fill(orow, orow + Dv, nan_value());
      nonfinite = 1;
      continue;
    }
    lse[r] = (w.m[r] + std::log2(w.l[r])) * 0.6931471805599453f;
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
    for (int c = 0; c < Dv; c += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(orow + c), inv);
      nonfinite |= nonfinite_v(x);
      _mm512_storeu_ps(orow + c, x);
    }
  }
  return nonfinite == 0;
}

}  // namespace attnzoo_native
#endif
