"""Mamba-2 (``Mamba2ForCausalLM``) through ``from_hf``: mixer-only layers (blocks with no
feed-forward), grouped B/C and gated RMSNorm; equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    small = {k: v for k, v in checks.SMALL.items() if k not in ("num_attention_heads", "num_key_value_heads",
                                                                  "intermediate_size", "max_position_embeddings")}
    return T.Mamba2Config(**{**small, "num_hidden_layers": 3, "num_heads": 8, "head_dim": 16, "expand": 2,
                             "state_size": 8, "n_groups": 2, "chunk_size": 8, **kw})


def _tied(**kw: Any) -> Any:
    return _config(n_groups=1, use_conv_bias=False, tie_word_embeddings=True, layer_norm_epsilon=1e-6,
                   conv_kernel=3, **kw)


class TestMamba2(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_tied,)


def test_every_layer_is_mixer_only() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.nn.mamba2 import Mamba2

    ours = from_hf(checks.hf_model(_config()))
    assert all(isinstance(b.attn, Mamba2) and b.ffn is None and b.ffn_norm is None for b in ours.blocks)
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for p in checks.hf_model(_config()).parameters())


@pytest.mark.parametrize(("key", "value", "named"), [
    ("use_bias", True, "use_bias"),
    ("time_step_limit", (0.001, float("inf")), "time_step_limit"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Mamba2ForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_config)
