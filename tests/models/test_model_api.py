"""The model constructors' public signatures: explicit keywords, no ``**kwargs``, at most 12
parameters; a misspelt or removed keyword is a ``TypeError`` naming it."""

from __future__ import annotations

import inspect

import pytest

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
