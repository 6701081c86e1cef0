"""Round 5 of bad input: calls the round-4 audit left failing inside torch (an IndexError,
a ZeroDivisionError, a shape error from deep inside a helper). Each is now refused at the
boundary naming the argument; docs/bad-input.md ("round 5") lists them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import attnzoo as az
from attnzoo.cost import measure_activation_bytes, visible_pairs
from attnzoo.distributed import shard_sequence
from attnzoo.interop import WordPieceTokenizer
from attnzoo.models._common import LayerCaches
from attnzoo.nn.cache import SinkWindowKVCache
from attnzoo.nn.parts import OutputGate, QKNorm
from attnzoo.nn.positional import LearnedPositionalEmbedding, RotaryEmbedding
from attnzoo.oracle import oracle_attention, visible_table

G = torch.Generator().manual_seed(0)
Q = torch.randn(1, 2, 3, 4, generator=G)
K = torch.randn(1, 2, 5, 4, generator=G)
V = torch.randn(1, 2, 5, 4, generator=G)
ROPE = RotaryEmbedding(4)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: oracle_attention(Q, torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)), ValueError, r"Hq % Hkv"),
    (lambda: oracle_attention(Q, torch.randn(1, 0, 5, 4), torch.randn(1, 0, 5, 4)), ValueError, r"Hq % Hkv"),
    (lambda: oracle_attention([1], K, V), TypeError, r"oracle: q must be a floating-point tensor"),
    (lambda: oracle_attention(Q.long(), K, V), TypeError, r"oracle: q must be a floating-point tensor"),
    (lambda: oracle_attention(Q[0], K, V), ValueError, r"oracle: q must be \[B, H, N, D\], got shape \(2, 3, 4\)"),
    (lambda: oracle_attention(Q, torch.randn(1, 2, 5, 3), V), ValueError, r"k \(1, 2, 5, 3\)"),
    (lambda: oracle_attention(Q, K, torch.randn(1, 2, 4, 4)), ValueError, r"v \(1, 2, 4, 4\)"),
    (lambda: oracle_attention(Q, K, V, window=(2,)), ValueError, r"oracle: window must be"),
    (lambda: oracle_attention(Q, K, V, window=-1), ValueError, r"oracle: window must be"),
    (lambda: oracle_attention(Q, K, V, alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must be a tensor \[Hq\]"),
    (lambda: oracle_attention(Q, K, V, mask=torch.ones(5, 3, dtype=torch.bool)), ValueError, r"mask must broadcast"),
    (lambda: oracle_attention(Q, K, V, mask=torch.zeros(5, 3)), ValueError, r"mask must broadcast"),
    (lambda: visible_table(1, 1, -3, 5), ValueError, r"b, hq, nq, nk must be ints >= 0"),
    (lambda: visible_table(1, 1, 3, 5, mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, r"mask must broadcast"),
    (lambda: LayerCaches([1, 2]), TypeError, r"LayerCaches: caches must be decode caches"),
    (lambda: LearnedPositionalEmbedding(8, 4, init_std=-1.0), ValueError, r"init_std"),
    (lambda: LearnedPositionalEmbedding(8, 4, init_std=float("nan")), ValueError, r"init_std"),
    (lambda: ROPE.cos_sin([0, 1]), TypeError, r"RotaryEmbedding: positions must be an int tensor"),
    (lambda: ROPE.rotate(torch.randn(1, 1, 3, 6), *ROPE.cos_sin(torch.arange(3))), ValueError,
     r"RotaryEmbedding.rotate: x must be \[B, H, N, D\] with D = 4"),
    (lambda: SinkWindowKVCache(1, 1, 2, 2, 4).update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4),
                                                     sink_offsets=torch.tensor([0.5])), ValueError, r"sink_offsets"),
    (lambda: SinkWindowKVCache(1, 1, 2, 2, 4).update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4),
                                                     sink_offsets=torch.tensor([0, 1])), ValueError, r"\[B\] = \[1\]"),
    (lambda: QKNorm(4)(torch.randn(1, 2, 3, 5)), ValueError, r"QKNorm: .* D = 4"),
    (lambda: QKNorm(8, over_heads=True)(torch.randn(1, 3, 3, 4)), ValueError, r"QKNorm: .* h \* D = 8"),
    (lambda: OutputGate(8, 2, 4).gate(torch.randn(1, 3, 5, 4), torch.randn(1, 5, 8)), ValueError,
     r"OutputGate: out must be \[B, H, N, Dv\] with H = 2"),
    (lambda: OutputGate(8, 2, 4, mode="element").gate(torch.randn(1, 2, 5, 3), torch.randn(1, 5, 8)),
     ValueError, r"and Dv = 4"),
    (lambda: visible_pairs("mha", 8), TypeError, r"visible_pairs: cfg must be"),
    (lambda: measure_activation_bytes(lambda: None, exclude=[1]), TypeError, r"exclude must hold tensors"),
    (lambda: shard_sequence(torch.tensor(1.0), dim=0, rank=0, world_size=1), ValueError, r"dim must be an int"),
    (lambda: WordPieceTokenizer([0, 1, 2]), TypeError, r"list of str tokens, got a list with non-str items"),
])
def test_bad_input_is_refused_by_name(call: Callable[[], object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_the_valid_neighbours_still_work() -> None:
    out, _ = oracle_attention(Q, K, V, mask=torch.zeros(1, 1, 3, 5), window=(2, None), causal=True)
    ref = az.attention(Q.double(), K.double(), V.double(), window=(2, None), causal=True, backend="reference")
    torch.testing.assert_close(out, ref)
    assert visible_table(2, 1, 3, 5, mask=torch.ones(5, dtype=torch.bool)).shape == (2, 1, 3, 5)
    assert LearnedPositionalEmbedding(8, 4, init_std=0).weight.abs().max() == 0
    x = torch.randn(1, 2, 3, 4)
    torch.testing.assert_close(ROPE.rotate(x, *ROPE.cos_sin(torch.arange(3))), ROPE(x))
    cache = SinkWindowKVCache(2, 1, 2, 2, 4)
    k = torch.randn(2, 2, 3, 4)
    assert cache.update(k, k, sink_offsets=torch.tensor([0, 1]))[0].shape == (2, 2, 3, 4)
    w = torch.ones(2, requires_grad=True)
    assert measure_activation_bytes(lambda: (w * w).sum(), exclude=(p for p in [w])) >= 0
    assert shard_sequence(torch.arange(6), dim=-1, rank=1, world_size=2).tolist() == [3, 4, 5]
    assert WordPieceTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"]).vocab["a"] == 4
