"""A hybrid model on the CPU in float32 — Qwen3-Next-shaped (3 gated-DeltaNet layers per
gated-attention layer, MoE; the default) or one of the Mamba-2 families (``--family bamba``,
``falcon_h1``, ``nemotron_h``, ``mamba2``: Mamba-2 mixers with attention layers, in parallel for
Falcon-H1; ``lfm2``: LFM2's gated short convolutions with attention; ``mamba``: Mamba-1's selective
scan, whose transformers fallback is a Python loop over the tokens): prefill of N tokens and one training step (forward + backward of the LM loss), three
ways on the same weights:

* ``hf-fallback``: transformers' model with its own PyTorch kernels (what a CPU gets without
  ``fla`` / ``mamba_ssm``: the chunked delta rule / SSD loops, ``F.conv1d``) and its ``eager``
  attention (``--hf-attention sdpa``: its CPU default, torch's SDPA);
* ``hf+attnzoo``: the same transformers model after ``attnzoo.hf.register()``, run with
  ``attn_implementation="attnzoo"`` (its full-attention layers through :func:`attnzoo.attention`)
  and its linear-attention hooks served by :mod:`attnzoo.hf_kernels`;
* ``attnzoo``: the model converted by ``attnzoo.interop.from_hf``.

Times are medians of interleaved repeats (each way in turn, then again), so load from other
processes hits all three alike; ratio = hf-fallback / this (> 1: faster than transformers). The
logits of the three are compared once (max relative difference vs hf-fallback).

    python benchmarks/bench_hf_hybrid.py                       # N = 4096, 3 repeats
    python benchmarks/bench_hf_hybrid.py --tokens 1024 --repeats 5 --threads 2
    python benchmarks/bench_hf_hybrid.py --family bamba --tokens 2048
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnzoo.hf as azhf
from attnzoo import hf_kernels
from attnzoo.interop import from_hf

#: family (transformers' model module) -> what its config builds
FAMILIES = {"qwen3_next": "4 layers: 3 linear : 1 full, MoE 4 experts top-2",
            "bamba": "4 layers: 3 Mamba-2 : 1 attention, SwiGLU MLPs",
            "falcon_h1": "4 layers: Mamba-2 beside attention in every layer, SwiGLU MLPs",
            "nemotron_h": "7 layers M-M-M*- (4 attnzoo blocks): 3 Mamba-2 : 1 attention, 3 relu^2 MLPs",
            "mamba2": "4 Mamba-2 mixer-only layers",
            "mamba": "4 Mamba-1 mixer-only layers (state 16, expand 2)",
            "lfm2": "4 layers: 3 gated short convolutions : 1 attention, SwiGLU MLPs"}


def _config(args: argparse.Namespace) -> object:
    """A small config of ``args.family`` (:data:`FAMILIES`) of width ``args.dim`` (heads of 64)."""
    import transformers as T

    C, heads = args.dim, args.dim // 64
    common = {"vocab_size": 1024, "hidden_size": C, "max_position_embeddings": 2 * args.tokens}
    attn = {"num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2)}
    mamba = {"mamba_n_heads": 2 * heads, "mamba_d_state": 64, "mamba_chunk_size": 64}
    if args.family == "qwen3_next":
        return T.Qwen3NextConfig(**common, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=64, intermediate_size=2 * C, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=C, shared_expert_intermediate_size=C, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
    if args.family == "bamba":
        return T.BambaConfig(**common, **attn, **mamba, num_hidden_layers=4, attn_layer_indices=[3],
                             intermediate_size=2 * C)
    if args.family == "falcon_h1":
        return T.FalconH1Config(**common, **attn, **mamba, num_hidden_layers=4, intermediate_size=2 * C,
                                mamba_d_ssm=2 * C)
    if args.family == "nemotron_h":
        return T.NemotronHConfig(**common, **attn, head_dim=64, hybrid_override_pattern="M-M-M*-",
                                 mamba_num_heads=2 * heads, mamba_head_dim=64, ssm_state_size=64, n_groups=1,
                                 chunk_size=64, intermediate_size=2 * C)
    if args.family == "lfm2":
        return T.Lfm2Config(**common, **attn, num_hidden_layers=4, intermediate_size=3 * C,
                            layer_types=["conv", "conv", "conv", "full_attention"])
    if args.family == "mamba":
        return T.MambaConfig(vocab_size=1024, hidden_size=C, num_hidden_layers=4, state_size=16, expand=2)
    return T.Mamba2Config(**{k: v for k, v in common.items() if k != "max_position_embeddings"},
                          num_hidden_layers=4, num_heads=2 * heads, head_dim=64, state_size=64, n_groups=1,
                          chunk_size=64)


def _model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers as T

    cfg = _config(args)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=args.hf_attention)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _set_hooks(family: str, served: bool) -> None:
    """transformers' own kernels (``served=False``) or attnzoo's behind its hooks."""
    import importlib

    mq = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for (module, fn), original in hf_kernels.ORIGINALS.items():
        if module == family:
            setattr(mq, fn, hf_kernels.HOOKS[fn] if served else original)


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=list(FAMILIES), default="qwen3_next")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hf-attention", choices=("eager", "sdpa"), default="eager",
                    help="transformers' attention of the hf-fallback way: eager (the docs' tables) or sdpa "
                         "(its default on a CPU)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    azhf.register()
    hf = _model(args)
    ours = from_hf(hf)
    x = torch.randint(0, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))

    def hf_logits(served: bool) -> torch.Tensor:
        _set_hooks(args.family, served)
        if args.family not in ("mamba2", "mamba"):  # attention-free: no attention implementation to set
            hf.set_attn_implementation("attnzoo" if served else args.hf_attention)
        return hf(input_ids=x, use_cache=False).logits

    def train(model: torch.nn.Module, run: Callable[[], torch.Tensor]) -> None:
        model.zero_grad(set_to_none=True)
        logits = run()
        F.cross_entropy(logits[0, :-1].float(), x[0, 1:]).backward()

    ways: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "hf-fallback": (lambda: hf_logits(False), lambda: train(hf, lambda: hf_logits(False))),
        "hf+attnzoo": (lambda: hf_logits(True), lambda: train(hf, lambda: hf_logits(True))),
        "attnzoo": (lambda: ours(x), lambda: train(ours, lambda: ours(x))),
    }
    with torch.no_grad():
        ref = hf_logits(False)
        errs = {name: float((fns[0]() - ref).abs().max() / ref.abs().max()) for name, fns in ways.items()}
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            prefill, step = ways[name]
            with torch.no_grad():
                times.setdefault((name, "prefill"), []).append(_time(prefill))
            times.setdefault((name, "train step"), []).append(_time(step))
            print(f"# repeat {r}: {name} prefill {times[(name, 'prefill')][-1]:.2f} s, train step "
                  f"{times[(name, 'train step')][-1]:.2f} s", flush=True)
    print(f"{args.family}, dim={args.dim}, {FAMILIES[args.family]}, hf attention {args.hf_attention}, "
          f"N={args.tokens}, threads={torch.get_num_threads()}, repeats={args.repeats}")
    print(f"{'way':<12} {'case':<11} {'median s':>9} {'ratio':>7} {'max rel err':>12}")
    for case in ("prefill", "train step"):
        base = statistics.median(times[("hf-fallback", case)])
        for name in ways:
            t = statistics.median(times[(name, case)])
            print(f"{name:<12} {case:<11} {t:9.3f} {base / t:7.2f} {errs[name]:12.2e}")


if __name__ == "__main__":
    main()
