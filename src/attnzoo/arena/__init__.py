"""The arena: train one small decoder per attention variant on real data and compare them.

``attnzoo arena`` (or ``python -m attnzoo.arena``) trains every default variant on character-level
Shakespeare (``lm``) and on multi-query associative recall (``mqar``) with identical settings and
writes a report (``report.md``, ``index.html``, ``results.json``, plots). See ``docs/arena.md``.

Programmatic use::

    from attnzoo.arena import MQARTask, train
    losses = train(model, MQARTask(), steps=100, global_batch=64, seed=0)
"""

from __future__ import annotations

import argparse
import sys

from attnzoo.arena.checkpoint import load_arena_model
from attnzoo.arena.runner import (
    DEFAULT_VARIANTS,
    TASKS,
    add_arena_arguments,
    run_arena,
    settings_for,
)
from attnzoo.arena.tasks import MQARTask, ShakespeareTask, Task, load_shakespeare
from attnzoo.arena.trainer import StepInfo, TrainConfig, lr_at, make_optimizer, train

__all__ = [
    "DEFAULT_VARIANTS",
    "TASKS",
    "MQARTask",
    "ShakespeareTask",
    "StepInfo",
    "Task",
    "TrainConfig",
    "add_arena_arguments",
    "load_arena_model",
    "load_shakespeare",
    "lr_at",
    "main",
    "make_optimizer",
    "run_arena",
    "settings_for",
    "train",
]


def main(argv: list[str] | None = None) -> int:
    """``python -m attnzoo.arena [options]``: parse the arena options and run it."""
    parser = argparse.ArgumentParser(prog="python -m attnzoo.arena", description=__doc__.split("\n\n")[0])
    add_arena_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_arena(args)
    except ValueError as e:
        print(f"attnzoo arena: error: {e}", file=sys.stderr)
        return 2
