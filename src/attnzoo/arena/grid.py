"""``attnzoo arena --task mqar-grid``: the recall-vs-state trade-off (Zoology's figure).

Every variant of the registry is trained on MQAR at every cell of a grid of model widths x
numbers of key-value pairs x sequence lengths, on a small fixed budget, and each trained model's
held-out accuracy is drawn against the bytes of its decode state after one sequence (measured
from the cache). Exact attention buys recall with a state that grows with the sequence; a
fixed-size state must compress all pairs into its numbers, so its recall falls as the pairs grow
unless the state (the width) grows too. See Arora et al. 2023, "Zoology".

The default grid (widths 32, 64 x pairs 4, 8 x seq_len 64, 600 steps of 32 sequences) took 19.4 minutes
for the 17 registered variants on two quiet CPU cores (AMD EPYC, 2 worker processes; 32 minutes when
other programs shared them). Each cell is
evaluated half-way, at three quarters and at the end: a cell still rising is marked "not converged",
and exact full attention that has not solved the task is marked "below its plateau" (at the default
budget the softmax variants have not made MQAR's jump: about 29% at 4 pairs), so compare the
variants within the budget or raise ``--steps``/``--batch``. ``--quick`` is a smoke test. ``--grid-widths``,
``--grid-pairs``, ``--grid-seq-lens``, ``--steps``, ``--batch``, ``--variants`` and ``--jobs`` change
it. Results go to ``--out`` (default ``arena-grid``): ``grid.json``, ``mqar_grid.png``, ``report.md``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from attnzoo._outputs import ensure_output_dir
from attnzoo.arena.measure import state_bytes
from attnzoo.arena.progress import Overall
from attnzoo.arena.storage import write_atomic
from attnzoo.arena.tasks import MQARTask
from attnzoo.arena.trainer import StepInfo, TrainConfig, train
from attnzoo.arena.verdict import RISING, SOLVED, mqar_converged
from attnzoo.arena.workers import Workers, worker_plan
from attnzoo.cost import estimate
from attnzoo.variants import VARIANTS, variant_names

__all__ = ["GRID", "QUICK_GRID", "convergence_text", "eval_steps", "grid_cells", "grid_jobs", "grid_window",
           "run_grid", "sees_every_token"]

GRID = {"widths": (32, 64), "pairs": (4, 8), "seq_lens": (64,), "steps": 600, "batch": 32, "depth": 2,
        "lr": 3e-3, "vocab": 64}
QUICK_GRID = {"widths": (16, 32), "pairs": (2,), "seq_lens": (16,), "steps": 8, "batch": 8, "depth": 1,
              "lr": 3e-3, "vocab": 16}

#: ``build(width, depth, heads, seq_len, variant, vocab, seed) -> model`` (the arena's model).
Builder = Callable[[int, int, int, int, str, int, int], torch.nn.Module]


def grid_cells(grid: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(width, pairs, seq_len)`` of every cell, in order."""
    return [(w, k, n) for n in grid["seq_lens"] for k in grid["pairs"] for w in grid["widths"]]


def _grid_settings(args: argparse.Namespace) -> dict[str, Any]:
    g = dict(QUICK_GRID if args.quick else GRID)
    for key, attr in (("widths", "grid_widths"), ("pairs", "grid_pairs"), ("seq_lens", "grid_seq_lens")):
        if getattr(args, attr, None):
            g[key] = tuple(getattr(args, attr))
    for key in ("steps", "batch", "depth", "lr"):
        if getattr(args, key, None) is not None:
            g[key] = getattr(args, key)
    if getattr(args, "mqar_vocab", None) is not None:
        g["vocab"] = args.mqar_vocab
    for _, k, n in grid_cells(g):  # every cell's task must exist before anything trains
        MQARTask(seq_len=n, num_kv_pairs=k, vocab_size=g["vocab"])
    return g


def _heads(width: int) -> int:
    return max(1, min(4, width // 16))


def grid_window(window: int | None, seq_len: int) -> int:
    """The window of the windowed variants in a cell: ``--window``, else a quarter of the sequence
    (so a window cannot see most pairs from most queries)."""
    return window or max(1, seq_len // 4)


def sees_every_token(variant: str, width: int, heads: int, seq_len: int, window: int) -> bool:
    """Whether ``variant`` (with its arena settings) is exact attention in which every query sees
    every earlier token: the mechanism can then recall every pair (MQAR's plateau is 100%). From
    the spec's cost function (its visible pairs), not from the name."""
    if "/" in variant:  # a hybrid stack: one layer that sees every token can recall every pair
        return any(sees_every_token(n, width, heads, seq_len, window) for n in set(variant.split("/")))
    spec = VARIANTS[variant]
    if not spec.exact:
        return False
    known = set(inspect.signature(estimate).parameters)
    kw = {k: v for k, v in spec.arena_settings(width, heads, window).items() if k in spec.options and k in known}
    return estimate(variant, seq_len, width, heads, **kw).visible_fraction * seq_len >= (seq_len + 1) / 2


def _cell(build: Builder, g: dict[str, Any], variant: str, cell: tuple[int, int, int], seed: int,
          device: torch.device) -> dict[str, Any]:
    """Train one model on one cell; its accuracy and decode-state bytes."""
    width, pairs, seq_len = cell
    task = MQARTask(seq_len=seq_len, num_kv_pairs=pairs, vocab_size=g["vocab"])
    model = build(width, g["depth"], _heads(width), seq_len, variant, task.vocab_size, seed).to(device)
    cfg = TrainConfig(lr=g["lr"], warmup=max(1, g["steps"] // 10))
    at = eval_steps(g["steps"])
    evals: list[dict[str, float]] = []

    def on_step(info: StepInfo) -> None:
        if info.step in at:
            evals.append({"step": info.step, **task.evaluate(model, device, seed)})
            model.train()

    t0 = time.perf_counter()
    losses = train(model, task, g["steps"], g["batch"], seed, config=cfg, device=device, on_step=on_step)
    wall = time.perf_counter() - t0
    tokens = task.batch(0, 1, seed)[0].to(device)  # [1, N]
    return {"variant": variant, "width": width, "pairs": pairs, "seq_len": seq_len, "heads": _heads(width),
            "accuracy": evals[-1]["accuracy"], "val_loss": evals[-1]["val_loss"], "final_train_loss": losses[-1],
            "evals": evals, "converged": mqar_converged(evals, window=len(at)),
            "state_bytes": state_bytes(model, tokens), "params": int(sum(p.numel() for p in model.parameters())),
            "train_wall_s": wall}


def eval_steps(steps: int) -> tuple[int, ...]:
    """The steps after which a grid cell is evaluated: half-way, three quarters and the end (fewer
    when ``steps`` is tiny). The last is always ``steps``; a cell whose accuracy rose by more than
    :data:`~attnzoo.arena.verdict.RISING` from the first to the last is "not converged"."""
    return tuple(sorted({max(1, steps // 2), max(1, 3 * steps // 4), steps}))


def _grid_figure(points: list[dict[str, Any]], variants: Sequence[str], g: dict[str, Any], path: Path) -> bool:
    """Accuracy against decode-state bytes, one panel per (pairs, seq_len); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(k, n) for n in g["seq_lens"] for k in g["pairs"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0), dpi=110, squeeze=False)
    cmap = plt.get_cmap("tab20" if len(variants) > 10 else "tab10")
    for ax, (k, n) in zip(axes[0], panels, strict=True):
        for i, v in enumerate(variants):
            pts = sorted((p for p in points if p["variant"] == v and p["pairs"] == k and p["seq_len"] == n),
                         key=lambda p: p["state_bytes"])
            if pts:
                color = cmap(i % cmap.N)
                ax.plot([p["state_bytes"] for p in pts], [p["accuracy"] for p in pts], color=color, label=v)
                for p in pts:  # a hollow marker: accuracy still rising at the end (a lower bound)
                    ax.plot(p["state_bytes"], p["accuracy"], marker="o", ms=4, color=color,
                            markerfacecolor=color if p.get("converged", True) is not False else "white")
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("decode-state bytes after one sequence")
        ax.set_title(f"{k} key-value pairs, seq_len {n}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"MQAR recall against decode state (widths {', '.join(map(str, g['widths']))}; "
                 f"{g['steps']} steps x batch {g['batch']}; hollow: not converged)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _grid_md(points: list[dict[str, Any]], g: dict[str, Any], quick: bool, wall: float, has_png: bool,
             jobs: int = 1) -> str:
    lines = ["# attnzoo arena: MQAR recall against decode state", ""]
    if quick:
        lines += ["> **Smoke test** (`--quick`): a tiny grid and budget; the numbers mean nothing.", ""]
    lines += [f"Grid: widths {list(g['widths'])} x key-value pairs {list(g['pairs'])} x seq_len "
              f"{list(g['seq_lens'])}; depth {g['depth']}, {g['steps']} steps x batch {g['batch']}, peak lr "
              f"{g['lr']:g}, vocabulary {g['vocab']}. Took {wall:.0f} s ({jobs} worker process"
              f"{'es' if jobs > 1 else ''}).", ""]
    if has_png:
        lines += ["![MQAR accuracy against decode-state bytes](mqar_grid.png)", ""]
    lines += [convergence_text(points, g), ""]
    lines += ["| variant | width | pairs | seq_len | params | state bytes | accuracy | accuracy over training |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {p['variant']} | {p['width']} | {p['pairs']} | {p['seq_len']} | {p['params']:,} | "
              f"{p['state_bytes']:,} | {100 * p['accuracy']:.1f}%{_marks(p)} | {_curve(p)} |" for p in points]
    return "\n".join(lines) + "\n"


def _below_plateau(point: dict[str, Any]) -> bool:
    """Exact attention over every earlier token that has not solved the task: below its plateau."""
    return bool(point.get("sees_every_token")) and point["accuracy"] < SOLVED


def _marks(point: dict[str, Any]) -> str:
    return ("*" if point.get("converged") is False else "") + ("†" if _below_plateau(point) else "")


def _curve(point: dict[str, Any]) -> str:
    """``"29% -> 36% -> 41% (rising)"``: the cell's evaluations."""
    accs = " -> ".join(f"{100 * e['accuracy']:.0f}% @{e['step']}" for e in point.get("evals", []))
    return accs + (" (rising)" if point.get("converged") is False else "")


def convergence_text(points: list[dict[str, Any]], g: dict[str, Any]) -> str:
    """One paragraph: which cells had not converged (accuracy still rising over the last half of the
    budget), and whether exact attention over every earlier token (whose plateau is 100%: it can
    recall every pair) got there; if not, the budget, not the mechanism, sets its points."""
    rising = [p for p in points if p.get("converged") is False]
    if rising:
        text = (f"\\* **Not converged** in {len(rising)} of {len(points)} cells: the accuracy rose by more than "
                f"{100 * RISING:.0f} points over the last half of the {g['steps']} steps, so it is a lower bound of "
                f"what the variant can do at that width; the figure draws these points hollow.")
    else:
        text = (f"Every cell converged: no accuracy rose by more than {100 * RISING:.0f} points over the last half "
                f"of the {g['steps']} steps (or it was solved).")
    full = [p for p in points if p.get("sees_every_token")]
    below = [p for p in full if _below_plateau(p)]
    if below:
        names = ", ".join(sorted({p["variant"] for p in full}))
        best = max(p["accuracy"] for p in below)
        text += (f" \u2020 **Below its plateau**: exact attention over every earlier token ({names}) can recall "
                 f"every pair, yet {len(below)} of its {len(full)} cells stayed under {100 * SOLVED:.0f}% (at most "
                 f"{100 * best:.1f}%; about 1 / pairs is guessing among the sequence's values): at this budget it "
                 f"has not made MQAR's jump, so the figure compares what the variants learn in "
                 f"{g['steps']} x {g['batch']} sequences, not what their states can hold. Raise `--steps` / "
                 f"`--batch` for the plateau (the `mqar` task's budget, 600 steps x 128 sequences of 32 tokens, "
                 f"gets mha to 100%).")
    elif full:
        text += " Exact attention over every earlier token solved every cell (its plateau)."
    return text


def _grid_variants(args: argparse.Namespace) -> list[str]:
    if not args.variants:
        return variant_names()
    names = [v.strip() for v in str(args.variants).split(",") if v.strip()]
    bad = [v for v in names if any(n.strip() not in variant_names() for n in v.split("/"))]
    if bad or not names:
        raise ValueError(f"--variants: unknown or empty {bad or args.variants!r}; expected a subset of "
                         f"{variant_names()}")
    return names


def grid_jobs(args: argparse.Namespace, runs: int) -> tuple[int, int | None]:
    """``(worker processes, torch threads per run)`` of the grid: :func:`attnzoo.arena.workers.worker_plan`.

    On a CPU the cells train in parallel processes, one per core with one torch thread each;
    ``--threads T`` gives ``cores // T`` workers, ``--jobs J`` sets the count. Other devices train
    one cell at a time. Every run is seeded by its cell, so the points do not depend on the order
    they finish in.
    """
    return worker_plan(args, runs)


def _label(variant: str, cell: tuple[int, int, int]) -> str:
    return f"{variant} width {cell[0]} pairs {cell[1]} seq_len {cell[2]}"


def _outcome(point: dict[str, Any] | None) -> str:
    """``": accuracy 29.1% (rising)"`` for a finished cell's progress line; ``": failed"``."""
    if point is None:
        return ": failed"
    return f": accuracy {100 * point['accuracy']:.1f}%" + (" (rising)" if point["converged"] is False else "")


def _run_cells(build: Builder, g: dict[str, Any], runs: list[tuple[str, tuple[int, int, int]]], seed: int,
               device: torch.device, overall: Overall) -> tuple[list[dict[str, Any] | None], dict[str, str]]:
    """Train the runs one after the other, in this process."""
    points: list[dict[str, Any] | None] = []
    errors: dict[str, str] = {}
    for v, cell in runs:
        overall.start(_label(v, cell))
        try:
            points.append(_cell(build, g, v, cell, seed, device))
        except Exception as e:  # one variant failing must not sink the grid
            points.append(None)
            errors[f"{v}@{cell}"] = f"{type(e).__name__}: {e}"
        overall.finish(trained=True)
    return points, errors


def _run_cells_parallel(build: Builder, g: dict[str, Any], runs: list[tuple[str, tuple[int, int, int]]], seed: int,
                        device: torch.device, overall: Overall, jobs: int, threads: int | None
                        ) -> tuple[list[dict[str, Any] | None], dict[str, str]]:
    """Train the runs in ``jobs`` worker processes (``threads`` torch threads each)."""
    points: list[dict[str, Any] | None] = [None] * len(runs)
    errors: dict[str, str] = {}
    calls = [(build, g, v, cell, seed, device) for v, cell in runs]
    with Workers(jobs, threads) as workers:
        for i, point, exc in workers.completed(_cell, calls):
            v, cell = runs[i]
            if exc is not None:  # one variant failing must not sink the grid
                errors[f"{v}@{cell}"] = f"{type(exc).__name__}: {exc}"
            points[i] = point
            overall.completed(_label(v, cell) + _outcome(point), float(cell[0] * cell[2]))
    return points, errors


def run_grid(args: argparse.Namespace, build: Builder) -> int:
    """Run the MQAR grid described by ``args``; writes ``grid.json``, ``mqar_grid.png``, ``report.md``.

    ``build`` must be picklable (a module-level function or a ``functools.partial`` of one) when the
    cells train in worker processes (:func:`grid_jobs`).
    """
    variants = _grid_variants(args)
    g = _grid_settings(args)
    device = torch.device(args.device)
    out = ensure_output_dir(args.out or ("arena-grid-quick" if args.quick else "arena-grid"), "--out")
    out.mkdir(parents=True, exist_ok=True)
    cells = grid_cells(g)
    runs = [(v, cell) for v in variants for cell in cells]
    jobs, threads = grid_jobs(args, len(runs))
    overall = Overall([float(w * n) for _, (w, _, n) in runs], enabled=args.progress != "none")
    t0 = time.perf_counter()
    if jobs > 1:
        done, errors = _run_cells_parallel(build, g, runs, args.seed, device, overall, jobs, threads)
    else:
        if threads is not None:
            torch.set_num_threads(threads)
        done, errors = _run_cells(build, g, runs, args.seed, device, overall)
    wall = time.perf_counter() - t0
    points = [p for p in done if p is not None]
    for p in points:
        p["sees_every_token"] = sees_every_token(p["variant"], p["width"], p["heads"], p["seq_len"],
                                                 grid_window(args.window, p["seq_len"]))
    write_atomic(out / "grid.json", json.dumps({"grid": {k: list(x) if isinstance(x, tuple) else x
                                                         for k, x in g.items()}, "quick": bool(args.quick),
                                                "variants": variants, "points": points, "errors": errors,
                                                "jobs": jobs, "threads": threads, "wall_s": wall}, indent=1))
    has_png = _grid_figure(points, variants, g, out / "mqar_grid.png")
    write_atomic(out / "report.md", _grid_md(points, g, bool(args.quick), wall, has_png, jobs))
    rising = sum(p["converged"] is False for p in points)
    print(f"arena mqar-grid: {len(points)} runs ({len(variants)} variants x {len(cells)} cells) in "
          f"{wall:.0f} s on {jobs} worker(s), {rising} not converged; report: {out / 'report.md'}"
          + (f"; {len(errors)} failed: {errors}" if errors else ""), flush=True)
    return 0
