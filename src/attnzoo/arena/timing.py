"""The arena's measurement pass: every variant's speed timed in one interleaved loop.

Speeds measured while each model trains are taken at different times, so a burst of load from
another program lands on some variants and not on others. This pass runs after training: for
``repeats`` rounds it times, for every variant in turn, one training step, one prefill of
``seq_len`` tokens and single-token decode steps at several cache lengths; each number is the
median over the rounds, so load spread over the pass hits every variant alike.

Load is recorded next to the numbers: the process's CPU time over wall time during each timing
(a process that is descheduled gets less CPU than wall time) and ``/proc/loadavg`` before and
after. :func:`machine_busy` turns them into a verdict the report prints beside the speeds.
Weights do not change speed, so the pass times freshly built models (``build(variant)``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from attnzoo.arena.tasks import IGNORE, Task
from attnzoo.arena.trainer import TrainConfig, make_optimizer

__all__ = ["loadavg", "machine_busy", "measure_pass"]

#: CPU/wall below this (one thread) means the process waited for a core.
BUSY_CPU_RATIO = 0.85
#: Median spread ``(max - min) / median`` of the training step's rounds above this: unsteady timings
#: (a median of 29% over the 8 default variants, single timings up to 121%, in a run on a shared
#: 2-vCPU machine whose load average and CPU time looked quiet).
BUSY_SPREAD = 0.2
#: Median over variants of each variant's largest spread of any timing (train step, prefill, decode
#: at each length) above this: rounds that disagree by more than half their median say nothing
#: about a variant (a pass reported "quiet" with per-variant spreads of 60-266%).
BUSY_ANY_SPREAD = 0.5
#: A load average above ``cores + BUSY_LOAD_MARGIN``: more runnable threads than cores, someone waits.
BUSY_LOAD_MARGIN = 0.25


def loadavg() -> float | None:
    """The 1-minute load average (``/proc/loadavg``, ``os.getloadavg``), None where unavailable."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


class _Clock:
    """Wall and process CPU time of the timed sections (``os.times`` counts every thread)."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def time(self, fn: Callable[[], Any]) -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        self.wall += dt
        self.cpu += time.process_time() - c0
        return dt


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    logits = model(x)  # [B, N, V]
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class _Subject:
    """One variant's model with everything its timings need, prepared before the clock runs."""

    def __init__(self, model: nn.Module, task: Task, batch: int, seed: int, cache_lengths: Sequence[int],
                 decode_steps: int, device: torch.device) -> None:
        self.model = model
        self.opt = make_optimizer(model, TrainConfig())
        x, y = task.batch(0, batch, seed)
        self.x, self.y = x.to(device), y.to(device)  # [B, N]
        self.prompt = self.x[:1]  # [1, N]
        self.cache_lengths, self.decode_steps = list(cache_lengths), decode_steps
        g = torch.Generator().manual_seed(seed)
        vocab = int(task.vocab_size)
        self.context = torch.randint(0, vocab, (1, max(self.cache_lengths, default=1)), generator=g).to(device)

    @torch.no_grad()
    def prefill(self) -> None:
        cache = self.model.init_cache(1, self.prompt.shape[1])  # type: ignore[operator]
        self.model(self.prompt, cache=cache)

    @torch.no_grad()
    def decode_at(self, length: int, clock: _Clock) -> float:
        """Seconds per decode step with ``length`` tokens already in the cache (prefill untimed)."""
        cache = self.model.init_cache(1, length + self.decode_steps)  # type: ignore[operator]
        self.model(self.context[:, :length], cache=cache)
        token = self.context[:, -1:]  # [1, 1]

        def steps() -> None:
            for _ in range(self.decode_steps):
                self.model(token, cache=cache)

        return clock.time(steps) / self.decode_steps


def _round(name: str, sub: _Subject, clock: _Clock, out: dict[str, dict[str, list[float]]]) -> None:
    """One round of every timing of one variant (errors recorded, not raised)."""
    rec = out.setdefault(name, {})
    sub.model.train()
    rec.setdefault("train_step_s", []).append(clock.time(lambda: _train_step(sub.model, sub.opt, sub.x, sub.y)))
    sub.model.eval()
    rec.setdefault("prefill_s", []).append(clock.time(sub.prefill))
    for length in sub.cache_lengths:
        rec.setdefault(f"decode_s@{length}", []).append(sub.decode_at(length, clock))


def _summary(times: dict[str, list[float]], batch: int, seq_len: int) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {"median_s": med, "repeats": {k: len(v) for k, v in times.items()},
                           "spread": {k: (max(v) - min(v)) / max(statistics.median(v), 1e-12)
                                      for k, v in times.items()}}
    out["train_tokens_per_s"] = batch * seq_len / med["train_step_s"]
    out["prefill_tokens_per_s"] = seq_len / med["prefill_s"]
    out["decode_tokens_per_s"] = {int(k.split("@")[1]): 1.0 / v for k, v in med.items() if k.startswith("decode_s@")}
    return out


def measure_pass(build: Callable[[str], nn.Module], variants: Sequence[str], task: Task, batch: int, seed: int,
                 device: torch.device, *, repeats: int = 5, cache_lengths: Sequence[int] = (128, 512, 2048),
                 decode_steps: int = 8, warmup: int = 1) -> dict[str, Any]:
    """Time every variant in one interleaved loop; returns the ``measurements`` entry of the results.

    Args:
        build: ``build(variant) -> model`` (a :class:`~attnzoo.models.DecoderLM` whose positions
            reach ``max(cache_lengths) + decode_steps`` tokens).
        variants: registry names to time, in order.
        task: gives the training batch ``[batch, N]`` and the prefill prompt (its first row).
        repeats: rounds; every number is the median over them.
        cache_lengths: cache sizes at which one decode step is timed.
        warmup: untimed rounds first (allocator, kernel choice).

    Returns:
        ``{"variants": {name: {...}}, "errors": {name: message}, "cpu_wall_ratio", "loadavg_before",
        "loadavg_after", "threads", "cpu_count", "repeats", "cache_lengths", "wall_s", "busy", "why"}``.
    """
    load0, t0 = loadavg(), time.perf_counter()
    subjects: dict[str, _Subject] = {}
    errors: dict[str, str] = {}
    for v in variants:
        try:
            subjects[v] = _Subject(build(v), task, batch, seed, cache_lengths, decode_steps, device)
        except Exception as e:  # a variant that cannot be timed must not sink the pass
            errors[v] = f"{type(e).__name__}: {e}"
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(warmup + repeats):
        clock = _Clock()
        for v in list(subjects):
            try:
                _round(v, subjects[v], clock, times if r >= warmup else {})
            except Exception as e:
                errors[v] = f"{type(e).__name__}: {e}"
                subjects.pop(v)
                times.pop(v, None)
        if r >= warmup:
            times.setdefault("_clock", {}).setdefault("wall", []).append(clock.wall)
            times["_clock"].setdefault("cpu", []).append(clock.cpu)
    clocks = times.pop("_clock", {"wall": [0.0], "cpu": [0.0]})
    result: dict[str, Any] = {
        "variants": {v: _summary(times[v], batch, task.seq_len) for v in subjects if v in times},
        "errors": errors, "repeats": repeats, "cache_lengths": list(cache_lengths),
        "cpu_wall_ratio": sum(clocks["cpu"]) / max(sum(clocks["wall"]), 1e-12),
        "loadavg_before": load0, "loadavg_after": loadavg(), "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count() or 1, "wall_s": time.perf_counter() - t0,
    }
    result["busy"], result["why"] = machine_busy(result)
    return result


def machine_busy(m: dict[str, Any]) -> tuple[bool, str]:
    """Was the machine busy during a measurement pass ``m``? ``(busy, reason)``.

    Busy when the process got clearly less CPU than wall time while it ran one thread (it waited
    for a core), when the load average exceeds the cores (by :data:`BUSY_LOAD_MARGIN`: more
    runnable threads than cores, this process's included), or when the rounds disagree: the median
    over variants of a training step's spread ``(max - min) / median`` above :data:`BUSY_SPREAD`,
    or the median over variants of each one's widest spread of any timing above
    :data:`BUSY_ANY_SPREAD`. On a shared virtual machine the last
    is often the only sign (a neighbour takes cycles that neither the load average nor this
    process's CPU time shows), and it bounds what a difference between two variants can mean.
    """
    reasons = []
    runs = [r["spread"] for r in m.get("variants", {}).values() if r.get("spread")]
    spreads = [sp["train_step_s"] for sp in runs if "train_step_s" in sp]
    spread = statistics.median(spreads) if spreads else 0.0
    if spread > BUSY_SPREAD:
        reasons.append(f"the same training step's time varied by a median of {spread:.0%} between rounds")
    widest = [max(sp.values()) for sp in runs]
    if widest and statistics.median(widest) > BUSY_ANY_SPREAD:
        reasons.append(f"a variant's timings varied by up to {max(widest):.0%} between rounds (median over "
                       f"variants of the widest: {statistics.median(widest):.0%})")
    ratio, threads, cores = m.get("cpu_wall_ratio"), int(m.get("threads") or 1), int(m.get("cpu_count") or 1)
    if ratio is not None and threads == 1 and ratio < BUSY_CPU_RATIO:
        reasons.append(f"the process got {ratio:.0%} of its wall time on a CPU")
    loads = [x for x in (m.get("loadavg_before"), m.get("loadavg_after")) if x is not None]
    if loads and max(loads) > cores + BUSY_LOAD_MARGIN:
        reasons.append(f"the load average was {max(loads):.1f} on {cores} cores")
    return bool(reasons), "; ".join(reasons)
