"""Nemotron-H (``NemotronHForCausalLM``) through ``from_hf``: each Hugging Face layer is one
mixer (Mamba-2 ``M``, NoPE attention ``*``, relu^2 MLP ``-``); a mixer layer and the MLP layer
after it become one attnzoo block, a lone mixer a mixer-only block. Equal to transformers' eager
(see ``hf_family_checks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    # mamba inner 4 x 24 = 96 (not expand x hidden = 128); attention head_dim 24 (not 64 / 4)
    return T.NemotronHConfig(**{**checks.SMALL, "head_dim": 24, "layers_block_type": T.NemotronHConfig._pattern_to_list(
        "M-M*-MM-"), "mamba_num_heads": 4, "mamba_head_dim": 24, "n_groups": 2, "ssm_state_size": 8,
        "chunk_size": 8, **kw})


def _second(**kw: Any) -> Any:
    # the legacy pattern key; one group, no conv bias, biased MLPs; tie_word_embeddings and
    # attention_bias, which transformers' modeling ignores (lm_head untied, unbiased projections)
    return T.NemotronHConfig(**{**checks.SMALL, "layers_block_type": None, "hybrid_override_pattern": "M*-M-",
                                "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_n_groups": 1, "ssm_state_size": 8,
                                "use_conv_bias": False, "conv_kernel": 3, "mlp_bias": True, "layer_norm_epsilon": 1e-6,
                                "tie_word_embeddings": True, "attention_bias": True, "chunk_size": 8, **kw})


class TestNemotronH(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_second,)


def test_a_mixer_and_the_mlp_after_it_are_one_block() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.nn.mamba2 import Mamba2

    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    # "M-M*-MM-": [M-] [M] [*-] [M] [M-]
    assert ours.depth == len(ours.blocks) == 5
    assert [isinstance(b.attn, Mamba2) for b in ours.blocks] == [True, True, False, True, True]
    assert [b.ffn is None and b.ffn_norm is None for b in ours.blocks] == [False, True, False, True, False]
    assert ours.blocks[2].attn.rope is None  # NoPE
    assert ours.blocks[0].attn.v_proj.weight.shape == (96, 64)  # mamba_num_heads x mamba_head_dim
    assert ours.blocks[0].ffn.activation == "relu2" and ours.blocks[0].ffn.gate_proj is None
    layers = hf.model.layers
    assert torch.equal(ours.blocks[2].ffn_norm.weight, layers[4].norm.weight)
    assert torch.equal(ours.blocks[4].ffn.down_proj.weight, layers[7].mixer.down_proj.weight)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_config)


def test_legacy_config_json_loads(tmp_path: Path) -> None:
    """A ``config.json`` with ``hybrid_override_pattern``, the legacy ``mamba_*`` keys and a
    ``num_hidden_layers`` (ignored, as transformers ignores it) loads the same model."""
    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_config())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["hybrid_override_pattern"] = "M-M*-MM-"
    data["mamba_n_groups"] = data.pop("n_groups")
    data["mamba_d_conv"] = data.pop("conv_kernel")
    for key in ("layers_block_type", "mlp_hidden_act", "use_bias"):  # the last two: the class defaults
        data.pop(key)
    data["num_hidden_layers"] = 3
    path.write_text(json.dumps(data))
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("pattern", "named"), [
    ("M*-ME", r"moe layers \(layers \[4\]"),
    ("-M*", r"mlp layer with no mixer layer before it \(layer 0"),
    ("M--*", r"mlp layer with no mixer layer before it \(layer 2"),
])
def test_layers_it_cannot_express_are_refused(pattern: str, named: str) -> None:
    from attnzoo.interop import UnsupportedConfigError, from_hf

    hf = T.NemotronHForCausalLM(_config(layers_block_type=T.NemotronHConfig._pattern_to_list(pattern),
                                        n_routed_experts=4, moe_intermediate_size=32,
                                        moe_shared_expert_intermediate_size=32))
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("use_bias", True, "use_bias"),
    ("time_step_limit", (0.0, 5.0), "time_step_limit"),
    ("mamba_hidden_act", "gelu", "mamba_hidden_act"),
    ("mlp_hidden_act", "quick_gelu", "mlp_hidden_act"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.NemotronHForCausalLM, _config, key, value, named)
