"""MLA decoding: absorbed vs materialised form, against MHA / GQA caches, at long cache lengths.

One :class:`attnzoo.MultiHeadLatentAttention` layer with DeepSeek-V3's head sizes but few heads and a
small width so it fits a CPU (``dim 1024, 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64,
v 128``, no query bottleneck, B = 1). For each cache length ``N`` the cache is filled with random
latents (a prefill of 32k tokens through the materialised form would need the full score matrix),
then the next token is decoded:

* ``absorbed``: ``W_UK`` folded into the query, attention over the latent cache as one shared
  head, ``W_UV`` applied afterwards;
* ``materialised``: every cached latent expanded into per-head keys and values, then attention.

Both must give the same output (the max difference is printed). For scale, an MHA layer
(16 KV heads of 128) and a GQA layer (4 KV heads of 128) with the same query heads decode one
token over caches of the same length. Reported: median ms per token, and cache bytes per token.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_mla.py                 # N = 4096 and 32768
    OMP_NUM_THREADS=1 python benchmarks/bench_mla.py --lens 1024 --repeats 2   # quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import attnzoo as az


def _time(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), out


def _step(mod: nn.Module, cache: object, n: int, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Decode ``x [B, 1, C]`` at position ``n`` (the cache is rewound to ``n`` tokens each time)."""
    def run() -> torch.Tensor:
        cache.length = n  # type: ignore[attr-defined]
        return mod(x, cache=cache)
    return run


def bench_mla(n: int, args: argparse.Namespace) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    mla = az.MultiHeadLatentAttention(args.dim, args.heads, kv_lora_rank=512, qk_nope_head_dim=128,
                                      qk_rope_head_dim=64, v_head_dim=128).eval()
    cache = mla.init_cache(1, n + 1)
    cache.latent.normal_(generator=g)
    x = torch.randn(1, 1, args.dim, generator=g)
    row: dict[str, object] = {"N": n, "mla_bytes_per_token": int(cache.bytes_per_token())}
    outs = {}
    for form in ("absorbed", "materialised"):
        mla.form = form
        reps = args.repeats if form == "absorbed" or n <= 8192 else max(1, args.repeats // 2)
        row[f"mla_{form}_ms"], outs[form] = _time(_step(mla, cache, n, x), reps)
    row["max_abs_diff"] = float((outs["absorbed"] - outs["materialised"]).abs().max())
    for name, kv in (("mha", args.heads), ("gqa", args.heads // 4)):
        mod = az.MultiHeadAttention(args.dim, args.heads, num_kv_heads=kv, head_dim=128, causal=True).eval()
        kv_cache = mod.init_cache(1, n + 1)
        kv_cache.k.normal_(generator=g)
        kv_cache.v.normal_(generator=g)
        row[f"{name}_ms"], _ = _time(_step(mod, kv_cache, n, x), args.repeats)
        row[f"{name}_bytes_per_token"] = int(kv_cache.bytes_per_token())
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lens", default="4096,32768", help="cache lengths N (comma-separated)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args()
    rows = []
    print(f"MLA decode, one layer: dim={args.dim} H={args.heads} r=512 dn=128 dr=64 dv=128, B=1, float32, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'N':>6} {'absorbed ms':>12} {'materialised ms':>16} {'speed-up':>9} {'MHA ms':>8} {'GQA ms':>8} "
          f"{'MLA B/tok':>10} {'MHA B/tok':>10} {'GQA B/tok':>10} {'|diff|':>9}")
    with torch.inference_mode():
        for n in (int(s) for s in args.lens.split(",")):
            r = bench_mla(n, args)
            rows.append(r)
            print(f"{n:>6} {r['mla_absorbed_ms']:>12.2f} {r['mla_materialised_ms']:>16.2f} "
                  f"{r['mla_materialised_ms'] / r['mla_absorbed_ms']:>8.1f}x {r['mha_ms']:>8.2f} {r['gqa_ms']:>8.2f} "
                  f"{r['mla_bytes_per_token']:>10} {r['mha_bytes_per_token']:>10} {r['gqa_bytes_per_token']:>10} "
                  f"{r['max_abs_diff']:>9.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
