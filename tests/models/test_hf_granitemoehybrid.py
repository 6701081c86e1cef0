"""Granite 4.0-H (``granitemoehybrid``) through ``from_hf``: Mamba-2 mixers and attention
(NoPE, or RoPE) scaled by ``attention_multiplier``; top-k-softmax experts plus the always-on
shared MLP (or the shared MLP alone); the embedding, residual and logit multipliers. Equal to
transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

#: the multipliers of the released shape (Granite 4.0-H: 12, 0.22, 1/128, ...), each != 1 and
#: the attention's != head_dim ** -0.5 (0.25 here)
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
                   logits_scaling=4.0)


def _config(**kw: Any) -> Any:
    """The released shape: Mamba-2 and NoPE attention layers, experts plus the shared MLP, tied
    embeddings, every multiplier != 1."""
    return T.GraniteMoeHybridConfig(**{
        **checks.SMALL, "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"],
        "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_n_groups": 2, "mamba_expand": 2, "mamba_chunk_size": 8,
        "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 48,
        "tie_word_embeddings": True, **MULTIPLIERS, **kw})


def _dense_rope(**kw: Any) -> Any:
    """No experts (the shared MLP alone), RoPE on the whole head, attention biases, untied head,
    one group and no convolution bias in the mixers, other multipliers (a logit scale < 1)."""
    return _config(**{
        "num_local_experts": 0, "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "attention_bias": True,
        "layer_types": ["full_attention", "linear_attention", "full_attention", "linear_attention"],
        "tie_word_embeddings": False, "mamba_n_groups": 1, "mamba_conv_bias": False, "rms_norm_eps": 1e-5,
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3,
        "logits_scaling": 0.5, **kw})


class TestGraniteMoeHybrid(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_dense_rope,)

    def test_saved_folder_of_the_dense_case_loads(self, tmp_path: Path) -> None:
        checks.check_folder(_dense_rope, tmp_path)


def test_layers_are_built_from_the_config() -> None:
    from attnzoo import FeedForward
    from attnzoo.interop import from_hf
    from attnzoo.models.parts import ScaledEmbedding
    from attnzoo.nn.mamba2 import Mamba2
    from attnzoo.nn.moe import MixtureOfExperts

    ours = from_hf(checks.hf_model(_config()))
    assert [isinstance(b.attn, Mamba2) for b in ours.blocks] == [True, False, True, False]
    assert ours.blocks[1].attn.rope is None and ours.blocks[1].attn.scale == 0.5  # NoPE, attention_multiplier
    assert ours.blocks[0].attn.norm.weight.shape == (2, 64)  # the gated norm per group
    moe = ours.blocks[0].ffn
    assert isinstance(moe, MixtureOfExperts) and moe.routing == "topk_softmax" and moe.top_k == 2
    assert isinstance(moe.shared_expert, FeedForward) and moe.shared_expert.down_proj.weight.shape == (64, 48)
    assert isinstance(ours.tok_emb, ScaledEmbedding) and ours.tok_emb.scale == 12.0
    assert ours.tie_embeddings

    dense = from_hf(checks.hf_model(_dense_rope()))
    assert [isinstance(b.attn, Mamba2) for b in dense.blocks] == [False, True, False, True]
    assert isinstance(dense.blocks[0].ffn, FeedForward) and dense.blocks[0].attn.rope.rotary_dim == 16
    assert not dense.tie_embeddings


def test_multipliers_are_folded_into_the_weights() -> None:
    """``residual_multiplier`` scales every weight writing into the residual stream,
    ``1 / logits_scaling`` the final norm of the LM (not of the base model)."""
    from attnzoo.interop import from_hf

    hf = checks.hf_model(_config())
    ours, layers, r = from_hf(hf), hf.model.layers, 0.22
    with torch.no_grad():
        assert torch.allclose(ours.blocks[0].attn.out_proj.weight, r * layers[0].mamba.out_proj.weight)
        assert torch.allclose(ours.blocks[1].attn.out_proj.weight, r * layers[1].self_attn.o_proj.weight)
        assert torch.allclose(ours.blocks[1].ffn.down_proj, r * layers[1].block_sparse_moe.experts.down_proj)
        assert torch.allclose(ours.blocks[1].ffn.shared_expert.down_proj.weight,
                              r * layers[1].shared_mlp.output_linear.weight)
        assert torch.allclose(ours.norm.weight, hf.model.norm.weight / 4.0)
        base = from_hf(checks.hf_model(_config(), T.AutoModel))
        assert torch.equal(base.norm.weight, hf.model.norm.weight)
        dense = checks.hf_model(_dense_rope())
        got = from_hf(dense).blocks[0]
        assert torch.allclose(got.attn.out_proj.bias, 0.5 * dense.model.layers[0].self_attn.o_proj.bias)
        assert torch.allclose(got.ffn.down_proj.weight, 0.5 * dense.model.layers[0].shared_mlp.output_linear.weight)


def test_builder_matches_the_conversion() -> None:
    """``build_granitemoehybrid`` (random weights) has the converted model's parameters, and
    reads the legacy layer names and a config.json without the keys transformers defaults."""
    from attnzoo.interop import from_hf
    from attnzoo.models.families.granitemoehybrid import build_granitemoehybrid
    from attnzoo.models.hf._state import HFConfig
    from attnzoo.nn.mamba2 import Mamba2

    for make in (_config, _dense_rope):
        data = make().to_dict()
        built = build_granitemoehybrid(HFConfig(data, "test"))
        converted = from_hf(checks.hf_model(make()))
        assert {k: v.shape for k, v in built.state_dict().items()} == \
            {k: v.shape for k, v in converted.state_dict().items()}
    data = {k: v for k, v in _config().to_dict().items() if k not in ("rms_norm_eps", "layer_types")}
    legacy = build_granitemoehybrid(HFConfig({**data, "layers_block_type": ["attention", "mamba", "mamba", "mamba"]},
                                             "test"))
    assert [isinstance(b.attn, Mamba2) for b in legacy.blocks] == [False, True, True, True]
    assert legacy.blocks[1].attn.norm.eps == 1e-6 and legacy.norm.eps == 1e-6  # transformers' default


@pytest.mark.parametrize(("make", "key", "value", "named"), [
    (_config, "position_embedding_type", "alibi", "position_embedding_type"),
    (_config, "mamba_proj_bias", True, "mamba_proj_bias"),
    (_config, "time_step_limit", (0.0, 5.0), "time_step_limit"),
    (_config, "hidden_act", "gelu", "hidden_act"),
    (_config, "attention_multiplier", 0.0, "attention_multiplier"),
    (_config, "embedding_multiplier", -1.0, "embedding_multiplier"),
    (_config, "logits_scaling", 0.0, "logits_scaling"),
    (_config, "layer_types", ["mamba", "sliding_attention", "mamba", "attention"], "sliding_attention"),
    (_dense_rope, "rope_parameters", {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
])
def test_options_it_cannot_reproduce_are_refused(make: Any, key: str, value: Any, named: str) -> None:
    checks.check_refused(T.GraniteMoeHybridForCausalLM, make, key, value, named)


@pytest.mark.parametrize("make", [_config, _dense_rope])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_config)
