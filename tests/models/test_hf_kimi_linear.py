"""Kimi Linear through ``from_hf``: KDA layers (per-channel decay, low-rank gates) 3 : 1 with NoPE
multi-head latent attention, DeepSeek-V3's MoE (sigmoid scores, the correction bias choosing the
experts, routed scaling, a shared expert) after a dense first layer; equal to transformers' eager
(see ``hf_family_checks``), and packed sequences equal to each sequence alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.nn.kda import KimiDeltaAttention  # noqa: E402
from attnzoo.nn.mla import MultiHeadLatentAttention  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    return T.KimiLinearConfig(**{**checks.SMALL, "num_key_value_heads": 4, "num_hidden_layers": 4,
                                 "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                                 "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                 "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                 "qk_rope_head_dim": 8, "v_head_dim": 16, "linear_num_heads": 2, "linear_head_dim": 16,
                                 **kw})


def _grouped_routing() -> Any:
    """Group-limited routing: 8 experts in 4 groups, each token's 2 experts from its best 2 groups."""
    return _config(num_local_experts=8, n_group=4, topk_group=2)


def _low_rank_query() -> Any:
    """A low-rank query (``q_lora_rank``), unnormalised expert weights, two shared experts."""
    return _config(q_lora_rank=24, norm_topk_prob=False, n_shared_experts=2, linear_conv_kernel_dim=3)


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert [type(b.attn) for b in ours.blocks] == [KimiDeltaAttention] * 3 + [MultiHeadLatentAttention]
    assert [isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks] == [False, True, True, True]
    assert ours.blocks[3].attn.rope is None  # NoPE latent attention
    assert ours.blocks[0].attn.qk_norm_eps == 1e-6


def test_correction_bias_chooses_the_experts() -> None:
    """The converted bias is live: a large bias on one expert puts it in every token's top-k."""
    ours = from_hf(checks.hf_model(_config()))
    moe = ours.blocks[1].ffn
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        moe.score_bias.zero_()
        moe.score_bias[3] = 10.0
        _, experts, _ = moe.route(x)
    assert bool((experts == 3).any(dim=-1).all())


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


@pytest.mark.parametrize(("key", "value", "named"), [("attention_bias", True, "attention_bias=True"),
                                                     ("hidden_act", "gelu", "hidden_act='gelu'")])
def test_unsupported_options_are_named(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.KimiLinearForCausalLM, _config, key, value, named)


class TestKimiLinear(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_grouped_routing, _low_rank_query)


def test_the_configured_length_is_the_models_length(tmp_path: Path) -> None:
    """KimiLinearConfig keeps max_position_embeddings as ``model_max_length`` (its to_dict and
    config.json have only that name): the converter fell back to 2048 positions, so generation
    past the configured length was not refused and past 2048 it was."""
    hf = checks.hf_model(_config(max_position_embeddings=32))
    ours = from_hf(hf)
    assert ours.max_seq_len == 32
    with pytest.raises(ValueError, match="exceeds the model's 32 positions"):
        ours.generate(checks.tokens(10, batch=1), 40)
    hf.save_pretrained(tmp_path)
    assert load_pretrained(tmp_path).max_seq_len == 32
    assert from_hf(checks.hf_model(_config(max_position_embeddings=4096))).max_seq_len == 4096
