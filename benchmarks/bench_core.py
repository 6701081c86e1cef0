"""Benchmark of the core attention backends (issue 2's performance paragraph).

Every number is a ratio against a peer measured in the same run (medians of repeats, the peers
interleaved so that machine load hits both alike). Peak extra memory is measured in a fresh
subprocess per case: after a first call at the same shape (for FlexAttention: the call that
compiles) and once the inputs exist, the kernel's resident-set high-water mark (``VmHWM``) is reset to the current
RSS through ``/proc/self/clear_refs``, and its growth during the call is reported, so it counts
every page the call touches (Linux only). The child runs with glibc's mmap threshold fixed at
64 KiB, so freed tensors leave the resident set at once. The kernel's counters are still approximate
to ~0.1-0.2 MB, so the window cases run ``--memory-runs`` times each (default 3) and the median is
reported with the range.

Usage::

    python benchmarks/bench_core.py                 # everything (several minutes on 2 cores)
    python benchmarks/bench_core.py --only dense window window_train memory bf16 peak
    python benchmarks/bench_core.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnzoo as az
from attnzoo import masks as M

B, H, D = 1, 8, 64


def qkv(n: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(B, H, n, D, generator=g).to(dtype).requires_grad_(grad) for _ in range(3))


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, calls interleaved round-robin after one warm-up each."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def causal_flops(n: int) -> float:
    """Useful FLOPs of causal attention forward (QK^T and PV on the visible half)."""
    return 4.0 * B * H * D * n * (n + 1) / 2


def mm_peak(dtype: torch.dtype) -> float:
    a = torch.randn(2048, 2048).to(dtype)
    t = timed({"mm": lambda: torch.mm(a, a)}, 3)["mm"]
    return 2 * 2048**3 / t / 1e9


def bench_dense(repeats: int) -> list[dict]:
    rows = []
    for n in (4096, 16384):
        q, k, v = qkv(n)
        with torch.no_grad():
            t = timed({
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "auto": lambda: az.attention(q, k, v, causal=True),
                "tiled": lambda: az.attention(q, k, v, causal=True, backend="tiled"),
            }, repeats if n <= 4096 else max(1, repeats // 2))
        fl = causal_flops(n)
        rows.append({"case": f"dense causal N={n} fp32", "sdpa_s": t["sdpa"], "auto_s": t["auto"],
                     "tiled_s": t["tiled"], "auto/sdpa": t["auto"] / t["sdpa"], "tiled/sdpa": t["tiled"] / t["sdpa"],
                     "sdpa_GFLOPs": fl / t["sdpa"] / 1e9, "auto_GFLOPs": fl / t["auto"] / 1e9,
                     "tiled_GFLOPs": fl / t["tiled"] / 1e9})
    return rows


def band_mask(n: int, left: int) -> torch.Tensor:
    i = torch.arange(n)
    return (i.view(-1, 1) - i.view(1, -1)).clamp(min=-1).le(left) & (i.view(1, -1) <= i.view(-1, 1))


def bench_window(repeats: int, with_flex: bool) -> list[dict]:
    rows = []
    left = 256
    for n in (16384, 65536):
        q, k, v = qkv(n)
        fns: dict[str, Callable[[], object]] = {"auto": lambda: az.attention(q, k, v, causal=True, window=(left, 0))}
        if n <= 16384:
            dense = band_mask(n, left)
            fns["sdpa_dense_band"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        compile_s = float("nan")
        if with_flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)

            def mod(b, h, qi, ki):
                return (ki <= qi) & (qi - ki <= left)

            bm = create_block_mask(mod, 1, 1, n, n, device="cpu", _compile=True)
            t0 = time.perf_counter()
            with torch.no_grad():
                flex(q, k, v, block_mask=bm)
            compile_s = time.perf_counter() - t0
            fns["flex_compiled"] = lambda: flex(q, k, v, block_mask=bm)
        with torch.no_grad():
            t = timed(fns, repeats if n <= 16384 else max(1, repeats // 2))
        row = {"case": f"causal window ({left},0) N={n} fp32", **{f"{k}_s": val for k, val in t.items()},
               "flex_compile_s": compile_s}
        if "sdpa_dense_band" in t:
            row["sdpa_dense_band/auto"] = t["sdpa_dense_band"] / t["auto"]
        if "flex_compiled" in t:
            row["auto/flex"] = t["auto"] / t["flex_compiled"]
        rows.append(row)
    return rows


def bench_window_train(repeats: int) -> list[dict]:
    """Causal window (256, 0), forward + backward (training): `auto` (tiled) against SDPA with a
    dense band mask at N=4096, and the backward's cost relative to the forward at N=16384."""
    left = 256
    rows = []
    n = 4096
    q, k, v = qkv(n, grad=True)
    dense = band_mask(n, left)

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            fn().sum().backward()
            for t in (q, k, v):
                t.grad = None
        return run

    t = timed({"auto": step(lambda: az.attention(q, k, v, causal=True, window=(left, 0))),
               "sdpa_dense_band": step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))}, repeats)
    rows.append({"case": f"causal window ({left},0) N={n} fp32 fwd+bwd", "auto_s": t["auto"],
                 "sdpa_dense_band_s": t["sdpa_dense_band"], "sdpa_dense_band/auto": t["sdpa_dense_band"] / t["auto"]})
    n = 16384
    q, k, v = qkv(n, grad=True)

    def fwd() -> None:
        with torch.no_grad():
            az.attention(q, k, v, causal=True, window=(left, 0))

    t = timed({"fwd": fwd, "fwd_bwd": step(lambda: az.attention(q, k, v, causal=True, window=(left, 0)))}, repeats)
    rows.append({"case": f"causal window ({left},0) N={n} fp32, auto", "fwd_s": t["fwd"], "fwd_bwd_s": t["fwd_bwd"],
                 "fwd_bwd/fwd": t["fwd_bwd"] / t["fwd"]})
    return rows


def _half_request(q: torch.Tensor) -> az.functional._request.AttnRequest:
    return az.functional._request.build_request(q, q, q, mask=None, causal=True, window=None, q_offset=None,
                                                scale=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                                                return_lse=False, return_weights=False)


def run_arguments(p: argparse.ArgumentParser, repeats: int) -> None:
    """The arguments of a timed run the model benchmarks share: ``--repeats``, ``--threads``, ``--json``."""
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def parse_run(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line; apply ``--threads`` (of :func:`run_arguments`)."""
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def print_rows(rows: list[dict], info: dict, header: str, columns: list[tuple[str, str, str]],
               as_json: bool) -> None:
    """A model benchmark's result: JSON ``{**info, "rows": rows}``, or ``header`` then a table of
    ``rows`` whose first column is ``impl`` and whose others are ``columns`` ``(key, title, format)``
    (``format`` a width and precision such as ``"9.3f"``; ``None`` values print blank)."""
    if as_json:
        print(json.dumps({**info, "rows": rows}, indent=1))
        return
    def cell(value: object, fmt: str) -> str:
        return "" if value is None else str(value) if isinstance(value, (bool, str)) else format(value, fmt)

    table = [[str(r["impl"])] + [cell(r[key], fmt) for key, _, fmt in columns] for r in rows]
    titles = ["impl"] + [title for _, title, _ in columns]
    widths = [max(len(row[i]) for row in [titles, *table]) for i in range(len(titles))]
    print(header)
    for row in [titles, *table]:
        print(f"{row[0]:{widths[0]}s}" + "".join(f" {c:>{w}s}" for c, w in zip(row[1:], widths[1:], strict=True)))


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the record next to the numbers."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def bench_half(repeats: int) -> list[dict]:
    """bf16 and fp16 causal N=4096: ``auto`` against SDPA in that dtype and SDPA through float32,
    with the errors (N=1024) of ``auto`` and of a plain eager implementation in that dtype vs float64."""
    from attnzoo.functional.backends import halfmath

    n = 4096
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = qkv(n, dtype)
        q64, k64, v64 = (x[:, :, :1024].double() for x in (q, k, v))
        t32, th = halfmath.calibrate(dtype)  # tiled's policy (matmul)
        s32, sh = halfmath.calibrate(dtype, kernel="sdpa")  # auto/sdpa's policy
        with torch.no_grad():
            t = timed({
                "sdpa_half": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "sdpa_via_fp32": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), is_causal=True).to(q.dtype),
                "auto": lambda q=q, k=k, v=v: az.attention(q, k, v, causal=True),
                "tiled": lambda q=q, k=k, v=v: az.attention(q, k, v, causal=True, backend="tiled"),
            }, repeats)
            ref = az.attention(q64, k64, v64, causal=True, backend="reference")
            qs, ks, vs = (x[:, :, :1024] for x in (q, k, v))
            s = (qs @ ks.transpose(-1, -2)) / math.sqrt(D)
            s = s.masked_fill(~M.causal().materialize(1, 1, 1024, 1024), float("-inf"))
            eager = torch.softmax(s, dim=-1) @ vs
            auto = az.attention(qs, ks, vs, causal=True)
        name = str(dtype).removeprefix("torch.")
        rows.append({"case": f"{name} causal N=4096", "cpu": cpu_model(), "threads": torch.get_num_threads(),
                     **{f"{a}_s": b for a, b in t.items()},
                     "sdpa_half/auto": t["sdpa_half"] / t["auto"],
                     "auto_backend": az.functional.choose_backend(_half_request(q)),
                     "half_math_sdpa": str(halfmath.half_math(dtype, "cpu", "sdpa")).removeprefix("torch."),
                     "half_math_tiled": str(halfmath.half_math(dtype, "cpu")).removeprefix("torch."),
                     "calib_sdpa_fp32_us": s32 * 1e6, "calib_sdpa_half_us": sh * 1e6,
                     "calib_matmul_fp32_us": t32 * 1e6, "calib_matmul_half_us": th * 1e6,
                     "err_auto_vs_fp64 (N=1024)": (auto.double() - ref).abs().max().item(),
                     "err_eager_vs_fp64 (N=1024)": (eager.double() - ref).abs().max().item()})
    return rows


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])  # kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(kind: str, n: int) -> None:
    q, k, v = qkv(n, grad=kind == "tiled")  # forward-only cases take no gradients
    if kind == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        bm = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= 256), 1, 1, n, n, device="cpu",
                               _compile=True)
        with torch.no_grad():
            flex(q, k, v, block_mask=bm)  # compile outside the measurement
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if kind == "flex":
            with torch.no_grad():
                out = flex(q, k, v, block_mask=bm)
        elif kind == "tiled":
            out = az.attention(q, k, v, causal=True, backend="tiled")
        elif kind == "auto_window":
            with torch.no_grad():
                out = az.attention(q, k, v, causal=True, window=(256, 0))
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if out.requires_grad:
            out.sum().backward()

    if kind != "flex":  # the measured call is the second at this shape, as for flex (whose first compiles)
        call(q, k, v)
        for t in (q, k, v):
            t.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident set
    base = _vm("VmRSS")
    call(q, k, v)
    print(json.dumps({"peak_extra_MB": (_vm("VmHWM") - base) / 1024}))


def child_memory(kind: str, n: int, runs: int = 1) -> dict[str, float]:
    """Median and range of ``runs`` fresh-process measurements of ``kind`` (MB)."""
    # A fixed glibc mmap threshold: every large buffer is mapped on allocation and unmapped on free,
    # so the high-water mark follows live memory instead of what the allocator keeps cached (with
    # glibc's adaptive threshold the same case varied by 20% between runs).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    got = []
    for _ in range(runs):
        res = subprocess.run([sys.executable, __file__, "--child", kind, str(n)], capture_output=True, text=True,
                             check=True, env=env)
        got.append(json.loads(res.stdout.strip().splitlines()[-1])["peak_extra_MB"])
    return {"median": statistics.median(got), "min": min(got), "max": max(got)}


def bench_memory(runs: int) -> list[dict]:
    # The kernel's resident-set counters are approximate to ~0.1 MB (per-CPU counters), so the
    # window cases, compared with each other at that precision, run ``runs`` times in fresh
    # processes and the medians are compared (the tiled case, ~3 minutes, is far from its limit).
    n = 32768
    tiled = child_memory("tiled", n)
    window = child_memory("auto_window", 65536, runs)
    flex = child_memory("flex", 65536, runs)
    return [{"case": f"tiled causal fwd+bwd N={n} fp32", "peak_extra_MB": tiled["median"],
             "naive_scores_MB (one N x N x H fp32 matrix)": B * H * n * n * 4 / 2**20},
            {"case": "auto causal window (256,0) fwd N=65536 fp32", "peak_extra_MB": window["median"],
             "peak_extra_MB range": (window["min"], window["max"]),
             "flex_compiled_peak_extra_MB": flex["median"], "flex range": (flex["min"], flex["max"]),
             "output_MB": B * H * 65536 * D * 4 / 2**20}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sections = ["peak", "dense", "window", "window_train", "memory", "bf16"]
    p.add_argument("--only", nargs="*", default=sections, choices=sections)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-flex", action="store_true", help="skip torch FlexAttention (compile takes minutes)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory-runs", type=int, default=3, help="fresh processes per memory case (median reported)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.child:
        _memory_child(a.child[0], int(a.child[1]))
        return
    rows: list[dict] = []
    if "peak" in a.only:
        rows.append({"case": "torch.mm 2048^2 peak", "fp32_GFLOPs": mm_peak(torch.float32),
                     "bf16_GFLOPs": mm_peak(torch.bfloat16)})
    if "dense" in a.only:
        rows += bench_dense(a.repeats)
    if "window" in a.only:
        rows += bench_window(a.repeats, with_flex=not a.no_flex)
    if "window_train" in a.only:
        rows += bench_window_train(a.repeats)
    if "memory" in a.only:
        rows += bench_memory(a.memory_runs)
    if "bf16" in a.only:
        rows += bench_half(a.repeats)
    for row in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
