"""attention_varlen == attention on each sequence alone (float64 per-sequence reference), forward and backward."""

from __future__ import annotations

import pytest
import torch
from tests.tools.test_docs import run_blocks

import attnzoo as az
from attnzoo.functional.softmax.varlen import varlen_mask
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
    import attnzoo.functional.backends.flex as flex

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
    _assert_block_map_exact(_cu(lq), _cu(lk), causal, window, 32, 16)


@pytest.mark.parametrize("causal, window", [(True, None), (True, (5, 0)), (False, (3, 6))])
def test_block_map_is_exact_for_every_sequence_start_within_two_tiles(causal, window) -> None:
    """The cases above never put a sequence start (or a window's first key) on a key tile's last
    key, the one place where an off-by-one in the empty-tile test changes the map: a mutation there
    passed the whole suite while a packed causal [127, 173] was 2.8 off. Every first length from
    1 to two key tiles, tiny tiles."""
    for first in range(1, 9):
        cu = _cu([first, 13, 6])
        _assert_block_map_exact(cu, cu, causal, window, 8, 4)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native-if-built", "pytorch-path"])
def test_packed_tiled_equals_each_sequence_alone_at_a_tile_edge(native: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression case of the mutation above: a sequence boundary one key before a tile edge
    (the compiled kernel, where built, has no block map: the PyTorch path is the one it tests)."""
    monkeypatch.setenv("ATTNZOO_NATIVE", native)
    torch.manual_seed(0)
    q, k, v, cu_q, cu_k = _inputs([127, 173], None)
    out = az.attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend="tiled")
    want, _ = per_sequence_reference(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def _assert_block_map_exact(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, window, bq: int, bk: int) -> None:
    m = varlen_mask(cu_q, cu_k, causal=causal, window=window)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
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

    text = run_blocks("docs/softmax-frontier.md", minimum=3)
    cq, ck = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
    drawn = re.findall(r"seq \d  row \d \(pos -?\d\)\s+([01]) ([01]) ([01]) \| ([01]) ([01])", text)
    assert len(drawn) == 10
    for kw, rows in (({"causal": True}, drawn[:5]), ({"window": (0, 1)}, drawn[5:])):
        dense = varlen_mask(cq, ck, **kw).materialize(1, 1, 5, 5, q_offset=0)[0, 0].int().tolist()
        assert dense == [[int(x) for x in r] for r in rows], kw


# ------------------------------------------- training: attnzoo::varlen_fwd + attnzoo::varlen_bwd
def _train_args(case: dict, dtype=torch.float64, hq=4) -> tuple[list[torch.Tensor], dict, torch.Tensor, torch.Tensor]:
    q, k, v, cu_q, cu_k = _inputs(*case["lengths"], hq=hq, dtype=dtype)
    sinks = torch.randn(hq, dtype=dtype) if case.get("sinks") else None
    leaves = [t.requires_grad_() for t in (q, k, v, *([sinks] if sinks is not None else []))]
    kw = _kwargs(case, hq)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(dtype)
    return leaves, kw, cu_q, cu_k


def _loss_grads(fn, leaves: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    """Outputs and gradients of ``sum(out * go) + sum(lse * gl)`` (finite LSE rows), leaves in order."""
    out, lse = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    gl = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    fin = torch.isfinite(lse.detach())
    loss = (out.double() * go).sum() + (lse.double().where(fin, 0.0) * gl).sum()
    return [out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)]


def _varlen_call(cu_q: torch.Tensor, cu_k: torch.Tensor, kw: dict, backend: str = "auto"):
    def fn(q, k, v, sinks=None):
        return az.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True, backend=backend, **kw)
    return fn


@pytest.mark.parametrize("case", CASES, ids=str)
def test_float64_gradients_through_the_operator_equal_per_sequence_reference(case: dict) -> None:
    """Eager training runs attnzoo::varlen_fwd / varlen_bwd (cross-sequence tiles skipped in both
    directions); its q, k, v (and sink) gradients equal the float64 per-sequence reference tightly."""
    leaves, kw, cu_q, cu_k = _train_args(case)
    out, _ = _varlen_call(cu_q, cu_k, kw)(*leaves)
    assert "attnzoo_varlen_fwd" in out.grad_fn.name()
    got = _loss_grads(_varlen_call(cu_q, cu_k, kw), leaves)
    want = _loss_grads(lambda q, k, v, sinks=None: per_sequence_reference(q, k, v, cu_q, cu_k, sinks=sinks, **kw),
                       leaves)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10, msg=lambda m, i=i: f"output {i}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", [True, False], ids=["half-tiles", "float32-tiles"])
def test_half_gradients_through_the_operator(dtype: torch.dtype, native: bool, monkeypatch: pytest.MonkeyPatch,
                                             ) -> None:
    """Half inputs: tiles in the half dtype or in float32 (what halfmath picks per machine), both tested."""
    import attnzoo.functional.backends.tiled as tiled
    import attnzoo.functional.softmax.varlen as varlen

    for module in (tiled, varlen):
        monkeypatch.setattr(module, "native_half_matmul", lambda dt, device_type: native)
    leaves, kw, cu_q, cu_k = _train_args(dict(lengths=SELF, causal=True, window=(17, 0), sinks=True), dtype=dtype)
    got = _loss_grads(_varlen_call(cu_q, cu_k, kw), leaves)
    want = _loss_grads(lambda q, k, v, sinks: per_sequence_reference(q, k, v, cu_q, cu_k, sinks=sinks, **kw),
                       leaves)
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[2:])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=5e-2, rtol=5e-2)


def test_hidden_nonfinite_keys_do_not_spoil_other_gradients() -> None:
    """A NaN/inf key changes only the rows that see it (NaN output, no gradient), as in every other
    path; the backward skips them too (no 0 * NaN through a tile shared by two sequences)."""
    q, k, v, cu_q, cu_k = _inputs([40, 60, 30], None, dtype=torch.float64)
    v[50, 0, 3], k[95, 1, 0] = float("nan"), float("inf")
    sinks = torch.randn(4, dtype=torch.float64)
    res = {}
    for backend in ("auto", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out, lse = _varlen_call(cu_q, cu_k, dict(causal=True), backend)(*leaves)
        (out.nan_to_num(0.0).sum() + lse.nan_to_num(0.0).sum()).backward()
        res[backend] = [out.detach(), *(t.grad for t in leaves)]
    assert res["auto"][0][40:50].isfinite().all() and res["auto"][0][50:100].isnan().any()
    for g, w in zip(res["auto"][:4], res["reference"][:4], strict=True):  # out, dq, dk, dv
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10, equal_nan=True)
    # the sink gradient skips the NaN rows too (autograd through the sink correction gives NaN: 0 * NaN)
    assert all(g.isfinite().all() for g in res["auto"][1:])


# cases that together cover sinks, window, softcap, GQA, LSE, ALiBi (same and different cu_seqlens)
COMPILE_CASES = [
    dict(lengths=SELF, causal=True, window=(17, 0), sinks=True),
    dict(lengths=CROSS, window=(30, 3), softcap=5.0),
    dict(lengths=SELF, causal=True, alibi=True),
    dict(lengths=CROSS, causal=True, alibi=True, sinks=True),
]


def _graph_capture(graphs: dict[str, set[str]]):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def capture(name: str):
        def compiler(gm: torch.fx.GraphModule, example: object) -> object:
            graphs[name] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))


@pytest.mark.parametrize("case", COMPILE_CASES, ids=str)
def test_compiled_training_runs_the_operators_and_matches_eager(case: dict) -> None:
    """Compiled training holds one varlen_fwd node forward and one varlen_bwd node backward (no
    dense [Tq, Tk] mask), and its outputs and gradients equal eager mode's."""
    leaves, kw, cu_q, cu_k = _train_args(case, dtype=torch.float32)
    want = _loss_grads(_varlen_call(cu_q, cu_k, kw), leaves)
    graphs: dict[str, set[str]] = {}
    torch._dynamo.reset()
    compiled = torch.compile(_varlen_call(cu_q, cu_k, kw), backend=_graph_capture(graphs), fullgraph=True)
    got = _loss_grads(compiled, leaves)
    assert "attnzoo.varlen_fwd.default" in graphs["forward"], graphs["forward"]
    assert "attnzoo.varlen_bwd.default" in graphs["backward"], graphs["backward"]
    assert not any("searchsorted" in t or "tiled" in t for t in graphs["forward"] | graphs["backward"])
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=0, rtol=0, msg=lambda m, i=i: f"output {i}: {m}")


def _training_step(cu: torch.Tensor):
    def step(q, k, v, sinks):
        out, lse = az.attention_varlen(q, k, v, cu, cu, causal=True, window=(12, 0), sinks=sinks, return_lse=True)
        loss = out.square().sum() + lse.sum()
        loss.backward()
        return loss.detach()
    return step


def test_training_step_forward_and_backward_has_no_graph_breaks() -> None:
    """Forward + backward traced as one graph (Dynamo traces ``backward()`` with trace_autograd_ops),
    with fullgraph=True; the gradients equal eager mode's."""
    q, k, v, cu, _ = _inputs([10, 0, 20, 18], None)
    sinks = torch.linspace(-1.0, 1.0, 4)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    step = _training_step(cu)
    step(*leaves)
    want = [t.grad.clone() for t in leaves]
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        torch._dynamo.reset()
        assert torch._dynamo.explain(step)(*leaves).graph_break_count == 0
        for t in leaves:
            t.grad = None
        torch._dynamo.reset()
        torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves)
    for g, w in zip((t.grad for t in leaves), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_varlen_operators_pass_opcheck() -> None:
    from attnzoo.functional.softmax.varlen import varlen_bwd, varlen_fwd

    q, k, v, cu_q, cu_k = _inputs([7, 0, 12], [9, 3, 12], hq=4, hkv=2, d=8, dv=6, dtype=torch.float64)
    sinks, slopes = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64), torch.linspace(0.1, 0.4, 4, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    for alibi, win in ((None, (5, 0)), (slopes, None)):
        torch.library.opcheck(varlen_fwd, (q, k, v, cu_q, cu_k, True, *(win or (None, None)), win is not None,
                                           None, 4.0, alibi, leaves[3], True, "tiled"))
    out, lse = varlen_fwd(*(t.detach() for t in (q, k, v)), cu_q, cu_k, True, None, None, False, None, None, slopes,
                          sinks.detach(), True, "tiled")
    for d_lse in (None, torch.randn_like(lse)):
        torch.library.opcheck(varlen_bwd, (torch.randn_like(out), d_lse, q.detach(), k.detach(), v.detach(), out, lse,
                                           cu_q, cu_k, True, None, None, False, None, None, slopes, sinks.detach()))
