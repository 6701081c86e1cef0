"""Per-rank peak memory of ring attention vs sequence length N and number of ranks P.

Spawns P gloo ranks on this machine (CPU) for each P, shards a sequence of N tokens with the
zigzag layout and runs causal GQA ring attention forward + backward. On every rank it records
the peak of *live tensor bytes allocated by the call* (inputs excluded), tracked with a
``TorchDispatchMode`` that follows every tensor an op creates until it is freed: a deterministic
count of what the attention itself needs, independent of the allocator and of noisy RSS.

The claim checked: per-rank peak memory for attention grows as N / P. So the table shows, per
(N, P), the largest peak over ranks, bytes per local token (peak / (N/P)), and the ratio to the
single-process peak at the same N (ideal: ~1/P).

    python benchmarks/bench_ring.py                      # N = 1024, 2048, 4096; P = 1, 2, 4
    python benchmarks/bench_ring.py --seq-lens 2048 8192 --ranks 1 2 4 8 --backend tiled
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from attnzoo.distributed import ring_attention, shard_sequence, work_per_rank


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


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, outdir: str) -> None:
    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    rows = []
    for n in args.seq_lens:
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, h, n, args.head_dim, generator=g) for h in (args.heads, args.kv_heads, args.kv_heads)]
        q, k, v = (shard_sequence(t, 2, layout=args.layout).requires_grad_() for t in full)
        d_out = torch.randn_like(q)
        del full
        peaks, fwd_peaks = [], []
        for _ in range(args.repeats):
            dist.barrier()
            with LiveBytes() as fwd_mode:
                out = ring_attention(q, k, v, causal=True, window=args.window, layout=args.layout,
                                     backend=args.backend)
            with LiveBytes() as mode:
                out = ring_attention(q, k, v, causal=True, window=args.window, layout=args.layout,
                                     backend=args.backend)
                out.backward(d_out)
                del out
            peaks.append(mode.peak)
            fwd_peaks.append(fwd_mode.peak)
            q.grad = k.grad = v.grad = None
        rows.append({"n": n, "rank": rank, "peak": max(peaks), "fwd_peak": max(fwd_peaks)})
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
    ap.add_argument("--repeats", type=int, default=1, help="runs per size (the peak is deterministic)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads shared by the ranks")
    args = ap.parse_args(argv)

    results: dict[tuple[int, int], dict[str, float]] = {}
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(world, _free_port(), args, d), nprocs=world)
            rows = [r for rank in range(world) for r in torch.load(os.path.join(d, f"rank{rank}.pt"))]
        for n in args.seq_lens:
            mine = [r for r in rows if r["n"] == n]
            results[(n, world)] = {"peak": max(r["peak"] for r in mine),
                                   "fwd_peak": max(r["fwd_peak"] for r in mine)}
    print(f"ring attention, causal, window={args.window}, layout={args.layout}, backend={args.backend}, B=1, Hq={args.heads}, "
          f"Hkv={args.kv_heads}, D={args.head_dim}, float32; peak = max over ranks of live tensor bytes "
          f"allocated by the call (inputs excluded)")
    print(f"{'N':>6} {'P':>3} {'N/P':>6} {'fwd peak MiB':>13} {'fwd+bwd peak MiB':>17} {'KiB / local token':>18} "
          f"{'vs P=1':>7}")
    for n in args.seq_lens:
        base = results.get((n, 1), results[(n, args.ranks[0])])["peak"]
        for world in args.ranks:
            r = results[(n, world)]
            print(f"{n:>6} {world:>3} {n // world:>6} {r['fwd_peak'] / 2**20:>13.2f} {r['peak'] / 2**20:>17.2f} "
                  f"{r['peak'] / 1024 / (n // world):>18.2f} {r['peak'] / base:>7.3f}")
    n, world = args.seq_lens[-1], max(args.ranks)
    print(f"\ncausal scores computed per rank (N={n}, P={world}, from the ring schedule), as a fraction of the max:")
    for layout in ("contiguous", "zigzag"):
        work = work_per_rank(n, world, layout=layout, causal=True, window=args.window)
        print(f"  {layout:>10}: " + " ".join(f"{w / max(work):.2f}" for w in work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
