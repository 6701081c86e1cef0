"""Probe (not a library path): how far a compiled C++ sliding-window kernel gets towards issue 37's
"window (256, 0) at N = 65536 at >= 50% of the run's fp32 matmul peak".

The kernel, compiled here with ``torch.utils.cpp_extension.load_inline`` (g++, about 20 s the first
time, cached afterwards), is the plainest fused design: OpenMP over (head, block of ``B`` queries);
per block one MKL ``sgemm`` for the scores of the ``B + window`` keys the block can see (``log2 e``
folded into the scale), one pass per row for max / ``exp2`` / sum with the invisible columns zeroed,
one ``sgemm`` for ``P V``, and the rows scaled by ``1 / sum`` at the end. It calls the ``sgemm_``
symbol that the x86 CPU wheel of torch exports from ``libtorch_cpu`` (MKL); where that symbol or a
compiler is missing the probe says so and stops. ``--gemm-only`` also times the two matmuls
without the softmax pass: the bound of this design.

The library keeps the PyTorch flat band (:mod:`attnzoo.functional.backends.tiled.flat`) as ``auto``;
docs/performance.md has the numbers this printed and why the kernel is not shipped.

Usage::

    python benchmarks/probe_native_window.py [--blocks 32 64 128] [--repeats 7]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from bench_core import timed  # the script's folder is on sys.path

import attnzoo as az

SOURCE = r"""
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
// i - left .. i + right. Returns out [BH, N, Dv] and lse [BH, N] (natural log).
std::vector<at::Tensor> window_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   int64_t left, int64_t right, double scale, int64_t block,
                                   bool softmax) {
  const int64_t BH = q.size(0), N = q.size(1), D = q.size(2), BHk = k.size(0), Dv = v.size(2);
  const int64_t G = BH / BHk, nblk = (N + block - 1) / block, span = block + left + right;
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
      gemm('T', 'N', L, (int)R, (int)D, (float)(scale * 1.4426950408889634), kb, (int)D, qb, (int)D,
           0.f, S.data(), L);
      for (int64_t r = 0; r < R && softmax; ++r) {
        const int64_t i = s + r;
        const int64_t lo = std::max(k_lo, i - left) - k_lo, hi = std::min(k_hi, i + right + 1) - k_lo;
        float* row = S.data() + r * L;
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
"""


def build():  # type: ignore[no-untyped-def]
    from torch.utils.cpp_extension import load_inline
    flags = ["-O3", "-ffast-math", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags += ["-march=native", "-mprefer-vector-width=512"]
    return load_inline("attnzoo_probe_window", cpp_sources=SOURCE, functions=["window_fwd"],
                       extra_cflags=flags, extra_ldflags=["-fopenmp"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--gemm-only", action="store_true")
    a = p.parse_args()
    t0 = time.perf_counter()
    try:
        ext = build()
    except Exception as e:  # no compiler, no sgemm_ symbol (non-MKL builds): nothing to probe
        raise SystemExit(f"the probe kernel did not build or load here: {type(e).__name__}: {e}") from None
    print(f"built/loaded in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    g = torch.Generator().manual_seed(0)
    for n, (left, right), hk in ((1000, (37, 0), 4), (777, (64, 5), 2), (300, (300, 0), 1)):
        q, k, v = (torch.randn(2, h, n, 32, generator=g) for h in (4, hk, hk))
        ref = az.attention(q.double(), k.double(), v.double(), window=(left, right), causal=right == 0)
        out, _ = ext.window_fwd(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), left, right, 32**-0.5, 64, True)
        err = (out.view_as(ref) - ref).abs().max().item()
        print(f"N={n} window=({left}, {right}) {4 // hk} query heads per KV head: max |ours - float64 reference| {err:.1e}")
    n, w = 65536, 256
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    qf, kf, vf = (x.flatten(0, 1) for x in (q, k, v))
    mm = torch.randn(2048, 2048, generator=g)
    fns = {"mm": lambda: torch.mm(mm, mm), "auto": lambda: az.attention(q, k, v, causal=True, window=(w, 0))}
    for b in a.blocks:
        fns[f"native B={b}"] = lambda b=b: ext.window_fwd(qf, kf, vf, w, 0, 0.125, b, True)
        if a.gemm_only:
            fns[f"  its two sgemm only, B={b}"] = lambda b=b: ext.window_fwd(qf, kf, vf, w, 0, 0.125, b, False)
    with torch.inference_mode():
        t = timed(fns, a.repeats)
    flops = 4.0 * 8 * 64 * sum(min(i, w) + 1 for i in range(n))
    peak = 2 * 2048**3 / t["mm"] / 1e9
    print(f"| window ({w}, 0) N={n}, 8 heads, D=64 | GFLOP/s (peak: fp32 2048^2 matmul {peak:.0f}) | ms | of peak |")
    print("|---|---:|---:|---:|")
    for name, s in t.items():
        if name != "mm":
            print(f"| {name} | {flops / s / 1e9:.0f} | {s * 1e3:.0f} | {100 * flops / s / 1e9 / peak:.0f}% |")


if __name__ == "__main__":
    main()
