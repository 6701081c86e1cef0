"""Benchmark harness behind ``attnzoo bench``: time and peak memory against sequence length.

A *target* is either a backend of :func:`attnzoo.attention` run on ``[B, H, N, D]`` (``sdpa``,
``tiled``, ``reference``, ``flex``, ``auto``), the peer ``torch`` (a bare call of
``torch.nn.functional.scaled_dot_product_attention``), or a registered variant module run on
``[B, N, C]`` (``mha``, ``sliding``, ``linear``... as ``variant:NAME`` or just ``NAME``).

Timing: after ``warmup`` calls, the median of ``repeats`` timed calls (``time.perf_counter``,
``torch.cuda.synchronize`` on CUDA). Achieved GFLOP/s use the *useful* FLOPs of
:func:`attnzoo.cost.estimate` (``backend="ideal"``: visible pairs only, so a causal kernel that
skips the upper triangle is not credited for it; forward + backward counts 3x the forward) and
are shown against a measured ``torch.mm`` peak of the same dtype on the same device.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` minus the memory held before the call;
on CPU :class:`PeakMemoryTracker`, a ``TorchDispatchMode`` that follows every tensor storage
created inside the measured call (forward and backward) and records the largest total alive at
once. It sees what the dispatcher allocates; scratch buffers a fused kernel allocates internally
(a few ``block x block`` tiles for torch's CPU flash kernel) are not visible to it. The memory run
is a separate call from the timed ones, so tracking costs no time in the timings.
"""

from __future__ import annotations

import csv
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from attnzoo._devices import resolve_device

__all__ = [
    "BenchReport",
    "BenchResult",
    "PeakMemoryTracker",
    "matmul_peak_gflops",
    "measure_peak_memory",
    "plot_bench",
    "run_bench",
    "time_call",
]

BACKEND_TARGETS = ("torch", "auto", "reference", "sdpa", "tiled", "flex", "flash")


# =========================================================================== measuring
class PeakMemoryTracker(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the ``with`` block and alive at once.

    Works on any device (it watches the dispatcher, not an allocator). Storages that existed
    before the block (inputs, parameters) are not counted.

    Example::

        with PeakMemoryTracker() as mem:
            attention(q, k, v, causal=True).sum().backward()
        mem.peak_bytes
    """

    def __init__(self) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._live: dict[int, tuple[Any, int]] = {}  # storages created inside: ptr -> (weak ref, bytes)
        self._old: dict[int, Any] = {}  # storages from before the block seen as inputs: ptr -> weak ref
        self._current = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Inputs not created inside the block existed before it; outputs aliasing them (views,
        # in-place results) are not new memory.
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in self._live and ptr not in self._old:
                    self._old[ptr] = self._ref(st)
        self._sweep()
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in self._live and ptr not in self._old:
                    n = st.nbytes()
                    self._live[ptr] = (self._ref(st), n)
                    self._current += n
        self.peak_bytes = max(self.peak_bytes, self._current)
        self._sweep()
        return out

    def _sweep(self) -> None:
        """Forget storages that have been freed (their address may be reused)."""
        for p in [p for p, (w, _) in self._live.items() if w.expired()]:
            self._current -= self._live.pop(p)[1]
        for p in [p for p, w in self._old.items() if w.expired()]:
            del self._old[p]


def measure_peak_memory(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Peak extra bytes while ``fn()`` runs (outputs freed inside count only while alive)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        del out
        return int(torch.cuda.max_memory_allocated(dev) - base)
    with PeakMemoryTracker() as mem:
        out = fn()
        del out
    return mem.peak_bytes


def time_call(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
              device: torch.device | str = "cpu") -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def matmul_peak_gflops(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                       max_n: int = 2048, budget_s: float = 0.25, repeats: int = 3) -> float:
    """Measured ``torch.mm`` peak (GFLOP/s): the roof that achieved GFLOP/s are read against.

    Square products of growing size ``n = 256, 512, ...`` up to ``max_n``, stopping once one
    call takes longer than ``budget_s`` (so a slow dtype cannot stall the run); the best median
    rate over the sizes is the peak.
    """
    dev = torch.device(device)
    best = 0.0
    n = 256
    while n <= max_n:
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        t = statistics.median(time_call(lambda a=a, b=b: torch.mm(a, b), repeats=repeats, warmup=1, device=dev))
        best = max(best, 2 * n**3 / t / 1e9)
        if t > budget_s:
            break
        n *= 2
    return best


# =========================================================================== cases
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
    status: str = "ok"  # "ok" | "skipped: ..." | "error: ..."


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


def _parse_target(t: str) -> tuple[str, str]:
    from attnzoo.variants import VARIANTS

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


def _backend_call(target: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  window: tuple[int, int] | None) -> Callable[[], torch.Tensor]:
    import torch.nn.functional as F

    from attnzoo.functional.attention import attention

    if target == "torch":
        if window is not None:
            n = q.shape[2]
            i = torch.arange(n, device=q.device)
            band = (i.view(1, -1) <= i.view(-1, 1)) & (i.view(1, -1) >= i.view(-1, 1) - window[0])
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: attention(q, k, v, causal=causal, window=window, backend=target)  # type: ignore[return-value]


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
        repeats, warmup: timed and untimed calls per case.
        memory: also measure peak memory (one extra call per case).
        max_case_seconds: once a target's median call takes longer, its longer sequences are
            skipped (keeps the default run around a minute).
        max_score_bytes: skip a case whose materialised score matrix (``reference`` backend)
            would exceed this.
        peak_max_n: largest ``n x n`` product of the ``torch.mm`` peak measurement.
        seed: RNG seed.
        progress: called with a label before each case.
    """
    from attnzoo.cost import dtype_from_name, estimate

    if mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {mode!r}")
    dt = dtype_from_name(dtype)
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dt}")
    dev = resolve_device(device)
    parsed = [(t, *_parse_target(t)) for t in targets]
    lens = [int(n) for n in seq_lens]
    if not lens or any(n < 1 for n in lens):
        raise ValueError(f"seq_lens must be positive integers, got {list(seq_lens)}")
    for name, val in (("batch", batch), ("heads", heads), ("head_dim", head_dim), ("repeats", repeats)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    win = (window, 0) if window is not None else None
    peak = matmul_peak_gflops(dt, dev, max_n=peak_max_n)
    dim = heads * head_dim
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
            g = torch.Generator().manual_seed(seed)
            if kind == "backend":
                if name == "reference" and 3 * batch * heads * n * n * 4 > max_score_bytes:
                    res.status = "skipped: score matrix over max_score_bytes"
                    continue
                q, k, v = (torch.randn(batch, heads, n, head_dim, generator=g).to(device=dev, dtype=dt)
                           .requires_grad_(mode == "fwd+bwd") for _ in range(3))
                call = _backend_call(name, q, k, v, causal, win)
                cost = estimate("sliding" if win else "mha", n, dim, heads, batch=batch, window=win,
                                causal=causal, backend="ideal")
                useful = cost.flops_useful
            else:
                from attnzoo.variants import build_attention

                kw: dict[str, Any] = {}
                if window is not None and name in ("sliding", "local_global"):
                    kw["window"] = window
                try:
                    mod = build_attention(name, dim, heads, **kw).to(device=dev, dtype=dt)
                except Exception as exc:
                    res.status = f"error: {type(exc).__name__}: {exc}"
                    continue
                if mode == "fwd":
                    mod.eval()
                x = torch.randn(batch, n, dim, generator=g).to(device=dev, dtype=dt)

                def call(mod: torch.nn.Module = mod, x: torch.Tensor = x) -> torch.Tensor:
                    y = mod(x)
                    return y[0] if isinstance(y, tuple) else y

                cost = estimate(name, n, dim, heads, batch=batch, window=kw.get("window"), backend="ideal")
                useful = cost.flops_projections + cost.flops_useful
            if mode == "fwd+bwd":
                fwd = call

                def step(fwd: Callable[[], torch.Tensor] = fwd) -> torch.Tensor:
                    out = fwd()
                    out.float().sum().backward()
                    return out

                fn: Callable[[], Any] = step
                useful *= 3
            else:
                def fwd_only(call: Callable[[], torch.Tensor] = call) -> torch.Tensor:
                    with torch.no_grad():
                        return call()

                fn = fwd_only
            try:
                times = time_call(fn, repeats=repeats, warmup=warmup, device=dev)
                if memory:
                    res.peak_mem_mb = measure_peak_memory(fn, dev) / 2**20
            except Exception as exc:
                res.status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                continue
            med = statistics.median(times)
            res.time_ms, res.time_ms_min, res.time_ms_max = med * 1e3, min(times) * 1e3, max(times) * 1e3
            res.repeats = repeats
            res.gflop = useful / 1e9
            res.gflops = useful / med / 1e9
            res.frac_of_peak = res.gflops / peak if peak > 0 else None
            if med > max_case_seconds:
                too_slow.add(label)
    meta = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "processor": platform.processor(), "device": str(dev), "dtype": str(dt).replace("torch.", ""),
        "mode": mode, "batch": batch, "heads": heads, "head_dim": head_dim, "causal": causal,
        "window": window, "repeats": repeats, "warmup": warmup, "matmul_peak_gflops": peak,
        "memory_method": ("torch.cuda.max_memory_allocated" if dev.type == "cuda"
                          else "PeakMemoryTracker (TorchDispatchMode over tensor storages)"),
        "flops": "useful FLOPs of attnzoo.cost.estimate(backend='ideal'); fwd+bwd = 3x fwd",
    }
    return BenchReport(results, meta)


# =========================================================================== plotting
def plot_bench(report: BenchReport, path: str | Path) -> Path:
    """Log-log plot of time, peak memory and achieved GFLOP/s against sequence length (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - extra not installed
        raise ImportError("plotting needs matplotlib: pip install 'attnzoo[plot]'") from exc
    meta = report.meta
    targets = list(dict.fromkeys(r.target for r in report.results))
    kinds = {r.target: r.kind for r in report.results}

    def label(t: str) -> str:
        if kinds.get(t) == "variant":
            return f"{t} (module)"
        return "torch SDPA (bare)" if t == "torch" else f"attention(backend={t!r})"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = [("time_ms", "median time per call (ms)", "Time"),
              ("peak_mem_mb", "peak extra memory (MiB)", "Peak memory"),
              ("gflops", "achieved GFLOP/s (useful FLOPs)", "Throughput")]
    for ax, (key, ylabel, title) in zip(axes, panels, strict=True):
        for t in targets:
            pts = [(r.seq_len, getattr(r, key)) for r in report.results
                   if r.target == t and getattr(r, key) is not None and getattr(r, key) > 0]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=label(t))
        if key == "gflops" and meta.get("matmul_peak_gflops"):
            ax.axhline(meta["matmul_peak_gflops"], color="gray", linestyle="--",
                       label=f"torch.mm peak ({meta['matmul_peak_gflops']:.0f})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    sub = (f"{meta.get('mode', '')}, {meta.get('dtype', '')}, {meta.get('device', '')}, "
           f"B={meta.get('batch')} H={meta.get('heads')} D={meta.get('head_dim')}, "
           f"causal={meta.get('causal')}, window={meta.get('window')}, threads={meta.get('threads')}")
    fig.suptitle(f"attnzoo bench: {sub}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
