"""Benchmark of ``score_mod`` (issue 36): ALiBi written as a score_mod against the built-in
``alibi_slopes`` path of the same backend (``tiled``), causal, forward and forward+backward.

Every number is a ratio against its peer measured in the same run (medians of repeats, the two
interleaved so that machine load hits both alike). The score_mod captures the slopes; with
``--learned`` they require gradients (the built-in path cannot serve that on ``tiled``, so then
the peer is the built-in path with fixed slopes: the ratio includes the slopes' gradient).

Usage::

    python benchmarks/bench_score_mod.py                       # N = 4096 and 16384, H = 4, D = 64
    python benchmarks/bench_score_mod.py --sizes 4096 --heads 8 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from bench_core import timed  # medians of interleaved repeats (the script's folder is on sys.path)

import attnzoo as az
from attnzoo.nn.positional import alibi_slopes


def alibi_score_mod(slopes: torch.Tensor) -> Callable[..., torch.Tensor]:
    """ALiBi as a score_mod: ``score - slope_h * |q_idx - kv_idx|``."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return score_mod


def case(n: int, heads: int, dim: int, repeats: int, learned: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g, requires_grad=True) for _ in range(3))
    slopes = alibi_slopes(heads)
    mod_slopes = slopes.clone().requires_grad_(learned)
    mod = alibi_score_mod(mod_slopes)

    def fwd_builtin() -> object:
        with torch.no_grad():
            return az.attention(q, k, v, causal=True, alibi_slopes=slopes, backend="tiled")

    def fwd_mod() -> object:
        with torch.no_grad():
            return az.attention(q, k, v, causal=True, score_mod=mod, backend="tiled")

    def train_builtin() -> object:
        az.attention(q, k, v, causal=True, alibi_slopes=slopes, backend="tiled").sum().backward()
        return None

    def train_mod() -> object:
        az.attention(q, k, v, causal=True, score_mod=mod, backend="tiled").sum().backward()
        return None

    f = timed({"builtin": fwd_builtin, "score_mod": fwd_mod}, repeats)
    t = timed({"builtin": train_builtin, "score_mod": train_mod}, repeats)
    return {"N": n, "fwd_builtin_s": f["builtin"], "fwd_score_mod_s": f["score_mod"],
            "fwd_ratio": f["score_mod"] / f["builtin"], "train_builtin_s": t["builtin"],
            "train_score_mod_s": t["score_mod"], "train_ratio": t["score_mod"] / t["builtin"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--learned", action="store_true", help="the score_mod's slopes require gradients")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    rows = []
    print(f"score_mod ALiBi vs built-in alibi_slopes, tiled, causal, B=1 H={args.heads} D={args.dim}, "
          f"torch threads {torch.get_num_threads()}, learned slopes: {args.learned}")
    print(f"{'N':>6} {'fwd builtin':>12} {'fwd mod':>10} {'ratio':>6} {'f+b builtin':>12} {'f+b mod':>10} {'ratio':>6}")
    for n in args.sizes:
        r = case(n, args.heads, args.dim, args.repeats, args.learned)
        rows.append(r)
        print(f"{n:>6} {r['fwd_builtin_s']:>11.3f}s {r['fwd_score_mod_s']:>9.3f}s {r['fwd_ratio']:>6.2f} "
              f"{r['train_builtin_s']:>11.3f}s {r['train_score_mod_s']:>9.3f}s {r['train_ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
