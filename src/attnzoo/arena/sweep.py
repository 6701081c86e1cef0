"""Training runs of the paper presets: one (variant, width, learning rate) run, early stopping at
the paper's threshold, the best-of-learning-rates reduction, and the preset's driver.

A run trains the Zoology model (:func:`preset_model`: a :class:`~attnzoo.models.DecoderLM` with
no MLP, tied embeddings, one head) with AdamW (weight decay 0.1) and a cosine schedule over the
epochs as ``zoology/train.py`` does, evaluates after every epoch and stops once the held-out
accuracy exceeds the threshold (0.99). Every run is a pure function of its :class:`RunSpec` and
the torch thread count, so runs train in any order in worker processes (``--jobs``) and a
finished run's record (``DIR/runs/<key>.json``) is reused by ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnzoo._outputs import ensure_output_dir
from attnzoo.arena.measure import state_bytes
from attnzoo.arena.paper_report import write_preset_report
from attnzoo.arena.presets import PRESETS, MQARCell, PaperMQAR, Preset, budget, scored_logits
from attnzoo.arena.progress import Overall
from attnzoo.arena.storage import write_atomic
from attnzoo.arena.trainer import gpt2_init
from attnzoo.arena.workers import Workers, worker_plan
from attnzoo.models import DecoderConfig, DecoderLM
from attnzoo.models.parts import DecoderParts
from attnzoo.variants import VARIANTS, layer_pattern

__all__ = [
    "RunSpec",
    "add_preset_arguments",
    "best_of",
    "cosine_epoch_lr",
    "partial_report",
    "point_cost",
    "preset_model",
    "preset_runs",
    "run_point",
    "run_preset",
    "sweep_points",
    "train_run",
]


@dataclass(frozen=True)
class RunSpec:
    """One training run of a preset: the variant (a registry name or a ``/`` layer pattern), the
    width, the training segment (``"64/4"``; ``"mixture"`` for Based), the learning rate, the window
    of windowed variants (None: a quarter of the training length), the seed."""

    preset: str
    size: str
    variant: str
    width: int
    train: str
    lr: float
    window: int | None = None
    seed: int = 0

    @property
    def key(self) -> str:
        """A file-name-safe id: ``mha-w64-64x4-lr2.2e-03``."""
        win = "" if self.window is None else f"-win{self.window}"
        return f"{self.variant.replace('/', '+')}-w{self.width}{win}-{self.train.replace('/', 'x')}-lr{self.lr:.1e}"

    @property
    def point(self) -> tuple[str, int, str, int | None]:
        """What the learning-rate sweep reduces over: everything but the learning rate."""
        return self.variant, self.width, self.train, self.window


def preset_model(variant: str, width: int, depth: int, heads: int, vocab: int, max_len: int, seed: int,
                 window: int | None = None) -> nn.Module:
    """The papers' MQAR model with ``variant`` as its sequence mixer: ``DecoderLM`` with no head
    (``DecoderParts(head=nn.Identity())``: it returns hidden states ``[B, N, C]``; :func:`~attnzoo.arena.presets.scored_logits` applies the
    tied head), learned positions, pre-norm LayerNorm blocks whose MLP is the identity (Zoology's
    ``state_mixer=Identity``: each block adds ``LayerNorm(x)`` where the MLP would add ``MLP(LN(x))``),
    normal(0, 0.02) initialisation. A ``/`` pattern builds a hybrid stack (one name per layer)."""
    layers = layer_pattern(variant, depth)
    names = sorted(set(layers))
    akw: dict[str, Any] = {}
    if len(names) == 1:
        akw = VARIANTS[names[0]].arena_settings(width, heads, window or max(1, max_len // 4))
    attention: Any = layers[0] if len(names) == 1 else list(layers)
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab, width, depth, heads, attention=attention, attention_kwargs=akw or None, pos="learned",
                        max_seq_len=max_len)
    model = DecoderLM(config=cfg, parts=DecoderParts(head=nn.Identity()))
    for block in model.blocks:  # type: ignore[attr-defined]
        block.ffn = nn.Identity()
    gpt2_init(model)
    return model


def cosine_epoch_lr(lr: float, epoch: int, epochs: int) -> float:
    """``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=epochs, eta_min=0)`` stepped once per
    epoch, as ``zoology/train.py``: the learning rate of 0-based ``epoch``."""
    return 0.5 * lr * (1.0 + math.cos(math.pi * epoch / max(1, epochs)))


@lru_cache(maxsize=2)
def _task(train: tuple[MQARCell, ...], test: tuple[MQARCell, ...], vocab: int, seed: int, power_a: float,
          random_non_queries: bool) -> PaperMQAR:
    return PaperMQAR(train, test, vocab_size=vocab, seed=seed, power_a=power_a, random_non_queries=random_non_queries)


def _segments(p: Preset, spec: RunSpec) -> tuple[tuple[MQARCell, ...], tuple[MQARCell, ...]]:
    if p.mixture:
        return p.train, p.test
    n, k = (int(x) for x in spec.train.split("/"))
    return (tuple(c for c in p.train if (c.seq_len, c.pairs) == (n, k)),
            tuple(c for c in p.test if (c.seq_len, c.pairs) == (n, k)))


def train_run(p: Preset, spec: RunSpec, device: torch.device | str = "cpu", max_steps: int | None = None,
              log: bool = False) -> dict[str, Any]:
    """Train one run of preset ``p`` (at its budget) to the threshold or the last epoch.

    Returns the run's record: every evaluation (``step``, ``epoch``, ``accuracy``, ``val_loss``,
    ``by_segment``), ``final`` (the last one), ``stopped_early`` (passed ``p.threshold``),
    ``state_bytes`` (decode state after one test sequence of the longest length, measured from the
    cache), ``params``, ``steps`` and wall seconds. ``max_steps`` caps the steps (tests).
    """
    device = torch.device(device)
    train, test = _segments(p, spec)
    task = _task(train, test, p.vocab, spec.seed, p.power_a, p.random_non_queries)
    batch = p.batch_for(task.seq_len)
    model = preset_model(spec.variant, spec.width, p.depth, p.heads, p.vocab, task.test_len, spec.seed,
                         spec.window).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=p.weight_decay)  # Zoology: every parameter
    per = task.steps_per_epoch(batch)
    marks = {max(1, round(per * (i + 1) / p.evals_per_epoch)) for i in range(p.evals_per_epoch)}
    evals: list[dict[str, Any]] = []
    step, stopped, t0 = 0, False, time.perf_counter()
    model.train()
    for epoch in range(p.max_epochs):
        for group in opt.param_groups:
            group["lr"] = cosine_epoch_lr(spec.lr, epoch, p.max_epochs)
        for i in range(per):
            x, y = task.batch(step, batch, spec.seed)
            logits, scored = scored_logits(model, x.to(device), y.to(device))  # [S, V]
            loss = nn.functional.cross_entropy(logits.float(), y.to(device)[scored])
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"{spec.key}: loss became {value} at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            capped = max_steps is not None and step >= max_steps
            if i + 1 in marks or capped:
                evals.append({"step": step, "epoch": round(epoch + (i + 1) / per, 3), "train_loss": value,
                              **task.evaluate(model, device, spec.seed)})
                if log:
                    print(f"[{spec.key}] step {step}: accuracy {evals[-1]['accuracy']:.3f}", file=sys.stderr,
                          flush=True)
                if evals[-1]["accuracy"] > p.threshold:  # zoology/train.py: metric > early_stopping_threshold
                    stopped = True
                    break
            if capped:
                break
        if stopped or (max_steps is not None and step >= max_steps):
            break
    wall = time.perf_counter() - t0
    model.eval()
    longest = max(test, key=lambda c: c.seq_len)
    probe = next(x for c, x, _ in task.tests if c == longest)[:1].long().to(device)  # [1, N]
    return {"spec": asdict(spec), "key": spec.key, "evals": evals, "final": {k: evals[-1][k] for k in
                                                                           ("accuracy", "val_loss", "by_segment")},
            "stopped_early": stopped, "steps": step, "steps_per_epoch": per, "batch": batch,
            "state_bytes": state_bytes(model, probe), "state_seq_len": longest.seq_len,
            "params": int(sum(q.numel() for q in model.parameters())), "train_wall_s": wall}


def preset_runs(p: Preset, variants: list[str] | None = None, seed: int = 0) -> list[RunSpec]:
    """Every run of ``p``: variants x widths x training segments x learning rates (Based: one
    mixture; its sliding window also over a few windows at the largest width, as the paper sweeps
    windows at one width)."""
    names = list(variants or p.variants)
    trains = ["mixture"] if p.mixture else [f"{c.seq_len}/{c.pairs}" for c in p.train]
    runs = []
    for v in names:
        configs: list[tuple[int, int | None]] = [(w, None) for w in p.widths]
        if p.mixture and v == "sliding":
            wins = (8, 16) if p.size == "quick" else (8, 32) if p.size == "reduced" else (8, 16, 32, 64, 128, 256, 512,
                                                                                           1024)
            configs = [(max(p.widths), win) for win in wins]
        for t in trains:
            for w, win in configs:
                runs += [RunSpec(p.name, p.size, v, w, t, lr, win, seed) for lr in p.lrs]
    return runs


def best_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best learning rate of every point (variant, width, segment, window): the papers' "maximum
    over learning rates". Each entry: the best record's numbers plus ``lrs`` (every learning rate's
    final accuracy) and ``best_lr``; ties go to the smaller learning rate."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        s = r["spec"]
        groups.setdefault((s["variant"], s["width"], s["train"], s["window"]), []).append(r)
    out = []
    for (v, w, t, win), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["spec"]["lr"])
        best = max(rs, key=lambda r: r["final"]["accuracy"])  # first of equal maxima: the smaller lr
        out.append({"variant": v, "width": w, "train": t, "window": win, "accuracy": best["final"]["accuracy"],
                    "by_segment": best["final"]["by_segment"], "best_lr": best["spec"]["lr"],
                    "lrs": {f"{r['spec']['lr']:.2e}": r["final"]["accuracy"] for r in rs},
                    "stopped_early": best["stopped_early"], "epochs": best["evals"][-1]["epoch"],
                    "state_bytes": best["state_bytes"], "state_seq_len": best["state_seq_len"],
                    "params": best["params"], "at_lr_edge": best["spec"]["lr"] in (rs[0]["spec"]["lr"],
                                                                                   rs[-1]["spec"]["lr"]) and len(rs) > 1})
    return out


def sweep_points(specs: list[RunSpec]) -> list[list[int]]:
    """The indices of ``specs`` grouped by point (everything but the learning rate), each group
    ordered from the largest learning rate down: the order :func:`run_point` trains them in."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, s in enumerate(specs):
        groups.setdefault(s.point, []).append(i)
    return [sorted(g, key=lambda i: -specs[i].lr) for g in groups.values()]


def point_cost(p: Preset, spec: RunSpec) -> float:
    """A relative estimate of one run's training cost, for scheduling: tokens per pass times the
    per-token work of a width-``C`` layer over ``N`` tokens, ``N x C x (C + N)`` (projections plus
    the scores of attention over every token; a constant factor does not change the order).

    Points are trained costliest first: with ``--jobs J`` the longest run then starts at once
    instead of last (the reduced Zoology preset's width-128, 128-token attention point, two
    3,000-step runs, ran alone for its last 15 minutes when points went cheapest first)."""
    n = max(c.seq_len for c in p.train) if spec.train == "mixture" else int(spec.train.split("/")[0])
    examples = sum(c.examples for c in p.train) if spec.train == "mixture" else \
        next(c.examples for c in p.train if f"{c.seq_len}/{c.pairs}" == spec.train)
    return float(examples) * n * spec.width * (spec.width + n)


def _point_left(point: list[int], reused: list[dict[str, Any] | None]) -> bool:
    for i in point:
        if reused[i] is None:
            return True
        if reused[i]["stopped_early"]:  # type: ignore[index]
            return False
    return False


def run_point(p: Preset, specs: list[RunSpec], reused: list[dict[str, Any] | None], device: str, out: str,
              ) -> list[dict[str, Any] | None]:
    """Train one point's learning rates, largest first, until one passes the threshold.

    The papers' value of a point is the best final accuracy over its learning rates; once a run has
    passed the threshold (early stop, accuracy > ``p.threshold``) the others could add at most
    ``1 - threshold`` (one point at 0.99), so they are skipped (``None`` in the returned list, one
    entry per spec). ``reused`` holds records of finished runs (``--resume``; ``None``: train), and
    each trained run's record is written to ``out/runs/<key>.json`` as it finishes."""
    recs: list[dict[str, Any] | None] = [None] * len(specs)
    for j, (spec, old) in enumerate(zip(specs, reused, strict=True)):
        recs[j] = old if old is not None else _run_in_worker(p, spec, device, out)
        if recs[j]["stopped_early"]:  # type: ignore[index]
            break
    return recs



def _run_in_worker(p: Preset, spec: RunSpec, device: str, out: str) -> dict[str, Any]:
    record = train_run(p, spec, device)
    write_atomic(Path(out) / "runs" / f"{spec.key}.json", json.dumps(record, indent=1))
    return record


def _reused(out: Path, spec: RunSpec) -> dict[str, Any] | None:
    """A finished run's record with the same spec (``--resume``), else None."""
    path = out / "runs" / f"{spec.key}.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        ok = isinstance(record, dict) and all(k in record for k in ("spec", "final", "evals", "state_bytes"))
    except (OSError, ValueError) as exc:
        ok, record = False, str(exc)
    if not ok:
        print(f"arena: warning: {path} is not a finished run record; training the run again", file=sys.stderr)
        return None
    return record if record.get("spec") == asdict(spec) else None


def add_preset_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--preset`` / ``--full`` / ``--lr-sweep`` options of ``attnzoo arena``."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="rerun a paper's MQAR figure: zoology-fig2 (accuracy vs width per sequence length) or "
                             "based-fig2 (accuracy vs state size), with the paper's data generator, models, learning-rate "
                             "sweep (best of) and early stop at 0.99; a reduced budget by default (--full: the paper's, "
                             "hours to days on a CPU; --quick: a smoke test); --jobs, --resume, --variants apply")
    parser.add_argument("--full", action="store_true", help="--preset: the paper's whole sweep and budget")
    parser.add_argument("--lr-sweep", dest="lr_sweep", action="store_true",
                        help="mqar task: train every variant at a few peak learning rates and keep the best")


def preset_size(args: argparse.Namespace) -> str:
    """``quick``, ``full`` or the default ``reduced``."""
    if getattr(args, "quick", False) and getattr(args, "full", False):
        raise ValueError("--quick and --full: choose one budget for --preset")
    return "quick" if args.quick else "full" if getattr(args, "full", False) else "reduced"


def run_preset(args: argparse.Namespace) -> int:
    """``attnzoo arena --preset NAME [--quick | --full] [--jobs J] [--resume] [--variants ...]``:
    train every run, reduce the learning-rate sweep, write ``preset.json``, the figure and
    ``report.md`` to ``--out`` (default ``arena-<preset>``)."""
    if args.preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    size = preset_size(args)
    p = budget(PRESETS[args.preset], size)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    for v in variants or []:
        layer_pattern(v, p.depth)  # unknown names fail before training
    specs = preset_runs(p, variants, args.seed)
    out = ensure_output_dir(args.out or f"arena-{p.name}" + ("-quick" if size == "quick" else ""), "--out")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    reused = [(_reused(out, s) if args.resume else None) for s in specs]
    points = sweep_points(specs)
    todo = sorted((pt for pt in points if _point_left(pt, reused)),  # costliest first (see point_cost)
                  key=lambda pt: (-point_cost(p, specs[pt[0]]), pt[0]))
    jobs, threads = worker_plan(args, max(1, len(todo)))
    overall = Overall([float(specs[pt[0]].width) for pt in todo] or [1.0], enabled=args.progress != "none")
    records: list[dict[str, Any] | None] = list(reused)
    calls = [(p, [specs[i] for i in pt], [reused[i] for i in pt], args.device, str(out)) for pt in todo]
    t0 = time.perf_counter()
    if todo and jobs > 1:
        with Workers(jobs, threads) as workers:
            for j, recs, exc in workers.completed(run_point, calls):
                if exc is not None:
                    raise exc
                for i, rec in zip(todo[j], recs, strict=True):
                    records[i] = rec
                best = max(r["final"]["accuracy"] for r in recs if r is not None)
                overall.completed(f"{specs[todo[j][0]].key}: best accuracy {100 * best:.1f}%",
                                  float(specs[todo[j][0]].width))
    else:
        if threads is not None:
            torch.set_num_threads(threads)
        for pt, call in zip(todo, calls, strict=True):
            overall.start(specs[pt[0]].key)
            for i, rec in zip(pt, run_point(*call), strict=True):
                records[i] = rec
            overall.finish(trained=True)
    wall = time.perf_counter() - t0
    done = [r for r in records if r is not None]
    trained = sum(1 for r, old in zip(records, reused, strict=True) if r is not None and old is None)
    skipped = [s.key for s, r in zip(specs, records, strict=True) if r is None]
    result = {"preset": p.name, "size": size, "paper": p.paper, "source": p.source, "settings": _settings(p),
              "runs": done, "points": best_of(done), "wall_s": wall, "jobs": jobs, "threads": threads,
              "reused": len(done) - trained, "skipped": skipped, "torch_threads": torch.get_num_threads()}
    write_atomic(out / "preset.json", json.dumps(result, indent=1))
    from_report = write_preset_report(result, p, out)
    print(f"arena --preset {p.name} ({size}): {len(done)} runs ({trained} trained, {len(done) - trained} reused, "
          f"{len(skipped)} skipped: a larger learning rate of their point passed {p.threshold}) in {wall:.0f} s on "
          f"{jobs} worker(s); report: {from_report}", flush=True)
    return 0


def partial_report(out: Path | str, preset: str, size: str = "reduced", wall_s: float = float("nan")) -> Path:
    """The report of the runs that finished in ``out/runs`` (a sweep cut short, e.g. by a time
    limit): ``preset.json`` and ``report.md`` as :func:`run_preset` writes them, from those runs
    only (``partial: true``; the report says how many of the sweep's runs are in). Returns the
    report's path."""
    out = Path(out)
    p = budget(PRESETS[preset], size)
    specs = {s.key: s for s in preset_runs(p)}
    done = [r for r in (_reused(out, s) for s in specs.values()) if r is not None]
    if not done:
        raise ValueError(f"partial_report: no finished run of {preset} ({size}) in {out / 'runs'}")
    result = {"preset": p.name, "size": size, "paper": p.paper, "source": p.source, "settings": _settings(p),
              "runs": done, "points": best_of(done), "wall_s": wall_s, "jobs": 0, "threads": None,
              "reused": len(done), "partial": True, "of_runs": len(specs)}
    write_atomic(out / "preset.json", json.dumps(result, indent=1))
    return write_preset_report(result, p, out)


def _settings(p: Preset) -> dict[str, Any]:
    d = asdict(p)
    d["lrs"] = list(p.lrs)
    return d
