"""A small, deterministic trainer: AdamW, linear warm-up, cosine decay, checkpoints, data parallel.

Data parallelism (``torchrun --nproc_per_node=N``): every rank builds the SAME global batch (batches
are a pure function of ``(seed, step)``, see :mod:`attnzoo.arena.tasks`) and trains on its own
contiguous slice of rows. Each rank's loss is its slice's share of the *global* token-mean loss,
scaled by the world size because DistributedDataParallel averages gradients over ranks; so the
averaged gradient is exactly the gradient of the global-batch loss, and the loss curve equals a
single process's up to floating-point reassociation.

Context parallelism (``sequence_layout=...``, the arena's ``--context-parallel``): every rank takes
ALL rows of the global batch but only its shard of the sequence positions
(:func:`attnzoo.distributed.shard_positions`); the model (wrapped by
:func:`attnzoo.distributed.context_parallel`) runs ring attention across the ranks. Each rank's loss
is its tokens' share of the global token mean and the gradients are summed over the ranks (one
``all_reduce`` of a flat buffer after the backward pass), which again gives the gradient of the
global-batch loss.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from attnzoo._interrupt import raise_if_interrupted
from attnzoo._validate import check_int
from attnzoo.arena.parallel import ParallelPlan
from attnzoo.arena.storage import load_checkpoint, save_checkpoint
from attnzoo.arena.tasks import IGNORE, Task
from attnzoo.distributed import shard_positions

__all__ = [
    "StepInfo",
    "TrainConfig",
    "cleanup_distributed",
    "config_dict",
    "gpt2_init",
    "init_distributed",
    "load_checkpoint",
    "lr_at",
    "make_optimizer",
    "rank_and_world",
    "save_checkpoint",
    "train",
]


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation hyper-parameters (AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``)."""

    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    compile: bool = False  # training forwards (and their backward) through torch.compile(model)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"TrainConfig: lr must be > 0, got {self.lr}")
        check_int(self.warmup, "warmup", "TrainConfig", minimum=0)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig: weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"TrainConfig: grad_clip must be > 0 or None, got {self.grad_clip}")


@dataclass(frozen=True)
class StepInfo:
    """What the trainer reports after each optimiser step (to progress bars and checkpointing)."""

    step: int  # 1-based number of completed steps
    steps: int
    loss: float  # global-batch training loss of this step
    lr: float
    tokens_per_s: float  # global tokens per second of training so far (this call)


def lr_at(step: int, steps: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based ``step`` of ``steps``: linear warm-up, then cosine to ``min_lr_ratio * lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def gpt2_init(model: nn.Module) -> None:
    """GPT-2 style initialisation of every ``Linear`` and ``Embedding`` weight: N(0, 0.02), zero biases
    (also Zoology's ``_init_weights``).

    With a tied LM head, unit-variance embeddings would start the loss far above ``ln V``; small
    weights start every variant near the uniform prediction, which keeps a short budget fair.
    """
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (dim >= 2) only, not on biases and norm gains."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, foreach=False)


# --------------------------------------------------------------------------- distributed
def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> bool:
    """Join the process group that ``torchrun`` describes (``WORLD_SIZE > 1``): gloo on CPU, NCCL on
    CUDA (one GPU per local rank), with a timeout so a dead rank fails instead of hanging.

    Returns True when this call created the group (and :func:`cleanup_distributed` should end it).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_available():  # pragma: no cover - torch built without distributed
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


def cleanup_distributed() -> None:
    """Destroy the default process group if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- training
def train(
    model: nn.Module,
    task: Task,
    steps: int,
    global_batch: int,
    seed: int,
    *,
    config: TrainConfig | None = None,
    device: torch.device | str = "cpu",
    start_step: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    checkpoint: Callable[[int, torch.optim.Optimizer], None] | None = None,
    checkpoint_every: int = 0,
    sequence_layout: str | None = None,
    parallel: ParallelPlan | None = None,
) -> list[float]:
    """Train ``model`` on ``task`` for steps ``start_step .. steps - 1``; returns the per-step
    global-batch training losses of those steps.

    Under an initialised process group of ``W > 1`` ranks the model is wrapped in
    ``DistributedDataParallel`` and each rank trains on rows ``[r * B / W, (r + 1) * B / W)`` of the
    global batch (``global_batch`` must be divisible by ``W``); the returned losses are the global
    ones on every rank.

    Args:
        model: maps ``tokens [B, N]`` to ``logits [B, N, V]``; already on ``device``.
        task: batches ``(inputs [B, N], targets [B, N])``, see :class:`attnzoo.arena.tasks.Task`.
        steps: total optimiser steps of the schedule (the cosine ends here).
        global_batch: sequences per step summed over all ranks.
        seed: selects the batches (``task.batch(step, global_batch, seed)``).
        config: optimiser and schedule; default :class:`TrainConfig()`.
        start_step: resume from here (with the saved ``optimizer``); the losses of steps before it
            are not recomputed.
        optimizer: an AdamW from :func:`make_optimizer` (e.g. restored from a checkpoint).
        on_step: called after every step with a :class:`StepInfo`.
        checkpoint: ``checkpoint(completed_steps, optimizer)`` every ``checkpoint_every`` steps and
            after the last one (call it from rank 0 only if it writes files).
        sequence_layout: ``None`` (data parallel) or ``"contiguous"`` / ``"zigzag"``: context
            parallel over the process group, with ``model`` already wrapped by
            :func:`attnzoo.distributed.context_parallel` with the same layout; ``model(tokens,
            positions=...)`` gets this rank's shard of every row and the shard's global positions.
            The sequence length must suit the layout (``zigzag``: divisible by ``2 * world``).
        parallel: FSDP2 + context parallelism, see :mod:`attnzoo.arena.parallel` (after ``parallelize``).
    """
    steps, global_batch, start_step = _checked_train_args(steps, global_batch, start_step, seed, sequence_layout)
    cfg = config or TrainConfig()
    device = torch.device(device)
    rank, world = rank_and_world()
    sharded, rows, positions = _split(task, global_batch, rank, world, sequence_layout, parallel, device)
    opt = optimizer if optimizer is not None else make_optimizer(model, cfg)
    net: nn.Module = model
    if world > 1 and not sharded and parallel is None:
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:  # training steps only: evaluation and decoding call the eager model
        net = torch.compile(net)
    model.train()
    losses: list[float] = []
    tokens = 0
    busy = 0.0  # seconds spent in training steps (callbacks and checkpoints excluded)
    for step in range(start_step, steps):
        raise_if_interrupted()  # a Ctrl-C that a library swallowed (see attnzoo._interrupt)
        t0 = time.perf_counter()
        lr = lr_at(step, steps, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = task.batch(step, global_batch, seed)  # [B, N] each, the global batch
        loss, n_tokens = _train_step(model, net, opt, cfg, task, step, x[rows].to(device), y[rows].to(device),
                                     int((y != IGNORE).sum()), positions, sum_grads=sharded)
        if not math.isfinite(loss):
            raise FloatingPointError(f"train: loss became {loss} at step {step} (lr {lr:.2e}); "
                                     f"lower the learning rate")
        losses.append(loss)
        tokens += n_tokens * world
        busy += time.perf_counter() - t0
        done = step + 1
        if on_step is not None:
            on_step(StepInfo(done, steps, loss, lr, tokens / max(busy, 1e-9)))
        if checkpoint is not None and ((checkpoint_every and done % checkpoint_every == 0) or done == steps):
            checkpoint(done, opt)
    model.eval()
    return losses


def _split(task: Task, global_batch: int, rank: int, world: int, sequence_layout: str | None,
           parallel: ParallelPlan | None, device: torch.device) -> tuple[bool, slice, torch.Tensor | None]:
    """``(sum the gradients here, this rank's rows, its positions of every row or None)``."""
    if parallel is not None:  # FSDP2 reduces the gradients; the step is the DDP one on a mesh
        return False, parallel.rows(global_batch), parallel.positions(task.seq_len, device)
    if global_batch % world:
        raise ValueError(f"train: global_batch ({global_batch}) must be divisible by the world size ({world})")
    sharded = sequence_layout is not None and world > 1
    local = global_batch if sharded else global_batch // world
    rows = slice(0, global_batch) if sharded else slice(rank * local, (rank + 1) * local)
    positions = None
    if sharded:
        positions = shard_positions(task.seq_len, layout=str(sequence_layout), device=device)  # [n]
    return sharded, rows, positions


def _checked_train_args(steps: int, global_batch: int, start_step: int, seed: int,
                        sequence_layout: str | None) -> tuple[int, int, int]:
    steps = check_int(steps, "steps", owner="train")
    global_batch = check_int(global_batch, "global_batch", owner="train")
    start_step = check_int(start_step, "start_step", minimum=0, owner="train")
    if start_step > steps:
        raise ValueError(f"train: start_step ({start_step}) is beyond steps ({steps})")
    check_int(seed, "seed", "train", minimum=None)
    if sequence_layout is not None and sequence_layout not in ("contiguous", "zigzag"):
        raise ValueError(f"train: sequence_layout must be None, 'contiguous' or 'zigzag', got {sequence_layout!r}")
    return steps, global_batch, start_step


def _train_step(model: nn.Module, net: nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig, task: Task,
                step: int, x: torch.Tensor, y: torch.Tensor, scored: int,
                positions: torch.Tensor | None, sum_grads: bool = True) -> tuple[float, int]:
    """One optimiser step on this rank's rows ``x, y [b, N]``; returns the global-batch loss and the
    number of tokens this rank trained on.

    ``scored`` counts the scored targets of the whole global batch; ``positions`` (context
    parallel) selects this rank's shard of every row; ``sum_grads``: sum the gradients over the
    ranks here (context parallel without FSDP), else DDP/FSDP2 average them.
    """
    if scored == 0:
        raise ValueError(f"train: batch {step} of task {task.name!r} has no scored targets")
    _, world = rank_and_world()
    if positions is not None:  # context parallel: this rank's positions of every row
        x, y = x[:, positions], y[:, positions]
        logits = net(x, positions=positions)  # [B, n, V]
    else:
        logits = net(x)  # [b, N, V]
    loss_sum = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(),
                                           ignore_index=IGNORE, reduction="sum")
    share = loss_sum / scored  # this rank's share of the global mean
    if positions is not None and sum_grads:
        share.backward()
        _sum_gradients(model)
    else:
        (share * world).backward()  # DDP divides the summed gradient by world
    if cfg.grad_clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    global_loss = share.detach()
    if world > 1:
        dist.all_reduce(global_loss)  # sum of shares = global mean
    return float(global_loss), x.numel()


def _sum_gradients(model: nn.Module) -> None:
    """Sum every parameter's gradient over the ranks (one all_reduce of a flat buffer)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
        offset += n


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg`` as JSON-ready data."""
    out = asdict(cfg)
    out["betas"] = list(cfg.betas)
    return out
