"""Sentence embeddings on CPU: a converted encoder (``from_hf``) against transformers' own.

A random-initialised encoder of a Hugging Face family (default ``bert`` in the all-MiniLM-L6-v2
shape: hidden 384, 6 layers, 12 heads, FFN 1536) embeds a batch of ``--batch`` sentences whose
lengths are drawn uniformly from ``[--min-len, --max-len]`` (padded to the longest, as a tokenizer
pads a batch). Timed per implementation: transformers with ``attn_implementation`` ``eager`` and
``sdpa``, transformers with attnzoo's kernels (``attnzoo``, :func:`attnzoo.hf.register`), and the
attnzoo model from :func:`attnzoo.interop.from_hf` (``from_hf``; ``from_hf_packed``: only the real
tokens, ``encode(packed=True)``, for a family whose encoder is packable). Reported: the median wall time of
``--repeats`` runs taken round-robin (outside load hits every implementation alike), sentences/s,
the ratio to transformers' ``sdpa``, and the max relative error of the mean-pooled embeddings
against ``eager``.

Usage::

    python benchmarks/bench_encoders.py                       # bert, batch 32, lengths 8..128
    python benchmarks/bench_encoders.py --family roberta --hidden 768 --layers 12 --heads 12
    python benchmarks/bench_encoders.py --family modernbert --json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch
import transformers
from bench_core import parse_run, print_rows, run_arguments  # the script's folder is on sys.path

import attnzoo.hf
from attnzoo.interop import from_hf


def build(args: argparse.Namespace) -> Any:
    """A random ``AutoModel`` of ``--family`` with the BERT-style size keys most encoders share."""
    cfg = transformers.AutoConfig.for_model(
        args.family, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=args.ffn, vocab_size=args.vocab, max_position_embeddings=max(512, args.max_len + 2),
        pad_token_id=1)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(cfg, attn_implementation="eager").eval()


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, N], mask [B, N])``: right-padded sentences of random lengths."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g)
    n = int(lengths.max())
    mask = (torch.arange(n)[None] < lengths[:, None]).long()
    tokens = torch.randint(3, args.vocab, (args.batch, n), generator=g).masked_fill(mask == 0, 1)
    return tokens, mask


def pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)


def runner(name: str, hf: Any, ours: Any, tokens: torch.Tensor, mask: torch.Tensor) -> Any:
    """A no-argument callable returning the mean-pooled embeddings ``[B, C]`` of one implementation."""
    if name == "from_hf":
        return lambda: ours.encode(tokens, mask)
    if name == "from_hf_packed":
        return lambda: ours.encode(tokens, mask, packed=True)

    def run() -> torch.Tensor:
        hf.set_attn_implementation(name)
        return pooled(hf(input_ids=tokens, attention_mask=mask).last_hidden_state, mask)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="bert", help="a transformers model_type attnzoo converts (default: bert)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    run_arguments(p, repeats=5)
    p.add_argument("--impls", default="eager,sdpa,attnzoo,from_hf,from_hf_packed")
    args = parse_run(p)
    attnzoo.hf.register()
    hf = build(args)
    ours = from_hf(hf).eval()
    tokens, mask = batch(args)
    impls = [i for i in args.impls.split(",") if i != "from_hf_packed" or ours.packable]
    runs = {name: runner(name, hf, ours, tokens, mask) for name in impls}
    times: dict[str, list[float]] = {name: [] for name in impls}
    outs: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for name in impls:  # warm-up, and the outputs compared
            outs[name] = runs[name]()
        for _ in range(args.repeats):
            for name in impls:
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
    ref = outs.get("eager", next(iter(outs.values())))
    base = statistics.median(times["sdpa"]) if "sdpa" in times else None
    rows = []
    for name in impls:
        t = statistics.median(times[name])
        err = float((outs[name] - ref).abs().max() / ref.abs().max())
        rows.append({"impl": name, "seconds": t, "sentences_per_s": args.batch / t,
                     "vs_sdpa": None if base is None else base / t, "max_rel_err": err})
    info = {"family": args.family, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "tokens": int(mask.sum()), "padded_tokens": int(mask.numel())}
    print_rows(rows, info, f"{args.family}: batch {args.batch}, {info['tokens']} real of {info['padded_tokens']} "
               f"tokens, {info['threads']} threads",
               [("seconds", "median s", ".4f"), ("sentences_per_s", "sent/s", ".1f"), ("vs_sdpa", "x sdpa", ".2f"),
                ("max_rel_err", "max rel err", ".2e")], args.json)


if __name__ == "__main__":
    main()
