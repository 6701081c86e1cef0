"""Zamba (``ZambaForCausalLM``) through ``from_hf``: Mamba-1 layers with per-head ``x_proj`` /
``dt_proj`` (the family-local ``ZambaMambaMixer``), and at the hybrid layers one shared NoPE
transformer block on ``[h | e]`` (one per layer when untied); equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

M, HY = "linear_attention", "hybrid"


def _config(**kw: Any) -> Any:
    """Two hybrid layers on one tied block, GQA 4/2 heads of 32 (= 2C / H), two Mamba heads of 64
    channels, state 8, dt rank 4 ("auto"), GELU MLP."""
    return T.ZambaConfig(**{**checks.SMALL, "num_hidden_layers": 5, "layers_block_type": [M, HY, M, HY, M],
                            "n_mamba_heads": 2, "mamba_d_state": 8, **kw})


def _untied(**kw: Any) -> Any:
    """Untied: transformers gives every hybrid layer a block of its own; four Mamba heads, SwiGLU,
    a first hybrid layer, MHA, head_dim 24 (!= 2C / H), conv kernel 3, in/out projection biases,
    no conv bias, dt rank 6, eps 1e-6."""
    return _config(**{"layers_block_type": [HY, M, HY, HY], "num_hidden_layers": 4, "tie_word_embeddings": False,
                      "n_mamba_heads": 4, "hidden_act": "silu", "num_key_value_heads": 4, "attention_head_dim": 24,
                      "mamba_d_conv": 3, "mamba_proj_bias": True, "mamba_conv_bias": False, "mamba_dt_rank": 6,
                      "rms_norm_eps": 1e-6, **kw})


def _default_layers(**kw: Any) -> Any:
    """``layers_block_type`` derived (m, m, hybrid, then every 3rd from offset 1: 8 layers), one
    Mamba head, MQA."""
    return T.ZambaConfig(**{**checks.SMALL, "num_hidden_layers": 8, "attn_layer_period": 3, "attn_layer_offset": 1,
                            "n_mamba_heads": 1, "mamba_d_state": 4, "num_key_value_heads": 1, **kw})


class TestZamba(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_untied, _default_layers)


def test_structure() -> None:
    from attnzoo.models.families.zamba import ZambaMambaMixer

    ours = from_hf(checks.hf_model(_default_layers()))
    kinds = ["hybrid" if b.shared is not None else "mamba" for b in ours.blocks]
    assert kinds == ["mamba", "mamba", "hybrid", "mamba", "hybrid", "mamba", "mamba", "hybrid"]
    uses = [b.shared for b in ours.blocks if b.shared is not None]
    assert all(u.block is uses[0].block for u in uses)  # tied: one block
    assert all(isinstance(b.attn, ZambaMambaMixer) for b in ours.blocks)
    assert uses[0].attn.rope is None and uses[0].attn.scale == pytest.approx((32 / 2) ** -0.5)
    untied = from_hf(checks.hf_model(_untied()))
    blocks = [b.shared.block for b in untied.blocks if b.shared is not None]
    assert len({id(b) for b in blocks}) == 3


def test_tied_copy_that_differs_is_an_error() -> None:
    from attnzoo.interop import CheckpointFormatError
    from attnzoo.models.families.zamba import convert_zamba
    from attnzoo.models.hf._state import HFConfig

    hf = checks.hf_model(_config())
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["model.layers.3.shared_transf.pre_ff_layernorm.weight"] += 1.0
    with pytest.raises(CheckpointFormatError, match=r"layers\.3\.shared_transf\.pre_ff_layernorm\.weight differs"):
        convert_zamba(HFConfig(hf.config.to_dict(), "test", "Zamba"), sd, device=None, dtype=None)


def test_saved_folder_of_the_untied_config_loads(tmp_path: Path) -> None:
    checks.check_folder(_untied, tmp_path)


def test_folder_without_derived_or_default_keys_loads(tmp_path: Path) -> None:
    """``attention_head_dim``, ``attention_hidden_size``, ``mamba_dt_rank``, ``layers_block_type``
    derived, and keys at their defaults left out."""
    keys = ("attention_head_dim", "attention_hidden_size", "mamba_dt_rank", "layers_block_type", "hidden_act",
            "hidden_mamba_act", "rms_norm_eps", "mamba_d_conv", "mamba_expand", "mamba_conv_bias", "mamba_proj_bias",
            "tie_word_embeddings", "attention_dropout")
    checks.check_folder_without_keys(checks.hf_model(_default_layers()), tmp_path, keys)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_mamba_act", "gelu", "hidden_mamba_act"),
    ("attention_hidden_size", 96, "attention_hidden_size"),
    ("layers_block_type", [M, HY, M, "full_attention", M], "full_attention"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.ZambaForCausalLM, _config, key, value, named)


@pytest.mark.parametrize("check", [checks.check_packed_equals_each_alone,
                                   checks.check_packed_gradients_equal_each_alone])
def test_packed_sequences_and_their_gradients_equal_each_alone(check: Any) -> None:
    check(_config)
    check(_untied)


def test_padded_row_equals_the_row_alone() -> None:
    """Left padding: transformers zeroes the padded tokens' mixer inputs and masks them in the
    shared attention, so its padded batch is each row alone too; attnzoo's padded forward and its
    cached decode after a padded prefill equal the row alone."""
    ours = from_hf(checks.hf_model(_config()))
    x, mask = checks.padded(14, pad=4)
    with torch.no_grad():
        padded = ours(x, attention_mask=mask.bool())
        alone = ours(x[:1, 4:])
        cache = ours.init_cache(2, 14)
        steps = [ours(x[:, :9], cache=cache, attention_mask=mask[:, :9].bool())]
        steps += [ours(x[:, t:t + 1], cache=cache, attention_mask=mask[:, :t + 1].bool()) for t in range(9, 14)]
    assert checks.rel(padded[0, 4:], alone[0]) <= 1e-5
    assert checks.rel(torch.cat(steps, dim=1)[mask.bool()], padded[mask.bool()]) <= 1e-5
