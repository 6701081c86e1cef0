"""Marian (opus-mt) and Pegasus (``families/marian.py``) against transformers' eager models: the
:class:`~hf_seq2seq_checks.Seq2SeqChecks` (teacher-forced logits on padded batches, the bare
``*Model``, encoder states, cached decoding, greedy generation, a saved folder, ``to_hf``, half
precision) for every option that changes the math (activations, ``scale_embedding``, Marian's
two vocabularies, untied embeddings, per-stack depths / heads / widths), the split sinusoidal
table against transformers', the ties transformers makes or refuses at load time, the float16
clamps, the refusals, and transformers with attnzoo's attention kernel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_seq2seq_checks as s2s  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families._seq2seq import clamp_float16  # noqa: E402
from attnzoo.models.families.marian import (  # noqa: E402
    VARIANTS,
    build_seq2seq,
    convert_seq2seq,
    split_sinusoidal_table,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from hf_encoder_checks import check_to_hf, real_rel  # noqa: E402
from hf_family_checks import V  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(cls: Any, **kw: Any) -> Any:
    base = {"vocab_size": V, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
            "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 64,
            "pad_token_id": s2s.PAD, "eos_token_id": s2s.EOS, "bos_token_id": 0, "decoder_start_token_id": s2s.PAD}
    return cls(**{**base, **kw})


def _marian(**kw: Any) -> Any:
    """opus-mt's settings: SiLU, embeddings times sqrt(d_model), one shared tied table."""
    return _cfg(T.MarianConfig, **{"activation_function": "swish", "scale_embedding": True, **kw})


def _pegasus(**kw: Any) -> Any:
    """pegasus-large's settings: ReLU, embeddings times sqrt(d_model)."""
    return _cfg(T.PegasusConfig, **{"activation_function": "relu", "scale_embedding": True, **kw})


def _with_bias(hf: Any, seed: int) -> Any:
    """``hf`` with a random ``final_logits_bias`` (a buffer: zeros after ``perturbed``)."""
    if hasattr(hf, "final_logits_bias"):
        with torch.no_grad():
            hf.final_logits_bias.add_(torch.randn(hf.final_logits_bias.shape,
                                                  generator=torch.Generator().manual_seed(seed + 7)))
    return hf


def _make(config: Any, cls: Any, seed: int = 0) -> Any:
    return _with_bias(s2s.hf_seq2seq(config, cls, seed), seed)


#: one transformers model per ``model_type`` added here, for the ``to_hf`` export sweep
SWEEP = {"marian": lambda seed: _make(_marian(), T.MarianMTModel, seed),
         "pegasus": lambda seed: _make(_pegasus(), T.PegasusForConditionalGeneration, seed)}

#: Marian's opus-mt-tc style: two vocabularies (the source's larger), the head tied to the decoder's table
_TWO_VOCABS = {"share_encoder_decoder_embeddings": False, "vocab_size": V + 32, "decoder_vocab_size": V}


class _Checks(s2s.Seq2SeqChecks):
    start = s2s.PAD

    def _make(self, cls: Any = None, config: Any = None, seed: int = 0, dtype: torch.dtype | None = None) -> Any:
        hf = _with_bias(super()._make(cls, config, seed), seed)
        return hf if dtype is None else hf.to(dtype)


class TestMarian(_Checks):
    config = staticmethod(_marian)
    model = T.MarianMTModel
    kernel_calls = 2 + 2 * 2  # the encoder's layers, the decoder's self- and cross-attention
    base = T.MarianModel
    cases = (lambda: _cfg(T.MarianConfig),  # the class defaults: exact GELU, no embedding scale
             lambda: _marian(**_TWO_VOCABS),
             lambda: _marian(tie_word_embeddings=False),  # four separate tables, `shared` unused
             lambda: _marian(**_TWO_VOCABS, tie_word_embeddings=False),
             lambda: _marian(encoder_layers=3, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=8,
                             encoder_ffn_dim=48, decoder_ffn_dim=80),
             lambda: _marian(activation_function="relu"), lambda: _marian(activation_function="gelu_new"))
    # MarianMTModel saves no position tables: the reloaded model and attnzoo both compute them
    drop = ("scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings", "decoder_vocab_size",
            "activation_function", "max_position_embeddings")


class TestPegasus(_Checks):
    config = staticmethod(_pegasus)
    model = T.PegasusForConditionalGeneration
    base = T.PegasusModel
    cases = (lambda: _cfg(T.PegasusConfig), lambda: _pegasus(tie_word_embeddings=False, encoder_layerdrop=0.1,
                                                             decoder_layerdrop=0.2),  # LayerDrop: off in eval
             lambda: _pegasus(encoder_layers=1, decoder_layers=3, encoder_attention_heads=8, decoder_attention_heads=2,
                              encoder_ffn_dim=80, decoder_ffn_dim=48))
    drop = ("scale_embedding", "tie_word_embeddings", "activation_function")


# --------------------------------------------------------------------------- positions
@pytest.mark.parametrize(("positions", "dim"), [(64, 32), (64, 33), (1024, 8)])
def test_position_table_equals_transformers(positions: int, dim: int) -> None:
    """sin in the first half of the channels, cos in the second (not interleaved), bit for bit."""
    want = T.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding(positions, dim).create_weight()
    assert torch.equal(split_sinusoidal_table(positions, dim), want)
    peg = T.models.pegasus.modeling_pegasus.PegasusSinusoidalPositionalEmbedding(positions, dim).create_weight()
    assert torch.equal(peg, want)


def test_the_checkpoints_tables_are_read_and_absent_ones_computed() -> None:
    hf = SWEEP["marian"](0)  # perturbed tables: what transformers' forward uses
    ours = from_hf(hf)
    assert torch.equal(ours.encoder.embedding.positions.weight, hf.model.encoder.embed_positions.weight)
    assert torch.equal(ours.decoder.pos_emb.weight, hf.model.decoder.embed_positions.weight)
    sd = {k: v for k, v in hf.state_dict().items() if "embed_positions" not in k and k != "final_logits_bias"}
    again = convert_seq2seq(HFConfig(hf.config.to_dict(), "config.json", "Marian"), sd, device=None, dtype=None)
    table = split_sinusoidal_table(64, 32)
    assert torch.equal(again.encoder.embedding.positions.weight, table)
    assert torch.equal(again.decoder.pos_emb.weight, table)
    assert not again.decoder.lm_head.bias.any()  # an old file without final_logits_bias: zeros, as transformers
    with pytest.raises(ValueError, match="beyond the table"):
        again.encode(torch.ones(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="64 positions"):
        again.decode(torch.ones(1, 65, dtype=torch.long), torch.zeros(1, 3, 32))


# --------------------------------------------------------------------------- ties
def test_the_tables_are_shared_as_transformers_ties_them() -> None:
    tied = from_hf(SWEEP["marian"](0))
    assert tied.decoder.lm_head.weight is tied.decoder.tok_emb.weight is tied.encoder.embedding.tok_emb.weight
    two = from_hf(_make(_marian(**_TWO_VOCABS), T.MarianMTModel))
    assert two.decoder.lm_head.weight is two.decoder.tok_emb.weight
    assert two.encoder.embedding.tok_emb.weight.shape == (V + 32, 32) and two.decoder.tok_emb.weight.shape == (V, 32)
    untied = from_hf(_make(_pegasus(tie_word_embeddings=False), T.PegasusForConditionalGeneration))
    weights = [untied.encoder.embedding.tok_emb.weight, untied.decoder.tok_emb.weight, untied.decoder.lm_head.weight]
    assert len({id(w) for w in weights}) == 3
    # untied: the four tables written back apart (`shared`, which the forward never reads, kept as it is)
    with pytest.warns(UserWarning, match=r"model\.shared\.weight"):
        check_to_hf(lambda seed: _make(_marian(tie_word_embeddings=False), T.MarianMTModel, seed))


def test_per_stack_sizes_and_norms_follow_transformers() -> None:
    hf = _make(_marian(encoder_layers=3, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=8,
                       encoder_ffn_dim=48, decoder_ffn_dim=80), T.MarianMTModel)
    ours = from_hf(hf)
    assert (ours.encoder.depth, ours.decoder.depth, ours.decoder.num_heads) == (3, 1, 8)
    assert (ours.encoder.blocks[0].attn.num_heads, ours.decoder.blocks[0].cross_attn.num_heads) == (2, 8)
    for model in (ours, from_hf(SWEEP["pegasus"](0))):  # every LayerNorm's epsilon is transformers' (1e-5)
        eps = {m.eps for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
        assert eps == {1e-5}, eps


def test_start_and_end_tokens_clamps_and_pad_rows_follow_the_config() -> None:
    for make, always in ((SWEEP["marian"], False), (SWEEP["pegasus"], True)):
        hf = make(0)
        ours = from_hf(hf)
        assert (ours.decoder_start_token_id, ours.eos_token_id) == (s2s.PAD, s2s.EOS)
        assert all(b.always is always for b in ours.encoder.blocks)
        src, src_mask = s2s.token_source()
        (ours.encode(src, src_mask).sum() + ours.decoder.embed(src).sum()).backward()  # no head: pad rows get none
        for emb in (ours.encoder.embedding.tok_emb, ours.decoder.tok_emb):
            assert emb.padding_idx == s2s.PAD and not emb.weight.grad[s2s.PAD].any() and emb.weight.grad.any()


def test_a_file_with_one_copy_of_the_tied_table_loads() -> None:
    """transformers' symmetric ties: the file may hold any one tensor of the tied group."""
    hf = SWEEP["pegasus"](0)
    for keep in ("model.encoder.embed_tokens.weight", "lm_head.weight"):
        sd = {k: v for k, v in hf.state_dict().items()
              if not (k.endswith("embed_tokens.weight") or k in ("model.shared.weight", "lm_head.weight")) or k == keep}
        ours = convert_seq2seq(HFConfig(hf.config.to_dict(), "config.json", "Pegasus"), sd, device=None, dtype=None,
                               model_type="pegasus")
        assert torch.equal(ours.decoder.lm_head.weight, hf.lm_head.weight)


def test_a_tie_whose_two_tensors_differ_in_the_file_is_not_made(tmp_path: Path) -> None:
    """transformers 5 loads a tied ``lm_head.weight`` that differs from ``shared`` as its own table."""
    from safetensors.torch import load_file, save_file

    hf = SWEEP["marian"](0)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    sd["lm_head.weight"] = sd["model.shared.weight"] + 0.5
    save_file(sd, path, metadata={"format": "pt"})
    theirs = T.MarianMTModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = load_pretrained(tmp_path)
    assert ours.decoder.lm_head.weight is not ours.decoder.tok_emb.weight
    src, src_mask = s2s.token_source()
    tgt, tgt_mask = s2s.target()
    with torch.no_grad():
        got = ours(src, tgt, src_mask=src_mask, tgt_mask=tgt_mask)
    want = s2s.hf_logits(theirs, {"input_ids": src, "attention_mask": src_mask}, tgt, tgt_mask)
    assert real_rel(got, want, tgt_mask) <= 1e-5


# --------------------------------------------------------------------------- float16
def test_float16_clamps_as_transformers() -> None:
    big = torch.tensor([1.0, 7e4, -7e4], dtype=torch.float32).half()  # [1, inf, -inf]
    limit = torch.finfo(torch.float16).max - 1000  # as transformers clamps: 64512 in float16
    assert torch.equal(clamp_float16(big, always=False), torch.clamp(big, min=-limit, max=limit))
    finite = torch.tensor([6.5e4, 1.0]).half()  # above the limit, finite
    assert torch.equal(clamp_float16(finite, always=False), finite)  # Marian: kept
    assert clamp_float16(finite, always=True).tolist() == [64512.0, 1.0]  # Pegasus: clamped
    assert torch.equal(clamp_float16(torch.tensor([7e4]), always=True), torch.tensor([7e4]))  # float32: unchanged
    hf = SWEEP["pegasus"](0)
    with torch.no_grad():  # the first feed-forward overflows float16: Pegasus clamps every layer's output
        hf.model.encoder.layers[0].fc2.weight.mul_(1e5)
    ours = from_hf(hf, dtype=torch.float16)
    hf = hf.half()
    src, src_mask = s2s.token_source()
    with torch.no_grad():
        want = hf.get_encoder()(input_ids=src, attention_mask=src_mask).last_hidden_state
        got = ours.encode(src, src_mask)
        assert hf.model.encoder.layers[0](hf.model.encoder.embed_tokens(src), None).abs().max() == 64512
    keep = src_mask.bool()
    assert torch.isfinite(got[keep]).all() and torch.isfinite(want[keep]).all()
    assert real_rel(got, want, src_mask) <= 2e-2


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("make", "key", "value", "match"), [
    (_marian, "is_decoder", True, "is_decoder"), (_pegasus, "is_encoder_decoder", False, "is_decoder"),
    (_marian, "activation_function", "tanh", "activation_function"),
    (_pegasus, "activation_function", "gelu_fast", "activation_function"),
    (_marian, "decoder_vocab_size", V + 1, "share_encoder_decoder_embeddings"),
    (_marian, "decoder_attention_heads", 5, "decoder_attention_heads")])
def test_options_without_an_equivalent_are_refused(make: Any, key: str, value: Any, match: str) -> None:
    model_type = make().model_type
    data = {**make().to_dict(), key: value}
    with pytest.raises(UnsupportedConfigError, match=match):
        build_seq2seq(HFConfig(data, "config.json", VARIANTS[model_type].name), model_type, device="meta")


def test_the_causal_lm_class_is_refused() -> None:
    with pytest.raises(UnsupportedConfigError, match="is_decoder"):
        from_hf(T.MarianForCausalLM._from_config(_marian()))


def test_class_defaults_are_read_when_the_config_leaves_them_out() -> None:
    """A ``config.json`` with only the model type: Marian's and Pegasus' class defaults (a meta build)."""
    for model_type, cls in (("marian", T.MarianConfig), ("pegasus", T.PegasusConfig)):
        model = build_seq2seq(HFConfig({"model_type": model_type}, "config.json"), model_type, device="meta")
        want = cls()
        assert model.decoder.vocab_size == want.vocab_size and model.decoder.depth == want.decoder_layers
        assert model.decoder_start_token_id == want.decoder_start_token_id
        assert model.eos_token_id == want.eos_token_id
        assert model.decoder.blocks[0].ffn.activation == "gelu"
        assert model.decoder.lm_head.weight is model.decoder.tok_emb.weight is model.encoder.embedding.tok_emb.weight




def test_a_left_padded_target_is_positioned_by_slot_as_transformers_does() -> None:
    """transformers positions the decoder's tokens by slot (``arange``), whatever the target mask."""
    hf = SWEEP["marian"](0)
    ours = from_hf(hf)
    src, src_mask = s2s.token_source()
    tgt, tgt_mask = s2s.target(pad=0)
    tgt_mask[1, :2] = 0  # row 1 left-padded
    with torch.no_grad():
        got = ours(src, tgt, src_mask=src_mask, tgt_mask=tgt_mask)
    want = s2s.hf_logits(hf, {"input_ids": src, "attention_mask": src_mask}, tgt, tgt_mask)
    assert real_rel(got, want, tgt_mask) <= 1e-5
