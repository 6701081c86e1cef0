"""Issue 33, item 8: batched generation with left padding == each row alone, for every variant.

``DecoderLM(attention=name)`` with a batch whose second row is left-padded: the logits of its real
tokens, through a full forward and through prefill + decode with the caches (what ``generate``
does), equal that row run alone, and ``generate`` gives the same tokens. StreamingLLM's sink tokens
are the row's first real tokens (``attnzoo.nn.streaming``); LocalGlobal's global positions count
from the row's first real token too.
"""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
from attnzoo.models._common import positions_from_mask
from attnzoo.variants import VARIANTS

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, T, NEW = 50, 12, 6
#: variants whose module refuses a (left) padding mask by name (nothing silently wrong); Infini-attention
#: cuts its segments at stream positions, so left padding would shift them
REFUSES_PADDING = {"nsa": "mask is not supported", "infini": r"variant 'infini'.*attention_mask.*left padding"}


def _model(name: str) -> az.DecoderLM:
    torch.manual_seed(0)
    return az.DecoderLM(VOCAB, 32, 2, 4, attention=name, max_seq_len=64,
                        attention_kwargs=dict(VARIANTS[name].check)).eval()


def _batch(pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, VOCAB, (1, T), generator=g)
    b = torch.randint(1, VOCAB, (1, T - pad), generator=g)
    prompt = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    real = torch.ones(2, T, dtype=torch.bool)
    real[1, :pad] = False
    return prompt, real, a, b


def _decoded_logits(lm: az.DecoderLM, prompt: torch.Tensor, real: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, 1 + NEW, V]`` of the prompt's last token and of ``cont``: prefill, then a token a step."""
    B, n = prompt.shape
    full = torch.cat([real, torch.ones(B, NEW, dtype=torch.bool)], 1)
    pos = positions_from_mask(full)
    cache = lm.init_cache(B, n + NEW)
    outs = [lm(prompt, cache=cache, positions=pos[:, :n], attention_mask=full[:, :n])[:, -1:]]
    for i in range(NEW):
        t = n + i
        outs.append(lm(cont[:, i:i + 1], cache=cache, positions=pos[:, t:t + 1], attention_mask=full[:, :t + 1]))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("pad", [2, 5])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_left_padded_generation_equals_each_row_alone(name: str, pad: int) -> None:
    lm = _model(name)
    prompt, real, a, b = _batch(pad, seed=pad)
    if name in REFUSES_PADDING:
        with pytest.raises(ValueError, match=REFUSES_PADDING[name]):
            lm(prompt, attention_mask=real)
        with pytest.raises(ValueError, match=REFUSES_PADDING[name]):
            lm.generate(prompt, NEW, attention_mask=real)
        return
    cont = torch.randint(1, VOCAB, (2, NEW), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        err_full = (lm(prompt, attention_mask=real)[1, pad:] - lm(b)[0]).abs().max().item()
        batched = _decoded_logits(lm, prompt, real, cont)
        alone = _decoded_logits(lm, b, torch.ones(1, T - pad, dtype=torch.bool), cont[1:])
        first = _decoded_logits(lm, a, torch.ones(1, T, dtype=torch.bool), cont[:1])
    err_dec = (batched[1] - alone[0]).abs().max().item()
    err_first = (batched[0] - first[0]).abs().max().item()
    assert max(err_full, err_dec, err_first) <= 1e-5, (
        f"{name} pad={pad}: full {err_full:.2e}, decoded padded row {err_dec:.2e}, unpadded row {err_first:.2e}")
    g = lm.generate(prompt, NEW, attention_mask=real)
    assert torch.equal(g[1, pad:], lm.generate(b, NEW)[0]) and torch.equal(g[0], lm.generate(a, NEW)[0]), name


@pytest.mark.parametrize(("window", "sinks"), [(1, 1), (3, 2), (6, 4)])
def test_streaming_sinks_are_each_rows_first_real_tokens(window: int, sinks: int) -> None:
    """The module alone, paddings from 0 to past the sinks and window, chunked prefill + decode."""
    from attnzoo.nn.cache import SinkWindowKVCache

    for pad in range(0, 10, 3):
        torch.manual_seed(pad)
        m = az.SlidingWindowAttention(16, 2, window=window, sink_tokens=sinks, rope=True).eval()
        xa, xb, xn = torch.randn(1, T, 16), torch.randn(1, T - pad, 16), torch.randn(2, NEW, 16)
        x = torch.cat([xa, torch.cat([torch.zeros(1, pad, 16), xb], 1)])
        real = torch.ones(2, T + NEW, dtype=torch.bool)
        real[1, :pad] = False
        pos = positions_from_mask(real)
        with torch.no_grad():
            full = m(torch.cat([x, xn], 1), mask=real[:, None, None, :], positions=pos)
            alone = m(torch.cat([xb, xn[1:]], 1))
            cache = m.init_cache(2, T + NEW)
            assert isinstance(cache, SinkWindowKVCache)
            outs = [m(x[:, :4], cache=cache, mask=real[:, None, None, :4], positions=pos[:, :4]),
                    m(x[:, 4:], cache=cache, mask=real[:, None, None, :T], positions=pos[:, 4:T])]
            for i in range(NEW):
                t = T + i
                outs.append(m(xn[:, i:i + 1], cache=cache, mask=real[:, None, None, :t + 1],
                              positions=pos[:, t:t + 1]))
        dec = torch.cat(outs, 1)
        assert (full[1, pad:] - alone[0]).abs().max().item() <= 1e-5, f"full forward, pad={pad}"
        assert (dec - full).abs().max().item() <= 1e-5, f"decode != full, pad={pad}"
        assert cache.nbytes == m.init_cache(2, T + NEW).nbytes  # still n + w + 1 slots


def test_streaming_cache_positions_refuse_padding() -> None:
    m = az.SlidingWindowAttention(16, 2, window=2, sink_tokens=1, rope=True, position_mode="cache")
    real = torch.ones(2, 5, dtype=torch.bool)
    real[1, :2] = False
    with pytest.raises(ValueError, match="position_mode='cache' takes no padding"):
        m(torch.randn(2, 5, 16), mask=real[:, None, None, :])


def test_infini_takes_right_padding_and_refuses_it_on_the_left_mid_stream() -> None:
    """Right padding keeps every real token's stream position (its segments are the row's own); a
    padded slot followed by a real token, in one call or across cached calls, is refused by name."""
    torch.manual_seed(0)
    m = az.InfiniAttention(16, 2, segment_len=3).eval()
    x = torch.randn(2, 8, 16)
    real = torch.ones(2, 8, dtype=torch.bool)
    real[1, 5:] = False  # right padding
    with torch.no_grad():
        torch.testing.assert_close(m(x, mask=real)[1, :5], m(x[1:, :5])[0], rtol=1e-5, atol=1e-6)
        cache = m.init_cache(2, 16)
        m(x, cache=cache, mask=real)
        with pytest.raises(ValueError, match="variant 'infini'"):  # a real token after the padding
            m(x[:, :1], cache=cache, mask=torch.ones(2, 9, dtype=torch.bool).index_fill(1, torch.tensor([6]), False))
        assert cache.length == 8  # refused before any state changed
