"""Training runs in worker processes: one policy for ``attnzoo arena`` and its ``mqar-grid``.

On a CPU, runs can train in spawned processes (``--jobs J``), each with ``--threads T`` torch
threads (default ``cores // J``). Whether that beats one process using every core depends on the
model's size, so the default is measured per command (2 cores of an AMD EPYC, 2026-12-02):
the grid's cells (width 32-64, 64 tokens) trained 1.3-1.9x faster as two one-thread processes than
one after the other on two threads, so the grid uses one worker per core; the default arena's
runs (width 128 x 128 tokens, width 64 x 128 sequences) gained nothing (9:35 against 9:09 for the
whole arena), so it trains one run at a time unless ``--jobs`` says otherwise. On other devices,
and under ``torchrun``, one run at a time. Every run is seeded by its own settings, so its numbers
do not depend on which worker trains it, or when; they may depend on the threads per run (a
float sum's order), which results record.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from typing import Any

import torch

__all__ = ["Workers", "worker_plan"]


def worker_plan(args: argparse.Namespace, runs: int, parallel_by_default: bool = True) -> tuple[int, int | None]:
    """``(worker processes, torch threads per run)`` for ``runs`` independent runs.

    Reads ``args.jobs`` (None: one per core when ``parallel_by_default``, else 1), ``args.threads``
    (None: ``cores // jobs`` with several workers; torch's choice with one) and ``args.device``.
    """
    jobs, threads = getattr(args, "jobs", None), args.threads
    if torch.device(args.device).type != "cpu":
        return 1, threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if jobs is None:
        jobs = max(1, cores // (threads or 1)) if parallel_by_default else 1
    jobs = max(1, min(jobs, runs))
    return jobs, (max(1, cores // jobs) if threads is None and jobs > 1 else threads)


class Workers:
    """``jobs`` spawned worker processes with ``threads`` torch threads each, for a ``with`` block.

    :meth:`completed` runs a batch of calls on them; a block may run several batches (the arena's
    extra seeds wait for the first batch's ranking) without paying the processes' start again.
    """

    def __init__(self, jobs: int, threads: int | None) -> None:
        self.jobs, self.threads = jobs, threads
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Workers:
        ctx = multiprocessing.get_context("spawn")  # fork after torch's thread pools start is unsafe
        init, init_args = (torch.set_num_threads, (self.threads,)) if self.threads else (None, ())
        self._pool = ProcessPoolExecutor(self.jobs, mp_context=ctx, initializer=init, initargs=init_args)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._pool is not None:
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                # Ctrl-C: the workers ignore it (see completed); stop them now, not after their runs
                for proc in list(getattr(self._pool, "_processes", {}).values()):
                    proc.terminate()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def completed(self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]]
                  ) -> Iterator[tuple[int, Any, BaseException | None]]:
        """Run ``fn(*call)`` for every call; yields ``(index of the call, result, None)`` or ``(index,
        None, exception)`` as each one finishes, in any order. ``fn`` and the arguments must be
        picklable (module-level functions). Closing the iterator early (an exception in the
        caller) cancels the calls that have not started."""
        if self._pool is None:
            raise RuntimeError("Workers.completed: use the Workers inside a `with` block")
        with _sigint_ignored():  # the pool spawns its processes inside submit: they inherit SIG_IGN
            futures: dict[Future[Any], int] = {self._pool.submit(fn, *call): i for i, call in enumerate(calls)}
        try:
            for fut in as_completed(futures):
                exc = fut.exception()
                yield futures[fut], (None if exc is not None else fut.result()), exc
        finally:
            for fut in futures:
                fut.cancel()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored for the block (main thread only; elsewhere a no-op). A process spawned inside it
    keeps ignoring Ctrl-C from its first instruction (an ignored signal survives ``exec`` and Python
    keeps it ignored), so a worker never prints a ``KeyboardInterrupt`` traceback, even while it
    imports torch: the parent alone reports the interrupt (one line) and stops the workers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
