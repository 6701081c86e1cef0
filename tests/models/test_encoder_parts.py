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
    with pytest.raises(ValueError, match="mlm_head=True builds the head"):
        TransformerEncoder(config=CFG, parts=EncoderParts(mlm=nn.Identity()))
    enc = TransformerEncoder(config=cfg, parts=EncoderParts(embedding=nn.Identity()))
    with pytest.raises(ValueError, match="no token types"):
        enc(torch.zeros(1, 3, dtype=torch.long), token_type_ids=torch.zeros(1, 3, dtype=torch.long))
