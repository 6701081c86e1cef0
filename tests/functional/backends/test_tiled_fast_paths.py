"""Two forward paths of the ``tiled`` backend (issue 37) against the reference: the head-flattened
window band (``tiled/flat.py``) and the whole-row softmax of a query block (``forward._forward_row``).

Small tile sizes (``use_tiles``) make small inputs cross many blocks and groups; each case also
checks that the request really takes the path under test. Forward, LSE and gradients in float64 to
1e-11; float32 and bfloat16 within twice plain eager attention's error (float64 reference)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnzoo as az
from attnzoo.functional.backends.tiled import forward as tiled_forward
from attnzoo.functional.backends.tiled import plan_for
from attnzoo.functional.backends.tiled.flat import flat_window
from attnzoo.functional.backends.tiled.plan import TileConfig, use_tiles
from attnzoo.functional.core._request import build_request

F64 = torch.float64
#: blocks of 4-16 rows, groups of a few blocks: N=256 crosses dozens of groups and every edge
TILES = TileConfig(block_q=16, block_k=8, max_chunk_k=64, merge_k=64, min_band_block=4, band_elems=1 << 16,
                   flat_elems=2000, row_elems=1 << 14)


def _qkv(B: int, H: int, N: int, D: int = 8, Hkv: int | None = None, dtype=F64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, N, D), (B, Hkv or H, N, D), (B, Hkv or H, N, D))
    return tuple(torch.randn(s, generator=g, dtype=F64).to(dtype).requires_grad_() for s in shapes)


def _takes_flat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: TileConfig = TILES, **kw) -> bool:
    r = build_request(q, k, v, mask=None, causal=kw.get("causal", False), window=kw.get("window"),
                      q_offset=kw.get("q_offset"), scale=None, softcap=kw.get("softcap"), alibi_slopes=None,
                      dropout_p=0.0, return_lse=True, return_weights=False)
    with use_tiles(tiles):
        return flat_window(r, plan_for(r), q, k, v) is not None


def _grads(out: torch.Tensor, lse: torch.Tensor, inputs) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out.double() ** 2).sum() + lse.double().sum(), inputs)


FLAT_CASES = [  # B, H, N, causal, window, softcap
    (2, 3, 256, True, (20, 0), None),    # a causal window: 5 blocks of 4 keys before each block
    (1, 2, 256, False, (17, 5), None),   # two-sided: edge blocks at both ends of every head
    (1, 2, 192, True, (33, None), None),  # right side cut by causality
    (2, 2, 256, True, (20, 0), 5.0),     # softcap
    (1, 2, 256, False, (3, 2), None),    # a window narrower than a block
]


@pytest.mark.parametrize("case", FLAT_CASES)
def test_flat_band_equals_reference_float64(case) -> None:
    B, H, N, causal, window, softcap = case
    q, k, v = _qkv(B, H, N)
    kw = dict(causal=causal, window=window, softcap=softcap)
    assert _takes_flat(q, k, v, **kw), f"{case}: not served by the flat band"
    with use_tiles(TILES):
        out, lse = az.attention(q, k, v, backend="tiled", return_lse=True, **kw)
    ref, ref_lse = az.attention(q, k, v, backend="reference", return_lse=True, **kw)
    assert (out - ref).abs().max() < 1e-12, f"{case}: out error {(out - ref).abs().max():.2e}"
    assert (lse - ref_lse).abs().max() < 1e-12, f"{case}: lse error {(lse - ref_lse).abs().max():.2e}"
    for name, a, b in zip("qkv", _grads(out, lse, (q, k, v)), _grads(ref, ref_lse, (q, k, v)), strict=True):
        assert (a - b).abs().max() < 1e-11, f"{case}: d{name} error {(a - b).abs().max():.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_band_low_precision_is_as_good_as_eager(dtype: torch.dtype) -> None:
    """The flat band in float32 (bfloat16 inputs run in float32 too) within twice eager's error."""
    q, k, v = _qkv(1, 4, 512, D=16, dtype=dtype, seed=1)
    kw = dict(causal=True, window=(40, 0))
    assert dtype != torch.float32 or _takes_flat(q, k, v, **kw)
    with torch.no_grad(), use_tiles(TILES):
        out = az.attention(q, k, v, backend="tiled", **kw)
    ref = az.attention(*(t.detach().double() for t in (q, k, v)), backend="reference", **kw)
    pos = torch.arange(512)
    visible = (pos.view(-1, 1) >= pos.view(1, -1)) & (pos.view(-1, 1) - 40 <= pos.view(1, -1))
    s = (q.detach() @ k.detach().transpose(-1, -2)) * 16 ** -0.5  # plain eager math in dtype
    eager = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v.detach()
    err, err_eager = (out.double() - ref).abs().max(), (eager.double() - ref).abs().max()
    assert out.dtype == dtype and err <= 2 * err_eager + 1e-6, f"{dtype}: {err:.2e} vs eager {err_eager:.2e}"


FALLBACKS = {  # what the flat band does not serve: the band path runs, same numbers
    "gqa": dict(H=4, Hkv=2),
    "q_offset": dict(q_offset=3),
    "transposed": dict(transposed=True),
    "ragged_n": dict(N=250),
    "switched_off": dict(tiles=dataclasses.replace(TILES, flat_elems=0)),
}


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_flat_band_declines_and_band_path_is_exact(name: str) -> None:
    spec = dict(FALLBACKS[name])
    N, H = spec.pop("N", 256), spec.pop("H", 2)
    q, k, v = _qkv(1, H, N, Hkv=spec.pop("Hkv", None))
    if spec.pop("transposed", False):  # [B, N, H, D] storage seen as [B, H, N, D]
        q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    tiles = spec.pop("tiles", TILES)
    kw = dict(causal=True, window=(20, 0), **spec)
    assert not _takes_flat(q, k, v, tiles, **kw), f"{name}: unexpectedly served by the flat band"
    with use_tiles(tiles):
        out, lse = az.attention(q, k, v, backend="tiled", return_lse=True, **kw)
    ref, ref_lse = az.attention(q, k, v, backend="reference", return_lse=True, **kw)
    assert (out - ref).abs().max() < 1e-12, f"{name}: out error {(out - ref).abs().max():.2e}"
    fin = torch.isfinite(ref_lse)
    assert (lse - ref_lse)[fin].abs().max() < 1e-12 and torch.equal(fin, torch.isfinite(lse)), f"{name}: lse"


ROW_CASES = {  # B, Hq, Hkv, Nq, Nk, keywords: rows of <= 1 << 14 scores take the whole-row softmax
    "causal": (2, 4, 4, 200, 200, dict(causal=True)),  # short rows whole, long rows by chunks
    "gqa_q_offset": (1, 4, 2, 100, 180, dict(causal=True)),  # 80 cached keys before the queries
    "softcap_alibi_dense": (1, 2, 2, 150, 150, dict(softcap=4.0, alibi=True)),
    "mask_object_sinks": (2, 2, 1, 120, 120, dict(mask=az.masks.causal() & az.masks.key_padding([120, 70]),
                                                  sinks=True)),
    "two_sided_window_gqa": (1, 4, 2, 300, 300, dict(window=(90, 60))),
}


def _row_kwargs(spec: dict, hq: int) -> dict:
    kw = dict(spec)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.linspace(0.05, 0.3, hq, dtype=F64)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-1.0, 1.0, hq, dtype=F64)
    return kw


@pytest.mark.parametrize("row_elems", [1 << 14, 0], ids=["rows", "chunks_only"])
@pytest.mark.parametrize("name", sorted(ROW_CASES))
def test_whole_row_softmax_equals_reference_float64(name: str, row_elems: int, monkeypatch) -> None:
    """With ``row_elems=0`` every block runs the online softmax by chunks (the path it replaced)."""
    B, Hq, Hkv, Nq, Nk, spec = ROW_CASES[name]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, Hq, Nq, 8, generator=g, dtype=F64).requires_grad_()
    k, v = (torch.randn(B, Hkv, Nk, 8, generator=g, dtype=F64).requires_grad_() for _ in range(2))
    kw = _row_kwargs(spec, Hq)
    calls = []
    row = tiled_forward._forward_row
    monkeypatch.setattr(tiled_forward, "_forward_row", lambda *a: calls.append(a[2]) or row(*a))
    with use_tiles(dataclasses.replace(TILES, row_elems=row_elems)):
        out, lse = az.attention(q, k, v, backend="tiled", return_lse=True, **kw)
    ref, ref_lse = az.attention(q, k, v, backend="reference", return_lse=True, **kw)
    assert bool(calls) == bool(row_elems), f"{name}: {len(calls)} blocks took the whole-row softmax"
    assert (out - ref).abs().max() < 1e-12, f"{name}: out error {(out - ref).abs().max():.2e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse - ref_lse)[fin].abs().max() < 1e-12, f"{name}: lse"
    lse, ref_lse = lse.masked_fill(~fin, 0), ref_lse.masked_fill(~fin, 0)
    for gn, a, b in zip("qkv", _grads(out, lse, (q, k, v)), _grads(ref, ref_lse, (q, k, v)), strict=True):
        assert (a - b).abs().max() < 1e-11, f"{name}: d{gn} error {(a - b).abs().max():.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_row_softmax_low_precision_is_as_good_as_eager(dtype: torch.dtype) -> None:
    """Dense causal attention, every block through the whole-row softmax (default tile sizes)."""
    q, k, v = (t.detach() for t in _qkv(1, 4, 512, D=16, dtype=dtype, seed=4))
    with torch.no_grad():
        out = az.attention(q, k, v, causal=True, backend="tiled")
    ref = az.attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    s = (q @ k.transpose(-1, -2)) * 16 ** -0.5  # plain eager math in dtype
    eager = torch.softmax(s.masked_fill(~torch.ones(512, 512, dtype=torch.bool).tril(), float("-inf")), -1) @ v
    err, err_eager = (out.double() - ref).abs().max(), (eager.double() - ref).abs().max()
    assert out.dtype == dtype and err <= 2 * err_eager + 1e-6, f"{dtype}: {err:.2e} vs eager {err_eager:.2e}"
