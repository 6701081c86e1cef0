"""Benchmark of ``attention_varlen`` (issue 15, item 5): packed vs padded vs per-sequence, and scaling.

Three questions, each answered by medians of interleaved repeats in one process (float32, causal):

1. Same tokens, three layouts: 16 sequences of mixed lengths (16,384 tokens) packed and run by
   one ``tiled`` call, the same sequences padded to the longest into a ``[16, H, Nmax, D]`` batch
   (torch ``sdpa``, its fused causal kernel), and a Python loop of one ``attention`` call per sequence.
2. Does the packed time follow ``sum n_i^2`` rather than ``T^2``? ``T`` fixed at 16,384 tokens cut
   into ``S`` equal sequences (``S = 1, 4, 16, 64``): ``sum n_i^2 = T^2 / S``, so the time should
   fall about ``S``-fold (down to the per-tile overhead); the per-sequence loop beside it.
3. Forward + backward of the mixed packed batch, packed vs per-sequence loop.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_varlen.py    # a few minutes on a busy 2-core machine
    python benchmarks/bench_varlen.py --heads 8 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from bench_core import timed  # medians of interleaved repeats (the script's folder is on sys.path)

import attnzoo as az

D = 64
MIXED = [4096, 2560, 2048, 1536, 1280, 1024, 896, 768, 640, 512, 384, 256, 160, 128, 64, 32]  # 16, sum 16384


def packed(lengths: list[int], heads: int, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(len(lengths))
    t = sum(lengths)
    q, k, v = (torch.randn(t, heads, D, generator=g).requires_grad_(grad) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def padded(q: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``[T, H, D]`` packed -> ``[S, H, Nmax, D]`` padded with zeros on the right."""
    out = q.new_zeros(len(lengths), q.shape[1], max(lengths), q.shape[2])
    start = 0
    for i, n in enumerate(lengths):
        out[i, :, :n] = q[start:start + n].transpose(0, 1)
        start += n
    return out


def loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    outs, start = [], 0
    for n in lengths:
        qi, ki, vi = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(az.attention(qi, ki, vi, causal=True))
        start += n
    return outs


def layouts(heads: int, repeats: int) -> dict[str, float]:
    q, k, v, cu = packed(MIXED, heads)
    qp, kp, vp = (padded(t, MIXED) for t in (q, k, v))
    with torch.no_grad():
        t = timed({
            "packed tiled": lambda: az.attention_varlen(q, k, v, cu, cu, causal=True),
            "padded sdpa": lambda: az.attention(qp, kp, vp, causal=True, backend="sdpa"),
            "per-sequence loop": lambda: loop(q, k, v, MIXED),
        }, repeats)
    for name, s in t.items():
        print(f"  {name:<18} {s * 1e3:9.1f} ms   {s / t['packed tiled']:5.2f}x packed")
    return t


def scaling(heads: int, repeats: int) -> dict[str, float]:
    """Packed tiled vs the per-sequence loop at fixed T, all cases interleaved (same machine load)."""
    total = sum(MIXED)
    fns: dict[str, Callable[[], object]] = {}
    for s in (1, 4, 16, 64):
        lengths = [total // s] * s
        q, k, v, cu = packed(lengths, heads)
        fns[f"packed S={s}"] = lambda q=q, k=k, v=v, cu=cu: az.attention_varlen(q, k, v, cu, cu, causal=True)
        fns[f"loop S={s}"] = lambda q=q, k=k, v=v, lengths=lengths: loop(q, k, v, lengths)
    with torch.no_grad():
        res = timed(fns, repeats)
    for s in (1, 4, 16, 64):
        p, lp = res[f"packed S={s}"], res[f"loop S={s}"]
        print(f"  S={s:<3} n={total // s:<6} sum n^2/T^2={1 / s:6.4f}   packed {p * 1e3:8.1f} ms "
              f"(time/time(S=1) {p / res['packed S=1']:6.4f})   per-sequence loop {lp * 1e3:8.1f} ms")
    frac = sum(n * n for n in MIXED) / total ** 2
    print(f"  mixed lengths of part 1: sum n^2/T^2 = {frac:.4f}")
    return res


def train_step(heads: int, repeats: int) -> dict[str, float]:
    q, k, v, cu = packed(MIXED, heads, grad=True)

    def packed_step() -> None:
        az.attention_varlen(q, k, v, cu, cu, causal=True).sum().backward()

    def loop_step() -> None:
        sum(o.sum() for o in loop(q, k, v, MIXED)).backward()

    t = timed({"packed tiled fwd+bwd": packed_step, "per-sequence loop fwd+bwd": loop_step}, repeats)
    for name, s in t.items():
        print(f"  {name:<26} {s * 1e3:9.1f} ms")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, causal, H={a.heads}, D={D}")
    print(f"1. 16 sequences, {sum(MIXED)} tokens (longest {max(MIXED)}): packed vs padded vs loop (forward)")
    res = {"layouts": layouts(a.heads, a.repeats)}
    print("2. T = 16384 tokens cut into S equal sequences (forward)")
    res["scaling"] = scaling(a.heads, a.repeats)
    print("3. training step on the mixed batch")
    res["train"] = train_step(a.heads, a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
