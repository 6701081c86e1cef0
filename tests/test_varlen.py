"""attention_varlen == attention on each sequence alone (float64 per-sequence reference), forward and backward."""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
from attnzoo.functional.varlen import varlen_mask
from attnzoo.masks import BLOCK_EMPTY, BLOCK_FULL

SELF = ([70, 0, 200, 5, 130], None)  # self-attention lengths (cu_k = cu_q), an empty sequence included
CROSS = ([70, 3, 20, 5, 130], [90, 10, 10, 0, 150])  # n_q < n_k, n_q > n_k, a sequence with no key


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lq: list[int], lk: list[int] | None, hq=4, hkv=2, d=16, dv=12, dtype=torch.float32):
    lk = lq if lk is None else lk
    q = torch.randn(sum(lq), hq, d, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, dtype=dtype)
    v = torch.randn(sum(lk), hkv, dv, dtype=dtype)
    return q, k, v, _cu(lq), _cu(lk)


def per_sequence_reference(q, k, v, cu_q, cu_k, *, sinks=None, **kw):
    """Oracle: float64 ``az.attention(backend="reference")`` on every sequence alone."""
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        nq, nk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if nq == 0:
            continue
        if nk == 0:
            outs.append(torch.zeros(nq, q.shape[1], v.shape[-1], dtype=torch.float64))
            base = torch.full((q.shape[1], nq), float("-inf"), dtype=torch.float64)
            lses.append(base if sinks is None else torch.logaddexp(base, sinks.double().view(-1, 1)))
            continue
        qi, ki, vi = (t.double().transpose(0, 1).unsqueeze(0)
                      for t in (q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]]))
        o, lse = az.attention(qi, ki, vi, return_lse=True, backend="reference",
                              sinks=None if sinks is None else sinks.double(), **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


CASES = [
    dict(lengths=SELF, causal=True),
    dict(lengths=SELF, causal=True, window=(17, 0)),
    dict(lengths=SELF, window=(9, 4), softcap=5.0),
    dict(lengths=SELF, causal=True, alibi=True),
    dict(lengths=CROSS, causal=True),
    dict(lengths=CROSS, window=(30, 3)),
    dict(lengths=CROSS, causal=True, alibi=True),  # per-sequence ALiBi distances: loop path
    dict(lengths=CROSS, causal=True, sinks=True),
    dict(lengths=SELF, sinks=True),
]


def _kwargs(c: dict, hq: int) -> dict:
    kw = {n: c[n] for n in ("causal", "window", "softcap") if n in c}
    if c.get("alibi"):
        kw["alibi_slopes"] = torch.linspace(0.05, 0.5, hq)
    return kw


@pytest.mark.parametrize("backend", ["auto", "tiled"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_packed_equals_per_sequence_forward_and_backward(backend: str, case: dict) -> None:
    q, k, v, cu_q, cu_k = _inputs(*case["lengths"])
    sinks = torch.randn(4) if case.get("sinks") else None
    leaves = [t.requires_grad_() for t in (q, k, v, *([sinks] if sinks is not None else []))]
    kw = _kwargs(case, 4)
    out, lse = az.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True, backend=backend, **kw)
    want_out, want_lse = per_sequence_reference(q, k, v, cu_q, cu_k, sinks=sinks, **kw)
    assert out.shape == (q.shape[0], 4, 12) and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    go, gl = torch.randn_like(want_out), torch.randn_like(want_lse).nan_to_num(0.0)
    fin = torch.isfinite(want_lse)  # -inf LSE rows (no key, no sink): no LSE gradient there
    loss = (out * go).sum() + (lse.double().where(fin, 0.0) * gl).sum()
    want_loss = (want_out * go).sum() + (want_lse.where(fin, 0.0) * gl).sum()
    got = torch.autograd.grad(loss, leaves)
    want = torch.autograd.grad(want_loss, leaves)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"grad {i}: {m}")


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_per_sequence_backends(backend: str) -> None:
    q, k, v, cu_q, cu_k = _inputs(*CROSS)
    out = az.attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend=backend)
    want, _ = per_sequence_reference(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_packed_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    import attnzoo.functional.flex as flex

    monkeypatch.setattr(flex, "COMPILE", False)  # eager FlexAttention: no compile time in the suite
    q, k, v, cu_q, cu_k = _inputs([40, 25, 0, 70], None, hq=2, hkv=1)
    with torch.no_grad():
        out = az.attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend="flex")
    want, _ = per_sequence_reference(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (40, 0)), (False, (7, 60))])
@pytest.mark.parametrize("lengths", [SELF, CROSS], ids=["self", "cross"])
def test_block_map_is_exact_where_it_matters(lengths, causal, window) -> None:
    """No tile marked empty has a visible pair, no tile marked full a hidden one, and every tile
    whose queries and keys lie in different sequences is empty (never computed)."""
    lq, lk = lengths[0], lengths[1] or lengths[0]
    cu_q, cu_k = _cu(lq), _cu(lk)
    m = varlen_mask(cu_q, cu_k, causal=causal, window=window)
    tq, tk, bq, bk = sum(lq), sum(lk), 32, 16
    dense = m.materialize(1, 1, tq, tk, q_offset=0)[0, 0]
    bm = m.block_map(1, 1, tq, tk, bq, bk, q_offset=0)[0, 0]
    seq_q = torch.searchsorted(cu_q[1:].long(), torch.arange(tq), right=True)
    seq_k = torch.searchsorted(cu_k[1:].long(), torch.arange(tk), right=True)
    for i in range(bm.shape[0]):
        for j in range(bm.shape[1]):
            tile = dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            if bm[i, j] == BLOCK_EMPTY:
                assert not tile.any(), (i, j)
            if bm[i, j] == BLOCK_FULL:
                assert tile.all(), (i, j)
            sq, sk = set(seq_q[i * bq:(i + 1) * bq].tolist()), set(seq_k[j * bk:(j + 1) * bk].tolist())
            if not sq & sk:
                assert bm[i, j] == BLOCK_EMPTY, (i, j)


def test_dense_pattern_is_block_diagonal() -> None:
    cu = _cu([2, 3])
    dense = varlen_mask(cu, cu, causal=True).materialize(1, 1, 5, 5, q_offset=0)[0, 0].int()
    assert dense.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


@pytest.mark.parametrize("cu_q, cu_k, exc, words", [
    (torch.tensor([0, 2, 5]), torch.tensor([0, 2, 5], dtype=torch.int32), TypeError, "int32"),
    (torch.tensor([1, 2, 5], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32), ValueError, "start at 0"),
    (torch.tensor([0, 4, 3, 5], dtype=torch.int32), torch.tensor([0, 2, 4, 5], dtype=torch.int32), ValueError,
     "non-decreasing"),
    (torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32), ValueError, "end at"),
    (torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32), ValueError,
     "same number of sequences"),
    (torch.tensor([[0, 5]], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), ValueError, "1-d"),
    ([0, 5], torch.tensor([0, 5], dtype=torch.int32), TypeError, "int32 tensor"),
])
def test_bad_cu_seqlens(cu_q, cu_k, exc, words) -> None:
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    with pytest.raises(exc, match=words):
        az.attention_varlen(q, k, v, cu_q, cu_k)


def test_bad_shapes() -> None:
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"rank 3 \[T, H, D\]"):
        az.attention_varlen(torch.randn(1, 5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), cu, cu)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        az.attention_varlen(torch.randn(5, 3, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), cu, cu)
    with pytest.raises(ValueError, match="backend"):
        az.attention_varlen(torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), cu, cu, backend="x")


def test_docs_examples_run_and_drawings_hold() -> None:
    """docs/softmax-frontier.md: every python block runs; the drawn varlen patterns are the mask's."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "softmax-frontier.md").read_text()
    found = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(found) >= 3
    for i, code in enumerate(found):
        exec(compile(code, f"softmax-frontier.md[block {i}]", "exec"), {"__name__": "__doc_example__"})
    cq, ck = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
    drawn = re.findall(r"seq \d  row \d \(pos -?\d\)\s+([01]) ([01]) ([01]) \| ([01]) ([01])", text)
    assert len(drawn) == 10
    for kw, rows in (({"causal": True}, drawn[:5]), ({"window": (0, 1)}, drawn[5:])):
        dense = varlen_mask(cq, ck, **kw).materialize(1, 1, 5, 5, q_offset=0)[0, 0].int().tolist()
        assert dense == [[int(x) for x in r] for r in rows], kw
