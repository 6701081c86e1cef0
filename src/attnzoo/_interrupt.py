"""The exit code of a command that caught Ctrl-C: 130, as the shell reports ``128 + SIGINT``.

Only the standard library: the package uses it before it imports torch.
"""

from __future__ import annotations

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
