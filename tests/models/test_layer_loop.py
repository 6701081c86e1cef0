"""``LayerLoopLM``: a subclass writes only its layer loop and gets ``DecoderLM``'s checks, cache
transaction, generation and packing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from attnzoo.models import DecoderConfig, DecoderParts, LayerLoopLM
from attnzoo.nn.attention import MultiHeadAttention

pytestmark = pytest.mark.usefixtures("one_thread")


class TwoStreamLM(LayerLoopLM):
    """Two residual streams: each block reads their sum and writes to the first."""

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: Any) -> Tensor:
        a, b = x, x
        for i, block in enumerate(self.blocks):
            a = a + block(a + b, cache=None if cache is None else cache[i])
        return a + b


def _model(seed: int = 0) -> TwoStreamLM:
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=50, dim=16, depth=2, num_heads=2, pos="none", max_seq_len=64)
    return TwoStreamLM(config=cfg, parts=DecoderParts(blocks=[MultiHeadAttention(16, 2, causal=True, rope=True)
                                                              for _ in range(2)])).eval()


def test_cached_decode_equals_full_forward() -> None:
    lm, x = _model(), torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = lm.init_cache(2, 11)
        steps = [lm(x[:, :4], cache=cache)] + [lm(x[:, t:t + 1], cache=cache) for t in range(4, 11)]
        full = lm(x)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 11


def test_packed_equals_each_alone() -> None:
    lm = _model()
    seqs = [torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 1)]
    cu = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    with torch.no_grad():
        torch.testing.assert_close(lm(torch.cat(seqs, dim=1), cu_seqlens=cu), torch.cat([lm(s) for s in seqs], dim=1))


class PackingTwoStreamLM(TwoStreamLM):
    """The same model, its blocks taking the packed row whole (``packs = True``)."""

    packs = True

    def run_layers(self, x: Tensor, *, cu_seqlens: Tensor | None = None, **kw: Any) -> Tensor:
        a, b = x, x
        for block in self.blocks:
            a = a + (block(a + b) if cu_seqlens is None else block(a + b, cu_seqlens=cu_seqlens))
        return a + b


def test_packed_whole_equals_each_alone() -> None:
    lm = _model()
    lm.__class__ = PackingTwoStreamLM
    seqs = [torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 1)]
    cu = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    seen: list[Any] = []
    lm.blocks[0].register_forward_pre_hook(lambda m, a, k: seen.append(k.get("cu_seqlens")), with_kwargs=True)
    with torch.no_grad():
        packed = lm(torch.cat(seqs, dim=1), cu_seqlens=cu)
        assert seen and seen[0] is not None  # one call over the whole row
        torch.testing.assert_close(packed, torch.cat([lm(s) for s in seqs], dim=1), rtol=1e-5, atol=1e-5)


def test_generate_runs_through_the_loop() -> None:
    lm, x = _model(), torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    out = lm.generate(x, 4)
    with torch.no_grad():
        again = lm(out[:, :-1])[:, -1].argmax(-1)  # the last greedy token from a full forward
    assert out.shape == (2, 9) and torch.equal(again, out[:, -1])


class FailsAfterFirstBlock(TwoStreamLM):
    def run_layers(self, x: Tensor, **kw: Any) -> Tensor:
        self.blocks[0](x, cache=kw["cache"][0])  # writes layer 0's cache, then fails
        raise RuntimeError("layer 1 failed")


def test_a_failing_call_leaves_the_cache_unchanged() -> None:
    lm = _model()
    cache = lm.init_cache(1, 8)
    with torch.no_grad():
        lm(torch.tensor([[1, 2, 3]]), cache=cache)
        lm.__class__ = FailsAfterFirstBlock
        with pytest.raises(RuntimeError, match="layer 1 failed"):
            lm(torch.tensor([[4]]), cache=cache)
    assert cache.length == 3 and all(c.length == 3 for c in cache)


def test_bad_input_is_named() -> None:
    lm, x = _model(), torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="context"):
        lm(x, context=torch.zeros(1, 2, 16))
    with pytest.raises(TypeError, match=r"cache must come from TwoStreamLM\.init_cache"):
        lm(x, cache=object())
    with pytest.raises(ValueError, match="batch size"):
        lm(x, cache=lm.init_cache(2, 8))
    with pytest.raises(ValueError, match=r"packed input \(cu_seqlens\) takes no cache"):
        lm(x, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32), cache=lm.init_cache(1, 8))
    with pytest.raises(ValueError, match="shape"):
        lm(x, positions=torch.arange(5))


def test_a_subclass_must_write_its_loop() -> None:
    cfg = DecoderConfig(vocab_size=10, dim=8, depth=1, num_heads=2, pos="none")
    lm = LayerLoopLM(config=cfg, parts=DecoderParts(blocks=[MultiHeadAttention(8, 2, causal=True)]))
    with pytest.raises(NotImplementedError, match="run_layers"):
        lm(torch.tensor([[1, 2]]))
