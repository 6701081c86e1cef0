"""Mamba-1's selective scan (:func:`attnzoo.selective_scan`): the chunk length policy.

The scan runs as gated linear attention with ``I`` value heads of width 1 and a decay per key
channel, so its cost is the chunked intra-chunk scores (``[B, I, T, chunk]``). With Mamba's decays
(``A = -(1..N)``, ``dt`` log-uniform in ``[1e-3, 0.1]``: the S4D-real initialisation, what a
checkpoint holds), this times the chunked scan at several chunk lengths and the token loop
(``form="recurrent"``, forward only: an elementwise loop over the tokens), forward without gradients and forward + backward, float32,
``B = 1``; the best of ``--repeats`` (the cases interleaved, so load hits them alike). The
default chunk is :data:`attnzoo.functional.recurrent.selective_scan.SCAN_CHUNK`.

    python benchmarks/bench_selective_scan.py                          # I = 512, T = 512 and 2048
    python benchmarks/bench_selective_scan.py --inner 1536 --tokens 1024 --threads 1
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from attnzoo import selective_scan


def _inputs(inner: int, tokens: int, state: int, grad: bool, dt_max: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    u, z = (torch.randn(1, inner, tokens, generator=g) for _ in range(2))
    dt = torch.exp(torch.rand(1, inner, tokens, generator=g) * (math.log(dt_max) - math.log(1e-3)) + math.log(1e-3))
    B, C = (torch.randn(1, state, tokens, generator=g) for _ in range(2))
    A = -torch.arange(1, state + 1, dtype=torch.float32).expand(inner, state).contiguous()
    return [t.requires_grad_(grad) for t in (u, dt, A, B, C, z)]


def _run(args: list[torch.Tensor], chunk: int | None, grad: bool) -> float:
    u, dt, A, B, C, z = args
    start = time.perf_counter()
    if chunk is None:  # the token loop (form="recurrent")
        with torch.no_grad():
            selective_scan(u, dt, A, B, C, None, z, form="recurrent")
        return time.perf_counter() - start
    if grad:
        selective_scan(u, dt, A, B, C, None, z, chunk_size=chunk, form="chunked").sum().backward()
    else:
        with torch.no_grad():
            selective_scan(u, dt, A, B, C, None, z, chunk_size=chunk, form="chunked")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inner", type=int, default=512, help="I, the inner channels (default: %(default)s)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="T (default: %(default)s)")
    ap.add_argument("--state", type=int, default=16, help="N (default: %(default)s)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 24, 32, 48, 64])
    ap.add_argument("--dt-max", type=float, default=0.1,
                    help="dt log-uniform in [1e-3, DT_MAX] (default: %(default)s, Mamba's initialisation; trained "
                         "models reach larger steps, hence stronger decays, which the chunked scan's exact plan serves)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"selective scan, I={args.inner}, N={args.state}, dt in [1e-3, {args.dt_max:g}], float32, threads={torch.get_num_threads()}, "
          f"best of {args.repeats}; seconds")
    print(f"{'T':>6} {'mode':>14} " + " ".join(f"{'chunk ' + str(c):>9}" for c in args.chunks) + f" {'loop':>9}")
    for tokens in args.tokens:
        for grad in (False, True):
            inputs = _inputs(args.inner, tokens, args.state, grad, args.dt_max)
            cases: list[int | None] = [*args.chunks, *([] if grad else [None])]
            best = {c: float("inf") for c in cases}
            for _ in range(args.repeats):  # each case in turn, then again
                for c in cases:
                    best[c] = min(best[c], _run(inputs, c, grad))
            cells = " ".join(f"{best[c]:9.3f}" for c in args.chunks) + (f" {best[None]:9.3f}" if not grad else "")
            print(f"{tokens:>6} {'fwd+bwd' if grad else 'fwd (no grad)':>14} {cells}")


if __name__ == "__main__":
    main()
