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
#: variants whose module refuses a padding mask by name (nothing silently wrong)
REFUSES_PADDING = {"nsa": "mask is not supported"}


def _model(name: str) -> az.DecoderLM:
    torch.manual_seed(0)
    return az.DecoderLM(config=az.models.DecoderConfig(VOCAB, 32, 2, 4, attention=name, max_seq_len=64,
                                                       attention_kwargs=dict(VARIANTS[name].check))).eval()


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


def test_infini_segments_count_each_rows_real_tokens() -> None:
    """Infini-attention's segments close at each row's ``segment_len``-th real token: left paddings from
    0 to past two segments, rows of different phases in one batch, chunked prefill + decode through
    the cache, equal each row alone; right padding without a cache too; a pad between real tokens,
    or after one in a cached call, is refused by name before any state changes."""
    torch.manual_seed(0)
    m = az.InfiniAttention(16, 2, segment_len=3, update="delta").eval()
    pads = (0, 1, 2, 4, 7)
    x = torch.randn(len(pads), T + NEW, 16)
    real = torch.ones(len(pads), T + NEW, dtype=torch.bool)
    for i, p in enumerate(pads):
        real[i, :p] = False
    with torch.no_grad():
        full = m(x, mask=real)
        cache = m.init_cache(len(pads), T + NEW)
        outs = [m(x[:, :4], cache=cache, mask=real[:, :4]), m(x[:, 4:T], cache=cache, mask=real[:, :T])]
        outs += [m(x[:, t:t + 1], cache=cache, mask=real[:, :t + 1]) for t in range(T, T + NEW)]
        assert cache.state.fill < m.segment_len  # the buffer never outgrows one segment
        for i, p in enumerate(pads):
            alone = m(x[i:i + 1, p:])[0]
            assert (full[i, p:] - alone).abs().max().item() <= 1e-5, f"full forward, pad={p}"
            assert (torch.cat(outs, 1)[i, p:] - alone).abs().max().item() <= 1e-5, f"decode, pad={p}"
        right = real.flip(1)  # right padding, no cache
        for i, p in enumerate(pads):
            n = T + NEW - p
            assert (m(x, mask=right)[i, :n] - m(x[i:i + 1, :n])[0]).abs().max().item() <= 1e-5, f"right, pad={p}"
        gap = torch.ones(1, 6, dtype=torch.bool).index_fill(1, torch.tensor([2]), False)
        with pytest.raises(ValueError, match=r"variant 'infini'.*between two real ones"):
            m(x[:1, :6], mask=gap)
        cache = m.init_cache(1, 16)
        m(x[:1, :5], cache=cache)
        with pytest.raises(ValueError, match=r"variant 'infini'.*after a real one in a cached call"):
            m(x[:1, 5:6], cache=cache, mask=torch.tensor([[True] * 5 + [False]]))
        assert cache.length == 5
