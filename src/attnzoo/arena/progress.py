"""Progress bars for training runs: tqdm or rich when installed (``pip install attnzoo[cli]``),
plain log lines otherwise, or nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from attnzoo.arena.trainer import StepInfo

__all__ = ["PROGRESS_KINDS", "Overall", "Progress", "format_duration", "make_progress"]

PROGRESS_KINDS = ("auto", "tqdm", "rich", "plain", "none")


class Progress:
    """A progress display for one training run; use as a context manager, call :meth:`update`."""

    def __init__(self, label: str, total: int, initial: int = 0) -> None:
        self.label, self.total, self.initial = label, total, initial

    def update(self, info: StepInfo) -> None:  # pragma: no cover - overridden
        pass

    def note(self, text: str) -> None:
        """A one-off message (evaluation result, checkpoint)."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Plain(Progress):
    def __init__(self, label: str, total: int, initial: int = 0) -> None:
        super().__init__(label, total, initial)
        self.every = max(1, total // 10)
        self.last = time.perf_counter()

    def update(self, info: StepInfo) -> None:
        if info.step % self.every == 0 or info.step == info.steps:
            print(f"[{self.label}] step {info.step}/{info.steps} loss {info.loss:.4f} "
                  f"lr {info.lr:.2e} {info.tokens_per_s:,.0f} tok/s", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        print(f"[{self.label}] {text}", file=sys.stderr, flush=True)


class _Tqdm(Progress):
    def __init__(self, label: str, total: int, initial: int = 0) -> None:
        super().__init__(label, total, initial)
        from tqdm.auto import tqdm

        self.bar: Any = tqdm(total=total, initial=initial, desc=label, unit="step", dynamic_ncols=True,
                             leave=True)
        self.extra, self.stats = "", ""

    def update(self, info: StepInfo) -> None:
        self.stats = f"loss {info.loss:.3f} | {info.tokens_per_s:,.0f} tok/s"
        self.bar.set_postfix_str(self.stats + self.extra, refresh=False)
        self.bar.update(1)

    def note(self, text: str) -> None:
        self.extra = f" | {text}"
        self.bar.set_postfix_str(self.stats + self.extra, refresh=False)

    def __exit__(self, *exc: object) -> None:
        self.bar.refresh()  # the last step's loss and the final evaluation, not the last redraw's
        self.bar.close()


class _Rich(Progress):
    def __init__(self, label: str, total: int, initial: int = 0) -> None:
        super().__init__(label, total, initial)
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar: Any = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), transient=False)
        self.task = self.bar.add_task(label, total=total, completed=initial, stats="")
        self.extra, self.stats = "", ""
        self.bar.start()

    def update(self, info: StepInfo) -> None:
        self.stats = f"loss {info.loss:.3f} | {info.tokens_per_s:,.0f} tok/s"
        self.bar.update(self.task, advance=1, stats=self.stats + self.extra)

    def note(self, text: str) -> None:
        self.extra = f" | {text}"
        self.bar.update(self.task, stats=self.stats + self.extra)

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def make_progress(kind: str, label: str, total: int, initial: int = 0) -> Progress:
    """A progress display: ``auto`` picks tqdm, then rich, then plain lines."""
    if kind not in PROGRESS_KINDS:
        raise ValueError(f"progress must be one of {PROGRESS_KINDS}, got {kind!r}")
    if kind == "none":
        return Progress(label, total, initial)
    if kind == "plain":
        return _Plain(label, total, initial)
    if kind in ("auto", "tqdm"):
        try:
            return _Tqdm(label, total, initial)
        except ImportError:
            if kind == "tqdm":
                raise ImportError("progress='tqdm' needs tqdm: pip install 'attnzoo[cli]'") from None
    try:
        return _Rich(label, total, initial)
    except ImportError:
        if kind == "rich":
            raise ImportError("progress='rich' needs rich: pip install 'attnzoo[cli]'") from None
    return _Plain(label, total, initial)


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``"1:15"``, ``3725`` -> ``"1:02:05"``."""
    total = max(0, round(seconds))
    h, rest = divmod(total, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Overall:
    """The arena's overall progress: one line per run start, ``run i/N``, elapsed time and ETA.

    ``weights`` are the relative costs of the runs (e.g. tokens trained); the ETA scales the time
    spent so far by the weight still to do. Runs reused with ``--resume`` count as done at once.
    """

    def __init__(self, weights: list[float], enabled: bool = True, stream: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not weights or any(w < 0 for w in weights):
            raise ValueError(f"Overall: weights must be a non-empty list of numbers >= 0, got {weights!r}")
        self.weights, self.enabled = list(weights), enabled
        self.stream, self.clock = stream, clock
        self.t0 = clock()
        self.done = 0  # runs finished
        self.done_weight = 0.0
        self.timed_weight = 0.0  # weight of the runs that were trained here (not reused)
        self.timed_s = 0.0

    @property
    def total(self) -> int:
        return len(self.weights)

    def eta(self) -> float | None:
        """Seconds left, from the time per unit weight of the runs trained so far (None: no data)."""
        if self.timed_weight <= 0:
            return None
        left = sum(self.weights[self.done:])
        return self.timed_s / self.timed_weight * left

    def start(self, name: str) -> str:
        """Announce run ``done + 1``; returns its ``"i/N"`` label."""
        label = f"{self.done + 1}/{self.total}"
        eta = self.eta()
        line = (f"arena: run {self.done + 1}/{self.total} {name} | elapsed "
                f"{format_duration(self.clock() - self.t0)} | ETA "
                f"{'estimating' if eta is None else format_duration(eta)}")
        if self.enabled:
            print(line, file=self.stream or sys.stderr, flush=True)
        self._run_t0 = self.clock()
        return label

    def completed(self, name: str, weight: float, trained: bool = True) -> None:
        """A run of ``weight`` finished, in any order (parallel workers): one line ``done i/N``; the ETA
        scales the elapsed wall time by the weight still to do (``trained=False``: reused with
        ``--resume``, so its weight says nothing of the rate)."""
        self.done += 1
        self.done_weight += weight
        if trained:
            self.timed_weight += weight
        elapsed = self.clock() - self.t0
        left = max(0.0, sum(self.weights) - self.done_weight)
        eta = elapsed / self.timed_weight * left if self.timed_weight else None
        if self.enabled:
            print(f"arena: done {self.done}/{self.total} {name} | elapsed {format_duration(elapsed)} | ETA "
                  f"{'estimating' if eta is None else format_duration(eta)}", file=self.stream or sys.stderr,
                  flush=True)

    def finish(self, trained: bool) -> None:
        """The current run is done (``trained=False``: reused, so its time says nothing)."""
        w = self.weights[self.done]
        if trained:
            self.timed_weight += w
            self.timed_s += self.clock() - self._run_t0
        self.done_weight += w
        self.done += 1
