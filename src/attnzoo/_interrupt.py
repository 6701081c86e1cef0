"""The exit code of a command that caught Ctrl-C: 130, as the shell reports ``128 + SIGINT``.

Only the standard library: the package uses it before it imports torch.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

#: the exit status of a command stopped by Ctrl-C (128 + SIGINT), as a shell reports it
INTERRUPTED = 130


def interrupted_exit_code() -> int:
    """``130``, for a command that caught ``KeyboardInterrupt`` and printed its one line.

    CPython 3.11 (seen on 3.11.7; ``run_eval_code_obj`` in ``pythonrun.c``) notes a
    ``KeyboardInterrupt`` that leaves code run from a string (``exec`` or ``eval`` of a ``str``: ``dataclasses`` builds every ``__init__`` that way, so a Ctrl-C landing
    while a module that declares a dataclass imports takes this path) as unhandled, even when an outer
    ``except`` catches it; ``python -m`` then ends by sending itself SIGINT (exit status ``-2``)
    instead of returning the code it was given. Each run of a string starts by clearing that note,
    so one trivial ``eval`` here makes the code returned the code seen.
    """
    eval("None")  # clears the interpreter's unhandled-interrupt note (see above); runs no user input
    return INTERRUPTED


_pending = False


def _remember_and_raise(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def remembered_interrupts() -> Iterator[None]:
    """Ctrl-C inside the block raises ``KeyboardInterrupt`` as usual and is also remembered, so that a
    library which swallows it (torch imports ``torch._dynamo`` lazily in the first optimizer's
    ``add_param_group``, and an interrupt landing in that import was seen lost in CI) cannot make it
    vanish: :func:`raise_if_interrupted` raises it again. Main thread only, and only where SIGINT has
    Python's default handler (a shell's ignored SIGINT stays ignored); the handler is restored after."""
    global _pending
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    _pending = False
    previous = signal.signal(signal.SIGINT, _remember_and_raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _pending = False


def raise_if_interrupted() -> None:
    """``KeyboardInterrupt`` if a Ctrl-C arrived inside :func:`remembered_interrupts` (once raised and
    swallowed by a library); called by the arena's training loop at every step."""
    if _pending:
        raise KeyboardInterrupt
