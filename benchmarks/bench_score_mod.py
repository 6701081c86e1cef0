"""Benchmark of ``score_mod`` (issue 36): ALiBi written as a score_mod against the built-in
``alibi_slopes`` path of the same backend (``tiled``), causal, forward and forward+backward.

Every number is a ratio against its peer measured in the same run (medians of repeats, the two
interleaved so that machine load hits both alike). The score_mod captures the slopes; with
``--learned`` they require gradients (the built-in path cannot serve that on ``tiled``, so then
the peer is the built-in path with fixed slopes: the ratio includes the slopes' gradient).

Usage::

    python benchmarks/bench_score_mod.py                       # N = 4096 and 16384, H = 4, D = 64
    python benchmarks/bench_score_mod.py --sizes 4096 --heads 8 --repeats 5 --json out.json
    python benchmarks/bench_score_mod.py --flex    # also the compiled path: FlexAttention forward (CPU: no backward)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import attnzoo as az
from attnzoo.nn.positional import alibi_slopes


def _once(f: Callable[[], object]) -> tuple[float, float]:
    """``(wall, process CPU)`` seconds of one call of ``f``."""
    w, c = time.perf_counter(), time.process_time()
    f()
    return time.perf_counter() - w, time.process_time() - c


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median ``(wall, CPU)`` seconds of each function over ``repeats`` rounds, the functions
    interleaved round-robin after one warm-up call each. On a shared machine the process CPU
    time is the steadier number (one thread: it excludes the time other processes ran)."""
    for f in fns.values():
        f()
    rounds = [{name: _once(f) for name, f in fns.items()} for _ in range(repeats)]
    return {name: (statistics.median(r[name][0] for r in rounds), statistics.median(r[name][1] for r in rounds))
            for name in fns}


def alibi_score_mod(slopes: torch.Tensor) -> Callable[..., torch.Tensor]:
    """ALiBi as a score_mod: ``score - slope_h * |q_idx - kv_idx|``."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return score_mod


def case(n: int, heads: int, dim: int, repeats: int, learned: bool, with_flex: bool = False) -> dict[str, float]:
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

    qd, kd, vd = (t.detach() for t in (q, k, v))  # FlexAttention on CPU refuses inputs that require grad

    def fwd_flex() -> object:
        with torch.no_grad():
            return az.attention(qd, kd, vd, causal=True, score_mod=mod, backend="flex")

    fwd = {"builtin": fwd_builtin, "score_mod": fwd_mod, **({"flex": fwd_flex} if with_flex else {})}
    f = timed(fwd, repeats)  # (the first call of flex compiles: the warm-up call of timed())
    t = timed({"builtin": train_builtin, "score_mod": train_mod}, repeats)
    row: dict[str, float] = {"N": n}
    for tag, res in (("fwd", f), ("train", t)):
        for i, unit in enumerate(("wall", "cpu")):
            row[f"{tag}_builtin_{unit}_s"], row[f"{tag}_score_mod_{unit}_s"] = res["builtin"][i], res["score_mod"][i]
            row[f"{tag}_{unit}_ratio"] = res["score_mod"][i] / res["builtin"][i]
    if with_flex:
        for i, unit in enumerate(("wall", "cpu")):
            row[f"fwd_flex_{unit}_s"] = f["flex"][i]
            row[f"fwd_flex_{unit}_ratio"] = f["flex"][i] / f["builtin"][i]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--learned", action="store_true", help="the score_mod's slopes require gradients")
    p.add_argument("--flex", action="store_true",
                   help="also time the score_mod forward on backend='flex' (torch.compile'd FlexAttention)")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    rows = []
    print(f"score_mod ALiBi vs built-in alibi_slopes, tiled, causal, B=1 H={args.heads} D={args.dim}, "
          f"torch threads {torch.get_num_threads()}, learned slopes: {args.learned}")
    print("times: median wall / median process CPU seconds; ratio = score_mod / built-in")
    print(f"{'N':>6} {'fwd builtin':>16} {'fwd mod':>16} {'ratio':>11} {'f+b builtin':>16} {'f+b mod':>16} {'ratio':>11}")
    for n in args.sizes:
        r = case(n, args.heads, args.dim, args.repeats, args.learned, args.flex)
        rows.append(r)
        cells = [f"{r[f'{t}_{w}_wall_s']:7.2f}/{r[f'{t}_{w}_cpu_s']:<7.2f}"
                 for t in ("fwd", "train") for w in ("builtin", "score_mod")]
        ratios = [f"{r[f'{t}_wall_ratio']:4.2f}/{r[f'{t}_cpu_ratio']:<4.2f}" for t in ("fwd", "train")]
        print(f"{n:>6} {cells[0]:>16} {cells[1]:>16} {ratios[0]:>11} {cells[2]:>16} {cells[3]:>16} {ratios[1]:>11}")
        if args.flex:
            print(f"{'':>6} flex score_mod forward {r['fwd_flex_wall_s']:.2f}/{r['fwd_flex_cpu_s']:.2f} s, ratio to "
                  f"built-in {r['fwd_flex_wall_ratio']:.2f}/{r['fwd_flex_cpu_ratio']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
