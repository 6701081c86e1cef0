"""Seq2seq generation on CPU: a converted encoder-decoder (``from_hf``) against transformers' own.

A random-initialised model of a Hugging Face seq2seq family in a real checkpoint's shape (``--model``:
``t5-small``, ``flan-t5-small``, ``bart-base``, ``opus-mt``, ``whisper-tiny``) generates
``--new`` tokens for a batch of ``--batch`` sources (token lengths drawn from ``[--min-len,
--max-len]`` and right-padded as a tokenizer pads a batch; Whisper: 30 s of random log-mel
features), greedy or with ``--beams``. End tokens are switched off on both sides, so every run
writes exactly ``--new`` tokens. Timed per implementation: transformers with ``attn_implementation``
``eager`` and ``sdpa`` (its ``GenerationMixin.generate`` with a plain generation config: no
processors), and the attnzoo model's ``generate`` (``from_hf``). Reported: the median wall time of
``--repeats`` runs taken round-robin, new tokens/s, the ratio to transformers' ``sdpa``, and whether
the generated tokens equal ``eager``'s.

Usage::

    python benchmarks/bench_seq2seq.py                                # t5-small, batch 8, greedy, 32 tokens
    python benchmarks/bench_seq2seq.py --model opus-mt --beams 4
    python benchmarks/bench_seq2seq.py --model whisper-tiny --batch 1 --new 64 --json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import transformers
from bench_core import (  # the script's folder is on sys.path
    cpu_model,
    parse_run,
    run_arguments,
    timed,
)

from attnzoo.interop import from_hf

T = transformers
#: model name -> (model class, config) of the checkpoint's shape
MODELS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "t5-small": lambda: (T.T5ForConditionalGeneration, T.T5Config(
        vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, feed_forward_proj="relu")),
    "flan-t5-small": lambda: (T.T5ForConditionalGeneration, T.T5Config(
        vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_heads=6,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "bart-base": lambda: (T.BartForConditionalGeneration, T.BartConfig(
        vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)),
    "opus-mt": lambda: (T.MarianMTModel, T.MarianConfig(
        vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="swish",
        scale_embedding=True, pad_token_id=58100, decoder_start_token_id=58100, eos_token_id=0)),
    "whisper-tiny": lambda: (T.WhisperForConditionalGeneration, T.WhisperConfig(
        vocab_size=51865, d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536, num_mel_bins=80)),
}


def build(name: str) -> Any:
    cls, cfg = MODELS[name]()
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation="eager").eval()


def source(hf: Any, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(src, src_mask)``: right-padded token ids of random lengths, or random log-mel features."""
    g = torch.Generator().manual_seed(1)
    cfg = hf.config
    if hf.main_input_name == "input_features":
        return torch.randn(args.batch, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g), None
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g)
    n = int(lengths.max())
    mask = torch.arange(n)[None] < lengths[:, None]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    src = torch.randint(3, min(cfg.vocab_size, 30000), (args.batch, n), generator=g).masked_fill(~mask, pad)
    return src, mask


def runner(name: str, hf: Any, ours: Any, src: torch.Tensor, mask: torch.Tensor | None,
           args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    """A no-argument callable returning the generated tokens ``[B, 1 + new]`` of one implementation."""
    start = getattr(hf.config, "decoder_start_token_id", None)
    start = hf.config.pad_token_id if start is None else start  # T5: the pad id
    if name == "from_hf":
        return lambda: ours.generate(src, args.new, src_mask=mask, bos_token_id=start, num_beams=args.beams)
    for key in ("eos_token_id", "forced_bos_token_id", "forced_eos_token_id"):  # no end, no forced tokens
        setattr(hf.generation_config, key, None)
    gc = T.GenerationConfig(decoder_start_token_id=start, pad_token_id=hf.config.pad_token_id, eos_token_id=None,
                            max_new_tokens=args.new, num_beams=args.beams, do_sample=False)
    inputs = {hf.main_input_name: src}
    if mask is not None:
        inputs["attention_mask"] = mask.long()

    def run() -> torch.Tensor:
        hf.set_attn_implementation(name)
        # GenerationMixin's generate (Whisper's override adds its task logic): the same plain search
        return T.GenerationMixin.generate(hf, **inputs, generation_config=gc)
    return run


def generation_arguments(p: argparse.ArgumentParser, batch: int) -> None:
    """The arguments the generation benchmarks share (this one and ``bench_generate.py``)."""
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--new", type=int, default=32, help="tokens generated per row")
    p.add_argument("--beams", type=int, default=1)
    run_arguments(p, repeats=3)
    p.add_argument("--impls", default="eager,sdpa,from_hf")


def report(outs: dict[str, torch.Tensor], times: dict[str, float], tokens: int, info: dict[str, Any],
           header: str, as_json: bool) -> None:
    """Print each implementation's median time, tokens/s (``tokens`` generated per run), ratio to
    transformers' ``sdpa`` and whether its tokens equal ``eager``'s: a table under ``header``, or JSON."""
    ref = outs.get("eager", next(iter(outs.values())))
    base = times.get("sdpa")
    rows = []
    for name, t in times.items():
        same = outs[name].shape == ref.shape and bool(torch.equal(outs[name], ref))
        rows.append({"impl": name, "seconds": t, "tokens_per_s": tokens / t,
                     "vs_sdpa": None if base is None else base / t, "same_tokens_as_eager": same})
    if as_json:
        print(json.dumps({**info, "rows": rows}, indent=1))
        return
    print(header)
    print(f"{'impl':8s} {'median s':>9s} {'tok/s':>8s} {'x sdpa':>7s} {'same tokens':>12s}")
    for r in rows:
        ratio = "" if r["vs_sdpa"] is None else f"{r['vs_sdpa']:.2f}"
        print(f"{r['impl']:8s} {r['seconds']:9.3f} {r['tokens_per_s']:8.1f} {ratio:>7s} "
              f"{r['same_tokens_as_eager']!s:>12s}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="t5-small", choices=sorted(MODELS))
    generation_arguments(p, batch=8)
    args = parse_run(p)
    hf = build(args.model)
    ours = from_hf(hf).eval()
    ours.eos_token_id = None  # every run writes exactly --new tokens (transformers: eos_token_id=None)
    src, mask = source(hf, args)
    impls = args.impls.split(",")
    runs = {name: runner(name, hf, ours, src, mask, args) for name in impls}
    with torch.inference_mode():
        outs = {name: run() for name, run in runs.items()}  # the outputs compared
        times = timed(runs, args.repeats)  # medians of interleaved repeats
    info = {"model": args.model, "batch": args.batch, "new": args.new, "beams": args.beams,
            "source_shape": list(src.shape), "cpu": cpu_model(),
            "threads": torch.get_num_threads()}
    report(outs, times, args.batch * args.new, info, f"{args.model}: batch {args.batch}, source {list(src.shape)}, "
           f"{args.new} new tokens, {args.beams} beam(s), {info['threads']} threads", args.json)


if __name__ == "__main__":
    main()
