"""The log-log picture of a bench run: time, peak memory and achieved GFLOP/s against N."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

__all__ = ["format_value", "plot_bench"]


class BenchReport(Protocol):
    """What the plot reads of :class:`attnzoo.bench.BenchReport` (results with ``target``,
    ``kind``, ``seq_len``, ``time_ms``, ``peak_mem_mb``, ``gflops``; ``meta``)."""

    results: list[Any]
    meta: dict[str, Any]


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
           f"causal={meta.get('causal')}, "
           + (f"window={meta['window']}" if meta.get("window") is not None else "window: each variant's default")
           + f", threads={meta.get('threads')}")
    fig.suptitle(f"attnzoo bench: {sub}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def format_value(x: float | None, spec: str = ".1f") -> str:
    """``x`` formatted with ``spec``; ``"-"`` for a missing or NaN value."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
