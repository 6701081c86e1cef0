"""``attnzoo arena``: train one small model per attention variant on each task, then write the report.

Every variant of a task gets the same width, depth, heads, steps, batch, learning-rate schedule and
seed; the model differs only in its attention. See ``docs/arena.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from attnzoo._outputs import ensure_output_dir
from attnzoo._validate import positive_float_arg as _positive_float
from attnzoo._validate import positive_int_arg as _positive_int
from attnzoo.arena.measure import decode_speed, state_bytes, training_memory
from attnzoo.arena.progress import PROGRESS_KINDS, make_progress
from attnzoo.arena.report import write_report
from attnzoo.arena.storage import (
    DamagedFile,
    first_line,
    read_checkpoint,
    read_run_record,
    save_checkpoint,
    set_aside,
    write_atomic,
)
from attnzoo.arena.tasks import MQARTask, ShakespeareTask, Task
from attnzoo.arena.trainer import (
    StepInfo,
    TrainConfig,
    cleanup_distributed,
    config_dict,
    init_distributed,
    make_optimizer,
    rank_and_world,
    train,
)
from attnzoo.distributed import ContextParallel, context_parallel, gather_sequence, shard_positions
from attnzoo.models import DecoderLM
from attnzoo.variants import VARIANTS, variant_names

__all__ = ["CONTEXT_PARALLEL_VARIANTS", "DEFAULT_VARIANTS", "TASKS", "TaskSettings", "add_arena_arguments",
           "build_model", "run_arena", "settings_for"]

#: Every registered variant, in the registry's order.
DEFAULT_VARIANTS = tuple(VARIANTS)
#: Variants whose attention runs on a ring (:func:`attnzoo.distributed.context_parallel`).
CONTEXT_PARALLEL_VARIANTS = tuple(name for name, spec in VARIANTS.items() if spec.ring)
#: Sequence layout of ``--context-parallel``: zigzag balances causal work over the ranks.
CONTEXT_PARALLEL_LAYOUT = "zigzag"
TASKS = ("lm", "mqar")
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


# The default budget (see docs/arena.md for how it was chosen and what it reaches).
_DEFAULTS = {
    "lm": TaskSettings("lm", seq_len=128, steps=200, batch=32, width=128, depth=2, heads=4, lr=3e-3, warmup=20,
                       eval_every=40),
    "mqar": TaskSettings("mqar", seq_len=32, steps=600, batch=128, width=64, depth=2, heads=4, lr=3e-3,
                         warmup=300, eval_every=100, num_kv_pairs=4, vocab_size=64, window=8, pos="learned"),
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
        s = replace(s, eval_every=max(1, min(s.eval_every, s.steps)))
        if "warmup" not in over:
            s = replace(s, warmup=min(s.warmup, max(1, s.steps // 10)))
    if s.warmup >= s.steps:
        raise ValueError(f"--warmup ({s.warmup}) must be smaller than --steps ({s.steps}) for task {task}")
    return s


def add_arena_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``attnzoo arena`` options to ``parser``."""
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated registry names (default: {','.join(DEFAULT_VARIANTS)}; with "
                             f"--context-parallel: {','.join(CONTEXT_PARALLEL_VARIANTS)})")
    parser.add_argument("--task", choices=(*TASKS, "all"), default="all", help="which task(s) to run (default: all)")
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
    parser.add_argument("--out", default="arena-report", help="report directory (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny budget for smoke tests (under 2 minutes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse finished runs and continue unfinished ones from their checkpoints in --out")
    parser.add_argument("--checkpoint-every", dest="checkpoint_every", type=_positive_int, default=100,
                        help="steps between checkpoints (default: %(default)s)")
    parser.add_argument("--progress", choices=PROGRESS_KINDS, default="auto",
                        help="progress display (default: tqdm, else rich, else plain lines)")
    parser.add_argument("--compile", action="store_true",
                        help="train through torch.compile(model) (forward and backward of every training step); "
                             "evaluation and decoding stay eager")
    parser.add_argument("--context-parallel", dest="context_parallel", action="store_true",
                        help="under torchrun: shard every sequence over the ranks (zigzag layout) and run ring "
                             "attention instead of splitting the batch; softmax variants only "
                             f"({','.join(CONTEXT_PARALLEL_VARIANTS)}); --seq-len must be divisible by 2 x ranks")


def _parse_variants(text: str | None, context_parallel: bool = False) -> list[str]:
    if text is None:
        return list(CONTEXT_PARALLEL_VARIANTS if context_parallel else DEFAULT_VARIANTS)
    names = [v.strip() for v in str(text).split(",") if v.strip()]
    known = variant_names()
    bad = [v for v in names if v not in known]
    if not names or bad:
        raise ValueError(f"--variants: unknown or empty {bad or text!r}; expected a comma-separated subset of {known}")
    if len(set(names)) != len(names):
        raise ValueError(f"--variants: {text!r} names a variant twice")
    if context_parallel:
        ring_less = [v for v in names if v not in CONTEXT_PARALLEL_VARIANTS]
        if ring_less:
            raise ValueError(f"--context-parallel: variants {ring_less} have no ring-attention form (their "
                             f"attention is a mask pattern or a recurrent state); use a subset of "
                             f"{list(CONTEXT_PARALLEL_VARIANTS)}")
    return names


def _make_task(s: TaskSettings) -> Task:
    if s.task == "lm":
        return ShakespeareTask(seq_len=s.seq_len)
    return MQARTask(seq_len=s.seq_len, num_kv_pairs=s.num_kv_pairs, vocab_size=s.vocab_size)


def _build_model(s: TaskSettings, variant: str, vocab: int, seed: int, device: torch.device) -> torch.nn.Module:
    akw = VARIANTS[variant].arena_settings(s.width, s.heads, s.window)  # e.g. window, performer's F
    torch.manual_seed(seed)
    model = DecoderLM(vocab, s.width, s.depth, s.heads, attention=variant, attention_kwargs=akw or None,
                      max_seq_len=max(s.seq_len, len(SAMPLE_PROMPT) + _sample_len(s)), pos=s.pos, device=device)
    _gpt2_init(model)
    return model


def build_model(s: TaskSettings, variant: str, vocab: int, seed: int,
                device: torch.device | str = "cpu") -> torch.nn.Module:
    """The arena's model for ``variant`` under settings ``s`` (what a checkpoint's weights fit)."""
    return _build_model(s, variant, vocab, seed, torch.device(device))


def _sample_len(s: TaskSettings) -> int:
    """New tokens of the greedy sample: fill the training window (at least 32)."""
    return max(32, s.seq_len - len(SAMPLE_PROMPT))


@torch.no_grad()
def _gpt2_init(model: torch.nn.Module) -> None:
    """GPT-2 style initialisation of every ``Linear`` and ``Embedding`` weight: N(0, 0.02), zero biases.

    With a tied LM head, unit-variance embeddings would start the loss far above ``ln V``; small
    weights start every variant near the uniform prediction, which keeps a short budget fair.
    """
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                torch.nn.init.zeros_(m.bias)


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


class _Run:
    """One (task, variant) training run with evaluation, checkpoints and measurements."""

    def __init__(self, s: TaskSettings, task: Task, variant: str, args: argparse.Namespace, out: Path,
                 device: torch.device) -> None:
        self.s, self.task, self.variant, self.args, self.out, self.device = s, task, variant, args, out, device
        self.rank, self.world = rank_and_world()
        self.name = f"{s.task}-{variant}"
        self.ckpt = out / "checkpoints" / f"{self.name}.pt"
        self.done_file = out / "runs" / f"{self.name}.json"
        self.cp = bool(getattr(args, "context_parallel", False)) and self.world > 1
        self.sig = _signature(s, variant, args.seed, self.world, self.cp)

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
        return data if data.get("signature") == self.sig else None

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
                             f"({state['extra'].get('signature')}); expected {self.sig}. "
                             f"Use another --out or drop --resume")
        if not 0 <= int(state["step"]) <= self.s.steps:
            self._warn(self.ckpt, f"is at step {state['step']}, outside the {self.s.steps} steps of the run")
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
            return done
        s, args = self.s, self.args
        cfg = TrainConfig(lr=s.lr, warmup=s.warmup, compile=bool(getattr(args, "compile", False)))
        model = _build_model(s, self.variant, self.task.vocab_size, args.seed, self.device)
        opt = make_optimizer(model, cfg)
        start, losses, evals = self._restore(model, opt)
        evaluated: torch.nn.Module = model
        if self.cp:
            context_parallel(model, layout=CONTEXT_PARALLEL_LAYOUT)
            evaluated = _GatheredLM(model, CONTEXT_PARALLEL_LAYOUT)
        if start == 0:
            evals.append({"step": 0, **self.task.evaluate(evaluated, self.device, args.seed)})
        last, wall, cpu = self._train(model, evaluated, cfg, opt, start, losses, evals)
        if start == s.steps and not evals:
            evals.append({"step": s.steps, **self.task.evaluate(evaluated, self.device, args.seed)})
        result: dict[str, Any] = {
            "task": s.task, "variant": self.variant, "signature": self.sig,
            "params": int(model.num_parameters()),  # type: ignore[operator]
            "train_losses": losses, "evals": evals, "final": {k: v for k, v in evals[-1].items() if k != "step"},
            "train_tokens_per_s": last.tokens_per_s if last else None, "train_wall_s": wall, "train_cpu_s": cpu,
        }
        result.update(self._measure(model))
        if self.cp:
            result["context_parallel"] = {"layout": CONTEXT_PARALLEL_LAYOUT, "ranks": self.world}
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
        with make_progress(kind, f"{self.name:>18}", s.steps, start) as bar:

            def on_step(info: StepInfo) -> None:
                losses.append(info.loss)
                last[:] = [info]
                bar.update(info)
                if info.step % s.eval_every == 0 or info.step == s.steps:
                    metrics = self.task.evaluate(evaluated, self.device, args.seed)
                    evals.append({"step": info.step, **metrics})
                    bar.note(_brief(metrics))
                    model.train()

            def checkpoint(step: int, optimizer: torch.optim.Optimizer) -> None:
                if self.rank == 0:
                    with _unwrapped(model) as plain:
                        save_checkpoint(self.ckpt, plain, optimizer, step,
                                        {"signature": self.sig, "losses": losses, "evals": evals})

            t0, c0 = time.perf_counter(), time.process_time()
            train(model, self.task, s.steps, s.batch, args.seed, config=cfg, device=self.device,
                  start_step=start, optimizer=opt, on_step=on_step, checkpoint=checkpoint,
                  checkpoint_every=args.checkpoint_every,
                  sequence_layout=CONTEXT_PARALLEL_LAYOUT if self.cp else None)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return (last[0] if last else None), wall, cpu

    def _measure(self, model: torch.nn.Module) -> dict[str, Any]:
        """Memory, decode state and speed, greedy sample (each one recorded as an error if it fails)."""
        out: dict[str, Any] = {}
        model.eval()
        try:
            # one rank's step: its rows of the batch, or (context parallel) every row at 1 / world of the positions
            out["memory"] = training_memory(model, self.task, self.s.batch if self.cp else self.s.batch // self.world,
                                            self.args.seed, self.device,
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
            out["sample_t08"] = _sampled_text(model, self.task, prompt, _sample_len(self.s), self.args.seed)
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


def _results(args: argparse.Namespace, settings: dict[str, TaskSettings], task_objs: dict[str, Task],
             variants: list[str], runs: dict[str, dict[str, Any]], device: torch.device, world: int,
             wall: float, cpu: float) -> dict[str, Any]:
    """The contents of ``results.json``."""
    return {
        "attnzoo_arena": 1,
        "settings": {t: asdict(s) for t, s in settings.items()},
        "optimizer": config_dict(TrainConfig()) | {"note": "lr and warmup per task in settings"},
        "seed": args.seed, "variants": variants,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "device": str(device), "threads": torch.get_num_threads(), "world_size": world,
                        "machine": platform.machine()},
        "wall_s": wall, "cpu_s": cpu,
        "prompt": SAMPLE_PROMPT,
        "unigram_val_loss": task_objs["lm"].unigram_loss() if "lm" in task_objs else None,
        "runs": runs,
    }


def run_arena(args: argparse.Namespace) -> int:
    """Run the arena described by ``args`` (from :func:`add_arena_arguments`); returns an exit code.

    Writes ``report.md``, ``index.html``, ``results.json`` and the plots to ``args.out``
    (rank 0 only under ``torchrun``). Raises ``ValueError`` for bad settings, before any training
    (an ``--out`` that cannot be written included).
    """
    cp = bool(getattr(args, "context_parallel", False))
    variants = _parse_variants(args.variants, cp)
    tasks = list(TASKS) if args.task == "all" else [args.task]
    if args.task not in (*TASKS, "all"):
        raise ValueError(f"--task must be one of {(*TASKS, 'all')}, got {args.task!r}")
    device = _check_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = {t: settings_for(t, args) for t in tasks}
    task_objs = {t: _make_task(s) for t, s in settings.items()}  # validates seq_len / pairs early
    out = ensure_output_dir(args.out, "--out")
    created = init_distributed(device)
    try:
        rank, world = rank_and_world()
        if device.type == "cuda" and world > 1:
            device = torch.device("cuda", torch.cuda.current_device())
        _check_world(settings, cp, rank, world)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        t0, c0 = time.perf_counter(), time.process_time()
        runs: dict[str, dict[str, Any]] = {t: {} for t in tasks}
        for t in tasks:
            for v in variants:
                runs[t][v] = _Run(settings[t], task_objs[t], v, args, out, device).execute()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if rank == 0:
            results = _results(args, settings, task_objs, variants, runs, device, world, wall, cpu)
            paths = write_report(results, out)
            print(f"arena: {len(variants)} variants x {len(tasks)} task(s) in {wall:.0f} s; report: "
                  f"{paths['md']} (open {paths['html']} in a browser)", file=sys.stderr)
    finally:
        if created:
            cleanup_distributed()
    return 0
