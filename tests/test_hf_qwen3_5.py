"""Qwen3.5 (text) through ``from_hf``: the Qwen3-Next stack with dense feed-forwards and split
linear-layer projections; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    return T.Qwen3_5TextConfig(**{**checks.SMALL, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
                                  "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                  **kw})


def test_logits_equal_transformers() -> None:
    checks.check_logits(_config, n=30)


def test_base_model_equals_transformers() -> None:
    checks.check_base_model(_config)


def test_greedy_generation_identical() -> None:
    checks.check_generation(_config)


def test_cached_decode_equals_full_forward() -> None:
    checks.check_cached_decode(_config)


def test_saved_folder_loads(tmp_path: Path) -> None:
    checks.check_folder(_config, tmp_path)
