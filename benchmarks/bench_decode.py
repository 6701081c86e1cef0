"""Decoding with a KV cache vs recomputing the sequence, for MHA / GQA / MQA / sliding window.

A 4-layer, width-512, 8-head pre-norm decoder stack (built inline: embedding, attention + GELU
MLP blocks, LM head; random weights) generates ``--new`` tokens greedily after a ``--prompt``-token
prompt, twice:

* cached: one prefill pass through ``module.init_cache`` caches, then one token per step;
* recompute: every step runs the whole sequence so far through the stack (no cache).

Reported per variant: wall time of prompt + generation (median of ``--repeats`` cached runs, taken
round-robin over the variants so that outside load hits them alike), decode tokens/s (generation
steps only), the speed-up of the cache (recompute time / cached time in the same run), whether both produce the same tokens, and
the KV-cache bytes measured from the cache tensors (per token slot, and in total at the final
length; the sliding cache holds ``window + 1`` slots whatever the length).

Usage::

    python benchmarks/bench_decode.py                       # the issue's setting (slow: recompute)
    python benchmarks/bench_decode.py --prompt 128 --new 32 --repeats 1   # quick look
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


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = attn
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, cache: object | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, make_attn: Callable[[], nn.Module], vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(make_attn(), dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, caches: list | None = None) -> torch.Tensor:
        x = self.embed(ids)  # [B, N, C]
        for i, blk in enumerate(self.blocks):
            x = blk(x, None if caches is None else caches[i])
        return self.head(self.norm(x[:, -1]))  # logits of the last position [B, V]

    def init_caches(self, batch: int, max_len: int) -> list:
        return [blk.attn.init_cache(batch, max_len) for blk in self.blocks]


@torch.no_grad()
def generate_cached(model: TinyDecoder, prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, list, float]:
    """Greedy tokens ``[B, new]``, the caches, and the time spent after the prefill (decode only)."""
    caches = model.init_caches(prompt.shape[0], prompt.shape[1] + new)
    logits = model(prompt, caches)
    t0 = time.perf_counter()
    out = []
    for _ in range(new):
        nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
        out.append(nxt)
        logits = model(nxt, caches)
    return torch.cat(out, 1), caches, time.perf_counter() - t0


@torch.no_grad()
def generate_recompute(model: TinyDecoder, prompt: torch.Tensor, new: int) -> torch.Tensor:
    seq = prompt
    for _ in range(new):
        nxt = model(seq).argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    return seq[:, prompt.shape[1]:]


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, list]:
    """Median wall time of ``repeats`` calls, and every call's result."""
    times, res = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res.append(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the cached run (median)")
    ap.add_argument("--recompute-repeats", type=int, default=1, help="repeats of the recompute run (median)")
    ap.add_argument("--variants", default="mha,gqa2,mqa,sliding")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    ap.add_argument("--json", default="", help="also write the results to this JSON file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    C, H = args.dim, args.heads
    makers: dict[str, Callable[[], nn.Module]] = {
        "mha": lambda: az.MultiHeadAttention(C, H, causal=True, rope=True),
        "gqa2": lambda: az.GroupedQueryAttention(C, H, num_kv_heads=2, causal=True, rope=True),
        "mqa": lambda: az.MultiQueryAttention(C, H, causal=True, rope=True),
        "sliding": lambda: az.SlidingWindowAttention(C, H, window=args.window, rope=True),
    }
    total = args.prompt + args.new
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} layers, width {C}, "
          f"{H} heads; prompt {args.prompt}, {args.new} new tokens, batch 1, float32")
    hdr = (f"{'variant':<8} {'cached s':>9} {'decode tok/s':>12} {'recompute s':>12} {'speed-up':>9} "
           f"{'same tokens':>11} {'KV B/token':>11} {'KV bytes total':>15}")
    print(hdr)
    names = args.variants.split(",")
    models, prompts = {}, {}
    for name in names:
        torch.manual_seed(0)
        models[name] = TinyDecoder(makers[name], args.vocab, C, args.layers).eval()
        prompts[name] = torch.randint(0, args.vocab, (1, args.prompt))
        generate_cached(models[name], prompts[name][:, :16], 4)  # warm-up
    # Cached runs round-robin over the variants, so that load from other processes hits them alike.
    cached: dict[str, list] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            t0 = time.perf_counter()
            res = generate_cached(models[name], prompts[name], args.new)
            cached[name].append((time.perf_counter() - t0, *res))
    rows = []
    for name in names:
        runs = cached[name]
        t_cached = statistics.median(r[0] for r in runs)
        t_decode = statistics.median(r[3] for r in runs)
        tok_c, caches = runs[-1][1], runs[-1][2]
        t_re, re_runs = timed(lambda m=models[name], p=prompts[name]: generate_recompute(m, p, args.new),
                              args.recompute_repeats)
        tok_r = re_runs[-1]
        kv_total = sum(c.nbytes for c in caches)
        slots = caches[0].capacity if isinstance(caches[0], az.SlidingWindowKVCache) else caches[0].max_len
        per_token = kv_total / slots
        decode_tps = args.new / t_decode
        same = float((tok_c == tok_r).float().mean())
        row = dict(variant=name, cached_s=t_cached, decode_s=t_decode, decode_tokens_per_s=decode_tps,
                   cached_runs_s=[r[0] for r in runs], recompute_s=t_re, speedup=t_re / t_cached,
                   same_tokens=same, kv_bytes_per_token=per_token, kv_bytes_total=kv_total, kv_slots=slots)
        rows.append(row)
        print(f"{name:<8} {t_cached:9.2f} {decode_tps:12.1f} {t_re:12.2f} {t_re / t_cached:8.1f}x "
              f"{same:11.0%} {per_token:11.0f} {kv_total:15,d}", flush=True)
    base = next((r for r in rows if r["variant"] == "mha"), None)
    if base is not None:
        for r in rows:
            print(f"KV bytes total at {total} tokens, {r['variant']}/mha = {r['kv_bytes_total'] / base['kv_bytes_total']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
