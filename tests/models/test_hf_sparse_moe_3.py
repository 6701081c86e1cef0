"""The third batch of sparse-MoE decoders through ``from_hf`` (``families/sparse_moe.py``): Mellum
(Qwen3-MoE's attention and experts on Laguna's layer: RoPE per layer kind, windows by
``layer_types``, dense layers by ``mlp_layer_types``), Flint (learnable attention sinks, NoPE full
layers, sigmoid routing with an ungated shared expert), Kolibri-1 (GLM-4's four norms, EXAONE-4's
NoPE full layers, routing by ``logits + bias`` weighted by sigmoids); and the dense Meta CWM
(``families/cwm.py``: LLaMA with windows by ``layer_types`` and LLaMA-3 RoPE). Equal to
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
KINDS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _mellum(**kw: Any) -> Any:
    """4 layers alternating sliding (window 6) and full, the first dense, 6 experts top-2
    renormalised, thetas 1e4 (sliding) / 5e5 (full), head_dim 24."""
    return T.MellumConfig(**{**checks.SMALL, **MOE, "num_hidden_layers": 4, "num_experts": 6, "head_dim": 24,
                             "sliding_window": 6, "layer_types": KINDS,
                             "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
                             "rope_parameters": {
                                 "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, **kw})


def _mellum_other(**kw: Any) -> Any:
    """3 layers, every one full and sparse (the defaults), top-3 not renormalised, biases on q/k/v/o,
    tied embeddings, head_dim 16."""
    return T.MellumConfig(**{**checks.SMALL, **MOE, "num_hidden_layers": 3, "num_experts": 5, "head_dim": 16,
                             "num_experts_per_tok": 3, "norm_topk_prob": False, "attention_bias": True,
                             "tie_word_embeddings": True, **kw})


def _flint(**kw: Any) -> Any:
    """5 layers by Flint's default kinds (full 0, 1, 4; sliding 2, 3; window 6; full layers NoPE),
    layers 0 and 1 dense (the default ``mlp_only_layers``), 6 experts top-2 sigmoid-routed and
    renormalised, a shared expert of 40, head_dim 24."""
    return T.FlintConfig(**{**checks.SMALL, **MOE, "num_hidden_layers": 5, "num_experts": 6, "head_dim": 24,
                            "sliding_window": 6, "shared_expert_intermediate_size": 40, **kw})


def _flint_other(**kw: Any) -> Any:
    """4 layers by explicit ``layer_types``, MoE on the odd layers (``decoder_sparse_step`` 2, no
    ``mlp_only_layers``), top-3 not renormalised, biases on q/k/v/o, tied embeddings, theta 1e6."""
    return _flint(**{"num_hidden_layers": 4, "layer_types": KINDS, "mlp_only_layers": [], "decoder_sparse_step": 2,
                     "num_experts_per_tok": 3, "norm_topk_prob": False, "attention_bias": True,
                     "tie_word_embeddings": True, "head_dim": 16,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **kw})


def _kolibri(**kw: Any) -> Any:
    """5 layers by Kolibri-1's default kinds (sliding 0-3 with a window of 6, full 4 and NoPE), every
    layer sparse: 6 experts, top-2 of the logits + a correction bias (perturbed), weighted by their
    sigmoids (not renormalised), a shared expert of 40, GLM-4's four norms, head_dim 24."""
    return T.Kolibri1Config(**{**checks.SMALL, **MOE, "num_hidden_layers": 5, "num_experts": 6, "head_dim": 24,
                               "sliding_window": 6, "shared_expert_intermediate_size": 40, **kw})


def _kolibri_other(**kw: Any) -> Any:
    """3 layers by explicit ``layer_types`` (full, sliding, full), top-3 renormalised, tied
    embeddings, head_dim 16, theta 1e6. (Without a ``sliding_window`` transformers' model cannot run:
    it always builds the sliding mask.)"""
    return _kolibri(**{"num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                       "num_experts_per_tok": 3, "norm_topk_prob": True, "tie_word_embeddings": True,
                       "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **kw})


def _cwm(**kw: Any) -> Any:
    """CWM (dense): 4 layers by the default kinds (full 0, sliding 1-3 with a window of 6), LLaMA-3
    scaled RoPE (the default type, its original length 16 so that the scaling shows), head_dim 24."""
    return T.CwmConfig(**{**checks.SMALL, "num_hidden_layers": 4, "head_dim": 24, "sliding_window": 6,
                          "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0,
                                              "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                              "original_max_position_embeddings": 16}, **kw})


def _cwm_other(**kw: Any) -> Any:
    """3 layers by explicit ``layer_types`` (sliding, full, sliding), MLP biases, tied embeddings,
    plain RoPE (theta 1e4), head_dim 16."""
    return _cwm(**{"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                   "mlp_bias": True, "tie_word_embeddings": True, "head_dim": 16,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


class TestMellum(checks.FamilyChecks):
    config = staticmethod(_mellum)
    cases = (_mellum_other,)


class TestFlint(checks.FamilyChecks):
    config = staticmethod(_flint)
    cases = (_flint_other,)


class TestKolibri1(checks.FamilyChecks):
    config = staticmethod(_kolibri)
    cases = (_kolibri_other,)


class TestCwm(checks.FamilyChecks):
    config = staticmethod(_cwm)
    cases = (_cwm_other,)


def test_structure() -> None:
    from attnzoo.blocks import FeedForward
    from attnzoo.interop import from_hf
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_mellum())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert [type(b.ffn) for b in ours.blocks] == [FeedForward] + [MixtureOfExperts] * 3
    assert [b.attn.window for b in ours.blocks] == [(5, 5), None, (5, 5), None]
    ropes = [b.attn.rope for b in ours.blocks]
    assert ropes[0] is ropes[2] and ropes[1] is ropes[3] and ropes[0] is not ropes[1]
    assert ours.blocks[1].ffn.routing == "softmax_topk" and ours.blocks[1].ffn.shared_expert is None

    hf = checks.hf_model(_flint())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert [type(b.ffn) for b in ours.blocks] == [FeedForward] * 2 + [MixtureOfExperts] * 3
    assert [b.attn.window for b in ours.blocks] == [None, None, (5, 5), (5, 5), None]
    assert [b.attn.rope is not None for b in ours.blocks] == [False, False, True, True, False]
    moe = ours.blocks[2].ffn
    assert (moe.routing, moe.num_experts, moe.top_k) == ("sigmoid_topk", 6, 2)
    assert moe.shared_expert is not None and moe.shared_gate is None
    assert all(b.attn.frontier.sinks is not None for b in ours.blocks)

    from attnzoo.models.families.sparse_moe import LogitBiasSigmoidMoE

    hf = checks.hf_model(_kolibri())
    ours = from_hf(hf)
    buffers = sum(b.numel() for n, b in ours.named_buffers() if n.endswith("score_bias"))
    hf_buffers = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert buffers == hf_buffers == 5 * 6
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(type(b.ffn) is LogitBiasSigmoidMoE for b in ours.blocks)
    assert [b.attn.window for b in ours.blocks] == [(5, 5)] * 4 + [None]
    assert [b.attn.rope is not None for b in ours.blocks] == [True] * 4 + [False]
    assert all(b.attn_out_norm is not None and b.ffn_out_norm is not None for b in ours.blocks)
    other = from_hf(checks.hf_model(_kolibri_other()))
    assert [b.attn.rope is not None for b in other.blocks] == [False, True, False]

    hf = checks.hf_model(_cwm())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert [b.attn.window for b in ours.blocks] == [None] + [(5, 5)] * 3
    assert all(type(b.ffn) is FeedForward and b.attn.rope is ours.blocks[0].attn.rope for b in ours.blocks)


@pytest.mark.parametrize(("make", "keys"), [
    (lambda: _mellum(num_key_value_heads=4, num_attention_heads=4, head_dim=128, sliding_window=1024,
                     layer_types=None, mlp_layer_types=None, rope_parameters=None),
     ("num_key_value_heads", "head_dim", "sliding_window", "norm_topk_prob", "attention_bias", "layer_types",
      "mlp_layer_types", "rope_parameters", "rms_norm_eps", "hidden_act")),
    (lambda: _flint(num_key_value_heads=4, num_attention_heads=4, head_dim=128, sliding_window=513,
                    shared_expert_intermediate_size=1024, layer_types=None, mlp_only_layers=None),
     ("num_key_value_heads", "head_dim", "sliding_window", "shared_expert_intermediate_size", "norm_topk_prob",
      "attention_bias", "layer_types", "mlp_only_layers", "decoder_sparse_step", "rms_norm_eps", "hidden_act")),
    (lambda: _kolibri(num_key_value_heads=4, num_attention_heads=4, head_dim=128, sliding_window=513,
                      shared_expert_intermediate_size=512, layer_types=None),
     ("num_key_value_heads", "head_dim", "sliding_window", "shared_expert_intermediate_size", "norm_topk_prob",
      "layer_types", "rms_norm_eps", "hidden_act")),
    (lambda: _cwm(num_key_value_heads=8, num_attention_heads=8, head_dim=128, sliding_window=8192, layer_types=None,
                  rope_parameters=None),
     ("num_key_value_heads", "head_dim", "sliding_window", "layer_types", "rope_parameters", "mlp_bias",
      "rms_norm_eps", "hidden_act", "tie_word_embeddings")),
    (lambda: _flint(num_hidden_layers=7), ("layer_types",)),
    (lambda: _kolibri(num_hidden_layers=6), ("layer_types",)),
    (lambda: _cwm(num_hidden_layers=7), ("layer_types",)),
], ids=["mellum", "flint", "kolibri1", "cwm", "flint_layer_types", "kolibri1_layer_types", "cwm_layer_types"])
def test_config_json_without_defaults_loads(make: Any, keys: tuple[str, ...], tmp_path: Path) -> None:
    """A ``config.json`` leaving these keys out: read as transformers' ``from_pretrained`` reads it
    (without ``layer_types``: each family's own rule of sliding and full layers, with a small window)."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.MellumForCausalLM, _mellum, "hidden_act", "gelu", "hidden_act"),
    (T.MellumForCausalLM, _mellum, "mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "mlp_layer_types"),
    (T.FlintForCausalLM, _flint, "hidden_act", "gelu", "hidden_act"),
    (T.Kolibri1ForCausalLM, _kolibri, "hidden_act", "gelu", "hidden_act"),
    (T.MellumForCausalLM, _mellum, "rope_parameters",
     {"full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "partial_rotary_factor"),
    (T.CwmForCausalLM, _cwm, "pretraining_tp", 2, "pretraining_tp"),
    (T.CwmForCausalLM, _cwm, "layer_types", ["full_attention", "chunked_attention", "full_attention",
                                             "full_attention"], "layer type"),
], ids=["mellum_activation", "mellum_layer_type", "flint_activation", "kolibri1_activation", "mellum_partial_rope",
        "cwm_pretraining_tp", "cwm_layer_type"])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Any, key: str, value: Any,
                                                  named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


@pytest.mark.parametrize("make", [_mellum, _flint, _kolibri, _cwm], ids=["mellum", "flint", "kolibri1", "cwm"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_mellum, _flint_other, _kolibri, _cwm], ids=["mellum", "flint", "kolibri1", "cwm"])
def test_packed_training_gradients_equal_each_alone(make: Any) -> None:
    checks.check_packed_gradients_equal_each_alone(make)


def test_mellum_multi_token_prediction_weights_are_dropped(tmp_path: Path) -> None:
    """Mellum's checkpoints may hold an ``mtp`` layer after the model (transformers ignores
    ``^mtp\\.``): dropped; any other unexpected key still fails the load."""
    from safetensors.torch import load_file, save_file

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_mellum())
    hf.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["mtp.layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(sd, str(tmp_path / "model.safetensors"))
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL
    sd["model.stray.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match="stray"):
        load_pretrained(tmp_path)
