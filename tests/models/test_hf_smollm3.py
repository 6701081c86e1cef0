"""SmolLM3 through ``from_hf``: NoPE layers (``no_rope_layers``), optional sliding layers;
equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import CheckpointFormatError, from_hf  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    return T.SmolLM3Config(**{**checks.SMALL, "num_hidden_layers": 4, "rope_theta": 5000.0, **kw})


CASES = {
    "nope_every_4th": _config,
    "sliding_and_nope": lambda: _config(use_sliding_window=True, sliding_window=6, no_rope_layers=[0, 1, 0, 1],
                                        layer_types=["sliding_attention", "full_attention"] * 2),
}


def test_nope_layers_have_no_rotary() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert [b.attn.rope is None for b in ours.blocks] == [False, False, False, True]


def test_malformed_no_rope_layers_is_named() -> None:
    hf = T.SmolLM3ForCausalLM(_config())
    hf.config.no_rope_layers = [1, 0]
    with pytest.raises(CheckpointFormatError, match="no_rope_layers has 2 entries for 4 layers"):
        from_hf(hf)


class TestSmollm3(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (CASES["sliding_and_nope"],)
