"""Gemma 4 text (``Gemma4ForCausalLM`` / ``Gemma4TextModel``) through ``from_hf``: sliding / full
layers with their own head widths and RoPE (default / proportional), scale-1 attention with q/k/v
RMSNorms, per-layer embeddings (PLE) handed to each layer by the layer loop, the layer scalar, KV
sharing across layers (with the double-wide MLP), keys as values (``attention_k_eq_v``), the MLP +
routed-experts MoE block; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.gemma4 import (  # noqa: E402
    Gemma4Attention,
    Gemma4Block,
    Gemma4Embedding,
    Gemma4LM,
    Gemma4MoE,
    SharedKVCounter,
    canonical,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

S, F = "sliding_attention", "full_attention"
ROPES = {S: {"rope_type": "default", "rope_theta": 500.0},
         F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 20000.0}}
#: 7 layers whose last 3 (full, sliding, full) reuse the keys of layers 3 (sliding) and 1 (full)
SHARED_KINDS = [S, F, S, S, F, S, F]


def _config(**kw: Any) -> Any:
    """6 layers (5 sliding : 1 full, the default pattern), window 6 (< the 30 tokens tested), head
    width 16 on sliding layers and 32 on the full one (``global_head_dim``), PLE of width 8, RoPE
    bases 500 (default) and 2e4 (proportional, a quarter of the pairs turn), untied head."""
    base = dict(num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=6, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=checks.V, rope_parameters={k: dict(v) for k, v in ROPES.items()},
                tie_word_embeddings=False)
    return T.Gemma4TextConfig(**{**checks.SMALL, **base, **kw})


def _shared(**kw: Any) -> Any:
    """KV sharing over the last 3 of 7 layers with their double-wide MLPs (64 -> 128: at 96 -> 192
    the random model's logits of a left-padded row already move by 3e-5 in transformers itself), the
    final-logit softcap, tied embeddings."""
    return _config(**{"num_hidden_layers": 7, "layer_types": SHARED_KINDS, "num_kv_shared_layers": 3,
                      "use_double_wide_mlp": True, "intermediate_size": 64, "final_logit_softcapping": 5.0,
                      "tie_word_embeddings": True, **kw})


def _k_eq_v(**kw: Any) -> Any:
    """Keys as values on the full layers (one global KV head), q/k/v/o biases,
    ``use_bidirectional_attention="vision"`` (causal for text), sliding / full alternating."""
    return _config(**{"attention_k_eq_v": True, "num_global_key_value_heads": 1, "attention_bias": True,
                      "num_hidden_layers": 4, "layer_types": [S, F, S, F], "use_bidirectional_attention": "vision",
                      **kw})


def _moe(**kw: Any) -> Any:
    """The MoE block on every layer (4 experts top-2, width 24) beside the MLP, no PLE, eps 1e-5."""
    return _config(**{"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24,
                      "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-5, "num_hidden_layers": 3,
                      "layer_types": [S, F, F], **kw})


def _everything(**kw: Any) -> Any:
    """Every option at once: KV sharing with double-wide MLPs, keys as values on the full layers,
    the MoE block, PLE, both softcap and tied embeddings off."""
    return _shared(**{"attention_k_eq_v": True, "num_global_key_value_heads": 1, "enable_moe_block": True,
                      "num_experts": 3, "top_k_experts": 2, "moe_intermediate_size": 16,
                      "final_logit_softcapping": None, "tie_word_embeddings": False, **kw})


CASES = {"plain": _config, "shared": _shared, "k_eq_v": _k_eq_v, "moe": _moe, "everything": _everything}


class TestGemma4(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_k_eq_v, _moe, _everything, _shared)


@pytest.mark.parametrize("case", ["plain", "k_eq_v", "moe", "everything"])
def test_cached_decode_of_every_case(case: str) -> None:
    checks.check_cached_decode(CASES[case])


def test_greedy_generation_with_shared_keys() -> None:
    checks.check_generation(_shared)


def test_structure() -> None:
    hf = checks.hf_model(_shared())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(isinstance(b, Gemma4Block) for b in ours.blocks)
    attn = [b.attn for b in ours.blocks]
    assert all(isinstance(a, Gemma4Attention) and a.scale == 1.0 for a in attn)
    assert [a.window for a in attn] == [(5, 5) if k == S else None for k in SHARED_KINDS]  # causal: left 5
    assert [a.head_dim for a in attn] == [16 if k == S else 32 for k in SHARED_KINDS]
    assert [a.sharing.role if a.sharing else None for a in attn] == [None, "store", None, "store", "reuse", "reuse",
                                                                     "reuse"]
    assert attn[4].qkv_proj.weight.shape == (4 * 32, 64) and attn[4].frontier.k_norm_weight is None
    assert [b.ffn.up_proj.weight.shape[0] for b in ours.blocks] == [64] * 4 + [128] * 3
    assert isinstance(ours.init_cache(1, 8)[5], SharedKVCounter)
    assert isinstance(ours, Gemma4LM) and isinstance(ours.tok_emb, Gemma4Embedding) and ours.tie_embeddings
    ple = ours.per_layer(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 64))
    assert ple.shape == (1, 3, 7, 8) and all(b.per_layer is not None for b in ours.blocks)
    assert {type(a.rope).__name__ for a in attn} == {"RotaryEmbedding", "ProportionalRotaryEmbedding"}
    assert attn[1].rope.turning == 4  # int(0.25 * 32 // 2) of the 16 pairs turn
    keqv = from_hf(checks.hf_model(_k_eq_v())).blocks[1].attn
    assert keqv.k_eq_v and keqv.num_kv_heads == 1 and keqv.qkv_proj.weight.shape == ((4 + 1) * 32, 64)
    moe = from_hf(checks.hf_model(_moe()))
    assert moe.per_layer is None and all(b.per_layer is None for b in moe.blocks)
    assert isinstance(moe.blocks[0].ffn, Gemma4MoE) and isinstance(moe.blocks[0].ffn_norm, torch.nn.Identity)


def test_layer_scalar_is_loaded() -> None:
    """``layer_scalar`` (a buffer, 1 at init) scales each layer's whole output."""
    hf = checks.hf_model(_shared())
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.2 * i)
    ours = from_hf(hf)
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL
    assert float(ours.blocks[3].layer_scalar) == pytest.approx(1.1)


@pytest.mark.parametrize("case", ["shared", "everything"])
def test_packed_sequences_equal_each_alone(case: str) -> None:
    checks.check_packed_equals_each_alone(CASES[case])
    checks.check_packed_gradients_equal_each_alone(CASES[case])


def test_packed_training_with_attention_dropout_is_refused_where_keys_are_shared() -> None:
    """The fused packed attention has no dropout; a layer that shares keys cannot fall back to one
    sequence at a time (its readers take the whole row's keys), so it raises instead."""
    ours = from_hf(checks.hf_model(_shared(attention_dropout=0.1))).train()
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="sharing keys across layers"):
        ours(checks.tokens(9, batch=1), cu_seqlens=cu)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` without the keys at their defaults: the layer pattern, the rope
    parameters, ``per_layer_config`` (rebuilt from ``global_head_dim``'s default 512), the
    activation, the norms' epsilon, the feature switches."""
    make = lambda: _config(global_head_dim=512, rope_parameters=None, layer_types=None)  # noqa: E731
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, (
        "layer_types", "rope_parameters", "per_layer_config", "hidden_activation", "rms_norm_eps",
        "attention_bias", "attention_k_eq_v", "num_kv_shared_layers", "enable_moe_block", "use_double_wide_mlp",
        "final_logit_softcapping", "use_bidirectional_attention", "attention_dropout"))


REFUSED = [
    ("use_bidirectional_attention", "all", r"use_bidirectional_attention='all'"),
    ("num_kv_shared_layers", 6, r"num_kv_shared_layers=6"),
    ("rope_parameters", {S: ROPES[S], F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_type='linear'"),
    ("per_layer_config", {5: {"head_dim": 32, "sliding_window": 4}}, r"per_layer_config\[5\] keys \['sliding_window'\]"),
    ("per_layer_config", {0: {"head_dim": 32}, 5: {"head_dim": 32}}, r"sliding_attention layers different sizes"),
]


@pytest.mark.parametrize(("key", "value", "named"), REFUSED, ids=[f"{k}={v!r}"[:40] for k, v, _ in REFUSED])
def test_unsupported_options_are_named(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Gemma4ForCausalLM, _config, key, value, named)


def test_multimodal_model_converts_as_its_text_decoder() -> None:
    """``Gemma4ForConditionalGeneration`` (``model_type="gemma4"``) converts as its text decoder:
    text-only logits equal the wrapper's (the wrapper cases in ``test_hf_multimodal``)."""
    cfg = T.Gemma4Config(text_config=_config().to_dict(), vision_config=None, audio_config=None)
    torch.manual_seed(0)
    wrapper = checks.perturbed(T.Gemma4ForConditionalGeneration(cfg))
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(from_hf(wrapper)(x), wrapper(input_ids=x).logits) <= 1e-5


def test_last_layer_is_made_full_attention() -> None:
    """As ``Gemma4TextConfig.__post_init__`` does (c. 190-195), a ``layer_types`` ending with a
    sliding layer has its last layer read as full attention."""
    hf = canonical(HFConfig({"num_hidden_layers": 3, "layer_types": [S, S, S]}, "config.json"))
    assert hf.req("layer_types", list) == [S, S, F]
    assert hf.req("per_layer_config", dict) == {2: {"head_dim": 512}}
