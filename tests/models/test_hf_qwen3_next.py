"""Qwen3-Next through ``from_hf``: gated DeltaNet layers with grouped value heads (3:1 with gated
full attention), partial rotary, the MoE with its sigmoid-gated shared expert on sparse layers,
dense layers between; equal to transformers' eager (see ``hf_family_checks``), and packed
sequences equal to each sequence alone."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.qwen3_next import QwenGatedDeltaNet  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    return T.Qwen3NextConfig(**{**checks.SMALL, "num_hidden_layers": 4, "head_dim": 16, "num_experts": 4,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 24, "linear_num_key_heads": 2,
                                "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                "decoder_sparse_step": 2, **kw})


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert [isinstance(b.attn, QwenGatedDeltaNet) for b in ours.blocks] == [True, True, True, False]
    assert [isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks] == [False, True, False, True]
    assert ours.blocks[3].attn.rope.rotary_dim == 4  # partial_rotary_factor 0.25 of 16


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_unsupported_options_are_named() -> None:
    checks.check_refused(T.Qwen3NextForCausalLM, _config, "attention_bias", True, "attention_bias=True")


class TestQwen3Next(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = ()
