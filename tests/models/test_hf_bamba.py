"""Bamba through ``from_hf``: Mamba-2 SSD mixers (grouped B/C, gated RMSNorm per group) with
GQA attention layers at ``attn_layer_indices`` (rotary on half of each head); equal to
transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    return T.BambaConfig(**{**checks.SMALL, "num_hidden_layers": 4, "attn_layer_indices": [1, 3],
                            "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_n_groups": 2, "mamba_expand": 2,
                            "mamba_chunk_size": 8, **kw})


def _one_group(**kw: Any) -> Any:
    return _config(mamba_n_groups=1, mamba_conv_bias=False, attn_layer_indices=[0], rms_norm_eps=1e-6, **kw)


class TestBamba(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_one_group,)


def test_layer_kinds_follow_attn_layer_indices() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.nn.mamba2 import Mamba2

    ours = from_hf(checks.hf_model(_config()))
    assert [isinstance(b.attn, Mamba2) for b in ours.blocks] == [True, False, True, False]
    assert ours.blocks[1].attn.rope.rotary_dim == 8  # half of head_dim 16
    assert ours.blocks[0].attn.norm.weight.shape == (2, 64)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("mamba_proj_bias", True, "mamba_proj_bias"),
    ("time_step_limit", (0.0, 5.0), "time_step_limit"),
    ("mlp_bias", True, "mlp_bias"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.BambaForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_config)
