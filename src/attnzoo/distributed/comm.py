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




# ----------------------------------------------------------------------------- groups and meshes
def resolve_group(group: Any, fn: str) -> Any:
    """A process group from ``group``: ``None`` (the world), a ``ProcessGroup``, a 1-D
    ``DeviceMesh`` (e.g. ``mesh["cp"]``), or a larger mesh with a dimension named ``"cp"``."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    try:  # DeviceMesh lives in torch.distributed.device_mesh (imported by torch.distributed)
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        DeviceMesh = ()  # type: ignore[assignment,misc]
    if isinstance(group, DeviceMesh):
        if group.ndim == 1:
            return group.get_group()
        names = group.mesh_dim_names or ()
        if "cp" in names:
            return group["cp"].get_group()
        raise ValueError(f"{fn}: group is a {group.ndim}-D DeviceMesh with dimensions {names or '(unnamed)'}; "
                         "pass a 1-D mesh such as mesh['cp'] (or name one dimension 'cp')")
    raise TypeError(f"{fn}: group must be None, a ProcessGroup or a DeviceMesh, got {type(group).__name__}")


def group_device(group: Any) -> torch.device:
    """The device collectives of ``group`` run on (CUDA for NCCL, else CPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group: Any, vals: Sequence[float] | None, err: Exception | None, fn: str,
          timeout: timedelta | None, *, same: Sequence[int] = (), describe: Any = None,
          names: Sequence[str] = ()) -> list[list[float]]:
    """Every rank's ``vals`` (one small ``all_gather``); raise on *every* rank when one rank failed
    its local checks (``err``, re-raised with its type on that rank) or the ranks disagree on the
    entries at indices ``same``. ``describe(vals) -> str`` renders one rank's entry in the error;
    ``names`` name the entries there."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    width = 1 + (len(vals) if vals is not None else 0)
    n = max(width, 64)  # a failed rank does not know the width: every rank sends a fixed-size vector
    mine = torch.zeros(n, dtype=torch.float64, device=group_device(group))
    if vals is not None:
        mine[0] = 1.0
        mine[1:width] = torch.tensor([float(v) for v in vals], dtype=torch.float64)
    bufs = [torch.empty_like(mine) for _ in range(size)]
    wait(dist.all_gather(bufs, mine, group=group, async_op=True), timeout, rank, f"{fn}: the all_gather of input checks")
    rows = [b.tolist() for b in bufs]
    if err is not None:
        raise type(err)(f"{fn} on rank {rank}: {err}") from err
    bad = [r for r, row in enumerate(rows) if row[0] != 1.0]
    if bad:
        raise ValueError(f"{fn} on rank {rank}: rank(s) {bad} rejected their inputs (their own error says why); "
                         "every rank stops instead of waiting for them")
    out = [row[1:width] for row in rows]
    for i in same:
        if len({row[i] for row in out}) > 1:
            table = "; ".join(f"rank {r}: {describe(row) if describe else row}" for r, row in enumerate(out))
            what = f"on {names[i]!r}" if i < len(names) else f"(entry {i})"
            raise ValueError(f"{fn} on rank {rank}: ranks disagree {what}; {table}")
    return out


# ----------------------------------------------------------------------------- differentiable collectives
class _AllGather(torch.autograd.Function):
    """``all_gather`` stacked on a new leading dim ``[P, ...]``; backward: the sum over ranks of the
    gradients of this rank's slot (an ``all_reduce``: gloo has no ``reduce_scatter``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, timeout: timedelta | None, what: str) -> Tensor:  # type: ignore[override]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        x = x.contiguous()
        bufs = [torch.empty_like(x) for _ in range(size)]
        wait(dist.all_gather(bufs, x, group=group, async_op=True), timeout, rank, f"the all_gather of {what}")
        ctx.group, ctx.timeout, ctx.what, ctx.rank = group, timeout, what, rank
        return torch.stack(bufs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        g = grad.contiguous().clone()
        wait(dist.all_reduce(g, group=ctx.group, async_op=True), ctx.timeout, ctx.rank,
             f"the backward all_reduce of {ctx.what}")
        return g[ctx.rank], None, None, None


def all_lengths(n: int, group: Any, device: torch.device, timeout: timedelta | None, owner: str) -> list[int]:
    """Every rank's shard length ``n``, in rank order (one small all-gather)."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    bufs = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(bufs, mine, group=group, async_op=True), timeout, dist.get_rank(group),
         f"{owner}: the all_gather of shard lengths")
    return [int(b.item()) for b in bufs]


def all_gather_grad(x: Tensor, group: Any, timeout: timedelta | None, what: str) -> Tensor:
    """Differentiable ``all_gather``: ``x [...]`` on every rank -> ``[P, ...]`` (every rank's ``x``).

    Every rank must use the result in its loss (or multiply it by zero into it): the backward
    is a collective and runs only where the result is part of the graph."""
    out = _AllGather.apply(x, group, timeout, what)
    assert isinstance(out, Tensor)
    return out


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``split_dim`` into ``send`` sizes (piece ``s`` goes to rank ``s``), receive
    ``recv`` sizes from every rank, concatenate along ``cat_dim``; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, split_dim: int, cat_dim: int, send: list[int], recv: list[int],  # type: ignore[override]
                group: Any, timeout: timedelta | None) -> Tensor:
        ctx.args = (split_dim, cat_dim, send, recv, group, timeout)
        return _all_to_all(x, split_dim, cat_dim, send, recv, group, timeout)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        split_dim, cat_dim, send, recv, group, timeout = ctx.args
        return (_all_to_all(grad, cat_dim, split_dim, recv, send, group, timeout),
                None, None, None, None, None, None)


def _all_to_all(x: Tensor, split_dim: int, cat_dim: int, send: list[int], recv: list[int], group: Any,
                timeout: timedelta | None) -> Tensor:
    """The exchange of :class:`_AllToAll`. Gloo needs every piece of one shape, so pieces are padded
    to the largest sizes (``send`` and ``recv`` are the same lists on every rank) and trimmed after."""
    rank = dist.get_rank(group)
    top_split, top_cat = max(send), max(recv)

    def padded(t: Tensor) -> Tensor:
        pad = [0] * (2 * t.dim())
        for dim, top in ((split_dim, top_split), (cat_dim, top_cat)):
            pad[2 * (t.dim() - 1 - dim) + 1] = top - t.shape[dim]
        return torch.nn.functional.pad(t, pad).contiguous() if any(pad) else t.contiguous()

    ins = [padded(p) for p in torch.split(x, send, dim=split_dim)]
    outs = [torch.empty_like(ins[0]) for _ in recv]
    wait(dist.all_to_all(outs, ins, group=group, async_op=True), timeout, rank, "the all_to_all of Ulysses attention")
    return torch.cat([o.narrow(split_dim, 0, send[rank]).narrow(cat_dim, 0, n) for o, n in zip(outs, recv, strict=True)],
                     dim=cat_dim)


def all_to_all_grad(x: Tensor, split_dim: int, cat_dim: int, send: list[int], recv: list[int], group: Any,
                    timeout: timedelta | None) -> Tensor:
    """Differentiable all-to-all (see :class:`_AllToAll`); ``send[s]`` / ``recv[s]`` are the sizes
    along ``split_dim`` sent to / along ``cat_dim`` received from rank ``s``."""
    out = _AllToAll.apply(x, split_dim, cat_dim, send, recv, group, timeout)
    assert isinstance(out, Tensor)
    return out
