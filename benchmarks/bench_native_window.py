"""The compiled forward (:mod:`attnzoo.functional.backends.tiled.native`) against the PyTorch paths:
issue 37's "window (256, 0) at N = 65536 at >= 50% of the run's fp32 matmul peak" and "tiled within
1.2x of SDPA" (dense causal N = 4096, 8 heads, D = 64; and with a softcap of 30, which SDPA cannot
do), quiet or beside busy processes.

Builds the kernel first when it is not built for this Python/torch/CPU (``attnzoo native --build``,
about 20 s; into ``$ATTNZOO_NATIVE_DIR``). Rows, timed interleaved (medians): ``torch.mm`` of
2048^2 (the peak), ``auto`` with the kernel turned off (the flat band), the kernel at each
``--blocks`` query-block size, the same call in its ``sgemm`` form where the build has the
register-blocked AVX-512 form (``native_fused.h``), and with ``--gemm-only`` the two ``sgemm`` per
block without the softmax pass (the bound of the ``sgemm`` form). ``--load N`` runs beside N busy one-thread processes
(``bench_cpu_kernels``' loaded column) and adds ``auto`` with flat groups of 2^24 scores (16x fewer
torch operations than the default 2^20). The second table: SDPA ``is_causal``, ``backend="tiled"``
with the kernel off and on, and ``auto`` with ``softcap=30`` off and on, timed interleaved.
``--train`` adds a third: forward + backward (the compiled ``window_bwd``) against the PyTorch
tiled backward and SDPA's, for dense causal N = 4096, softcap 30 and the (256, 0) window at N =
16,384 and 65,536.

Usage::

    python benchmarks/bench_native_window.py [--blocks 32 64 128] [--repeats 7] [--gemm-only] [--load 2] [--train]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from bench_core import cpu_model, timed  # the script's folder is on sys.path
from bench_cpu_kernels import _busy, _with_tiles

import attnzoo as az
from attnzoo.functional.backends.tiled import native
from attnzoo.functional.backends.tiled.plan import DEFAULT_TILES


def _without_native(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        os.environ["ATTNZOO_NATIVE"] = "0"
        try:
            return fn()
        finally:
            del os.environ["ATTNZOO_NATIVE"]
    return run


def _dense_fns(g: torch.Generator) -> dict[str, Callable[[], object]]:
    q, k, v = (torch.randn(1, 8, 4096, 64, generator=g) for _ in range(3))
    tiled = lambda: az.attention(q, k, v, causal=True, backend="tiled")  # noqa: E731
    capped = lambda: az.attention(q, k, v, causal=True, softcap=30.0)  # noqa: E731
    return {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            "tiled, kernel off (PyTorch)": _without_native(tiled), "tiled, compiled kernel": tiled,
            "softcap 30, auto, kernel off (PyTorch tiled)": _without_native(capped),
            "softcap 30, auto, compiled kernel": capped}


def _dense_table(t: dict[str, float]) -> None:
    print("\n| causal N=4096, 8 heads, D=64 | ms | / SDPA is_causal |\n|---|---:|---:|")
    for name, s in t.items():
        print(f"| {name} | {s * 1e3:.1f} | {s / t['sdpa']:.2f}x |")


def _train_fns(g: torch.Generator) -> dict[str, Callable[[], object]]:
    """Forward + backward of each case, kernel on and off, and SDPA's causal training step."""
    fns: dict[str, Callable[[], object]] = {}
    for n, window, cap in ((4096, None, None), (4096, None, 30.0), (16384, (256, 0), None), (65536, (256, 0), None)):
        q, k, v = (torch.randn(1, 8, n, 64, generator=g, requires_grad=True) for _ in range(3))
        d_out = torch.randn(1, 8, n, 64, generator=g)

        def step(q=q, k=k, v=v, d_out=d_out, window=window, cap=cap) -> None:  # type: ignore[no-untyped-def]
            az.attention(q, k, v, causal=True, window=window, softcap=cap, backend="tiled").backward(d_out)

        name = f"N={n}" + (f", window {window}" if window else "") + (f", softcap {cap:g}" if cap else "")
        fns[f"{name}: compiled"] = step
        fns[f"{name}: PyTorch tiled"] = _without_native(step)
        if n == 4096 and cap is None:
            fns[f"{name}: SDPA is_causal"] = lambda q=q, k=k, v=v, d_out=d_out: \
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(d_out)
    return fns


def _sgemm_form(ext: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, b: int) -> object:
    """``window_fwd`` with the register-blocked AVX-512 form switched off for the call."""
    was = ext.set_fused(False)
    try:
        return ext.window_fwd(q, k, v, w, 0, 0.125, 0.0, b, True)
    finally:
        ext.set_fused(was)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[native.BLOCK])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--gemm-only", action="store_true")
    p.add_argument("--load", type=int, default=0, help="busy one-thread processes started for the timing")
    p.add_argument("--train", action="store_true", help="also time forward + backward (the compiled backward)")
    a = p.parse_args()
    os.environ.pop("ATTNZOO_NATIVE", None)
    if native.native_module() is None:
        t0 = time.perf_counter()
        try:
            native.build()
        except native.NativeUnavailable as e:
            raise SystemExit(str(e)) from None
        print(f"built in {time.perf_counter() - t0:.1f} s")
    ext = native.native_module()
    assert ext is not None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_model()} ({platform.machine()}), "
          f"forward form: {'register-blocked AVX-512' if ext.has_fused() else 'sgemm'}")
    n, w = 65536, 256
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    qf, kf, vf = (x.flatten(0, 1) for x in (q, k, v))
    mm = torch.randn(2048, 2048, generator=g)
    auto = lambda: az.attention(q, k, v, causal=True, window=(w, 0))  # noqa: E731
    fns: dict[str, Callable[[], object]] = {"mm": lambda: torch.mm(mm, mm), "auto, kernel off (flat band)":
                                            _without_native(auto)}
    if a.load:
        fns["auto, kernel off, flat groups of 2^24 scores"] = _without_native(
            _with_tiles(replace(DEFAULT_TILES, flat_elems=1 << 24), auto))
    for b in a.blocks:
        fns[f"compiled kernel, B={b}" + (" (auto)" if b == native.BLOCK else "")] = \
            lambda b=b: ext.window_fwd(qf, kf, vf, w, 0, 0.125, 0.0, b, True)
        if ext.has_fused():  # the same call in the sgemm form (what the register-blocked one replaced)
            fns[f"  its sgemm form, B={b}"] = lambda b=b: _sgemm_form(ext, qf, kf, vf, w, b)
        if a.gemm_only:
            fns[f"  its two sgemm only, B={b}"] = lambda b=b: ext.window_fwd(qf, kf, vf, w, 0, 0.125, 0.0, b, False)
    busy = [mp.get_context("spawn").Process(target=_busy, args=(time.time() + 3600,), daemon=True)
            for _ in range(a.load)]
    for proc in busy:
        proc.start()
    try:
        with torch.inference_mode():
            t = timed(fns, a.repeats)
            t2 = timed(_dense_fns(g), a.repeats)
        t3 = timed(_train_fns(g), max(1, a.repeats // 2)) if a.train else {}
    finally:
        for proc in busy:
            proc.terminate()
    flops = 4.0 * 8 * 64 * sum(min(i, w) + 1 for i in range(n))
    peak = 2 * 2048**3 / t["mm"] / 1e9
    print(f"{a.load} busy processes of ours during the timing")
    _dense_table(t2)
    if t3:
        print("\n| forward + backward, 8 heads, D=64 | ms | / PyTorch tiled |\n|---|---:|---:|")
        for name, s in t3.items():
            base = t3[name.rsplit(": ", 1)[0] + ": PyTorch tiled"]
            print(f"| {name} | {s * 1e3:.1f} | {s / base:.2f}x |")
    print(f"| window ({w}, 0) N={n}, 8 heads, D=64 | GFLOP/s (peak: fp32 2048^2 matmul {peak:.0f}) | ms | of peak |")
    print("|---|---:|---:|---:|")
    for name, s in t.items():
        if name != "mm":
            print(f"| {name} | {flops / s / 1e9:.0f} | {s * 1e3:.0f} | {100 * flops / s / 1e9 / peak:.0f}% |")


if __name__ == "__main__":
    main()
