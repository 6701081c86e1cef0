"""LFM2 through ``from_hf``: gated short-convolution layers (``B * x`` through a causal depthwise
conv1d, no activation, times ``C``) mixed with per-head QK-normed GQA attention; SwiGLU
feed-forwards whose width ``block_auto_adjust_ff_dim`` changes; equal to transformers' eager
(see ``hf_family_checks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    """conv / attention mixed, conv biases, the ff width auto-adjusted: int(2 * 120 / 3) = 80,
    times 1.1 = 88, rounded up to a multiple of 20: 100."""
    return T.Lfm2Config(**{**checks.SMALL, "intermediate_size": 120, "num_hidden_layers": 4,
                           "layer_types": ["conv", "full_attention", "conv", "full_attention"], "conv_bias": True,
                           "conv_L_cache": 3, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.1,
                           "block_multiple_of": 20, **kw})


def _untied(**kw: Any) -> Any:
    """No conv biases, kernel 4, untied head, the ff width as given, eps 1e-6, linear-scaled rope."""
    return T.Lfm2Config(**{**checks.SMALL, "num_hidden_layers": 4,
                           "layer_types": ["full_attention", "conv", "conv", "conv"], "conv_bias": False,
                           "conv_L_cache": 4, "tie_word_embeddings": False, "block_auto_adjust_ff_dim": False,
                           "norm_eps": 1e-6, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 10000.0}, **kw})


class TestLfm2(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_untied,)


def test_structure() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.models.families.lfm2 import Lfm2ShortConvMixer
    from attnzoo.nn.attention import MultiHeadAttention

    ours = from_hf(checks.hf_model(_config()))
    assert [type(b.attn) for b in ours.blocks] == [Lfm2ShortConvMixer, MultiHeadAttention] * 2
    conv = ours.blocks[0].attn
    assert conv.in_proj.weight.shape == (192, 64) and conv.in_proj.bias is not None
    assert conv.conv.weight.shape == (64, 1, 3) and conv.conv.bias is not None and conv.out_proj.bias is not None
    attn = ours.blocks[1].attn
    assert attn.frontier.q_norm_weight.shape == (16,) and attn.frontier.q_norm.eps == 1e-5 and not attn.frontier.q_norm.over_heads
    assert ours.blocks[1].ffn.up_proj.weight.shape == (100, 64)
    assert ours.tie_embeddings
    cache = ours.init_cache(2, 16)
    assert cache[0].conv["conv"].shape == (2, 64, 2) and cache[0].state.shape == (2, 1, 1, 1)
    untied = from_hf(checks.hf_model(_untied()))
    assert not untied.tie_embeddings and untied.blocks[1].attn.conv.bias is None
    assert untied.blocks[1].attn.conv.weight.shape == (64, 1, 4)


@pytest.mark.parametrize("kw", [
    {"block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 7},
    {"block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0},
    {"block_auto_adjust_ff_dim": False},
])
def test_ff_width_is_transformers(kw: dict[str, Any]) -> None:
    from attnzoo.models.families.lfm2 import ff_dim
    from attnzoo.models.hf._state import HFConfig

    config = _config(**kw)
    width = T.models.lfm2.modeling_lfm2.Lfm2MLP(config).w1.out_features
    assert ff_dim(HFConfig(config.to_dict(), "test")) == width


def test_ff_width_without_multiplier() -> None:
    """``block_ffn_dim_multiplier=None`` (modeling 118; the strict config class no longer takes it,
    a ``config.json`` may): ``int(2 * intermediate_size / 3)``, not rounded."""
    from attnzoo.models.families.lfm2 import canonical, ff_dim
    from attnzoo.models.hf._state import HFConfig

    data = {**_config().to_dict(), "block_ffn_dim_multiplier": None}
    assert ff_dim(canonical(HFConfig(data, "test"))) == 80


@pytest.mark.parametrize("bias", [True, False])
def test_mixer_equals_transformers_short_conv(bias: bool) -> None:
    """The mixer alone against ``Lfm2ShortConv`` on a left-padded batch (all tokens, padded ones
    too: transformers zeroes the input there, so with biases ``b_B * b_x`` enters the conv)."""
    from attnzoo.models.families.lfm2 import Lfm2ShortConvMixer

    config = _config(conv_bias=bias)
    torch.manual_seed(0)
    theirs = checks.perturbed(T.models.lfm2.modeling_lfm2.Lfm2ShortConv(config, 0))
    ours = Lfm2ShortConvMixer(64, 3, bias=bias).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 11, 64)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        ref = theirs(x, attention_mask=mask)
        got = ours(x, mask=mask.bool())
        alone = ours(x[:1, 4:])
    assert checks.rel(got, ref) <= 1e-6
    # without biases a padded token feeds zeros: the left-padded row equals the row alone
    assert (checks.rel(got[:1, 4:], alone) <= 1e-6) != bias


def test_mixer_decode_equals_full_forward() -> None:
    from attnzoo.models.families.lfm2 import Lfm2ShortConvMixer

    torch.manual_seed(0)
    mixer = Lfm2ShortConvMixer(32, 4, bias=True).eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        full = mixer(x)
        cache = mixer.init_cache(2, 9)
        steps = [mixer(x[:, :3], cache=cache)] + [mixer(x[:, t:t + 1], cache=cache) for t in range(3, 9)]
    assert cache.length == 9
    assert checks.rel(torch.cat(steps, dim=1), full) <= 1e-6


def test_legacy_config_keys_and_defaults_load(tmp_path: Path) -> None:
    """A ``config.json`` as released: the class's defaults left out, ``block_ff_dim`` /
    ``tie_embedding`` for ``intermediate_size`` / ``tie_word_embeddings``, ``full_attn_idxs``
    for ``layer_types``, a legacy ``rope_theta``; transformers reads the folder the same way."""
    from attnzoo.interop import load_pretrained

    config = _config(conv_bias=False, block_multiple_of=256, block_ffn_dim_multiplier=1.0, norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    hf = checks.hf_model(config)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in ("conv_bias", "conv_L_cache", "block_multiple_of", "block_ffn_dim_multiplier",
                "block_auto_adjust_ff_dim", "norm_eps", "rope_parameters", "layer_types", "tie_word_embeddings"):
        data.pop(key, None)
    data.update(block_ff_dim=data.pop("intermediate_size"), tie_embedding=False, full_attn_idxs=[1, 3],
                rope_theta=1e6)
    path.write_text(json.dumps(data))
    model = load_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert not model.tie_embeddings and [type(b.attn).__name__ for b in model.blocks] == [
        "Lfm2ShortConvMixer", "MultiHeadAttention"] * 2
    x = checks.tokens(10)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        assert checks.rel(again(input_ids=x).logits, ref) <= 1e-6
        assert checks.rel(model(x), ref) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("layer_types", ["conv", "sliding_attention", "conv", "full_attention"], "layer type 'sliding_attention'"),
    ("rope_parameters", {"rope_type": "proportional", "rope_theta": 10000.0}, "rope_type='proportional'"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Lfm2ForCausalLM, _config, key, value, named)


def test_malformed_sizes_are_named() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.models.hf.errors import CheckpointFormatError

    hf = T.Lfm2ForCausalLM(_config())
    hf.config.conv_L_cache = 0
    with pytest.raises(CheckpointFormatError, match="conv_L_cache"):
        from_hf(hf)


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_config)
