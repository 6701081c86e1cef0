"""Cohere Compass text (``families/cohere_compass.py``: Cohere2's parallel layer with RoPE per layer
kind — ``None`` for NoPE —, sliding windows by ``layer_types``, the logit scale) through ``from_hf``:
equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.dense import ParallelBlock, ScaledLMHead  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

SLIDING_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": None}


def _config(**kw: Any) -> Any:
    """3 layers (sliding with RoPE, full without positions, sliding), a window of 6, logit scale 0.5,
    tied (the default)."""
    return T.CohereCompassTextConfig(**{**checks.SMALL, "num_hidden_layers": 3, "sliding_window": 6,
                                        "logit_scale": 0.5, "rope_parameters": SLIDING_ROPE,
                                        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                        **kw})


def _other(**kw: Any) -> Any:
    """Every layer full (the default kinds) with linear-scaled RoPE, q/k/v/o biases, one key/value head,
    untied, no logit scale (1), eps 1e-3."""
    return _config(**{"layer_types": None, "num_hidden_layers": 2, "attention_bias": True, "num_key_value_heads": 1,
                      "tie_word_embeddings": False, "logit_scale": None, "layer_norm_eps": 1e-3,
                      "rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1000.0,
                                                             "factor": 2.0}}, **kw})


def _two_ropes() -> Any:
    """Both kinds rotate, each with its own theta."""
    return _config(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "default", "rope_theta": 50.0}})


class TestCohereCompassText(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_two_ropes, _other)


def test_structure() -> None:
    """Parallel blocks, windows on the sliding layers, no rotary on the NoPE ones, the scaled head."""
    ours = from_hf(hf := checks.hf_model(_config()))
    assert all(isinstance(b, ParallelBlock) for b in ours.blocks) and ours.tie_embeddings
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert [b.attn.window for b in ours.blocks] == [(5, 5), None, (5, 5)]
    assert [b.attn.rope is not None for b in ours.blocks] == [True, False, True]
    assert isinstance(ours.lm_head, ScaledLMHead) and ours.lm_head.scale == 0.5
    assert isinstance(ours.norm, torch.nn.LayerNorm) and ours.norm.bias is None
    other = from_hf(checks.hf_model(_other()))
    assert other.lm_head.scale == 1.0 and other.blocks[0].attn.qkv_proj.bias is not None
    assert other.blocks[0].attn.num_kv_heads == 1 and other.norm.eps == 1e-3


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` leaving out the keys at their defaults (no ``layer_types``: every layer
    full; no ``logit_scale``: 1): read as ``from_pretrained`` reads it."""
    hf = checks.hf_model(_config(layer_types=None, logit_scale=None, num_key_value_heads=4, sliding_window=4096,
                                 max_position_embeddings=8192,
                                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    checks.check_folder_without_keys(hf, tmp_path, (
        "layer_types", "logit_scale", "num_key_value_heads", "sliding_window", "max_position_embeddings",
        "hidden_act", "layer_norm_eps", "tie_word_embeddings", "attention_bias", "attention_dropout"))


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "relu", "hidden_act"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "full_attention"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "unknown_rope", "rope_theta": 1e4},
                         "full_attention": None}, "rope_type"),
    ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"], "layer type"),
], ids=["activation", "rope_entry", "rope_type", "layer_type"])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.CohereCompassForCausalLM, _config, key, value, named)


def test_packed_sequences_and_register() -> None:
    """Packed sequences equal each alone (forward and float64 gradients); transformers' own model
    with ``attn_implementation="attnzoo"`` gives its eager logits."""
    for make in (_config, _other):
        checks.check_packed_equals_each_alone(make)
        checks.check_packed_gradients_equal_each_alone(make)
    checks.check_register_equals_eager(checks.hf_model(_config()))
