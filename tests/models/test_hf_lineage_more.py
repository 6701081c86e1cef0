"""More families on the lineage builders through ``from_hf``: Granite 3.x (``dense``: the four
multipliers, q/k/v/o and MLP biases), StarCoder2 (``dense``: biased LayerNorms, an ungated biased
MLP, a window on every layer), GraniteMoE (``sparse_moe``: Granite's multipliers, top-k softmax
experts), PhiMoE (``sparse_moe``: LayerNorms, LM-head bias, the sparsemixer), MiMo-V2-Flash (its own
module: q/k and v head widths apart, sinks and doubled KV heads on sliding layers, per-kind RoPE,
DeepSeek-V3 MoE) and Laguna (its own module: per-layer head counts, softplus output gates, per-kind
partial RoPE, sigmoid-routed MoE with a shared expert); equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import SUPPORTED_ARCHITECTURES, from_hf  # noqa: E402
from attnzoo.models.families import dense, laguna, mimo_v2_flash, sparse_moe  # noqa: E402
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.models.hf.convert import BUILDERS  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- configs
def _granite(**kw: Any) -> Any:
    """2 layers, every multiplier away from 1, untied."""
    return T.GraniteConfig(**{**checks.SMALL, "num_hidden_layers": 2, "embedding_multiplier": 3.0,
                              "attention_multiplier": 0.2, "residual_multiplier": 0.4, "logits_scaling": 2.5, **kw})


def _granite_other() -> Any:
    """q/k/v/o and MLP biases, head_dim 24, tied, one key/value head, llama3-scaled RoPE."""
    return _granite(attention_bias=True, mlp_bias=True, head_dim=24, tie_word_embeddings=True, num_key_value_heads=1,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0,
                                     "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0})


def _starcoder2(**kw: Any) -> Any:
    """2 layers, window 6, biases everywhere (the default), tied, GELU (tanh)."""
    return T.Starcoder2Config(**{**checks.SMALL, "num_hidden_layers": 2, "sliding_window": 6, **kw})


def _starcoder2_other() -> Any:
    """No window, no biases, untied, plain GELU, one key/value head, eps 1e-3, theta 1000."""
    return _starcoder2(sliding_window=None, use_bias=False, tie_word_embeddings=False, hidden_act="gelu",
                       num_key_value_heads=1, norm_epsilon=1e-3,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _granitemoe(**kw: Any) -> Any:
    """2 layers, 4 experts top-2, every multiplier away from 1, untied."""
    return T.GraniteMoeConfig(**{**checks.SMALL, "num_hidden_layers": 2, "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "embedding_multiplier": 2.0, "attention_multiplier": 0.3,
                                 "residual_multiplier": 0.5, "logits_scaling": 4.0, **kw})


def _granitemoe_other() -> Any:
    """q/k/v/o biases, top-1 of 3 experts, head_dim 24, tied."""
    return _granitemoe(attention_bias=True, num_local_experts=3, num_experts_per_tok=1, head_dim=24,
                       tie_word_embeddings=True)


def _phimoe(**kw: Any) -> Any:
    """2 layers, 4 experts, window 6, the sparsemixer's epsilon 0.3 (so that it masks some logits), untied."""
    return T.PhimoeConfig(**{**checks.SMALL, "num_hidden_layers": 2, "num_local_experts": 4, "sliding_window": 6,
                             "router_jitter_noise": 0.3, **kw})


def _phimoe_other() -> Any:
    """q/k/v/o and LM-head biases, no window, head_dim 24, 3 experts, the default epsilon 0.01, eps 1e-3."""
    return _phimoe(attention_bias=True, lm_head_bias=True, sliding_window=None, head_dim=24, num_local_experts=3,
                   router_jitter_noise=0.01, rms_norm_eps=1e-3)


def _mimo(**kw: Any) -> Any:
    """3 layers (full, sliding, sliding; dense, sparse, sparse), head_dim 24 > v_head_dim 16, window 6,
    4 experts top-2 in 2 groups (top 1 group), scaling 1.5, untied."""
    return T.MiMoV2FlashConfig(**{
        **checks.SMALL, "num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 24, "v_head_dim": 16,
        "sliding_window": 6, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5, "attention_value_scale": 0.6,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"], **kw})


def _mimo_other() -> Any:
    """v_head_dim 32 > head_dim 16, q/k/v biases, every layer sparse, sliding first, plain top-k
    without renormalisation, half of each head rotated, tied."""
    return _mimo(head_dim=16, v_head_dim=32, attention_bias=True, mlp_layer_types=["sparse"] * 3, n_group=1,
                 norm_topk_prob=False, routed_scaling_factor=None, tie_word_embeddings=True,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e5,
                                                     "partial_rotary_factor": 0.5},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e3,
                                                        "partial_rotary_factor": 0.5}})


def _laguna(**kw: Any) -> Any:
    """3 layers (full, sliding, full; dense, sparse, sparse), window 6, per-head gates, head counts
    4/2/4, head_dim 16 (the full layers rotate half of it), 4 experts top-2, scaling 1.5, untied."""
    return T.LagunaConfig(**{
        **checks.SMALL, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 6, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "moe_routed_scaling_factor": 1.5, "num_attention_heads_per_layer": [4, 2, 4],
        "layer_types": ["full_attention", "sliding_attention", "full_attention"], **kw})


def _laguna_other() -> Any:
    """Per-element gates, q/k/v/o biases, every layer sparse, head_dim 24, tied, eps 1e-3."""
    return _laguna(gating="per-element", attention_bias=True, mlp_layer_types=["sparse"] * 3, head_dim=24,
                   tie_word_embeddings=True, rms_norm_eps=1e-3, num_attention_heads_per_layer=None,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e5,
                                                       "partial_rotary_factor": 0.25},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e3,
                                                          "partial_rotary_factor": 1.0}})


class TestGranite(checks.FamilyChecks):
    config = staticmethod(_granite)
    cases = (_granite_other,)


class TestStarcoder2(checks.FamilyChecks):
    config = staticmethod(_starcoder2)
    cases = (_starcoder2_other,)


class TestGraniteMoe(checks.FamilyChecks):
    config = staticmethod(_granitemoe)
    cases = (_granitemoe_other,)


class TestPhimoe(checks.FamilyChecks):
    config = staticmethod(_phimoe)
    cases = (_phimoe_other,)


class TestMiMoV2Flash(checks.FamilyChecks):
    config = staticmethod(_mimo)
    cases = (_mimo_other,)


class TestLaguna(checks.FamilyChecks):
    config = staticmethod(_laguna)
    cases = (_laguna_other,)


ALL: dict[str, Callable[[], Any]] = {"laguna": _laguna, "laguna_other": _laguna_other, "mimo": _mimo, "mimo_other": _mimo_other, "phimoe": _phimoe, "phimoe_other": _phimoe_other, "granitemoe": _granitemoe, "granitemoe_other": _granitemoe_other, "granite": _granite, "granite_other": _granite_other, "starcoder2": _starcoder2,
                                     "starcoder2_other": _starcoder2_other}


# --------------------------------------------------------------------------- structure
def test_parameter_counts_equal_transformers() -> None:
    """(MiMo-V2-Flash pads its heads: counted in its structure test.)"""
    for name, make in ALL.items():
        if name.startswith(("mimo", "laguna")):
            continue
        hf = checks.hf_model(make())
        ours = from_hf(hf)
        n_ours, n_hf = (sum(p.numel() for p in m.parameters()) for m in (ours, hf))
        assert n_ours == n_hf, name


def test_granite_structure() -> None:
    ours = from_hf(checks.hf_model(_granite_other()))
    attn = ours.blocks[0].attn
    assert attn.scale == pytest.approx(0.2) and attn.qkv_proj.bias is not None and attn.out_proj.bias is not None
    assert ours.blocks[0].ffn.down_proj.bias is not None and ours.tie_embeddings


def test_granitemoe_structure() -> None:
    ours = from_hf(checks.hf_model(_granitemoe_other()))
    ffn = ours.blocks[1].ffn
    assert isinstance(ffn, MixtureOfExperts) and ffn.shared_expert is None and ffn.top_k == 1
    assert ours.blocks[0].attn.scale == pytest.approx(0.3) and ours.blocks[0].attn.out_proj.bias is not None


def test_phimoe_structure_and_routing() -> None:
    """LayerNorms with biases, the LM-head bias; the sparsemixer's weights and experts are transformers'."""
    hf = checks.hf_model(_phimoe_other())
    ours = from_hf(hf)
    assert isinstance(ours.norm, torch.nn.LayerNorm) and ours.norm.bias is not None and ours.lm_head.bias is not None
    assert isinstance(ours.blocks[0].attn_norm, torch.nn.LayerNorm) and ours.blocks[0].attn.out_proj.bias is not None
    moe = ours.blocks[0].ffn
    assert isinstance(moe, sparse_moe.SparseMixerMoE) and moe.eps == 0.01
    x = torch.randn(50, 64)
    with torch.no_grad():
        _, ref_w, ref_e = hf.model.layers[0].mlp.router(x)
        w, e, _ = moe.route(x)
    torch.testing.assert_close(e, ref_e)
    torch.testing.assert_close(w, ref_w)
    wide = from_hf(checks.hf_model(_phimoe())).blocks[0].ffn
    assert wide.eps == 0.3 and ours.blocks[0].attn.window is None and from_hf(hf).depth == 2


def test_mimo_structure() -> None:
    """Twice the key/value heads, a window and sinks on the sliding layers; heads padded to the wider
    of head_dim / v_head_dim; the sliding_window_size key; the padding's zeros."""
    hf = checks.hf_model(_mimo())
    ours = from_hf(hf)
    full, sliding = ours.blocks[0].attn, ours.blocks[1].attn
    assert (full.num_kv_heads, sliding.num_kv_heads) == (1, 2) and full.head_dim == 24
    assert full.window is None and sliding.window == (5, 5)
    assert full.frontier.sinks is None and sliding.frontier.sinks is not None
    assert full.scale == pytest.approx(24 ** -0.5) and full.rope.rotary_dim == 8
    assert ours.blocks[1].ffn.shared_expert is None and not hasattr(ours.blocks[0].ffn, "router")
    assert float(full.out_proj.weight.detach().view(64, 4, 24)[..., 16:].abs().max()) == 0.0
    n_hf = sum(p.numel() for p in hf.parameters())
    pad = sum(b.attn.num_kv_heads * 8 * 64 + 4 * 8 * 64 for b in ours.blocks)  # zero v rows and o columns
    assert sum(p.numel() for p in ours.parameters()) == n_hf + pad
    assert mimo_v2_flash.canonical(HFConfig({**_mimo().to_dict(), "sliding_window_size": 9}, "t", "M")).req("sliding_window") == 10


def test_laguna_structure() -> None:
    """Per-layer head counts, a window on the sliding layer, softplus gates (per head / per element),
    partial rotary on the full layers, the shared expert; the gate equals transformers'."""
    hf = checks.hf_model(_laguna())
    ours = from_hf(hf)
    assert [b.attn.num_heads for b in ours.blocks] == [4, 2, 4]
    assert [b.attn.window for b in ours.blocks] == [None, (5, 5), None]
    assert [b.attn.rope.rotary_dim for b in ours.blocks] == [8, 16, 8]
    gate = ours.blocks[0].attn.frontier.gate_proj
    assert isinstance(gate, laguna.SoftplusGate) and gate.mode == "head" and ours.blocks[1].ffn.shared_expert is not None
    other = from_hf(checks.hf_model(_laguna_other())).blocks[0].attn
    assert other.frontier.gate_proj.mode == "element" and other.out_proj.bias is not None
    n_hf = sum(p.numel() for p in hf.parameters())  # transformers' choice bias is a parameter, attnzoo's a buffer
    assert sum(p.numel() for p in ours.parameters()) == n_hf - 2 * 4


def test_starcoder2_structure() -> None:
    ours = from_hf(checks.hf_model(_starcoder2(residual_dropout=0.2, embedding_dropout=0.3)))
    block = ours.blocks[0]
    assert block.attn.window == (5, 5) and block.attn.qkv_proj.bias is not None and block.dropout.p == 0.2
    assert isinstance(ours.norm, torch.nn.LayerNorm) and ours.norm.bias is not None and ours.drop.p == 0.3
    assert block.ffn.up_proj.bias is not None and ours.tie_embeddings
    assert from_hf(checks.hf_model(_starcoder2_other())).blocks[0].attn.window is None


# --------------------------------------------------------------------------- packing
@pytest.mark.parametrize("name", ["granite_other", "starcoder2", "granitemoe_other", "phimoe", "mimo", "laguna"])
def test_packed_sequences_equal_each_alone(name: str) -> None:
    checks.check_packed_equals_each_alone(ALL[name])
    checks.check_packed_gradients_equal_each_alone(ALL[name])


@pytest.mark.parametrize("name", ["starcoder2", "phimoe", "mimo", "laguna"])
def test_register_attention_equals_eager(name: str) -> None:
    """The windowed families inside transformers with ``attn_implementation="attnzoo"``: the eager
    logits on a left-padded batch, and packed sequences equal to each alone."""
    hf = checks.hf_model(ALL[name]())
    checks.check_register_equals_eager(hf)
    checks.check_transformers_packed(hf)  # padding-free input (restarting position_ids, cu_seq_lens)


# --------------------------------------------------------------------------- config.json, refusals
FOLDERS = {
    "granite": (lambda: _granite(embedding_multiplier=1.0, attention_multiplier=1.0, residual_multiplier=1.0,
                                 logits_scaling=1.0, rope_parameters=None),
                ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling",
                 "rms_norm_eps", "attention_bias", "mlp_bias", "rope_parameters", "tie_word_embeddings",
                 "hidden_act")),
    "starcoder2": (lambda: _starcoder2(sliding_window=None, norm_epsilon=1e-5, rope_parameters=None),
                   ("norm_epsilon", "hidden_act", "use_bias", "tie_word_embeddings", "sliding_window",
                    "rope_parameters", "residual_dropout", "embedding_dropout")),
    "granitemoe": (lambda: _granitemoe(embedding_multiplier=1.0, attention_multiplier=1.0, residual_multiplier=1.0,
                                       logits_scaling=1.0, num_local_experts=8),
                   ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling",
                    "num_local_experts", "num_experts_per_tok", "rms_norm_eps", "attention_bias",
                    "tie_word_embeddings", "hidden_act")),
    "phimoe": (lambda: _phimoe(router_jitter_noise=0.01, num_local_experts=16, num_key_value_heads=8,
                               num_attention_heads=8, rms_norm_eps=1e-5, sliding_window=None, rope_parameters=None),
               ("router_jitter_noise", "num_local_experts", "num_experts_per_tok", "num_key_value_heads",
                "rms_norm_eps", "attention_bias", "lm_head_bias", "sliding_window", "rope_parameters",
                "tie_word_embeddings", "input_jitter_noise", "hidden_act")),
    "mimo": (lambda: _mimo(head_dim=192, v_head_dim=128, num_attention_heads=8, num_key_value_heads=4, sliding_window=129,
                           attention_value_scale=0.707, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                           num_experts_per_tok=8, n_routed_experts=8, layer_types=None, mlp_layer_types=None,
                           num_hidden_layers=6, rope_parameters=None),
             ("head_dim", "v_head_dim", "sliding_window", "attention_value_scale", "n_group", "topk_group",
              "routed_scaling_factor", "num_experts_per_tok", "layer_types", "mlp_layer_types", "rope_parameters",
              "norm_topk_prob", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "hidden_act",
              "num_key_value_heads")),
    "laguna": (lambda: _laguna(num_key_value_heads=8, num_attention_heads=8, num_attention_heads_per_layer=None,
                               head_dim=128, sliding_window=512, num_experts=8, num_experts_per_tok=8,
                               moe_intermediate_size=16, shared_expert_intermediate_size=16, layer_types=None,
                               mlp_layer_types=None, moe_routed_scaling_factor=1.0, rope_parameters=None),
               ("num_key_value_heads", "head_dim", "sliding_window", "layer_types", "mlp_layer_types",
                "num_attention_heads_per_layer", "moe_routed_scaling_factor", "rope_parameters", "gating",
                "attention_bias", "rms_norm_eps", "tie_word_embeddings", "hidden_act")),
}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_config_json_without_defaults_loads(name: str, tmp_path: Path) -> None:
    """A ``config.json`` that leaves out the config class's defaults: read as transformers reads it."""
    make, keys = FOLDERS[name]
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.GraniteForCausalLM, _granite, "hidden_act", "gelu", "hidden_act"),
    (T.GraniteForCausalLM, _granite, "logits_scaling", 0.0, "logits_scaling"),
    (T.GraniteForCausalLM, _granite, "pretraining_tp", 2, "pretraining_tp"),
    (T.Starcoder2ForCausalLM, _starcoder2, "hidden_act", "tanh", "hidden_act"),
    (T.GraniteMoeForCausalLM, _granitemoe, "hidden_act", "gelu", "hidden_act"),
    (T.GraniteMoeForCausalLM, _granitemoe, "embedding_multiplier", -1.0, "embedding_multiplier"),
    (T.PhimoeForCausalLM, _phimoe, "num_experts_per_tok", 3, "num_experts_per_tok"),
    (T.PhimoeForCausalLM, _phimoe, "input_jitter_noise", 0.1, "input_jitter_noise"),
    (T.PhimoeForCausalLM, _phimoe, "hidden_act", "gelu", "hidden_act"),
    (T.PhimoeForCausalLM, _phimoe, "rope_parameters",
     {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "short_mscale": 1.0, "long_mscale": 1.2, "original_max_position_embeddings": 64}, "rope_type"),
    (T.MiMoV2FlashForCausalLM, _mimo, "hidden_act", "gelu", "hidden_act"),
    (T.MiMoV2FlashForCausalLM, _mimo, "mlp_layer_types", ["dense", "moe", "sparse"], "mlp_layer_types"),
    (T.MiMoV2FlashForCausalLM, _mimo, "rope_parameters",
     {t: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.125}
      for t in ("full_attention", "sliding_attention")}, "partial_rotary_factor"),
    (T.LagunaForCausalLM, _laguna, "moe_router_logit_softcapping", 30.0, "moe_router_logit_softcapping"),
    (T.LagunaForCausalLM, _laguna, "moe_apply_router_weight_on_input", True, "moe_apply_router_weight_on_input"),
    (T.LagunaForCausalLM, _laguna, "gating", "per-group", "gating"),
    (T.LagunaForCausalLM, _laguna, "hidden_act", "gelu", "hidden_act"),
    (T.LagunaForCausalLM, _laguna, "rope_parameters",
     {t: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0625}
      for t in ("full_attention", "sliding_attention")}, "partial_rotary_factor"),
])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Callable[[], Any], key: str, value: Any,
                                                 named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


def test_every_family_is_dispatched() -> None:
    """Each new family reaches ``from_hf`` through its module's ``DISPATCH``."""
    for module, types in ((dense, ("granite", "starcoder2")), (sparse_moe, ("granitemoe", "phimoe")),
                          (mimo_v2_flash, ("mimo_v2_flash",)), (laguna, ("laguna",))):
        for t in types:
            d = module.DISPATCH[t]
            assert BUILDERS[t] == (d.name, d.convert)
            assert all(c in SUPPORTED_ARCHITECTURES for c in d.classes)
