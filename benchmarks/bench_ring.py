"""Per-rank peak memory and time of ring vs Ulysses attention vs one process, by N and ranks P.

Spawns P gloo ranks on this machine (CPU) for each P, shards a sequence of N tokens with the
zigzag layout and runs causal GQA ring attention and Ulysses attention (all-to-all to head
shards), forward + backward; P = 1 is one process calling ``az.attention`` on the whole
sequence. Every (N, P, method) gets one unmeasured forward + backward call first (one-time costs
such as the ``auto`` backend's calibration stay out of the numbers). On every rank it records
the peak of *live tensor bytes allocated by the call* (inputs excluded), tracked with a
``TorchDispatchMode`` that follows every tensor an op creates until it is freed: a deterministic
count of what the attention itself needs, independent of the allocator and of noisy RSS.

The claim checked: per-rank peak memory for attention grows as N / P. So the table shows, per
(N, P), the largest peak over ranks, bytes per local token (peak / (N/P)), and the ratio to the
single-process peak at the same N (ideal: ~1/P). Times: forward + backward wall time of one
call (median of ``--repeats``, the slowest rank), measured outside the memory tracker. All ranks
share this machine's cores, so on a small CPU the times show the overhead of each method, not a
speed-up; treat them as indicative.

    python benchmarks/bench_ring.py                      # N = 1024, 2048, 4096; P = 1, 2, 4
    python benchmarks/bench_ring.py --seq-lens 2048 8192 --ranks 1 2 4 8 --methods ring
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from attnzoo import attention
from attnzoo.distributed import ring_attention, shard_sequence, ulysses_attention, work_per_rank


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by ops under this mode (views and in-place ops add nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage data_ptr -> live tensors created here that use it
        self._size: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live -= self._size.pop(key)
            del self._refs[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in self._refs:
                self._refs[key] += 1
            elif key in inputs or st.nbytes() == 0:
                continue  # a view or an in-place result of something allocated before
            else:
                self._refs[key] = 1
                self._size[key] = st.nbytes()
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    if method == "one process":
        out = attention(q, k, v, causal=True, window=args.window, backend=args.backend)
    elif method == "ring":
        out = ring_attention(q, k, v, causal=True, window=args.window, layout=args.layout, backend=args.backend)
    else:
        out = ulysses_attention(q, k, v, causal=True, window=args.window, layout=args.layout, backend=args.backend)
    assert isinstance(out, torch.Tensor)
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, outdir: str) -> None:
    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    rows = []
    methods = ["one process"] if world == 1 else args.methods
    for n in args.seq_lens:
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, h, n, args.head_dim, generator=g) for h in (args.heads, args.kv_heads, args.kv_heads)]
        q, k, v = (shard_sequence(t, 2, layout=args.layout).requires_grad_() for t in full)
        d_out = torch.randn_like(q)
        del full
        for method in methods:
            peaks, fwd_peaks, times = [], [], []
            # One unmeasured forward + backward first: one-time costs (the ``auto`` backend's calibration
            # against SDPA, once a process) stay out of the peaks and the times.
            dist.barrier()
            _call(method, q, k, v, args).backward(d_out)
            q.grad = k.grad = v.grad = None
            for _ in range(args.repeats):
                dist.barrier()
                with LiveBytes() as fwd_mode:
                    out = _call(method, q, k, v, args)
                with LiveBytes() as mode:
                    out = _call(method, q, k, v, args)
                    out.backward(d_out)
                    del out
                peaks.append(mode.peak)
                fwd_peaks.append(fwd_mode.peak)
                q.grad = k.grad = v.grad = None
                dist.barrier()
                t0 = time.perf_counter()
                _call(method, q, k, v, args).backward(d_out)
                times.append(time.perf_counter() - t0)
                q.grad = k.grad = v.grad = None
            rows.append({"n": n, "rank": rank, "method": method, "peak": max(peaks), "fwd_peak": max(fwd_peaks),
                         "time": statistics.median(times)})
    torch.save(rows, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    ap.add_argument("--window", type=int, default=None, help="causal sliding window (keys before the query)")
    ap.add_argument("--backend", default="auto", help="az.attention backend per shard pair (auto = tiled)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size (the peak is deterministic; times: median)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads shared by the ranks")
    ap.add_argument("--methods", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"])
    args = ap.parse_args(argv)

    results: dict[tuple[int, int, str], dict[str, float]] = {}
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(world, _free_port(), args, d), nprocs=world)
            rows = [r for rank in range(world) for r in torch.load(os.path.join(d, f"rank{rank}.pt"))]
        for r in rows:
            key = (r["n"], world, r["method"])
            cur = results.setdefault(key, {"peak": 0.0, "fwd_peak": 0.0, "time": 0.0})
            for f in cur:  # the worst rank
                cur[f] = max(cur[f], float(r[f]))
    print(f"causal attention, window={args.window}, layout={args.layout}, backend={args.backend}, B=1, Hq={args.heads}, "
          f"Hkv={args.kv_heads}, D={args.head_dim}, float32, forward + backward; peak = max over ranks of live tensor "
          f"bytes allocated by the call (inputs excluded); time = slowest rank, median of {args.repeats}")
    print(f"{'N':>6} {'P':>3} {'method':>11} {'N/P':>6} {'fwd peak MiB':>13} {'fwd+bwd peak MiB':>17} "
          f"{'KiB / local token':>18} {'vs P=1':>7} {'time ms':>9} {'time vs P=1':>12}")
    for n in args.seq_lens:
        base = results.get((n, 1, "one process"))
        for (nn, world, method), r in results.items():
            if nn != n:
                continue
            mem = f"{r['peak'] / base['peak']:>7.3f}" if base else f"{'-':>7}"
            tim = f"{r['time'] / base['time']:>12.2f}" if base else f"{'-':>12}"
            print(f"{n:>6} {world:>3} {method:>11} {n // world:>6} {r['fwd_peak'] / 2**20:>13.2f} "
                  f"{r['peak'] / 2**20:>17.2f} {r['peak'] / 1024 / (n // world):>18.2f} {mem} "
                  f"{r['time'] * 1e3:>9.1f} {tim}")
    n, world = args.seq_lens[-1], max(args.ranks)
    print(f"\ncausal scores computed per rank (N={n}, P={world}, from the ring schedule), as a fraction of the max:")
    for layout in ("contiguous", "zigzag"):
        work = work_per_rank(n, world, layout=layout, causal=True, window=args.window)
        print(f"  {layout:>10}: " + " ".join(f"{w / max(work):.2f}" for w in work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
