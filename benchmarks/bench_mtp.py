"""Self-speculative decoding with a checkpoint's multi-token-prediction (MTP) layer on CPU:
``generate(use_mtp=True)`` against greedy decoding and against transformers' ``use_mtp`` with the
same weights, read by both from the same checkpoint folder.

A random-initialised model in DeepSeek-V3's or GLM-4.5's layout (``--family``; ``--layers`` layers of
width ``--width``, a mixture of experts from layer 1, a ``--vocab`` vocabulary) is saved as a
checkpoint folder with one MTP layer (``model.layers.{L}``: a MoE decoder layer with ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head``, as the released checkpoints). ``--family qwen3_next``: a
Qwen3-Next hybrid (three gated-DeltaNet layers per gated full-attention layer, a MoE on every layer)
with its MTP layer in Qwen's layout (``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.layers.0``, ``mtp.norm``);
transformers drops that layer, so its ``use_mtp`` is not timed, and a rejected draft rolls the
DeltaNet states back (the accepted tokens are fed again with the next round). ``--family step3p5``:
Step-3.7-Flash's text model (sliding:full 3:1 with their own head counts, gated attention, a MoE
from layer 1) inside its multimodal wrapper (a one-layer vision tower), its MTP layer a full-attention
MoE layer at ``model.layers.{L}``. Two MTP layers are timed:

* ``random``: as initialised: every draft is rejected, so a round costs the MTP layer and a
  two-token verification for one token (the overhead);
* ``distilled``: the MTP layer trained (``--distill`` Adam steps with attnzoo's ``mtp_logits``, the
  model frozen) to predict the model's own greedy continuations of the timed prompt and 15 others,
  then written back with ``save_pretrained(like=...)``: it has seen the text it drafts, so nearly
  every draft is kept (the ceiling; DeepSeek-V3's report gives 85-90% for its trained MTP layer).

Timed, round-robin (``--repeats``, medians), batch 1 (transformers' assisted generation takes one
row): attnzoo greedy, attnzoo ``use_mtp``, transformers greedy and transformers ``use_mtp``.
Reported: median seconds, tokens/s, the ratio to transformers' greedy, whether the tokens equal
greedy decoding's, the model's forwards in one run (counted at its final norm) and the fraction
of drafts accepted (attnzoo's run).

Usage::

    python benchmarks/bench_mtp.py                       # deepseek_v3, 64 new tokens
    python benchmarks/bench_mtp.py --family glm4_moe --json
    python benchmarks/bench_mtp.py --family qwen3_next
    python benchmarks/bench_mtp.py --family step3p5
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
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
from safetensors.torch import load_file, save_file

from attnzoo.models.hf import load_pretrained, save_pretrained

transformers.logging.set_verbosity_error()  # the load reports of the MTP layer transformers skips


def config(args: argparse.Namespace, layers: int) -> Any:
    """The transformers config of ``--family`` with ``layers`` layers."""
    moe = {"vocab_size": args.vocab, "hidden_size": args.width, "intermediate_size": 4 * args.width,
           "moe_intermediate_size": args.width // 2, "num_attention_heads": 8, "n_routed_experts": 16,
           "num_experts_per_tok": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
           "topk_group": 1, "num_hidden_layers": layers, "max_position_embeddings": 4096, "num_mtp_layers": 1}
    if args.family == "qwen3_next":
        kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        return transformers.Qwen3NextConfig(
            vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=args.width // 2, shared_expert_intermediate_size=args.width // 2,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
            max_position_embeddings=4096, layer_types=[*(kinds * layers)[:layers - 1], "full_attention"])
    if args.family == "step3p5":
        kinds = ["sliding_attention"] * 3 + ["full_attention"]
        text = {"vocab_size": args.vocab, "hidden_size": args.width, "intermediate_size": 4 * args.width,
                "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                "num_sliding_attention_heads": 16, "sliding_window": 128, "moe_intermediate_size": args.width // 2,
                "n_routed_experts": 16, "num_experts_per_tok": 4, "share_expert_dim": args.width // 2,
                "max_position_embeddings": 4096, "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
                "layer_types": [*(kinds * layers)[:layers - 1], "full_attention"],
                "rope_parameters": {k: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
                                    for k in set(kinds)}}
        vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 28, "patch_size": 14}
        return transformers.Step3p7Config(text_config=text, vision_config=vision)
    if args.family == "deepseek_v3":
        return transformers.DeepseekV3Config(**moe, num_key_value_heads=8, q_lora_rank=args.width // 2,
                                  kv_lora_rank=args.width // 4, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
    return transformers.Glm4MoeConfig(**moe, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.5)


def hf_class(args: argparse.Namespace) -> Any:
    """transformers' class of ``--family`` (Step-3.7: its multimodal wrapper, no causal-LM class)."""
    return transformers.Step3p7ForConditionalGeneration if args.family == "step3p5" else transformers.AutoModelForCausalLM


def step_checkpoint(args: argparse.Namespace, folder: Path) -> Path:
    """Step-3.7's: the ``--layers + 1``-layer model saved (its released names), its last layer kept as
    the MTP layer (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` added), the config cut back."""
    torch.manual_seed(0)
    transformers.Step3p7ForConditionalGeneration(config(args, args.layers + 1)).eval().save_pretrained(folder)
    L, C = args.layers, args.width
    tensors = load_file(str(folder / "model.safetensors"))
    tensors |= {f"model.layers.{L}.{n}.weight": torch.zeros(C) for n in ("enorm", "hnorm", "shared_head.norm")}
    tensors[f"model.layers.{L}.eh_proj.weight"] = torch.randn(C, 2 * C) / (2 * C) ** 0.5
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    data = json.loads((folder / "config.json").read_text())
    text = data["text_config"]
    for key in ("layer_types", "mlp_layer_types"):
        text[f"mtp_{key}"], text[key] = text[key][L:], text[key][:L]
    text.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    for key in ("swiglu_limits", "swiglu_limits_shared"):
        if isinstance(text.get(key), list):
            text[key] = text[key][:L]
    text.pop("per_layer_config", None)  # rebuilt by the config from num_sliding_attention_heads
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def checkpoint(args: argparse.Namespace, folder: Path) -> Path:
    """A ``--layers``-layer checkpoint whose layer ``--layers`` is a random MTP layer."""
    if args.family == "step3p5":
        return step_checkpoint(args, folder)
    torch.manual_seed(0)
    whole = transformers.AutoModelForCausalLM.from_config(config(args, args.layers + 1)).eval()
    model = transformers.AutoModelForCausalLM.from_config(config(args, args.layers)).eval()
    model.load_state_dict(whole.state_dict(), strict=False)
    model.save_pretrained(folder)
    L, C = args.layers, args.width
    if args.family == "qwen3_next":  # Qwen's layout: mtp.* beside the model, 1 + w norms (zeros: scale 1)
        mtp = {f"mtp.layers.0.{k[len(f'model.layers.{L}.'):]}": v for k, v in whole.state_dict().items()
               if k.startswith(f"model.layers.{L}.")}
        mtp |= {f"mtp.{n}.weight": torch.zeros(C) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        mtp["mtp.fc.weight"] = torch.randn(C, 2 * C) / (2 * C) ** 0.5
        tensors = load_file(str(folder / "model.safetensors")) | {k: v.contiguous() for k, v in mtp.items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    mtp = {k: v for k, v in whole.state_dict().items() if k.startswith(f"model.layers.{L}.")}
    mtp |= {f"model.layers.{L}.{n}.weight": torch.ones(C) for n in ("enorm", "hnorm", "shared_head.norm")}
    mtp[f"model.layers.{L}.eh_proj.weight"] = torch.randn(C, 2 * C) / (2 * C) ** 0.5
    mtp[f"model.layers.{L}.shared_head.head.weight"] = whole.lm_head.weight.detach()
    mtp[f"model.layers.{L}.embed_tokens.weight"] = whole.model.embed_tokens.weight.detach()
    tensors = load_file(str(folder / "model.safetensors")) | {k: v.contiguous() for k, v in mtp.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def distill(folder: Path, out: Path, args: argparse.Namespace, x: torch.Tensor) -> Path:
    """``folder`` with its MTP layer trained (``--distill`` Adam steps, the model frozen) on the
    model's greedy continuations of the timed prompt ``x`` and 15 others."""
    model = load_pretrained(folder).eval()
    g = torch.Generator().manual_seed(2)
    prompts = torch.cat([x, torch.randint(3, args.vocab, (15, x.shape[1]), generator=g)])
    with torch.no_grad():
        seqs = model.generate(prompts, args.new)
        hidden = model.hidden_states(seqs)  # the frozen model's part, once
    for p in model.parameters():
        p.requires_grad_(False)
    train = list(model.mtp.parameters())
    for p in train:
        p.requires_grad_(True)
    opt = torch.optim.Adam(train, lr=1e-2)
    for _ in range(args.distill):
        logits = model.mtp_logits(seqs, hidden=hidden)[0][:, :-1]  # row j predicts token j + 2
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seqs[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MTP layer's copies of the embedding and head keep their values
        return save_pretrained(model, out, like=folder)


def runs_of(folder: Path, args: argparse.Namespace, x: torch.Tensor, calls: dict[str, int],
            tag: str) -> dict[str, Callable[[], torch.Tensor]]:
    """The four timed runs of the checkpoint ``folder`` (greedy only for the ``random`` one's peers)."""
    ours = load_pretrained(folder).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = hf_class(args).from_pretrained(folder).eval()
    if args.family != "step3p5":  # Step-3.7's model names its MTP layers itself
        theirs._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{args.layers}\..*"]  # where this MTP layer is
    ours.norm.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    text = getattr(theirs.model, "language_model", theirs.model)
    text.norm.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    gc = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False, "pad_token_id": 0}
    runs = {f"attnzoo use_mtp ({tag})": lambda: ours.generate(x, args.new, use_mtp=True)}
    if args.family != "qwen3_next":  # transformers drops Qwen's MTP layer
        runs[f"transformers use_mtp ({tag})"] = lambda: theirs.generate(x, **gc, use_mtp=True)
    if tag == "random":
        runs = {"attnzoo greedy": lambda: ours.generate(x, args.new),
                "transformers greedy": lambda: theirs.generate(x, **gc), **runs}
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="deepseek_v3", choices=("deepseek_v3", "glm4_moe", "qwen3_next", "step3p5"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--len", type=int, default=32, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="tokens generated")
    p.add_argument("--distill", type=int, default=100, help="Adam steps training the MTP layer")
    run_arguments(p, repeats=5)
    args = parse_run(p)
    x = torch.randint(3, args.vocab, (1, args.len), generator=torch.Generator().manual_seed(1))
    calls = {"n": 0}
    with tempfile.TemporaryDirectory() as tmp:
        base = checkpoint(args, Path(tmp) / "random")
        runs = runs_of(base, args, x, calls, "random")
        runs |= runs_of(distill(base, Path(tmp) / "distilled", args, x), args, x, calls, "distilled")
        outs, forwards = {}, {}
        with torch.inference_mode():
            for name, run in runs.items():
                calls["n"] = 0
                outs[name] = run()
                forwards[name] = calls["n"]
            times = timed(runs, args.repeats)
    ref = outs["attnzoo greedy"]
    rows = [{"impl": name, "seconds": t, "tokens_per_s": args.new / t, "vs_greedy": times["transformers greedy"] / t,
             "same_tokens_as_greedy": bool(torch.equal(outs[name], ref)), "forwards": forwards[name],
             # a round drafts one token and writes 1 + the accepted drafts; the prefill writes one (a hybrid's
             # rejected round feeds its tokens again: more forwards than tokens, no count of drafts)
             "accepted": (args.new - forwards[name]) / max(forwards[name] - 1, 1)
             if "use_mtp" in name and forwards[name] <= args.new else None}
            for name, t in times.items()]
    info = {"family": args.family, "layers": args.layers, "width": args.width, "vocab": args.vocab,
            "prompt": args.len, "new": args.new, "distill": args.distill, "cpu": cpu_model(),
            "threads": torch.get_num_threads()}
    print_rows(rows, info, f"{args.family}-shaped: {args.layers} layers, width {args.width}, vocab {args.vocab}, "
               f"prompt {args.len}, {args.new} new tokens, 1 MTP layer; {info['threads']} threads, {info['cpu']}",
               [("seconds", "median s", ".3f"), ("tokens_per_s", "tok/s", ".1f"),
                ("vs_greedy", "x transformers greedy", ".2f"), ("same_tokens_as_greedy", "= greedy", ""),
                ("forwards", "model fwd", "d"), ("accepted", "drafts kept", ".2f")], args.json)


if __name__ == "__main__":
    main()
