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

Layout: :mod:`attnzoo.bench.measure` (timing, peak memory, ``torch.mm`` peak),
:mod:`attnzoo.bench.run` (targets, the size guard, :func:`run_bench`, the report) and
:mod:`attnzoo.bench.plot` (the PNG).
"""

from __future__ import annotations

from attnzoo.bench.measure import (
    PeakMemoryTracker,
    matmul_peak_gflops,
    measure_peak_memory,
    time_call,
)
from attnzoo.bench.plot import format_value, plot_bench
from attnzoo.bench.run import (
    BACKEND_TARGETS,
    BenchReport,
    BenchResult,
    estimate_case_bytes,
    run_bench,
)

__all__ = [
    "BACKEND_TARGETS",
    "BenchReport",
    "BenchResult",
    "PeakMemoryTracker",
    "estimate_case_bytes",
    "format_value",
    "matmul_peak_gflops",
    "measure_peak_memory",
    "plot_bench",
    "run_bench",
    "time_call",
]
