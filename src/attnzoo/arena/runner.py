"""``attnzoo arena``: train one small model per attention variant on each task, then write the report.

Every variant of a task gets the same width, depth, heads, steps, batch, learning-rate schedule and
seed; the model differs only in its attention. See ``docs/arena.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from attnzoo._interrupt import interrupted_exit_code, remembered_interrupts
from attnzoo._outputs import ensure_output_dir
from attnzoo._validate import nonnegative_int_arg as _nonnegative_int
from attnzoo._validate import positive_float_arg as _positive_float
from attnzoo._validate import positive_int_arg as _positive_int
from attnzoo.arena.fairness import StopRun, best_lr_record, should_stop, sweep_lrs
from attnzoo.arena.grid import GRID, grid_window, run_grid, sees_every_token
from attnzoo.arena.hybrid import check_entry, entry_kwargs
from attnzoo.arena.longctx import long_context
from attnzoo.arena.measure import decode_speed, state_bytes, training_memory
from attnzoo.arena.parallel import GatheredModel, parallelize, plain_copy, plan_from_args
from attnzoo.arena.progress import PROGRESS_KINDS, Overall, make_progress
from attnzoo.arena.report import summary_text, write_report
from attnzoo.arena.storage import (
    DamagedFile,
    first_line,
    read_checkpoint,
    read_run_record,
    save_checkpoint,
    set_aside,
    write_atomic,
)
from attnzoo.arena.sweep import add_preset_arguments, run_preset
from attnzoo.arena.tasks import MQARTask, ShakespeareTask, Task
from attnzoo.arena.timing import measure_pass
from attnzoo.arena.trainer import (
    StepInfo,
    TrainConfig,
    cleanup_distributed,
    config_dict,
    gpt2_init,
    init_distributed,
    make_optimizer,
    rank_and_world,
    train,
)
from attnzoo.arena.verdict import verdict
from attnzoo.arena.workers import Workers, worker_plan
from attnzoo.distributed import ContextParallel, context_parallel, gather_sequence, shard_positions
from attnzoo.models import DecoderConfig, DecoderLM
from attnzoo.variants import VARIANTS, layer_pattern, variant_names

__all__ = ["CONTEXT_PARALLEL_VARIANTS", "DEFAULT_VARIANTS", "TASKS", "TaskSettings", "add_arena_arguments",
           "build_model", "run_arena", "setting_differences", "settings_for"]

#: Every registered variant, in the registry's order.
DEFAULT_VARIANTS = tuple(name for name, spec in VARIANTS.items() if spec.arena_default)
#: Variants whose attention runs on a ring (:func:`attnzoo.distributed.context_parallel`).
CONTEXT_PARALLEL_VARIANTS = tuple(name for name, spec in VARIANTS.items() if spec.ring)
#: Sequence layout of ``--context-parallel``: zigzag balances causal work over the ranks.
CONTEXT_PARALLEL_LAYOUT = "zigzag"
TASKS = ("lm", "mqar")
DEFAULT_OUT = "arena-report"
QUICK_OUT = "arena-report-quick"
SAMPLE_PROMPT = "Ham.\nWhat is the matter, my lord?\n\n"


@dataclass(frozen=True)
class TaskSettings:
    """Everything that defines one task's runs (identical for every variant)."""

    task: str
    seq_len: int
    steps: int
    batch: int
    width: int
    depth: int
    heads: int
    lr: float
    warmup: int
    eval_every: int
    num_kv_pairs: int = 0  # mqar only
    vocab_size: int = 0  # mqar only
    window: int | None = None  # sliding / local_global window (None: the registry default)
    pos: str = "rope"  # DecoderLM positional encoding: rope | learned | sinusoidal | none
    max_steps: int = 0  # > steps: adaptive budget (attnzoo.arena.fairness): the schedule's horizon and the cap

    @property
    def horizon(self) -> int:
        """Steps of the schedule: the cap of an adaptive budget, else ``steps``."""
        return max(self.steps, self.max_steps)


# The default budget (see docs/arena.md for how it was chosen and what it reaches).
_DEFAULTS = {
    "lm": TaskSettings("lm", seq_len=128, steps=200, batch=32, width=128, depth=2, heads=4, lr=3e-3, warmup=20,
                       eval_every=40),
    "mqar": TaskSettings("mqar", seq_len=32, steps=600, batch=128, width=64, depth=2, heads=4, lr=1e-3,
                         warmup=300, eval_every=50, num_kv_pairs=4, vocab_size=64, window=8, pos="learned",
                         max_steps=1500),
}
_QUICK = {
    "lm": TaskSettings("lm", seq_len=32, steps=12, batch=8, width=32, depth=1, heads=2, lr=3e-3, warmup=3,
                       eval_every=6),
    "mqar": TaskSettings("mqar", seq_len=32, steps=12, batch=16, width=32, depth=1, heads=2, lr=3e-3, warmup=3,
                         eval_every=6, num_kv_pairs=4, vocab_size=64, window=8, pos="learned"),
}


def settings_for(task: str, args: argparse.Namespace) -> TaskSettings:
    """The defaults for ``task`` (``--quick`` or full) with the command-line overrides applied."""
    s = (_QUICK if args.quick else _DEFAULTS)[task]
    over: dict[str, Any] = {}
    for name in ("steps", "seq_len", "width", "depth", "heads", "batch", "lr", "window", "warmup"):
        value = getattr(args, name, None)
        if value is not None:
            over[name] = value
    if task == "mqar":
        if getattr(args, "mqar_pairs", None) is not None:
            over["num_kv_pairs"] = args.mqar_pairs
        if getattr(args, "mqar_vocab", None) is not None:
            over["vocab_size"] = args.mqar_vocab
    s = replace(s, **over)
    if "steps" in over:
        s = replace(s, eval_every=max(1, min(s.eval_every, s.steps)), max_steps=0)  # --steps: a fixed budget
        if "warmup" not in over:
            s = replace(s, warmup=min(s.warmup, max(1, s.steps // 10)))
    if s.warmup >= s.steps:
        raise ValueError(f"--warmup ({s.warmup}) must be smaller than --steps ({s.steps}) for task {task}")
    return s


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def add_arena_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``attnzoo arena`` options to ``parser``."""
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated registry names (default: {','.join(DEFAULT_VARIANTS)}; with "
                             f"--context-parallel: {','.join(CONTEXT_PARALLEL_VARIANTS)})")
    parser.add_argument("--task", choices=(*TASKS, "all", "mqar-grid"), default="all",
                        help="which task(s) to run (default: all). mqar-grid: MQAR accuracy over width x "
                             "key-value pairs x sequence length for every variant, against decode-state bytes "
                             "(the Zoology figure), with --grid-widths/--grid-pairs/--grid-seq-lens; the default "
                             "grid (17 variants x 4 cells) took 19 minutes on 2 quiet AVX2 CPU cores, --quick under 2 minutes")
    parser.add_argument("--steps", type=_positive_int, help="optimiser steps per run (default: per task, see docs)")
    parser.add_argument("--seq-len", dest="seq_len", type=_positive_int, help="tokens per training sequence")
    parser.add_argument("--width", type=_positive_int, help="model width C")
    parser.add_argument("--depth", type=_positive_int, help="number of transformer blocks")
    parser.add_argument("--heads", type=_positive_int, help="attention heads")
    parser.add_argument("--batch", type=_positive_int, help="global batch (sequences per step)")
    parser.add_argument("--lr", type=_positive_float, help="peak learning rate")
    parser.add_argument("--warmup", type=_positive_int, help="linear warm-up steps before the cosine decay")
    parser.add_argument("--window", type=_positive_int, help="window of sliding / local_global attention")
    parser.add_argument("--mqar-pairs", dest="mqar_pairs", type=_positive_int, help="MQAR key-value pairs")
    parser.add_argument("--mqar-vocab", dest="mqar_vocab", type=_positive_int, help="MQAR vocabulary size")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    parser.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default=None,
                        help=f"report directory (default: {DEFAULT_OUT}, with --quick {QUICK_OUT})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny budget for smoke tests (under 2 minutes); its report is marked as a smoke test")
    parser.add_argument("--force", action="store_true",
                        help="let --quick write into a folder that holds a full report (it is overwritten)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    parser.add_argument("--seeds", type=_positive_int, default=2,
                        help="seeds of the lm task, for the seed-noise estimate of the verdict (default: %(default)s)")
    parser.add_argument("--seeds-top", dest="seeds_top", type=_nonnegative_int, default=2,
                        help="run the extra seeds only for the K variants with the best lm loss at --seed, to "
                             "keep the default run short; 0: every variant (default: %(default)s)")
    parser.add_argument("--grid-widths", dest="grid_widths", type=_int_list,
                        help=f"mqar-grid: model widths (default: {_csv(GRID['widths'])})")
    parser.add_argument("--grid-pairs", dest="grid_pairs", type=_int_list,
                        help=f"mqar-grid: numbers of key-value pairs (default: {_csv(GRID['pairs'])})")
    parser.add_argument("--grid-seq-lens", dest="grid_seq_lens", type=_int_list,
                        help=f"mqar-grid: sequence lengths (default: {_csv(GRID['seq_lens'])})")
    parser.add_argument("--jobs", type=_positive_int, metavar="J",
                        help="runs trained at once, in worker processes with cores // J torch threads each "
                             "unless --threads is given (default: 1; mqar-grid on a CPU: one per core, or cores // "
                             "--threads; always 1 on other devices and under torchrun)")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="skip the measurement pass and the long-context costs (no speed columns)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse finished runs and continue unfinished ones from their checkpoints in --out")
    parser.add_argument("--checkpoint-every", dest="checkpoint_every", type=_positive_int, default=100,
                        help="steps between checkpoints (default: %(default)s)")
    parser.add_argument("--progress", choices=PROGRESS_KINDS, default="auto",
                        help="progress display (default: tqdm, else rich, else plain lines)")
    parser.add_argument("--compile", action="store_true",
                        help="train through torch.compile(model) (forward and backward of every training step); "
                             "evaluation and decoding stay eager")
    add_preset_arguments(parser)
    parser.add_argument("--context-parallel", dest="context_parallel", nargs="?", const=True, default=False,
                        type=_positive_int, metavar="N", help=_CP_HELP)


_CP_HELP = ("under torchrun: shard every sequence over the ranks (zigzag layout) and run ring attention instead "
            f"of splitting the batch; softmax variants only ({','.join(CONTEXT_PARALLEL_VARIANTS)}); --seq-len "
            "must be divisible by 2 x ranks. With N: FSDP2 on a (world / N, N) mesh, sequences over N ranks, rows "
            "of the batch over the rest, every variant but nsa and infini (attnzoo.arena.parallel; not "
            "checkpointed)")


def _int_list(text: str) -> list[int]:
    """``"32,64"`` -> ``[32, 64]`` (positive ints; argparse reports the error)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return values


def _parse_variants(text: str | None, context_parallel: bool = False) -> list[str]:
    """``--variants``: comma-separated registry names or ``/`` layer patterns (hybrid stacks)."""
    if text is None:
        return list(CONTEXT_PARALLEL_VARIANTS if context_parallel else DEFAULT_VARIANTS)
    raw = [v.strip() for v in str(text).split(",") if v.strip()]
    if not raw:
        raise ValueError(f"--variants: empty {text!r}; expected a comma-separated subset of {variant_names()}")
    names = [check_entry(v) for v in raw]
    if len(set(names)) != len(names):
        raise ValueError(f"--variants: {text!r} names a variant twice")
    if context_parallel:
        ring_less = [v for v in names if any(n not in CONTEXT_PARALLEL_VARIANTS for n in v.split("/"))]
        if ring_less:
            raise ValueError(f"--context-parallel: variants {ring_less} have no ring-attention form (their "
                             f"attention is a mask pattern or a recurrent state); use a subset of "
                             f"{list(CONTEXT_PARALLEL_VARIANTS)}")
    return names


def _make_task(s: TaskSettings) -> Task:
    if s.task == "lm":
        return ShakespeareTask(seq_len=s.seq_len)
    return MQARTask(seq_len=s.seq_len, num_kv_pairs=s.num_kv_pairs, vocab_size=s.vocab_size)


def _arena_pos(pos: str, variant: str, depth: int) -> str:
    """The task's ``pos``, except that a rope task gives ``"none"`` to a stack none of whose ``depth``
    layers takes a rotary embedding (they carry order themselves or rely on causality; see
    ``VariantSpec.positions``). The layers are the pattern cycled to the depth, as the model builds them."""
    takes = any(VARIANTS[n].takes_rope() for n in layer_pattern(variant, depth))
    return "none" if pos == "rope" and not takes else pos


def deepen_for_patterns(settings: dict[str, TaskSettings], variants: list[str],
                        depth_given: bool) -> tuple[dict[str, TaskSettings], list[str]]:
    """Every layer of a ``/`` pattern built: ``(settings, notes)``.

    Without ``--depth``, a task whose default depth is shorter than the longest pattern gets that
    pattern's length (for every variant of the task, so they stay comparable): the pinned
    ``--variants "gated_deltanet/gated_deltanet/gated_deltanet/mha"`` trains its ``mha`` layer at the
    default depth too. With ``--depth`` the pattern is cycled to it as asked, and a note names the
    layers that a shorter depth leaves out.
    """
    longest = max((1 + v.count("/") for v in variants), default=1)
    out, notes = dict(settings), []
    for task, s in settings.items():
        if s.depth >= longest:
            continue
        if depth_given:
            cut = [v for v in variants if 1 + v.count("/") > s.depth]
            notes.append(f"arena: --depth {s.depth} builds only the first {s.depth} layer(s) of {cut}")
        else:
            out[task] = replace(s, depth=longest)
            notes.append(f"arena: {task}: depth {s.depth} -> {longest}, the longest layer pattern's length "
                         f"(every variant of the task gets it; --depth sets it)")
    return out, notes


def _build_model(s: TaskSettings, variant: str, vocab: int, seed: int, device: torch.device,
                 max_len: int = 0) -> torch.nn.Module:
    akw = entry_kwargs(variant, s.width, s.heads, s.window)  # e.g. window, performer's F
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab, s.width, s.depth, s.heads, attention=variant, attention_kwargs=akw or None,
                        max_seq_len=max(s.seq_len, len(SAMPLE_PROMPT) + _sample_len(s), max_len),
                        pos=_arena_pos(s.pos, variant, s.depth))
    model = DecoderLM(config=cfg, device=device)
    gpt2_init(model)
    return model


def build_model(s: TaskSettings, variant: str, vocab: int, seed: int,
                device: torch.device | str = "cpu") -> torch.nn.Module:
    """The arena's model for ``variant`` under settings ``s`` (what a checkpoint's weights fit)."""
    return _build_model(s, variant, vocab, seed, torch.device(device))


def _sample_len(s: TaskSettings) -> int:
    """New tokens of the greedy sample: fill the training window (at least 32)."""
    return max(32, s.seq_len - len(SAMPLE_PROMPT))


def _signature(s: TaskSettings, variant: str, seed: int, world: int,
               context_parallel: bool = False) -> dict[str, Any]:
    sig = {**asdict(s), "variant": variant, "seed": seed, "world_size": world}
    if context_parallel:
        sig["context_parallel"] = CONTEXT_PARALLEL_LAYOUT
    return sig


class _GatheredLM(torch.nn.Module):
    """The full-sequence view of a context-parallel model (for evaluation): every rank passes the
    same ``tokens [B, N]``, runs its shard through the ring and gets all logits ``[B, N, V]`` back."""

    def __init__(self, model: torch.nn.Module, layout: str) -> None:
        super().__init__()
        self.model, self.layout = model, layout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = shard_positions(tokens.shape[1], layout=self.layout, device=tokens.device)  # [n]
        return gather_sequence(self.model(tokens[:, pos], positions=pos), 1, layout=self.layout)


@contextmanager
def _unwrapped(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Temporarily put the plain attention modules back in place of their ``ContextParallel``
    wrappers (for checkpoints with the usual parameter names and for cached decoding)."""
    swapped = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, ContextParallel):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, mod.module)
            swapped.append((parent, child, mod))
    try:
        yield model
    finally:
        for parent, child, mod in swapped:
            setattr(parent, child, mod)


def _run_name(s: TaskSettings, variant: str, seed: int, args: argparse.Namespace) -> str:
    """The file name of a run: ``mqar-gqa``, a hybrid's ``/`` as ``+``, ``-seed1`` for an extra seed,
    ``-lr0.001`` inside an ``--lr-sweep``."""
    name = f"{s.task}-{variant.replace('/', '+')}" + ("" if seed == args.seed else f"-seed{seed}")
    if getattr(args, "lr_sweep", False) and s.task == "mqar":
        name += f"-lr{s.lr:g}"
    return name


class _Run:
    """One (task, variant) training run with evaluation, checkpoints and measurements."""

    def __init__(self, s: TaskSettings, task: Task, variant: str, args: argparse.Namespace, out: Path,
                 device: torch.device, seed: int | None = None, label: str = "") -> None:
        self.s, self.task, self.variant, self.args, self.out, self.device = s, task, variant, args, out, device
        self.seed = args.seed if seed is None else seed
        self.label = label
        self.rank, self.world = rank_and_world()
        self.name = _run_name(s, variant, self.seed, args)
        self.reused = False
        self.ckpt = out / "checkpoints" / f"{self.name}.pt"
        self.done_file = out / "runs" / f"{self.name}.json"
        self.cp = bool(getattr(args, "context_parallel", False)) and self.world > 1
        self.plan = plan_from_args(args) if self.cp else None  # --context-parallel N: FSDP2 + CP
        self.sig = _signature(s, variant, self.seed, self.world, self.cp)
        # exact attention over every token (plateau 100%) trains on to the cap unless solved
        self.exact = s.task == "mqar" and sees_every_token(variant, s.width, s.heads, s.seq_len, s.window or s.seq_len)

    def _warn(self, path: Path, problem: str) -> None:
        """Name a damaged file, set it aside and say that the run is trained again."""
        moved = set_aside(path) if self.rank == 0 else path
        if self.rank == 0:
            print(f"arena: warning: [{self.name}] {path} {problem}; set aside as {moved.name}, training the run "
                  f"again", file=sys.stderr)

    def _finished(self) -> dict[str, Any] | None:
        """The record of a finished run with the same settings (``--resume``), else None."""
        if not (self.args.resume and self.done_file.exists()):
            return None
        try:
            data = read_run_record(self.done_file)
        except DamagedFile as exc:
            self._warn(self.done_file, str(exc))
            return None
        if data.get("signature") != self.sig:
            return None
        if self.ckpt.exists():  # a finished run's checkpoint is a model users load: it must be whole too
            try:
                read_checkpoint(self.ckpt)
            except DamagedFile as exc:
                self._warn(self.ckpt, str(exc))
                return None
        return data

    def _restore(self, model: torch.nn.Module, opt: torch.optim.Optimizer
                 ) -> tuple[int, list[float], list[dict[str, float]]]:
        """Load the checkpoint (``--resume``) into ``model`` and ``opt``: ``(start step, losses, evals)``.

        A damaged checkpoint is set aside and ``model``/``opt`` are left as built (step 0); one made
        with other settings is an error.
        """
        if not (self.args.resume and self.ckpt.exists()):
            return 0, [], []
        try:
            state = read_checkpoint(self.ckpt)
        except DamagedFile as exc:
            self._warn(self.ckpt, str(exc))
            return 0, [], []
        if state["extra"].get("signature") != self.sig:
            raise ValueError(f"--resume: checkpoint {self.ckpt} was made with different settings "
                             f"({setting_differences(state['extra'].get('signature'), self.sig)}). "
                             f"Use another --out or drop --resume")
        if not 0 <= int(state["step"]) <= self.s.horizon:
            self._warn(self.ckpt, f"is at step {state['step']}, outside the {self.s.horizon} steps of the run")
            return 0, [], []
        fresh_model = {k: v.clone() for k, v in model.state_dict().items()}
        fresh_opt = opt.state_dict()
        try:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            model.load_state_dict(fresh_model)  # nothing of the damaged file stays
            opt.load_state_dict(fresh_opt)
            self._warn(self.ckpt, f"does not fit the model ({first_line(exc)[:160]})")
            return 0, [], []
        return int(state["step"]), list(state["extra"]["losses"]), list(state["extra"]["evals"])

    def execute(self) -> dict[str, Any]:
        """Train (or resume, or reuse) this run, measure it and write its record; returns the record."""
        done = self._finished()
        if done is not None:
            if self.rank == 0:
                print(f"[{self.name}] finished earlier, reusing {self.done_file}", file=sys.stderr)
            self.reused = True
            return done
        s = self.s
        cfg = TrainConfig(lr=s.lr, warmup=s.warmup, compile=bool(getattr(self.args, "compile", False)))
        model = _build_model(s, self.variant, self.task.vocab_size, self.seed, self.device)
        if self.plan is not None:  # before the optimizer: it must see the sharded parameters
            parallelize(model, self.plan)
        opt = make_optimizer(model, cfg)
        start, losses, evals = self._restore(model, opt) if self.plan is None else (0, [], [])
        evaluated: torch.nn.Module = model if self.plan is None else GatheredModel(model, self.plan)
        if self.cp and self.plan is None:
            context_parallel(model, layout=CONTEXT_PARALLEL_LAYOUT)
            evaluated = _GatheredLM(model, CONTEXT_PARALLEL_LAYOUT)
        if start == 0:
            evals.append({"step": 0, **self.task.evaluate(evaluated, self.device, self.seed)})
        last, wall, cpu = self._train(model, evaluated, cfg, opt, start, losses, evals)
        if start == s.horizon and not evals:
            evals.append({"step": s.horizon, **self.task.evaluate(evaluated, self.device, self.seed)})
        result: dict[str, Any] = {
            "task": s.task, "variant": self.variant, "signature": self.sig,
            "params": int(model.num_parameters()),  # type: ignore[operator]
            "train_losses": losses, "evals": evals, "final": {k: v for k, v in evals[-1].items() if k != "step"},
            "train_tokens_per_s": last.tokens_per_s if last else None, "train_wall_s": wall, "train_cpu_s": cpu,
        }
        if self.plan is not None:  # measure a plain copy with the trained weights (gathered on every rank)
            model = plain_copy(model, _build_model(s, self.variant, self.task.vocab_size, self.seed, self.device))
        result.update(self._measure(model))
        if self.cp:
            result["context_parallel"] = {"layout": CONTEXT_PARALLEL_LAYOUT, "ranks": self.world}
            if self.plan is not None:
                result["context_parallel"].update(fsdp=True, cp=self.plan.cp, dp=self.plan.dp)
        if self.rank == 0:
            write_atomic(self.done_file, json.dumps(result, indent=1))
        return result

    def _train(self, model: torch.nn.Module, evaluated: torch.nn.Module, cfg: TrainConfig,
               opt: torch.optim.Optimizer, start: int, losses: list[float], evals: list[dict[str, float]],
               ) -> tuple[StepInfo | None, float, float]:
        """Train from ``start`` with progress, evaluations and checkpoints (``losses``/``evals`` grow).

        Returns the last step's info (None when nothing was left to train), wall and CPU seconds.
        """
        s, args = self.s, self.args
        last: list[StepInfo] = []
        kind = args.progress if self.rank == 0 else "none"
        with make_progress(kind, f"{self.label} {self.name:>18}".strip(), s.horizon, start) as bar:

            def on_step(info: StepInfo) -> None:
                losses.append(info.loss)
                last[:] = [info]
                bar.update(info)
                if info.step % s.eval_every == 0 or info.step == s.horizon:
                    metrics = self.task.evaluate(evaluated, self.device, self.seed)
                    evals.append({"step": info.step, **metrics})
                    bar.note(_brief(metrics))
                    model.train()
                    if s.max_steps > s.steps and should_stop(evals, info.step, s.steps, s.horizon, self.exact):
                        raise StopRun(info.step)

            def checkpoint(step: int, optimizer: torch.optim.Optimizer) -> None:
                if self.rank == 0:
                    with _unwrapped(model) as plain:
                        save_checkpoint(self.ckpt, plain, optimizer, step,
                                        {"signature": self.sig, "losses": losses, "evals": evals})

            t0, c0 = time.perf_counter(), time.process_time()
            try:
                train(model, self.task, s.horizon, s.batch, self.seed, config=cfg, device=self.device,
                      start_step=start, optimizer=opt, on_step=on_step,
                      checkpoint=checkpoint if self.plan is None else None, checkpoint_every=args.checkpoint_every,
                      sequence_layout=CONTEXT_PARALLEL_LAYOUT if self.cp and self.plan is None else None,
                      parallel=self.plan)
            except StopRun:  # an adaptive budget ended early: solved, or flat past its nominal steps
                model.eval()
                if self.plan is None and last:  # the checkpoint holds the weights the record reports
                    checkpoint(last[0].step, opt)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return (last[0] if last else None), wall, cpu

    def _measure(self, model: torch.nn.Module) -> dict[str, Any]:
        """Memory, decode state and speed, greedy sample (each one recorded as an error if it fails)."""
        out: dict[str, Any] = {}
        model.eval()
        try:
            # one rank's step: its rows of the batch, or (context parallel) every row at 1 / world of the positions
            out["memory"] = training_memory(model, self.task, self.s.batch if self.cp else self.s.batch // self.world,
                                            self.seed, self.device,
                                            sequence_layout=CONTEXT_PARALLEL_LAYOUT if self.cp else None)
        except Exception as e:  # a measurement must not sink the whole arena
            out["memory_error"] = f"{type(e).__name__}: {e}"
        if not isinstance(self.task, ShakespeareTask):
            return out
        with _unwrapped(model) as plain:  # decoding runs on one rank with a KV cache
            out.update(self._measure_decode(plain))
        return out

    def _measure_decode(self, model: torch.nn.Module) -> dict[str, Any]:
        out: dict[str, Any] = {}
        assert isinstance(self.task, ShakespeareTask)
        prompt = self.task.encode(SAMPLE_PROMPT)[None].to(self.device)  # [1, P]
        try:
            full = self.task.val_batches()[0][0][:1].to(self.device)  # [1, N]
            out["state_bytes_per_token"] = state_bytes(model, full) / full.shape[1]
        except Exception as e:
            out["state_error"] = f"{type(e).__name__}: {e}"
        try:
            speed, tokens = decode_speed(model, prompt, _sample_len(self.s))
            out["decode_tokens_per_s"] = speed
            out["sample"] = self.task.decode(tokens[0].cpu())
            out["sample_t08"] = _sampled_text(model, self.task, prompt, _sample_len(self.s), self.seed)
        except Exception as e:
            out["decode_error"] = f"{type(e).__name__}: {e}"
        return out


@torch.no_grad()
def _sampled_text(model: torch.nn.Module, task: ShakespeareTask, prompt: torch.Tensor, new: int, seed: int) -> str:
    """A seeded sample at temperature 0.8 (greedy decoding of small models falls into loops)."""
    g = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = model.generate(prompt, new, temperature=0.8, generator=g)  # type: ignore[operator]
    return task.decode(tokens[0].cpu())


def _brief(metrics: dict[str, float]) -> str:
    if "accuracy" in metrics:
        return f"val acc {metrics['accuracy']:.1%}"
    return f"val {metrics['val_loss']:.3f}"


def _check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device: {name!r} is not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def _check_world(settings: dict[str, TaskSettings], cp: bool, rank: int, world: int) -> None:
    """Batch (data parallel) or sequence length (context parallel) must split over the ranks."""
    if cp and world == 1 and rank == 0:
        print("arena: --context-parallel has no effect in a single process; start it with "
              "torchrun --nproc_per_node=N", file=sys.stderr)
    for t, s in settings.items():
        if cp and world > 1:
            if s.seq_len % (2 * world):
                raise ValueError(f"--context-parallel: --seq-len ({s.seq_len}) of task {t} must be divisible "
                                 f"by 2 x ranks = {2 * world} (zigzag layout)")
        elif s.batch % world:
            raise ValueError(f"--batch ({s.batch}) of task {t} must be divisible by the {world} ranks")


def _grid_model(window: int | None, device: torch.device, width: int, depth: int, heads: int, seq_len: int,
                variant: str, vocab: int, seed: int) -> torch.nn.Module:
    """The arena's MQAR model for one grid cell (window: ``window``, else a quarter of seq_len)."""
    s = TaskSettings("mqar", seq_len=seq_len, steps=1, batch=1, width=width, depth=depth, heads=heads, lr=3e-3,
                     warmup=0, eval_every=1, window=grid_window(window, seq_len), pos="learned")
    return _build_model(s, variant, vocab, seed, device)


def _grid_builder(args: argparse.Namespace) -> Any:
    """:func:`_grid_model` for ``--window`` and ``--device``; picklable, for the grid's worker processes."""
    return functools.partial(_grid_model, args.window, _check_device(args.device))


def setting_differences(old: object, new: dict[str, Any]) -> str:
    """The settings in which two run signatures differ, as ``"key: old -> new"`` (comma-separated)."""
    if not isinstance(old, dict):
        return f"no settings recorded (found {type(old).__name__})"
    keys = [k for k in new if old.get(k, "<missing>") != new[k]] + [k for k in old if k not in new]
    return ", ".join(f"{k}: {old.get(k, '<missing>')!r} -> {new.get(k, '<missing>')!r}" for k in keys) or "none"


def _results(args: argparse.Namespace, settings: dict[str, TaskSettings], task_objs: dict[str, Task],
             variants: list[str], runs: dict[str, dict[str, Any]], device: torch.device, world: int,
             wall: float, cpu: float) -> dict[str, Any]:
    """The contents of ``results.json`` (measurements, seeds and long-context costs added later)."""
    return {
        "attnzoo_arena": 2, "quick": bool(args.quick),
        "settings": {t: asdict(s) for t, s in settings.items()},
        "optimizer": config_dict(TrainConfig()) | {"note": "lr and warmup per task in settings"},
        "seed": args.seed, "variants": variants,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "device": str(device), "threads": torch.get_num_threads(), "world_size": world,
                        "machine": platform.machine(), "cpu_count": os.cpu_count()},
        "wall_s": wall, "cpu_s": cpu,
        "prompt": SAMPLE_PROMPT,
        "unigram_val_loss": task_objs["lm"].unigram_loss() if "lm" in task_objs else None,
        "runs": runs,
    }


def resolve_out(args: argparse.Namespace) -> Path:
    """``--out`` (default by ``--quick``), refusing to let a quick run overwrite a full report.

    A folder holds a full report when its ``results.json`` or its ``arena-kind.txt`` (written when
    a run starts) says so; ``--force`` overrides.
    """
    out = ensure_output_dir(args.out or (QUICK_OUT if args.quick else DEFAULT_OUT), "--out")
    if not args.quick or getattr(args, "force", False):
        return out
    full = False
    kind = out / KIND_FILE
    if kind.is_file():
        full = kind.read_text().strip() != "quick"
    elif (out / "results.json").is_file():
        try:
            full = not json.loads((out / "results.json").read_text()).get("quick", False)
        except (OSError, ValueError, AttributeError):
            full = True
    if full:
        raise ValueError(f"--out {str(out)!r} holds a full arena report; --quick would overwrite it and its "
                         f"checkpoints. Use another --out (default for --quick: {QUICK_OUT}) or add --force")
    return out


KIND_FILE = "arena-kind.txt"


def _seed_plan(args: argparse.Namespace, variants: list[str]) -> list[int]:
    """The extra lm seeds (after ``--seed``)."""
    return [args.seed + i for i in range(1, int(getattr(args, "seeds", 1) or 1))]


def _top_variants(args: argparse.Namespace, runs: dict[str, dict[str, Any]], variants: list[str]) -> list[str]:
    """The variants that get the extra seeds: all, or the ``--seeds-top`` best by lm loss."""
    top = int(getattr(args, "seeds_top", 0) or 0)
    lm = runs.get("lm", {})
    if top <= 0 or top >= len(variants):
        return list(variants)
    ranked = sorted((v for v in variants if v in lm), key=lambda v: lm[v]["final"]["val_loss"])
    return ranked[:top]


#: One run for :meth:`_Plan.run_many`: ``(settings, task, variant, seed or None for --seed)``.
_Call = tuple[TaskSettings, Task, str, int | None]


def _train_in_worker(s: TaskSettings, task: Task, variant: str, args: argparse.Namespace, out: Path,
                     device: torch.device, seed: int | None, label: str) -> tuple[dict[str, Any], bool]:
    """One run in a worker process: ``(record, reused)``."""
    run = _Run(s, task, variant, args, out, device, seed=seed, label=label)
    return run.execute(), run.reused


class _Plan:
    """Every run of this invocation, trained in this process or in worker processes
    (:func:`attnzoo.arena.workers.worker_plan`), with the overall progress line."""

    def __init__(self, args: argparse.Namespace, settings: dict[str, TaskSettings], variants: list[str],
                 enabled: bool, world: int = 1) -> None:
        self.args, self.settings, self.variants = args, settings, variants
        extra = _seed_plan(args, variants) if "lm" in settings else []
        top = int(getattr(args, "seeds_top", 0) or 0)
        n_top = len(variants) if top <= 0 else min(top, len(variants))
        weights = [self._weight(t) for t in settings for _ in variants for _ in _lr_settings(args, settings[t])]
        if extra:
            weights += [self._weight("lm")] * (len(extra) * n_top)
        self.overall = Overall(weights, enabled=enabled)
        self.extra_seeds = extra
        self.started = 0
        if world > 1 or getattr(args, "context_parallel", False):
            self.jobs, self.threads = 1, args.threads  # torchrun: the ranks share each run
        else:
            self.jobs, self.threads = worker_plan(args, len(weights), parallel_by_default=False)
        self.workers = Workers(self.jobs, self.threads)

    def __enter__(self) -> _Plan:
        if self.jobs > 1:
            self.workers.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.workers.__exit__(*exc)

    def _weight(self, t: str) -> float:
        s = self.settings[t]
        return float(s.horizon * s.batch * s.seq_len * s.width * s.depth)

    @staticmethod
    def _name(s: TaskSettings, variant: str, seed: int | None) -> str:
        return f"{s.task}-{variant}" + ("" if seed is None else f" seed {seed}")

    def run(self, s: TaskSettings, task: Task, variant: str, out: Path, device: torch.device,
            seed: int | None = None) -> dict[str, Any]:
        label = self.overall.start(self._name(s, variant, seed))
        run = _Run(s, task, variant, self.args, out, device, seed=seed, label=label)
        record = run.execute()
        self.overall.finish(trained=not run.reused)
        return record

    def run_many(self, calls: list[_Call], out: Path, device: torch.device) -> list[dict[str, Any]]:
        """Train ``calls``; their records in the same order. In worker processes when ``self.jobs > 1``
        (each worker prints plain progress lines; this process one ``done i/N`` line per run)."""
        if self.jobs == 1:
            return [self.run(s, task, v, out, device, seed) for s, task, v, seed in calls]
        wargs = argparse.Namespace(**{**vars(self.args), "progress": "plain" if self.overall.enabled else "none"})
        labels = [f"{self.started + i + 1}/{self.overall.total}" for i in range(len(calls))]
        self.started += len(calls)
        records: list[dict[str, Any]] = [{} for _ in calls]
        jobs = [(s, task, v, wargs, out, device, seed, label) for (s, task, v, seed), label in zip(calls, labels, strict=True)]
        for i, result, exc in self.workers.completed(_train_in_worker, jobs):
            if exc is not None:
                raise exc
            records[i], reused = result
            s, _, v, seed = calls[i]
            self.overall.completed(f"{self._name(s, v, seed)}: {_brief(records[i]['final'])}", self._weight(s.task),
                                   trained=not reused)
        return records


def _lr_settings(args: argparse.Namespace, s: TaskSettings) -> list[TaskSettings]:
    """The settings a (task, variant) trains under: one, or with ``--lr-sweep`` one per learning
    rate of :func:`attnzoo.arena.fairness.sweep_lrs` (mqar only)."""
    if not getattr(args, "lr_sweep", False) or s.task != "mqar":
        return [s]
    return [replace(s, lr=lr) for lr in sweep_lrs(s.lr)]


def _train_all(plan: _Plan, task_objs: dict[str, Task], out: Path, device: torch.device
               ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every run: ``(runs, seed_runs)`` (``seed_runs``: the extra lm seeds and who got them)."""
    runs: dict[str, dict[str, Any]] = {t: {} for t in plan.settings}
    calls: list[_Call] = [(s, task_objs[t], v, None) for t, s in plan.settings.items() for v in plan.variants
                          for s in _lr_settings(plan.args, s)]
    swept: dict[str, dict[float, dict[str, Any]]] = {}
    for (s, _, v, _), record in zip(calls, plan.run_many(calls, out, device), strict=True):
        if len(_lr_settings(plan.args, plan.settings[s.task])) > 1:
            swept.setdefault(v, {})[s.lr] = record
        else:
            runs[s.task][v] = record
    for v, by_lr in swept.items():  # --lr-sweep: the best learning rate of every mqar variant
        runs["mqar"][v] = best_lr_record(by_lr)
    seed_runs: dict[str, Any] = {"seeds": [plan.args.seed], "variants": [], "finals": {}}
    if plan.extra_seeds and "lm" in runs:
        top = _top_variants(plan.args, runs, plan.variants)
        seed_runs.update(seeds=[plan.args.seed, *plan.extra_seeds], variants=top,
                         all_variants=len(top) == len(plan.variants))
        extra: list[_Call] = [(plan.settings["lm"], task_objs["lm"], v, seed) for v in top for seed in plan.extra_seeds]
        finals = {v: [runs["lm"][v]["final"]] for v in top}
        for (_, _, v, _), record in zip(extra, plan.run_many(extra, out, device), strict=True):
            finals[v].append(record["final"])
        seed_runs["finals"] = finals
    return runs, seed_runs


def _measure_all(args: argparse.Namespace, settings: dict[str, TaskSettings], task_objs: dict[str, Task],
                 variants: list[str], device: torch.device) -> dict[str, Any]:
    """The measurement pass and the long-context costs (``{}`` with ``--no-measure``)."""
    if not getattr(args, "measure", True):
        return {}
    t = "lm" if "lm" in settings else next(iter(settings))
    s = settings[t]
    lengths = (32, 64) if args.quick else (128, 512, 2048)
    if args.rank_zero_msgs:
        print(f"arena: measurement pass: {len(variants)} variants interleaved (train step, prefill, decode at "
              f"{', '.join(map(str, lengths))} cached tokens)", file=sys.stderr, flush=True)
    m = measure_pass(lambda v: _build_model(s, v, task_objs[t].vocab_size, args.seed, device,
                                            max_len=max(lengths) + 16),
                     variants, task_objs[t], s.batch, args.seed, device, repeats=2 if args.quick else 5,
                     cache_lengths=lengths, decode_steps=2 if args.quick else 8)
    m["task"] = t
    if args.rank_zero_msgs:
        print("arena: long-context costs (measured where bounded, cost model beyond)", file=sys.stderr, flush=True)
    return {"measurements": m, "long_context": long_context(variants, s.width, s.heads, s.depth, s.window, device,
                                                          quick=args.quick)}


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished worker processes."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def interrupted_line(args: argparse.Namespace) -> str:
    """The one line an interrupted arena prints: whether anything of it is on disk to resume from."""
    out = Path(args.out or (QUICK_OUT if args.quick else DEFAULT_OUT))
    kept = [p for d in ("runs", "checkpoints") if (out / d).is_dir() for p in (out / d).iterdir()
            if p.suffix in (".json", ".pt")]
    if not kept:
        return "arena: interrupted; nothing written"
    return (f"arena: interrupted; {len(kept)} run records and checkpoints are kept in {out}: "
            f"resume with --resume")


def _one_line_interrupt(fn: Any) -> Any:
    """``fn(args)`` with Ctrl-C (SIGINT) at any point, start-up included, as :func:`interrupted_line`
    on stderr and exit code 130 instead of a ``KeyboardInterrupt`` traceback."""

    @functools.wraps(fn)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            with remembered_interrupts():  # a Ctrl-C a library swallows is raised again at the next step
                return fn(args)
        except KeyboardInterrupt:
            print(interrupted_line(args), file=sys.stderr, flush=True)
            return interrupted_exit_code()

    return wrapped


@_one_line_interrupt
def run_arena(args: argparse.Namespace) -> int:
    """Run the arena described by ``args`` (from :func:`add_arena_arguments`); returns an exit code.

    Writes ``report.md``, ``index.html``, ``results.json`` and the plots to ``--out``
    (rank 0 only under ``torchrun``). Raises ``ValueError`` for bad settings, before any training
    (an ``--out`` that cannot be written, or a ``--quick`` run over a full report, included).
    Ctrl-C prints one line (:func:`interrupted_line`) and returns 130.
    """
    grid_only = [f"--{k.replace('_', '-')}" for k in ("grid_widths", "grid_pairs", "grid_seq_lens")
                 if getattr(args, k, None) is not None]
    if grid_only and args.task != "mqar-grid":
        raise ValueError(f"{', '.join(grid_only)}: only for --task mqar-grid (got --task {args.task})")
    if getattr(args, "preset", None):
        return run_preset(args)
    if args.task == "mqar-grid":
        return run_grid(args, _grid_builder(args))
    cp = getattr(args, "context_parallel", False) is True  # with N (FSDP2), every shardable variant
    variants = _parse_variants(args.variants, cp)
    tasks = list(TASKS) if args.task == "all" else [args.task]
    if args.task not in (*TASKS, "all"):
        raise ValueError(f"--task must be one of {(*TASKS, 'all', 'mqar-grid')}, got {args.task!r}")
    device = _check_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings, notes = deepen_for_patterns({t: settings_for(t, args) for t in tasks}, variants,
                                          getattr(args, "depth", None) is not None)
    task_objs = {t: _make_task(s) for t, s in settings.items()}  # validates seq_len / pairs early
    out = resolve_out(args)
    created = init_distributed(device)
    try:
        rank, world = rank_and_world()
        args.rank_zero_msgs = rank == 0 and args.progress != "none"
        for note in notes if args.rank_zero_msgs else ():
            print(note, file=sys.stderr, flush=True)
        if device.type == "cuda" and world > 1:
            device = torch.device("cuda", torch.cuda.current_device())
        _check_world(settings, cp, rank, world)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / KIND_FILE, "quick\n" if args.quick else "full\n")
        t0, c0 = time.perf_counter(), _cpu_seconds()
        with _Plan(args, settings, variants, args.rank_zero_msgs, world) as plan:
            runs, seed_runs = _train_all(plan, task_objs, out, device)
        extra = _measure_all(args, settings, task_objs, variants, device) if rank == 0 and not cp else {}
        wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
        if rank == 0:
            results = _results(args, settings, task_objs, variants, runs, device, world, wall, cpu)
            results.update(extra, seed_runs=seed_runs)
            results["environment"].update(train_jobs=plan.jobs, train_threads=plan.threads or torch.get_num_threads())
            results["verdict"] = verdict(results)
            paths = write_report(results, out)
            print(summary_text(results, paths), flush=True)
    finally:
        if created:
            cleanup_distributed()
    return 0
