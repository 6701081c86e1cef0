"""Empty inputs, degenerate shapes and non-finite hidden keys on every backend (issue 14,
defects 2 and 3): empty key sets give zeros and LSE -inf, empty queries/batches give empty
outputs, zero heads or head dims a ValueError naming the argument, and a key a row cannot see
never changes that row."""

from __future__ import annotations

import pytest
import torch

import attnzoo as az

BACKENDS = ("reference", "sdpa", "tiled", "flex", "auto")
LSE_BACKENDS = ("reference", "tiled", "flex", "auto")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # flex's eager-mode notice


def _skip_unavailable(backend: str) -> None:
    if backend not in ("auto", *az.functional.available_backends("cpu")):
        pytest.skip(f"{backend} unavailable")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_no_keys_gives_zeros(backend: str, causal: bool) -> None:
    _skip_unavailable(backend)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 0, 8), torch.randn(2, 2, 0, 5)
    out = az.attention(q, k, v, causal=causal, backend=backend)
    assert out.shape == (2, 4, 3, 5) and torch.equal(out, torch.zeros_like(out))
    if backend in LSE_BACKENDS:
        out, lse = az.attention(q, k, v, causal=causal, backend=backend, return_lse=True)
        assert lse.shape == (2, 4, 3) and torch.isneginf(lse).all() and not out.any()


def test_no_keys_keeps_gradients_and_weights() -> None:
    q, k = torch.randn(1, 2, 3, 8, requires_grad=True), torch.randn(1, 2, 0, 8, requires_grad=True)
    v = torch.randn(1, 2, 0, 8, requires_grad=True)
    out, w = az.attention(q, k, v, return_weights=True)
    assert w.shape == (1, 2, 3, 0)
    out.sum().backward()  # zeros, but part of the graph
    assert v.grad is not None and v.grad.shape == v.shape


def test_merging_an_empty_shard_changes_nothing() -> None:
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    full, full_lse = az.attention(q, k, v, return_lse=True, backend="tiled")
    empty, empty_lse = az.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True, backend="tiled")
    out, lse = az.merge_attention([full, empty], [full_lse, empty_lse])
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_queries_or_batch_gives_empty_outputs(backend: str) -> None:
    _skip_unavailable(backend)
    k = torch.randn(1, 2, 5, 8)
    out = az.attention(torch.randn(1, 2, 0, 8), k, k, causal=True, backend=backend)
    assert out.shape == (1, 2, 0, 8)
    z = torch.randn(0, 2, 5, 8)
    assert az.attention(z, z, z, causal=True, backend=backend).shape == (0, 2, 5, 8)
    if backend in LSE_BACKENDS:
        assert az.attention(z, z, z, backend=backend, return_lse=True)[1].shape == (0, 2, 5)


@pytest.mark.parametrize(("q_shape", "kv_shape", "v_dim", "word"), [
    ((1, 0, 3, 8), (1, 0, 3, 8), 8, "Hq = 0"),
    ((1, 2, 3, 8), (1, 0, 3, 8), 8, "Hkv = 0"),
    ((1, 2, 3, 0), (1, 2, 3, 0), 4, "D = 0"),
    ((1, 2, 3, 8), (1, 2, 3, 8), 0, "Dv = 0"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_degenerate_shapes_name_the_argument(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], v_dim: int,
                                             word: str, backend: str) -> None:
    q, k = torch.randn(q_shape), torch.randn(kv_shape)
    v = torch.randn(*kv_shape[:3], v_dim)
    with pytest.raises(ValueError, match=word):
        az.attention(q, k, v, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_hidden_nonfinite_key_changes_no_row(backend: str, where: str, value: float) -> None:
    _skip_unavailable(backend)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    clean = az.attention(q, k, v, causal=True, backend=backend)
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if where == "k" else bad_v)[0, 0, 5, 0] = value
    out = az.attention(q, bad_k, bad_v, causal=True, backend=backend)
    torch.testing.assert_close(out[:, :, :3], clean[:, :, :3])  # rows 0-2 cannot see key 5
    torch.testing.assert_close(out[:, 1], clean[:, 1])  # nor can head 1's rows see head 0's keys
    assert not torch.isfinite(out[0, 0, 3]).all()  # row 3 sees it


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_hidden_nonfinite_key_under_masks_and_gqa(backend: str) -> None:
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[1, :, :, 2] = False  # batch 1 hides key 2 from every row
    clean = az.attention(q, k, v, mask=mask, window=(1, 1), backend=backend)
    k2 = k.clone()
    k2[1, 0, 2] = float("nan")
    out = az.attention(q, k2, v, mask=mask, window=(1, 1), backend=backend)
    torch.testing.assert_close(out, clean)


@pytest.mark.parametrize("slopes", [[float("nan"), 0.5], [float("inf"), 0.5]])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_alibi_slopes_are_refused(backend: str, slopes: list[float]) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        az.attention(q, q, q, alibi_slopes=torch.tensor(slopes), backend=backend)
