"""The model constructors' public signatures: explicit keywords, no ``**kwargs``, at most 12
parameters; a misspelt or removed keyword is a ``TypeError`` naming it."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import attnzoo as az

CONSTRUCTORS = [az.DecoderLM, az.TransformerEncoder, az.Transformer, az.VisionTransformer, az.TransformerBlock]


@pytest.mark.parametrize("cls", CONSTRUCTORS, ids=lambda c: c.__name__)
def test_constructor_takes_explicit_keywords_only(cls: type) -> None:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # self
    kinds = {p.name: p.kind for p in params}
    assert inspect.Parameter.VAR_KEYWORD not in kinds.values(), f"{cls.__name__} takes **kwargs: {kinds}"
    assert inspect.Parameter.VAR_POSITIONAL not in kinds.values(), f"{cls.__name__} takes *args: {kinds}"
    assert len(params) <= 12, f"{cls.__name__} has {len(params)} parameters: {list(kinds)}"
    assert "config" in kinds and "device" in kinds and "dtype" in kinds


@pytest.mark.parametrize(("build", "name"), [
    (lambda: az.DecoderLM(50, 16, 1, 2, nmu_heads=2), "nmu_heads"),
    (lambda: az.DecoderLM(50, 16, 1, 2, norm="rms"), "norm"),  # a config field: through config=
    (lambda: az.TransformerEncoder(50, 16, 1, 2, norm_first=False), "norm_first"),
    (lambda: az.Transformer(50, 50, 16, 2, 1, 1, ffn_hidden=32), "ffn_hidden"),
    (lambda: az.VisionTransformer(16, 4, window=3), "window"),
    (lambda: az.TransformerBlock(16, 2, dropout=0.1), "dropout"),
])
def test_keyword_outside_the_signature_is_a_type_error_naming_it(build, name: str) -> None:
    with pytest.raises(TypeError, match=name):
        build()


def test_explicit_keywords_override_the_config() -> None:
    cfg = az.models.DecoderConfig(50, 16, 2, 2, pos="learned", max_seq_len=32, norm="rms")
    lm = az.DecoderLM(config=cfg, pos="rope", max_seq_len=64, num_kv_heads=1)
    assert (lm.config.pos, lm.config.max_seq_len, lm.config.num_kv_heads, lm.config.norm) == ("rope", 64, 1, "rms")
    assert az.DecoderLM(config=cfg).config is cfg  # nothing given: the config as it is
    enc = az.TransformerEncoder(config=az.models.EncoderConfig(50, 16, 1, 2, norm_first=False), pos="sinusoidal")
    assert (enc.config.pos, enc.config.norm_first) == ("sinusoidal", False)
    blk = az.TransformerBlock(config=az.blocks.BlockConfig(16, 2, dropout=0.1), causal=True)
    assert blk.config is not None and (blk.config.causal, blk.config.dropout) == (True, 0.1)
    with pytest.raises(TypeError, match="config must be a DecoderConfig"):
        az.DecoderLM(config=az.models.EncoderConfig(50, 16, 1, 2))
    with pytest.raises(ValueError, match="pos must be one of"):
        az.DecoderLM(50, 16, 1, 2, pos="alibi")


def test_parts_are_checked_and_named() -> None:
    with pytest.raises(TypeError, match="parts must be a DecoderParts"):
        az.DecoderLM(50, 16, 1, 2, parts={"head": None})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"head must be an nn\.Module"):
        az.models.DecoderParts(head="lm")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="blocks must be a list of modules"):
        az.models.DecoderParts(blocks=az.TransformerBlock(16, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="softcap must be a finite positive number"):
        az.models.LMHead(16, 50, softcap=-1.0)
    with pytest.raises(ValueError, match="tie_embeddings=True ties the LMHead"):
        az.DecoderLM(50, 16, 1, 2, parts=az.models.DecoderParts(embedding=nn.Identity()))
    cfg = az.models.DecoderConfig(50, 16, 2, 2)
    with pytest.raises(TypeError, match="change must return a BlockConfig"):
        az.DecoderLM.with_blocks(cfg, lambda b, i: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="without blocks"):
        az.DecoderLM.with_blocks(cfg, lambda b, i: b, parts=az.models.DecoderParts(blocks=[nn.Identity()] * 2))


def test_injected_parts_equal_the_formula() -> None:
    """A scaled embedding and a soft-capped head change exactly what they say: the same weights
    through a plain model give ``softcap * tanh(plain(scale * emb) / softcap)``."""
    torch.manual_seed(0)
    cfg = az.models.DecoderConfig(50, 16, 2, 2, norm="rms", ffn="swiglu")
    parts = az.models.DecoderParts(embedding=az.models.ScaledEmbedding(50, 16, scale=4.0),
                                   head=az.models.LMHead(16, 50, softcap=3.0))
    capped = az.DecoderLM(config=cfg, parts=parts).eval()
    assert capped.tie_embeddings and capped.lm_head.weight is capped.tok_emb.weight
    plain = az.DecoderLM(config=cfg).eval()
    plain.load_state_dict(capped.state_dict())  # the same weight names
    tokens = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        x = plain.tok_emb(tokens) * 4.0
        for block in plain.blocks:
            x = block(x)
        want = 3.0 * torch.tanh(plain.lm_head(plain.norm(x)) / 3.0)
        torch.testing.assert_close(capped(tokens), want)
        packed = capped(tokens.reshape(1, 14), cu_seqlens=torch.tensor([0, 7, 14], dtype=torch.int32))
        torch.testing.assert_close(packed.reshape(2, 7, 50), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [az.DecoderLM, az.TransformerEncoder], ids=lambda c: c.__name__)
def test_a_config_passed_as_a_size_or_missing_sizes_say_what_to_do(cls: type) -> None:
    cfg = cls.config_class(50, 16, 1, 2)
    with pytest.raises(TypeError, match=r"vocab_size got a .*Config; pass a config as config="):
        cls(cfg)
    with pytest.raises(TypeError, match="depth, num_heads must be given without config="):
        cls(50, 16)
    assert isinstance(cls(config=cfg), cls)


def test_packed_tokens_of_more_than_one_row_are_named() -> None:
    lm = az.DecoderLM(config=az.models.DecoderConfig(50, 16, 1, 2, max_seq_len=32))
    with pytest.raises(ValueError, match=r"one row of tokens \[1, T\]; got tokens \(2, 13\)"):
        lm(torch.zeros(2, 13, dtype=torch.long), cu_seqlens=torch.tensor([0, 5, 13], dtype=torch.int32))
