"""T5 / mT5 / UMT5 encoder-decoders (``families/t5.py``) against transformers' eager
``*ForConditionalGeneration`` and ``*Model``: the shared seq2seq checks (teacher-forced logits on
padded batches, encoder states, cached decoding, greedy generation, saved folders, ``to_hf``, half
precision) for every option that changes the math (T5 v1.0's rescaled tied head, v1.1 / Flan's
unscaled one, mT5's never-rescaled head, an untied head, ``num_decoder_layers``, feed-forward kinds,
``d_kv`` heads, head counts that do not divide the width, bucket settings, the shared vs per-layer
relative bias), transformers' own ``generate``, the float16 clamp after the cross-attention, the
kernel hook, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import hf_seq2seq_checks as sc  # noqa: E402
from attnzoo import EncoderDecoder, TransformerEncoder  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.t5 import ScaledLMHead, build_t5, convert_t5  # noqa: E402
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from hf_encoder_checks import check_to_hf, real_rel  # noqa: E402
from hf_family_checks import V, rel  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(cls: Any = T.T5Config, **kw: Any) -> Any:
    base = {"vocab_size": V, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_heads": 4,
            "pad_token_id": sc.PAD, "eos_token_id": sc.EOS, "bos_token_id": 0, "decoder_start_token_id": 0,
            "relative_attention_num_buckets": 8, "relative_attention_max_distance": 10}
    return cls(**{**base, **kw})


def _t5() -> Any:  # T5 v1.0: relu, tied head, hidden states rescaled by d_model ** -0.5
    return _cfg(feed_forward_proj="relu")


def _mt5() -> Any:
    return _cfg(T.MT5Config, feed_forward_proj="gated-gelu")


def _umt5() -> Any:
    return _cfg(T.UMT5Config, feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def _untied(model: Any, seed: int = 0) -> Any:
    """``model`` with its own ``lm_head`` (Flan-T5 / mT5 / UMT5 checkpoints; a model built from a
    config in transformers 5.25 shares the embedding's storage)."""
    g = torch.Generator().manual_seed(100 + seed)
    w = model.lm_head.weight.detach()
    model.lm_head.weight = nn.Parameter(w + torch.randn(w.shape, generator=g) * 0.5)
    return model


#: one transformers model per family here, for the ``to_hf`` export sweep (the encoder-only models
#: keep their ``t5`` / ``mt5`` / ``umt5`` keys in ``test_hf_t5_encoder.SWEEP``)
SWEEP = {"t5_seq2seq": lambda seed: sc.hf_seq2seq(_t5(), T.T5ForConditionalGeneration, seed),
         "mt5_seq2seq": lambda seed: _untied(sc.hf_seq2seq(_mt5(), T.MT5ForConditionalGeneration, seed), seed),
         "umt5_seq2seq": lambda seed: sc.hf_seq2seq(_umt5(), T.UMT5ForConditionalGeneration, seed)}

#: keys left at their config class's default in the configs above
_DROP = ("is_decoder", "layer_norm_epsilon", "feed_forward_proj", "num_decoder_layers")


class TestT5(sc.Seq2SeqChecks):
    config = staticmethod(_t5)
    model = T.T5ForConditionalGeneration
    base = T.T5Model
    cases = (lambda: _cfg(feed_forward_proj="gated-gelu", tie_word_embeddings=False),  # v1.1 / Flan: no rescale
             lambda: _cfg(feed_forward_proj="gated-silu", num_decoder_layers=3),
             lambda: _cfg(num_decoder_layers=1, d_kv=16),  # heads wider than d_model / H
             lambda: _cfg(num_heads=3),  # d_model not divisible by the heads
             lambda: _cfg(relative_attention_num_buckets=6, relative_attention_max_distance=4),
             lambda: _cfg(layer_norm_epsilon=1e-2))
    drop = _DROP


class TestMT5(sc.Seq2SeqChecks):
    config = staticmethod(_mt5)
    model = T.MT5ForConditionalGeneration
    base = T.MT5Model
    cases = (lambda: _cfg(T.MT5Config, tie_word_embeddings=True, num_heads=3),)  # mT5 never rescales
    drop = _DROP


class TestUMT5(sc.Seq2SeqChecks):
    config = staticmethod(_umt5)
    model = T.UMT5ForConditionalGeneration
    base = T.UMT5Model
    cases = (lambda: _cfg(T.UMT5Config, num_layers=3, num_decoder_layers=2, feed_forward_proj="relu"),)  # scaled
    drop = _DROP


def test_one_embedding_and_the_relative_biases_are_shared_as_in_transformers() -> None:
    t5, umt5 = from_hf(SWEEP["t5_seq2seq"](0)), from_hf(SWEEP["umt5_seq2seq"](0))
    assert isinstance(t5, EncoderDecoder) and isinstance(t5.decoder.lm_head, ScaledLMHead)
    assert t5.decoder.tok_emb is t5.encoder.tok_emb and t5.decoder.lm_head.weight is t5.encoder.tok_emb.weight
    assert t5.decoder.lm_head.scale == 32 ** -0.5 and type(umt5.decoder.lm_head) is not ScaledLMHead
    dec = t5.decoder.blocks
    assert dec[0].attn.relative_bias is dec[1].attn.relative_bias and not dec[0].attn.relative_bias.bidirectional
    assert [n for n, _ in t5.named_parameters() if "relative" in n] == [
        "encoder.blocks.0.attn.relative_bias.weight", "decoder.blocks.0.attn.relative_bias.weight"]
    assert len([n for n, _ in umt5.named_parameters() if "relative" in n]) == 4
    assert (t5.decoder_start_token_id, t5.eos_token_id) == (0, sc.EOS)


def test_the_stale_cross_attention_bias_of_old_checkpoints_is_ignored() -> None:
    hf = SWEEP["t5_seq2seq"](0)
    sd = {**hf.state_dict(), "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight": torch.ones(8, 4)}
    model = convert_t5(HFConfig(hf.config.to_dict(), "config.json", "T5"), sd, device=None, dtype=None)
    assert torch.equal(model.decoder.blocks[0].attn.relative_bias.weight,
                       hf.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight)


def test_decoder_start_defaults_to_the_pad_id_and_eos_lists() -> None:
    data = {**_t5().to_dict(), "decoder_start_token_id": None, "eos_token_id": [sc.EOS]}
    model = build_t5(HFConfig(data, "config.json", "T5"), device="meta")
    assert (model.decoder_start_token_id, model.eos_token_id) == (sc.PAD, sc.EOS)
    data["eos_token_id"] = [sc.EOS, 3]  # several end ids: generate takes eos_token_id=
    assert build_t5(HFConfig(data, "config.json", "T5"), device="meta").eos_token_id is None


def test_generate_equals_transformers_generate() -> None:
    """transformers' cached greedy ``generate`` (its own relative bias at offset positions) from the
    config's decoder start token, row by row up to each row's end token."""
    for make, cls in ((_t5, T.T5ForConditionalGeneration), (_umt5, T.UMT5ForConditionalGeneration)):
        hf = sc.hf_seq2seq(make(), cls)
        src, mask = sc.token_source()
        got = from_hf(hf).generate(src, 8, src_mask=mask)
        want = hf.generate(input_ids=src, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=1)
        for row, ref in zip(got.tolist(), want.tolist(), strict=True):
            end = ref.index(sc.EOS, 1) + 1 if sc.EOS in ref[1:] else len(ref)
            assert row[:end] == ref[:end], (row, ref)


def test_an_untied_head_converts_saves_and_exports(tmp_path: Path) -> None:
    """Flan-T5's layout: ``lm_head.weight`` of its own, ``tie_word_embeddings: false`` in the file and
    no ``scale_decoder_outputs`` (older than transformers 5): no rescale, the head kept apart."""
    hf = _untied(sc.hf_seq2seq(_cfg(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
                               T.T5ForConditionalGeneration))
    ours = from_hf(hf)
    assert ours.decoder.lm_head.weight is not ours.encoder.tok_emb.weight
    assert type(ours.decoder.lm_head) is not ScaledLMHead
    src, mask = sc.token_source()
    tgt, tgt_mask = sc.target()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data.pop("scale_decoder_outputs")
    path.write_text(json.dumps({**data, "tie_word_embeddings": False}))
    again = T.T5ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert again.lm_head.weight.data_ptr() != again.shared.weight.data_ptr()
    want = sc.hf_logits(again, {"input_ids": src, "attention_mask": mask}, tgt, tgt_mask)
    for model in (ours, load_pretrained(tmp_path)):
        with torch.no_grad():
            assert real_rel(model(src, tgt, src_mask=mask, tgt_mask=tgt_mask), want, tgt_mask) <= sc.TOL
    check_to_hf(lambda seed: _untied(sc.hf_seq2seq(_mt5(), T.MT5ForConditionalGeneration, seed), seed))


def test_a_saved_bare_model_has_no_head(tmp_path: Path) -> None:
    hf = sc.hf_seq2seq(_umt5(), T.UMT5Model)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert isinstance(model.decoder.lm_head, nn.Identity)
    src, mask = sc.token_source()
    tgt, tgt_mask = sc.target()
    with torch.no_grad():
        got = model(src, tgt, src_mask=mask, tgt_mask=tgt_mask)
    assert real_rel(got, sc.hf_logits(hf, {"input_ids": src, "attention_mask": mask}, tgt, tgt_mask),
                    tgt_mask) <= sc.TOL


def test_encoder_only_checkpoints_still_convert_to_the_encoder() -> None:
    for cfg, cls in ((_t5(), T.T5EncoderModel), (_umt5(), T.UMT5EncoderModel)):
        assert isinstance(from_hf(cls._from_config(cfg)), TransformerEncoder)


def test_float16_overflow_after_the_cross_attention_is_clamped_as_transformers() -> None:
    hf = sc.hf_seq2seq(_mt5(), T.MT5ForConditionalGeneration)
    with torch.no_grad():  # the first decoder layer's cross-attention overflows float16
        hf.decoder.block[0].layer[1].EncDecAttention.o.weight.mul_(3e4)
    ours = from_hf(hf, dtype=torch.float16)
    hf = hf.half()
    src, mask = sc.token_source()
    tgt, tgt_mask = sc.target()
    want = sc.hf_logits(hf, {"input_ids": src, "attention_mask": mask}, tgt, tgt_mask)
    with torch.no_grad():
        got = ours(src, tgt, src_mask=mask, tgt_mask=tgt_mask)
        memory = ours.encode(src, mask)
        h = ours.decoder.blocks[0](ours.decoder.embed(tgt), memory)
    assert h.abs().max() == 64512  # clamped to finfo.max - 1000 inside the block
    real = tgt_mask.bool()
    assert torch.isfinite(got[real]).all() and torch.isfinite(want[real]).all()
    assert real_rel(got, want, tgt_mask) <= 2e-2


def test_cached_decode_of_a_long_target_reaches_the_far_buckets() -> None:
    """Past ``relative_attention_max_distance`` every key shares the last causal bucket."""
    model = from_hf(SWEEP["umt5_seq2seq"](0))
    src, mask = sc.token_source()
    tgt = torch.randint(3, V, (3, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        memory = model.encode(src, mask)
        full = model.decode(tgt, memory, memory_mask=mask)
        cache = model.init_cache(3, 16)
        steps = torch.cat([model.decode(tgt[:, i:i + 1], memory, memory_mask=mask, cache=cache) for i in range(16)], 1)
    assert rel(steps, full) <= sc.TOL
    assert all(c.cross_cache is not None and c.cross_cache.length == src.shape[1] for c in cache)  # projected once


@pytest.mark.parametrize("cls", [T.T5ForQuestionAnswering, T.T5ForSequenceClassification,
                                 T.T5ForTokenClassification])
def test_task_heads_are_refused_by_name(cls: Any) -> None:
    match = cls.__name__.replace("T5For", "")
    with pytest.raises(UnsupportedConfigError, match=match):
        from_hf(cls._from_config(_t5()))


@pytest.mark.parametrize(("key", "value", "match"), [
    ("is_decoder", True, "is_decoder"), ("feed_forward_proj", "gated-relu", "feed_forward_proj"),
    ("relative_attention_max_distance", 2, "max_distance"),
    ("relative_attention_max_distance", 3, "max_distance"),  # the encoder's buckets work, the decoder's causal ones not
    ("model_type", "longt5", "model_type")])
def test_options_without_an_equivalent_are_refused(key: str, value: Any, match: str) -> None:
    data = {**_t5().to_dict(), key: value}
    with pytest.raises(UnsupportedConfigError, match=match):
        build_t5(HFConfig(data, "config.json", "T5"), device="meta")
