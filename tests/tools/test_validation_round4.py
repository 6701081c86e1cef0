"""Round 4 of bad input (an audit of every public name): calls that were accepted and gave a
silently wrong or backend-dependent result, or failed inside torch. Each is now refused at the
boundary naming the argument; docs/bad-input.md ("round 4") lists them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import attnzoo as az
from attnzoo.blocks import FeedForward, RMSNorm
from attnzoo.distributed import work_per_rank
from attnzoo.functional.softmax.attention import merge_attention
from attnzoo.models.config import Rope
from attnzoo.models.encoder import cls_pool, max_pool, mean_pool
from attnzoo.models.parts import LMHead
from attnzoo.nn.attention import default_kv_heads
from attnzoo.nn.kda import KimiDeltaAttention
from attnzoo.nn.parts import QKNorm
from attnzoo.variants import build_attention

G = torch.Generator().manual_seed(0)
Q4 = torch.randn(1, 2, 5, 8, generator=G)
PACKED = torch.randn(10, 4, 16, generator=G)
CU = torch.tensor([0, 4, 10], dtype=torch.int32)
R = torch.randn(1, 1, 4, 4, generator=G)


def _streaming_with_a_smaller_cache() -> object:
    m = az.StreamingAttention(8, 2, window=2, sink_tokens=1)
    return m(torch.randn(1, 1, 8), cache=az.SinkWindowKVCache(1, 0, 1, 2, 4, max_len=16))


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: az.attention(Q4, Q4, Q4, mask=torch.full((5, 5), float("nan"))), ValueError, r"mask: .*NaN or \+inf"),
    (lambda: az.attention(Q4, Q4, Q4, mask=torch.zeros(5, 5).fill_diagonal_(float("inf"))), ValueError,
     r"mask: .*NaN or \+inf"),
    (lambda: az.attention(Q4, Q4, Q4, alibi_slopes=torch.ones(2, dtype=torch.bool)), TypeError,
     "alibi_slopes must be a floating-point tensor"),
    (lambda: az.attention_varlen(PACKED, PACKED, PACKED, CU, CU, alibi_slopes=torch.ones(4, dtype=torch.long)),
     TypeError, "alibi_slopes must be a floating-point tensor"),
    (lambda: az.attention_varlen(PACKED, PACKED, PACKED, CU, CU, sinks=[0.0] * 4), TypeError, "sinks must be"),
    (lambda: az.retention(R, R, R, torch.tensor([0.9]), scale=0), ValueError, "scale must be a finite float > 0"),
    (lambda: az.retention(R, R, R, torch.tensor([0.9]), scale=-1.0), ValueError, "scale must be"),
    (lambda: KimiDeltaAttention(8, 2, norm_eps=-1.0), ValueError, "norm_eps"),
    (lambda: KimiDeltaAttention(8, 2, norm_eps=float("nan")), ValueError, "norm_eps"),
    (lambda: merge_attention([Q4.long()], [torch.zeros(1, 2, 5)]), TypeError, r"outs\[0\] .* floating-point"),
    (lambda: az.MultiHeadAttention(8, 2, kv_dim=0), ValueError, "kv_dim must be >= 1"),
    (_streaming_with_a_smaller_cache, ValueError, r"cache keeps sink_tokens=0, window=1; the module needs"),
    (lambda: build_attention("fox", 16, 2)(torch.randn(1, 3, 16), cache=build_attention("fox", 32, 4).init_cache(1, 16)),
     ValueError, r"FoxCache: the cache holds batch 1 x 4 heads"),
    (lambda: az.alibi_slopes(4, dtype=torch.int64), TypeError, "dtype must be a floating"),
    (lambda: az.MultiHeadAttention(8, 2, causal=True).init_cache(2, 8, dtype=torch.int64), TypeError,
     "KVCache: dtype must be a floating"),
    (lambda: az.SlidingWindowKVCache(1, 2, 2, 4, dtype=torch.int32), TypeError, "dtype must be a floating"),
    (lambda: work_per_rank(8, 0), ValueError, "world_size must be >= 1"),
    (lambda: work_per_rank(8, 2, causal="yes"), TypeError, "causal must be a bool"),
    (lambda: default_kv_heads(0), ValueError, "num_heads must be >= 1"),
    (lambda: FeedForward(8, bias="no"), TypeError, "FeedForward: bias must be a bool"),
    (lambda: LMHead(8, 16, bias="no"), TypeError, "LMHead: bias must be a bool"),
    (lambda: LMHead(8, -1), ValueError, "LMHead: vocab_size must be >= 1"),
    (lambda: az.available_backends("tpu"), ValueError, "available_backends: device must be"),
    (lambda: az.RotaryEmbedding(8, scaling_factor=4.0), ValueError, "scaling_factor=4.0 applies only with"),
    (lambda: Rope(factor=2.0), ValueError, r"Rope: factor=2.0 applies only with"),
    (lambda: RMSNorm(8)(torch.ones(1, 8, dtype=torch.long)), TypeError, "RMSNorm: x must be a floating-point"),
    (lambda: QKNorm(4)(torch.full((1, 1, 1, 4), 3)), TypeError, "QKNorm: t must be a floating-point"),
    (lambda: mean_pool(torch.ones(2, 3, 4, dtype=torch.long)), TypeError, "mean_pool: hidden must be a floating"),
    (lambda: cls_pool(torch.randn(2, 0, 4)), ValueError, r"cls_pool: hidden must have shape \[B, N, C\] with N >= 1"),
])
def test_refused_at_the_boundary(call: Callable[[], object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_the_valid_neighbours_still_work() -> None:
    causal = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(az.attention(Q4, Q4, Q4, mask=causal), az.attention(Q4, Q4, Q4, causal=True))
    out = az.attention_varlen(PACKED, PACKED, PACKED, CU, CU, return_lse=True)
    assert isinstance(out, tuple) and len(out) == 2  # the compiled kernel's result too (it gave a list)
    m = az.StreamingAttention(8, 2, window=2, sink_tokens=1)
    assert m(torch.randn(1, 1, 8), cache=m.init_cache(1, 16)).shape == (1, 1, 8)


def test_a_non_finite_future_key_never_reaches_an_earlier_row_of_linear_attention() -> None:
    """The quadratic form masked its causal scores by a product (NaN * 0 = NaN), so rows before a NaN
    key were NaN there and finite in the chunked and recurrent forms: now every form agrees."""
    q = torch.rand(1, 1, 6, 4, generator=G)
    k, v = q.clone(), torch.rand(1, 1, 6, 4, generator=G)
    k[..., 3, :] = float("nan")
    outs = {f: az.linear_attention(q, k, v, causal=True, form=f)[..., :3, :] for f in ("quadratic", "chunked",
                                                                                         "recurrent")}
    for f, o in outs.items():
        assert torch.isfinite(o).all(), f
        torch.testing.assert_close(o, outs["recurrent"])


def test_no_backend_is_available_on_a_device_this_machine_lacks() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert az.available_backends("cuda:0") == [] and "reference" in az.available_backends("cpu")


def test_max_pool_of_a_row_without_real_tokens_is_zeros_as_mean_pool() -> None:
    h = torch.randn(2, 3, 4, generator=G)
    m = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.equal(max_pool(h, m)[1], torch.zeros(4)) and torch.equal(mean_pool(h, m)[1], torch.zeros(4))
    torch.testing.assert_close(max_pool(h, m)[0], h[0, :2].amax(dim=0))
