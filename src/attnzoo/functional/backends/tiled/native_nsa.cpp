// attnzoo's compiled NSA selected branch (float32 CPU): inference, and the forward (with its
// log-sum-exps) and backward of training; built with native_window.cpp at install or by
// `attnzoo native --build`. Reference: attnzoo.functional.softmax.nsa (_chunk_selected,
// _selected_tiles, _selected_block_major).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "native_common.h"

using attnzoo_native::FlushDenormals;
using attnzoo_native::any_nonfinite;
using attnzoo_native::exp2_clamped;
using attnzoo_native::nan_value;
using attnzoo_native::gemm;

namespace {

// Thread-local work space of one chunk of queries: the (query, block) pairs sorted by block, the
// gathered query rows, the scores and P V of one block, and each query row's running softmax state.
struct Chunk {
  std::vector<int64_t> start, pair_query;      // CSR by block: pairs start[j] .. start[j + 1] - 1
  std::vector<float> qt, s, o, alpha, m, l, acc;
  std::vector<char> bad;  // query rows that saw a non-finite score: NaN
  std::vector<float> dot, dp, dqt, delta;  // the backward's: gathered dO rows, dP, dQ rows, rowsum(dO O)
};

// The shapes every entry point shares, checked once: q [B, G r, N, D], kb [B, G, Ns, L, D],
// vb [B, G, Ns, L, Dv], idx / ok [B, G, N, n].
struct Shape {
  int64_t B, H, N, D, G, Ns, L, Dv, n, r, nchunk;
};

Shape check_args(const char* fn, const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                 const at::Tensor& idx, const at::Tensor& ok, int64_t t0, int64_t chunk) {
  for (const at::Tensor* t : {&q, &kb, &vb}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                fn, ": q, kb, vb must be contiguous float32 CPU tensors");
  }
  TORCH_CHECK(q.dim() == 4 && kb.dim() == 5 && vb.dim() == 5, fn, ": q must be 4-d, kb and vb 5-d");
  TORCH_CHECK(idx.scalar_type() == at::kLong && ok.scalar_type() == at::kBool && idx.is_contiguous() &&
              ok.is_contiguous() && idx.dim() == 4 && idx.sizes() == ok.sizes(),
              fn, ": idx (int64) and ok (bool) must be contiguous [B, G, N, n]");
  Shape z{q.size(0), q.size(1), q.size(2), q.size(3), kb.size(1), kb.size(2), kb.size(3), vb.size(4), idx.size(3), 0, 0};
  TORCH_CHECK(kb.size(0) == z.B && vb.size(0) == z.B && vb.size(1) == z.G && vb.size(2) == z.Ns && vb.size(3) == z.L &&
              kb.size(4) == z.D && z.G > 0 && z.H % z.G == 0, fn, ": q, kb, vb shapes disagree");
  TORCH_CHECK(idx.size(0) == z.B && idx.size(1) == z.G && idx.size(2) == z.N, fn, ": idx must be [B, G, N, n]");
  TORCH_CHECK(chunk > 0 && t0 >= 0 && (t0 + z.N) <= z.Ns * z.L, fn, ": chunk > 0 and keys through t0 + N - 1");
  const int64_t* ip = idx.data_ptr<int64_t>();
  const bool* okp = ok.data_ptr<bool>();
  for (int64_t e = 0; e < idx.numel(); ++e) {
    TORCH_CHECK(!okp[e] || (ip[e] >= 0 && ip[e] < z.Ns), fn, ": a picked block is out of range");
  }
  z.r = z.H / z.G;
  z.nchunk = (z.N + chunk - 1) / chunk;
  return z;
}

// The (query, block) pairs of c queries' picks ib / ob [c, n], sorted by block (counting sort,
// queries ascending within a block) into w.start / w.pair_query.
void sort_pairs(Chunk& w, const int64_t* ib, const bool* ob, int64_t c, int64_t n, int64_t Ns) {
  w.start.assign(Ns + 1, 0);
  for (int64_t e = 0; e < c * n; ++e) if (ob[e]) ++w.start[ib[e] + 1];
  for (int64_t j = 0; j < Ns; ++j) w.start[j + 1] += w.start[j];
  w.pair_query.resize(w.start[Ns]);
  std::vector<int64_t> fill(w.start.begin(), w.start.end() - 1);
  for (int64_t e = 0; e < c * n; ++e) if (ob[e]) w.pair_query[fill[ib[e]]++] = e / n;
}

// The gathered query rows of block j's pairs: the picking queries' r head rows, row p r + h, from
// x [B, H, N, W] (rows of width W) into dst [np r, W].
void gather_rows(const float* x, float* dst, const Chunk& w, int64_t p0, int64_t np, int64_t b, int64_t g,
                 int64_t i0, const Shape& z, int64_t W) {
  for (int64_t p = 0; p < np; ++p) {
    const int64_t i = i0 + w.pair_query[p0 + p];
    for (int64_t h = 0; h < z.r; ++h) {
      std::copy_n(x + ((b * z.H + g * z.r + h) * z.N + i) * W, W, dst + (p * z.r + h) * W);
    }
  }
}

}  // namespace

// NSA's selected branch: q [B, G r, N, D], kb [B, G, Ns, L, D], vb [B, G, Ns, L, Dv] (keys cut into
// selection blocks of L, zero-padded), idx [B, G, N, n] int64 picked blocks, ok [B, G, N, n] bool
// (false: a padding slot), all contiguous. Query i (position t0 + i) attends, with the scores
// scale * q.k, over the keys <= t0 + i of its picked blocks; the r query heads of KV group g share
// the picks. Organised by block: per chunk of `chunk` queries of one (b, g), every block's pairs
// are one sgemm for the scores and one for P V, merged into the query rows by a running maximum.
// Writes out [B, G r, N, Dv] and, where lsep is given, each row's log-sum-exp in log2 units of
// the scaled scores ([B, G r, N]; NaN for a row that saw an inf or a NaN score).
static void selected_forward(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& idx,
                             const at::Tensor& ok, int64_t t0, double scale, int64_t chunk, const Shape& z,
                             float* op, float* lsep) {
  const int64_t N = z.N, D = z.D, Dv = z.Dv, L = z.L, Ns = z.Ns, n = z.n, r = z.r, H = z.H, G = z.G;
  const int64_t* ip = idx.data_ptr<int64_t>();
  const bool* okp = ok.data_ptr<bool>();
  const float* qp = q.data_ptr<float>();
  const float *kp = kb.data_ptr<float>(), *vp = vb.data_ptr<float>();
  // built with -ffast-math (no infinities): "no score yet" is the lowest finite float
  const float alpha2 = (float)scale * 1.4426950408889634f, none = std::numeric_limits<float>::lowest();
  at::parallel_for(0, z.B * G * z.nchunk, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    Chunk w;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / z.nchunk, i0 = (task % z.nchunk) * chunk, i1 = std::min(N, i0 + chunk), c = i1 - i0;
      const int64_t b = bg / G, g = bg % G;
      sort_pairs(w, ip + (bg * N + i0) * n, okp + (bg * N + i0) * n, c, n, Ns);
      w.m.assign(c * r, none);
      w.l.assign(c * r, 0.f);
      w.bad.assign(c * r, 0);
      w.acc.assign(c * r * Dv, 0.f);
      for (int64_t j = 0; j < Ns; ++j) {
        const int64_t p0 = w.start[j], np = w.start[j + 1] - p0, R = np * r;
        if (np == 0) continue;
        w.qt.resize(R * D); w.s.resize(R * L); w.o.resize(R * Dv); w.alpha.resize(R);
        gather_rows(qp, w.qt.data(), w, p0, np, b, g, i0, z, D);
        const float* kj = kp + ((bg * Ns) + j) * L * D;
        const float* vj = vp + ((bg * Ns) + j) * L * Dv;
        gemm('T', 'N', (int)L, (int)R, (int)D, alpha2, kj, (int)D, w.qt.data(), (int)D, 0.f, w.s.data(), (int)L);
        for (int64_t p = 0; p < np; ++p) {
          const int64_t qi = w.pair_query[p0 + p];
          const int64_t hi = std::min<int64_t>(L, t0 + i0 + qi - j * L + 1);  // keys <= the query's position
          for (int64_t h = 0; h < r; ++h) {
            const int64_t row = p * r + h, st = qi * r + h;
            float* sr = w.s.data() + row * L;
            float mx = none;
            for (int64_t k = 0; k < hi; ++k) mx = std::max(mx, sr[k]);
            if (hi < L) std::fill(sr + std::max<int64_t>(hi, 0), sr + L, 0.f);
            if (hi <= 0) { w.alpha[row] = 1.f; continue; }  // no visible key in this block (not from pick_blocks)
            if (any_nonfinite(sr, hi)) w.bad[st] = 1;  // the row ends as NaN
            const float m_new = std::max(w.m[st], mx);
            float sum = 0.f;
            for (int64_t k = 0; k < hi; ++k) { const float e = exp2_clamped(sr[k] - m_new); sr[k] = e; sum += e; }
            const float a = w.m[st] == none ? 0.f : exp2_clamped(w.m[st] - m_new);  // 0 for the row's first block
            w.alpha[row] = a;
            w.l[st] = w.l[st] * a + sum;
            w.m[st] = m_new;
          }
        }
        gemm('N', 'N', (int)Dv, (int)R, (int)L, 1.f, vj, (int)Dv, w.s.data(), (int)L, 0.f, w.o.data(), (int)Dv);
        for (int64_t p = 0; p < np; ++p) {
          const int64_t qi = w.pair_query[p0 + p];
          for (int64_t h = 0; h < r; ++h) {
            const int64_t row = p * r + h;
            float* acc = w.acc.data() + (qi * r + h) * Dv;
            const float* o = w.o.data() + row * Dv;
            const float a = w.alpha[row];
            for (int64_t d = 0; d < Dv; ++d) acc[d] = acc[d] * a + o[d];
          }
        }
      }
      for (int64_t qi = 0; qi < c; ++qi) {
        for (int64_t h = 0; h < r; ++h) {
          const int64_t st = qi * r + h, at_row = (b * H + g * r + h) * N + i0 + qi;
          const float lsum = w.l[st], inv = lsum > 0.f ? 1.f / lsum : 0.f;
          const float* acc = w.acc.data() + st * Dv;
          float* o = op + at_row * Dv;
          if (w.bad[st]) {
            std::fill(o, o + Dv, nan_value());
            if (lsep) lsep[at_row] = nan_value();
            continue;
          }
          for (int64_t d = 0; d < Dv; ++d) o[d] = acc[d] * inv;
          if (lsep) lsep[at_row] = lsum > 0.f ? w.m[st] + std::log2(lsum) : none;
        }
      }
    }
  });
}

at::Tensor nsa_selected_fwd(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& idx,
                            const at::Tensor& ok, int64_t t0, double scale, int64_t chunk) {
  const Shape z = check_args("nsa_selected_fwd", q, kb, vb, idx, ok, t0, chunk);
  at::Tensor out = at::empty({z.B, z.H, z.N, z.Dv}, q.options());
  selected_forward(q, kb, vb, idx, ok, t0, scale, chunk, z, out.data_ptr<float>(), nullptr);
  return out;
}

// nsa_selected_fwd for training: also returns each row's log-sum-exp [B, G r, N] (log2 units of the
// scaled scores), which nsa_selected_bwd reads.
std::vector<at::Tensor> nsa_selected_train_fwd(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                                               const at::Tensor& idx, const at::Tensor& ok, int64_t t0, double scale,
                                               int64_t chunk) {
  const Shape z = check_args("nsa_selected_train_fwd", q, kb, vb, idx, ok, t0, chunk);
  at::Tensor out = at::empty({z.B, z.H, z.N, z.Dv}, q.options()), lse = at::empty({z.B, z.H, z.N}, q.options());
  selected_forward(q, kb, vb, idx, ok, t0, scale, chunk, z, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

// The backward of nsa_selected_train_fwd: out, d_out [B, G r, N, Dv], lse [B, G r, N] (its log2
// log-sum-exps). Per chunk of queries and picked block, as the forward: S recomputed, P = 2^(S - lse),
// dP = dO V^T, dS = P (dP - delta) with delta = rowsum(dO out), dQ += scale dS K (the task's own
// rows), dK += scale dS^T Q and dV += P^T dO into a private copy of the blocks per range of tasks (one
// range a thread), added to the outputs under a lock when the range is done. A row whose LSE is not finite (it saw an inf or a NaN) sends NaN to its
// dQ and nothing to the blocks. Returns dq [B, G r, N, D], dkb [B, G, Ns, L, D], dvb [B, G, Ns, L, Dv].
std::vector<at::Tensor> nsa_selected_bwd(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                                         const at::Tensor& idx, const at::Tensor& ok, const at::Tensor& out,
                                         const at::Tensor& lse, const at::Tensor& d_out, int64_t t0, double scale,
                                         int64_t chunk) {
  const Shape z = check_args("nsa_selected_bwd", q, kb, vb, idx, ok, t0, chunk);
  for (const at::Tensor* t : {&out, &d_out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                t->sizes() == at::IntArrayRef({z.B, z.H, z.N, z.Dv}), "nsa_selected_bwd: out and d_out must be "
                "contiguous float32 [B, H, N, Dv]");
  }
  TORCH_CHECK(lse.device().is_cpu() && lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
              lse.sizes() == at::IntArrayRef({z.B, z.H, z.N}), "nsa_selected_bwd: lse must be float32 [B, H, N]");
  const int64_t N = z.N, D = z.D, Dv = z.Dv, L = z.L, Ns = z.Ns, n = z.n, r = z.r, H = z.H, G = z.G;
  const int64_t blocks = z.B * G * Ns * L;
  at::Tensor dq = at::zeros({z.B, H, N, D}, q.options());
  at::Tensor dkb = at::zeros(kb.sizes(), kb.options()), dvb = at::zeros(vb.sizes(), vb.options());
  const int64_t* ip = idx.data_ptr<int64_t>();
  const bool* okp = ok.data_ptr<bool>();
  const float *qp = q.data_ptr<float>(), *kp = kb.data_ptr<float>(), *vp = vb.data_ptr<float>();
  const float *opp = out.data_ptr<float>(), *dop = d_out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  const float alpha2 = (float)scale * 1.4426950408889634f, sc = (float)scale;
  float *dkp = dkb.data_ptr<float>(), *dvp = dvb.data_ptr<float>();
  std::mutex merge;
  at::parallel_for(0, z.B * G * z.nchunk, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    Chunk w;
    // this range's private dK / dV of every block (a range per thread), added to the outputs at its end
    std::vector<float> dk(blocks * D, 0.f), dv(blocks * Dv, 0.f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / z.nchunk, i0 = (task % z.nchunk) * chunk, i1 = std::min(N, i0 + chunk), c = i1 - i0;
      const int64_t b = bg / G, g = bg % G;
      sort_pairs(w, ip + (bg * N + i0) * n, okp + (bg * N + i0) * n, c, n, Ns);
      w.delta.assign(c * r, 0.f);
      w.bad.assign(c * r, 0);
      for (int64_t qi = 0; qi < c; ++qi) {
        for (int64_t h = 0; h < r; ++h) {
          const int64_t at_row = (b * H + g * r + h) * N + i0 + qi;
          float acc = 0.f;
          for (int64_t d = 0; d < Dv; ++d) acc += dop[at_row * Dv + d] * opp[at_row * Dv + d];
          w.delta[qi * r + h] = acc;
          w.bad[qi * r + h] = any_nonfinite(lp + at_row, 1);
        }
      }
      for (int64_t j = 0; j < Ns; ++j) {
        const int64_t p0 = w.start[j], np = w.start[j + 1] - p0, R = np * r;
        if (np == 0) continue;
        w.qt.resize(R * D); w.dot.resize(R * Dv); w.s.resize(R * L); w.dp.resize(R * L); w.dqt.resize(R * D);
        gather_rows(qp, w.qt.data(), w, p0, np, b, g, i0, z, D);
        gather_rows(dop, w.dot.data(), w, p0, np, b, g, i0, z, Dv);
        const float* kj = kp + ((bg * Ns) + j) * L * D;
        const float* vj = vp + ((bg * Ns) + j) * L * Dv;
        gemm('T', 'N', (int)L, (int)R, (int)D, alpha2, kj, (int)D, w.qt.data(), (int)D, 0.f, w.s.data(), (int)L);
        gemm('T', 'N', (int)L, (int)R, (int)Dv, 1.f, vj, (int)Dv, w.dot.data(), (int)Dv, 0.f, w.dp.data(), (int)L);
        for (int64_t p = 0; p < np; ++p) {
          const int64_t qi = w.pair_query[p0 + p];
          const int64_t hi = std::max<int64_t>(0, std::min<int64_t>(L, t0 + i0 + qi - j * L + 1));
          for (int64_t h = 0; h < r; ++h) {
            const int64_t row = p * r + h, st = qi * r + h;
            float* pr = w.s.data() + row * L;   // becomes P
            float* dsr = w.dp.data() + row * L;  // becomes dS
            if (w.bad[st]) { std::fill(pr, pr + L, 0.f); std::fill(dsr, dsr + L, 0.f); continue; }
            const float m = lp[(b * H + g * r + h) * N + i0 + qi], dl = w.delta[st];
            for (int64_t k = 0; k < hi; ++k) {
              const float pk = exp2_clamped(pr[k] - m);
              pr[k] = pk;
              dsr[k] = pk * (dsr[k] - dl);
            }
            std::fill(pr + hi, pr + L, 0.f);
            std::fill(dsr + hi, dsr + L, 0.f);
          }
        }
        // dQ rows = scale dS K_j; dK_j += scale dS^T Q; dV_j += P^T dO
        gemm('N', 'N', (int)D, (int)R, (int)L, sc, kj, (int)D, w.dp.data(), (int)L, 0.f, w.dqt.data(), (int)D);
        gemm('N', 'T', (int)D, (int)L, (int)R, sc, w.qt.data(), (int)D, w.dp.data(), (int)L, 1.f,
             dk.data() + ((bg * Ns) + j) * L * D, (int)D);
        gemm('N', 'T', (int)Dv, (int)L, (int)R, 1.f, w.dot.data(), (int)Dv, w.s.data(), (int)L, 1.f,
             dv.data() + ((bg * Ns) + j) * L * Dv, (int)Dv);
        for (int64_t p = 0; p < np; ++p) {
          const int64_t i = i0 + w.pair_query[p0 + p];
          for (int64_t h = 0; h < r; ++h) {
            float* dst = dqp + ((b * H + g * r + h) * N + i) * D;
            const float* src = w.dqt.data() + (p * r + h) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] += src[d];
          }
        }
      }
      for (int64_t qi = 0; qi < c; ++qi) {  // a row that saw an inf or a NaN: NaN
        for (int64_t h = 0; h < r; ++h) {
          if (!w.bad[qi * r + h]) continue;
          float* dst = dqp + ((b * H + g * r + h) * N + i0 + qi) * D;
          std::fill(dst, dst + D, nan_value());
        }
      }
    }
    const std::lock_guard<std::mutex> lock(merge);
    for (int64_t x = 0; x < blocks * D; ++x) dkp[x] += dk[x];
    for (int64_t x = 0; x < blocks * Dv; ++x) dvp[x] += dv[x];
  });
  return {dq, dkb, dvb};
}
