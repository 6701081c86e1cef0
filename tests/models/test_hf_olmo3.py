"""OLMo 3 through ``from_hf``: 3 sliding : 1 full layers with their own rotary embeddings, QK
RMSNorm over all heads, output norms; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    return T.Olmo3Config(**{**checks.SMALL, "num_hidden_layers": 4, "sliding_window": 6, **kw})


CASES = {
    "default": _config,
    "scaled_full_rope": lambda: _config(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 16}}),
}


def test_layer_kinds() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert [b.attn.window for b in ours.blocks] == [(5, 5)] * 3 + [None]  # causal: (5, 5) sees 5 keys back
    assert len({id(b.attn.rope) for b in ours.blocks}) == 2


def test_unknown_layer_type_is_named() -> None:
    hf = T.Olmo3ForCausalLM(_config())
    hf.config.layer_types = ["chunked_attention"] * 4
    with pytest.raises(UnsupportedConfigError, match="layer type 'chunked_attention'"):
        from_hf(hf)


class TestOlmo3(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (CASES["scaled_full_rope"],)
