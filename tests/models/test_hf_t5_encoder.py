"""T5 / mT5 / UMT5 encoders (``families/t5_encoder.py``) against transformers' eager ``*EncoderModel``:
hidden states on padded batches for every option that changes the math (feed-forward kinds, bucket
settings, ``d_kv`` heads, head counts that do not divide the width, the shared vs per-layer relative
bias), the bucket function against transformers', the float16 overflow clamp, ``to_hf``, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_encoder_checks as ec  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, to_hf  # noqa: E402
from attnzoo.models.families.t5_encoder import (  # noqa: E402
    RelativeBiasAttention,
    RelativePositionBias,
    build_t5_encoder,
    convert_t5_encoder,
    relative_position_buckets,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.nn.attention import build_softmax  # noqa: E402
from hf_family_checks import V, rel  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(cls: Any = T.T5Config, **kw: Any) -> Any:
    base = {"vocab_size": V, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_heads": 4,
            "pad_token_id": ec.PAD, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 10}
    return cls(**{**base, **kw})


def _t5() -> Any:
    return _cfg(feed_forward_proj="relu")


def _mt5() -> Any:
    return _cfg(T.MT5Config, feed_forward_proj="gated-gelu")


def _umt5() -> Any:
    return _cfg(T.UMT5Config, feed_forward_proj="gated-gelu")


#: one transformers model per ``model_type`` added here, for the ``to_hf`` export sweep
SWEEP = {"t5": lambda seed: ec.hf_encoder(_t5(), T.T5EncoderModel, seed),
         "mt5": lambda seed: ec.hf_encoder(_mt5(), T.MT5EncoderModel, seed),
         "umt5": lambda seed: ec.hf_encoder(_umt5(), T.UMT5EncoderModel, seed)}

#: keys left at their config class's default in the configs above
_DROP = ("is_decoder", "layer_norm_epsilon")


class TestT5(ec.EncoderChecks):
    config = staticmethod(_t5)
    base = T.T5EncoderModel
    cases = (lambda: _cfg(feed_forward_proj="gated-gelu"),  # T5 v1.1 (gelu_new)
             lambda: _cfg(feed_forward_proj="gated-silu"), lambda: _cfg(feed_forward_proj="gelu"),
             lambda: _cfg(feed_forward_proj="gelu_new"),
             lambda: _cfg(d_kv=16),  # heads wider than d_model / H
             lambda: _cfg(num_heads=3),  # d_model not divisible by the heads (mT5-small: 512 wide, 6 heads)
             lambda: _cfg(relative_attention_num_buckets=32, relative_attention_max_distance=128),
             lambda: _cfg(relative_attention_num_buckets=6, relative_attention_max_distance=4),
             lambda: _cfg(layer_norm_epsilon=1e-2))
    drop = (*_DROP, "feed_forward_proj")


class TestMT5(ec.EncoderChecks):
    config = staticmethod(_mt5)
    base = T.MT5EncoderModel
    cases = (lambda: _cfg(T.MT5Config, num_heads=3),)
    drop = (*_DROP, "feed_forward_proj")


class TestUMT5(ec.EncoderChecks):
    config = staticmethod(_umt5)
    base = T.UMT5EncoderModel
    cases = (lambda: _cfg(T.UMT5Config, num_layers=3, feed_forward_proj="relu"),)
    drop = (*_DROP, "feed_forward_proj")


def test_t5_shares_the_first_layers_bias_and_umt5_has_one_per_layer() -> None:
    t5, umt5 = from_hf(SWEEP["t5"](0)), from_hf(SWEEP["umt5"](0))
    assert t5.blocks[0].attn.relative_bias is t5.blocks[1].attn.relative_bias
    assert [n for n, _ in t5.named_parameters() if "relative" in n] == ["blocks.0.attn.relative_bias.weight"]
    assert len([n for n, _ in umt5.named_parameters() if "relative" in n]) == 2


@pytest.mark.parametrize(("buckets", "distance"), [(32, 128), (8, 10), (6, 4), (64, 512)])
def test_buckets_equal_transformers(buckets: int, distance: int) -> None:
    r = torch.arange(-700, 701)[None, :] - torch.arange(0, 3)[:, None]
    for bidirectional in (True, False):
        want = T.models.t5.modeling_t5.T5Attention._relative_position_bucket(
            r, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance)
        got = relative_position_buckets(r, num_buckets=buckets, max_distance=distance, bidirectional=bidirectional)
        assert torch.equal(got, want), (buckets, distance, bidirectional)


def test_bias_shapes_and_bad_settings() -> None:
    bias = RelativePositionBias(8, 4, max_distance=10)
    assert bias(torch.arange(5), torch.arange(7)).shape == (1, 4, 5, 7)
    assert bias(torch.arange(10).view(2, 5), torch.arange(10).view(2, 5)).shape == (2, 4, 5, 5)
    for buckets, distance in ((2, 128), (8, 2)):
        with pytest.raises(ValueError, match="max_distance"):
            RelativePositionBias(buckets, 4, max_distance=distance)


def test_causal_relative_attention_decodes_as_the_full_forward() -> None:
    torch.manual_seed(0)
    bias = RelativePositionBias(8, 4, max_distance=10, bidirectional=False)
    with torch.no_grad():
        bias.weight.normal_()
    attn = build_softmax(RelativeBiasAttention, 32, 4, head_dim=8, bias=False, causal=True, scale=1.0,
                         relative_bias=bias)
    x = torch.randn(2, 9, 32)
    cache = attn.init_cache(2, 9)
    with torch.no_grad():
        steps = torch.cat([attn(x[:, :4], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(4, 9)], 1)
        assert rel(steps, attn(x)) <= 1e-5


def test_float16_overflow_is_clamped_as_transformers() -> None:
    hf = SWEEP["mt5"](0)
    with torch.no_grad():  # the first feed-forward overflows float16: transformers clamps to finfo.max - 1000
        hf.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(3e4)
    ours = from_hf(hf, dtype=torch.float16)
    hf = hf.half()
    x, mask = ec.batch()
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask).last_hidden_state
        got = ours(x, attention_mask=mask)
        assert hf.encoder.block[0](hf.shared(x))[0].abs().max() == 64512  # clamped inside the block
    assert torch.isfinite(got[mask.bool()]).all() and torch.isfinite(want[mask.bool()]).all()
    assert ec.real_rel(got, want, mask) <= 2e-2


def test_to_hf_round_trip() -> None:
    for make in SWEEP.values():
        target, source = make(0), make(1)
        ours = from_hf(source)
        assert to_hf(ours, target) is target
        again = dict(from_hf(target).state_dict())
        for name, want in ours.state_dict().items():
            assert torch.allclose(again[name], want, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("cls", [T.T5ForConditionalGeneration, T.T5Model, T.T5ForTokenClassification,
                                 T.UMT5ForConditionalGeneration])
def test_models_other_than_the_encoder_are_refused(cls: Any) -> None:
    """By the encoder's converter (``from_hf`` converts the seq2seq models whole: ``test_hf_t5.py``)."""
    cfg = _umt5() if cls is T.UMT5ForConditionalGeneration else _t5()
    hf = cls._from_config(cfg)
    with pytest.raises(UnsupportedConfigError, match="EncoderModel"):
        convert_t5_encoder(HFConfig(cfg.to_dict(), "config.json", "T5"), hf.state_dict(), device=None, dtype=None)
    if cls is T.T5ForTokenClassification:
        with pytest.raises(UnsupportedConfigError, match="EncoderModel"):
            from_hf(hf)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("is_decoder", True, "is_decoder"), ("feed_forward_proj", "gated-relu", "feed_forward_proj"),
    ("feed_forward_proj", "tanh", "feed_forward_proj"), ("relative_attention_max_distance", 2, "max_distance"),
    ("relative_attention_num_buckets", 2, "relative_attention_num_buckets")])
def test_options_without_an_equivalent_are_refused(key: str, value: Any, match: str) -> None:
    data = {**_t5().to_dict(), key: value}
    with pytest.raises(UnsupportedConfigError, match=match):
        build_t5_encoder(HFConfig(data, "config.json", "T5"), per_layer_bias=False, device="meta")


def test_a_file_with_only_the_encoders_embedding_copy_loads() -> None:
    hf = SWEEP["t5"](0)
    sd = {k: v for k, v in hf.state_dict().items() if k != "shared.weight"}
    ours = convert_t5_encoder(HFConfig(hf.config.to_dict(), "config.json", "T5"), sd, device=None, dtype=None)
    assert torch.equal(ours.tok_emb.weight, hf.shared.weight)


def test_the_shared_bias_is_computed_once_per_step_without_gradients() -> None:
    """``RelativePositionBias.slots`` keeps its last table while nothing changed (the layers sharing
    T5's first-layer bias reuse it), recomputes it after the weight changes, keeps none with grads."""
    bias = RelativePositionBias(8, 4, max_distance=10)
    with torch.no_grad():
        bias.weight.normal_()
        a = bias.slots(0, 5, device=torch.device("cpu"), dtype=torch.float32)
        assert bias.slots(0, 5, device=torch.device("cpu"), dtype=torch.float32) is a
        assert torch.equal(a, bias(torch.arange(5), torch.arange(5)))
        b = bias.slots(3, 1, device=torch.device("cpu"), dtype=torch.float32)  # a decoding step
        assert torch.equal(b, bias(torch.arange(3, 4), torch.arange(4)))
        bias.weight.add_(1.0)
        assert not torch.equal(bias.slots(3, 1, device=torch.device("cpu"), dtype=torch.float32), b)
    g = bias.slots(0, 5, device=torch.device("cpu"), dtype=torch.float32)
    assert g.requires_grad and bias.slots(0, 5, device=torch.device("cpu"), dtype=torch.float32) is not g
