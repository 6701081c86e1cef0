"""``EncoderDecoder``: an encoder-decoder composed of its two stacks (the seam the Hugging Face
seq2seq families convert to), and ``DecoderParts(positions=...)``: a decoder's absolute positions
as a part. Equivalences: the native ``Transformer`` is an ``EncoderDecoder`` of its own stacks
(same outputs), cached decoding and ``generate`` from a ``decoder_prompt`` equal the full forward,
a positions part equals the table it stands for; and every bad argument refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnzoo as az
from attnzoo.models import (
    DecoderConfig,
    DecoderParts,
    EncoderConfig,
    EncoderDecoder,
    TransformerEncoder,
)
from attnzoo.nn.positional import LearnedPositionalEmbedding

V, C, L, H = 40, 16, 2, 4
pytestmark = pytest.mark.usefixtures("one_thread")


class NormedPositions(LearnedPositionalEmbedding):
    """A learned table followed by a LayerNorm (BART's ``layernorm_embedding``)."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__(dim, max_len)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *, offset: int = 0) -> torch.Tensor:
        return self.norm(super().forward(x, positions, offset=offset))


def _decoder(positions: nn.Module | None = None, cross: bool = True, pos: str = "learned") -> az.DecoderLM:
    cfg = DecoderConfig(V, C, L, H, pos=pos, max_seq_len=32)
    return az.DecoderLM.with_blocks(cfg, lambda b, _: b.replace(cross_attention=cross),
                                    parts=DecoderParts(positions=positions))


def _model(**kw: object) -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder(TransformerEncoder(config=EncoderConfig(V, C, L, H)), _decoder(NormedPositions(C, 32)),
                          **kw).eval()  # type: ignore[arg-type]


def _src() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    return src, mask


def test_the_native_transformer_is_an_encoder_decoder_of_its_stacks() -> None:
    torch.manual_seed(0)
    native = az.Transformer(V, V, C, H, 1, L, dropout=0.0).eval()
    assert isinstance(native, EncoderDecoder)
    composed = EncoderDecoder(native.encoder, native.decoder).eval()
    src, mask = _src()
    tgt = torch.randint(3, V, (2, 5))
    with torch.no_grad():
        assert torch.equal(composed(src, tgt, src_mask=mask), native(src, tgt, src_mask=mask))
        assert torch.equal(composed.generate(src, 4, bos_token_id=0, src_mask=mask),
                           native.generate(src, 4, bos_token_id=0, src_mask=mask))


def test_cached_decoding_equals_the_full_forward() -> None:
    model = _model()
    src, mask = _src()
    tgt = torch.randint(3, V, (2, 7))
    with torch.no_grad():
        memory = model.encode(src, mask)
        full = model.decode(tgt, memory, memory_mask=mask)
        cache = model.init_cache(2, 7)
        steps = [model.decode(tgt[:, :3], memory, memory_mask=mask, cache=cache)]
        steps += [model.decode(tgt[:, i:i + 1], memory, memory_mask=mask, cache=cache) for i in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_generate_from_a_decoder_prompt_is_greedy_decoding_of_the_full_forward() -> None:
    model = _model(decoder_start_token_id=0)
    src, mask = _src()
    prompt = torch.tensor([[0, 5, 6], [0, 7, 8]])
    with torch.no_grad():
        got = model.generate(src, 5, src_mask=mask, decoder_prompt=prompt)
        ys = prompt
        for _ in range(5):
            ys = torch.cat([ys, model(src, ys, src_mask=mask)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(got, ys)
        # the model's start token is the default start; its eos the default end
        start = model.generate(src, 3, src_mask=mask)
        assert start.shape == (2, 4) and bool((start[:, 0] == 0).all())


def test_generate_stops_at_the_models_end_token() -> None:
    model = _model(decoder_start_token_id=0)
    src, mask = _src()
    with torch.no_grad():
        first = int(model.generate(src, 1, src_mask=mask)[0, 1])
        stopping = _model(decoder_start_token_id=0, eos_token_id=first)
        out = stopping.generate(src, 6, src_mask=mask)
    assert out[0, 1] == first and bool((out[0, 1:] == first).all())


def test_a_positions_part_equals_the_table_it_stands_for() -> None:
    torch.manual_seed(0)
    plain = _decoder()
    table = LearnedPositionalEmbedding(C, 32)
    part = _decoder(table)
    part.load_state_dict(plain.state_dict())
    assert part.pos_emb is table
    tokens = torch.randint(0, V, (2, 6))
    context = torch.randn(2, 4, C)
    with torch.no_grad():
        assert torch.equal(part(tokens, context=context), plain(tokens, context=context))


def test_a_given_positions_part_keeps_its_weights() -> None:
    table = LearnedPositionalEmbedding(C, 32)
    with torch.no_grad():
        table.weight.fill_(0.25)
    assert bool((_decoder(table).pos_emb.weight == 0.25).all())


@pytest.mark.parametrize("pos", ["rope", "none"])
def test_a_positions_part_needs_an_absolute_position_kind(pos: str) -> None:
    with pytest.raises(ValueError, match=f"parts.positions .*pos={pos!r}"):
        _decoder(LearnedPositionalEmbedding(C, 32), pos=pos)


def test_positions_part_must_be_a_module() -> None:
    with pytest.raises(TypeError, match=r"positions must be an nn\.Module"):
        DecoderParts(positions=lambda x, p: x)  # type: ignore[arg-type]


def test_bad_stacks_are_refused_by_name() -> None:
    enc = TransformerEncoder(config=EncoderConfig(V, C, L, H))
    with pytest.raises(TypeError, match=r"encoder must be an nn\.Module"):
        EncoderDecoder("encoder", _decoder())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decoder must be a DecoderLM whose blocks have cross-attention"):
        EncoderDecoder(enc, _decoder(cross=False))
    with pytest.raises(TypeError, match="decoder must be a DecoderLM"):
        EncoderDecoder(enc, nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decoder_start_token_id must be < the decoder's vocab_size=40"):
        EncoderDecoder(enc, _decoder(), decoder_start_token_id=V)
    with pytest.raises(ValueError, match="eos_token_id"):
        EncoderDecoder(enc, _decoder(), eos_token_id=-1)


def test_bad_generate_arguments_are_refused_by_name() -> None:
    model = _model()
    src, mask = _src()
    with pytest.raises(ValueError, match="bos_token_id is required"):
        model.generate(src, 2)
    with pytest.raises(ValueError, match="bos_token_id or decoder_prompt, not both"):
        model.generate(src, 2, bos_token_id=0, decoder_prompt=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"decoder_prompt must be \[B, P\]"):
        model.generate(src, 2, decoder_prompt=torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"decoder_prompt must have shape \[B, N\] with N >= 1"):
        model.generate(src, 2, decoder_prompt=torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="bos_token_id must be < 40"):
        model.generate(src, 2, bos_token_id=V)
    with pytest.raises(ValueError, match="src must hold at least one row"):
        model.generate(src[:0], 2, bos_token_id=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(src, 40, bos_token_id=0)
    with pytest.raises(ValueError, match="src_mask"):
        model.generate(src, 2, bos_token_id=0, src_mask=mask[:, :4])


def test_a_non_token_encoder_takes_any_source_tensor() -> None:
    class Features(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3, C)

        def forward(self, src: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            return self.proj(src.transpose(1, 2))  # [B, 3, T] -> [B, T, C]

    torch.manual_seed(0)
    model = EncoderDecoder(Features(), _decoder(), decoder_start_token_id=0).eval()
    feats = torch.randn(2, 3, 5)
    assert model.generate(feats, 3).shape == (2, 4)
    with pytest.raises(ValueError, match=r"src must be a tensor \[B, \.\.\.\]"):
        model.generate(feats[0, 0], 3)


def test_loss_is_the_cross_entropy_of_the_labels_shifted_behind_the_start_token() -> None:
    model = _model(decoder_start_token_id=0)
    src, mask = _src()
    labels = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(3))
    labels[0, 4:] = -100  # right padding: not counted
    tgt_in = torch.cat([torch.zeros(2, 1, dtype=torch.long), labels[:, :-1].clamp(min=0)], dim=1)
    logits = model(src, tgt_in, src_mask=mask)
    keep = labels != -100
    want = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(model.loss(src, labels, src_mask=mask), want)
    torch.testing.assert_close(model.loss(src, labels, src_mask=mask, decoder_input=tgt_in), want)


def test_bad_loss_arguments_are_refused_by_name() -> None:
    src = _src()[0]
    labels = torch.randint(3, V, (2, 6))
    with pytest.raises(ValueError, match="no decoder_start_token_id; pass decoder_input"):
        _model().loss(src, labels)
    model = _model(decoder_start_token_id=0)
    with pytest.raises(ValueError, match=r"labels must be integer token ids \[B, N\]"):
        model.loss(src, labels.float())
    with pytest.raises(ValueError, match="decoder_input must have the labels' shape"):
        model.loss(src, labels, decoder_input=labels[:, :3])
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 40\) or ignore_index=-100"):
        model.loss(src, labels.masked_fill(labels == labels[0, 0], V))
    with pytest.raises(TypeError, match="ignore_index"):
        model.loss(src, labels, ignore_index=1.5)  # type: ignore[arg-type]
    bare = EncoderDecoder(model.encoder, az.DecoderLM.with_blocks(
        DecoderConfig(V, C, L, H), lambda b, _: b.replace(cross_attention=True), parts=DecoderParts(head=nn.Identity())),
        decoder_start_token_id=0)
    with pytest.raises(ValueError, match="no LM head"):
        bare.loss(src, labels)
