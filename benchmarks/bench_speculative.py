"""Speculative decoding on CPU: attnzoo's ``generate`` with prompt lookup or an assistant model,
against its own greedy decoding and against transformers' assisted generation with the same weights.

A random-initialised model in a real checkpoint's shape (``--model``: ``smollm2-135m``, a Llama;
``qwen2.5-0.5b``; ``qwen3-next-shape``, a small hybrid whose gated-DeltaNet states are rolled back
after a rejected draft, where keys are truncated) generates ``--new`` greedy tokens for ``--batch`` prompts of ``--len`` tokens that
repeat a short random phrase (text that quotes itself: what prompt lookup is for). Drafters:

* ``lookup``: ``prompt_lookup_num_tokens=--lookup`` (``max_matching_ngram_size`` 2);
* ``assistant``: the target's own first ``--draft-layers`` layers with its final norm and head (an
  early-exit draft, LayerSkip-style; on random weights the deep layers change the next token little,
  so it agrees often), ``num_assistant_tokens=--draft-tokens``, confidence threshold 0 for both
  libraries (transformers adjusts its threshold as it goes; fixed here, so both draft alike).

Timed, round-robin (``--repeats``, medians): attnzoo greedy, attnzoo with each drafter and, at batch 1
(transformers' assisted generation takes one row), transformers greedy (``sdpa``) and transformers
with each drafter. Reported: median seconds, new tokens/s, the ratio to transformers' greedy (to
attnzoo's greedy at batch > 1), whether the tokens equal greedy decoding's, and the forwards of the
target and of the assistant in one run (counted at their LM heads).

Usage::

    python benchmarks/bench_speculative.py                    # smollm2-135m, batch 1, 64 tokens
    python benchmarks/bench_speculative.py --batch 4
    python benchmarks/bench_speculative.py --model qwen2.5-0.5b --json
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
from bench_generate import MODELS as DENSE

from attnzoo.interop import from_hf

T = transformers
#: the dense shapes of bench_generate, and a hybrid whose linear-attention states roll back
MODELS: dict[str, Callable[[], Any]] = {
    **DENSE,
    "qwen3-next-shape": lambda: T.Qwen3NextConfig(  # 12 layers, 3 gated DeltaNet : 1 gated attention, dense MLP
        vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, num_experts=0, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True),
}


def prompts(vocab: int, args: argparse.Namespace) -> torch.Tensor:
    """``[B, --len]``: each row a random ``--phrase``-token phrase repeated."""
    g = torch.Generator().manual_seed(1)
    phrase = torch.randint(3, vocab, (args.batch, args.phrase), generator=g)
    return phrase.repeat(1, -(-args.len // args.phrase))[:, :args.len]


def early_exit(hf: Any, layers: int) -> Any:
    """A transformers model of ``hf``'s first ``layers`` layers, its embeddings, final norm and head."""
    fields = {**hf.config.to_dict(), "num_hidden_layers": layers}
    if fields.get("layer_types"):  # a hybrid: the first layers' kinds
        fields["layer_types"] = fields["layer_types"][:layers]
    cfg = hf.config.__class__(**fields)
    draft = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    draft.load_state_dict({k: v for k, v in hf.state_dict().items() if k in draft.state_dict()})
    return draft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--len", type=int, default=96, help="prompt tokens")
    p.add_argument("--phrase", type=int, default=24, help="tokens of the phrase the prompt repeats")
    p.add_argument("--new", type=int, default=64, help="tokens generated per row")
    p.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens (transformers' example: 10)")
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--draft-tokens", type=int, default=5, help="num_assistant_tokens")
    run_arguments(p, repeats=5)
    args = parse_run(p)
    cfg = MODELS[args.model]()
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    hf_draft = early_exit(hf, args.draft_layers)
    ours, draft = from_hf(hf).eval(), from_hf(hf_draft).eval()
    x = prompts(cfg.vocab_size, args)
    drafters: dict[str, dict[str, Any]] = {
        "lookup": {"prompt_lookup_num_tokens": args.lookup},
        "assistant": {"num_assistant_tokens": args.draft_tokens, "assistant_confidence_threshold": 0.0},
    }
    calls = {"target": 0, "draft": 0}  # forwards of the target and of the assistant (their heads run once a forward)
    for role, models in (("target", (ours, hf)), ("draft", (draft, hf_draft))):
        for model in models:
            model.lm_head.register_forward_hook(lambda *_, r=role: calls.__setitem__(r, calls[r] + 1))
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "attnzoo greedy": lambda: ours.generate(x, args.new),
        "attnzoo lookup": lambda: ours.generate(x, args.new, **drafters["lookup"]),
        "attnzoo assistant": lambda: ours.generate(x, args.new, assistant_model=draft, **drafters["assistant"]),
    }
    if args.batch == 1:
        # transformers reads the drafting settings from the assistant's own generation config
        hf_draft.generation_config.update(num_assistant_tokens_schedule="constant", **drafters["assistant"])
        gc = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False, "pad_token_id": 0}
        runs["transformers greedy"] = lambda: hf.generate(x, **gc)
        runs["transformers lookup"] = lambda: hf.generate(x, **gc, **drafters["lookup"])
        runs["transformers assistant"] = lambda: hf.generate(x, **gc, assistant_model=hf_draft)
    forwards: dict[str, dict[str, int]] = {}
    with torch.inference_mode():
        outs = {}
        for name, run in runs.items():
            calls.update(target=0, draft=0)
            outs[name] = run()
            forwards[name] = dict(calls)
        times = timed(runs, args.repeats)
    ref = outs["attnzoo greedy"]
    base = times.get("transformers greedy", times["attnzoo greedy"])
    rows = [{"impl": name, "seconds": t, "tokens_per_s": args.batch * args.new / t, "vs_greedy": base / t,
             "same_tokens_as_greedy": outs[name].shape == ref.shape and bool(torch.equal(outs[name], ref)),
             "target_forwards": forwards[name]["target"], "draft_forwards": forwards[name]["draft"]}
            for name, t in times.items()]
    info = {"model": args.model, "batch": args.batch, "prompt": args.len, "new": args.new, "lookup": args.lookup,
            "draft_layers": args.draft_layers, "draft_tokens": args.draft_tokens, "cpu": cpu_model(),
            "threads": torch.get_num_threads()}
    peer = "transformers" if args.batch == 1 else "attnzoo"
    print_rows(rows, info, f"{args.model}: batch {args.batch}, prompt {args.len} (a {args.phrase}-token phrase "
               f"repeated), {args.new} new tokens, lookup {args.lookup}, assistant = first {args.draft_layers} layers "
               f"drafting {args.draft_tokens}; {info['threads']} threads, {info['cpu']}",
               [("seconds", "median s", ".3f"), ("tokens_per_s", "tok/s", ".1f"), ("vs_greedy", f"x {peer} greedy", ".2f"),
                ("same_tokens_as_greedy", "= greedy", ""), ("target_forwards", "target fwd", "d"),
                ("draft_forwards", "draft fwd", "d")], args.json)


if __name__ == "__main__":
    main()
