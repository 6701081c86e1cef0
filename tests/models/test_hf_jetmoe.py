"""JetMoE (``families/jetmoe.py``: a mixture of attention heads — routed query/output projections
over shared keys/values — and a MoE feed-forward, both with output biases) through ``from_hf``:
equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families import jetmoe  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**kw: Any) -> Any:
    """2 layers, 4 experts top-2 (attention and MLP), 2 key/value heads of 16 (so 4 query heads), the
    final norm's epsilon 0.05 (the layers' stay 1e-6), untied."""
    return T.JetMoeConfig(**{**checks.SMALL, "num_hidden_layers": 2, "num_key_value_heads": 2, "kv_channels": 16,
                             "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 0.05,
                             "tie_word_embeddings": False, **kw})


def _other(**kw: Any) -> Any:
    """3 layers, 3 experts top-3 (every expert), one key/value head of 24 (3 query heads, 72 != 64
    channels), tied, linear-scaled RoPE (factor 2, theta 1000)."""
    return _config(**{"num_hidden_layers": 3, "num_local_experts": 3, "num_experts_per_tok": 3,
                      "num_key_value_heads": 1, "kv_channels": 24, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                      "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}, **kw})


def _top1() -> Any:
    """Top-1 of 5 experts, 4 key/value heads of 8."""
    return _config(num_local_experts=5, num_experts_per_tok=1, num_key_value_heads=4, kv_channels=8)


class TestJetMoe(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_top1, _other)

    def test_packed_sequences_and_gradients_equal_each_alone(self) -> None:
        """Packed (``cu_seqlens``): each sequence's routing and attention alone, forward and float64 gradients."""
        for make in (self.config, _other):
            checks.check_packed_equals_each_alone(make)
            checks.check_packed_gradients_equal_each_alone(make)


def test_structure() -> None:
    """The mixtures' shapes, the layers' fixed epsilon and the final norm's, tied embeddings, the
    parameter count."""
    hf = checks.hf_model(_other())
    ours = from_hf(hf)
    attn, ffn = ours.blocks[0].attn, ours.blocks[0].ffn
    assert isinstance(attn, jetmoe.MixtureOfAttentionHeads) and isinstance(ffn, jetmoe.JetMoeMoE)
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.num_experts, attn.top_k) == (3, 1, 24, 3, 3)
    assert tuple(attn.q_proj.weight.shape) == (3, 24, 64) and tuple(attn.out_proj.weight.shape) == (3, 64, 24)
    assert (ffn.num_experts, ffn.top_k, ffn.hidden) == (3, 3, 96) and ours.tie_embeddings
    assert ours.blocks[0].attn_norm.eps == 1e-6 and from_hf(checks.hf_model(_config())).norm.eps == 0.05
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_routing_equals_transformers() -> None:
    """Both routers pick and weight as transformers' ``JetMoeTopKGating``."""
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    x = torch.randn(40, 64)
    for gating, router in ((hf.model.layers[0].mlp.router, ours.blocks[0].ffn.router),
                           (hf.model.layers[1].self_attention.experts.router, ours.blocks[1].attn.router)):
        sorted_idx, _, gates, _, logits = gating(x)
        w, e = jetmoe.top_k_softmax(router(x), 2, x.dtype)
        torch.testing.assert_close(w.flatten()[sorted_idx], gates)
        torch.testing.assert_close(router(x), logits)
        assert torch.equal(e, logits.topk(2, dim=-1).indices)


def test_layer_norm_epsilon_is_transformers_default() -> None:
    """The layers' norms keep 1e-6 (the final one takes the config's 0.05); transformers' layers set
    to 0.05 would give other logits."""
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    assert all(b.attn_norm.eps == b.ffn_norm.eps == 1e-6 for b in ours.blocks) and ours.norm.eps == 0.05
    x = checks.tokens(12)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.input_layernorm.variance_epsilon = layer.post_attention_layernorm.variance_epsilon = 0.05
        assert checks.rel(ours(x), hf(input_ids=x).logits) > 1e-3


def test_empty_input() -> None:
    attn = from_hf(checks.hf_model(_config())).blocks[0].attn
    assert attn(torch.zeros(2, 0, 64)).shape == (2, 0, 64)


#: the keys a ``config.json`` may leave out at ``JetMoeConfig``'s defaults
DEFAULT_KEYS = ("num_key_value_heads", "kv_channels", "num_local_experts", "num_experts_per_tok", "rms_norm_eps",
                "tie_word_embeddings", "max_position_embeddings", "rope_parameters", "activation_function",
                "attention_dropout", "num_attention_heads")


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` leaving out the keys at their defaults: read as ``from_pretrained`` reads it."""
    hf = checks.hf_model(_config(num_key_value_heads=16, kv_channels=128, num_local_experts=8, num_experts_per_tok=2,
                                 rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,
                                 rope_parameters=None))
    checks.check_folder_without_keys(hf, tmp_path, DEFAULT_KEYS)


def test_options_it_cannot_reproduce_are_refused() -> None:
    """Non-SiLU experts, more picks than experts, an unknown rope type: each refused by name."""
    for key, value in (("activation_function", "gelu"), ("num_experts_per_tok", 5),
                       ("rope_parameters", {"rope_type": "unknown_rope", "rope_theta": 1e4})):
        checks.check_refused(T.JetMoeForCausalLM, _config, key, value, "rope_type" if key == "rope_parameters" else key)


def test_register_attention_equals_eager() -> None:
    """transformers' JetMoE with ``attn_implementation="attnzoo"`` gives its eager logits on a
    left-padded batch."""
    checks.check_register_equals_eager(checks.hf_model(_config()))
