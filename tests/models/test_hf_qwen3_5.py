"""Qwen3.5 (text) through ``from_hf``: the Qwen3-Next stack with dense feed-forwards and split
linear-layer projections; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    return T.Qwen3_5TextConfig(**{**checks.SMALL, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
                                  "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                  **kw})


class TestQwen35(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = ()
