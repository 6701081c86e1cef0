"""Gemma 4 unified text (``Gemma4UnifiedForCausalLM`` / ``Gemma4UnifiedTextModel``) through
``from_hf``: Gemma 4's text decoder without per-layer embeddings or MoE (sliding / full layers with
their own head widths and RoPE, scale-1 attention with q/k/v RMSNorms, keys as values, KV sharing
with the double-wide MLP, the layer scalar); equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_gemma4 as gemma4_tests  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.gemma3n import UNIFIED_DEFAULTS  # noqa: E402
from attnzoo.models.families.gemma4 import Gemma4Attention, Gemma4Block, Gemma4LM, SharedKVCounter  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

S, F = "sliding_attention", "full_attention"
ROPES = {S: {"rope_type": "default", "rope_theta": 500.0},
         F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 20000.0}}


def _config(**kw: Any) -> Any:
    """6 layers (5 sliding : 1 full, the default pattern), window 6 (< the 30 tokens tested), head
    width 16 on sliding layers and 32 on the full one (``global_head_dim``), RoPE bases 500
    (default) and 2e4 (proportional), untied head."""
    base = dict(num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=6,
                rope_parameters={k: dict(v) for k, v in ROPES.items()}, tie_word_embeddings=False)
    return T.Gemma4UnifiedTextConfig(**{**checks.SMALL, **base, **kw})


def _shared(**kw: Any) -> Any:
    """KV sharing over the last 3 of 7 layers (S F S S F S F: layers 4-6 read layers 1 and 3) with
    their double-wide MLPs, keys as values on the full layers (one global KV head), q/k/v/o biases,
    the final-logit softcap, tied embeddings."""
    return _config(**{"num_hidden_layers": 7, "layer_types": [S, F, S, S, F, S, F], "num_kv_shared_layers": 3,
                      "use_double_wide_mlp": True, "intermediate_size": 64, "attention_k_eq_v": True,
                      "num_global_key_value_heads": 1, "attention_bias": True, "final_logit_softcapping": 5.0,
                      "tie_word_embeddings": True, **kw})


def _mqa(**kw: Any) -> Any:
    """MQA, SiLU, eps 1e-5, alternating layers, the text-causal ``use_bidirectional_attention=None``."""
    return _config(**{"num_key_value_heads": 1, "hidden_activation": "silu", "rms_norm_eps": 1e-5,
                      "num_hidden_layers": 4, "layer_types": [S, F, S, F], "use_bidirectional_attention": None, **kw})


class TestGemma4Unified(checks.FamilyChecks):
    """The shared-keys config generates (through the cache) and loads from a folder; the plain one decodes."""

    config = staticmethod(_shared)
    cases = (_mqa, _config)


def test_structure() -> None:
    hf = checks.hf_model(_shared())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert isinstance(ours, Gemma4LM) and ours.per_layer is None
    assert all(isinstance(b, Gemma4Block) and b.per_layer is None for b in ours.blocks)
    attn = [b.attn for b in ours.blocks]
    assert all(isinstance(a, Gemma4Attention) for a in attn)
    assert [a.sharing.role if a.sharing else None for a in attn] == [None, "store", None, "store", "reuse", "reuse",
                                                                     "reuse"]
    assert attn[1].k_eq_v and attn[1].num_kv_heads == 1 and attn[1].head_dim == 32
    assert [b.ffn.up_proj.weight.shape[0] for b in ours.blocks] == [64] * 4 + [128] * 3
    assert isinstance(ours.init_cache(1, 8)[6], SharedKVCounter)


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_shared)
    checks.check_packed_gradients_equal_each_alone(_shared)


def test_register_serves_transformers_own_model() -> None:
    hf = checks.hf_model(_shared())
    checks.check_register_equals_eager(hf)
    checks.check_transformers_packed(hf)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` without the keys at their defaults: the layer pattern, the rope
    parameters, the sliding window (1024, not Gemma 4's 512), ``per_layer_config`` (rebuilt from
    ``global_head_dim``'s default 512), the activation, the norms' epsilon, the feature switches."""
    make = lambda: _config(global_head_dim=512, rope_parameters=None, layer_types=None,  # noqa: E731
                           sliding_window=1024)
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, (
        "layer_types", "rope_parameters", "per_layer_config", "sliding_window", "hidden_activation", "rms_norm_eps",
        "attention_bias", "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp",
        "final_logit_softcapping", "use_bidirectional_attention", "attention_dropout"))


def test_defaults_are_the_config_class_defaults() -> None:
    """Every default read where a ``config.json`` leaves a key out is ``Gemma4UnifiedTextConfig``'s
    (the sliding window 1024 and the 262144 positions differ from Gemma 4's)."""
    ref = T.Gemma4UnifiedTextConfig().to_dict()
    shared = {k: v for k, v in UNIFIED_DEFAULTS.items() if k in ref}
    assert {k: ref[k] for k in shared} == shared and len(shared) >= 16


def test_layer_scalar_loads_and_gemma4_only_keys_are_ignored() -> None:
    """Each layer's ``layer_scalar`` buffer (1 at init, not perturbed by the checks) is loaded; keys of
    Gemma 4 that the unified config has not (per-layer embeddings, the MoE block) change nothing, as
    in transformers."""
    hf = checks.hf_model(_config())
    hf.config.hidden_size_per_layer_input, hf.config.enable_moe_block = 8, True
    scalars = torch.linspace(0.5, 1.5, 6)
    with torch.no_grad():
        for layer, value in zip(hf.model.layers, scalars, strict=True):
            layer.layer_scalar.fill_(value)
    ours, x = from_hf(hf), checks.tokens(10)
    assert ours.per_layer is None and torch.equal(torch.cat([b.layer_scalar for b in ours.blocks]), scalars)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


#: Gemma 4's refusals, from the same code (``num_kv_shared_layers=6``: every layer of 6 reusing keys)
REFUSED = gemma4_tests.REFUSED


@pytest.mark.parametrize(("key", "value", "named"), REFUSED, ids=[f"{k}={v!r}"[:40] for k, v, _ in REFUSED])
def test_unsupported_options_are_named(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Gemma4UnifiedForCausalLM, _config, key, value, named)
