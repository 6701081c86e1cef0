"""In which dtype half-precision inputs are multiplied: measured, not inferred from CPU flags.

A CPU's flags say whether it *has* half-precision instructions, not whether torch's half matmuls
beat its float32 ones at attention's tile shapes: on an Intel Xeon with AMX, bf16 tile matmuls
ran ~2-4x faster than float32 and float16 ones about as fast (one thread); on the Xeon of issue 14
(AVX-512 BF16/FP16) bf16 SDPA ran 1.5x *slower* than float32 SDPA; on AVX2-only CPUs bf16
matmuls are hundreds of times slower; on an AMD EPYC (Zen 4, AVX-512 BF16 but no FP16) bf16
matmuls ran 2.3x faster than float32 and float16 ones ~200x slower. So the first half-precision call on a CPU times one
tile-shaped batched matmul in float32 and in the half dtype (one thread, interleaved, best of
several), runs through float32 math only if the half matmul is at least 1.25x slower, and caches
the answer per process, dtype and kernel. The SDPA backend times causal SDPA itself instead (native
vs through float32): on an AVX2-only EPYC bf16 matmuls were 17x slower than float32 but bf16 SDPA
1.1x faster than SDPA through float32, because torch's CPU SDPA accumulates half inputs in float32.
CUDA always multiplies natively.

Override (tests, reproducible benchmarks): the environment variable ``ATTNZOO_HALF_MATH`` =
``native`` | ``float32`` | ``measure`` (default), or :func:`set_half_math`, which wins over it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnzoo._devices import tracing

__all__ = ["HALF_DTYPES", "MAX_SLOWDOWN", "calibrate", "half_math", "half_math_mode", "set_half_math"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
_MODES = ("native", "float32", "measure")
_override: str | None = None
_measured: dict[tuple[torch.dtype, str], bool] = {}

#: Per calibrated kernel, how much slower the half call may be before half inputs run through
#: float32 math. ``"matmul"`` (the tiled kernels): 1.25x, since converting costs a pass each way and
#: kernels gain from half precision beyond the matmul (fp16 SDPA beat SDPA via float32 by 1.2x on a
#: Xeon where the fp16 matmul timed 0.9x of fp32); clear cases stay clear: bf16 was 1.66x slower than
#: fp32 on the Xeon of issue 14, ~500x on AVX2-only CPUs, and 2.7x *faster* with AMX. ``"sdpa"``
#: (the SDPA backend): 1.0x, since its timing already includes both conversions.
MAX_SLOWDOWN = {"matmul": 1.25, "sdpa": 1.0}


def set_half_math(mode: str | None) -> None:
    """Force ``"native"`` or ``"float32"`` math for half inputs on CPU, or ``"measure"``
    (``None``: back to the environment variable / measuring)."""
    global _override
    if mode is not None and mode not in _MODES:
        raise ValueError(f"half math mode must be one of {_MODES} or None, got {mode!r}")
    _override = mode


def half_math_mode() -> str:
    """The mode in force: :func:`set_half_math`'s, else ``ATTNZOO_HALF_MATH``'s, else ``"measure"``."""
    if _override is not None:
        return _override
    env = os.environ.get("ATTNZOO_HALF_MATH", "measure").strip().lower() or "measure"
    if env not in _MODES:
        raise ValueError(f"ATTNZOO_HALF_MATH must be one of {_MODES}, got {env!r}")
    return env


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _check_kernel(kernel: str, fn: str) -> None:
    if kernel not in MAX_SLOWDOWN:
        raise ValueError(f"{fn}: kernel must be one of {list(MAX_SLOWDOWN)}, got {kernel!r}")


def _calls(dtype: torch.dtype, size: int, depth: int, kernel: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """``(float32 call, half call)`` of the calibrated kernel: a ``[4, size, depth] x [4, depth, size]``
    batched matmul (``"matmul"``), or causal SDPA on ``[1, 4, size, depth]`` natively in ``dtype``
    against SDPA through float32 with the conversions in and out included (``"sdpa"``)."""
    g = torch.Generator().manual_seed(0)
    if kernel == "matmul":
        a32, b32 = torch.randn(4, size, depth, generator=g), torch.randn(4, depth, size, generator=g)
        ah, bh = a32.to(dtype), b32.to(dtype)
        return (lambda: torch.bmm(a32, b32)), (lambda: torch.bmm(ah, bh))
    _check_kernel(kernel, "calibrate")
    qh, kh, vh = (torch.randn(1, 4, size, depth, generator=g).to(dtype) for _ in range(3))

    def via32() -> object:
        return F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), is_causal=True).to(dtype)

    return via32, (lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))


def calibrate(dtype: torch.dtype, repeats: int = 7, size: int = 256, depth: int = 64,
              kernel: str = "matmul") -> tuple[float, float]:
    """Seconds of one call of ``kernel`` (see :func:`_calls`) through float32 and in ``dtype`` on one
    CPU thread (best of ``repeats``, calls interleaved so load hits both alike).

    One thread: the kernels' relative speed is a property of the core (AMX, AVX-512 FMA, ...),
    while multi-threaded timings of such short calls on a loaded machine are dominated by thread
    wake-ups (a 2-thread run on a machine at load 15 timed 24 ms vs 32 ms for a 0.1 ms call)."""
    f32, fh = _calls(dtype, size, depth, kernel)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        f32(), fh()  # warm-up (first calls initialise kernels)
        t32 = th = float("inf")
        for _ in range(repeats):
            t32 = min(t32, _timed(f32))
            th = min(th, _timed(fh))
    finally:
        torch.set_num_threads(threads)
    return t32, th


def half_math(dtype: torch.dtype, device: torch.device | str, kernel: str = "matmul") -> torch.dtype:
    """The dtype in which attention computes ``dtype`` inputs on ``device``: ``dtype`` itself or
    ``torch.float32``. Non-half dtypes are returned unchanged.

    ``kernel="matmul"`` (tiled kernels: half tiles when the half matmul is at most 1.25x slower) or
    ``"sdpa"`` (the SDPA backend: native when SDPA in ``dtype`` is at least as fast as SDPA through
    float32, conversions included; torch's CPU SDPA kernel accumulates half inputs in float32, so
    its speed is not the matmul's: on an AVX2 EPYC bf16 matmuls timed 17x slower than float32 but
    bf16 SDPA 1.1x faster than SDPA via float32).
    """
    _check_kernel(kernel, "half_math")
    if dtype not in HALF_DTYPES or torch.device(device).type != "cpu":
        return dtype
    mode = half_math_mode()
    if mode != "measure":
        return dtype if mode == "native" else torch.float32
    fast = _measured.get((dtype, kernel))
    if fast is None:
        if tracing():  # no timing inside a traced graph: float32 is always right
            return torch.float32
        t32, th = calibrate(dtype, kernel=kernel)
        fast = _measured[(dtype, kernel)] = th <= t32 * MAX_SLOWDOWN[kernel]
    return dtype if fast else torch.float32
