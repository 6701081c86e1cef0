"""Seq2seq training steps on CPU: packed pairs (``cu_seqlens``) against the padded batch, and
transformers' padded step as the peer.

A random-initialised encoder-decoder in a real checkpoint's shape (``--model``: ``t5-small``,
``bart-base``, ``opus-mt``; converted with ``from_hf``) takes one training step (loss, backward) on
``--pairs`` (source, target) pairs whose lengths are drawn from ``[--min-len, --max-len]`` (targets
half as long), three ways: transformers' model on the right-padded batch (``sdpa``), attnzoo's on
the same padded batch (``loss(src, labels, src_mask=...)``), and attnzoo's on the pairs packed end
to end (``loss(src, labels, src_cu_seqlens=..., labels_cu_seqlens=...)``: no work on padding).
Dropout off, so the three losses are equal (printed). Reported: the median wall time of
``--repeats`` steps taken round-robin and the ratio to transformers'.

Usage::

    python benchmarks/bench_seq2seq_train.py                         # t5-small, 16 pairs of 16..128 tokens
    python benchmarks/bench_seq2seq_train.py --model bart-base --json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import transformers
from bench_core import (  # the script's folder is on sys.path
    cpu_model,
    parse_run,
    print_rows,
    run_arguments,
    timed,
)
from bench_seq2seq import MODELS

from attnzoo.interop import from_hf


def pairs(vocab: int, pad: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The padded batch (``src``, ``src_mask``, ``labels`` with -100 on padding) and the same pairs
    packed (``packed_src``, ``packed_labels``, ``src_cu``, ``labels_cu``)."""
    g = torch.Generator().manual_seed(1)
    src_len = torch.randint(args.min_len, args.max_len + 1, (args.pairs,), generator=g)
    tgt_len = (src_len // 2).clamp_min(1)
    srcs = [torch.randint(3, min(vocab, 30000), (int(n),), generator=g) for n in src_len]
    tgts = [torch.randint(3, min(vocab, 30000), (int(n),), generator=g) for n in tgt_len]
    src = torch.nn.utils.rnn.pad_sequence(srcs, batch_first=True, padding_value=pad)
    labels = torch.nn.utils.rnn.pad_sequence(tgts, batch_first=True, padding_value=-100)
    cu = [torch.tensor([0, *torch.cumsum(n, 0).tolist()], dtype=torch.int32) for n in (src_len, tgt_len)]
    return {"src": src, "src_mask": torch.arange(src.shape[1])[None] < src_len[:, None], "labels": labels, "packed_src": torch.cat(srcs)[None],
            "packed_labels": torch.cat(tgts)[None], "src_cu": cu[0], "labels_cu": cu[1]}


def steps(hf: Any, ours: Any, data: dict[str, torch.Tensor]) -> dict[str, Callable[[], float]]:
    """One training step (forward, loss, backward) per implementation, returning the loss."""
    def step(loss_fn: Callable[[], torch.Tensor], model: torch.nn.Module) -> Callable[[], float]:
        def run() -> float:
            model.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            return float(loss)
        return run

    mask = data["src_mask"]
    return {
        "transformers": step(lambda: hf(input_ids=data["src"], attention_mask=mask.long(),
                                        labels=data["labels"]).loss, hf),
        "padded": step(lambda: ours.loss(data["src"], data["labels"], src_mask=mask), ours),
        "packed": step(lambda: ours.loss(data["packed_src"], data["packed_labels"], src_cu_seqlens=data["src_cu"],
                                         labels_cu_seqlens=data["labels_cu"]), ours),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="t5-small", choices=("t5-small", "bart-base", "opus-mt"))
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    run_arguments(p, repeats=3)
    args = parse_run(p)
    cls, cfg = MODELS[args.model]()
    cfg.dropout = 0.0
    for key in ("dropout_rate", "attention_dropout", "activation_dropout"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    if getattr(cfg, "decoder_start_token_id", None) is None:  # T5 starts from the pad id
        cfg.decoder_start_token_id = cfg.pad_token_id
    torch.manual_seed(0)
    hf = cls._from_config(cfg, attn_implementation="sdpa").train()
    ours = from_hf(hf).train()
    data = pairs(cfg.vocab_size, cfg.pad_token_id if cfg.pad_token_id is not None else 0, args)
    runs = steps(hf, ours, data)
    losses = {name: run() for name, run in runs.items()}
    times = timed(runs, args.repeats)
    base = times["transformers"]
    real = int(data["src_cu"][-1] + data["labels_cu"][-1])
    rows = [{"impl": name, "seconds": times[name], "vs_transformers": base / times[name], "loss": losses[name]}
            for name in runs]
    info = {"model": args.model, "pairs": args.pairs, "padded_tokens": int(data["src"].numel() + data["labels"].numel()),
            "real_tokens": real, "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "transformers": transformers.__version__}
    print_rows(rows, info, f"{args.model}: {args.pairs} pairs, {real} real of {info['padded_tokens']} padded tokens, "
               f"{info['threads']} threads, {info['cpu']}",
               [("seconds", "median s", ".3f"), ("vs_transformers", "x transformers", ".2f"), ("loss", "loss", ".4f")],
               args.json)


if __name__ == "__main__":
    main()
