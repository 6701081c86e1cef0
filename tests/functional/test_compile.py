"""torch.compile / torch.export: no graph breaks, compiled == eager (outputs and gradients), export
round trips and bounded recompiles under dynamic shapes. Tiny shapes; most compiles use the
``eager``/``aot_eager`` backends (what Dynamo and AOTAutograd see is what matters); one test runs
inductor."""

import functools
import itertools
from collections.abc import Callable

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from tests.tools.test_docs import run_blocks
from torch._dynamo.testing import CompileCounterWithBackend

import attnzoo as az
from attnzoo.functional.backends.tiled_ops import tiled_fwd
from attnzoo.functional.softmax.nsa import (
    NSAConfig,
    nsa_attention,
    nsa_sparse,
    nsa_sparse_fwd,
    num_compressed,
)
from attnzoo.models.export import CachedStep, cache_tensors
from attnzoo.variants import VARIANTS, build_attention

pytestmark = pytest.mark.usefixtures("one_thread")

N, D = 48, 16


def _qkv(n: int = N, hq: int = 4, hkv: int = 4, grad: bool = False) -> tuple[torch.Tensor, ...]:
    q = torch.randn(1, hq, n, D)
    k, v = torch.randn(1, hkv, n, D), torch.randn(1, hkv, n, D)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _projection_layout(t: torch.Tensor) -> torch.Tensor:
    """``t [B, H, N, D]`` with the same values stored ``[B, N, H, D]`` (a module's view of its projection)."""
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(t.requires_grad)


def _window_mask() -> az.masks.Mask:
    return az.masks.causal() & az.masks.sliding_window(8, 0)


CALLS: dict[str, Callable[..., object]] = {
    **{f"causal-{be}": (lambda q, k, v, be=be: az.attention(q, k, v, causal=True, backend=be))
       for be in ("auto", "reference", "sdpa", "tiled", "flex")},
    **{f"window-{be}": (lambda q, k, v, be=be: az.attention(q, k, v, causal=True, window=(8, 0), backend=be))
       for be in ("auto", "reference", "sdpa", "tiled")},
    "mask-object-auto": lambda q, k, v: az.attention(q, k, v, mask=_window_mask()),
    "mask-object-tiled": lambda q, k, v: az.attention(q, k, v, mask=_window_mask(), backend="tiled"),
    "tiled-softcap-alibi-lse": lambda q, k, v: az.attention(
        q, k, v, causal=True, softcap=5.0, alibi_slopes=torch.linspace(0.1, 0.5, 4), return_lse=True,
        backend="tiled"),
    "linear": lambda q, k, v: az.linear_attention(q, k, v, causal=True),
    "linear-chunked": lambda q, k, v: az.linear_attention(q, k, v, causal=True, chunk_size=16),
    "performer": lambda q, k, v: az.performer_attention(q, k, v, torch.randn(8, D), causal=True),
    # Mamba-1's scan: u, delta [1, 4, N], A [4, 4] (negative), B/C [1, 4, N]; compiled: the chunked form
    "selective-scan": lambda q, k, v: az.selective_scan(q[..., 0], k[..., 0], -v[0, :, :4, 0].abs(), k[:1, 0, :, 1:5].mT,
                                                        v[:1, 0, :, 1:5].mT, delta_softplus=True),
}


def _break_count(fn: Callable[..., object], *args: object) -> int:
    dynamo.reset()
    return dynamo.explain(fn)(*args).graph_break_count


@pytest.mark.parametrize("name", sorted(CALLS))
def test_core_calls_have_no_graph_breaks(name: str) -> None:
    assert _break_count(CALLS[name], *_qkv()) == 0


FLEX_CASES: dict[str, Callable[..., object]] = {
    "causal": lambda q, k, v, be: az.attention(q, k, v, causal=True, backend=be),
    "window-gqa": lambda q, k, v, be: az.attention(q, k[:, :2], v[:, :2], causal=True, window=(130, 0), backend=be),
    "offset-window": lambda q, k, v, be: az.attention(q[:, :, 100:], k, v, causal=True, window=(None, 40), backend=be),
    "bool-mask": lambda q, k, v, be: az.attention(q, k, v, causal=True, mask=(torch.arange(300) % 7 != 3).expand(300, 300),
                                                        backend=be),
    "mask-object": lambda q, k, v, be: az.attention(q, k, v, mask=az.masks.causal() & az.masks.sliding_window(64, 0),
                                                    backend=be),
}


def _flex_inputs() -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, 4, 300, D, generator=torch.Generator().manual_seed(i)) for i in range(3))


@pytest.mark.parametrize("name", sorted(FLEX_CASES))
def test_flex_in_a_compiled_graph_builds_its_block_mask_with_operators(name: str) -> None:
    """Inside ``torch.compile`` the flex backend's block tables of a causal / window request come from
    ``attnzoo::flex_block_table`` (computed from shapes, eagerly: no generated kernels for them; the
    per-key-block tables, which only a backward reads, are left out); a ``Mask`` object keeps the
    traced block map. Outputs equal the reference backend (several 128-token
    blocks, GQA, ``Nq < Nk``, a bool mask on top, a one-sided window)."""
    q, k, v = _flex_inputs()
    counter = CompileCounterWithBackend("aot_eager")
    dynamo.reset()
    with torch.no_grad():
        got = torch.compile(FLEX_CASES[name], backend=counter, fullgraph=True)(q, k, v, "flex")
        want = FLEX_CASES[name](q, k, v, "reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    targets = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("flex_block_table" in t for t in targets) == (0 if name == "mask-object" else 2), targets


def test_inductor_flex_with_block_table_operators_matches_reference() -> None:
    """The generated FlexAttention kernel reads tables made by the operators (torch 2.13's CPU template
    failed to build when both tile kinds came out of one operator: each kind is its own call)."""
    q, k, v = _flex_inputs()
    dynamo.reset()
    with torch.no_grad():
        got = torch.compile(FLEX_CASES["window-gqa"], fullgraph=True)(q, k, v, "flex")
        want = FLEX_CASES["window-gqa"](q, k, v, "reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_block_table_operator() -> None:
    """The operator passes ``opcheck``, and its tables are those torch's ``create_block_mask`` builds
    from the same predicate evaluated densely."""
    from torch.nn.attention.flex_attention import create_block_mask

    from attnzoo.functional.backends.flex import BLOCK_FULL, BLOCK_PARTIAL, block_table

    q = _flex_inputs()[0][:, :, 44:]  # [1, 4, 256, D] against 300 keys: q_offset 44
    for args in ((q, True, None, None, False, False, 300, 44), (q, True, 130, 0, True, False, 300, 44),
                 (q, False, None, 40, True, True, 300, 44)):
        for kind, by_key in itertools.product((BLOCK_PARTIAL, BLOCK_FULL), (False, True)):
            torch.library.opcheck(block_table, (*args, kind, by_key))
    want = create_block_mask(lambda b, h, i, j: (i + 44 >= j) & (i + 44 - j <= 130), 1, 4, 256, 300, device="cpu")
    args = (q, True, 130, 0, True, False, 300, 44)
    for (kind, by_key), (w_count, w_idx) in (
            ((BLOCK_PARTIAL, False), (want.kv_num_blocks, want.kv_indices)),
            ((BLOCK_FULL, False), (want.full_kv_num_blocks, want.full_kv_indices)),
            ((BLOCK_PARTIAL, True), (want.q_num_blocks, want.q_indices)),
            ((BLOCK_FULL, True), (want.full_q_num_blocks, want.full_q_indices))):
        count, idx = block_table(*args, kind, by_key)
        assert count.shape[:2] == idx.shape[:2] == (1, 1)  # broadcast over batch and heads
        count, idx = count.expand_as(w_count), idx.expand_as(w_idx)
        assert torch.equal(count, w_count)
        for row in itertools.product(*(range(n) for n in count.shape)):  # the first count indices are tiles
            assert torch.equal(idx[row][: count[row]], w_idx[row][: count[row]])


def test_gqa_tiled_has_no_graph_breaks() -> None:
    q, k, v = _qkv(hq=4, hkv=2)
    assert _break_count(lambda q, k, v: az.attention(q, k, v, causal=True, window=(8, 0), backend="tiled"),
                        q, k, v) == 0


MODULES: dict[str, Callable[[], torch.nn.Module]] = {
    "mha-causal": lambda: az.MultiHeadAttention(32, 4, causal=True),
    "sliding-window-8": lambda: az.SlidingWindowAttention(32, 4, window=8),
    **{f"variant-{name}": (lambda name=name: build_attention(name, 32, 4)) for name in VARIANTS},
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_forwards_have_no_graph_breaks(name: str) -> None:
    assert _break_count(MODULES[name](), torch.randn(2, N, 32)) == 0


def test_encoder_and_vit_forwards_have_no_graph_breaks() -> None:
    enc = az.TransformerEncoder(vocab_size=100, dim=32, depth=1, num_heads=4)
    assert _break_count(enc, torch.randint(0, 100, (2, N))) == 0
    vit = az.VisionTransformer(image_size=32, patch_size=8, num_classes=10, dim=32, depth=1, num_heads=4)
    assert _break_count(vit, torch.randn(2, 3, 32, 32)) == 0


def test_mixer_only_and_parallel_mixer_blocks_have_no_graph_breaks() -> None:
    """The compositions of the Mamba-2 families: a mixer-only block (Mamba-2, Nemotron-H) and a
    ``ParallelMixers`` block (Falcon-H1: Mamba-2 beside attention)."""
    from attnzoo.blocks import BlockLayers

    norm = lambda: az.RMSNorm(32)  # noqa: E731
    blocks = [az.TransformerBlock(32, layers=BlockLayers(attention=lambda: az.Mamba2(32, 4, chunk_size=8),
                                                         feed_forward=None, norm=norm)),
              az.TransformerBlock(32, layers=BlockLayers(
                  attention=lambda: az.ParallelMixers([az.Mamba2(32, 4, chunk_size=8),
                                                       az.MultiHeadAttention(32, 4, causal=True, rope=True)]),
                  feed_forward=lambda: az.FeedForward(32, activation="relu2"), norm=norm))]
    lm = az.DecoderLM(100, 32, 2, 4, parts=az.models.DecoderParts(blocks=blocks)).eval()
    assert _break_count(lm, torch.randint(0, 100, (2, N))) == 0


def _lm(attention: str = "sliding") -> az.DecoderLM:
    return az.DecoderLM(vocab_size=100, dim=32, depth=2, num_heads=4, attention=attention).eval()


def test_decoder_lm_forward_has_no_graph_breaks() -> None:
    assert _break_count(_lm(), torch.randint(0, 100, (2, N))) == 0


# --------------------------------------------------------------- compiled == eager
GRAD_CALLS = ("causal-reference", "causal-sdpa", "causal-tiled", "window-tiled", "window-sdpa",
              "mask-object-tiled", "tiled-softcap-alibi-lse", "linear-chunked", "performer", "selective-scan")


def _outputs_and_grads(fn: Callable[..., object], args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    for a in args:
        a.grad = None
    res = fn(*args)
    outs = list(res) if isinstance(res, tuple) else [res]
    sum(o.float().sin().sum() for o in outs if torch.isfinite(o).all()).backward()
    return [o.detach() for o in outs] + [a.grad.clone() for a in args]


@pytest.mark.parametrize("name", GRAD_CALLS)
def test_compiled_matches_eager_with_gradients(name: str) -> None:
    args = _qkv(grad=True)
    torch.manual_seed(1)
    want = _outputs_and_grads(CALLS[name], args)
    dynamo.reset()
    torch.manual_seed(1)
    got = _outputs_and_grads(torch.compile(CALLS[name], backend="aot_eager", fullgraph=True), args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_inductor_tiled_window_forward_backward_matches_eager() -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
        return az.attention(q, k, v, causal=True, window=(8, 0), backend="tiled") * 2.0

    # q as a transposed view ([B, N, H, D] -> [B, H, N, D]), as the modules pass it
    q = torch.randn(1, N, 4, D).transpose(1, 2).requires_grad_(True)
    args = (q, *_qkv(hq=4, hkv=2, grad=True)[1:])
    want = _outputs_and_grads(fn, args)
    dynamo.reset()
    got = _outputs_and_grads(torch.compile(fn, fullgraph=True), args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_tiled_custom_operator_registration() -> None:
    """opcheck: schema, fake (meta) implementation, autograd registration and AOT dispatch."""
    q, k, v = _qkv(grad=True)
    mask = torch.rand(1, 1, N, N) > 0.3
    v_bnhd = _projection_layout(v)
    for args in ((q, k, v, None, True, 8, 0, True, 0, 0.25, None, None),
                 (q, k, v_bnhd, None, True, 8, 0, True, 0, 0.25, None, None),
                 (q, k, v, mask, False, None, None, False, 0, 0.25, 4.0, torch.linspace(0.1, 0.5, 4)),
                 (q.detach(), k.detach(), v.detach(), None, True, None, None, False, 0, 0.25, None, None, False)):
        torch.library.opcheck(tiled_fwd, args)
    with torch.no_grad():  # the output is stored as v (the fake says so; opcheck compares strides)
        assert tiled_fwd(q, k, v_bnhd, None, True, 8, 0, True, 0, 0.25, None, None)[0].stride() == v_bnhd.stride()


@pytest.mark.parametrize(("window", "q_offset", "band"), [((8, 0), 0, True), ((None, 2), 5, True),
                                                          ((4, 0), -2, False)])
def test_sdpa_band_mask_operator_when_no_row_is_empty(window: tuple[int | None, int], q_offset: int,
                                                      band: bool) -> None:
    """Compiled ``sdpa`` with a causal/window request in which every query sees its own key takes its
    additive mask from the ``attnzoo::band_mask`` operator (no generated kernel for the mask); a
    request that may leave a row empty keeps the empty-row-safe path. Both equal eager."""
    from attnzoo.functional.backends.sdpa import band_mask

    q, k, v = _qkv()
    nq = N - 5 if q_offset == 5 else N
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return az.attention(q, k, v, causal=True, window=window, q_offset=q_offset, backend="sdpa")

    dynamo.reset()
    args = (q[:, :, :nq], k, v)
    torch.testing.assert_close(torch.compile(fn, backend=backend, fullgraph=True)(*args), fn(*args))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert (torch.ops.attnzoo.band_mask.default in targets) == band
    torch.library.opcheck(band_mask, (5, 9, 4, True, 2, -1, torch.float32, torch.device("cpu")))


@pytest.mark.parametrize(("hkv", "window", "dtype"), [(4, None, torch.float32), (2, None, torch.float32),
                                                     (1, (8, 0), torch.float32), (4, None, torch.bfloat16)])
def test_sdpa_compiled_cpu_training_runs_torchs_flash_kernels_as_one_operator(
        hkv: int, window: tuple[int, int] | None, dtype: torch.dtype) -> None:
    """Compiled ``sdpa`` training on CPU (causal, GQA, a band) calls ``attnzoo::sdpa_cpu_flash_forward`` (torch's
    CPU flash forward; its autograd formula the flash backward): outputs and gradients equal eager SDPA.
    Without gradients the plain SDPA call stays."""
    from attnzoo.functional.backends.sdpa import sdpa_cpu_flash_bwd, sdpa_cpu_flash_fwd

    q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(hkv=hkv))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return az.attention(q, k, v, causal=True, window=window, backend="sdpa")

    def run(f: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        out = f(q, k, v)
        return [out, *torch.autograd.grad(out.sin().sum(), (q, k, v))]

    for grad in (True, False):
        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
            graphs.append(gm)  # noqa: B023 (each pass reads its own list)
            return gm.forward

        dynamo.reset()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        if grad:  # eager first: it measures the half-precision policy that the compiled call reads
            want = run(fn)
            for got, w in zip(run(compiled), want, strict=True):
                torch.testing.assert_close(got, w, rtol=0, atol=0)
        else:
            with torch.no_grad():
                torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=0, atol=0)
        targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert (torch.ops.attnzoo.sdpa_cpu_flash_forward.default in targets) == grad
    d = q.detach().requires_grad_()
    torch.library.opcheck(sdpa_cpu_flash_fwd, (d, k.detach(), v.detach(), None, True, 0.25))
    with torch.no_grad():
        o, lse = sdpa_cpu_flash_fwd(d, k, v, None, True, 0.25)
        torch.library.opcheck(sdpa_cpu_flash_bwd, (torch.ones_like(o), d, k, v, o, lse, None, True, 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_sdpa_training_matches_eager(dtype: torch.dtype) -> None:
    """Inductor checks the size and strides of every custom operator's output against its fake: the
    SDPA operators' outputs keep the kernel's memory layout (gradients and LSE stored ``[B, N, H, *]``)
    and ``out`` is stored as ``v`` when the shapes agree (else as ``q``, the kernel's), so a fake that
    said otherwise fails here."""
    from attnzoo.functional.backends.sdpa import sdpa_cpu_flash_bwd, sdpa_cpu_flash_fwd

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = az.attention(q, k, v, causal=True, backend="sdpa")  # [B, H, N, D]
        return out.transpose(1, 2).reshape(q.shape[0], N, -1)  # [B, N, H * D], as the modules read it

    def bnhd(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return _projection_layout(torch.randn(*shape, dtype=dtype))

    # q a [B, N, H, D] view with GQA; then q contiguous (as RoPE writes it) and v a view (output copied)
    for q, k, v in ((bnhd(1, 4, N, D), *(t.to(dtype) for t in _qkv(hq=4, hkv=2)[1:])),
                    (*(t.to(dtype) for t in _qkv()[:2]), bnhd(1, 4, N, D))):
        args = tuple(t.detach().requires_grad_() for t in (q, k, v))
        want = _outputs_and_grads(fn, args)
        dynamo.reset()
        got = _outputs_and_grads(torch.compile(fn, fullgraph=True), args)
        for g, w in zip(got, want, strict=True):  # the loss's sin/cos may round differently when generated
            torch.testing.assert_close(g, w)
    f64 = torch.float64  # float64: float64 LSE
    for qt, kt, vt in ((bnhd(1, 4, N, D, dtype=f64), torch.randn(1, 2, N, D, dtype=f64), torch.randn(1, 2, N, D, dtype=f64)),
                       (torch.randn(1, 4, N, D, dtype=f64), torch.randn(1, 4, N, D, dtype=f64), bnhd(1, 4, N, D, dtype=f64))):
        qt.requires_grad_()
        torch.library.opcheck(sdpa_cpu_flash_fwd, (qt, kt, vt, None, True, 0.25))
        with torch.no_grad():
            o, lse = sdpa_cpu_flash_fwd(qt, kt, vt, None, True, 0.25)
            assert o.stride() == (vt.stride() if vt.shape == qt.shape else qt.stride())
            torch.library.opcheck(sdpa_cpu_flash_bwd, (torch.ones_like(o), qt, kt, vt, o, lse, None, True, 0.25))


def test_inductor_tiled_training_matches_eager() -> None:
    """The tiled operator stores its output as ``v`` (a module's ``[B, N, H, D]`` view) when the shapes
    agree: inductor's stride checks pass and a module-style head merge gives eager's outputs and
    gradients."""
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = az.attention(q, k, v, causal=True, window=(8, 0), backend="tiled")  # [B, H, N, D]
        return out.transpose(1, 2).reshape(q.shape[0], N, -1)  # [B, N, H * D]

    q = torch.randn(1, 4, N, D)  # as RoPE writes it
    k, v = (_projection_layout(torch.randn(1, 4, N, D)) for _ in range(2))
    args = tuple(t.requires_grad_() for t in (q, k, v))
    want = _outputs_and_grads(fn, args)
    dynamo.reset()
    got = _outputs_and_grads(torch.compile(fn, fullgraph=True), args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


REFERENCE_CASES = {
    "causal-gqa": ({"causal": True}, 2, "out"),
    "window-softcap-weights": ({"causal": True, "window": (8, 0), "softcap": 3.0, "return_weights": True}, 4, "all"),
    "lse-only": ({"causal": True, "return_lse": True}, 1, "lse"),
    "mask-alibi": ({"mask": _window_mask(), "alibi_slopes": torch.linspace(0.1, 0.5, 4)}, 4, "out"),
    "float-mask-gradient": ({"mask": torch.zeros(N, N, dtype=torch.float64, requires_grad=True)}, 4, "out"),
}


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_reference_compiles_to_its_operators_with_the_eager_gradients(case: str) -> None:
    """Compiled ``reference`` calls ``attnzoo::reference_fwd`` (the eager oracle, keeping the
    probabilities) and its gradient ``attnzoo::reference_bwd`` (the softmax backward on them, through a
    softcap, with GQA, LSE and weights gradients): float64 outputs and gradients equal eager autograd
    to 1e-12. A float mask that needs a gradient keeps the traced path."""
    kwargs, hkv, used = REFERENCE_CASES[case]
    q, k, v = (t.double().requires_grad_() for t in _qkv(hkv=hkv))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        res = az.attention(q, k, v, backend="reference", **kwargs)
        return res if isinstance(res, tuple) else (res,)

    def run(f: Callable[..., tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        res = f(q, k, v)
        picked = {"out": res[:1], "lse": res[1:], "all": res}[used]
        loss = sum(t.sin().sum() for t in picked)
        return [*res, *torch.autograd.grad(loss, (q, k, v), allow_unused=True, materialize_grads=True)]

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    dynamo.reset()
    for got, want in zip(run(torch.compile(fn, backend=backend, fullgraph=True)), run(fn), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert (torch.ops.attnzoo.reference_fwd.default in targets) == (case != "float-mask-gradient")


def test_reference_operators_pass_opcheck() -> None:
    from attnzoo.functional.backends.reference_ops import reference_bwd, reference_fwd

    q, k, v = (t.double() for t in _qkv(hkv=2))
    args = (None, True, 8, 0, True, 0, 0.25, 5.0, None)
    torch.library.opcheck(reference_fwd, (q.requires_grad_(), k, v, *args, True))
    with torch.no_grad():
        out, _lse, probs = reference_fwd(q, k, v, *args, True)
        torch.library.opcheck(reference_bwd, (torch.ones_like(out), None, None, q, k, v, probs, 0.25, 5.0))


@pytest.mark.parametrize("used", ["out", "lse", "both"])
def test_tiled_operator_backward_with_an_unused_output(used: str) -> None:
    """The operator's backward takes an unused output's gradient as None (no zeros tensor is built,
    so a compiled backward has no kernel for it): gradients equal the float64 reference whether the
    output, the LSE or both are used."""
    q, k, v = (t.double().requires_grad_() for t in _qkv())

    def loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        return {"out": out.sin().sum(), "lse": lse.square().sum(), "both": out.sum() + lse.sum()}[used]

    got = tiled_fwd(q, k, v, None, True, 8, 0, True, 0, 0.25, None, None, need_lse=True)
    want = az.attention(q, k, v, causal=True, window=(8, 0), scale=0.25, backend="reference", return_lse=True)
    for g, w in zip(*(torch.autograd.grad(loss(*o), (q, k, v), allow_unused=True, materialize_grads=True)
                      for o in (got, want)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_inductor_decoder_lm_training_step_matches_eager() -> None:
    lm = _lm().train()
    tok = torch.randint(0, 100, (2, N))

    def loss_and_grads(model: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        lm.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tok).flatten(0, 1), tok.flatten())
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in lm.parameters()]

    want = loss_and_grads(lm)
    dynamo.reset()
    got = loss_and_grads(torch.compile(lm, fullgraph=True))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- export
def test_export_decoder_lm_and_encoder_give_eager_outputs() -> None:
    tok = torch.randint(0, 100, (2, N))
    lm = _lm()
    want = lm(tok)
    torch.testing.assert_close(torch.export.export(lm, (tok,)).module()(tok), want)
    enc = az.TransformerEncoder(vocab_size=100, dim=32, depth=2, num_heads=4).eval()
    am = torch.ones(2, N, dtype=torch.bool)
    am[1, N // 2:] = False
    want = enc(tok, attention_mask=am)
    ep = torch.export.export(enc, (tok,), {"attention_mask": am})
    torch.testing.assert_close(ep.module()(tok, attention_mask=am), want)


def test_export_cached_decode_step_gives_eager_outputs() -> None:
    lm = _lm("mha")
    prompt, nxt = torch.randint(0, 100, (2, 10)), torch.randint(0, 100, (2, 1))
    cache = lm.init_cache(2, 32)
    with torch.no_grad():
        lm(prompt, cache=cache)
        keys, values = (list(map(torch.clone, ts)) for ts in cache_tensors(cache))
        want = lm(nxt, cache=cache)  # eager step: the cache now holds 11 tokens
        ep = torch.export.export(CachedStep(lm, past_len=10), (nxt, keys, values))
        logits, new_keys, new_values = ep.module()(nxt, keys, values)
    torch.testing.assert_close(logits, want)
    for got, ref in zip(new_keys + new_values, [c.k for c in cache] + [c.v for c in cache], strict=True):
        torch.testing.assert_close(got, ref)
    # ... and the full forward over prompt + token agrees (the decoding contract, exported)
    torch.testing.assert_close(logits[:, -1], lm(torch.cat([prompt, nxt], 1))[:, -1], rtol=1e-4, atol=1e-5)


def test_cache_tensors_rejects_non_kv_caches() -> None:
    with pytest.raises(TypeError, match="KVCache"):
        cache_tensors(_lm("linear").init_cache(1, 16))


# ------------------------------------------------------------------ dynamic shapes
def _graphs_for_lengths(fn: Callable[..., object], inputs: list[tuple[torch.Tensor, ...]]) -> int:
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)
    for args in inputs:
        compiled(*args)
    return len(graphs)


LENGTHS = (24, 40, 56, 72)


@pytest.mark.parametrize("backend", ["sdpa", "tiled", "auto"])
def test_dynamic_shapes_compile_once_for_several_lengths(backend: str) -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
        return az.attention(q, k, v, causal=True, window=(8, 0), backend=backend)

    assert _graphs_for_lengths(fn, [_qkv(n) for n in LENGTHS]) == 1


def test_dynamic_shapes_decoder_lm_compiles_once() -> None:
    lm = _lm()
    # the RoPE frequencies exist from construction: no module state filled by the first call
    assert _graphs_for_lengths(lm, [(torch.randint(0, 100, (1, n)),) for n in LENGTHS]) == 1


# --------------------------------------------------------------------------- docs
def test_compile_docs_examples_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/compile.md runs as written (with the aot_eager backend, to keep the test short)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    run_blocks("docs/compile.md", minimum=2, before_each=dynamo.reset)


@pytest.mark.slow  # heavy (seconds of inductor compile on 2 cores): the lighter compile tests stay in the default run
def test_dynamic_shapes_linear_attention_compiles_at_most_twice() -> None:
    """The chunked causal form runs as one group when compiled: one graph for lengths that are
    multiples of the chunk and one for the others (the padding branch)."""
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
        return az.linear_attention(q, k, v, causal=True, chunk_size=16)

    assert _graphs_for_lengths(fn, [_qkv(n) for n in (24, 40, 48, 64, 72)]) <= 2


# ------------------------------------------- varlen, sigmoid, sinks, recurrent kernels
CU = (0, 10, 10, 30, 48)  # four sequences, one of them empty


def _packed(grad: bool = False) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(CU[-1], 4, D).requires_grad_(grad) for _ in range(3))


def _cu() -> torch.Tensor:
    return torch.tensor(CU, dtype=torch.int32)


def _small(t: torch.Tensor) -> torch.Tensor:
    return t * 0.3  # keeps the recurrent states tame


KERNELS: dict[str, Callable[..., object]] = {
    **{f"varlen-{be}": (lambda q, k, v, be=be: az.attention_varlen(
        q, k, v, _cu(), _cu(), causal=True, window=(12, 0), sinks=torch.linspace(-1.0, 1.0, 4),
        return_lse=be != "sdpa", backend=be)) for be in ("auto", "sdpa", "reference")},
    "varlen-alibi": lambda q, k, v: az.attention_varlen(
        q, k, v, _cu(), _cu(), causal=True, alibi_slopes=torch.linspace(0.1, 0.5, 4)),
    **{f"sigmoid-{be}": (lambda q, k, v, be=be: az.sigmoid_attention(
        q, k, v, causal=True, window=8, softcap=5.0, backend=be)) for be in ("tiled", "reference")},
    "sigmoid-mask-object": lambda q, k, v: az.sigmoid_attention(q, k, v, mask=_window_mask()),
    **{f"sinks-{be}": (lambda q, k, v, be=be: az.attention(
        q, k, v, causal=True, sinks=torch.linspace(-1.0, 1.0, 4), backend=be))
       for be in ("auto", "sdpa", "tiled", "reference")},
    **{f"retention-{form}": (lambda q, k, v, form=form: az.retention(
        _small(q), k, v, torch.tensor([0.9, 0.8, 0.7, 0.95]), form=form, chunk_size=16))
       for form in ("recurrent", "chunked", "quadratic")},
    **{f"gla-{form}": (lambda q, k, v, form=form: az.gated_linear_attention(
        _small(q), k, v, -0.05 * k.abs(), form=form, chunk_size=16)) for form in ("recurrent", "chunked")},
    **{f"delta-{form}": (lambda q, k, v, form=form: az.delta_rule(
        q, torch.nn.functional.normalize(k, dim=-1), v, torch.sigmoid(v[..., 0]), form=form, chunk_size=16,
        log_decay=-0.05 * q[..., 0].abs(), return_state=True))
       for form in ("recurrent", "chunked")},
}


def _kernel_args(name: str, grad: bool = False) -> tuple[torch.Tensor, ...]:
    if name.startswith("varlen"):
        return _packed(grad)
    if name.startswith(("retention", "gla", "delta")):  # a traced loop per token or chunk: short
        return _qkv(n=8 if name.endswith("recurrent") else 24, grad=grad)
    return _qkv(grad=grad)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_new_kernels_have_no_graph_breaks(name: str) -> None:
    assert _break_count(KERNELS[name], *_kernel_args(name)) == 0


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_new_kernels_compiled_match_eager_with_gradients(name: str) -> None:
    torch.manual_seed(0)
    args = _kernel_args(name, grad=True)
    want = _outputs_and_grads(KERNELS[name], args)
    dynamo.reset()
    got = _outputs_and_grads(torch.compile(KERNELS[name], backend="aot_eager", fullgraph=True), args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_sigmoid_custom_operator_registration() -> None:
    from attnzoo.functional.softmax.sigmoid import sigmoid_fwd

    q, k, v = _qkv(grad=True)
    mask = torch.rand(1, 1, N, N) > 0.3
    v_bnhd = _projection_layout(v)
    for args in ((q, k, v, None, True, 8, 0, True, 0, 0.25, None, None, -3.0),
                 (q, k, v_bnhd, None, True, 8, 0, True, 0, 0.25, None, None, -3.0),
                 (q, k, v, mask, False, None, None, False, 0, 0.25, 4.0, torch.linspace(0.1, 0.5, 4), -1.0)):
        torch.library.opcheck(sigmoid_fwd, args)
    with torch.no_grad():  # the output is stored as v (the fake says so; opcheck compares strides)
        assert sigmoid_fwd(q, k, v_bnhd, None, True, 8, 0, True, 0, 0.25, None, None, -3.0).stride() == v_bnhd.stride()


@pytest.mark.slow  # heavy (seconds of inductor compile on 2 cores): the lighter compile tests stay in the default run
def test_dynamic_shapes_chunked_decay_kernels_compile_once() -> None:
    """The chunked form of the recurrent kernels (retention, GLA with a decay per key dimension, the
    delta rule with and without a decay) compiles **once** for several lengths under
    ``dynamic=True``: when compiling, the chunks form one padded group and the state at each chunk
    start comes from a closed form over the chunks' log decays (diagonal maps) or from the
    ``attnzoo::matrix_scan`` operator (the delta rule's full ``[Dk, Dk]`` maps), so no loop or
    branch depends on the length; the outputs equal eager."""
    gamma = torch.tensor([0.9, 0.8, 0.7, 0.95])
    inputs = [tuple(_small(t) for t in _qkv(n)) for n in (9, 14, 21)]
    fns = {
        "retention": lambda q, k, v: az.retention(q, k, v, gamma, form="chunked", chunk_size=4),
        "gla": lambda q, k, v: az.gated_linear_attention(q, k, v, -0.05 * k.abs() - 1e-3, form="chunked",
                                                         chunk_size=4),
        "delta": lambda q, k, v: az.delta_rule(q, F.normalize(k, dim=-1), v, torch.sigmoid(v[..., 0]),
                                               form="chunked", chunk_size=4),
        "gated-delta": lambda q, k, v: az.delta_rule(q, F.normalize(k, dim=-1), v, torch.sigmoid(v[..., 0]),
                                                     log_decay=-0.1 * q[..., 0].abs(), form="chunked",
                                                     chunk_size=4),
    }
    for name, fn in fns.items():
        counter = CompileCounterWithBackend("eager")
        dynamo.reset()
        compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
        for args in inputs:
            torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-5, atol=1e-6)
        assert counter.frame_count == 1, name


def test_matrix_scan_operator_gradients_equal_the_loop() -> None:
    """``attnzoo::matrix_scan`` (the delta rule's chunk-to-chunk scan in a compiled graph): float64
    gradients of its reverse-scan backward equal autograd through the eager loop, with the chunk
    starts, the final state or both used; ``opcheck`` passes."""
    from attnzoo.functional.recurrent._chunked_scan import _loop_starts, matrix_scan

    g = torch.Generator().manual_seed(0)
    a = (0.3 * torch.randn(2, 3, 5, 4, 4, generator=g, dtype=torch.float64)).requires_grad_()
    r = torch.randn(2, 3, 5, 4, 6, generator=g, dtype=torch.float64).requires_grad_()
    s0 = torch.randn(2, 3, 4, 6, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(2, 3, 5, 4, 6, generator=g, dtype=torch.float64)
    for used in ("starts", "end", "both"):
        def loss(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
            starts, end = fn(a, r, s0)
            return {"starts": (starts * w).sum(), "end": end.sin().sum(), "both": (starts * w).sum() + end.sum()}[used]  # noqa: B023

        for got, want in zip(torch.autograd.grad(loss(matrix_scan), (a, r, s0), allow_unused=True, materialize_grads=True),
                             torch.autograd.grad(loss(_loop_starts), (a, r, s0), allow_unused=True, materialize_grads=True),
                             strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.library.opcheck(matrix_scan, (a, r, s0))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_dynamic_shapes_recurrent_kernels_compile_once(form: str) -> None:
    """Graphs compiled for four lengths under ``dynamic=True``: one, for both forms. The recurrent
    form's token loop is one operator when compiling (``_chunked_scan.token_loop``; before, the
    trip count specialised the graph and each length recompiled: 4 of 4); the chunked forms compile
    once (the delta rule's full ``[Dk, Dk]`` chunk maps through ``attnzoo::matrix_scan``)."""
    gamma = torch.tensor([0.9, 0.8, 0.7, 0.95])
    lengths = (9, 12, 16, 20)
    inputs = [tuple(_small(t) for t in _qkv(n)) for n in lengths]
    counts = {
        "retention": _graphs_for_lengths(lambda q, k, v: az.retention(q, k, v, gamma, form=form, chunk_size=4),
                                         inputs),
        "delta": _graphs_for_lengths(lambda q, k, v: az.delta_rule(q, k, v, torch.sigmoid(v[..., 0]), form=form,
                                                                   chunk_size=4), inputs),
    }
    assert counts == {"retention": 1, "delta": 1}, counts


TOKEN_LOOPS: dict[str, Callable[..., object]] = {
    "linear": lambda q, k, v: az.linear_attention(q, k, v, causal=True, form="recurrent"),
    "gla-per-key": lambda q, k, v: az.gated_linear_attention(
        q, k, v, -torch.nn.functional.softplus(k), form="recurrent", return_state=True),
    "gated-delta": lambda q, k, v: az.delta_rule(
        q, torch.nn.functional.normalize(k, dim=-1), v, torch.sigmoid(v[..., 0]),
        log_decay=-torch.nn.functional.softplus(q[..., 0]), form="recurrent", return_state=True),
}


@pytest.mark.parametrize("name", list(TOKEN_LOOPS))
def test_recurrent_form_is_one_operator_for_any_length(name: str) -> None:
    """``form="recurrent"`` compiles once for three lengths with ``dynamic=True`` (its token loop is
    ``attnzoo::<kernel>_recurrent``); outputs and float64 gradients equal the eager loop's."""
    fn = TOKEN_LOOPS[name]
    counter = CompileCounterWithBackend("aot_eager")  # keeps the graphs
    dynamo.reset()
    compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
    for n in (5, 9, 14):
        g = torch.Generator().manual_seed(n)
        args = tuple((0.3 * torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64)).requires_grad_()
                     for _ in range(3))
        for got, want in zip(_outputs_and_grads(compiled, args), _outputs_and_grads(fn, args), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 1
    targets = {str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"}
    assert any("_recurrent" in t for t in targets), targets


def test_gla_per_key_training_graph_calls_the_scores_operator() -> None:
    """A compiled training graph of chunked GLA with a decay per key dimension holds the chunk scores as
    one ``attnzoo::gla_vector_scores`` node, and its backward graph one ``gla_vector_scores_bwd``
    (traced, the halving's levels became a dozen generated kernels and a 2-layer ``DecoderLM`` step
    compiled in 80 s); an inference graph keeps the loop-free blocks, which run faster compiled."""
    from torch._dynamo.backends.common import aot_autograd

    fn = KERNELS["gla-chunked"]
    for grad in (True, False):
        graphs: dict[str, list[torch.fx.GraphModule]] = {"fw": [], "bw": []}

        def keep(kind: str, graphs: dict[str, list[torch.fx.GraphModule]] = graphs) -> Callable[..., object]:
            return lambda gm, example: graphs[kind].append(gm) or gm

        dynamo.reset()
        args = _kernel_args("gla-chunked", grad=grad)
        out = torch.compile(fn, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")),
                            fullgraph=True)(*args)
        if grad:
            out.sum().backward()
        calls = {kind: {str(n.target) for g in gs for n in g.graph.nodes if "gla_vector_scores" in str(n.target)}
                 for kind, gs in graphs.items()}
        want = ({"fw": {"attnzoo.gla_vector_scores.default"}, "bw": {"attnzoo.gla_vector_scores_bwd.default"}}
                if grad else {"fw": set(), "bw": set()})
        assert calls == want, (grad, calls)


def test_token_loop_operators_pass_opcheck() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.3 * torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    s = torch.zeros(1, 2, 4, 4, dtype=torch.float64)
    gates = -torch.rand(1, 2, 5, generator=g, dtype=torch.float64)
    cases = {"linear_recurrent": (q.exp(), k.exp(), v, s, torch.zeros(1, 2, 4, dtype=torch.float64)),
             "gla_recurrent": (q, k, v, gates, s),
             "delta_rule_recurrent": (q, k, v, torch.sigmoid(gates), gates, s)}
    for op, tensors in cases.items():
        args = [t.clone().requires_grad_() for t in tensors]
        torch.library.opcheck(getattr(torch.ops.attnzoo, op).default, (args,))


@pytest.mark.parametrize("name", ["varlen-auto", "varlen-sdpa", "varlen-alibi"])
def test_varlen_inference_runs_as_one_operator_and_matches_eager(name: str) -> None:
    from attnzoo.functional.softmax.varlen import varlen_fwd

    args = _packed()
    dynamo.reset()
    got = torch.compile(KERNELS[name], backend="aot_eager", fullgraph=True)(*args)
    torch.testing.assert_close(got, KERNELS[name](*args))
    q, k, v = args
    torch.library.opcheck(varlen_fwd, (q, k, v, _cu(), _cu(), True, 12, 0, True, None, None, None,
                                       torch.linspace(-1.0, 1.0, 4), True, "tiled"))


# ------------------------------------------------------------- native sparse attention
NSA_SMALL = {"block_len": 4, "block_stride": 2, "select_len": 4, "num_selected": 4, "window": 8}


def _nsa_module() -> torch.nn.Module:
    torch.manual_seed(0)
    mod = build_attention("nsa", 32, 4, num_kv_heads=2, **NSA_SMALL)
    mod.query_chunk = 16  # several chunks over N = 48, the last one ragged below
    return mod


def _nsa_inputs(grad: bool = False, n: int = 45) -> tuple[torch.Tensor, ...]:
    """``q, k, v, k_cmp, v_cmp, gates`` for :func:`nsa_attention` (GQA 4 / 2, ``Nk = n + 3``: ``q_offset = 3``)."""
    g = torch.Generator().manual_seed(2)
    nc = num_compressed(n + 3, 4, 2)
    shapes = ((1, 4, n, D), (1, 2, n + 3, D), (1, 2, n + 3, D), (1, 2, nc, D), (1, 2, nc, D))
    ts = [torch.randn(*s, generator=g) for s in shapes] + [torch.rand(1, 4, n, 3, generator=g)]
    return tuple(t.requires_grad_(grad) for t in ts)


@pytest.mark.parametrize("form", ["auto", "reference"])
def test_nsa_functional_has_no_graph_breaks_and_compiled_matches_eager(form: str) -> None:
    cfg = NSAConfig(**NSA_SMALL)

    def fn(*args: torch.Tensor) -> torch.Tensor:
        return nsa_attention(*args, cfg, form=form, query_chunk=16)

    assert _break_count(fn, *_nsa_inputs()) == 0
    args = _nsa_inputs(grad=True)
    want = _outputs_and_grads(fn, args)
    dynamo.reset()
    got = _outputs_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_nsa_module_compiled_matches_eager_with_gradients_as_one_operator() -> None:
    """The module's compressed and selected branches compile to one ``attnzoo::nsa_sparse_fwd`` node
    (its backward recomputes through the eager kernel): outputs and the gradients of ``x`` and every
    parameter match eager."""
    mod = _nsa_module()
    x = torch.randn(2, N, 32, requires_grad=True)

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        mod.zero_grad()
        x.grad = None
        out = fn(x)
        out.sin().sum().backward()
        return [out.detach(), x.grad.clone()] + [p.grad.clone() for p in mod.parameters()]

    want = run(mod)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    dynamo.reset()
    got = run(torch.compile(mod, backend=backend, fullgraph=True))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.attnzoo.nsa_sparse_fwd.default) == 1
    graphs.clear()  # without gradients: the inference operator, which saves nothing for a backward
    dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(mod, backend=backend, fullgraph=True)(x), want[0])
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.attnzoo.nsa_sparse.default in targets and torch.ops.attnzoo.nsa_sparse_fwd.default not in targets


@pytest.mark.slow  # heavy (seconds of inductor compile on 2 cores): the lighter compile tests stay in the default run
def test_nsa_cached_decode_compiled_matches_eager() -> None:
    """A compiled decode step (new tokens written into :class:`NSACache`, blocks compressed as they
    complete) has no graph break and gives the eager step's outputs and cache contents."""
    mod = _nsa_module().eval()
    x = torch.randn(2, 20, 32)
    caches = [mod.init_cache(2, 20), mod.init_cache(2, 20)]
    step = torch.compile(mod, backend="aot_eager", fullgraph=True)
    dynamo.reset()
    with torch.no_grad():
        for cache in caches:
            mod(x[:, :9], cache=cache)
        assert dynamo.explain(mod)(x[:, 9:10], cache=mod.init_cache(2, 20)).graph_break_count == 0
        for s, e in ((9, 10), (10, 11), (11, 14), (14, 15)):  # single tokens and a chunk, crossing block ends
            torch.testing.assert_close(step(x[:, s:e], cache=caches[1]), mod(x[:, s:e], cache=caches[0]))
    assert caches[1].length == caches[0].length == 15 and caches[1].num_blocks == caches[0].num_blocks
    for name in ("k", "v", "k_cmp", "v_cmp"):
        torch.testing.assert_close(getattr(caches[1], name), getattr(caches[0], name))


def test_dynamic_shapes_nsa_module_compiles_once() -> None:
    """The chunk loop of the sparse branches sits inside the operator and the window branch is one
    ``az.attention`` call when compiled, so no trip count specialises the graph."""
    mod = _nsa_module()
    with torch.no_grad():
        assert _graphs_for_lengths(mod, [(torch.randn(1, n, 32),) for n in LENGTHS]) == 1


def test_nsa_custom_operator_registration() -> None:
    """opcheck of ``attnzoo::nsa_sparse_fwd`` (schema, fake implementation, autograd through
    ``attnzoo::nsa_sparse_bwd``, AOT dispatch): GQA with a ``q_offset`` and ragged chunks, and a
    sequence with no complete compressed block."""
    cfg = (4, 2, 4, 4, 8, 2)
    q, k, v, kc, vc, gates = _nsa_inputs(grad=True, n=13)
    torch.library.opcheck(nsa_sparse_fwd, (q, k, v, kc, vc, gates, *cfg, 3, 0.25, 5))
    torch.library.opcheck(nsa_sparse, (*tuple(t.detach() for t in (q, k, v, kc, vc, gates)), *cfg, 3, 0.25, 5))
    short = (t[:, :, :2].detach().requires_grad_() for t in (q, k, v))
    empty = kc[:, :, :0].detach().requires_grad_(), vc[:, :, :0].detach().requires_grad_()
    torch.library.opcheck(nsa_sparse_fwd, (*short, *empty, gates[:, :, :2].detach().requires_grad_(), *cfg, 0, 0.25,
                                           128))


@pytest.mark.parametrize(("n", "q_offset", "chunk", "kv"), [(45, 3, 16, 2), (37, 0, 5, 1), (2, 0, 128, 2)])
def test_nsa_operator_backward_is_analytic_and_equals_autograd(n: int, q_offset: int, chunk: int, kv: int) -> None:
    """``attnzoo::nsa_sparse_bwd`` computes the gradients from the probabilities and picks its
    forward saved (no second forward): float64 gradients of every input equal autograd through
    the eager chunk loop, with ragged chunks, GQA / MQA and no complete compressed block."""
    from attnzoo.functional.softmax.nsa import _sparse

    cfg = NSAConfig(**NSA_SMALL)
    g = torch.Generator().manual_seed(5)
    nk, nc = n + q_offset, num_compressed(n + q_offset, 4, 2)
    shapes = ((2, 4, n, D), (2, kv, nk, D), (2, kv, nk, D), (2, kv, nc, D), (2, kv, nc, D))
    args = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    args = tuple(t.requires_grad_() for t in (*args, torch.rand(2, 4, n, 3, generator=g, dtype=torch.float64)))
    weight = torch.randn(2, 4, n, D, generator=g, dtype=torch.float64)
    fields = (cfg.block_len, cfg.block_stride, cfg.select_len, cfg.num_selected, cfg.window, cfg.local_blocks)
    outs = [_sparse(*args, cfg, q_offset, 0.3, chunk), nsa_sparse_fwd(*args, *fields, q_offset, 0.3, chunk)[0]]
    grads = [torch.autograd.grad((o * weight).sum(), args, allow_unused=True, materialize_grads=True) for o in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # heavy (seconds of inductor compile on 2 cores): the lighter compile tests stay in the default run
@pytest.mark.parametrize("mode", ["absolute", "cache"])
def test_streaming_cached_decode_compiled_matches_eager(mode: str) -> None:
    """StreamingLLM (sink tokens + window) in both position conventions: a full forward, a cached
    prefill and a decode step have no graph break (the sink/window split and the cache's kept slots
    are Python ints); compiled prefill + 12 single tokens + a chunk give the eager full forward, with
    the cache passed as an argument its length turns dynamic: at most 3 graphs for the 14 calls."""
    mod = az.SlidingWindowAttention(32, 4, window=8, sink_tokens=2, position_mode=mode, rope=True).eval()
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        full = mod(x)
        assert _break_count(mod, x) == 0
        cache = mod.init_cache(2, 40)
        assert _break_count(lambda t: mod(t, cache=cache), x[:, :17]) == 0
        assert _break_count(lambda t: mod(t, cache=cache), x[:, 17:18]) == 0
        dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        step, cache = torch.compile(mod, backend=counter, fullgraph=True), mod.init_cache(2, 40)
        got = [step(x[:, s:e], cache=cache) for s, e in [(0, 17), *((t, t + 1) for t in range(17, 29)), (29, 40)]]
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=1e-5, atol=1e-6)
    assert counter.frame_count <= 3
