"""Spawning gloo process groups for the multi-process tests (not a test module).

``spawn(world, job, outdir)`` starts ``world`` processes (``torch.multiprocessing``, spawn, a free
port on 127.0.0.1, a gloo timeout) that each run ``job(rank, world, res)`` and save ``res``; past
a hard deadline the processes are killed and the calling test fails instead of hanging.
``job`` must be a module-level function of an importable module (the test module)."""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

GLOO_TIMEOUT_S = 30  # any collective stuck longer than this raises in the worker
JOB_DEADLINE_S = 150  # the whole spawned job


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def rel_grad(g: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """``max |g - want|`` relative to ``want``'s own size, floored at sqrt(eps) of ``scale`` (the
    model's largest gradient): a gradient that is zero in exact arithmetic (a key bias under a
    shift-invariant softmax) is rounding noise whose size depends on the summation order."""
    floor = torch.finfo(want.dtype).eps ** 0.5 * scale
    return float((g.detach().double() - want.detach().double()).abs().max()) / max(float(want.abs().max()), floor)


def save(rank: int, res: dict[str, Any]) -> None:
    """Write this rank's results now (for a worker about to die on purpose)."""
    torch.save(res, os.path.join(os.environ["ATTNZOO_TEST_OUTDIR"], f"rank{rank}.pt"))


def _entry(rank: int, world: int, port: int, job: Callable[[int, int, dict[str, Any]], None], outdir: str) -> None:
    os.environ["ATTNZOO_TEST_OUTDIR"] = outdir
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    res: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        job(rank, world, res)
    except Exception as e:  # recorded, the test reports it
        res["worker_error"] = f"{type(e).__name__}: {e}"
    finally:
        res["time/job"] = time.perf_counter() - t0
        save(rank, res)
    os._exit(0)  # some checks break the group on purpose: leave without teardown


def spawn(world: int, job: Callable[[int, int, dict[str, Any]], None], outdir: Path,
          deadline_s: float = JOB_DEADLINE_S) -> list[dict[str, Any]]:
    """Every rank's ``res`` dict (``{}`` for a rank that saved nothing)."""
    ctx = mp.start_processes(_entry, args=(world, free_port(), job, str(outdir)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world}-rank job {job.__name__!r} still running after {deadline_s}s (a hang)")
    out = []
    for r in range(world):
        f = outdir / f"rank{r}.pt"
        out.append(torch.load(f) if f.exists() else {})
    return out


def ranks_fixture(world: int, job: Callable[[int, int, dict[str, Any]], None], name: str) -> Any:
    """A module-scoped fixture that spawns ``world`` ranks running ``job`` once per test module."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        return spawn(world, job, tmp_path_factory.mktemp(name))

    return fixture


class CountingTask:
    """An arena task for trainer tests: sequences counting up modulo the vocabulary from a random
    start, each token replaced by a random one with probability ``noise`` (a pure function of the step)."""

    name = "count"

    def __init__(self, vocab_size: int, seq_len: int, noise: float = 0.0, salt: int = 100_003) -> None:
        self.vocab_size, self.seq_len, self.noise, self.salt = vocab_size, seq_len, noise, salt

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * self.salt + step)
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=g)
        seq = (start + torch.arange(self.seq_len + 1)) % self.vocab_size  # [B, N + 1]
        if self.noise:
            flip = torch.rand(seq.shape, generator=g) < self.noise
            seq = torch.where(flip, torch.randint(0, self.vocab_size, seq.shape, generator=g), seq)
        return seq[:, :-1], seq[:, 1:]

    def evaluate(self, model: nn.Module, device: torch.device, seed: int) -> dict[str, float]:
        """``val_loss`` (nats) on one held-out batch (steps below 0 are never trained on)."""
        x, y = self.batch(-1, 8, seed)
        with torch.no_grad():
            logits = model(x.to(device))  # [B, N, V]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
        return {"val_loss": float(loss)}
