"""Progress bars for training runs: tqdm or rich when installed (``pip install attnzoo[cli]``),
plain log lines otherwise, or nothing."""

from __future__ import annotations

import sys
import time
from typing import Any

from attnzoo.arena.trainer import StepInfo

__all__ = ["PROGRESS_KINDS", "Progress", "make_progress"]

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
        self.extra = ""

    def update(self, info: StepInfo) -> None:
        self.bar.set_postfix_str(f"loss {info.loss:.3f} | {info.tokens_per_s:,.0f} tok/s{self.extra}",
                                 refresh=False)
        self.bar.update(1)

    def note(self, text: str) -> None:
        self.extra = f" | {text}"

    def __exit__(self, *exc: object) -> None:
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
        self.extra = ""
        self.bar.start()

    def update(self, info: StepInfo) -> None:
        self.bar.update(self.task, advance=1,
                        stats=f"loss {info.loss:.3f} | {info.tokens_per_s:,.0f} tok/s{self.extra}")

    def note(self, text: str) -> None:
        self.extra = f" | {text}"

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
