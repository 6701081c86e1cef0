"""Native sparse attention: forward time of the fast form vs dense causal attention at long N.

B=1, H=8 query heads, Hkv=2 (GQA groups of 4, as published), D=64, float32, forward only
(inference mode), kernels on ``[B, H, N, D]`` inputs (no projections). NSA uses the paper's block
sizes: compressed blocks ``l=32`` with stride ``d=16``, top-``n=16`` selected blocks of ``l'=64``
tokens (the first and two local blocks included), window ``w=512``. Rows:

* ``nsa``: :func:`attnzoo.functional.softmax.nsa.nsa_attention` (``form="fast"``), block compression
  included (the MLP of :class:`attnzoo.nn.nsa.BlockCompressor`);
* ``nsa:selected``: the selected branch alone as inference runs it (random block picks
  precomputed; :func:`attnzoo.functional.softmax.nsa._selected_tiles` in passes of ``SDPA_PASS``
  queries): it reads only the ``n l'`` selected keys per query, so its time should grow ~linearly
  in N (``t(4N)/t(N)`` ~ 4); the compressed branch still scores ``N^2 / (2 d)`` (query, block) pairs;
* ``nsa:window``: the window branch alone (``az.attention(window=(w - 1, 0), causal=True)`` as one
  banded call over blocks of 128 queries, each over the ``128 + w - 1`` keys their windows reach);
* ``dense``: ``az.attention(q, k, v, causal=True, backend="sdpa")`` (GQA, K/V not expanded). Above
  ``--dense-max`` it is not run: the table shows ``t(dense-max) * (N / dense-max)^2`` marked
  ``(estimate)``.

Usage::

    python benchmarks/bench_nsa.py                          # N = 16384 and 65536
    python benchmarks/bench_nsa.py --sizes 4096 --repeats 3

Times are medians of ``--repeats`` calls after one warm-up at N=2048: wall clock and process CPU
time (all torch threads; a shared machine inflates it less than wall time). Compare columns within
one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnzoo as az
from attnzoo.functional.softmax.nsa import (
    SDPA_PASS,
    NSAConfig,
    _blocks,
    _selected_tiles,
    _window,
    nsa_attention,
    pick_blocks,
)
from attnzoo.nn.nsa import BlockCompressor

B, H, HKV, D = 1, 8, 2, 64
CFG = NSAConfig(block_len=32, block_stride=16, select_len=64, num_selected=16, window=512)
CHUNK = 128


def _inputs(n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, n, D, generator=g)
    k = torch.randn(B, HKV, n, D, generator=g)
    v = torch.randn(B, HKV, n, D, generator=g)
    gates = torch.rand(B, H, n, 3, generator=g)
    return q, k, v, gates


def _calls(n: int) -> dict[str, Callable[[], object]]:
    q, k, v, gates = _inputs(n)
    torch.manual_seed(0)
    kc, vc = BlockCompressor(D, CFG.block_len, CFG.block_stride, {}), BlockCompressor(D, CFG.block_len,
                                                                                     CFG.block_stride, {})

    def nsa() -> object:
        return nsa_attention(q, k, v, kc(k), vc(v), gates, CFG, form="fast", query_chunk=CHUNK)

    kb, vb = _blocks(k, CFG.select_len), _blocks(v, CFG.select_len)
    ns = kb.shape[2]
    picks = []
    g = torch.Generator().manual_seed(1)
    n_sel = min(CFG.num_selected, ns)
    for a in range(0, n, SDPA_PASS):
        t = torch.arange(a, min(n, a + SDPA_PASS))
        idx, ok = pick_blocks(torch.rand(B, HKV, len(t), ns, generator=g), t, CFG)
        picks.append((t, F.pad(idx, (0, n_sel - idx.shape[-1])), F.pad(ok, (0, n_sel - ok.shape[-1]))))
    scale = D ** -0.5

    def selected() -> object:
        return [_selected_tiles(q[:, :, t[0]:t[-1] + 1].unflatten(1, (HKV, H // HKV)), kb, vb, idx, ok, t, CFG, scale)
                for t, idx, ok in picks]

    return {"nsa": nsa, "nsa:selected": selected,
            "nsa:window": lambda: _window(q, k, v, CFG, 0, scale, CHUNK, "auto"),
            "dense": lambda: az.attention(q, k, v, causal=True, backend="sdpa")}


def _time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and process-CPU seconds of ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dense-max", type=int, default=16384, help="largest N at which dense attention is run")
    a = p.parse_args(argv)
    with torch.inference_mode():
        for fn in _calls(2048).values():  # warm-up
            fn()
        rows: dict[str, dict[int, str]] = {}
        dense_ref: tuple[int, float] | None = None
        for n in a.sizes:
            for name, fn in _calls(n).items():
                if name == "dense" and n > a.dense_max:
                    est = "n/a" if dense_ref is None else f"{dense_ref[1] * (n / dense_ref[0]) ** 2:.1f} (estimate)"
                    rows.setdefault(name, {})[n] = est
                    continue
                s, c = _time(fn, a.repeats)
                if name == "dense":
                    dense_ref = (n, s)
                rows.setdefault(name, {})[n] = f"{s:.2f} (cpu {c:.2f})"
                print(f"{name:>14} N={n:>6}: {s:.2f} s wall, {c:.2f} s process CPU", flush=True)
    print(f"\nforward seconds: wall (process CPU), B={B} H={H} Hkv={HKV} D={D} fp32, torch threads={torch.get_num_threads()}, "
          f"l={CFG.block_len} d={CFG.block_stride} l'={CFG.select_len} n={CFG.num_selected} w={CFG.window}")
    print("| method | " + " | ".join(f"N={n}" for n in a.sizes) + " |")
    print("|---|" + "---|" * len(a.sizes))
    for name, cols in rows.items():
        print(f"| {name} | " + " | ".join(cols[n] for n in a.sizes) + " |")


if __name__ == "__main__":
    main()
