"""gpt-oss through ``from_hf``: attention sinks, alternating sliding/full layers, q/k/v/o
biases, YaRN RoPE, a 4-expert MoE (router bias, top-k then softmax, clamped SwiGLU with
biases); equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    small = {**checks.SMALL, "intermediate_size": 32}
    return T.GptOssConfig(**{**small, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 6,
                             "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 1.5,
                             "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 16}, **kw})


def test_layers_are_sinks_windows_and_experts() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert [b.attn.window is None for b in ours.blocks] == [False, True, False, True]
    assert all(b.attn.frontier.sinks is not None and isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks)


class TestGptOss(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = ()
