// attnzoo's compiled attention forward (float32, CPU: full, causal, sliding windows, softcap); built by
// `attnzoo native --build`. Reference: attnzoo.functional.backends.tiled (PyTorch); see tiled/native.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <atomic>
#include <limits>
#include <memory>
#include <vector>

#include "native_common.h"
#include "native_fused.h"

using attnzoo_native::FlushDenormals;
using attnzoo_native::any_nonfinite;
using attnzoo_native::exp2_clamped;
using attnzoo_native::gemm;
using attnzoo_native::nan_value;

// The output and log-sum-exp tensors of a call and the raw pointers the blocks read and write.
struct Buffers {
  at::Tensor out, lse;
  const float *qp, *kp, *vp;
  float *op, *lp;
  Buffers(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef out_shape,
          at::IntArrayRef lse_shape)
      : out(at::empty(out_shape, q.options())), lse(at::empty(lse_shape, q.options())),
        qp(q.data_ptr<float>()), kp(k.data_ptr<float>()), vp(v.data_ptr<float>()),
        op(out.data_ptr<float>()), lp(lse.data_ptr<float>()) {}
};

// The softcap of scores lo .. hi - 1 of a row: cap tanh(x / cap) as cap (1 - 2 / (2^(2 log2e x / cap) + 1))
// (exp2f vectorises, tanhf does not), in log2 units; nothing when cap = 0.
static void cap_row(float* row, int64_t lo, int64_t hi, float cap) {
  if (cap <= 0) return;
  const float log2e = 1.4426950408889634f, k2 = 2.f * log2e / cap, capl2 = cap * log2e;
  for (int64_t c = lo; c < hi; ++c) row[c] = capl2 * (1.f - 2.f / (exp2_clamped(row[c] * k2) + 1.f));
}

// ALiBi: adds -slope2 |d0 - c| to scores lo .. hi - 1 of a row whose query sits at column d0
// (slope2 = slope log2 e, log2 units); nothing when slope2 = 0.
static void alibi_row(float* row, int64_t lo, int64_t hi, int64_t d0, float slope2) {
  if (slope2 == 0.f) return;
  float* r = row + lo;
  const float at = (float)(d0 - lo);  // the query's column from lo; 32-bit counters vectorise
  for (int c = 0; c < (int)(hi - lo); ++c) r[c] -= slope2 * std::fabs(at - (float)c);
}

// Turns scores lo .. hi - 1 (lo < hi) of a row of L into 2^(s - m), zeroes the other columns, and
// returns their sum.
static float exp_row(float* row, int64_t lo, int64_t hi, int64_t L, float m) {
  if (lo > 0) std::fill(row, row + lo, 0.f);
  if (hi < L) std::fill(row + hi, row + L, 0.f);
  float acc = 0.f;
  for (int64_t c = lo; c < hi; ++c) { const float e = exp2_clamped(row[c] - m); row[c] = e; acc += e; }
  return acc;
}

static float max_of(const float* row, int64_t lo, int64_t hi) {
  float m = row[lo];
  for (int64_t c = lo + 1; c < hi; ++c) m = std::max(m, row[c]);
  return m;
}

// The maximum of the raw scores lo .. hi - 1 (lo < hi) after the softcap and ALiBi, and in *bad
// whether a raw score is an inf or a NaN (tested first: the softcap would bound it). A separate
// pass (1-3% of the kernel's time): folded into the maximum's loop, the test made dense causal
// N = 4096 take 85-89 ms instead of 65-68 (measured on the AMX Xeon, docs/performance.md).
static float checked_max(float* row, int64_t lo, int64_t hi, float cap, int64_t d0, float slope2, bool* bad) {
  *bad = any_nonfinite(row + lo, hi - lo);
  cap_row(row, lo, hi, cap);
  alibi_row(row, lo, hi, d0, slope2);
  return max_of(row, lo, hi);
}

// One row of L scores (log2 units unless capped) whose columns lo .. hi - 1 (lo < hi) are visible:
// the softcap, the maximum, the row turned into 2^(s - max) with the invisible columns zeroed.
// Returns the maximum and writes the sum into *sum (NaN where a visible score is an inf or a NaN).
static float softmax_row(float* row, int64_t lo, int64_t hi, int64_t L, float cap, float* sum) {
  bool bad;
  const float m = checked_max(row, lo, hi, cap, 0, 0.f, &bad);
  *sum = bad ? nan_value() : exp_row(row, lo, hi, L, m);
  return m;
}

// Keys per pass of a block of queries: longer rows are taken in chunks with a running maximum (the
// chunk's scores stay in the L2 cache; one pass over 16,384 keys ran at 1.14x SDPA's time).
static constexpr int64_t KEY_CHUNK = 1024;

// Per-thread buffers of attend_block: scores of a block x KEY_CHUNK keys, and per row the running
// maximum, sum and rescale factor.
struct BlockScratch {
  std::vector<float> S, m, l, a;
  std::vector<char> bad;  // rows that saw a non-finite score: NaN
  bool out_finite = true;  // every output value attend_block wrote so far is finite
#if defined(__AVX512F__)
  std::unique_ptr<attnzoo_native::FusedScratch> fused;  // made on first use
#endif
  BlockScratch(int64_t block, int64_t span)
      : S(block * std::max<int64_t>(1, std::min(span, KEY_CHUNK))), m(block), l(block), a(block), bad(block) {}
};

// Whether attend_block may use the register-blocked form (native_fused.h) where it applies; off, the
// sgemm form serves every call (tests compare the two through `set_fused`).
static bool g_fused = true;

static bool set_fused(bool on) {
  const bool was = g_fused;
  g_fused = on;
  return was;
}

// Whether this build has the register-blocked form (compiled for a CPU with AVX-512).
static bool has_fused() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// Keys per pass of the register-blocked form: 512 keys x 32 queries of scores (64 KB, in the L2 cache).
static constexpr int64_t FUSED_CHUNK = 512;

// One block of R queries (query i0 + r, rows of q at stride ldq) against keys k_lo .. k_hi - 1 (rows
// of k, v at strides ldk, ldv): query i sees keys i - left .. i + right within them (at least one).
// Keys in chunks of KEY_CHUNK: per chunk one sgemm for the scores, the softcap / ALiBi / running
// maximum / exp2 / sum pass, the output rows rescaled, one sgemm adding P V. Writes R output rows
// (stride ldo) and R log-sum-exps (natural log, stride 1). softmax = false: the sgemm only.
static void attend_block(const float* qb, int ldq, const float* kb, int ldk, const float* vb, int ldv,
                         float* ob, int ldo, float* lse, int64_t R, int64_t i0, int64_t k_lo, int64_t k_hi,
                         int64_t left, int64_t right, int D, int Dv, float scale, float cap, bool softmax,
                         BlockScratch& w, float slope2 = 0.f, bool fused = true) {
  const float log2e = 1.4426950408889634f, none = std::numeric_limits<float>::lowest();
  const float alpha = cap > 0 ? scale : scale * log2e;  // capped scores take log2 e after tanh
#if defined(__AVX512F__)
  if (softmax && fused && g_fused && attnzoo_native::fused_applies(Dv)) {
    using attnzoo_native::FQ;
    if (!w.fused) w.fused = std::make_unique<attnzoo_native::FusedScratch>(D, FUSED_CHUNK);
    for (int64_t r0 = 0; r0 < R; r0 += FQ) {
      w.out_finite &= attnzoo_native::fused_block(qb + r0 * ldq, ldq, kb, ldk, vb, ldv, ob + r0 * ldo, ldo, lse + r0,
                                  std::min<int64_t>(FQ, R - r0), i0 + r0, k_lo, k_hi, left, right, D, Dv, alpha,
                                  FUSED_CHUNK, *w.fused, attnzoo_native::ScoreMods{cap, slope2});
    }
    return;
  }
#endif
  float* S = w.S.data();
  std::fill(w.m.begin(), w.m.begin() + R, none);
  std::fill(w.l.begin(), w.l.begin() + R, 0.f);
  std::fill(w.bad.begin(), w.bad.begin() + R, 0);
  for (int64_t c0 = k_lo; c0 < k_hi; c0 += KEY_CHUNK) {
    const int64_t c1 = std::min(k_hi, c0 + KEY_CHUNK);
    const int L = (int)(c1 - c0);
    gemm('T', 'N', L, (int)R, D, alpha, kb + (c0 - k_lo) * ldk, ldk, qb, ldq, 0.f, S, L);
    for (int64_t r = 0; r < R && softmax; ++r) {
      const int64_t i = i0 + r;
      const int64_t lo = std::max(c0, i - left) - c0, hi = std::min(c1, i + right + 1) - c0;
      float* row = S + r * L;
      if (hi <= lo) { std::fill(row, row + L, 0.f); w.a[r] = 1.f; continue; }
      bool bad;
      const float m_new = std::max(w.m[r], checked_max(row, lo, hi, cap, i - c0, slope2, &bad));
      if (bad) w.bad[r] = 1;  // the row ends as NaN; go on with finite numbers
      const float sum = exp_row(row, lo, hi, L, m_new);
      w.a[r] = w.m[r] == none ? 0.f : exp2_clamped(w.m[r] - m_new);  // rescales the earlier chunks
      w.l[r] = w.l[r] * w.a[r] + sum;
      w.m[r] = m_new;
    }
    if (c0 > k_lo && softmax) {
      for (int64_t r = 0; r < R; ++r) {
        float* o = ob + r * ldo;
        for (int64_t c = 0; c < Dv; ++c) o[c] *= w.a[r];
      }
    }
    gemm('N', 'N', Dv, (int)R, L, 1.f, vb + (c0 - k_lo) * ldv, ldv, S, L, c0 > k_lo ? 1.f : 0.f, ob, ldo);
  }
  for (int64_t r = 0; r < R && softmax; ++r) {
    float* o = ob + r * ldo;
    if (w.bad[r]) {
      lse[r] = nan_value();
      std::fill(o, o + Dv, nan_value());
      w.out_finite = false;
      continue;
    }
    lse[r] = (w.m[r] + std::log2(w.l[r])) * 0.6931471805599453f;
    const float inv = 1.f / w.l[r];
    for (int64_t c = 0; c < Dv; ++c) o[c] *= inv;
    if (any_nonfinite(o, Dv)) w.out_finite = false;
  }
}

// ALiBi slopes [H] (any float dtype) times log2 e per head, or zeros without slopes.
static std::vector<float> alibi_slopes2(const c10::optional<at::Tensor>& slopes, int64_t H, const char* fn) {
  std::vector<float> out(H, 0.f);
  if (!slopes.has_value() || !slopes->defined()) return out;
  TORCH_CHECK(slopes->dim() == 1 && slopes->size(0) == H && slopes->is_floating_point() && slopes->device().is_cpu(),
              fn, ": slopes must be a 1-d float CPU tensor of the query heads");
  const at::Tensor s = slopes->to(at::kFloat).contiguous();
  for (int64_t h = 0; h < H; ++h) out[h] = s.data_ptr<float>()[h] * 1.4426950408889634f;
  return out;
}

// A thread's copy of the key and value rows its blocks read, one head's rows lo .. hi - 1 contiguous,
// for layouts whose rows lie far apart (a [B, N, H, D] projection viewed as [B, H, N, D], packed
// [T, H, D] sequences): a block re-reads its keys' rows, and at a stride of H x D they collide in the
// L1 cache's sets (dense causal N = 4096 from the view: 93 ms instead of 64; docs/performance.md).
// Consecutive blocks of a head slide forward, so each row is copied about once; a block seeing more
// rows than the copy holds reads the source in place.
struct RowPack {
  std::vector<float> k, v;
  int64_t id = -1, lo = 0, hi = 0;
  const int64_t cap;
  const int D, Dv;
  RowPack(int64_t cap_rows, int D_, int Dv_) : cap(cap_rows), D(D_), Dv(Dv_) {}
  // Points kb / vb (rows of head `head`, source row r at ks + r ldk / vs + r ldv) at a contiguous copy of
  // rows k_lo .. k_hi - 1 (ldk = D, ldv = Dv) when they fit; else leaves them as they are.
  void cover(int64_t head, const float* ks, int ldk_src, const float* vs, int ldv_src, int64_t k_lo, int64_t k_hi,
             const float*& kb, int& ldk, const float*& vb, int& ldv) {
    if (k_hi - k_lo > cap) return;
    if (k.empty()) {
      k.resize((size_t)(cap * D));
      v.resize((size_t)(cap * Dv));
    }
    if (head != id || k_lo < lo || k_lo > hi) { id = head; lo = hi = k_lo; }
    if (k_hi - lo > cap) {  // slide: keep rows k_lo .. hi - 1 at the front
      std::memmove(k.data(), k.data() + (k_lo - lo) * D, sizeof(float) * (hi - k_lo) * D);
      std::memmove(v.data(), v.data() + (k_lo - lo) * Dv, sizeof(float) * (hi - k_lo) * Dv);
      lo = k_lo;
    }
    for (int64_t r = hi; r < k_hi; ++r) {
      std::memcpy(k.data() + (r - lo) * D, ks + r * ldk_src, sizeof(float) * D);
      std::memcpy(v.data() + (r - lo) * Dv, vs + r * ldv_src, sizeof(float) * Dv);
    }
    hi = std::max(hi, k_hi);
    kb = k.data() + (k_lo - lo) * D;
    vb = v.data() + (k_lo - lo) * Dv;
    ldk = D;
    ldv = Dv;
  }
};

// Rows a RowPack holds: four blocks' worth (2,048 at least), at most 16 MB of keys and values.
static int64_t pack_rows(int64_t span, int64_t D, int64_t Dv) {
  return std::min<int64_t>(std::max<int64_t>(4 * span, 2048), ((int64_t)16 << 20) / (4 * (D + Dv)));
}

// q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, Dv] float32 with contiguous rows and any other
// strides (the [B, N, H, D] -> [B, H, N, D] view of a projection: no whole copy, see RowPack; 3-d [BH, N, D]
// is taken as B = 1); query i sees keys i - left .. i + right (left = right = N: every key;
// left = N, right = 0: causal). Scores are scale * q.k, capped to softcap * tanh(score / softcap)
// when softcap > 0, then minus slope_h |i - j| with ALiBi slopes [Hq]. Returns out [B, Hq, N, Dv] and
// lse [B, Hq, N] (natural log; 3-d inputs: without B). softmax = false leaves the two sgemm only (a
// benchmark bound). `finite`, a bool tensor of one element when given, is set to whether every output
// value is finite (the caller's non-finite guard then need not read the output again). fused = false
// keeps the sgemm form: a training forward whose LSE window_bwd recomputes its scores against (the
// register-blocked form rounds the scores differently, ~1e-6, which the gradients would show).
std::vector<at::Tensor> window_fwd(const at::Tensor& q3, const at::Tensor& k3, const at::Tensor& v3,
                                   int64_t left, int64_t right, double scale, double softcap,
                                   int64_t block, bool softmax, const c10::optional<at::Tensor>& slopes,
                                   const c10::optional<at::Tensor>& finite, bool fused) {
  const bool flat = q3.dim() == 3;
  const at::Tensor q = flat ? q3.unsqueeze(0) : q3, k = flat ? k3.unsqueeze(0) : k3, v = flat ? v3.unsqueeze(0) : v3;
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(3) == 1 &&
                t->stride(2) >= t->size(3), "window_fwd: q, k, v must be 3-d or 4-d float32 CPU tensors with contiguous rows");
  }
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
              v.size(1) == k.size(1), "window_fwd: q heads must be a multiple of k/v heads (same batch)");
  TORCH_CHECK(k.size(2) == q.size(2) && v.size(2) == q.size(2) && k.size(3) == q.size(3), "window_fwd: q, k, v lengths or q/k widths differ");
  TORCH_CHECK(left >= 0 && right >= 0 && block > 0, "window_fwd: left, right must be >= 0 and block > 0");
  TORCH_CHECK(softcap >= 0, "window_fwd: softcap must be >= 0 (0: none)");
  const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), D = q.size(3), Hkv = k.size(1), Dv = v.size(3);
  const int64_t G = Hq / Hkv, nblk = (N + block - 1) / block;
  const int64_t span = std::min<int64_t>(N, block + std::min(left, N) + std::min(right, N));
  const std::vector<float> slope2 = alibi_slopes2(slopes, Hq, "window_fwd");
  const bool report = finite.has_value() && finite->defined();
  if (report) {
    TORCH_CHECK(finite->scalar_type() == at::kBool && finite->numel() == 1 && finite->device().is_cpu() &&
                finite->is_contiguous(), "window_fwd: finite must be a one-element bool CPU tensor");
  }
  std::atomic<bool> all_finite(true);
  Buffers b(q, k, v, {B, Hq, N, Dv}, {B, Hq, N});
  at::parallel_for(0, B * Hq * nblk, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    BlockScratch w(block, span);
    RowPack pack(pack_rows(span, D, Dv), (int)D, (int)Dv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nblk, s = (t % nblk) * block, e = std::min(N, s + block);
      const int64_t bi = bh / Hq, kv = (bh % Hq) / G, k_lo = std::max<int64_t>(0, s - left), k_hi = std::min(N, e + right);
      const float* ks = b.kp + bi * k.stride(0) + kv * k.stride(1);  // row 0 of the head
      const float* vs = b.vp + bi * v.stride(0) + kv * v.stride(1);
      const float* kb = ks + k_lo * k.stride(2);
      const float* vb = vs + k_lo * v.stride(2);
      int ldk = (int)k.stride(2), ldv = (int)v.stride(2);
      if (ldk != D || ldv != Dv) pack.cover(bi * Hkv + kv, ks, ldk, vs, ldv, k_lo, k_hi, kb, ldk, vb, ldv);
      attend_block(b.qp + bi * q.stride(0) + (bh % Hq) * q.stride(1) + s * q.stride(2), (int)q.stride(2),
                   kb, ldk, vb, ldv, b.op + (bh * N + s) * Dv, (int)Dv, b.lp + bh * N + s, e - s, s, k_lo, k_hi,
                   left, right, (int)D, (int)Dv, (float)scale, (float)softcap, softmax, w, slope2[bh % Hq], fused);
    }
    if (!w.out_finite) all_finite.store(false);
  });
  if (report) *finite->data_ptr<bool>() = softmax && all_finite.load();
  if (flat) return {b.out.squeeze(0), b.lse.squeeze(0)};
  return {b.out, b.lse};
}

// Packed variable-length sequences (flash-attn's varlen layout, queries and keys of equal lengths):
// q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] contiguous float32, cu int64 [S + 1] (0 .. T). Within
// each sequence query i sees keys i - left .. i + right of the same sequence. Returns out [T, Hq, Dv]
// and lse [Hq, T].
std::vector<at::Tensor> varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cu, int64_t left, int64_t right, double scale,
                                   double softcap, int64_t block, bool fused) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous(),
                "varlen_fwd: q, k, v must be contiguous 3-d float32 CPU tensors");
  }
  TORCH_CHECK(cu.device().is_cpu() && cu.scalar_type() == at::kLong && cu.dim() == 1 && cu.is_contiguous() &&
              cu.numel() >= 1, "varlen_fwd: cu must be a contiguous 1-d int64 CPU tensor");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && v.size(1) == k.size(1), "varlen_fwd: q heads must be a multiple of k/v heads");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(2) == q.size(2), "varlen_fwd: q, k, v lengths or q/k widths differ");
  TORCH_CHECK(left >= 0 && right >= 0 && block > 0 && softcap >= 0, "varlen_fwd: left, right, softcap must be >= 0 and block > 0");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), Dv = v.size(2), G = Hq / Hkv;
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t S = cu.numel() - 1;
  TORCH_CHECK(c[0] == 0 && c[S] == T, "varlen_fwd: cu must run from 0 to T");
  std::vector<int64_t> task_seq, task_start;  // one task per (sequence, block of queries); heads below
  int64_t longest = 0;
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(c[i + 1] >= c[i], "varlen_fwd: cu must not decrease");
    longest = std::max(longest, c[i + 1] - c[i]);
    for (int64_t s0 = c[i]; s0 < c[i + 1]; s0 += block) { task_seq.push_back(i); task_start.push_back(s0); }
  }
  const int64_t ntask = (int64_t)task_seq.size();
  const int64_t span = std::min<int64_t>(longest, block + std::min(left, longest) + std::min(right, longest));
  Buffers b(q, k, v, {T, Hq, Dv}, {Hq, T});
  at::parallel_for(0, Hq * ntask, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    BlockScratch w(block, span);
    RowPack pack(pack_rows(span, D, Dv), (int)D, (int)Dv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / ntask, task = t % ntask, seq = task_seq[task], s = task_start[task];
      const int64_t e = std::min(c[seq + 1], s + block), kv = h / G;
      const int64_t k_lo = std::max(c[seq], s - left), k_hi = std::min(c[seq + 1], e + right);
      const float* kb = b.kp + (k_lo * Hkv + kv) * D;
      const float* vb = b.vp + (k_lo * Hkv + kv) * Dv;
      int ldk = (int)(Hkv * D), ldv = (int)(Hkv * Dv);
      if (Hkv > 1) pack.cover(kv, b.kp + kv * D, ldk, b.vp + kv * Dv, ldv, k_lo, k_hi, kb, ldk, vb, ldv);
      attend_block(b.qp + (s * Hq + h) * D, (int)(Hq * D), kb, ldk, vb, ldv, b.op + (s * Hq + h) * Dv, (int)(Hq * Dv),
                   b.lp + h * T + s, e - s, s, k_lo, k_hi, left, right, (int)D, (int)Dv, (float)scale,
                   (float)softcap, true, w, 0.f, fused);
    }
  });
  return {b.out, b.lse};
}

// Split-KV decoding: a few queries against a long cache, GQA-aware. q [B, Hq, Nq, D] contiguous;
// k [B, Hkv, Nk, D] and v [B, Hkv, Nk, Dv] with contiguous rows (any batch / head strides: a slice of
// a longer cache is read in place). The G = Hq / Hkv query heads of a KV head are stacked as
// G Nq rows, so each key is read once for its group. Query i (position q_offset + i) sees keys
// q_offset + i - left .. q_offset + i + right (clipped to the cache). Tasks are (batch, KV head,
// split of `split` keys); each writes its rows' maximum, sum and unnormalised output, merged after
// the parallel region by their log-sum-exps. Returns out [B, Hq, Nq, Dv] and lse [B, Hq, Nq]
// (natural log; -inf and a zero row where a query sees no key).
std::vector<at::Tensor> decode_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t left,
                                   int64_t right, int64_t q_offset, double scale, double softcap, int64_t split) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(3) == 1 &&
                t->stride(2) == t->size(3), "decode_fwd: q, k, v must be 4-d float32 CPU tensors with contiguous rows");
  }
  TORCH_CHECK(q.is_contiguous(), "decode_fwd: q must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Nk && k.size(3) == D &&
              Hkv > 0 && Hq % Hkv == 0, "decode_fwd: q, k, v shapes disagree");
  TORCH_CHECK(left >= 0 && right >= 0 && q_offset >= 0 && split > 0 && softcap >= 0,
              "decode_fwd: left, right, q_offset, softcap must be >= 0 and split > 0");
  const int64_t G = Hq / Hkv, rows = G * Nq, nsplit = std::max<int64_t>(1, (Nk + split - 1) / split);
  at::Tensor out = at::empty({B, Hq, Nq, Dv}, q.options()), lse = at::empty({B, Hq, Nq}, q.options());
  std::vector<float> pm(B * Hkv * nsplit * rows), pl(B * Hkv * nsplit * rows), po(B * Hkv * nsplit * rows * Dv);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t ksb = k.stride(0), ksh = k.stride(1), vsb = v.stride(0), vsh = v.stride(1);
  const float log2e = 1.4426950408889634f, cap = (float)softcap;
  const float none = std::numeric_limits<float>::lowest();  // -ffast-math: no infinities
  at::parallel_for(0, B * Hkv * nsplit, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<float> S;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nsplit, sp = task % nsplit, b = bh / Hkv, h = bh % Hkv;
      // keys of this split that some query sees
      const int64_t c0 = std::max(sp * split, std::max<int64_t>(0, q_offset - left));
      const int64_t c1 = std::min(std::min(Nk, (sp + 1) * split), q_offset + Nq - 1 + right + 1);
      float* m = pm.data() + task * rows;
      float* l = pl.data() + task * rows;
      float* o = po.data() + task * rows * Dv;
      if (c1 <= c0) {
        std::fill(m, m + rows, none); std::fill(l, l + rows, 0.f); std::fill(o, o + rows * Dv, 0.f);
        continue;
      }
      const int C = (int)(c1 - c0);
      S.resize(rows * C);
      const float* kc = kp + b * ksb + h * ksh + c0 * D;
      const float* vc = vp + b * vsb + h * vsh + c0 * Dv;
      const float* qg = qp + (b * Hq + h * G) * Nq * D;  // the group's rows, row g Nq + i
      gemm('T', 'N', C, (int)rows, (int)D, cap > 0 ? (float)scale : (float)scale * log2e, kc, (int)D, qg, (int)D,
           0.f, S.data(), C);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = q_offset + r % Nq;
        const int64_t lo = std::max(c0, pos - left) - c0, hi = std::min(c1, pos + right + 1) - c0;
        float* row = S.data() + r * C;
        if (hi <= lo) {
          std::fill(row, row + C, 0.f); m[r] = none; l[r] = 0.f;
          continue;
        }
        m[r] = softmax_row(row, lo, hi, C, cap, &l[r]);  // l: NaN for a row that saw an inf or NaN (the merge)
      }
      gemm('N', 'N', (int)Dv, (int)rows, C, 1.f, vc, (int)Dv, S.data(), C, 0.f, o, (int)Dv);
    }
  });
  float *outp = out.data_ptr<float>(), *lsep = lse.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t bh = begin; bh < end; ++bh) {
      for (int64_t r = 0; r < rows; ++r) {
        float mx = none;
        bool bad = false;
        for (int64_t sp = 0; sp < nsplit; ++sp) {
          const int64_t t = bh * nsplit + sp;
          bad = bad || any_nonfinite(&pl[t * rows + r], 1);
          if (pl[t * rows + r] > 0.f) mx = std::max(mx, pm[t * rows + r]);
        }
        float* dst = outp + (bh * rows + r) * Dv;  // [B, Hkv, G Nq, Dv] is [B, Hq, Nq, Dv]
        if (bad) {  // a split saw a non-finite score
          std::fill(dst, dst + Dv, nan_value());
          lsep[bh * rows + r] = nan_value();
          continue;
        }
        std::fill(dst, dst + Dv, 0.f);
        float den = 0.f;
        for (int64_t sp = 0; sp < nsplit; ++sp) {
          const int64_t t = bh * nsplit + sp;
          if (!(pl[t * rows + r] > 0.f)) continue;
          const float w = exp2_clamped(pm[t * rows + r] - mx);
          den += w * pl[t * rows + r];
          const float* src = po.data() + (t * rows + r) * Dv;
          for (int64_t c = 0; c < Dv; ++c) dst[c] += w * src[c];
        }
        if (den > 0.f) {
          const float inv = 1.f / den;
          for (int64_t c = 0; c < Dv; ++c) dst[c] *= inv;
          lsep[bh * rows + r] = (mx + std::log2(den)) * 0.6931471805599453f;
        } else {
          lsep[bh * rows + r] = -std::numeric_limits<float>::infinity();
        }
      }
    }
  });
  return {out, lse};
}

// Row-major C = alpha op(A) op(B) + beta C (C [m x n]): the column-major call on the transposes.
static void gemm_rm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                    int ldb, float beta, float* c, int ldc) {
  gemm(tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
}

// The backward of window_fwd: q, k, v, out [BH | BHk, N, *], lse [BH, N] (natural log, from window_fwd),
// d_out [BH, N, Dv], d_lse [BH, N] (zeros when the log-sum-exp takes no gradient), all contiguous
// float32. Per block of queries the scores are recomputed, P = exp(S - lse), dP = dO V^T,
// dS = P (dP - delta + d_lse) with delta = rowsum(dO out) (times 1 - tanh^2 under a softcap),
// dQ = scale dS K, dK += scale dS^T Q, dV += P^T dO. Tasks are (KV head, segment of query blocks)
// with private dK / dV over the segment's keys, added up after the parallel region (no races).
// Returns dq [BH, N, D], dk [BHk, N, D], dv [BHk, N, Dv].
std::vector<at::Tensor> window_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& out, const at::Tensor& lse, const at::Tensor& d_out,
                                   const at::Tensor& d_lse, int64_t left, int64_t right, double scale,
                                   double softcap, int64_t block, const c10::optional<at::Tensor>& slopes) {
  for (const at::Tensor* t : {&q, &k, &v, &out, &d_out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous(),
                "window_bwd: q, k, v, out, d_out must be contiguous 3-d float32 CPU tensors");
  }
  for (const at::Tensor* t : {&lse, &d_lse}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() &&
                t->size(0) == q.size(0) && t->size(1) == q.size(1), "window_bwd: lse and d_lse must be [BH, N] float32");
  }
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0 && v.size(0) == k.size(0), "window_bwd: q heads must be a multiple of k/v heads");
  TORCH_CHECK(k.size(1) == q.size(1) && v.size(1) == q.size(1) && k.size(2) == q.size(2), "window_bwd: q, k, v lengths or q/k widths differ");
  TORCH_CHECK(out.sizes() == d_out.sizes() && out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == v.size(2),
              "window_bwd: out and d_out must be [BH, N, Dv]");
  TORCH_CHECK(left >= 0 && right >= 0 && block > 0 && softcap >= 0, "window_bwd: left, right, softcap must be >= 0 and block > 0");
  const int64_t BH = q.size(0), N = q.size(1), D = q.size(2), BHk = k.size(0), Dv = v.size(2);
  const int64_t G = BH / BHk, nblk = (N + block - 1) / block;
  left = std::min(left, N);
  right = std::min(right, N);
  const int64_t span = std::min<int64_t>(N, block + left + right);
  // segments of query blocks per KV head: about two tasks a thread, as long as the tasks' private
  // dK / dV (each over its segment's keys) hold at most 4x the keys of the whole dK / dV
  int64_t nseg = std::min<int64_t>(nblk, std::max<int64_t>(1, (2 * at::get_num_threads() + BHk - 1) / BHk));
  auto private_keys = [&](int64_t n) { return n * std::min(N, ((nblk + n - 1) / n) * block + left + right); };
  while (nseg > 1 && private_keys(nseg) > 4 * N) --nseg;
  const int64_t per = (nblk + nseg - 1) / nseg;
  const std::vector<float> slope2 = alibi_slopes2(slopes, BH, "window_bwd");  // [BH]: 3-d rows of B = 1
  at::Tensor dq = at::empty_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  std::vector<std::vector<float>> pk(BHk * nseg), pv(BHk * nseg);  // private dK / dV of each task
  std::vector<int64_t> plo(BHk * nseg, 0), phi(BHk * nseg, 0);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>(), *dop = d_out.data_ptr<float>();
  const float* dlp = d_lse.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  const float log2e = 1.4426950408889634f, sc = (float)scale, cap = (float)softcap;
  at::parallel_for(0, BHk * nseg, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<float> S(block * span), dP(block * span), T(cap > 0 ? block * span : 0), delta(block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / nseg, seg = task % nseg;
      const int64_t b0 = seg * per, b1 = std::min(nblk, b0 + per);
      if (b0 >= b1) continue;
      const int64_t s_lo = std::max<int64_t>(0, b0 * block - left), s_hi = std::min(N, std::min(N, b1 * block) + right);
      plo[task] = s_lo; phi[task] = s_hi;
      std::vector<float>& dkp = pk[task];
      std::vector<float>& dvp = pv[task];
      dkp.assign((s_hi - s_lo) * D, 0.f);
      dvp.assign((s_hi - s_lo) * Dv, 0.f);
      for (int64_t h = kv * G; h < (kv + 1) * G; ++h) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t s = blk * block, e = std::min(N, s + block), R = e - s;
          const int64_t k_lo = std::max<int64_t>(0, s - left), k_hi = std::min(N, e + right);
          const int L = (int)(k_hi - k_lo);
          const float* qb = qp + (h * N + s) * D;
          const float* kb = kp + (kv * N + k_lo) * D;
          const float* vb = vp + (kv * N + k_lo) * Dv;
          const float* dob = dop + (h * N + s) * Dv;
          const float* ob = op + (h * N + s) * Dv;
          for (int64_t r = 0; r < R; ++r) {  // delta - d_lse per row
            float acc = 0.f;
            for (int64_t c = 0; c < Dv; ++c) acc += dob[r * Dv + c] * ob[r * Dv + c];
            delta[r] = acc - dlp[h * N + s + r];
          }
          gemm_rm('N', 'T', (int)R, L, (int)D, cap > 0 ? sc : sc * log2e, qb, (int)D, kb, (int)D, 0.f, S.data(), L);
          gemm_rm('N', 'T', (int)R, L, (int)Dv, 1.f, dob, (int)Dv, vb, (int)Dv, 0.f, dP.data(), L);
          for (int64_t r = 0; r < R; ++r) {
            const int64_t i = s + r;
            const int64_t lo = std::max(k_lo, i - left) - k_lo, hi = std::min(k_hi, i + right + 1) - k_lo;
            float* srow = S.data() + r * L;
            float* drow = dP.data() + r * L;
            const float l2 = lp[h * N + i] * log2e;
            if (cap > 0) {
              float* trow = T.data() + r * L;
              const float k2 = 2.f * log2e / cap;
              for (int64_t c = lo; c < hi; ++c) {
                const float t = 1.f - 2.f / (exp2_clamped(srow[c] * k2) + 1.f);  // tanh(raw / cap)
                trow[c] = 1.f - t * t;
                srow[c] = cap * log2e * t;
              }
              alibi_row(srow, lo, hi, i - k_lo, slope2[h]);
              for (int64_t c = lo; c < hi; ++c) {
                const float p = exp2_clamped(srow[c] - l2);
                srow[c] = p;
                drow[c] = p * (drow[c] - delta[r]) * trow[c];
              }
            } else {
              alibi_row(srow, lo, hi, i - k_lo, slope2[h]);
              for (int64_t c = lo; c < hi; ++c) {
                const float p = exp2_clamped(srow[c] - l2);
                srow[c] = p;
                drow[c] = p * (drow[c] - delta[r]);
              }
            }
            if (lo > 0) { std::fill(srow, srow + lo, 0.f); std::fill(drow, drow + lo, 0.f); }
            if (hi < L) { std::fill(srow + hi, srow + L, 0.f); std::fill(drow + hi, drow + L, 0.f); }
          }
          gemm_rm('N', 'N', (int)R, (int)D, L, sc, dP.data(), L, kb, (int)D, 0.f, dqp + (h * N + s) * D, (int)D);
          gemm_rm('T', 'N', L, (int)Dv, (int)R, 1.f, S.data(), L, dob, (int)Dv, 1.f, dvp.data() + (k_lo - s_lo) * Dv, (int)Dv);
          gemm_rm('T', 'N', L, (int)D, (int)R, sc, dP.data(), L, qb, (int)D, 1.f, dkp.data() + (k_lo - s_lo) * D, (int)D);
        }
      }
    }
  });
  float *dkd = dk.data_ptr<float>(), *dvd = dv.data_ptr<float>();
  at::parallel_for(0, BHk, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t kv = begin; kv < end; ++kv) {
      for (int64_t seg = 0; seg < nseg; ++seg) {
        const int64_t task = kv * nseg + seg, lo = plo[task], n = phi[task] - lo;
        const float* a = pk[task].data();
        const float* b = pv[task].data();
        float* ko = dkd + (kv * N + lo) * D;
        float* vo = dvd + (kv * N + lo) * Dv;
        for (int64_t x = 0; x < n * D; ++x) ko[x] += a[x];
        for (int64_t x = 0; x < n * Dv; ++x) vo[x] += b[x];
      }
    }
  });
  return {dq, dk, dv};
}

// native_nsa.cpp
at::Tensor nsa_selected_fwd(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& idx,
                            const at::Tensor& ok, int64_t t0, double scale, int64_t chunk);
std::vector<at::Tensor> nsa_selected_train_fwd(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                                               const at::Tensor& idx, const at::Tensor& ok, int64_t t0, double scale,
                                               int64_t chunk);
std::vector<at::Tensor> nsa_selected_bwd(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                                         const at::Tensor& idx, const at::Tensor& ok, const at::Tensor& out,
                                         const at::Tensor& lse, const at::Tensor& d_out, int64_t t0, double scale,
                                         int64_t chunk);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nsa_selected_fwd", &nsa_selected_fwd, "NSA's selected branch over picked key blocks (float32)");
  m.def("nsa_selected_train_fwd", &nsa_selected_train_fwd, "nsa_selected_fwd and its log2 log-sum-exps");
  m.def("nsa_selected_bwd", &nsa_selected_bwd, "the backward of nsa_selected_train_fwd (float32)");
  m.def("has_fused", &has_fused, "whether this build has the register-blocked AVX-512 form");
  m.def("set_fused", &set_fused, "use the register-blocked AVX-512 form where it applies; returns the previous setting",
        py::arg("on"));
  m.def("window_fwd", &window_fwd, "attention forward over [B, H, N, D] (float32)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("left"), py::arg("right"), py::arg("scale"), py::arg("softcap"), py::arg("block"),
        py::arg("softmax"), py::arg("slopes") = py::none(), py::arg("finite") = py::none(), py::arg("fused") = true);
  m.def("decode_fwd", &decode_fwd, "split-KV decoding over a cache (float32)");
  m.def("window_bwd", &window_bwd, "the backward of window_fwd (float32)", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("d_out"), py::arg("d_lse"), py::arg("left"), py::arg("right"),
        py::arg("scale"), py::arg("softcap"), py::arg("block"), py::arg("slopes") = py::none());
  m.def("varlen_fwd", &varlen_fwd, "attention forward over packed sequences [T, H, D] (float32)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("cu"), py::arg("left"), py::arg("right"), py::arg("scale"),
        py::arg("softcap"), py::arg("block"), py::arg("fused") = true);
}
