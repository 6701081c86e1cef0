"""Bad input to generation (``sample_next_token``, ``DecoderLM.generate``, ``Transformer.generate``):
each is refused up front by name (``TypeError`` for a wrong type, ``ValueError`` for a wrong value),
before any forward runs; the valid settings still give the right tokens."""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo as az
from attnzoo.models import sample_next_token

V = 16

#: (settings, error, argument named): refused by sample_next_token and both generate methods alike
BAD_SETTINGS = [
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"temperature": math.inf}, ValueError, "temperature"),
    ({"temperature": math.nan}, ValueError, "temperature"),
    ({"temperature": "1"}, TypeError, "temperature"),
    ({"temperature": True}, TypeError, "temperature"),
    ({"temperature": 1.0, "top_p": 0.0}, ValueError, "top_p"),
    ({"temperature": 1.0, "top_p": -1.0}, ValueError, "top_p"),
    ({"temperature": 1.0, "top_p": 2.0}, ValueError, "top_p"),
    ({"temperature": 1.0, "top_p": "0.5"}, TypeError, "top_p"),
    ({"temperature": 1.0, "top_k": 0}, ValueError, "top_k"),
    ({"temperature": 1.0, "top_k": -2}, ValueError, "top_k"),
    ({"temperature": 1.0, "top_k": 2.5}, TypeError, "top_k"),
    ({"temperature": 1.0, "generator": "x"}, TypeError, "generator"),
    ({"temperature": 1.0, "generator": 0}, TypeError, "generator"),
]


def _decoder() -> az.DecoderLM:
    torch.manual_seed(0)
    return az.DecoderLM(V, 8, 1, 2).eval()


def _count_forwards(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(("settings", "exc", "name"), BAD_SETTINGS)
def test_sample_next_token_refuses_bad_settings_by_name(settings: dict, exc: type, name: str) -> None:
    """A11 / C11: temperature=-1 sampled the least likely token, top_p <= 0 was silently greedy and
    top_p=2 ignored, the others were torch errors."""
    with pytest.raises(exc, match=f"sample_next_token: {name}"):
        sample_next_token(torch.randn(2, V), **settings)


@pytest.mark.parametrize(("settings", "exc", "name"), BAD_SETTINGS)
def test_generate_refuses_bad_settings_before_any_forward(settings: dict, exc: type, name: str) -> None:
    """C12 / A29: generator=0 was torch's TypeError after the prompt's forward; temperature=inf was
    accepted. Both generate methods check with sample_next_token's own check, before any forward."""
    lm = _decoder()
    calls = _count_forwards(lm)
    with pytest.raises(exc, match=f"DecoderLM.generate: {name}"):
        lm.generate(torch.tensor([[1, 2, 3]]), 2, **settings)
    assert calls[0] == 0
    tr = az.Transformer(V, V, 8, 2, 1, 1).eval()
    encoded = _count_forwards(tr.encoder)
    with pytest.raises(exc, match=f"Transformer.generate: {name}"):
        tr.generate(torch.tensor([[1, 2, 3]]), 2, bos_token_id=0, **settings)
    assert encoded[0] == 0


@pytest.mark.parametrize(("logits", "exc"), [
    (torch.randn(V), ValueError),  # 1-D: returned a 0-d token
    (torch.randn(2, 3, V), ValueError),  # 3-D: returned [B, N]
    (torch.randn(2, 0), ValueError),  # no vocabulary: IndexError
    ([[1.0, 2.0]], TypeError),  # a list: AttributeError
    (torch.randint(0, 5, (2, V)), TypeError),  # integer logits
    (torch.full((2, V), math.nan), ValueError),  # NaN: greedy returned token 0
    (torch.tensor([[0.0, math.inf, 1.0]]), ValueError),
    (torch.full((2, V), -math.inf), ValueError),  # all hidden: RuntimeError when sampling, 0 when greedy
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_next_token_refuses_bad_logits_by_name(logits: object, exc: type, temperature: float) -> None:
    with pytest.raises(exc, match="sample_next_token: logits"):
        sample_next_token(logits, temperature=temperature)  # type: ignore[arg-type]


def test_sample_next_token_valid_settings_give_the_right_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    logits[1, :5] = -math.inf  # some hidden tokens are fine
    # greedy is argmax, NaN-free rows of any floating dtype
    assert torch.equal(sample_next_token(logits), logits.argmax(-1))
    assert torch.equal(sample_next_token(logits.half()), logits.half().argmax(-1))
    # sampling draws from softmax(logits / T), as torch.multinomial does with the same generator
    for t in (0.5, 1.0, 2.0):
        want = torch.multinomial((logits / t).softmax(-1), 1, generator=torch.Generator().manual_seed(7))[:, 0]
        got = sample_next_token(logits, temperature=t, generator=torch.Generator().manual_seed(7))
        assert torch.equal(got, want), t
    # top_k above the vocabulary keeps every token (as generate does); top_p=1 keeps every token
    free = sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(3))
    for kw in ({"top_k": V + 5}, {"top_k": V}, {"top_p": 1.0}):
        assert torch.equal(sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(3),
                                             **kw), free), kw
    # top_k=1 is greedy; a tiny temperature too (no overflow to NaN)
    assert torch.equal(sample_next_token(logits, temperature=1.0, top_k=1), logits.argmax(-1))
    assert torch.equal(sample_next_token(logits * 1e30, temperature=1e-30), logits.argmax(-1))
    # the hidden tokens of row 1 are never drawn
    draws = torch.stack([sample_next_token(logits, temperature=5.0, generator=torch.Generator().manual_seed(s))
                         for s in range(50)])
    assert (draws[:, 1] >= 5).all()


def test_generate_refuses_right_padding() -> None:
    """A1: a right-padded prompt sampled its next token from the pad slot."""
    lm = _decoder()
    calls = _count_forwards(lm)
    prompt = torch.tensor([[7, 7, 5, 11, 14], [1, 2, 3, 4, 5]])
    for row in ([1, 1, 1, 0, 0], [0, 1, 0, 1, 1], [1, 0, 1, 1, 1]):
        mask = torch.tensor([row, [1] * 5], dtype=torch.bool)
        with pytest.raises(ValueError, match="attention_mask must be left padding"):
            lm.generate(prompt, 3, attention_mask=mask)
    assert calls[0] == 0


def test_generate_left_padding_still_equals_each_row_alone() -> None:
    lm = _decoder()
    short, long = torch.tensor([[5, 11, 14]]), torch.tensor([[3, 9, 2, 8, 1]])
    prompt = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5], dtype=torch.bool)
    out = lm.generate(prompt, 4, attention_mask=mask)
    assert torch.equal(out[0, 5:], lm.generate(short, 4)[0, 3:])
    assert torch.equal(out[1, 5:], lm.generate(long, 4)[0, 5:])
    # 0/1 ints and an all-real mask are left padding too
    assert torch.equal(lm.generate(long, 4, attention_mask=torch.ones(1, 5, dtype=torch.long)), lm.generate(long, 4))


def test_generate_names_an_empty_prompt_batch() -> None:
    """D3: B = 0 was refused by init_cache ('batch_size must be >= 1'), a name the caller never gave."""
    with pytest.raises(ValueError, match=r"DecoderLM.generate: prompt must hold at least one row"):
        _decoder().generate(torch.zeros(0, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"Transformer.generate: src must hold at least one row"):
        az.Transformer(V, V, 8, 2, 1, 1).generate(torch.zeros(0, 3, dtype=torch.long), 2, bos_token_id=0)


def test_generate_checks_extend_context_without_an_overflow() -> None:
    """A21: extend_context='yes' was only checked when the sequence overflowed max_seq_len."""
    lm = _decoder()
    with pytest.raises(TypeError, match="extend_context must be a bool"):
        lm.generate(torch.tensor([[1, 2]]), 2, extend_context="yes")
    with pytest.raises(TypeError, match="extend_context"):
        lm.generate(torch.tensor([[1, 2]]), 0, extend_context=1)
    assert lm.generate(torch.tensor([[1, 2]]), 2, extend_context=True).shape == (1, 4)
