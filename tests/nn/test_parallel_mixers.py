"""ParallelMixers: mixers side by side on the same input (Falcon-H1's layers) — the sum of its
parts, with their caches, padding, packing and rollback; bad input named."""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
from attnzoo.masks import key_padding
from attnzoo.nn.parallel import ParallelCache, ParallelMixers


def _mixer(seed: int = 0) -> ParallelMixers:
    torch.manual_seed(seed)
    return ParallelMixers([az.Mamba2(32, 4, state_size=8, chunk_size=4),
                           az.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=True)]).double().eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().detach() / b.abs().max().detach())


def test_output_is_the_sum_of_the_parts_with_padding() -> None:
    m = _mixer()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    real = torch.ones(2, 9, dtype=torch.bool)
    real[0, :3] = False
    mask = key_padding(real)
    want = sum(part(x, mask=mask) for part in m.mixers)
    assert _rel(m(x, mask=mask), want) <= 1e-12


def test_cached_decode_equals_full_forward_and_rolls_back() -> None:
    m = _mixer(1)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    cache = m.init_cache(2, 11)
    assert isinstance(cache, ParallelCache) and len(cache) == 2
    first = m(x[:, :5], cache=cache)
    mark = cache.mark()
    m(torch.randn(2, 3, 32, dtype=torch.float64), cache=cache)  # a call to undo
    cache.rollback(mark)
    assert cache.length == 5
    steps = [first] + [m(x[:, t:t + 1], cache=cache) for t in range(5, 11)]
    assert _rel(torch.cat(steps, 1), m(x)) <= 1e-10
    cache.reset()
    assert cache.length == 0


def test_packed_sequences_equal_each_alone() -> None:
    m = _mixer(2)
    seqs = [torch.randn(1, n, 32, dtype=torch.float64) for n in (4, 7, 1)]
    cu = torch.tensor([0, 4, 11, 12], dtype=torch.int32)
    assert _rel(m(torch.cat(seqs, 1), cu_seqlens=cu), torch.cat([m(s) for s in seqs], 1)) <= 1e-10


def test_in_a_decoder_block_decode_equals_full() -> None:
    from attnzoo.blocks import BlockLayers, RMSNorm

    torch.manual_seed(3)
    layers = BlockLayers(attention=lambda: _mixer(3), feed_forward=lambda: az.FeedForward(32, activation="swiglu"),
                         norm=lambda: RMSNorm(32))
    model = az.DecoderLM(64, 32, 2, 4, parts=az.models.DecoderParts(blocks=lambda i: az.TransformerBlock(
        32, layers=layers))).double().eval()
    tokens = torch.randint(0, 64, (2, 10))
    cache = model.init_cache(2, 10)
    steps = torch.cat([model(tokens[:, :6], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache)
                                                            for t in range(6, 10)], 1)
    assert _rel(steps, model(tokens)) <= 1e-10


def test_bad_input_is_named() -> None:
    mamba = az.Mamba2(32, 4)
    with pytest.raises(ValueError, match="at least 2 mixers"):
        ParallelMixers([mamba])
    with pytest.raises(TypeError, match="sequence of modules"):
        ParallelMixers(mamba)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        ParallelMixers([mamba, "mha"])  # type: ignore[list-item]
    m = _mixer()
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="context"):
        m(x, x)
    with pytest.raises(TypeError, match="init_cache"):
        m(x, cache=m.mixers[0].init_cache(1, 3))
    with pytest.raises(ValueError, match="at least one"):
        ParallelCache([])
