"""``score_mod`` (issue 36): every backend that serves it against a dense float64 oracle written from
the math (forward, LSE and gradients, the captured tensors' included), its compositions, its
routing, its memory, and bad input. The oracle (``tests/oracle.py``) knows nothing of score_mod:
each test writes the bias its score_mod adds as a dense float mask from the same formula."""

from __future__ import annotations

import pytest
import torch
from tests.oracle import oracle_attention
from tests.tools.test_docs import run_blocks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import attnzoo as az
from attnzoo.functional import choose_backend
from attnzoo.functional.backends.tiled import TileConfig, use_tiles
from attnzoo.functional.core._request import build_request
from attnzoo.nn.parts import AttentionParts, Scores
from attnzoo.variants import build_attention

SMALL = TileConfig(block_q=8, block_k=4, max_chunk_k=12, merge_k=8)


def _qkv(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dv: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(True)
                 for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))


def _grads(out: torch.Tensor, lse: torch.Tensor, wrt: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    lse_w = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return list(torch.autograd.grad((out * w).sum() + 0.3 * lse_w.sum(), wrt))


def _bias_dense(table: torch.Tensor, slopes: torch.Tensor, nq: int, nk: int, off: int, span: int) -> torch.Tensor:
    """The oracle's copy of ``_relative_mod``: ``table[p - j + span] - slopes[h] |p - j|`` as [1, Hq, Nq, Nk]."""
    p = torch.arange(off, off + nq).view(-1, 1)
    j = torch.arange(nk).view(1, -1)
    rel = p - j
    return (table.double()[rel + span] - slopes.double().view(-1, 1, 1) * rel.abs().double()).unsqueeze(0)


def _relative_mod(table: torch.Tensor, slopes: torch.Tensor, span: int):
    def mod(score, b, h, q_idx, kv_idx):
        rel = q_idx - kv_idx
        return score + table[rel + span].to(score.dtype) - slopes[h].to(score.dtype) * rel.abs().to(score.dtype)
    return mod


CASES = [
    dict(causal=True),
    dict(causal=True, window=(5, 0)),
    dict(window=(3, 4)),
    dict(causal=True, softcap=2.0),
    dict(causal=True, q_offset=4),
    dict(hkv=1),  # MQA
    dict(causal=True, dv=5, hkv=2),
    dict(nq=1),  # decode: one query at the last position
]


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_score_mod_matches_oracle(backend: str, dtype: torch.dtype, case: dict) -> None:
    case = dict(case)
    hkv, dv, nq = case.pop("hkv", 4), case.pop("dv", 8), case.pop("nq", 19)
    b, hq, nk = 2, 4, 23
    q, k, v = _qkv(b, hq, hkv, nq, nk, 8, dv, dtype)
    span = nq + nk + 8
    g = torch.Generator().manual_seed(3)
    table = torch.randn(2 * span + 1, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    slopes = torch.rand(hq, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    off = case.get("q_offset", nk - nq)
    with use_tiles(SMALL):
        out, lse = az.attention(q, k, v, score_mod=_relative_mod(table, slopes, span), return_lse=True,
                                backend=backend, **case)
    ref_out, ref_lse = oracle_attention(q, k, v, mask=_bias_dense(table, slopes, nq, nk, off, span), **case)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    got = _grads(out, lse, [q, k, v, table, slopes])
    want = _grads(ref_out, ref_lse, [q, k, v, table, slopes])
    for name, a, w in zip(["q", "k", "v", "table", "slopes"], got, want, strict=True):
        torch.testing.assert_close(a.double(), w.double(), rtol=tol * 10, atol=tol * 10, msg=name)


def test_nonlinear_score_mod_and_module_parameters() -> None:
    """A multiplicative per-head gate (``s * g_h`` is attention with q_h scaled by g_h) read from an
    ``nn.Module``'s parameter, on the tiled backend with GQA and a window: exact, gradients included."""
    q, k, v = _qkv(1, 4, 2, 17, 17, 8, 8, torch.float64)
    lin = torch.nn.Linear(1, 4, dtype=torch.float64)

    def mod(score, b, h, q_idx, kv_idx):
        gate = torch.sigmoid(lin.weight[:, 0] + lin.bias)  # [H], computed inside score_mod
        return score * gate[h]

    with use_tiles(SMALL):
        out = az.attention(q, k, v, causal=True, window=(6, 0), score_mod=mod, backend="tiled")
    gate = torch.sigmoid(lin.weight[:, 0] + lin.bias)
    ref, _ = oracle_attention(q * gate.view(1, 4, 1, 1), k, v, causal=True, window=(6, 0))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), [q, k, v, lin.weight, lin.bias])
    want = torch.autograd.grad((ref * w).sum(), [q, k, v, lin.weight, lin.bias])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_sinks_and_mask_objects_compose() -> None:
    """score_mod + sinks + a Mask object + ALiBi: tiled == reference (the definition), forward and grads."""
    q, k, v = _qkv(2, 4, 2, 21, 21, 8, 8, torch.float32, seed=1)
    sinks = torch.randn(4, requires_grad=True)
    table = torch.randn(64, requires_grad=True)
    alibi = torch.rand(4)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[(q_idx - kv_idx).abs()]

    mask = az.masks.causal() & az.masks.key_padding(torch.tensor([21, 15]))
    res = {}
    for backend in ("reference", "tiled"):
        with use_tiles(SMALL):
            out, lse = az.attention(q, k, v, mask=mask, sinks=sinks, score_mod=mod, alibi_slopes=alibi,
                                    return_lse=True, backend=backend)
        res[backend] = (out, lse, _grads(out, lse, [q, k, v, sinks, table]))
    for a, b in zip(tree_leaves(res["reference"]), tree_leaves(res["tiled"]), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_auto_routes_score_mod() -> None:
    q, k, v = _qkv(1, 2, 2, 9, 9, 8, 8, torch.float32)

    def mod(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - kv_idx).abs()

    ref = az.attention(q, k, v, causal=True, score_mod=mod, backend="reference")
    r = build_request(q, k, v, mask=None, causal=True, window=None, q_offset=None, scale=None, softcap=None,
                      alibi_slopes=None, dropout_p=0.0, return_lse=False, return_weights=False, score_mod=mod)
    assert choose_backend(r) == "tiled"
    torch.testing.assert_close(az.attention(q, k, v, causal=True, score_mod=mod), ref)
    out, w = az.attention(q, k, v, causal=True, score_mod=mod, return_weights=True)  # -> reference
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 9))
    torch.manual_seed(0)
    dropped = az.attention(q, k, v, causal=True, score_mod=mod, dropout_p=0.5)  # -> reference
    assert dropped.shape == ref.shape
    for backend in ("sdpa", "flash"):
        with pytest.raises(ValueError, match="score_mod"):
            az.attention(q, k, v, score_mod=mod, backend=backend)


def test_flex_forward_matches_and_refuses_cpu_gradients() -> None:
    if "flex" not in az.available_backends():
        pytest.skip("FlexAttention not available")
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 9, 9, 8, 8, torch.float32))
    slopes = torch.rand(2)

    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    ref = az.attention(q, k, v, causal=True, q_offset=3, score_mod=mod, backend="reference")
    got = az.attention(q, k, v, causal=True, q_offset=3, score_mod=mod, backend="flex")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    learned = slopes.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="gradients on CPU"):
        az.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * learned[h], backend="flex")


def test_varlen_score_mod_equals_each_sequence_alone() -> None:
    """Packed ``attention_varlen`` with a score_mod that reads the batch index (= the sequence) and
    positions (within each sequence) equals ``attention`` on each sequence alone; gradients too."""
    lens = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(17, 4, 8, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(3))
    per_seq = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_(True)

    def mod(score, b, h, q_idx, kv_idx):
        return score - per_seq[b, h] * (q_idx - kv_idx).abs()

    with use_tiles(SMALL):
        packed = az.attention_varlen(q, k, v, cu, cu, causal=True, score_mod=mod, backend="tiled")
    outs = []
    for i, (lo, n) in enumerate(zip(cu[:-1].tolist(), lens, strict=True)):
        qi, ki, vi = (t[lo:lo + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        alone = az.attention(qi, ki, vi, causal=True, backend="reference",
                             score_mod=lambda s, b, h, qq, kk, i=i: s - per_seq[i, h] * (qq - kk).abs())
        outs.append(alone[0].transpose(0, 1))
    want = torch.cat(outs)
    torch.testing.assert_close(packed, want, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((packed * w).sum(), [q, k, v, per_seq]),
                    torch.autograd.grad((want * w).sum(), [q, k, v, per_seq]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    per_seq_backend = az.attention_varlen(q, k, v, cu, cu, causal=True, score_mod=mod, backend="reference")
    torch.testing.assert_close(per_seq_backend, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [None, 3])
def test_module_score_mod_decode_equals_full(window: int | None) -> None:
    """``MultiHeadAttention(parts=AttentionParts(scores=Scores(score_mod=...)))``: token-by-token decoding with a cache == the full forward
    (the score_mod sees stream positions also when a sliding cache holds only the last keys)."""
    torch.manual_seed(0)
    slopes = torch.linspace(0.1, 0.8, 4)
    mod = Scores(score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs() + 0.01 * qi)
    mha = az.MultiHeadAttention(32, 4, causal=True, window=window, parts=AttentionParts(scores=mod))
    x = torch.randn(2, 11, 32)
    full = mha(x)
    cache = mha.init_cache(2, 11)
    steps = [mha(x[:, :4], cache=cache)] + [mha(x[:, t:t + 1], cache=cache) for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    plain = az.MultiHeadAttention(32, 4, causal=True, window=window)
    plain.load_state_dict(mha.state_dict())
    assert not torch.allclose(plain(x), full)  # the score_mod did something


class _Largest(TorchDispatchMode):
    """The largest tensor any operator returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_memory_is_linear_at_4096() -> None:
    """Forward + backward at N = 4096 with a score_mod (learned slopes) never makes a tensor of
    N x N / 32 elements: the largest is one score tile (512 x 1024 here); the reference backend,
    which does materialise the scores, trips the same kind of check (at N = 512)."""
    n = 4096
    q, k, v = (torch.randn(1, 1, n, 8, requires_grad=True) for _ in range(3))
    slopes = torch.rand(1, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    spy = _Largest()
    with use_tiles(TileConfig(block_q=512, block_k=512, max_chunk_k=1024, merge_k=1024)), spy:
        out = az.attention(q, k, v, causal=True, score_mod=mod, backend="tiled")
        out.sum().backward()
    assert slopes.grad is not None and torch.isfinite(slopes.grad).all()
    assert spy.numel <= 512 * 1024 <= n * n // 32, spy.numel
    dense = _Largest()
    with dense:
        m = 512
        az.attention(q[:, :, :m], k[:, :, :m], v[:, :, :m], causal=True, score_mod=mod, backend="reference")
    assert dense.numel >= m * m  # the check can fail


@pytest.mark.parametrize("bad, error, match", [
    (3, TypeError, "score_mod must be callable"),
    (lambda s, b, h, qi, ki: s.sum(), ValueError, "score's shape"),
    (lambda s, b, h, qi, ki: s.double(), TypeError, "score's dtype"),
    (lambda s, b, h, qi, ki: s + torch.zeros(3)[qi - ki + 100], ValueError, "score_mod raised IndexError"),
    (lambda s, b, h, qi: s, ValueError, "score_mod raised TypeError"),
    (lambda s, b, h, qi, ki: 1.0, TypeError, "score_mod must return a tensor"),
])
def test_bad_score_mod(bad, error, match) -> None:
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(error, match=match):
        az.attention(q, q, q, score_mod=bad)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(error, match=match):
        az.attention_varlen(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), cu, cu, score_mod=bad)
    with pytest.raises(TypeError, match="score_mod"):
        Scores(score_mod=3)
    with pytest.raises(TypeError, match="score_mod"):
        build_attention("mha", 16, 2, score_mod=3)


def test_score_mod_docs_run() -> None:
    """Every python block of docs/score-mod.md runs as written (test_docs.py's block finder)."""
    run_blocks("docs/score-mod.md", minimum=3)


HALF_CASES = {
    "causal x100": dict(scale_q=100.0, hkv=4, nq=64, mask=None),
    "gqa x30": dict(scale_q=30.0, hkv=2, nq=64, mask=None),
    "padding x30": dict(scale_q=30.0, hkv=4, nq=64, mask="padding"),
    "decode x10": dict(scale_q=10.0, hkv=2, nq=1, mask=None),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(HALF_CASES))
def test_half_precision_large_scores_every_backend(dtype: torch.dtype, name: str) -> None:
    """Issue 33 item 2: bf16/fp16 inputs with large scores. Every available backend's error against
    float64 is within 2x of a float32-accumulating reference's (the flash-attn bound), forward;
    and the tiled and reference backends' gradients likewise."""
    c = HALF_CASES[name]
    g = torch.Generator().manual_seed(5)
    nk = 64
    q = (torch.randn(1, 4, c["nq"], 16, generator=g) * c["scale_q"]).to(dtype)
    k, v = (torch.randn(1, c["hkv"], nk, 16, generator=g).to(dtype) for _ in range(2))
    mask = az.masks.key_padding([40]) if c["mask"] == "padding" else None
    kw = dict(causal=True, mask=mask)

    def run(backend: str, *ts: torch.Tensor) -> torch.Tensor:
        return az.attention(*ts, backend=backend, **kw)

    exact = run("reference", q.double(), k.double(), v.double())
    plain = run("reference", q.float(), k.float(), v.float()).to(dtype)  # float32 math, rounded once
    bound = 2 * (plain.double() - exact).abs().max().item() + 1e-6
    for backend in ("reference", "sdpa", "tiled", "flex"):
        if backend not in az.available_backends():
            continue
        err = (run(backend, q, k, v).double() - exact).abs().max().item()
        assert err <= bound, (backend, err, bound)
    # gradients (tiled: its own backward; reference: autograd in float32)
    w = torch.randn(exact.shape, generator=g, dtype=torch.float64)
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    g64 = torch.autograd.grad((run("reference", *leaves64) * w).sum(), leaves64)
    leaves32 = [t.float().requires_grad_(True) for t in (q, k, v)]
    g32 = [x.to(dtype) for x in torch.autograd.grad((run("reference", *leaves32) * w.float()).sum(), leaves32)]
    for backend in ("tiled", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        got = torch.autograd.grad((run(backend, *leaves) * w.to(dtype)).sum(), leaves)
        for nm, a, p, e in zip("qkv", got, g32, g64, strict=True):
            err, ref_err = (a.double() - e).abs().max().item(), (p.double() - e).abs().max().item()
            assert err <= 2 * ref_err + 1e-3 * e.abs().max().item() + 1e-6, (backend, nm, err, ref_err)


def test_ring_attention_score_mod_one_rank_zigzag() -> None:
    """``ring_attention(score_mod=...)`` on a one-rank gloo group with the zigzag layout (two
    segments per rank, so shard pairs start at different global positions): equals ``attention``
    with the same score_mod on global positions, gradients to the captured slopes included."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs a fresh torch.distributed")
    import socket

    from attnzoo.distributed import ring_attention

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        q, k, v = _qkv(1, 4, 2, 24, 24, 8, 8, torch.float64)
        slopes = torch.rand(4, dtype=torch.float64, requires_grad=True)

        def mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs() + 0.01 * kv_idx

        got = ring_attention(q, k, v, causal=True, layout="zigzag", score_mod=mod, block=4)
        want = az.attention(q, k, v, causal=True, score_mod=mod, backend="reference")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        w = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad((got * w).sum(), [q, k, v, slopes]),
                        torch.autograd.grad((want * w).sum(), [q, k, v, slopes]), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_score_mod_matches_eager() -> None:
    """Under torch.compile a score_mod is traced densely: same output and captured-tensor gradients."""
    slopes = torch.rand(2, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    out = torch.compile(lambda q, k, v: az.attention(q, k, v, causal=True, score_mod=mod))(q, k, v)
    got = torch.autograd.grad(out.sum(), [q, slopes])
    eager = az.attention(q, k, v, causal=True, score_mod=mod)
    want = torch.autograd.grad(eager.sum(), [q, slopes])
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_varlen_inference_keeps_score_mod() -> None:
    """Under no_grad, auto's per-length split of attention_varlen (SDPA calls) must not drop a score_mod:
    each sequence equals attention() with the same score_mod on it alone (positions per sequence)."""
    torch.manual_seed(0)
    lens = [7, 7, 3]
    cu = torch.tensor([0, 7, 14, 17], dtype=torch.int32)
    q, k, v = (torch.randn(17, 4, 8) for _ in range(3))

    def bias(s, b, h, qi, ki):
        return s - 0.3 * (qi - ki).abs()

    with torch.no_grad():
        out = az.attention_varlen(q, k, v, cu, cu, causal=True, score_mod=bias)
    lo = 0
    for n in lens:
        sl = slice(lo, lo + n)
        ref = az.attention(q[sl].transpose(0, 1)[None].double(), k[sl].transpose(0, 1)[None].double(),
                           v[sl].transpose(0, 1)[None].double(), causal=True, score_mod=bias, backend="reference")
        torch.testing.assert_close(out[sl].double(), ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        lo += n
    with pytest.raises(TypeError, match="score_mod must be callable"), torch.no_grad():
        az.attention_varlen(q, k, v, cu, cu, score_mod=3)


@pytest.mark.parametrize("name", ["linear", "infini", "diff", "mla"])
def test_variants_without_a_score_matrix_refuse_score_mod_by_name(name: str) -> None:
    with pytest.raises(TypeError, match="score_mod"):
        build_attention(name, 16, 2, score_mod=lambda s, b, h, qi, ki: s)
    if name == "linear":
        q = torch.randn(1, 2, 4, 8)
        with pytest.raises(TypeError, match="score_mod"):
            az.sigmoid_attention(q, q, q, score_mod=lambda s, b, h, qi, ki: s)


_TABLE = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
ADDITIVITY = [
    ("alibi", lambda s, b, h, qi, ki: s - torch.tensor([0.5, 0.25])[h] * (qi - ki).abs(), True),
    ("table", lambda s, b, h, qi, ki: s + _TABLE[h, (qi - ki).clamp(0, 15)], True),
    ("bias first", lambda s, b, h, qi, ki: (qi - ki).float() * 0.1 + s, True),
    ("two shifts", lambda s, b, h, qi, ki: (s + 1) - _TABLE[h, qi.clamp(0, 15)], True),
    ("identity", lambda s, b, h, qi, ki: s, True),
    ("scaled", lambda s, b, h, qi, ki: s * 2, False),
    ("tanh", lambda s, b, h, qi, ki: torch.tanh(s), False),
    ("where", lambda s, b, h, qi, ki: torch.where(qi >= ki, s, torch.full_like(s, -1e4)), False),
    ("bias minus score", lambda s, b, h, qi, ki: (qi - ki).float() - s, False),
    ("score twice", lambda s, b, h, qi, ki: s + s, False),
    ("shift then scale", lambda s, b, h, qi, ki: (s + 1) * 2, False),
    ("in place", lambda s, b, h, qi, ki: s.add_(1), False),
    ("alpha", lambda s, b, h, qi, ki: torch.add(s, 1.0, alpha=2), False),  # additive, but not recognised: safe
    ("values out and back", lambda s, b, h, qi, ki: s + torch.tensor(s.tolist()), False),  # 2 * score
    ("shape read", lambda s, b, h, qi, ki: s + torch.zeros(s.shape).mul_(s.dim()), True),
]


@pytest.mark.parametrize(("name", "fn", "additive"), ADDITIVITY, ids=[c[0] for c in ADDITIVITY])
def test_additive_score_mods_are_recognised_and_nothing_else(name: str, fn, additive: bool) -> None:
    """Only ``score + bias`` chains (the bias not computed from the score) count as additive: their
    gradient w.r.t. the score is the identity, which the backward then uses without re-running them."""
    from attnzoo.functional.core.score_mod import check_score_mod

    q = torch.randn(1, 2, 8, 4)
    assert check_score_mod(fn, q, 8, 0).additive is additive


@pytest.mark.parametrize("learned", [False, True])
def test_additive_score_mod_backward_skips_the_rerun_only_without_captured_gradients(learned: bool) -> None:
    """An additive score_mod is not differentiated in the backward (no call on a score that requires
    grad) when nothing it captures needs a gradient; with a learned bias table it is (for the table's
    gradient). Both equal the oracle."""
    q, k, v = _qkv(1, 2, 2, 20, 20, 4, 4, torch.float64, seed=11)
    table = torch.randn(2, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(12)).requires_grad_(learned)
    calls = []

    def mod(score, b, h, q_idx, kv_idx):
        calls.append(score.requires_grad)  # True: a vector-Jacobian product through it
        return score + table[h, q_idx - kv_idx + 20]

    with use_tiles(SMALL):
        out, lse = az.attention(q, k, v, causal=True, score_mod=mod, backend="tiled", return_lse=True)
        before = len(calls)
        got = _grads(out, lse, [q, k, v, *([table] if learned else [])])
    assert any(calls[before:]) is learned
    rel = (torch.arange(20).view(-1, 1) - torch.arange(20).view(1, -1) + 20).clamp(0, 39)
    bias = table[torch.arange(2).view(-1, 1, 1), rel.unsqueeze(0)].unsqueeze(0)  # [1, H, N, N]
    want_out, want_lse = oracle_attention(q, k, v, mask=bias, causal=True)
    want = _grads(want_out, want_lse, [q, k, v, *([table] if learned else [])])
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
