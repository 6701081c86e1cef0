"""MiniMax (``MiniMaxForCausalLM``) through ``from_hf``: lightning-attention layers (fixed per-head
decay, RMSNorm over the heads, sigmoid gate) mixed with softmax GQA layers (RoPE, optional
sliding window), a renormalised top-k mixture of SwiGLU experts on every layer, and the six
residual factors folded into the weights of post-norm blocks; equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

#: every residual factor away from 1 and from the others, so dropping any one fails the logits
FACTORS = {"full_attn_alpha_factor": 1.7, "full_attn_beta_factor": 0.6, "linear_attn_alpha_factor": 2.3,
           "linear_attn_beta_factor": 0.8, "mlp_alpha_factor": 1.4, "mlp_beta_factor": 0.7}


def _config(**kw: Any) -> Any:
    """hidden 64, 4 layers alternating full / linear (the default ``layer_types``), blocks of 8
    tokens (< the 30 tested), 4 experts top-2, no window, every factor away from 1."""
    return T.MiniMaxConfig(**{**checks.SMALL, "num_hidden_layers": 4, "num_local_experts": 4,
                              "num_experts_per_tok": 2, "block_size": 8, **FACTORS, **kw})


def _other(**kw: Any) -> Any:
    """5 layers linear, linear, full, linear, full (a lightning layer first: the embedding's norm
    takes the linear alpha), head_dim 24 (!= hidden / heads), blocks of 5, sliding window 6, 3
    experts top-1, tied embeddings, eps 1e-3, other factors (a negative beta)."""
    factors = {"full_attn_alpha_factor": 0.5, "full_attn_beta_factor": 1.9, "linear_attn_alpha_factor": 3.1,
               "linear_attn_beta_factor": -0.4, "mlp_alpha_factor": 0.8, "mlp_beta_factor": 1.3}
    kinds = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
    return _config(**{"num_hidden_layers": 5, "layer_types": kinds, "head_dim": 24, "block_size": 5,
                      "sliding_window": 6, "num_local_experts": 3, "num_experts_per_tok": 1,
                      "tie_word_embeddings": True, "rms_norm_eps": 1e-3, **factors, **kw})


def _top3(**kw: Any) -> Any:
    """Top-3 of 5 experts, one layer of each kind, the window larger than the blocks."""
    return _config(**{"num_hidden_layers": 2, "num_local_experts": 5, "num_experts_per_tok": 3, "sliding_window": 12,
                      "block_size": 4, **kw})


class TestMiniMax(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_top3, _other)


def test_structure() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.models.families.minimax import (
        LightningAttention,
        NormedEmbedding,
        lightning_slopes,
    )
    from attnzoo.nn.attention import MultiHeadAttention
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_other())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert [type(b.attn) for b in ours.blocks] == [LightningAttention] * 2 + [MultiHeadAttention, LightningAttention,
                                                                               MultiHeadAttention]
    assert all(not b.norm_first and isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks)
    assert isinstance(ours.tok_emb, NormedEmbedding) and ours.tie_embeddings
    assert isinstance(ours.blocks[-1].ffn_norm, torch.nn.Identity)
    mixer = ours.blocks[0].attn
    assert mixer.qkv_proj.weight.shape == (3 * 4 * 24, 64) and mixer.norm.eps == 1e-6 and mixer.chunk_size == 5
    assert ours.blocks[2].attn.window[0] == 5  # sliding_window - 1 keys before the query
    for i in (0, 1, 3):  # the rates are transformers' buffers
        torch.testing.assert_close(ours.blocks[i].attn.slopes, hf.model.layers[i].self_attn.slope_rate.flatten())
        torch.testing.assert_close(ours.blocks[i].attn.slopes, lightning_slopes(4, i, 5).float())
    moe = ours.blocks[0].ffn
    assert (moe.num_experts, moe.top_k, moe.routing, moe.norm_topk_prob) == (3, 1, "softmax_topk", True)


def test_half_casts_keep_the_rates_in_float32() -> None:
    from attnzoo.interop import from_hf

    ours = from_hf(checks.hf_model(_config())).to(torch.bfloat16)
    assert ours.blocks[1].attn.slopes.dtype == torch.float32
    assert ours.blocks[1].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(ours(checks.tokens(12)).float()).all()


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` that leaves out ``MiniMaxConfig``'s defaults (alternating ``layer_types``,
    blocks of 256, 8 key/value heads, 8 experts top-2, SiLU, eps 1e-5, theta 1e6, the factors 1,
    untied): read as transformers reads it."""
    hf = checks.hf_model(_config(num_attention_heads=8, num_key_value_heads=8, num_local_experts=8, block_size=256,
                                 **dict.fromkeys(FACTORS, 1.0)))
    checks.check_folder_without_keys(hf, tmp_path, (
        "layer_types", "block_size", "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "hidden_act",
        "rms_norm_eps", "rope_parameters", "rope_theta", "tie_word_embeddings", "router_jitter_noise", *FACTORS))


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "gelu", "hidden_act"),
    ("linear_attn_alpha_factor", 0.0, "linear_attn_alpha_factor"),
    ("full_attn_alpha_factor", 0, "full_attn_alpha_factor"),
    ("mlp_alpha_factor", 0.0, "mlp_alpha_factor"),
    ("mlp_beta_factor", float("nan"), "mlp_beta_factor"),
    ("router_jitter_noise", 0.1, "router_jitter_noise"),
    ("layer_types", ["full_attention", "sliding_attention"] * 2, "sliding_attention"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.MiniMaxForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    """transformers' lightning layers take no packed sequences: ours alone are compared."""
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    """Top-2 (with one expert renormalised to weight 1 the router's gradient is 0 up to rounding)."""
    checks.check_packed_gradients_equal_each_alone(lambda: _other(num_experts_per_tok=2))
