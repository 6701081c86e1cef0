"""OLMo-hybrid through ``from_hf``: gated DeltaNet layers (grouped value heads, ``beta`` in
``[0, 2]``) 3 : 1 with QK-normed full attention (NoPE as released, or RoPE), per-layer norm
placement; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    return T.OlmoHybridConfig(**{**checks.SMALL, "num_hidden_layers": 4, "linear_num_key_heads": 2,
                                 "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                 **kw})


def _nope(**kw: Any) -> Any:
    cfg = _config(linear_allow_neg_eigval=False, **kw)
    cfg.rope_parameters = None  # the released checkpoints: transformers then builds no rotary embedding
    return cfg


CASES = {"rope_neg_eigval": _config, "nope_positive_beta": _nope}


def test_released_layout_is_nope() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.models.families.qwen3_next import QwenGatedDeltaNet

    ours = from_hf(checks.hf_model(CASES["nope_positive_beta"]()))
    assert [isinstance(b.attn, QwenGatedDeltaNet) for b in ours.blocks] == [True, True, True, False]
    assert ours.blocks[3].attn.rope is None
    assert from_hf(checks.hf_model(_config())).blocks[0].attn.allow_neg_eigval


class TestOlmoHybrid(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (CASES["nope_positive_beta"],)
