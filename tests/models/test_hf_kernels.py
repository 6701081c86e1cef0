"""``attnzoo.hf.register()`` serves transformers' linear-attention kernel hooks
(:mod:`attnzoo.hf_kernels`): each hook equals transformers' own PyTorch fallback, a Qwen3-Next
model's logits and greedy generation are unchanged by them, and packed sequences (which the
fallback refuses) give each sequence's logits alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.qwen3_next import modeling_qwen3_next as mq  # noqa: E402

import attnzoo.hf as azhf  # noqa: E402
import hf_family_checks as checks  # noqa: E402
from attnzoo import hf_kernels  # noqa: E402

T = transformers
azhf.register()


def _original(fn: str) -> Any:
    return hf_kernels.ORIGINALS[("qwen3_next", fn)]


def test_register_serves_the_hooks() -> None:
    assert mq.torch_chunk_gated_delta_rule is hf_kernels.chunk_gated_delta_rule
    assert mq.causal_conv1d_fn is hf_kernels.causal_conv1d_fn
    assert {"qwen3_next.causal_conv1d_update", "qwen3_5.torch_recurrent_gated_delta_rule",
            "kimi_linear.chunk_kimi_delta_attention"} <= set(hf_kernels.install())


def _inputs(B: int = 2, N: int = 37, hk: int = 2, hv: int = 4, per_channel: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (B, N, hv, 8) if per_channel else (B, N, hv)
    return {"query": torch.randn(B, N, hk, 8, generator=g), "key": torch.randn(B, N, hk, 8, generator=g),
            "value": torch.randn(B, N, hv, 6, generator=g),
            "g": -torch.rand(shape, generator=g), "beta": torch.rand(B, N, hv, generator=g),
            "initial_state": torch.randn(B, hv, 8, 6, generator=g)}


@pytest.mark.parametrize("fn", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_delta_rule_hooks_equal_the_fallback(fn: str) -> None:
    x = _inputs()
    ref, ref_state = _original(fn)(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = hf_kernels.HOOKS[fn](**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert checks.rel(out, ref) < 1e-5 and checks.rel(state, ref_state) < 1e-5


def test_kda_hook_equals_the_fallback() -> None:
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    x = _inputs(hk=4, per_channel=True)
    ref, ref_state = hf_kernels.ORIGINALS[("kimi_linear", "recurrent_kimi_delta_attention")](
        **x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = mk.chunk_kimi_delta_attention(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert checks.rel(out, ref) < 1e-5 and checks.rel(state, ref_state) < 1e-5


def test_conv_hooks_equal_the_fallback() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 12, 9, generator=g), torch.randn(12, 4, generator=g)
    ref = _original("causal_conv1d_fn")(x, w, None, activation="silu")
    assert checks.rel(hf_kernels.causal_conv1d_fn(x, w, None, activation="silu"), ref) < 1e-6
    state = torch.randn(2, 12, 4, generator=g)
    step = torch.randn(2, 12, 1, generator=g)
    ref_state = state.clone()
    ref = _original("causal_conv1d_update")(step, ref_state, w, None, "silu")
    out = hf_kernels.causal_conv1d_update(step, state, w, None, "silu")
    assert checks.rel(out, ref) < 1e-6 and torch.equal(state, ref_state)


def _config() -> Any:
    return T.Qwen3NextConfig(**{**checks.SMALL, "num_hidden_layers": 4, "head_dim": 16, "num_experts": 4,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 24, "linear_num_key_heads": 2,
                                "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8})


def test_model_logits_and_generation_equal_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = checks.hf_model(_config())
    x, mask = checks.padded(30)
    prompt = x[1:, :7]
    with torch.no_grad():
        ours = hf(input_ids=x, attention_mask=mask).logits
    gen = hf.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for fn in hf_kernels.HOOKS:
        if ("qwen3_next", fn) in hf_kernels.ORIGINALS:
            monkeypatch.setattr(mq, fn, _original(fn))
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask).logits
    ref_gen = hf.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    real = mask.bool()
    assert checks.rel(ours[real], ref[real]) <= checks.TOL
    assert torch.equal(gen, ref_gen)


def test_packed_sequences_equal_each_alone() -> None:
    """Padding-free input (``position_ids`` restarting, ``cu_seq_lens_q``, no cache), as transformers'
    ``DataCollatorWithFlattening`` makes it: the fallback refuses it, the served kernels keep
    the sequences apart."""
    hf = checks.hf_model(_config())
    lengths = [6, 13, 9]
    seqs = [checks.tokens(n, batch=1, seed=20 + i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = hf(input_ids=torch.cat(seqs, dim=1), position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=max(lengths), max_length_k=max(lengths)).logits
        alone = torch.cat([hf(input_ids=s).logits for s in seqs], dim=1)
    assert checks.rel(packed, alone) <= checks.TOL
