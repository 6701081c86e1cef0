"""The second batch of sparse-MoE decoders through ``from_hf`` (``families/sparse_moe.py``):
dots.llm1, ERNIE-4.5-MoE, Hunyuan-MoE (A13B), EXAONE-MoE, Solar-Open, AFMoE and HY-V3. Their
options: DeepSeek-V3 routing (group-limited sigmoid + correction bias, shared experts, scaling),
ERNIE's biased softmax choice, Hunyuan's q/k norms after RoPE, NoPE full layers, sliding windows
by layer type, AFMoE's sandwich norms and output gate, dense-layer patterns; equal to
transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _dots1(**kw: Any) -> Any:
    """3 layers (the first dense), 8 experts in 2 groups, top-2 of the best group (not
    renormalised), a shared expert, biases on q/k/v/o, per-head QK norms, a window of 6 from layer 1
    on (max_window_layers), routed scaling 1.5."""
    return T.Dots1Config(**{**checks.SMALL, **MOE, "num_hidden_layers": 3, "n_routed_experts": 8, "n_shared_experts": 1,
                            "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "sliding_window": 6,
                            "max_window_layers": 1, "attention_bias": True, "routed_scaling_factor": 1.5, **kw})


def _dots1_other(**kw: Any) -> Any:
    """Every layer sparse, no window, renormalised top-3, 2 shared experts, head_dim 24, no biases,
    tied embeddings."""
    return _dots1(**{"first_k_dense_replace": 0, "sliding_window": None, "norm_topk_prob": True, "n_group": 1,
                     "num_experts_per_tok": 3, "n_shared_experts": 2, "head_dim": 24, "attention_bias": False,
                     "tie_word_embeddings": True, **kw})


def _ernie(**kw: Any) -> Any:
    """3 layers (the first dense: moe_layer_start_index 1), 6 experts top-2 chosen by softmax +
    correction bias, a shared expert, interleaved RoPE, tied embeddings (the default)."""
    return T.Ernie4_5_MoeConfig(**{**checks.SMALL, "num_hidden_layers": 3, "moe_num_experts": 6, "moe_k": 2,
                                   "moe_intermediate_size": 32, "moe_num_shared_experts": 1, **kw})


def _ernie_other(**kw: Any) -> Any:
    """4 layers, MoE on layers 1 and 3 (moe_layer_interval 2, from 0 to 3), no shared expert,
    top-3, head_dim 24, untied, theta 1e4."""
    return _ernie(**{"num_hidden_layers": 4, "moe_layer_interval": 2, "moe_layer_start_index": 0,
                     "moe_layer_end_index": 3, "moe_num_shared_experts": 0, "moe_k": 3, "head_dim": 24,
                     "tie_word_embeddings": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


def _hunyuan(**kw: Any) -> Any:
    """2 layers, 4 experts top-2 (renormalised) plus the shared MLP, q/k norms after RoPE."""
    return T.HunYuanMoEV1Config(**{**checks.SMALL, "num_hidden_layers": 2, "num_experts": 4, "moe_topk": 2,
                                   "head_dim": 16, **kw})


def _hunyuan_other(**kw: Any) -> Any:
    """Biases on q/k/v/o, head_dim 24, top-1 of 3, tied embeddings, Hunyuan's NTK ``alpha`` RoPE."""
    return _hunyuan(**{"attention_bias": True, "head_dim": 24, "num_experts": 3, "moe_topk": 1,
                       "tie_word_embeddings": True,
                       "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "alpha": 50.0,
                                           "rope_theta": 10000.0}, **kw})


def test_hunyuan_top_k_per_layer() -> None:
    """Hunyuan's ``moe_topk`` as one int per layer: each layer routes to its own number of experts."""
    from attnzoo.interop import from_hf

    hf = checks.hf_model(_hunyuan(moe_topk=[3, 1]))
    ours = from_hf(hf)
    assert [b.ffn.top_k for b in ours.blocks] == [3, 1]
    x = checks.tokens(16)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def _exaone(**kw: Any) -> Any:
    """4 layers: sliding (window 6, RoPE) and full (NoPE) alternating (sliding_window_pattern 2), the
    first dense, 8 experts in 2 groups top-2, a shared expert, routed scaling 2.5, QK norms."""
    return T.ExaoneMoeConfig(**{**checks.SMALL, **MOE, "num_hidden_layers": 4, "num_experts": 8, "n_group": 2,
                                "sliding_window": 6, "sliding_window_pattern": 2, **kw})


def _exaone_other(**kw: Any) -> Any:
    """Explicit layer_types (two sliding, then full NoPE), mlp_layer_types sparse/dense/sparse, not
    renormalised, 2 shared experts, head_dim 24."""
    return _exaone(**{"num_hidden_layers": 3, "mlp_layer_types": ["sparse", "dense", "sparse"],
                      "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                      "norm_topk_prob": False, "num_shared_experts": 2, "n_group": 1, "head_dim": 24, **kw})


def _solar(**kw: Any) -> Any:
    """2 layers, both sparse, 6 experts top-2, a shared expert, q/k/v biases (o_proj none),
    head_dim 16."""
    return T.SolarOpenConfig(**{**checks.SMALL, **MOE, "num_hidden_layers": 2, "n_routed_experts": 6, "head_dim": 16,
                                "attention_bias": True, **kw})


def _solar_other(**kw: Any) -> Any:
    """8 experts in 2 groups, not renormalised, routed scaling 2, 2 shared experts, no biases, tied."""
    return _solar(**{"n_routed_experts": 8, "n_group": 2, "topk_group": 1, "norm_topk_prob": False,
                     "routed_scaling_factor": 2.0, "n_shared_experts": 2, "attention_bias": False,
                     "tie_word_embeddings": True, **kw})


def _afmoe(**kw: Any) -> Any:
    """4 layers (the first dense): sliding (window 6, RoPE) and full (NoPE) alternating, sandwich
    norms, the element-wise output gate, 6 experts top-2 by sigmoid + bias, route_scale 1.7,
    2 shared experts, muP embedding scale."""
    return T.AfmoeConfig(**{**checks.SMALL, **MOE, "num_hidden_layers": 4, "num_experts": 6, "head_dim": 16,
                            "sliding_window": 6, "global_attn_every_n_layers": 2, "route_scale": 1.7,
                            "mup_enabled": True, **kw})


def _afmoe_other(**kw: Any) -> Any:
    """Every layer sparse, explicit layer_types, biases on q/k/v/o, one shared expert, no muP,
    top-3."""
    return _afmoe(**{"num_hidden_layers": 3, "num_dense_layers": 0, "mup_enabled": False, "attention_bias": True,
                     "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                     "num_shared_experts": 1, "num_experts_per_tok": 3, **kw})


def _hy3(**kw: Any) -> Any:
    """3 layers (the first dense), 6 experts top-2 by sigmoid + bias (scaling 2.826), a shared
    expert, biases on q/k/v/o and on the MLPs (mlp_bias), QK norms."""
    return T.HYV3Config(**{**checks.SMALL, **MOE, "num_hidden_layers": 3, "num_experts": 6, "head_dim": 16,
                           "mlp_bias": True, "attention_bias": True, **kw})


def _hy3_other(**kw: Any) -> Any:
    """mlp_layer_types sparse/dense/sparse, 2 shared experts, no biases, head_dim 24, tied."""
    return _hy3(**{"mlp_layer_types": ["sparse", "dense", "sparse"], "num_shared_experts": 2, "mlp_bias": False,
                   "attention_bias": False, "head_dim": 24, "tie_word_embeddings": True, **kw})


class TestDots1(checks.FamilyChecks):
    config = staticmethod(_dots1)
    cases = (_dots1_other,)


class TestErnie45Moe(checks.FamilyChecks):
    config = staticmethod(_ernie)
    cases = (_ernie_other,)


def _mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions ``generate`` gives a left-padded batch: counted from each row's first token."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


class TestHunyuanMoe(checks.FamilyChecks):
    """Hunyuan's q/k norms act after RoPE, so its logits depend on the absolute positions: on a
    left-padded batch transformers' forward without ``position_ids`` counts the pads, attnzoo (and
    transformers' ``generate``) count from each row's first token; compared at those positions."""

    config = staticmethod(_hunyuan)
    cases = (_hunyuan_other,)

    def test_logits_equal_transformers(self) -> None:
        from attnzoo.interop import from_hf

        for make in (self.config, *self.cases):
            hf = checks.hf_model(make())
            x, mask = checks.padded(24)
            with torch.no_grad():
                ref = hf(input_ids=x, attention_mask=mask, position_ids=_mask_positions(mask)).logits
                got = from_hf(hf)(x, attention_mask=mask.bool())
            assert checks.rel(got[mask.bool()], ref[mask.bool()]) <= checks.TOL

    def test_base_model_equals_transformers(self) -> None:
        from attnzoo.interop import from_hf

        for make in (self.config, *self.cases):
            hf = checks.hf_model(make(), T.AutoModel)
            x, mask = checks.padded(16, pad=3)
            with torch.no_grad():
                ref = hf(input_ids=x, attention_mask=mask, position_ids=_mask_positions(mask)).last_hidden_state
                got = from_hf(hf)(x, attention_mask=mask.bool())
            assert checks.rel(got[mask.bool()], ref[mask.bool()]) <= checks.TOL


class TestExaoneMoe(checks.FamilyChecks):
    config = staticmethod(_exaone)
    cases = (_exaone_other,)


class TestSolarOpen(checks.FamilyChecks):
    config = staticmethod(_solar)
    cases = (_solar_other,)


class TestAfmoe(checks.FamilyChecks):
    config = staticmethod(_afmoe)
    cases = (_afmoe_other,)


class TestHYV3(checks.FamilyChecks):
    config = staticmethod(_hy3)
    cases = (_hy3_other,)


def test_structure() -> None:
    from attnzoo.blocks import FeedForward
    from attnzoo.interop import from_hf
    from attnzoo.models.families.sparse_moe import Float32RouterMoE, PostRopeNormAttention
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_afmoe())
    ours = from_hf(hf)
    buffers = sum(b.numel() for n, b in ours.named_buffers() if n.endswith("score_bias"))  # HF: expert_bias parameters
    assert buffers == 3 * 6
    assert sum(p.numel() for p in ours.parameters()) + buffers == sum(p.numel() for p in hf.parameters())
    assert [type(b.ffn) for b in ours.blocks] == [FeedForward] + [MixtureOfExperts] * 3
    assert [b.attn.window for b in ours.blocks] == [(5, 5), None, (5, 5), None]
    assert [b.attn.rope is not None for b in ours.blocks] == [True, False, True, False]
    moe = ours.blocks[1].ffn
    assert (moe.routing, moe.routed_scaling, moe.num_experts, moe.top_k) == ("sigmoid_topk", 1.7, 6, 2)
    assert all(b.attn_out_norm is not None and b.ffn_out_norm is not None for b in ours.blocks)
    exaone = from_hf(checks.hf_model(_exaone()))
    assert [b.attn.rope is not None for b in exaone.blocks] == [True, False, True, False]
    assert [b.attn.window for b in exaone.blocks] == [(5, 5), None, (5, 5), None]
    ernie = from_hf(checks.hf_model(_ernie_other()))
    assert [type(b.ffn) for b in ernie.blocks] == [FeedForward, Float32RouterMoE] * 2
    assert ernie.blocks[1].ffn.shared_expert is None and ernie.blocks[0].attn.rope.interleaved
    hunyuan = from_hf(checks.hf_model(_hunyuan()))
    assert all(isinstance(b.attn, PostRopeNormAttention) and b.ffn.score_bias is None for b in hunyuan.blocks)
    dots = from_hf(checks.hf_model(_dots1()))
    assert [b.attn.window for b in dots.blocks] == [None, (5, 5), (5, 5)]


@pytest.mark.parametrize(("make", "keys"), [
    (lambda: _dots1(n_group=1, first_k_dense_replace=0, attention_bias=False, routed_scaling_factor=1.0),
     ("first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "attention_bias",
      "routed_scaling_factor", "hidden_act", "rms_norm_eps")),
    (lambda: _ernie(num_key_value_heads=4, moe_num_shared_experts=2),
     ("num_key_value_heads", "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
      "moe_layer_interval", "moe_norm_min", "use_bias", "tie_word_embeddings", "rope_parameters", "rms_norm_eps")),
    (lambda: _hunyuan(num_key_value_heads=4),
     ("num_key_value_heads", "attention_bias", "rms_norm_eps", "hidden_act", "tie_word_embeddings")),
    (lambda: _exaone(n_group=1, routed_scaling_factor=2.5),
     ("n_group", "topk_group", "num_shared_experts", "norm_topk_prob", "routed_scaling_factor",
      "mlp_layer_types", "first_k_dense_replace", "rms_norm_eps")),
    (lambda: _solar(num_key_value_heads=8, num_attention_heads=8, attention_bias=False, head_dim=128),
     ("num_key_value_heads", "head_dim", "attention_bias", "n_shared_experts", "n_group", "topk_group",
      "norm_topk_prob", "routed_scaling_factor", "rope_parameters", "rms_norm_eps")),
    (lambda: _afmoe(mup_enabled=False, route_scale=1.0),
     ("mup_enabled", "route_scale", "num_dense_layers", "num_shared_experts", "attention_bias", "rms_norm_eps")),
    (lambda: _hy3(num_key_value_heads=8, num_attention_heads=8, mlp_bias=False, attention_bias=False,
                  head_dim=128, router_scaling_factor=2.826),
     ("num_key_value_heads", "head_dim", "mlp_bias", "attention_bias", "router_scaling_factor", "num_shared_experts",
      "mlp_layer_types", "rope_parameters", "rms_norm_eps")),
    (_dots1, ("layer_types",)),
    (_exaone, ("layer_types",)),
    (_afmoe, ("layer_types",)),
], ids=["dots1", "ernie4_5_moe", "hunyuan_v1_moe", "exaone_moe", "solar_open", "afmoe", "hy_v3", "dots1_layer_types",
        "exaone_moe_layer_types", "afmoe_layer_types"])
def test_config_json_without_defaults_loads(make: Any, keys: tuple[str, ...], tmp_path: Path) -> None:
    """A ``config.json`` leaving these keys out: read as transformers' ``from_pretrained`` reads it
    (without ``layer_types``: each family's own rule of sliding and full layers)."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.Ernie4_5_MoeForCausalLM, _ernie, "use_bias", True, "use_bias"),
    (T.Ernie4_5_MoeForCausalLM, _ernie, "hidden_act", "gelu", "hidden_act"),
    (T.HYV3ForCausalLM, _hy3, "mlp_layer_types", ["dense", "moe", "sparse"], "mlp_layer_types"),
    (T.Dots1ForCausalLM, _dots1, "hidden_act", "gelu", "hidden_act"),
], ids=["ernie_use_bias", "ernie_activation", "hy_v3_layer_type", "dots1_activation"])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Any, key: str, value: Any,
                                                  named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


def test_hunyuan_experts_per_layer_are_refused(tmp_path: Path) -> None:
    """The original Hunyuan code's per-layer ``num_experts`` list (transformers' config takes one int):
    refused by name from a ``config.json``."""
    import json

    from attnzoo.interop import UnsupportedConfigError, load_pretrained

    checks.hf_model(_hunyuan()).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_experts": [4, 4]}))
    with pytest.raises(UnsupportedConfigError, match="num_experts"):
        load_pretrained(tmp_path)


def test_exaone_string_window_pattern_is_refused() -> None:
    """EXAONE-MoE's ``sliding_window_pattern`` as a string ("LLLG") without ``layer_types``: refused
    (transformers' own post-processing cannot read it either)."""
    from attnzoo.interop import UnsupportedConfigError, from_hf

    hf = T.ExaoneMoeForCausalLM(_exaone())
    hf.config.layer_types, hf.config.sliding_window_pattern = None, "LG"
    with pytest.raises(UnsupportedConfigError, match="sliding_window_pattern"):
        from_hf(hf)


@pytest.mark.parametrize("make", [_dots1, _hunyuan, _afmoe], ids=["dots1", "hunyuan_v1_moe", "afmoe"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_exaone, lambda: _hunyuan_other(moe_topk=2)], ids=["exaone_moe", "hunyuan_v1_moe"])
def test_packed_training_gradients_equal_each_alone(make: Any) -> None:
    """(Top-2: a top-1 router renormalised to 1 has no gradient, only float noise to compare.)"""
    checks.check_packed_gradients_equal_each_alone(make)


def test_ernie_multi_token_prediction_weights_are_dropped(tmp_path: Path) -> None:
    """ERNIE-4.5's checkpoints hold an ``mtp`` layer after the model: not part of the causal LM,
    ignored (any other unexpected key still fails the load)."""
    from safetensors.torch import load_file, save_file

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_ernie())
    hf.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["model.mtp_block.0.input_layernorm.weight"] = torch.ones(64)
    save_file(sd, str(tmp_path / "model.safetensors"))
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL
    sd["model.stray.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match="stray"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("make", [_exaone, _hunyuan], ids=["exaone_moe", "hunyuan_v1_moe"])
def test_transformers_through_register(make: Any) -> None:
    """transformers' own model with ``attn_implementation="attnzoo"`` (``attnzoo.hf.register()``):
    the eager logits on a left-padded batch, and packed input (``cu_seq_lens``) == each alone."""
    import attnzoo.hf as azhf

    azhf.register()
    hf = checks.hf_model(make())
    x, mask = checks.padded(20)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask).logits
        hf.set_attn_implementation("attnzoo")
        ours = hf(input_ids=x, attention_mask=mask).logits
    assert checks.rel(ours[mask.bool()], ref[mask.bool()]) <= checks.TOL
    checks.check_transformers_packed(hf)
