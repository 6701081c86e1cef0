"""FSDP2 + context parallelism for the arena trainer on a 2-D ``("dp", "cp")`` DeviceMesh.

``torchrun --nproc_per_node=W -m attnzoo arena --context-parallel N ...`` puts the ``W`` ranks on a
``(W / N, N)`` mesh: every sequence is sharded over the ``N`` ranks of a ``"cp"`` row
(:func:`attnzoo.distributed.context_parallel`, zigzag layout) and the global batch's rows over the
``W / N`` rows of ``"dp"``. The parameters are sharded with ``torch.distributed.fsdp.fully_shard``
on the whole mesh (HSDP: sharded over ``"cp"``, replicated over ``"dp"``), so the gradient FSDP2
reduces is the mean over all ``W`` ranks; each rank's loss is its tokens' share of the global
token-mean loss times ``W``, which makes that mean the gradient of the global-batch loss (the loss
curve equals one process's up to float reassociation; tested in ``tests/test_context_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from attnzoo._validate import check_int
from attnzoo.distributed import context_parallel, gather_sequence, shard_positions

__all__ = ["GatheredModel", "ParallelPlan", "full_state_dict", "make_plan", "parallelize", "plain_copy",
           "plan_from_args"]


@dataclass(frozen=True)
class ParallelPlan:
    """Where this rank sits on the ``("dp", "cp")`` mesh and how sequences are cut."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh, dims ("dp", "cp")
    layout: str = "zigzag"
    method: str = "ring"

    @property
    def dp(self) -> int:
        return int(self.mesh["dp"].size())

    @property
    def cp(self) -> int:
        return int(self.mesh["cp"].size())

    @property
    def cp_group(self) -> Any:
        return self.mesh["cp"].get_group()

    def rows(self, global_batch: int) -> slice:
        """This rank's rows of the global batch (its ``"dp"`` coordinate)."""
        if global_batch % self.dp:
            raise ValueError(f"train: global_batch ({global_batch}) must be divisible by the data-parallel size "
                             f"({self.dp} = world / context-parallel size)")
        per = global_batch // self.dp
        r = int(self.mesh.get_local_rank("dp"))
        return slice(r * per, (r + 1) * per)

    def positions(self, seq_len: int, device: torch.device) -> Tensor:
        """The global positions of this rank's shard of every sequence ``[n]``."""
        return shard_positions(seq_len, group=self.cp_group, layout=self.layout, device=device)


def make_plan(context_parallel_size: int, *, layout: str = "zigzag", method: str = "ring",
              device_type: str = "cpu") -> ParallelPlan:
    """The ``(world / N, N)`` mesh of the default process group for ``N = context_parallel_size``."""
    n = check_int(context_parallel_size, "context_parallel_size", owner="make_plan")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("make_plan: --context-parallel N needs torchrun (an initialised process group)")
    world = dist.get_world_size()
    if world % n:
        raise ValueError(f"--context-parallel {n}: the world size {world} must be a multiple of {n}")
    mesh = init_device_mesh(device_type, (world // n, n), mesh_dim_names=("dp", "cp"))
    return ParallelPlan(mesh, layout, method)


def parallelize(model: nn.Module, plan: ParallelPlan) -> nn.Module:
    """Context parallelism over ``"cp"``, then FSDP2 (``fully_shard``) of every block and of the
    root on the whole mesh; in place. Build the optimizer afterwards (it must see the sharded
    parameters)."""
    context_parallel(model, plan.mesh["cp"], plan.layout, plan.method)
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=plan.mesh)
    fully_shard(model, mesh=plan.mesh)
    return model


class GatheredModel(nn.Module):
    """The full-sequence view of a parallelized model for evaluation: every rank passes the same
    ``tokens [B, N]``, runs its shard and gets all logits ``[B, N, V]`` back (gathered over ``"cp"``)."""

    def __init__(self, model: nn.Module, plan: ParallelPlan) -> None:
        super().__init__()
        self.model, self.plan = model, plan

    def forward(self, tokens: Tensor) -> Tensor:
        pos = self.plan.positions(tokens.shape[1], tokens.device)
        out = self.model(tokens[:, pos], positions=pos)
        return gather_sequence(out, 1, group=self.plan.cp_group, layout=self.plan.layout)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer as a full (unsharded) CPU tensor, with the plain model's names
    (the ``.module`` of the context-parallel wrappers removed). A collective: call on every rank."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name.replace(".module.", ".")] = full.detach().cpu()
    return out


def plain_copy(model: nn.Module, fresh: nn.Module) -> nn.Module:
    """``fresh`` (an unwrapped model of the same architecture) with the trained weights of the
    parallelized ``model``; a collective (call on every rank). For measurements and decoding."""
    fresh.load_state_dict(full_state_dict(model))
    return fresh


def plan_from_args(args: Any) -> ParallelPlan | None:
    """The mesh of ``--context-parallel N`` (``None`` without N: the flag alone, or absent)."""
    n = getattr(args, "context_parallel", False)
    if isinstance(n, bool) or n is None:
        return None
    return make_plan(int(n), device_type="cuda" if str(getattr(args, "device", "cpu")).startswith("cuda") else "cpu")
