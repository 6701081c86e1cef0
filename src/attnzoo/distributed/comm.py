"""Process groups and the ring exchange: rank checks, timeouts that name the failing peer, and
overlapped point-to-point sends/receives between the neighbours of a ring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnzoo._validate import check_int


def require_dist(fn: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{fn} needs an initialised torch.distributed process group "
                           "(launch with torchrun, or call torch.distributed.init_process_group)")


def rank_and_size(group: Any, rank: int | None, world_size: int | None, fn: str) -> tuple[int, int]:
    """``(rank, world_size)`` from explicit arguments or from the process group."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"{fn}: pass both rank and world_size or neither, got rank={rank!r}, "
                         f"world_size={world_size!r}")
    if rank is None or world_size is None:
        require_dist(fn)
        return dist.get_rank(group), dist.get_world_size(group)
    for name, x in (("rank", rank), ("world_size", world_size)):
        check_int(x, name, minimum=None, owner=fn)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{fn}: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def as_timeout(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, a timedelta or None, got {timeout!r}")
    return timedelta(seconds=float(timeout))


def wait(work: Any, timeout: timedelta | None, rank: int, what: str) -> None:
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError
        raise RuntimeError(f"rank {rank}: {what} failed ({str(e).strip().splitlines()[0] if str(e).strip() else e!r}). "
                           "A peer process may have died, timed out, or called this with different "
                           "arguments.") from e


class Ring:
    """Point-to-point exchange with the neighbours of this rank in a process group's ring."""

    def __init__(self, group: Any, timeout: timedelta | None) -> None:
        self.group = group
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process "
                             f"group passed as group=")
        self.size = dist.get_world_size(group)
        pg = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(pg, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(pg, (self.rank - 1) % self.size)

    def start(self, send: Sequence[Tensor], recv_like: Sequence[tuple[tuple[int, ...], torch.dtype]],
              tag: int, what: str) -> Pending:
        """Send ``send`` to the next rank and receive tensors of the given shapes from the previous one."""
        send = [t.contiguous() for t in send]
        bufs = [torch.empty(shape, dtype=dt, device=send[0].device) for shape, dt in recv_like]
        # One batch per exchange: NCCL needs matching sends/receives grouped to avoid deadlock.
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group, tag + i) for i, b in enumerate(bufs)]
        works = dist.batch_isend_irecv(ops)
        return Pending(works, bufs, send, what)

    def finish(self, p: Pending) -> list[Tensor]:
        for w in p.works:
            wait(w, self.timeout, self.rank,
                  f"ring exchange of {p.what} with ranks {self.prev} (recv) / {self.next} (send)")
        return p.bufs


@dataclass
class Pending:
    works: list[Any]
    bufs: list[Tensor]
    keep: list[Tensor]  # tensors being sent, kept alive until the send completes
    what: str


