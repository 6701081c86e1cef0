"""attnzoo inside transformers: a sliding-window Mistral forward, attnzoo vs transformers' sdpa / eager.

A random-initialised Mistral (default: 2 layers, hidden 256, 8 heads, 2 KV heads, sliding window
512, vocab 1024) runs one forward pass over ``--seq`` tokens (batch 1, no cache) with each
``attn_implementation``; the same weights for all. Reported: median wall time of ``--repeats``
runs (taken round-robin so outside load hits every implementation alike), the ratio to attnzoo,
and the maximum relative logit difference to eager.

Usage::

    python benchmarks/bench_hf.py                 # 4096 tokens, median of 3
    python benchmarks/bench_hf.py --seq 1024 --impls attnzoo,attnzoo_tiled,sdpa
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

import attnzoo.hf


def build(args: argparse.Namespace) -> torch.nn.Module:
    cfg = transformers.MistralConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, sliding_window=args.window,
        vocab_size=1024, max_position_embeddings=max(args.seq, 4096))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def time_forward(model: torch.nn.Module, impl: str, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.set_attn_implementation(impl)
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return time.perf_counter() - t0, logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", default="attnzoo,sdpa,eager")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args()
    attnzoo.hf.register()
    impls = args.impls.split(",")
    model = build(args)
    ids = torch.randint(0, 1024, (1, args.seq), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {i: [] for i in impls}
    logits: dict[str, torch.Tensor] = {}
    for impl in impls:  # warm-up (also the logits used for the error column)
        _, logits[impl] = time_forward(model, impl, ids)
    for _ in range(args.repeats):
        for impl in impls:
            times[impl].append(time_forward(model, impl, ids)[0])
    ref = logits.get("eager", logits[impls[-1]])
    base = statistics.median(times[impls[0]])
    rows = []
    for impl in impls:
        med = statistics.median(times[impl])
        err = ((logits[impl] - ref).abs().max() / ref.abs().max()).item()
        rows.append({"impl": impl, "median_s": round(med, 4), f"x_{impls[0]}": round(med / base, 2),
                     "max_rel_err_vs_ref": float(f"{err:.2e}")})
    if args.json:
        print(json.dumps({"settings": vars(args), "threads": torch.get_num_threads(), "rows": rows}, indent=1))
        return
    print(f"Mistral {args.layers}L h{args.hidden} {args.heads}/{args.kv_heads} heads, window {args.window}, "
          f"{args.seq} tokens, torch threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'impl':<20}{'median s':>10}{'ratio':>8}{'max rel err':>13}")
    for r in rows:
        print(f"{r['impl']:<20}{r['median_s']:>10.4f}{r[f'x_{impls[0]}']:>8.2f}{r['max_rel_err_vs_ref']:>13.1e}")


if __name__ == "__main__":
    main()
