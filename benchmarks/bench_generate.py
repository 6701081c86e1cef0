"""Decoder-only generation on CPU: a converted model (``from_hf``) against transformers' own ``generate``.

A random-initialised model in a real checkpoint's shape (``--model``: ``smollm2-135m``, a Llama;
``qwen2.5-0.5b``) generates ``--new`` tokens for a left-padded batch of ``--batch`` prompts (lengths
drawn from ``[--min-len, --max-len]``), greedy or with ``--beams`` (and ``--returns`` hypotheses per
prompt), with a chat model's settings: two end tokens that the random model never writes (so every
run writes exactly ``--new`` tokens), a pad, and ``--repetition-penalty``. Timed per
implementation: transformers with ``attn_implementation`` ``sdpa`` and ``eager`` and attnzoo's
``generate``. Reported: the median wall time of ``--repeats`` runs taken round-robin, new tokens/s,
the ratio to transformers' ``sdpa``, and whether the tokens equal ``eager``'s.

Usage::

    python benchmarks/bench_generate.py                        # smollm2-135m, batch 4, greedy, 32 tokens
    python benchmarks/bench_generate.py --beams 4 --returns 2
    python benchmarks/bench_generate.py --model qwen2.5-0.5b --batch 1 --json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import transformers
from bench_core import cpu_model, parse_run, timed  # the script's folder is on sys.path
from bench_seq2seq import generation_arguments, report

from attnzoo.interop import from_hf

T = transformers
#: model name -> config of the checkpoint's shape
MODELS: dict[str, Callable[[], Any]] = {
    "smollm2-135m": lambda: T.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2.5-0.5b": lambda: T.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
}


def prompts(vocab: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, mask)``: left-padded prompts of random lengths (pad id 0)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g)
    n = int(lengths.max())
    mask = torch.arange(n)[None] >= (n - lengths)[:, None]
    return torch.randint(3, vocab - 2, (args.batch, n), generator=g).masked_fill(~mask, 0), mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    generation_arguments(p, batch=4)
    p.add_argument("--returns", type=int, default=1, help="num_return_sequences (<= --beams)")
    p.add_argument("--repetition-penalty", type=float, default=1.1)
    args = parse_run(p)
    cfg = MODELS[args.model]()
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ours = from_hf(hf).eval()
    x, mask = prompts(cfg.vocab_size, args)
    ends = [cfg.vocab_size - 1, cfg.vocab_size - 2]  # never in a prompt; the random model does not write them
    settings = {"eos_token_id": ends, "pad_token_id": 0, "repetition_penalty": args.repetition_penalty,
                "num_beams": args.beams, "num_return_sequences": args.returns}
    gc = T.GenerationConfig(max_new_tokens=args.new, do_sample=False, **settings)

    def transformers_run(impl: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            hf.set_attn_implementation(impl)
            return hf.generate(input_ids=x, attention_mask=mask.long(), generation_config=gc)
        return run

    runs: dict[str, Callable[[], torch.Tensor]] = {}
    for name in args.impls.split(","):
        runs[name] = (transformers_run(name) if name != "from_hf"
                      else lambda: ours.generate(x, args.new, attention_mask=mask, **settings))
    with torch.inference_mode():
        outs = {name: run() for name, run in runs.items()}  # the outputs compared
        times = timed(runs, args.repeats)  # medians of interleaved repeats
    info = {"model": args.model, "batch": args.batch, "new": args.new, "beams": args.beams, "returns": args.returns,
            "prompt_shape": list(x.shape), "cpu": cpu_model(), "threads": torch.get_num_threads()}
    report(outs, times, args.batch * args.returns * args.new, info,
           f"{args.model}: batch {args.batch}, prompts {list(x.shape)} left-padded, {args.new} new tokens, "
           f"{args.beams} beam(s), {args.returns} return(s), {info['threads']} threads, {info['cpu']}", args.json)


if __name__ == "__main__":
    main()
