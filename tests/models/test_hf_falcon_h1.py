"""Falcon-H1 through ``from_hf``: a Mamba-2 mixer and attention in parallel in every layer
(``ParallelMixers``), muP multipliers folded into the weights, the three gate/norm forms of the
mixer; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

#: every multiplier away from 1, so that dropping or misplacing one fails the logits check
MULTIPLIERS = dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, mlp_multipliers=[0.8, 1.3],
                   key_multiplier=0.7, attention_out_multiplier=1.4, attention_in_multiplier=0.9,
                   ssm_multipliers=[1.1, 0.75, 1.25, 0.85, 1.5], ssm_in_multiplier=1.2, ssm_out_multiplier=0.65)


def _config(**kw: Any) -> Any:
    return T.FalconH1Config(**{**checks.SMALL, "num_hidden_layers": 3, "head_dim": 16, "mamba_d_ssm": 96,
                               "mamba_n_heads": 6, "mamba_d_state": 8, "mamba_n_groups": 2, "mamba_chunk_size": 8,
                               **MULTIPLIERS, **kw})


def _norm_after_gate(**kw: Any) -> Any:
    return _config(mamba_rms_norm=True, mamba_norm_before_gate=False, tie_word_embeddings=True,
                   mamba_conv_bias=False, **kw)


def _norm_before_gate(**kw: Any) -> Any:
    return _config(mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_d_ssm=None, mamba_n_heads=4,
                   attention_bias=True, **kw)


class TestFalconH1(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_norm_after_gate, _norm_before_gate)


def test_layers_are_mamba_and_attention_in_parallel() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.nn.attention import MultiHeadAttention
    from attnzoo.nn.mamba2 import Mamba2
    from attnzoo.nn.parallel import ParallelMixers

    ours = from_hf(checks.hf_model(_config()))
    for block in ours.blocks:
        assert isinstance(block.attn, ParallelMixers)
        mamba, attn = block.attn.mixers
        assert isinstance(mamba, Mamba2) and isinstance(attn, MultiHeadAttention)
        assert mamba.norm.weight is None and mamba.num_heads * mamba.inner_head_dim == 96
    assert [from_hf(checks.hf_model(make())).blocks[0].attn.mixers[0].norm.place
            for make in (_norm_after_gate, _norm_before_gate)] == ["after_gate", "before_gate"]


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_norm_after_gate)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("projectors_bias", True, "projectors_bias"),
    ("mamba_proj_bias", True, "mamba_proj_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("time_step_limit", (0.0, 4.0), "time_step_limit"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.FalconH1ForCausalLM, _config, key, value, named)
