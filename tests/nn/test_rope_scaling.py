"""RoPE scaling: attnzoo's inverse frequencies / attention scaling equal transformers' own functions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnzoo.nn.rope_scaling import ROPE_SCALINGS, default_inv_freq, rope_inv_freq, scaled_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM = 32
MAX_POS = 256
ORIG = 64
LONG = [1.0 + 0.25 * i for i in range(HEAD_DIM // 2)]
SHORT = [1.0 + 0.01 * i for i in range(HEAD_DIM // 2)]

CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn_betas_attn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG,
                        "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": ORIG,
                    "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn_no_truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
                         "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
    "longrope": {"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT,
                 "original_max_position_embeddings": ORIG},
    "longrope_factor_attn": {"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT, "factor": 3.0,
                             "attention_factor": 1.1, "original_max_position_embeddings": ORIG},
}


def _config(params: dict[str, Any], theta: float = 10000.0, partial: float | None = None) -> Any:
    rp = dict(params, rope_theta=theta)
    if partial is not None:
        rp["partial_rotary_factor"] = partial
    return transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM, num_hidden_layers=1,
                                    vocab_size=32, max_position_embeddings=MAX_POS, rope_parameters=rp)


def _hf(config: Any, seq_len: int | None) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return inv, float(scale)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seq_len", [None, 32, ORIG + 1, MAX_POS, 4 * MAX_POS])
def test_matches_transformers(case: str, seq_len: int | None) -> None:
    cfg = _config(CASES[case], theta=500000.0 if case == "llama3" else 10000.0)
    want, want_scale = _hf(cfg, seq_len)
    got, got_scale = scaled_inv_freq(cfg, seq_len=seq_len)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    assert got_scale == pytest.approx(want_scale, rel=1e-12)


def test_config_dict_and_partial_rotary() -> None:
    cfg = _config(CASES["yarn"], partial=0.5)
    want, want_scale = _hf(cfg, None)
    got, got_scale = scaled_inv_freq(cfg.to_dict())
    assert got.shape == (HEAD_DIM // 4,)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    assert got_scale == pytest.approx(want_scale)


def test_legacy_rope_scaling_dict() -> None:
    legacy = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": MAX_POS, "rope_theta": 1e4,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    got, scale = scaled_inv_freq(legacy)
    torch.testing.assert_close(got, default_inv_freq(32, 1e4) / 2.0)
    assert scale == 1.0


@pytest.mark.parametrize("case", ["dynamic", "longrope", "yarn", "llama3"])
def test_matches_the_rotary_module_past_original_length(case: str) -> None:
    """What transformers' rotary module uses at run time (dynamic growth, long/short switch)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _config(CASES[case])
    rotary = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 1, HEAD_DIM)
    for n in (16, ORIG + 8, 2 * MAX_POS):
        cos, _ = rotary(x, torch.arange(n)[None])
        inv, scale = scaled_inv_freq(cfg, seq_len=n)
        angles = torch.arange(n, dtype=torch.float32)[:, None] * inv
        want = torch.cat([angles, angles], -1).cos() * scale
        torch.testing.assert_close(cos[0], want, rtol=1e-5, atol=1e-5)


def test_dynamic_keeps_base_within_max_position() -> None:
    p = {"rope_type": "dynamic", "factor": 4.0}
    short, _ = rope_inv_freq(p, 16, max_position_embeddings=100, seq_len=50)
    torch.testing.assert_close(short, default_inv_freq(16, 10000.0))
    long, _ = rope_inv_freq(p, 16, max_position_embeddings=100, seq_len=400)
    assert (long[1:] < short[1:]).all() and long[0] == short[0]


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="rope_type must be one of"):
        rope_inv_freq({"rope_type": "ntk-by-parts"}, 16)
    with pytest.raises(ValueError, match="'factor'"):
        rope_inv_freq({"rope_type": "linear"}, 16)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_inv_freq({"rope_type": "yarn", "factor": 2.0}, 16)
    with pytest.raises(ValueError, match="8 entries"):
        rope_inv_freq({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3,
                       "original_max_position_embeddings": 10, "factor": 2.0}, 16)
    with pytest.raises(ValueError, match="even"):
        default_inv_freq(15, 10000.0)
    with pytest.raises(TypeError, match="mapping"):
        rope_inv_freq([("rope_type", "linear")], 16)  # type: ignore[arg-type]
    assert set(ROPE_SCALINGS) == {"default", "linear", "dynamic", "yarn", "llama3", "longrope"}
