"""M2M100 / NLLB-200 (``families/m2m_100.py``) against transformers' eager ``M2M100ForConditionalGeneration``
and ``M2M100Model``: the seq2seq checks (:class:`hf_seq2seq_checks.Seq2SeqChecks`) for every option that
changes the math (tied or untied embeddings, ``scale_embedding``, an odd width, per-stack sizes, the
activation, the pad id), the sinusoidal table, positions counted from the ids (pads inside a target,
left-padded targets, the cache), the length limit and a larger ``max_position_embeddings`` reproducing
transformers' grown table, the float16 clamp, the refusals, and transformers' model with attnzoo's kernels."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.interop import UnsupportedConfigError, from_hf  # noqa: E402
from attnzoo.models.families.m2m_100 import build_m2m_100, convert_m2m_100, fairseq_sinusoidal_table  # noqa: E402
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from hf_encoder_checks import real_rel  # noqa: E402
from hf_family_checks import V, rel  # noqa: E402
from hf_seq2seq_checks import EOS, PAD, Seq2SeqChecks, hf_logits, hf_seq2seq, target, token_source  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")
LM, BASE = T.M2M100ForConditionalGeneration, T.M2M100Model


def _cfg(**kw: Any) -> Any:
    """A tiny M2M100 config: the stacks differ in heads, feed-forward width and depth."""
    base = {"vocab_size": V, "d_model": 32, "encoder_layers": 2, "decoder_layers": 3, "encoder_attention_heads": 4,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 48, "decoder_ffn_dim": 40, "max_position_embeddings": 24,
            "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": 0, "decoder_start_token_id": EOS}
    return T.M2M100Config(**{**base, **kw})


#: one transformers model per ``model_type``, for the ``to_hf`` export sweep
SWEEP = {"m2m_100": lambda seed: hf_seq2seq(_cfg(), LM, seed)}


class TestM2M100(Seq2SeqChecks):
    config = staticmethod(_cfg)
    model = LM
    base = BASE
    kernel_calls = 2 + 3 * 2  # the encoder's 2 layers, the decoder's 3 (self- and cross-attention)
    cases = (lambda: _cfg(tie_word_embeddings=False),  # four separate embeddings, shared unused
             lambda: _cfg(scale_embedding=False),
             lambda: _cfg(d_model=33, encoder_attention_heads=3, decoder_attention_heads=11),  # odd: zero column
             lambda: _cfg(activation_function="gelu"),
             lambda: _cfg(pad_token_id=0))  # the sources' pad slots (id 1) count as real positions
    drop = ("scale_embedding", "activation_function", "tie_word_embeddings", "decoder_start_token_id",
            "pad_token_id", "eos_token_id")
    start = EOS


@pytest.mark.parametrize(("dim", "pad"), [(32, 1), (33, 1), (4, 0), (7, 5)])
def test_table_equals_transformers(dim: int, pad: int) -> None:
    want = T.models.m2m_100.modeling_m2m_100.M2M100SinusoidalPositionalEmbedding.get_embedding(40, dim, pad)
    assert torch.equal(fairseq_sinusoidal_table(40, dim, pad), want)


def test_the_table_is_not_in_the_state_dict_and_untied_models_read_their_own_embeddings() -> None:
    ours = from_hf(hf_seq2seq(_cfg(tie_word_embeddings=False), LM))
    assert not [k for k in ours.state_dict() if "table" in k]
    assert ours.decoder.tok_emb.weight is not ours.encoder.embedding.tok_emb.weight
    tied = from_hf(SWEEP["m2m_100"](0))
    assert tied.decoder.tok_emb.weight is tied.encoder.embedding.tok_emb.weight is tied.decoder.lm_head.weight
    assert (tied.decoder_start_token_id, tied.eos_token_id) == (EOS, EOS)


def test_special_tokens_of_a_config_without_them() -> None:
    data = {k: v for k, v in _cfg().to_dict().items() if k not in ("decoder_start_token_id", "eos_token_id")}
    model = build_m2m_100(HFConfig(data, "test"), device="meta")
    assert (model.decoder_start_token_id, model.eos_token_id) == (2, 2)  # the config class's defaults
    model = build_m2m_100(HFConfig({**data, "decoder_start_token_id": None, "eos_token_id": [2, 5]}, "test"),
                          device="meta")
    assert (model.decoder_start_token_id, model.eos_token_id) == (None, None)


def test_positions_are_counted_from_the_ids() -> None:
    """A pad id inside an unmasked target, a left-padded target with its mask, and a cached decode
    over a pad token: as transformers (which counts the new tokens only with a cache)."""
    hf = SWEEP["m2m_100"](0)
    ours = from_hf(hf)
    src, src_mask = token_source()
    tgt, _ = target(pad=0)
    tgt[:, 3] = PAD  # a pad id in every row, attended to (no mask)
    left = torch.ones_like(tgt)
    left[1, :2] = 0
    tgt[1, :2] = PAD
    inputs = {"input_ids": src, "attention_mask": src_mask}
    with torch.no_grad():
        assert rel(ours(src, tgt, src_mask=src_mask), hf_logits(hf, inputs, tgt, None)) <= 1e-5
        assert real_rel(ours(src, tgt, src_mask=src_mask, tgt_mask=left), hf_logits(hf, inputs, tgt, left),
                        left) <= 1e-5
        memory = ours.encode(src, src_mask)
        cache = ours.init_cache(3, tgt.shape[1])
        got = torch.cat([ours.decode(tgt[:, :2], memory, memory_mask=src_mask, cache=cache)]
                        + [ours.decode(tgt[:, i:i + 1], memory, memory_mask=src_mask, cache=cache)
                           for i in range(2, tgt.shape[1])], dim=1)
        enc = hf.get_encoder()(**inputs)
        r = hf(encoder_outputs=enc, attention_mask=src_mask, decoder_input_ids=tgt[:, :2], use_cache=True)
        steps = [r.logits]
        for i in range(2, tgt.shape[1]):
            r = hf(encoder_outputs=enc, attention_mask=src_mask, decoder_input_ids=tgt[:, i:i + 1],
                   cache=r.cache, use_cache=True)
            steps.append(r.logits)
    assert rel(got, torch.cat(steps, dim=1)) <= 1e-5


def test_sequences_past_max_position_embeddings() -> None:
    """Refused (transformers grows its table); a larger ``max_position_embeddings`` loads the same
    weights and equals transformers' grown table."""
    hf = SWEEP["m2m_100"](0)
    ours = from_hf(hf)
    src = torch.randint(3, V, (2, 30), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(3, V, (2, 28), generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ours.encode(src)
    with pytest.raises(ValueError, match="max_seq_len"):
        ours(src[:, :20], tgt)
    with pytest.raises(ValueError, match="max_seq_len"):
        ours.generate(src[:, :20], 30)
    longer = build_m2m_100(HFConfig({**hf.config.to_dict(), "max_position_embeddings": 40}, "test"))
    longer.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert rel(longer(src, tgt), hf(input_ids=src, decoder_input_ids=tgt).logits) <= 1e-5


def test_float16_encoder_layers_clamp_as_transformers() -> None:
    hf = SWEEP["m2m_100"](0)
    with torch.no_grad():  # the first encoder layer's output overflows float16 (inf) or nears it
        hf.model.encoder.layers[0].fc2.bias[:4] = 1e5
        hf.model.encoder.layers[0].fc2.bias[4:8] = 65000.0
    ours = from_hf(hf, dtype=torch.float16)
    hf = hf.half()
    src, src_mask = token_source()
    with torch.no_grad():
        got, want = ours.encode(src, src_mask), hf.get_encoder()(input_ids=src, attention_mask=src_mask).last_hidden_state
        layer0 = hf.model.encoder.layers[0](hf.model.encoder.embed_tokens(src), None)
        assert layer0.abs().max() == 65504 - 1000  # clamped inside the layer
        assert ours.encoder.blocks[0](ours.encoder.embed(src)).abs().max() == 65504 - 1000
    keep = src_mask.bool()
    assert torch.isfinite(got[keep]).all() and torch.isfinite(want[keep]).all()
    assert real_rel(got, want, src_mask) <= 2e-2


@pytest.mark.parametrize(("key", "value", "named"), [
    ("pad_token_id", None, "pad_token_id=None"), ("decoder_attention_heads", 5, "decoder_attention_heads=5"),
    ("encoder_attention_heads", 3, "encoder_attention_heads=3"), ("d_model", 2, "d_model=2"),
    ("activation_function", "tanh", "activation_function='tanh'")])
def test_refused_by_name(key: str, value: Any, named: str) -> None:
    data = {**_cfg().to_dict(), key: value}
    if key == "d_model":
        data.update(encoder_attention_heads=1, decoder_attention_heads=1)
    with pytest.raises(UnsupportedConfigError, match=named.replace("(", r"\(")):
        build_m2m_100(HFConfig(data, "test", "M2M100"), device="meta")




def test_tied_copies_that_differ_are_refused() -> None:
    """A file whose tied embedding copies differ (transformers would untie them) is refused by name;
    a file with only one copy loads from it."""
    hf = SWEEP["m2m_100"](0)
    data = hf.config.to_dict()
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["model.decoder.embed_tokens.weight"] += 1.0
    with pytest.raises(UnsupportedConfigError, match="tied copies that differ"):
        convert_m2m_100(HFConfig(data, "config.json", "M2M100"), sd, device="cpu", dtype=None)
    only = {k: v for k, v in hf.state_dict().items() if k not in ("model.shared.weight", "lm_head.weight",
                                                                   "model.decoder.embed_tokens.weight")}
    ours = convert_m2m_100(HFConfig(data, "config.json", "M2M100"), only, device="cpu", dtype=None)
    assert torch.equal(ours.encoder.embedding.tok_emb.weight, hf.model.shared.weight)
