// attnzoo's compiled NSA selected branch (float32 CPU inference); built with native_window.cpp by
// `attnzoo native --build`. Reference: attnzoo.functional.softmax.nsa (_chunk_selected, _selected_tiles).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
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
};

}  // namespace

// NSA's selected branch: q [B, G r, N, D], kb [B, G, Ns, L, D], vb [B, G, Ns, L, Dv] (keys cut into
// selection blocks of L, zero-padded), idx [B, G, N, n] int64 picked blocks, ok [B, G, N, n] bool
// (false: a padding slot), all contiguous. Query i (position t0 + i) attends, with the scores
// scale * q.k, over the keys <= t0 + i of its picked blocks; the r query heads of KV group g share
// the picks. Organised by block: per chunk of `chunk` queries of one (b, g), every block's pairs
// are one sgemm for the scores and one for P V, merged into the query rows by a running maximum.
// Returns out [B, G r, N, Dv].
at::Tensor nsa_selected_fwd(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& idx,
                            const at::Tensor& ok, int64_t t0, double scale, int64_t chunk) {
  for (const at::Tensor* t : {&q, &kb, &vb}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "nsa_selected_fwd: q, kb, vb must be contiguous float32 CPU tensors");
  }
  TORCH_CHECK(q.dim() == 4 && kb.dim() == 5 && vb.dim() == 5, "nsa_selected_fwd: q must be 4-d, kb and vb 5-d");
  TORCH_CHECK(idx.scalar_type() == at::kLong && ok.scalar_type() == at::kBool && idx.is_contiguous() &&
              ok.is_contiguous() && idx.dim() == 4 && idx.sizes() == ok.sizes(),
              "nsa_selected_fwd: idx (int64) and ok (bool) must be contiguous [B, G, N, n]");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t G = kb.size(1), Ns = kb.size(2), L = kb.size(3), Dv = vb.size(4), n = idx.size(3);
  TORCH_CHECK(kb.size(0) == B && vb.size(0) == B && vb.size(1) == G && vb.size(2) == Ns && vb.size(3) == L &&
              kb.size(4) == D && G > 0 && H % G == 0, "nsa_selected_fwd: q, kb, vb shapes disagree");
  TORCH_CHECK(idx.size(0) == B && idx.size(1) == G && idx.size(2) == N, "nsa_selected_fwd: idx must be [B, G, N, n]");
  TORCH_CHECK(chunk > 0 && t0 >= 0 && (t0 + N) <= Ns * L, "nsa_selected_fwd: chunk > 0 and keys through t0 + N - 1");
  const int64_t r = H / G, nchunk = (N + chunk - 1) / chunk;
  const int64_t* ip = idx.data_ptr<int64_t>();
  const bool* okp = ok.data_ptr<bool>();
  for (int64_t e = 0; e < idx.numel(); ++e) {
    TORCH_CHECK(!okp[e] || (ip[e] >= 0 && ip[e] < Ns), "nsa_selected_fwd: a picked block is out of range");
  }
  at::Tensor out = at::empty({B, H, N, Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float *kp = kb.data_ptr<float>(), *vp = vb.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // built with -ffast-math (no infinities): "no score yet" is the lowest finite float
  const float alpha2 = (float)scale * 1.4426950408889634f, none = std::numeric_limits<float>::lowest();
  at::parallel_for(0, B * G * nchunk, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    Chunk w;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / nchunk, i0 = (task % nchunk) * chunk, i1 = std::min(N, i0 + chunk), c = i1 - i0;
      const int64_t b = bg / G, g = bg % G;
      const int64_t* ib = ip + (bg * N + i0) * n;
      const bool* ob = okp + (bg * N + i0) * n;
      // pairs by block (counting sort, queries ascending within a block)
      w.start.assign(Ns + 1, 0);
      for (int64_t e = 0; e < c * n; ++e) if (ob[e]) ++w.start[ib[e] + 1];
      for (int64_t j = 0; j < Ns; ++j) w.start[j + 1] += w.start[j];
      w.pair_query.resize(w.start[Ns]);
      std::vector<int64_t> fill(w.start.begin(), w.start.end() - 1);
      for (int64_t e = 0; e < c * n; ++e) if (ob[e]) w.pair_query[fill[ib[e]]++] = e / n;
      w.m.assign(c * r, none);
      w.l.assign(c * r, 0.f);
      w.bad.assign(c * r, 0);
      w.acc.assign(c * r * Dv, 0.f);
      for (int64_t j = 0; j < Ns; ++j) {
        const int64_t p0 = w.start[j], np = w.start[j + 1] - p0, R = np * r;
        if (np == 0) continue;
        w.qt.resize(R * D); w.s.resize(R * L); w.o.resize(R * Dv); w.alpha.resize(R);
        for (int64_t p = 0; p < np; ++p) {  // the picking queries' r head rows, row p r + h
          const int64_t i = i0 + w.pair_query[p0 + p];
          for (int64_t h = 0; h < r; ++h) {
            std::copy_n(qp + ((b * H + g * r + h) * N + i) * D, D, w.qt.data() + (p * r + h) * D);
          }
        }
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
          const float lsum = w.l[qi * r + h], inv = lsum > 0.f ? 1.f / lsum : 0.f;
          const float* acc = w.acc.data() + (qi * r + h) * Dv;
          float* o = op + ((b * H + g * r + h) * N + i0 + qi) * Dv;
          if (w.bad[qi * r + h]) { std::fill(o, o + Dv, nan_value()); continue; }
          for (int64_t d = 0; d < Dv; ++d) o[d] = acc[d] * inv;
        }
      }
    }
  });
  return out;
}
