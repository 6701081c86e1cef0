"""LocalGlobalAttention: the mask-algebra pattern equals a dense table; masks compose; decoding."""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
from attnzoo.masks import Mask

C, H = 32, 4


def dense_pattern(n: int, w: int, glob: list[int], causal: bool) -> torch.Tensor:
    """The Longformer pattern written directly as a table (independent of the mask algebra)."""
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    is_g = torch.zeros(n, dtype=torch.bool)
    is_g[glob] = True
    allowed = ((i - j).abs() <= w) | is_g.view(-1, 1) | is_g.view(1, -1)
    if causal:
        allowed = allowed & (j <= i)
    return allowed


def twin(m: az.LocalGlobalAttention) -> az.MultiHeadAttention:
    plain = az.MultiHeadAttention(C, H, num_kv_heads=m.num_kv_heads, backend="reference").eval()
    plain.load_state_dict(m.state_dict())
    return plain


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["auto", "reference", "tiled"])
def test_matches_dense_pattern(causal: bool, backend: str) -> None:
    torch.manual_seed(0)
    n, w, glob = 20, 2, [0, 7]
    m = az.LocalGlobalAttention(C, H, window=w, global_tokens=glob, causal=causal, num_kv_heads=2,
                                backend=backend).eval()
    x = torch.randn(2, n, C)
    with torch.no_grad():
        got = m(x)
        want = twin(m)(x, mask=dense_pattern(n, w, glob, causal))
    assert (got - want).abs().max() < 1e-5


def test_weights_follow_the_pattern() -> None:
    torch.manual_seed(1)
    m = az.LocalGlobalAttention(C, H, window=1, global_tokens=(3,)).eval()
    _, w = m(torch.randn(1, 9, C), return_weights=True)
    visible = w[0].sum(0) > 0  # any head
    assert torch.equal(visible, dense_pattern(9, 1, [3], False))


def test_user_masks_compose_with_the_pattern() -> None:
    torch.manual_seed(2)
    n = 12
    m = az.LocalGlobalAttention(C, H, window=2, global_tokens=(0,), causal=True).eval()
    plain = twin(m)
    x = torch.randn(2, n, C)
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, 8:] = False
    pattern = dense_pattern(n, 2, [0], True)
    bias = torch.randn(1, H, n, n)
    with torch.no_grad():
        # bool tensor (key padding), Mask object, float bias
        want = plain(x, mask=pattern & real[:, None, None, :])
        assert (m(x, mask=real[:, None, None, :]) - want).abs().max() < 1e-5
        assert (m(x, mask=az.masks.key_padding(real)) - want).abs().max() < 1e-5
        want_b = plain(x, mask=bias.masked_fill(~pattern, float("-inf")))
        assert (m(x, mask=bias) - want_b).abs().max() < 1e-5


def test_the_pattern_reaches_attention_as_a_mask_object() -> None:
    """No N x N tensor is built by the module: attention() receives a Mask predicate (seen through
    the public attend seam, ``module.attend_fn``)."""
    seen, keys = [], []

    def spy(q, k, v, **kw):
        seen.append(kw["mask"])
        keys.append(k.shape[2])
        return az.attention(q, k, v, **kw)

    m = az.LocalGlobalAttention(C, H, window=4, global_tokens=(0,), causal=True).eval()
    m.attend_fn = spy
    x = torch.randn(1, 64, C)
    with torch.no_grad():
        m(x)
        cache = m.init_cache(1, 64)
        m(x[:, :10], cache=cache)
        m(x[:, 10:11], cache=cache)
    # the one-token decode step gathers what it sees (window 4 + itself + global key 0), no mask
    assert len(seen) == 3 and all(isinstance(s, Mask) for s in seen[:2]) and seen[2] is None
    assert keys == [64, 10, 4 + 1 + 1]


def test_long_input_runs_tiled() -> None:
    torch.manual_seed(3)
    n = 1024
    m = az.LocalGlobalAttention(C, H, window=16, global_tokens=(0, 500), causal=True, backend="tiled").eval()
    x = torch.randn(1, n, C)
    with torch.no_grad():
        got = m(x)
        # compare a slice of queries against the reference on their rows only
        rows = torch.tensor([0, 1, 17, 499, 500, 501, 1023])
        want = twin(m)(x, mask=dense_pattern(n, 16, [0, 500], True))
    assert (got[:, rows] - want[:, rows]).abs().max() < 1e-5


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="window must be >= 0"):
        az.LocalGlobalAttention(C, H, window=-1)
    with pytest.raises(TypeError, match="window must be an int"):
        az.LocalGlobalAttention(C, H, window=(2, 2))
    with pytest.raises(ValueError, match="global_tokens"):
        az.LocalGlobalAttention(C, H, window=2, global_tokens=())
    with pytest.raises(ValueError, match="global_tokens"):
        az.LocalGlobalAttention(C, H, window=2, global_tokens=(-1,))
    with pytest.raises(TypeError, match="kv_dim"):
        az.LocalGlobalAttention(C, H, window=2, kv_dim=16)
    m = az.LocalGlobalAttention(C, H, window=2)
    with pytest.raises(ValueError, match="does not broadcast"):
        m(torch.randn(2, 6, C), mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal=True"):
        m(torch.randn(1, 1, C), cache=az.KVCache(1, 4, H, C // H))


@pytest.mark.parametrize(("bad", "exc"), [(("a",), TypeError), (0, TypeError), ("0", TypeError), ((1.5,), TypeError),
                                          (torch.tensor([0.5]), TypeError)])
def test_bad_global_tokens_are_clear_errors(bad, exc) -> None:
    with pytest.raises(exc, match="global_tokens"):
        az.LocalGlobalAttention(C, H, window=2, global_tokens=bad)


def test_global_tokens_as_a_tensor_and_pickling() -> None:
    import pickle

    m = az.LocalGlobalAttention(C, H, window=2, global_tokens=torch.tensor([0, 3]), causal=True).eval()
    assert m.global_positions == (0, 3)
    x = torch.randn(1, 8, C)
    with torch.no_grad():
        assert torch.equal(pickle.loads(pickle.dumps(m))(x), m(x))
