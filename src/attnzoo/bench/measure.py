"""Measuring a call: median time, peak memory (any device) and the ``torch.mm`` peak to read them against."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakMemoryTracker", "matmul_peak_gflops", "measure_peak_memory", "time_call", "time_eager_and_compiled"]


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


def time_eager_and_compiled(eager: Callable[[], Any], compiled: Callable[[], Any], repeats: int = 5,
                            warmup: int = 1, device: torch.device | str = "cpu",
                            ) -> tuple[float, list[float], list[float]]:
    """``(compile_s, eager_times, compiled_times)``: the first call of ``compiled`` (which
    compiles) is timed as the compile time; after ``warmup`` untimed calls of each, ``repeats``
    eager and compiled calls alternate, so both see the same machine load."""
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    compiled()
    sync()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        eager()
        compiled()
    eager_times: list[float] = []
    compiled_times: list[float] = []
    for _ in range(repeats):
        for fn, times in ((eager, eager_times), (compiled, compiled_times)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
    return compile_s, eager_times, compiled_times


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
