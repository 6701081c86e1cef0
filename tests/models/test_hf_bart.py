"""BART, mBART and PLBART (``families/bart.py``) against transformers' eager models: the seq2seq checks
per family (teacher-forced logits, the bare model, encoder states, cached decoding, greedy generation,
saved folders, ``to_hf``, half precision) for every option that changes the math (post- vs pre-norm,
``scale_embedding``, activations, stacks of different depth / heads / width, untied embeddings), the
offset positions on left-padded rows, the float16 clamp, files holding only the tied copies,
``*ForSequenceClassification``, the kernel hook, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.interop import UnsupportedConfigError, from_hf  # noqa: E402
from attnzoo.models.families.bart import Seq2SeqClassifier, convert_bart, shift_tokens_right  # noqa: E402
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from hf_encoder_checks import check_to_hf, real_rel  # noqa: E402
from hf_family_checks import V  # noqa: E402
from hf_seq2seq_checks import EOS, PAD, Seq2SeqChecks, hf_logits, hf_seq2seq, target, token_source  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

SIZES: dict[str, Any] = {
    "vocab_size": V, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 48, "decoder_ffn_dim": 48, "max_position_embeddings": 24,
    "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": 0}
#: every option of the stacks' shapes at once: deeper encoder, other heads and widths per stack
UNEVEN: dict[str, Any] = {"encoder_layers": 3, "decoder_layers": 1, "encoder_attention_heads": 2,
                          "decoder_attention_heads": 8, "encoder_ffn_dim": 40, "decoder_ffn_dim": 56}
#: keys left at their config class's defaults (a config.json may leave them out)
DROP = ("activation_function", "dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop",
        "decoder_layerdrop", "tie_word_embeddings", "pad_token_id", "eos_token_id")


def _bart(**kw: Any) -> Any:
    return T.BartConfig(**{**SIZES, **kw})


def _mbart(**kw: Any) -> Any:
    return T.MBartConfig(**{**SIZES, "decoder_start_token_id": EOS, **kw})


def _plbart(**kw: Any) -> Any:
    return T.PLBartConfig(**{**SIZES, **kw})


def _biased(hf: Any, seed: int) -> Any:
    """``hf`` with its ``final_logits_bias`` buffer (zeros at init, not perturbed) set to noise."""
    bias = getattr(hf, "final_logits_bias", None)
    if bias is not None:
        with torch.no_grad():
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(seed + 7)))
    return hf


def _hf(config: Any, cls: Any, seed: int = 0) -> Any:
    return _biased(hf_seq2seq(config, cls, seed), seed)


#: ``model_type`` -> a maker of a transformers model ``seed`` (the ``to_hf`` export sweep)
SWEEP = {"bart": lambda seed: _hf(_bart(), T.BartForConditionalGeneration, seed),
         "mbart": lambda seed: _hf(_mbart(), T.MBartForConditionalGeneration, seed),
         "plbart": lambda seed: _hf(_plbart(), T.PLBartForConditionalGeneration, seed)}


class _Checks(Seq2SeqChecks):
    start = EOS
    drop = DROP

    def _make(self, cls: Any = None, config: Any = None, seed: int = 0, dtype: torch.dtype | None = None) -> Any:
        hf = _biased(super()._make(cls, config, seed), seed)
        return hf if dtype is None else hf.to(dtype)


class TestBart(_Checks):
    config = staticmethod(_bart)
    model, base = T.BartForConditionalGeneration, T.BartModel
    cases = (lambda: _bart(activation_function="relu", scale_embedding=True, **UNEVEN),
             lambda: _bart(activation_function="gelu_new", tie_word_embeddings=False),
             lambda: _bart(activation_function="silu", encoder_layerdrop=0.1, decoder_layerdrop=0.2))
    drop = (*DROP, "scale_embedding", "decoder_start_token_id")


class TestMBart(_Checks):
    config = staticmethod(_mbart)
    model, base = T.MBartForConditionalGeneration, T.MBartModel
    kernel_calls = 2 + 2 * 2  # the encoder's layers, the decoder's self- and cross-attention
    cases = (lambda: _mbart(scale_embedding=True, activation_function="quick_gelu", **UNEVEN),
             lambda: _mbart(tie_word_embeddings=False))
    drop = (*DROP, "scale_embedding")


class TestPLBart(_Checks):
    config = staticmethod(_plbart)
    model, base = T.PLBartForConditionalGeneration, T.PLBartModel
    cases = (lambda: _plbart(scale_embedding=False, **UNEVEN),)
    drop = (*DROP, "scale_embedding")


@pytest.mark.parametrize("make", [_bart, _mbart], ids=["bart", "mbart"])
def test_positions_are_the_slots_on_a_left_padded_target(make: Any) -> None:
    """transformers' decoder positions are ``arange`` whatever ``decoder_attention_mask`` says: a
    left-padded target's first real token sits at its slot (the source's likewise: ``token_source``
    has a left-padded row)."""
    hf = _hf(make(), T.BartForConditionalGeneration if make is _bart else T.MBartForConditionalGeneration)
    ours = from_hf(hf)
    src, src_mask = token_source()
    tgt, tgt_mask = target(pad=0)
    tgt_mask[1, :3] = 0
    tgt = tgt.masked_fill(tgt_mask == 0, PAD)
    with torch.no_grad():
        got = ours(src, tgt, src_mask=src_mask, tgt_mask=tgt_mask)
    want = hf_logits(hf, {"input_ids": src, "attention_mask": src_mask}, tgt, tgt_mask)
    assert real_rel(got, want, tgt_mask) <= 1e-5


def test_one_shared_embedding_and_the_tables_offset() -> None:
    hf = SWEEP["bart"](0)
    ours = from_hf(hf)
    emb = ours.encoder.embedding.tok_emb.weight
    assert emb is ours.decoder.tok_emb.weight and emb is ours.decoder.lm_head.weight
    assert torch.equal(ours.decoder.pos_emb.table.weight, hf.model.decoder.embed_positions.weight[2:])
    assert torch.equal(ours.decoder.lm_head.bias, hf.final_logits_bias[0])
    untied = from_hf(_hf(_bart(tie_word_embeddings=False), T.BartForConditionalGeneration))
    assert len({id(p) for p in (untied.encoder.embedding.tok_emb.weight, untied.decoder.tok_emb.weight,
                                untied.decoder.lm_head.weight)}) == 3


def test_generation_defaults_come_from_the_config_or_its_class() -> None:
    data = {k: v for k, v in _bart().to_dict().items() if k not in ("decoder_start_token_id", "eos_token_id")}
    sd = SWEEP["bart"](0).state_dict()
    ours = convert_bart(HFConfig(data, "config.json", "BART"), sd, device="meta", dtype=None)
    assert (ours.decoder_start_token_id, ours.eos_token_id) == (2, 2)  # BartConfig's: </s>
    ours = convert_bart(HFConfig({**data, "decoder_start_token_id": 5, "eos_token_id": 3}, "config.json", "BART"), sd,
                        device="meta", dtype=None)
    assert (ours.decoder_start_token_id, ours.eos_token_id) == (5, 3)


def _convert(hf: Any, sd: dict[str, torch.Tensor]) -> Any:
    return convert_bart(HFConfig(hf.config.to_dict(), "config.json", "BART"), sd, device=None, dtype=None)


def test_a_file_with_only_a_tied_copy_or_without_the_logits_bias_loads() -> None:
    hf = SWEEP["bart"](0)
    sd = {k: v for k, v in hf.state_dict().items()
          if k not in ("model.shared.weight", "model.encoder.embed_tokens.weight", "final_logits_bias")}
    ours = _convert(hf, sd)
    assert torch.equal(ours.encoder.embedding.tok_emb.weight, hf.model.shared.weight)
    assert not ours.decoder.lm_head.bias.any()  # transformers' _keys_to_ignore_on_load_missing: zeros
    sd = dict(hf.state_dict())
    sd["model.decoder.embed_tokens.weight"] = sd["model.decoder.embed_tokens.weight"] + 1.0
    with pytest.raises(UnsupportedConfigError, match="tied copies that differ"):
        _convert(hf, sd)


@pytest.mark.parametrize("make,cls", [(_bart, T.BartModel), (_mbart, T.MBartModel)], ids=["bart", "mbart"])
def test_float16_overflow_is_clamped_as_transformers(make: Any, cls: Any) -> None:
    """The encoder layers clamp to ``finfo.max - 1000`` in float16 (BART when a value overflowed,
    mBART always)."""
    hf = hf_seq2seq(make(), cls)
    layer = hf.encoder.layers[-1]
    with torch.no_grad():
        if make is _bart:  # post-norm: the final LayerNorm's scale overflows the layer's output
            layer.final_layer_norm.weight.mul_(3e5)
        else:  # pre-norm: the residual stream passes finfo.max - 1000 (finite: clamped all the same)
            layer.fc2.bias.fill_(65000.0)
    ours = from_hf(hf, dtype=torch.float16)
    hf = hf.half()
    seen: list[torch.Tensor] = []
    layer.register_forward_hook(lambda _m, _i, out: seen.append(out))
    ours.encoder.blocks[-1].register_forward_hook(lambda _m, _i, out: seen.append(out))
    src, src_mask = token_source()
    with torch.no_grad():
        want = hf.encoder(input_ids=src, attention_mask=src_mask).last_hidden_state
        got = ours.encode(src, src_mask)
    for out in seen:  # transformers' layer, then attnzoo's block: clamped inside
        assert out[src_mask.bool()].abs().max() == torch.finfo(torch.float16).max - 1000
    real = src_mask.bool()
    assert torch.isfinite(got[real]).all() and torch.isfinite(want[real]).all()
    assert real_rel(got, want, src_mask) <= 2e-2


def test_shift_tokens_right_equals_transformers() -> None:
    ids = torch.tensor([[5, 6, 2, 9, 1, 1], [7, 8, 9, 2, 4, 3]])
    want = T.models.bart.modeling_bart.shift_tokens_right(ids, 1, 2)
    assert torch.equal(shift_tokens_right(ids, 1, 2), want)
    want = T.models.mbart.modeling_mbart.shift_tokens_right(ids.clone(), 1)
    assert torch.equal(shift_tokens_right(ids, 1, None), want)


def _labelled(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, mask)`` whose rows each hold two end tokens (the last one read), the first row right-padded."""
    src, mask = token_source(pad=0, seed=seed)
    src[0, 6], src[0, 7:], mask[0, 7:] = EOS, PAD, 0
    src[1, 9] = src[2, 9] = EOS
    src[:, 2] = EOS
    return src, mask


@pytest.mark.parametrize("make,cls", [(_bart, T.BartForSequenceClassification),
                                      (_mbart, T.MBartForSequenceClassification)], ids=["bart", "mbart"])
def test_sequence_classification_equals_transformers(make: Any, cls: Any) -> None:
    # mBART-50 sets decoder_start_token_id=2, which its classifier's shift ignores: each row's last
    # token (a language id after the end token) goes first
    cfg = make(num_labels=3, decoder_start_token_id=EOS)
    hf = _hf(cfg, cls)
    ours = from_hf(hf)
    assert isinstance(ours, Seq2SeqClassifier)
    src, mask = _labelled()
    if make is _mbart:
        src[0, 7], mask[0, 7] = 9, 1
        src[1:, 8], src[1:, 9] = EOS, 9
    with torch.no_grad():
        got = ours.classify(src, mask)
        want = hf(input_ids=src, attention_mask=mask).logits
    assert real_rel(got[:, None], want[:, None], torch.ones(3, 1)) <= 1e-5
    check_to_hf(lambda seed: _hf(cfg, cls, seed))
    src[1] = src[1].masked_fill(src[1] == EOS, 7)  # a row without the end token
    with pytest.raises(ValueError, match="end token"):
        ours.classify(src, mask)


@pytest.mark.parametrize("cls", [T.BartForCausalLM, T.BartForQuestionAnswering, T.MBartForCausalLM])
def test_other_heads_are_refused_by_name(cls: Any) -> None:
    cfg = _mbart() if cls is T.MBartForCausalLM else _bart()
    with pytest.raises(UnsupportedConfigError, match=r"ForCausalLM|ForQuestionAnswering"):
        from_hf(cls._from_config(cfg))


@pytest.mark.parametrize(("key", "value", "match"), [
    ("activation_function", "tanh", "activation_function"), ("is_decoder", True, "is_decoder")])
def test_options_without_an_equivalent_are_refused(key: str, value: Any, match: str) -> None:
    data = {**_bart().to_dict(), key: value}
    hf = SWEEP["bart"](0)
    with pytest.raises(UnsupportedConfigError, match=match):
        convert_bart(HFConfig(data, "config.json", "BART"), hf.state_dict(), device="meta", dtype=None)


def test_a_classifier_with_several_end_tokens_is_refused() -> None:
    hf = _hf(_bart(num_labels=2), T.BartForSequenceClassification)
    data = {**hf.config.to_dict(), "eos_token_id": [2, 3]}
    with pytest.raises(UnsupportedConfigError, match="eos_token_id"):
        convert_bart(HFConfig(data, "config.json", "BART"), hf.state_dict(), device="meta", dtype=None)
