"""Running the bench: every target at every sequence length, with a size guard, into a report."""

from __future__ import annotations

import csv
import json
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnzoo._devices import resolve_device
from attnzoo._memory import refuse_if_too_big
from attnzoo._validate import check_int, check_positive_float
from attnzoo.bench.measure import (
    matmul_peak_gflops,
    measure_peak_memory,
    time_call,
    time_eager_and_compiled,
)
from attnzoo.bench.plot import plot_bench
from attnzoo.cost import dtype_from_name, estimate, estimate_stack
from attnzoo.functional.softmax.attention import attention
from attnzoo.variants import VARIANTS, build_attention, layer_pattern

__all__ = ["BACKEND_TARGETS", "BenchReport", "BenchResult", "estimate_case_bytes", "run_bench"]

BACKEND_TARGETS = ("torch", "auto", "reference", "sdpa", "tiled", "flex", "flash")
#: Targets that may materialise an ``[N, N]`` bool band for a sliding window.
_BAND_TARGETS = ("torch", "auto", "sdpa", "flex")


@dataclass
class BenchResult:
    """One (target, sequence length) measurement."""

    target: str
    kind: str  # "backend" | "variant"
    seq_len: int
    mode: str  # "fwd" | "fwd+bwd"
    dtype: str
    device: str
    batch: int
    heads: int
    head_dim: int
    time_ms: float | None = None  # median
    time_ms_min: float | None = None
    time_ms_max: float | None = None
    repeats: int = 0
    peak_mem_mb: float | None = None
    gflop: float | None = None  # useful GFLOP of one call
    gflops: float | None = None  # achieved GFLOP/s (useful FLOPs / median time)
    frac_of_peak: float | None = None  # gflops / measured matmul peak
    compile_s: float | None = None  # --compile: seconds of the first compiled call (time_ms is then compiled)
    eager_ms: float | None = None  # --compile: eager median, interleaved with the compiled calls
    compiled_over_eager: float | None = None  # --compile: compiled median / eager median
    status: str = "ok"  # "ok" | "ok; peak memory not measured: ..." | "skipped: ..." | "error: ..."


@dataclass
class BenchReport:
    """All results of a run plus what is needed to read them."""

    results: list[BenchResult]
    meta: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "results": [asdict(r) for r in self.results]}

    def write(self, out_dir: str | Path, stem: str = "bench", plot: bool = True) -> dict[str, Path]:
        """Write ``stem.csv``, ``stem.json`` and (``plot=True``) ``stem.png`` into ``out_dir``."""
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        paths = {"csv": d / f"{stem}.csv", "json": d / f"{stem}.json"}
        names = list(asdict(self.results[0]).keys()) if self.results else list(BenchResult.__dataclass_fields__)
        with paths["csv"].open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=names)
            w.writeheader()
            for r in self.results:
                w.writerow(asdict(r))
        paths["json"].write_text(json.dumps(self.as_dict(), indent=2))
        if plot:
            paths["png"] = plot_bench(self, d / f"{stem}.png")
        return paths


@dataclass(frozen=True)
class _Setup:
    """What every case of one run shares."""

    dtype: torch.dtype
    device: torch.device
    mode: str
    batch: int
    heads: int
    head_dim: int
    causal: bool
    window: int | None
    repeats: int
    warmup: int
    memory: bool
    max_score_bytes: int
    seed: int
    compile: bool = False

    @property
    def band(self) -> tuple[int, int] | None:
        return (self.window, 0) if self.window is not None else None


def _parse_target(t: str) -> tuple[str, str]:
    if "/" in t:  # a per-layer stack, e.g. gated_deltanet/gated_deltanet/gated_deltanet/mha
        try:
            layer_pattern(t.removeprefix("variant:"), 1)
        except ValueError as e:
            raise ValueError(f"targets: {t!r} is not a stack of registered variants: {e}") from None
        return "variant", t.removeprefix("variant:")
    if t.startswith("variant:"):
        name = t.split(":", 1)[1]
        if name not in VARIANTS:
            raise ValueError(f"targets: unknown variant {name!r}; expected one of {list(VARIANTS)}")
        return "variant", name
    if t.startswith("backend:"):
        t = t.split(":", 1)[1]
    if t in BACKEND_TARGETS:
        return "backend", t
    if t in VARIANTS:
        return "variant", t
    raise ValueError(f"targets: unknown target {t!r}; expected a backend {BACKEND_TARGETS}, "
                     f"a variant {list(VARIANTS)} or variant:NAME")


def estimate_case_bytes(kind: str, name: str, n: int, *, batch: int, heads: int, head_dim: int,
                        dtype: torch.dtype, mode: str = "fwd", window: int | None = None) -> int:
    """A lower estimate of the memory one bench case needs (inputs, output, gradients, temporaries).

    Backends: q, k, v and the output ``[B, H, N, D]`` twice over (temporaries), doubled again for
    the gradients of ``fwd+bwd``, plus an ``[N, N]`` bool band for a window on the targets that
    build one. Variants: about six ``[B, N, C]`` activations (input, q, k, v, attention output,
    projection), doubled for ``fwd+bwd``. The ``reference`` backend's ``[N, N]`` scores are not
    counted: ``max_score_bytes`` skips those cases.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    grads = 2 if mode == "fwd+bwd" else 1
    if kind == "backend":
        band = n * n if window is not None and name in _BAND_TARGETS else 0
        return 2 * 4 * batch * heads * n * head_dim * elt * grads + band
    return 6 * batch * n * heads * head_dim * elt * grads


def _checked_setup(mode: str, dtype: str | torch.dtype, device: str | torch.device, ints: dict[str, int],
                   max_case_seconds: float) -> tuple[torch.dtype, torch.device]:
    if mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {mode!r}")
    dt = dtype_from_name(dtype)
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dt}")
    dev = resolve_device(device)
    for name, val in ints.items():
        check_int(val, name, minimum=0 if name == "warmup" else 1)
    check_positive_float(max_case_seconds, "max_case_seconds")
    return dt, dev


def _backend_call(target: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  window: tuple[int, int] | None) -> Callable[[], torch.Tensor]:
    if target == "torch":
        if window is not None:
            n = q.shape[2]
            i = torch.arange(n, device=q.device)
            band = (i.view(1, -1) <= i.view(-1, 1)) & (i.view(1, -1) >= i.view(-1, 1) - window[0])
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: attention(q, k, v, causal=causal, window=window, backend=target)  # type: ignore[return-value]


def _backend_case(name: str, n: int, st: _Setup, g: torch.Generator) -> tuple[Callable[[], Any], float]:
    """The call of backend ``name`` at length ``n`` and its useful FLOPs."""
    q, k, v = (torch.randn(st.batch, st.heads, n, st.head_dim, generator=g).to(device=st.device, dtype=st.dtype)
               .requires_grad_(st.mode == "fwd+bwd") for _ in range(3))
    cost = estimate("sliding" if st.band else "mha", n, st.heads * st.head_dim, st.heads, batch=st.batch,
                    window=st.band, causal=st.causal, backend="ideal")
    return _backend_call(name, q, k, v, st.causal, st.band), cost.flops_useful


def _variant_case(name: str, n: int, st: _Setup, g: torch.Generator) -> tuple[Callable[[], Any], float]:
    """The call of variant module ``name`` on ``x [B, N, C]`` and its useful FLOPs."""
    dim = st.heads * st.head_dim
    names = layer_pattern(name, len(name.split("/")))  # one layer, or a stack "a/b/c" (residual chain)
    mods = []
    for layer in names:
        kw = {"window": st.window} if st.window is not None and "window" in VARIANTS[layer].options else {}
        mods.append(build_attention(layer, dim, st.heads, **kw).to(device=st.device, dtype=st.dtype))
        if st.mode == "fwd":
            mods[-1].eval()
    x = torch.randn(st.batch, n, dim, generator=g).to(device=st.device, dtype=st.dtype)

    def call() -> torch.Tensor:
        h = x
        for mod in mods:
            y = mod(h)
            y = y[0] if isinstance(y, tuple) else y
            h = y if len(mods) == 1 else h + y
        return h

    # --window applies to the layers that take one (as they were built); a stack without any gets none
    takes = any("window" in VARIANTS[name].options for name in names)
    window = {"window": st.window} if st.window is not None and takes else {}
    cost = estimate_stack(names, n, dim, st.heads, batch=st.batch, backend="ideal", **window)
    return call, cost.flops_projections + cost.flops_useful


def _in_mode(call: Callable[[], Any], mode: str) -> Callable[[], Any]:
    """``call`` as measured: forward under ``no_grad``, or forward and backward of the summed output."""
    if mode == "fwd+bwd":
        def step() -> torch.Tensor:
            out = call()
            out.float().sum().backward()
            return out

        return step

    def fwd_only() -> torch.Tensor:
        with torch.no_grad():
            return call()

    return fwd_only


def _timed(res: BenchResult, call: Callable[[], Any], fn: Callable[[], Any], st: _Setup) -> list[float]:
    """Seconds of each timed call of ``fn``; with ``st.compile``, of ``torch.compile(call)`` in the
    same mode, timed interleaved with eager ``fn`` (compile time and ratio go into ``res``)."""
    if not st.compile:
        return time_call(fn, repeats=st.repeats, warmup=st.warmup, device=st.device)
    torch._dynamo.reset()  # a fresh cache per case: earlier cases' guards must not count as recompiles
    compiled = _in_mode(torch.compile(call), st.mode)
    res.compile_s, eager, times = time_eager_and_compiled(fn, compiled, repeats=st.repeats, warmup=st.warmup,
                                                          device=st.device)
    res.eager_ms = statistics.median(eager) * 1e3
    res.compiled_over_eager = statistics.median(times) / statistics.median(eager)
    return times


def _reason(exc: Exception) -> str:
    """``Type: first line`` of an exception (at most 200 characters of it)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}"


def _run_case(res: BenchResult, kind: str, name: str, st: _Setup, peak: float) -> None:
    """Measure one case into ``res`` (time, memory, GFLOP/s) or record why it was skipped or failed."""
    n = res.seq_len
    g = torch.Generator().manual_seed(st.seed)
    if kind == "backend":
        if name == "reference" and 3 * st.batch * st.heads * n * n * 4 > st.max_score_bytes:
            res.status = "skipped: score matrix over max_score_bytes"
            return
        call, useful = _backend_case(name, n, st, g)
    else:
        try:
            call, useful = _variant_case(name, n, st, g)
        except Exception as exc:
            res.status = f"error: {type(exc).__name__}: {exc}"
            return
    if st.mode == "fwd+bwd":
        useful *= 3
    fn = _in_mode(call, st.mode)
    try:
        times = _timed(res, call, fn, st)
    except Exception as exc:
        res.status = f"error: {_reason(exc)}"
        return
    if st.memory:
        try:
            res.peak_mem_mb = measure_peak_memory(fn, st.device) / 2**20
        except Exception as exc:  # e.g. FlexAttention's higher-order operator refuses the CPU tracker's mode
            res.status = f"ok; peak memory not measured: {_reason(exc)[:120]}"
    med = statistics.median(times)
    res.time_ms, res.time_ms_min, res.time_ms_max = med * 1e3, min(times) * 1e3, max(times) * 1e3
    res.repeats = st.repeats
    res.gflop = useful / 1e9
    res.gflops = useful / med / 1e9
    res.frac_of_peak = res.gflops / peak if peak > 0 else None


def _meta(st: _Setup, peak: float) -> dict[str, Any]:
    return {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "processor": platform.processor(), "device": str(st.device), "dtype": str(st.dtype).replace("torch.", ""),
        "mode": st.mode, "batch": st.batch, "heads": st.heads, "head_dim": st.head_dim, "causal": st.causal,
        "window": st.window, "repeats": st.repeats, "warmup": st.warmup, "matmul_peak_gflops": peak,
        "memory_method": ("torch.cuda.max_memory_allocated" if st.device.type == "cuda"
                          else "PeakMemoryTracker (TorchDispatchMode over tensor storages)"),
        "flops": "useful FLOPs of attnzoo.cost.estimate(backend='ideal'); fwd+bwd = 3x fwd",
        "compile": st.compile,
    }


def _refuse_oversized(parsed: list[tuple[str, str, str]], lens: list[int], st: _Setup) -> None:
    """``ValueError`` before any measurement when the largest case would not fit in free memory."""
    for label, kind, name in parsed:
        n = max(lens)
        need = estimate_case_bytes(kind, name, n, batch=st.batch, heads=st.heads, head_dim=st.head_dim,
                                   dtype=st.dtype, mode=st.mode, window=st.window)
        refuse_if_too_big(need, f"bench case {label} N={n}", st.device)


def run_bench(
    targets: Sequence[str] = ("torch", "sdpa", "tiled"),
    seq_lens: Sequence[int] = (256, 512, 1024, 2048),
    *,
    mode: str = "fwd",
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    causal: bool = True,
    window: int | None = None,
    repeats: int = 5,
    warmup: int = 1,
    memory: bool = True,
    max_case_seconds: float = 5.0,
    max_score_bytes: int = 2 << 30,
    peak_max_n: int = 2048,
    seed: int = 0,
    compile: bool = False,
    progress: Callable[[str], None] | None = None,
) -> BenchReport:
    """Time (and measure the peak memory of) every target at every sequence length.

    Args:
        targets: backends (``torch`` = bare SDPA, ``auto``, ``sdpa``, ``tiled``, ``reference``,
            ``flex``) and/or variants (``mha``, ``variant:sliding``...).
        seq_lens: sequence lengths ``N`` (self-attention).
        mode: ``"fwd"`` or ``"fwd+bwd"``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: ``"cpu"`` or ``"cuda"``.
        batch, heads, head_dim: ``B``, ``H``, ``D`` (variants get ``C = H * D``).
        causal: causal attention (backends); variants are built causal.
        window: a causal sliding window ``(window, 0)`` for backend targets and the window of
            ``sliding``/``local_global`` variants.
        repeats, warmup: timed (at least 1) and untimed (at least 0) calls per case.
        memory: also measure peak memory (one extra call per case).
        max_case_seconds: once a target's median call takes longer, its longer sequences are
            skipped (keeps the default run around a minute); positive and finite.
        max_score_bytes: skip a case whose materialised score matrix (``reference`` backend)
            would exceed this.
        peak_max_n: largest ``n x n`` product of the ``torch.mm`` peak measurement.
        seed: RNG seed.
        compile: time ``torch.compile`` of each call instead (its backward too in ``fwd+bwd``):
            ``compile_s`` is the first compiled call, ``time_ms`` the compiled calls, timed
            interleaved with eager ones (``eager_ms``, ``compiled_over_eager``).
        progress: called with a label before each case.

    Raises:
        ValueError: bad arguments, or a case whose estimated memory (:func:`estimate_case_bytes`)
            exceeds the memory available on ``device`` (checked before anything runs).
    """
    dt, dev = _checked_setup(mode, dtype, device, {"batch": batch, "heads": heads, "head_dim": head_dim,
                                                   "repeats": repeats, "warmup": warmup}, max_case_seconds)
    parsed = [(t, *_parse_target(t)) for t in targets]
    lens = [int(n) for n in seq_lens]
    if not lens or any(n < 1 for n in lens):
        raise ValueError(f"seq_lens must be positive integers, got {list(seq_lens)}")
    st = _Setup(dt, dev, mode, batch, heads, head_dim, causal, window, repeats, warmup, memory, max_score_bytes, seed,
                compile)
    _refuse_oversized(parsed, lens, st)
    peak = matmul_peak_gflops(dt, dev, max_n=peak_max_n)
    results: list[BenchResult] = []
    too_slow: set[str] = set()
    for label, kind, name in parsed:
        for n in sorted(lens):
            res = BenchResult(label, kind, n, mode, str(dt).replace("torch.", ""), str(dev), batch, heads, head_dim)
            results.append(res)
            if label in too_slow:
                res.status = f"skipped: a shorter case took over {max_case_seconds:g} s"
                continue
            if progress is not None:
                progress(f"{label} N={n}")
            _run_case(res, kind, name, st, peak)
            if res.time_ms is not None and res.time_ms / 1e3 > max_case_seconds:
                too_slow.add(label)
    return BenchReport(results, _meta(st, peak))
