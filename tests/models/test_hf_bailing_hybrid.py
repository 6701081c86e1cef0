"""Bailing-hybrid (Ling / Ring linear hybrids) through ``from_hf``: KDA layers with full-rank gates
and the bounded ("safe") decay, the last layer of each group multi-head latent attention with
interleaved RoPE and a per-head output gate, dense layers then DeepSeek-V3's MoE (group-limited
routing, shared experts, per-layer SwiGLU limits); equal to transformers' eager (see
``hf_family_checks``), packed sequences and their gradients equal to each sequence alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.bailing_hybrid import (  # noqa: E402
    GatedLatentAttention,
    LimitedSwiGLU,
    LingDeltaAttention,
)
from attnzoo.nn.moe import Experts, MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**kw: Any) -> Any:
    """4 layers, groups of 2 (KDA, MLA, KDA, MLA), a dense first layer then MoE with 8 experts in
    4 groups (2 picked from the best 2 groups) and one shared expert; the safe gate on."""
    return T.BailingHybridConfig(**{**checks.SMALL, "num_key_value_heads": 4, "num_hidden_layers": 4,
                                    "layer_group_size": 2, "head_dim": 16, "kv_lora_rank": 16,
                                    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                    "num_local_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "rope_theta": 10000.0,
                                    **kw})


def _plain_gate_low_rank_query() -> Any:
    """Kimi's softplus decay (``kda_safe_gate=False``), a low-rank query, attention biases, two
    shared experts, unnormalised expert weights, convolutions of 3."""
    return _config(kda_safe_gate=False, q_lora_rank=24, attention_bias=True, n_shared_experts=2,
                   norm_topk_prob=False, short_conv_kernel_size=3)


def _limited_tied_yarn() -> Any:
    """Explicit layer kinds (3 KDA : 1 MLA, two dense layers), per-layer SwiGLU limits small enough
    to clip, ``tie_word_embeddings`` (transformers still keeps a separate head), YaRN on the latent
    attention's rotary channels (with ``mscale_all_dim``), another lower bound."""
    return _config(layer_types=["linear_attention"] * 3 + ["full_attention"],
                   mlp_layer_types=["dense", "dense", "sparse", "sparse"], kda_lower_bound=-3.0,
                   expert_swiglu_limit_list=[0, 0, 0.05, 0.02], share_expert_swiglu_limit_list=[0.3, 0, 0.05, 0],
                   tie_word_embeddings=True,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 64, "mscale_all_dim": 1.0})


class TestBailingHybrid(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_plain_gate_low_rank_query, _limited_tied_yarn)


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_limited_tied_yarn()))
    assert [type(b.attn) for b in ours.blocks] == [LingDeltaAttention] * 3 + [GatedLatentAttention]
    assert [isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks] == [False, False, True, True]
    assert ours.blocks[0].attn.lower_bound == -3.0 and ours.blocks[0].attn.qk_norm_eps == 1e-6
    assert ours.blocks[3].attn.rope is not None and ours.blocks[3].attn.rope.interleaved
    assert [b.ffn.activation for b in ours.blocks[2:]] == ["limited_swiglu"] * 2
    assert isinstance(ours.blocks[2].ffn.shared_expert, LimitedSwiGLU)
    assert not isinstance(ours.blocks[3].ffn.shared_expert, LimitedSwiGLU)  # limit 0: a plain SwiGLU
    assert ours.lm_head.weight is not ours.tok_emb.weight  # transformers never ties this family's head
    plain = from_hf(checks.hf_model(_plain_gate_low_rank_query()))
    assert plain.blocks[0].attn.lower_bound is None


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_plain_gate_low_rank_query)


def _rewrite_weights(folder: Path, change: Any) -> None:
    path = folder / "model.safetensors"
    sd = dict(safetensors_torch.load_file(str(path)))
    change(sd)
    safetensors_torch.save_file(sd, str(path), metadata={"format": "pt"})


def test_multi_token_prediction_layers_are_dropped(tmp_path: Path) -> None:
    """A checkpoint with its MTP layer (``layers.{num_hidden_layers}``): transformers drops it, so does the converter."""
    hf = checks.hf_model(_config(num_mtp_layers=1))
    hf.save_pretrained(tmp_path)

    def add_mtp(sd: dict[str, torch.Tensor]) -> None:
        for name in ("eh_proj.weight", "enorm.weight", "attention.dense.weight", "mlp.gate.weight"):
            sd[f"model.layers.4.{name}"] = torch.ones(3, 3)

    _rewrite_weights(tmp_path, add_mtp)
    x = checks.tokens(9)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


def test_tied_checkpoint_without_head(tmp_path: Path) -> None:
    """``tie_word_embeddings`` and no ``lm_head.weight`` in the checkpoint: the head is the embedding."""
    checks.hf_model(_config(tie_word_embeddings=True)).save_pretrained(tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.pop("lm_head.weight"))
    ours = load_pretrained(tmp_path)
    assert ours.lm_head.weight is ours.tok_emb.weight


def test_config_json_with_keys_left_out(tmp_path: Path) -> None:
    """Layer kinds from ``layer_group_size``, two dense layers (``first_k_dense_replace``'s default;
    Kimi Linear's is 1), the safe gate and its bound, no SwiGLU limits, as transformers reads them."""
    hf = checks.hf_model(_config(first_k_dense_replace=2))
    checks.check_folder_without_keys(hf, tmp_path, ("layer_types", "mlp_layer_types", "first_k_dense_replace",
                                                    "kda_safe_gate", "kda_lower_bound", "expert_swiglu_limit_list",
                                                    "share_expert_swiglu_limit_list"))
    assert "first_k_dense_replace" not in json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "rope_type='dynamic'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("expert_swiglu_limit_list", [0, -1.0, 0, 0], "a negative limit"),
])
def test_unsupported_options_are_named(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.BailingHybridForCausalLM, _config, key, value, named)


def test_limited_swiglu_experts_take_a_limit_alone() -> None:
    """``Experts("limited_swiglu")`` (the routed experts' clip after the activation) needs
    ``swiglu_limit`` and refuses ``swiglu_alpha``; ``LimitedSwiGLU`` a positive limit."""
    assert Experts("limited_swiglu", swiglu_limit=0.5).gated
    with pytest.raises(ValueError, match="limited_swiglu' needs swiglu_limit"):
        Experts("limited_swiglu")
    with pytest.raises(ValueError, match="takes no swiglu_alpha"):
        Experts("limited_swiglu", swiglu_limit=0.5, swiglu_alpha=1.702)
    with pytest.raises(ValueError, match="limit must be a number > 0"):
        LimitedSwiGLU(8, 16, 0.0)
