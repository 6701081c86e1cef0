// attnzoo's compiled attention forward (float32, CPU: full, causal, sliding windows, softcap); built by
// `attnzoo native --build`. Reference: attnzoo.functional.backends.tiled (PyTorch); see tiled/native.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*, const int*);

// Column-major BLAS: C = alpha op(A) op(B) + beta C.
static void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// q [BH, N, D], k [BHk, N, D], v [BHk, N, Dv] contiguous float32; query i sees keys
// i - left .. i + right (left = right = N: every key; left = N, right = 0: causal). Scores are
// scale * q.k, capped to softcap * tanh(score / softcap) when softcap > 0. Returns out [BH, N, Dv]
// and lse [BH, N] (natural log). softmax = false leaves the two sgemm only (a benchmark bound).
std::vector<at::Tensor> window_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   int64_t left, int64_t right, double scale, double softcap,
                                   int64_t block, bool softmax) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous(),
                "window_fwd: q, k, v must be contiguous 3-d float32 CPU tensors");
  }
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0 && v.size(0) == k.size(0), "window_fwd: q heads must be a multiple of k/v heads");
  TORCH_CHECK(k.size(1) == q.size(1) && v.size(1) == q.size(1) && k.size(2) == q.size(2), "window_fwd: q, k, v lengths or q/k widths differ");
  TORCH_CHECK(left >= 0 && right >= 0 && block > 0, "window_fwd: left, right must be >= 0 and block > 0");
  TORCH_CHECK(softcap >= 0, "window_fwd: softcap must be >= 0 (0: none)");
  const int64_t BH = q.size(0), N = q.size(1), D = q.size(2), BHk = k.size(0), Dv = v.size(2);
  const int64_t G = BH / BHk, nblk = (N + block - 1) / block;
  const int64_t span = std::min<int64_t>(N, block + std::min(left, N) + std::min(right, N));
  const float log2e = 1.4426950408889634f, cap = (float)softcap, inv_cap = cap > 0 ? 1.f / cap : 0.f;
  const float alpha = cap > 0 ? (float)scale : (float)scale * log2e;  // capped scores take log2 e after tanh
  auto out = at::empty({BH, N, Dv}, q.options());
  auto lse = at::empty({BH, N}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, BH * nblk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S(block * span), inv(block);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nblk, s = (t % nblk) * block, e = std::min(N, s + block), R = e - s;
      const int64_t kv = bh / G, k_lo = std::max<int64_t>(0, s - left), k_hi = std::min(N, e + right);
      const int L = (int)(k_hi - k_lo);
      const float* qb = qp + (bh * N + s) * D;
      const float* kb = kp + (kv * N + k_lo) * D;
      const float* vb = vp + (kv * N + k_lo) * Dv;
      float* ob = op + (bh * N + s) * Dv;
      gemm('T', 'N', L, (int)R, (int)D, alpha, kb, (int)D, qb, (int)D, 0.f, S.data(), L);
      for (int64_t r = 0; r < R && softmax; ++r) {
        const int64_t i = s + r;
        const int64_t lo = std::max(k_lo, i - left) - k_lo, hi = std::min(k_hi, i + right + 1) - k_lo;
        float* row = S.data() + r * L;
        if (cap > 0) {
          // cap tanh(x / cap) as cap (1 - 2 / (2^(2 log2e x / cap) + 1)): exp2f vectorises, tanhf does not
          const float k2 = 2.f * log2e * inv_cap, capl2 = cap * log2e;
          for (int64_t c = lo; c < hi; ++c) row[c] = capl2 * (1.f - 2.f / (exp2f(row[c] * k2) + 1.f));
        }
        float m = neg_inf;
        for (int64_t c = lo; c < hi; ++c) m = std::max(m, row[c]);
        if (lo > 0) std::fill(row, row + lo, 0.f);
        if (hi < L) std::fill(row + hi, row + L, 0.f);
        float sum = 0.f;
        for (int64_t c = lo; c < hi; ++c) { const float p = exp2f(row[c] - m); row[c] = p; sum += p; }
        lp[bh * N + i] = (m + std::log2(sum)) * 0.6931471805599453f;
        inv[r] = 1.f / sum;
      }
      gemm('N', 'N', (int)Dv, (int)R, L, 1.f, vb, (int)Dv, S.data(), L, 0.f, ob, (int)Dv);
      for (int64_t r = 0; r < R && softmax; ++r) {
        float* o = ob + r * Dv;
        for (int64_t c = 0; c < Dv; ++c) o[c] *= inv[r];
      }
    }
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("window_fwd", &window_fwd, "sliding-window attention forward (float32)");
}
