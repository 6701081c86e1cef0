"""The sparse-MoE decoders of the LLaMA line through ``from_hf`` (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE): GQA + RoPE layers whose feed-forward is a top-k softmax mixture of SwiGLU experts (a
sigmoid-gated shared expert, dense layers by ``mlp_only_layers`` / ``decoder_sparse_step``, sliding
windows, QK norms per family); equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = {"num_hidden_layers": 3, "num_experts_per_tok": 2}


def _mixtral(**kw: Any) -> Any:
    """3 layers, 4 experts top-2 (renormalised), no window."""
    return T.MixtralConfig(**{**checks.SMALL, **MOE, "num_local_experts": 4, **kw})


def _mixtral_other(**kw: Any) -> Any:
    """A window of 6 on every layer, head_dim 24, 3 experts top-1, tied embeddings."""
    return _mixtral(**{"sliding_window": 6, "head_dim": 24, "num_local_experts": 3, "num_experts_per_tok": 1,
                       "tie_word_embeddings": True, "rms_norm_eps": 1e-3, **kw})


def _qwen2(**kw: Any) -> Any:
    """4 layers, 4 experts top-2 (not renormalised), a shared expert of 40, q/k/v biases."""
    return T.Qwen2MoeConfig(**{**checks.SMALL, **MOE, "num_hidden_layers": 4, "num_experts": 4,
                               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 40, **kw})


def _qwen2_other(**kw: Any) -> Any:
    """Sliding layers by transformers' rule (even layers below max_window_layers=3), window 6, every
    second layer sparse and layer 1 dense by mlp_only_layers (so layers 0, 1, 2 dense, 3 sparse),
    renormalised top-3 of 5, no q/k/v biases."""
    return _qwen2(**{"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 3,
                     "decoder_sparse_step": 2, "mlp_only_layers": [1], "num_experts": 5, "num_experts_per_tok": 3,
                     "norm_topk_prob": True, "qkv_bias": False, **kw})


def _qwen3(**kw: Any) -> Any:
    """3 layers, per-head QK norms, 4 experts top-2 renormalised."""
    return T.Qwen3MoeConfig(**{**checks.SMALL, **MOE, "num_experts": 4, "moe_intermediate_size": 32,
                               "norm_topk_prob": True, **kw})


def _qwen3_other(**kw: Any) -> Any:
    """One window of 6 on every layer, head_dim 24, attention biases, layer 0 dense, not
    renormalised, tied embeddings."""
    return _qwen3(**{"use_sliding_window": True, "sliding_window": 6, "head_dim": 24, "attention_bias": True,
                     "mlp_only_layers": [0], "norm_topk_prob": False, "tie_word_embeddings": True, **kw})


def _olmoe(**kw: Any) -> Any:
    """3 layers, QK norms over all heads, 4 experts top-2 (not renormalised)."""
    return T.OlmoeConfig(**{**checks.SMALL, **MOE, "num_experts": 4, **kw})


def _olmoe_other(**kw: Any) -> Any:
    """Renormalised top-3 of 5, attention biases, 4 key/value heads (= query heads)."""
    return _olmoe(**{"num_experts": 5, "num_experts_per_tok": 3, "norm_topk_prob": True, "attention_bias": True,
                     "num_key_value_heads": 4, **kw})


def _glm(**kw: Any) -> Any:
    """4 layers (the first dense), 8 experts in 2 groups, top-2 of the best group, a shared expert,
    q/k/v biases, rotary on half of each head (the default), routed scaling 1.5."""
    return T.Glm4MoeConfig(**{**checks.SMALL, "num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "attention_bias": True,
                              "routed_scaling_factor": 1.5, **kw})


def _glm_other(**kw: Any) -> Any:
    """Per-head QK norms, two dense layers, not renormalised, no biases, 2 shared experts, rotary on
    a quarter of each head, head_dim 24."""
    return _glm(**{"use_qk_norm": True, "first_k_dense_replace": 2, "norm_topk_prob": False, "attention_bias": False,
                   "n_shared_experts": 2, "n_group": 1, "num_experts_per_tok": 3, "head_dim": 24,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                   **kw})


def _m2(**kw: Any) -> Any:
    """3 layers, QK norms over all heads, 6 experts top-2 by sigmoid + bias, rotary on 8 of 16."""
    return T.MiniMaxM2Config(**{**checks.SMALL, "num_hidden_layers": 3, "num_local_experts": 6,
                                "num_experts_per_tok": 2, "head_dim": 16, "rotary_dim": 8, **kw})


def _m2_other(**kw: Any) -> Any:
    """Full rotary, top-3, tied embeddings, head_dim 24."""
    return _m2(**{"rotary_dim": 24, "head_dim": 24, "num_experts_per_tok": 3, "tie_word_embeddings": True, **kw})


class TestGlm4Moe(checks.FamilyChecks):
    config = staticmethod(_glm)
    cases = (_glm_other,)


class TestMiniMaxM2(checks.FamilyChecks):
    config = staticmethod(_m2)
    cases = (_m2_other,)


class TestMixtral(checks.FamilyChecks):
    config = staticmethod(_mixtral)
    cases = (_mixtral_other,)


class TestQwen2Moe(checks.FamilyChecks):
    config = staticmethod(_qwen2)
    cases = (_qwen2_other,)


class TestQwen3Moe(checks.FamilyChecks):
    config = staticmethod(_qwen3)
    cases = (_qwen3_other,)


class TestOlmoe(checks.FamilyChecks):
    config = staticmethod(_olmoe)
    cases = (_olmoe_other,)


def test_structure() -> None:
    from attnzoo.blocks import FeedForward
    from attnzoo.interop import from_hf
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_qwen2_other())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    biased = checks.hf_model(_qwen2())  # q/k/v biases: the output projection gets a zero bias of C
    assert sum(p.numel() for p in from_hf(biased).parameters()) == sum(p.numel() for p in biased.parameters()) + 4 * 64
    assert [type(b.ffn) for b in ours.blocks] == [FeedForward] * 3 + [MixtureOfExperts]
    assert [b.attn.window for b in ours.blocks] == [(5, 5), None, (5, 5), None]
    moe = ours.blocks[3].ffn
    assert (moe.num_experts, moe.top_k, moe.routing, moe.norm_topk_prob) == (5, 3, "softmax_topk", True)
    assert moe.shared_expert is not None and moe.shared_gate is not None
    mixtral = from_hf(checks.hf_model(_mixtral_other()))
    assert all(b.attn.window == (5, 5) for b in mixtral.blocks) and mixtral.tie_embeddings
    assert all(b.ffn.norm_topk_prob and b.ffn.shared_expert is None for b in mixtral.blocks)


def test_saved_mistral_names_load(tmp_path: Path) -> None:
    """A Mixtral folder in Mistral's own names (``block_sparse_moe``, experts ``w1``/``w3``/``w2``)."""
    from safetensors.torch import save_file

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_mixtral())
    hf.config.save_pretrained(tmp_path)
    sd = {}
    for key, t in hf.state_dict().items():
        if ".mlp.experts.gate_up_proj" in key:
            base = key.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts.")
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                sd[f"{base}{e}.w1.weight"], sd[f"{base}{e}.w3.weight"] = gate.contiguous(), up.contiguous()
        elif ".mlp.experts.down_proj" in key:
            base = key.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts.")
            sd.update({f"{base}{e}.w2.weight": w.contiguous() for e, w in enumerate(t)})
        else:
            sd[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t.contiguous()
    save_file(sd, str(tmp_path / "model.safetensors"))
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("make", "keys"), [
    (lambda: _mixtral(num_attention_heads=8, num_key_value_heads=8, num_local_experts=8),
     ("num_local_experts", "num_experts_per_tok", "sliding_window", "hidden_act", "rms_norm_eps", "rope_parameters",
      "rope_theta", "tie_word_embeddings", "router_jitter_noise")),
    (lambda: _qwen2(num_attention_heads=16, num_key_value_heads=16, max_window_layers=28),
     ("qkv_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "decoder_sparse_step",
      "mlp_only_layers", "norm_topk_prob", "hidden_act", "rope_parameters", "rope_theta")),
    (lambda: _qwen3(norm_topk_prob=False),
     ("use_sliding_window", "sliding_window", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
      "attention_bias", "hidden_act", "rope_parameters", "rope_theta")),
    (lambda: _olmoe(num_attention_heads=4, num_key_value_heads=4),
     ("num_key_value_heads", "clip_qkv", "norm_topk_prob", "attention_bias", "hidden_act", "rope_parameters",
      "rope_theta")),
    (_qwen2_other, ("layer_types",)),
    (lambda: _glm(num_key_value_heads=8, num_attention_heads=8, n_group=1, routed_scaling_factor=1.0,
                  attention_bias=False),
     ("num_key_value_heads", "attention_bias", "use_qk_norm", "first_k_dense_replace", "n_shared_experts", "n_group",
      "topk_group", "routed_scaling_factor", "norm_topk_prob", "hidden_act", "rms_norm_eps")),
    (lambda: _m2(num_key_value_heads=8, num_attention_heads=8, head_dim=128, hidden_size=64),
     ("num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act")),
], ids=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "qwen2_moe_layer_types", "glm4_moe", "minimax_m2"])
def test_config_json_without_defaults_loads(make: Any, keys: tuple[str, ...], tmp_path: Path) -> None:
    """A ``config.json`` leaving these keys out: read as transformers' ``from_pretrained`` reads it."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.MixtralForCausalLM, _mixtral, "router_jitter_noise", 0.1, "router_jitter_noise"),
    (T.MixtralForCausalLM, _mixtral, "hidden_act", "gelu", "hidden_act"),
    (T.OlmoeForCausalLM, _olmoe, "clip_qkv", 8.0, "clip_qkv"),
    (T.Qwen3MoeForCausalLM, _qwen3, "decoder_sparse_step", 0, "decoder_sparse_step"),
], ids=["jitter", "activation", "clip_qkv", "sparse_step"])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Any, key: str, value: Any,
                                                  named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


@pytest.mark.parametrize("make", [_mixtral_other, _qwen2_other], ids=["mixtral", "qwen2_moe"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_qwen3, _glm], ids=["qwen3_moe", "glm4_moe"])
def test_packed_training_gradients_equal_each_alone(make: Any) -> None:
    checks.check_packed_gradients_equal_each_alone(make)


def test_multi_token_prediction_layers_are_dropped(tmp_path: Path) -> None:
    """GLM-4.5's checkpoints hold ``num_nextn_predict_layers`` extra layers after the last one: not
    part of the causal LM, ignored (any other unexpected key still fails the load)."""
    from safetensors.torch import load_file, save_file

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_glm())
    hf.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd.update({k.replace("layers.3.", "layers.4."): v.clone() for k, v in sd.items() if ".layers.3." in k})
    save_file(sd, str(tmp_path / "model.safetensors"))
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL
    sd["model.stray.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match="stray"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("make", [_mixtral_other, _qwen2_other, _qwen3_other, _olmoe_other, _glm_other, _m2],
                         ids=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2"])
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


def test_every_variant_is_dispatched() -> None:
    """A family of the builder is a ``Variant`` row (its name and classes included); ``convert.py``
    dispatches every one of them through ``DISPATCH``, with no line of its own."""
    from attnzoo.interop import SUPPORTED_ARCHITECTURES
    from attnzoo.models.families.sparse_moe import DISPATCH, VARIANTS
    from attnzoo.models.hf.convert import BUILDERS

    assert set(DISPATCH) == set(VARIANTS)
    assert all(BUILDERS[t] == (d.name, d.convert) for t, d in DISPATCH.items())
    assert all(c in SUPPORTED_ARCHITECTURES for d in DISPATCH.values() for c in d.classes)
