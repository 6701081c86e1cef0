"""The arena under ``--context-parallel N`` (FSDP2 + context parallelism, attnzoo.arena.parallel):
2 gloo ranks train a recurrent variant with every sequence sharded over both ranks, and the loss
curve and evaluations equal the same arena run in one process (float32 losses: 1e-4 relative)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from attnzoo.arena.runner import add_arena_arguments, run_arena
from dist_spawn import spawn

ARGV = ["--quick", "--variants", "gated_deltanet", "--task", "mqar", "--steps", "3", "--progress", "none"]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arena_arguments(p)
    return p.parse_args(list(argv))


def _arena_job(rank: int, world: int, res: dict[str, Any]) -> None:
    run_arena(_args(*ARGV, "--context-parallel", str(world), "--out", os.environ["ATTNZOO_ARENA_OUT"]))


def test_arena_context_parallel_n_equals_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNZOO_ARENA_OUT", str(tmp_path / "cp"))  # inherited by the spawned ranks
    results = spawn(2, _arena_job, tmp_path, deadline_s=300)
    for r, res in enumerate(results):
        assert "worker_error" not in res, f"rank {r}: {res['worker_error']}"
    run_arena(_args(*ARGV, "--out", str(tmp_path / "one")))
    cp = json.loads((tmp_path / "cp" / "results.json").read_text())["runs"]["mqar"]["gated_deltanet"]
    one = json.loads((tmp_path / "one" / "results.json").read_text())["runs"]["mqar"]["gated_deltanet"]
    assert cp["context_parallel"] == {"layout": "zigzag", "ranks": 2, "fsdp": True, "cp": 2, "dp": 1}
    assert len(cp["train_losses"]) == len(one["train_losses"]) == 3
    for step, (a, b) in enumerate(zip(cp["train_losses"], one["train_losses"], strict=True)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: 2 ranks {a} vs one process {b}"
    for a, b in zip(cp["evals"], one["evals"], strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-4 * abs(b["val_loss"]), (a, b)
