"""Gemma 3 (text) through ``from_hf``: 5 sliding : 1 full layers, each with its own RoPE base
(10k local, 1M global, and a scaled global rope), per-head QK-norm, the final-logit softcap; equal to
transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    base = dict(num_hidden_layers=6, head_dim=16, sliding_window=6, query_pre_attn_scalar=12,
                rope_local_base_freq=500.0, rope_theta=20000.0)
    return T.Gemma3TextConfig(**{**checks.SMALL, **base, **kw})


CASES = {
    "plain": _config,
    "softcaps": lambda: _config(final_logit_softcapping=5.0),
    "scaled_global_rope": lambda: _config(rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


def test_layer_kinds_and_per_layer_rope() -> None:
    ours = from_hf(checks.hf_model(_config()))
    windows = [b.attn.window for b in ours.blocks]
    assert windows[5] is None and all(w is not None for w in windows[:5])
    bases = {float(b.attn.rope.base) for b in ours.blocks}
    assert bases == {500.0, 20000.0}


def test_unsupported_options_are_named() -> None:
    hf = T.Gemma3ForCausalLM(_config())
    hf.config.use_bidirectional_attention = True
    with pytest.raises(UnsupportedConfigError, match="use_bidirectional_attention=True"):
        from_hf(hf)
    with pytest.raises(UnsupportedConfigError, match=r"attn_logit_softcapping=3\.0"):
        from_hf(T.Gemma3ForCausalLM(_config(attn_logit_softcapping=3.0)))
    hf = T.Gemma3ForCausalLM(_config())
    hf.config.rope_parameters["full_attention"] = {"rope_type": "mrope", "rope_theta": 1e4}
    with pytest.raises(UnsupportedConfigError, match="rope_type='mrope'"):
        from_hf(hf)


class TestGemma3(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = tuple(CASES[c] for c in ("softcaps", "scaled_global_rope"))
