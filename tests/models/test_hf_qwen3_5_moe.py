"""Qwen3.5-MoE (text) through ``from_hf``: the Qwen3.5 stack (split linear-layer projections, gated
DeltaNet 3 : 1 gated full attention) with Qwen3-Next's MoE and its gated shared expert on every
layer; equal to transformers' eager (see ``hf_family_checks``)."""

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
    small = {k: v for k, v in checks.SMALL.items() if k != "intermediate_size"}  # no dense layer: no such key
    return T.Qwen3_5MoeTextConfig(**{**small, "num_hidden_layers": 4, "head_dim": 16, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 24, "linear_num_key_heads": 2,
                                     "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                                     "linear_value_head_dim": 8, **kw})


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert [isinstance(b.attn, QwenGatedDeltaNet) for b in ours.blocks] == [True, True, True, False]
    assert all(isinstance(b.ffn, MixtureOfExperts) and b.ffn.norm_topk_prob for b in ours.blocks)


def test_unsupported_options_are_named() -> None:
    checks.check_refused(T.Qwen3_5MoeForCausalLM, _config, "attention_bias", True, "attention_bias=True")


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


class TestQwen35Moe(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = ()
