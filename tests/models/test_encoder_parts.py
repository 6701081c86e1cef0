"""``TransformerEncoder(parts=EncoderParts(...))``: given modules are used as they are and give the
same encoder as the config's own when they are the same modules; bad parts are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from attnzoo import TransformerEncoder
from attnzoo.models import EncoderConfig, EncoderParts

CFG = EncoderConfig(50, 32, 2, 4, max_seq_len=16, type_vocab_size=2, norm_first=False, pooler=True, num_labels=3,
                    mlm_head=True)


class _Embed(nn.Module):
    """The default path's embedding, as one part (same weights, same order of operations)."""

    def __init__(self, ref: TransformerEncoder) -> None:
        super().__init__()
        self.tok, self.pos, self.typ, self.norm = ref.tok_emb, ref.pos_emb, ref.type_emb, ref.embed_norm

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None, positions: Tensor | None) -> Tensor:
        x = self.pos(self.tok(tokens), positions)
        types = torch.zeros_like(tokens) if token_type_ids is None else token_type_ids
        return self.norm(x + self.typ(types))


class _Classifier(nn.Module):
    def __init__(self, ref: TransformerEncoder) -> None:
        super().__init__()
        self.ref = ref

    def forward(self, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        return self.ref.classify(hidden)


def _pair() -> tuple[TransformerEncoder, TransformerEncoder]:
    torch.manual_seed(0)
    ref = TransformerEncoder(config=CFG).eval()
    parts = EncoderParts(embedding=_Embed(ref), blocks=list(ref.blocks), norm=ref.norm, mlm=ref.mlm,
                         classifier=_Classifier(ref))
    ours = TransformerEncoder(config=CFG.replace(mlm_head=False, num_labels=0, pooler=False), parts=parts).eval()
    return ref, ours


def test_given_parts_are_used_as_they_are() -> None:
    ref, ours = _pair()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    types = (torch.arange(9) > 4).long().expand(2, 9)
    want = ref(tokens, attention_mask=mask, token_type_ids=types)
    got = ours(tokens, attention_mask=mask, token_type_ids=types)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(ours.mlm_logits(got), ref.mlm_logits(want), rtol=0, atol=0)
    torch.testing.assert_close(ours.classify(got, mask), ref.classify(want), rtol=0, atol=0)
    assert ours.tok_emb is None and ours.pos_emb is None and ours.type_emb is None
    assert isinstance(ours.embed_norm, nn.Identity)
    # the parts keep their weights (no re-initialisation by the encoder)
    assert ours.blocks[0] is ref.blocks[0]


def test_block_factory_and_positions_reach_given_blocks() -> None:
    seen: list[Tensor | None] = []

    class Probe(nn.Module):
        def forward(self, x: Tensor, *, key_padding: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
            seen.append(positions)
            return x

    enc = TransformerEncoder(config=EncoderConfig(50, 32, 3, 4, pos="none"), parts=EncoderParts(blocks=lambda i: Probe()))
    pos = torch.arange(5)[None] + 7
    enc(torch.zeros(1, 5, dtype=torch.long), positions=pos)
    assert len(seen) == 3 and all(p is pos for p in seen)


def test_bad_parts_are_refused() -> None:
    cfg = EncoderConfig(50, 32, 2, 4)
    with pytest.raises(TypeError, match="parts must be an EncoderParts"):
        TransformerEncoder(config=cfg, parts={"blocks": []})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EncoderParts: mlm must be an nn"):
        EncoderParts(mlm="head")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EncoderParts: blocks must be a list"):
        EncoderParts(blocks=nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"depth=2 nn\.Module entries"):
        TransformerEncoder(config=cfg, parts=EncoderParts(blocks=[nn.Identity()]))
    with pytest.raises(ValueError, match=r"dim \(30\) must be divisible by num_heads \(4\)"):
        TransformerEncoder(config=EncoderConfig(50, 30, 2, 4))
    TransformerEncoder(config=EncoderConfig(50, 30, 2, 4), parts=EncoderParts(blocks=[nn.Identity()] * 2))
    with pytest.raises(ValueError, match="mlm_head=True builds the head"):
        TransformerEncoder(config=CFG, parts=EncoderParts(mlm=nn.Identity()))
    enc = TransformerEncoder(config=cfg, parts=EncoderParts(embedding=nn.Identity()))
    with pytest.raises(ValueError, match="no token types"):
        enc(torch.zeros(1, 3, dtype=torch.long), token_type_ids=torch.zeros(1, 3, dtype=torch.long))


def _ragged(seed: int = 2) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 3, 0, 12, 1])
    mask = torch.arange(12)[None] < lengths[:, None]
    return torch.randint(0, 50, (5, 12), generator=g).masked_fill(~mask, 0), mask


@pytest.mark.parametrize("pooling", ["mean", "max", "cls"])
@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_packed_encode_equals_the_padded_forward(pooling: str, pos: str) -> None:
    torch.manual_seed(0)
    enc = TransformerEncoder(config=CFG.replace(pos=pos, mlm_head=False, num_labels=0)).eval()
    x, mask = _ragged()
    types = (torch.arange(12) > 5).long().expand(5, 12)
    with torch.no_grad():
        want = enc.encode(x, mask, pooling=pooling, token_type_ids=types, packed=False)
        got = enc.encode(x, mask, pooling=pooling, token_type_ids=types, packed=True)
    real = mask.any(1)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    assert not got[~real].any()  # a row without tokens pools to zeros


def test_packed_forward_is_each_sequence_alone() -> None:
    torch.manual_seed(0)
    enc = TransformerEncoder(config=EncoderConfig(50, 32, 2, 4, type_vocab_size=2)).eval()
    seqs = [torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 1, 8)]
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    with torch.no_grad():
        packed = enc(torch.cat(seqs, 1), cu_seqlens=cu)
        alone = torch.cat([enc(s) for s in seqs], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


def test_packed_input_is_refused_where_it_cannot_be_exact() -> None:
    enc = TransformerEncoder(config=EncoderConfig(50, 32, 2, 4, max_seq_len=8))
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    x = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="takes no attention_mask or positions"):
        enc(x, cu_seqlens=cu, attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="longer than the model's 8 positions"):
        enc(torch.zeros(1, 9, dtype=torch.long), cu_seqlens=torch.tensor([0, 9], dtype=torch.int32))
    given = TransformerEncoder(config=EncoderConfig(50, 32, 2, 4), parts=EncoderParts(embedding=nn.Embedding(50, 32)))
    assert not given.packable
    with pytest.raises(ValueError, match="a given embedding"):
        given(x, cu_seqlens=cu)
    left = torch.ones(2, 4, dtype=torch.bool)
    left[0, 0] = False
    with pytest.raises(ValueError, match="right-padded: False"):
        enc.encode(torch.zeros(2, 4, dtype=torch.long), left, packed=True)
    with pytest.raises(ValueError, match="needs an attention_mask"):
        enc.encode(torch.zeros(2, 4, dtype=torch.long), packed=True)
    with pytest.raises(TypeError, match="packed must be a bool or None"):
        enc.encode(torch.zeros(2, 4, dtype=torch.long), left, packed="yes")  # type: ignore[arg-type]


def test_first_token_classifier_and_pool_refuse_bad_arguments() -> None:
    from attnzoo.models.encoder import FirstTokenClassifier

    with pytest.raises(ValueError, match="FirstTokenClassifier: activation"):
        FirstTokenClassifier(8, 2, activation="nope")
    with pytest.raises(ValueError, match="must not be gated"):
        FirstTokenClassifier(8, 2, activation="swiglu")
    with pytest.raises(ValueError, match="num_labels"):
        FirstTokenClassifier(8, 0)
    with pytest.raises(ValueError, match="dropout"):
        FirstTokenClassifier(8, 2, dropout=1.5)
    with pytest.raises(ValueError, match="pooling"):
        TransformerEncoder.pool(torch.zeros(1, 2, 8), None, "median")
    enc = TransformerEncoder(config=EncoderConfig(50, 32, 1, 4, type_vocab_size=2))
    x, mask = _ragged()
    with pytest.raises(ValueError, match="token_type_ids shape"):
        enc.encode(x, mask, token_type_ids=torch.zeros(5, 11, dtype=torch.long))


def test_family_parts_refuse_bad_arguments() -> None:
    from attnzoo.models.encoder import FactorisedMLMHead
    from attnzoo.models.families.bert_kin import albert_blocks
    from attnzoo.models.families.deberta import log_buckets
    from attnzoo.models.families.mpnet import PaddingOffsetEmbedding

    with pytest.raises(ValueError, match="FactorisedMLMHead: activation"):
        FactorisedMLMHead(8, 8, 10, activation="nope", eps=1e-5)
    with pytest.raises(ValueError, match="must not be gated"):
        FactorisedMLMHead(8, 8, 10, activation="swiglu", eps=1e-5)
    cfg = EncoderConfig(50, 32, 2, 4)
    with pytest.raises(ValueError, match="groups"):
        albert_blocks(cfg, 0, 1, 2, device=None, dtype=None)
    with pytest.raises(ValueError, match="groups that never run"):
        albert_blocks(cfg, 3, 1, 2, device=None, dtype=None)
    with pytest.raises(ValueError, match="buckets"):
        log_buckets(torch.arange(4), 1, 16)
    with pytest.raises(ValueError, match="max_positions"):
        log_buckets(torch.arange(4), 8, 5)
    with pytest.raises(ValueError, match="padding_idx"):
        PaddingOffsetEmbedding(10, 8, 12, 1, padding_idx=-1, norm_eps=1e-5)
