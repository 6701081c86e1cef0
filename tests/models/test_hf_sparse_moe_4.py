"""The fourth batch of sparse-MoE decoders through ``from_hf`` (``families/sparse_moe.py``):
GraniteMoeShared (GraniteMoE's multipliers and experts plus an always-on shared MLP), FlexOlmo
(OLMoE's attention and experts on OLMo 2's output norms), Param2-MoE and Sarvam-MoE (transformers'
GLM-4.5 model under their own configs: full rotation, QK norms by default). Equal to transformers'
eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")


def _granitemoeshared(**kw: Any) -> Any:
    """2 layers, 4 experts top-2, a shared MLP of 40, every multiplier away from 1, untied."""
    return T.GraniteMoeSharedConfig(**{**checks.SMALL, "num_hidden_layers": 2, "num_local_experts": 4,
                                       "num_experts_per_tok": 2, "shared_intermediate_size": 40,
                                       "embedding_multiplier": 2.0, "attention_multiplier": 0.3,
                                       "residual_multiplier": 0.5, "logits_scaling": 4.0, **kw})


def _granitemoeshared_other(**kw: Any) -> Any:
    """No shared MLP (``shared_intermediate_size`` 0, the default), q/k/v/o biases, top-1 of 3, head_dim 24, tied."""
    return _granitemoeshared(**{"shared_intermediate_size": 0, "attention_bias": True, "num_local_experts": 3,
                                "num_experts_per_tok": 1, "head_dim": 24, "tie_word_embeddings": True, **kw})


def _flex_olmo(**kw: Any) -> Any:
    """3 layers, QK norms over all heads, output norms, 5 experts top-2 (not renormalised)."""
    return T.FlexOlmoConfig(**{**checks.SMALL, "num_hidden_layers": 3, "num_experts": 5, "num_experts_per_tok": 2,
                               **kw})


def _flex_olmo_other(**kw: Any) -> Any:
    """Renormalised top-3 of 4, attention biases, 4 key/value heads (= query heads), tied, theta 1e4."""
    return _flex_olmo(**{"num_experts": 4, "num_experts_per_tok": 3, "norm_topk_prob": True, "attention_bias": True,
                         "num_key_value_heads": 4, "tie_word_embeddings": True,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


def _param2(**kw: Any) -> Any:
    """4 layers (the first dense), 8 experts in 2 groups, top-2 of the best group, 2 shared experts,
    per-head QK norms (the default), full rotation (the default), routed scaling 2.5, head_dim 16, tied."""
    return T.Param2MoeConfig(**{**checks.SMALL, "num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "head_dim": 16, **kw})


def _param2_other(**kw: Any) -> Any:
    """q/k/v biases, no QK norms, two dense layers, not renormalised, one shared expert, a rotary on
    half of each head, head_dim 24, untied."""
    return _param2(**{"attention_bias": True, "use_qk_norm": False, "first_k_dense_replace": 2,
                      "norm_topk_prob": False, "n_shared_experts": 1, "n_group": 1, "num_experts_per_tok": 3,
                      "head_dim": 24, "tie_word_embeddings": False,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                      **kw})


def _sarvam(**kw: Any) -> Any:
    """3 layers (the first dense), 6 experts top-2, one shared expert, per-head QK norms, full
    rotation, head_dim 16, untied (the defaults)."""
    return T.SarvamMoEConfig(**{**checks.SMALL, "num_hidden_layers": 3, "n_routed_experts": 6,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16, **kw})


def _sarvam_other(**kw: Any) -> Any:
    """q/k/v biases, routed scaling 1.0, 2 shared experts, tied, head_dim 24."""
    return _sarvam(**{"attention_bias": True, "routed_scaling_factor": 1.0, "n_shared_experts": 2,
                      "tie_word_embeddings": True, "head_dim": 24, **kw})


class TestGraniteMoeShared(checks.FamilyChecks):
    config = staticmethod(_granitemoeshared)
    cases = (_granitemoeshared_other,)


class TestFlexOlmo(checks.FamilyChecks):
    config = staticmethod(_flex_olmo)
    cases = (_flex_olmo_other,)


class TestParam2Moe(checks.FamilyChecks):
    config = staticmethod(_param2)
    cases = (_param2_other,)


class TestSarvamMoe(checks.FamilyChecks):
    config = staticmethod(_sarvam)
    cases = (_sarvam_other,)


def test_structure() -> None:
    from attnzoo.blocks import FeedForward
    from attnzoo.interop import from_hf
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_granitemoeshared())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(type(b.ffn.shared_expert) is FeedForward and b.ffn.shared_gate is None for b in ours.blocks)
    assert all(b.ffn.shared_expert is None for b in from_hf(checks.hf_model(_granitemoeshared_other())).blocks)

    hf = checks.hf_model(_flex_olmo())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(type(b.attn_norm) is torch.nn.Identity and type(b.attn_out_norm) is not torch.nn.Identity
               and type(b.ffn_out_norm) is not torch.nn.Identity for b in ours.blocks)

    for make in (_param2, _sarvam):
        hf = checks.hf_model(make())
        assert type(hf).__name__ == "Glm4MoeForCausalLM"
        ours = from_hf(hf)
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
        assert [type(b.ffn) for b in ours.blocks] == [FeedForward] + [MixtureOfExperts] * (len(ours.blocks) - 1)
        assert ours.blocks[0].attn.rope.rotary_dim == 16  # the whole head


@pytest.mark.parametrize(("make", "keys"), [
    (lambda: _granitemoeshared(num_key_value_heads=4, shared_intermediate_size=0),
     ("num_key_value_heads", "shared_intermediate_size", "attention_bias", "rms_norm_eps", "hidden_act")),
    (lambda: _flex_olmo(num_key_value_heads=4, num_experts=7, num_experts_per_tok=5),
     ("num_key_value_heads", "num_experts", "num_experts_per_tok", "norm_topk_prob", "attention_bias",
      "rope_parameters", "rms_norm_eps", "hidden_act")),
    (lambda: _param2(num_key_value_heads=8, num_attention_heads=8, n_routed_experts=64, num_experts_per_tok=6,
                     n_shared_experts=2, moe_intermediate_size=2048, n_group=1, hidden_size=32, head_dim=64,
                     rope_parameters=None),
     ("num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
      "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
      "head_dim", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "rope_parameters", "hidden_act")),
    (lambda: _sarvam(num_key_value_heads=4, n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=1,
                     moe_intermediate_size=1024, hidden_size=32, num_attention_heads=4, head_dim=64,
                     rope_parameters=None),
     ("num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
      "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
      "head_dim", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "rope_parameters", "hidden_act")),
], ids=["granitemoeshared", "flex_olmo", "param2moe", "sarvam_moe"])
def test_config_json_without_defaults_loads(make: Any, keys: tuple[str, ...], tmp_path: Path) -> None:
    """A ``config.json`` leaving these keys out: read as transformers' ``from_pretrained`` reads it."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


def test_param2_original_config_names_load(tmp_path: Path) -> None:
    """Param2's original configs name ``attention_bias`` ``use_qkv_bias`` and ``n_shared_experts``
    ``num_shared_experts`` (its config's ``attribute_map``): read as transformers reads them."""
    import json

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_param2(attention_bias=True, n_shared_experts=1))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["use_qkv_bias"], data["num_shared_experts"] = data.pop("attention_bias"), data.pop("n_shared_experts")
    path.write_text(json.dumps(data))
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.attention_bias and again.config.n_shared_experts == 1
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), again(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.GraniteMoeSharedForCausalLM, _granitemoeshared, "hidden_act", "gelu", "hidden_act"),
    (T.GraniteMoeSharedForCausalLM, _granitemoeshared, "rope_parameters",
     {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    (T.FlexOlmoForCausalLM, _flex_olmo, "hidden_act", "gelu", "hidden_act"),
    (T.Glm4MoeForCausalLM, _param2, "hidden_act", "gelu", "hidden_act"),
    (T.Glm4MoeForCausalLM, _sarvam, "pretraining_tp", 2, "pretraining_tp"),
], ids=["granitemoeshared_activation", "granitemoeshared_partial_rope", "flex_olmo_activation", "param2_activation",
        "sarvam_pretraining_tp"])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Any, key: str, value: Any,
                                                  named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


@pytest.mark.parametrize("make", [_granitemoeshared, _flex_olmo, _param2, _sarvam],
                         ids=["granitemoeshared", "flex_olmo", "param2moe", "sarvam_moe"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_granitemoeshared, _flex_olmo, _param2_other, _sarvam],
                         ids=["granitemoeshared", "flex_olmo", "param2moe", "sarvam_moe"])
def test_packed_training_gradients_equal_each_alone(make: Any) -> None:
    checks.check_packed_gradients_equal_each_alone(make)
