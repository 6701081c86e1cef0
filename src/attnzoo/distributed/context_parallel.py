"""Context parallelism for whole models: :func:`context_parallel` wraps every mixer of a model so
that it runs on a sequence sharded over the ranks of a group.

* softmax attention (:class:`~attnzoo.MultiHeadAttention` and its variants, MLA, differential
  attention): :class:`ContextParallel` points the module's attend seam at :func:`ring_attention`
  (``method="ring"``) or :func:`ulysses_attention` (``method="ulysses"``); sigmoid attention the
  same with ``score="sigmoid"`` (the ring adds its shard pairs' outputs, no log-sum-exp merge);
  forgetting attention (FoX) the same with its forget-gate bias as a ``score_mod`` on global
  positions (the gates of the whole sequence gathered, their prefix sum taken in global order);
* recurrent and feature-map mixers: :class:`~attnzoo.distributed.recurrent.ContextParallelRecurrent`
  (state summaries scanned over the ranks);
* NSA and Infini-attention (no sharded form): :class:`~attnzoo.distributed.gathered.
  ContextParallelGathered` runs them on the gathered sequence (exact; no memory saving for that
  mixer), or, with ``fallback="refuse"``, they are refused by name before any communication.

Packed documents: inside ``with documents(cu_seqlens):`` (global boundaries) the attention of
every wrapped module is restricted to documents.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_choice
from attnzoo.distributed.comm import (
    agree,
    all_gather_grad,
    all_lengths,
    require_dist,
    resolve_group,
)
from attnzoo.distributed.gathered import ContextParallelGathered
from attnzoo.distributed.recurrent import ContextParallelRecurrent
from attnzoo.distributed.ring import ring_attention
from attnzoo.distributed.sharding import DOCUMENTS, ShardedMixer, check_layout, positions_of
from attnzoo.distributed.ulysses import ulysses_attention
from attnzoo.nn.attention import MultiHeadAttention, SigmoidAttention, StreamingAttention
from attnzoo.nn.base import AttentionBase
from attnzoo.nn.differential import DifferentialAttention
from attnzoo.nn.feature_attention import _FeatureAttention
from attnzoo.nn.fox import FoxAttention, forget_sums, forgetting_bias
from attnzoo.nn.infini import InfiniAttention
from attnzoo.nn.local_global import LocalGlobalAttention
from attnzoo.nn.mla import MultiHeadLatentAttention
from attnzoo.nn.nsa import NativeSparseAttention
from attnzoo.nn.recurrent import RecurrentMixer

__all__ = ["METHODS", "ContextParallel", "context_parallel", "documents"]

#: Attention methods of :func:`context_parallel`.
METHODS = ("ring", "ulysses")

#: What :func:`context_parallel` does with a mixer that has no sharded form.
FALLBACKS = ("gather", "refuse")

#: Modules that cannot run on a sharded sequence, and why.
REFUSED: dict[type, str] = {
    NativeSparseAttention: "its selection branch ranks blocks of the whole sequence by the scores of compressed "
                           "keys (a global top-k per query)",
    InfiniAttention: "its compressive memory is read and written per segment of segment_len tokens with a "
                     "local softmax inside each segment; shards would have to be whole segments",
}

@contextlib.contextmanager
def documents(cu_seqlens: Tensor) -> Iterator[None]:
    """Packed documents for context-parallel modules: inside the block, every wrapped attention
    module attends within the documents of the *global* boundaries ``cu_seqlens [S+1]``, and
    every wrapped recurrent / feature-map mixer restarts its state (and its short convolutions)
    at each boundary, inside a shard or on a shard edge.

    Pass the local tokens as usual (``[1, n, C]``: packed documents are one row), with
    ``positions=`` their positions *inside their document* (for RoPE)."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"documents: cu_seqlens must be an int tensor [S+1], got {type(cu_seqlens).__name__}")
    token = DOCUMENTS.set(cu_seqlens)
    try:
        yield
    finally:
        DOCUMENTS.reset(token)


def _check_method(method: object, fn: str) -> str:
    return check_choice(method, "method", fn, choices=METHODS)


def _attention_problem(module: nn.Module, method: str) -> str | None:
    """Why a softmax- or sigmoid-attention module cannot run under ``method`` (``None``: it can)."""
    if isinstance(module, SigmoidAttention):
        if module.kv_dim is not None:
            return "a cross-attention module (kv_dim set) is not supported; shard the queries only"
        return None
    if isinstance(module, MultiHeadAttention):
        if module.kv_dim is not None:
            return "a cross-attention module (kv_dim set) is not supported; shard the queries only"
        if module._structure() is not None and method == "ring":
            return ("it uses a mask pattern (local-global / streaming); ring attention supports causal and "
                    "window only: use method='ulysses'")
        if module.dropout > 0:
            return f"attention dropout ({module.dropout}) is not supported; build the module with dropout=0"
        return None
    if isinstance(module, MultiHeadLatentAttention):
        if module.form == "absorbed":
            return "the absorbed form attends to the latent with a folded mask; use form='auto' or 'materialised'"
        if module.options.dropout > 0:
            return f"attention dropout ({module.options.dropout}) is not supported"
        return None
    if isinstance(module, (DifferentialAttention, FoxAttention)):
        return None
    return f"{type(module).__name__} is not a softmax-attention module"


class ContextParallel(ShardedMixer):
    """Run a softmax-attention module on a sequence sharded over ranks.

    The wrapped module keeps its parameters and runs its own forward (projections, norms, RoPE
    at the *global* positions of the local tokens); only its attend seam changes for the call:
    :func:`ring_attention` (``method="ring"``) or :func:`ulysses_attention` (``"ulysses"``) over
    the group with the module's ``causal``/``window``/``scale``/ALiBi/sinks. Parameters are not
    synchronised: sum their gradients over the group (DDP, or FSDP2 ``fully_shard`` over a mesh
    that includes the group's ranks, see ``docs/distributed.md``).

    Args:
        module: a self-attention ``MultiHeadAttention`` (GQA/MQA/sliding-window, RoPE, ALiBi,
            sinks; local-global and streaming patterns with ``method="ulysses"``; a
            ``SigmoidAttention``), a ``FoxAttention``, a
            ``MultiHeadLatentAttention`` or a ``DifferentialAttention``.
        group: a ProcessGroup or a 1-D DeviceMesh (``mesh["cp"]``), default the world.
        layout: ``"contiguous"`` or ``"zigzag"``: how ``x`` was cut (:func:`shard_sequence`).
        method: ``"ring"`` or ``"ulysses"``.
        backend: backend for each attention call (ring: it must support ``return_lse``).
        timeout: seconds (or a timedelta) for any single network wait.

    Shapes:
        ``forward(x [B, n, C]) -> [B, n, C]`` where ``x`` is this rank's shard of ``[B, N, C]``.
    """

    def __init__(self, module: nn.Module, *, group: Any = None, layout: str = "contiguous", method: str = "ring",
                 backend: str = "auto", timeout: float | timedelta | None = None) -> None:
        method = _check_method(method, "ContextParallel")
        if not isinstance(module, (MultiHeadAttention, MultiHeadLatentAttention, DifferentialAttention,
                                   FoxAttention)):
            raise TypeError(f"ContextParallel wraps a MultiHeadAttention, MultiHeadLatentAttention, "
                            f"DifferentialAttention or FoxAttention, got {type(module).__name__}")
        problem = _attention_problem(module, method)
        if problem is not None:
            raise ValueError(f"ContextParallel: {type(module).__name__}: {problem}")
        if not isinstance(backend, str):
            raise TypeError(f"ContextParallel: backend must be a str, got {type(backend).__name__}")
        super().__init__(module, group, layout, timeout, "ContextParallel")
        self.method, self.backend = method, backend

    def forward(self, x: Tensor, *, positions: Tensor | None = None, mask: Any = None, cache: Any = None) -> Tensor:
        """Attend from this rank's tokens ``x [B, n, C]`` to the whole sharded sequence.

        Args:
            x: the local shard.
            positions: global positions of the local tokens, int ``[n]`` or ``[B, n]`` (default:
                from the layout and every rank's shard length, i.e. :func:`shard_positions`).
                Used for RoPE.
            mask, cache: not supported (``ValueError`` unless ``None``): the module's pattern
                applies, documents come from :func:`documents`, and a sharded sequence is not
                decoded.
        """
        require_dist("ContextParallel")
        m = self.module
        err: Exception | None = None
        try:  # checked on every rank first: a bad input on one rank is an error on all (none waits)
            self._local_checks(x, positions, mask, cache)
        except (TypeError, ValueError) as e:
            err = e
        agree(self.group, None if err is not None else [x.shape[0], x.shape[-1]], err, "ContextParallel",
              self.timeout, same=[0, 1])
        n = x.shape[1]
        if DOCUMENTS.get() is not None and _counts_from_document_start(m):
            # global tokens, sink tokens and a score_mod's positions count from each document's start
            # in packed input; the sharded seams see absolute positions: run this layer gathered
            gathered = ContextParallelGathered(m, group=self.group, layout=self.layout, timeout=self.timeout)
            return gathered(x, positions=positions)
        if isinstance(m, FoxAttention):  # no positional encoding: positions are not used
            return self._fox(x)
        if positions is None and (getattr(m, "rope", None) is not None or isinstance(m, MultiHeadLatentAttention)):
            lengths = all_lengths(n, self.group, x.device, self.timeout, "ContextParallel")
            positions = positions_of(self.layout, lengths, dist.get_rank(self.group), device=x.device)
        seam = _sigmoid_attend if isinstance(m, SigmoidAttention) else _sharded_attend
        # The module runs its own forward; only its attend seam is pointed at the ring for this call.
        attend = functools.partial(seam, method=self.method, group=self.group, layout=self.layout,
                                   cp_backend=self.backend, timeout=self.timeout, cu_seqlens=DOCUMENTS.get())
        saved, m.attend_fn = m.attend_fn, attend
        try:
            out = m(x) if positions is None else m(x, positions=positions)  # [B, n, C]
        finally:
            m.attend_fn = saved
        assert isinstance(out, Tensor)
        return out

    def _local_checks(self, x: object, positions: object, mask: object, cache: object) -> None:
        if mask is not None or cache is not None:
            raise ValueError("ContextParallel: mask= and cache= are not supported (the module's causal/window "
                             "apply, documents come from attnzoo.distributed.documents; decode with the unwrapped "
                             "module)")
        if not isinstance(x, Tensor):
            raise TypeError(f"ContextParallel: x must be a tensor [B, n, C], got {type(x).__name__}")
        dim = self.module.dim
        if x.dim() != 3 or x.shape[-1] != dim:
            raise ValueError(f"ContextParallel: x must have shape [B, n, C] with C = {dim}, got {tuple(x.shape)}")
        B, n, _ = x.shape
        if positions is not None and (not isinstance(positions, Tensor)
                                      or tuple(positions.shape) not in ((n,), (B, n)) or positions.is_floating_point()):
            raise ValueError(f"ContextParallel: positions must be an int tensor [n] = [{n}] or [B, n] = "
                             f"[{B}, {n}], got "
                             f"{positions if not isinstance(positions, Tensor) else tuple(positions.shape)}")

    def _fox(self, x: Tensor) -> Tensor:
        """FoX on the shard ``x [B, n, C]``: every rank gathers the forget gates ``log f`` of the whole
        sequence (``[B, H, N]``, small) and takes their cumulative sum in global order (restarting at every
        document under :func:`documents`, as the packed module does), so the
        score bias ``c_i - c_j`` of every shard pair is the one of one process; the attention is
        ring or Ulysses attention with that bias as a ``score_mod`` on global positions."""
        m = self.module
        assert isinstance(m, FoxAttention)
        n = x.shape[1]
        lengths = all_lengths(n, self.group, x.device, self.timeout, "ContextParallel")
        q, k, v = m.project_qkv(x)  # [B, H, n, D], [B, Hkv, n, D]
        log_f = m.log_forget(x)  # [B, H, n]
        every = all_gather_grad(F.pad(log_f, (0, max(lengths) - n)), self.group, self.timeout,
                                "ContextParallel: the FoX forget gates")  # [P, B, H, n_max]
        in_rank_order = torch.cat([every[r, :, :, :ln] for r, ln in enumerate(lengths)], dim=-1)  # [B, H, N]
        order = torch.cat([positions_of(self.layout, lengths, r) for r in range(len(lengths))]).to(x.device)
        documents = DOCUMENTS.get()
        c = forget_sums(in_rank_order[:, :, torch.argsort(order)], documents)  # [B, H, N], global order
        kw: dict[str, Any] = {"group": self.group, "causal": True, "layout": self.layout, "backend": self.backend,
                              "timeout": self.timeout, "cu_seqlens": documents,
                              "score_mod": forgetting_bias(c)}
        out = ring_attention(q, k, v, **kw) if self.method == "ring" else ulysses_attention(q, k, v, **kw)
        assert isinstance(out, Tensor)
        return m.merge_heads(out)  # [B, n, C]

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}, method={self.method!r}"


def _counts_from_document_start(module: nn.Module) -> bool:
    """Whether the module's pattern or score modification reads positions (not only offsets)."""
    return isinstance(module, (LocalGlobalAttention, StreamingAttention)) or getattr(module, "score_mod", None) is not None


def _seam_checks(mask: Any, return_weights: bool, dropout_p: float, method: str) -> None:
    if return_weights or dropout_p:
        raise ValueError("ContextParallel: return_weights and attention dropout are not supported")
    if isinstance(mask, Tensor) or (mask is not None and method == "ring"):
        raise ValueError(f"ContextParallel: the module passed a mask ({type(mask).__name__}) to attention; "
                         f"{'ring attention takes causal/window only' if method == 'ring' else 'only position masks (attnzoo.masks.Mask) shard'}")


def _sharded_attend(q: Tensor, k: Tensor, v: Tensor, *, method: str, group: Any, layout: str, cp_backend: str,
                    timeout: timedelta | None, cu_seqlens: Tensor | None, mask: Any = None, causal: bool = False,
                    window: Any = None, scale: float | None = None, softcap: float | None = None,
                    alibi_slopes: Tensor | None = None, dropout_p: float = 0.0, return_weights: bool = False,
                    q_offset: int | None = None, backend: str = "auto", sinks: Tensor | None = None,
                    score_mod: Any = None) -> Tensor:
    """The attend seam of a softmax module: ``az.attention``'s keywords in, :func:`ring_attention` or
    :func:`ulysses_attention` (``method``) over the group out. ``q_offset`` is ignored (every shard sits
    at its global positions from ``layout``) and ``backend`` too (each piece runs on ``cp_backend``);
    under Ulysses a position ``Mask`` of the module (e.g. local-global) applies unchanged: every rank
    holds the whole sequence for its heads."""
    del q_offset, backend
    _seam_checks(mask, return_weights, dropout_p, method)
    kw: dict[str, Any] = {"group": group, "causal": causal, "window": window, "scale": scale, "softcap": softcap,
                          "alibi_slopes": alibi_slopes, "sinks": sinks, "layout": layout, "cu_seqlens": cu_seqlens,
                          "backend": cp_backend, "timeout": timeout, "score_mod": score_mod}
    out = ring_attention(q, k, v, **kw) if method == "ring" else ulysses_attention(q, k, v, mask=mask, **kw)
    assert isinstance(out, Tensor)
    return out


def _sigmoid_attend(q: Tensor, k: Tensor, v: Tensor, *, group: Any, layout: str, cp_backend: str,
                    timeout: timedelta | None, cu_seqlens: Tensor | None, method: str, bias: float | None = None,
                    causal: bool = False, window: Any = None, mask: Any = None, scale: float | None = None,
                    softcap: float | None = None, q_offset: int | None = None, alibi_slopes: Tensor | None = None,
                    return_weights: bool = False, backend: str = "auto") -> Tensor:
    """The attend seam of a :class:`~attnzoo.SigmoidAttention`: :func:`attnzoo.sigmoid_attention`'s
    keywords in, :func:`ring_attention` / :func:`ulysses_attention` with ``score="sigmoid"`` out
    (the default ``bias`` is ``-log(N)`` of the whole sequence, as in one process)."""
    del q_offset, backend
    _seam_checks(mask, return_weights, 0.0, method)
    kw: dict[str, Any] = {"group": group, "causal": causal, "window": window, "scale": scale, "softcap": softcap,
                          "alibi_slopes": alibi_slopes, "layout": layout, "cu_seqlens": cu_seqlens,
                          "backend": cp_backend, "timeout": timeout, "score": "sigmoid", "bias": bias}
    out = ring_attention(q, k, v, **kw) if method == "ring" else ulysses_attention(q, k, v, mask=mask, **kw)
    assert isinstance(out, Tensor)
    return out


def _ulysses_fits(module: nn.Module, group: Any) -> bool:
    """Whether Ulysses can shard ``module``'s heads over the group (Hq divisible by the ranks, Hkv
    divisible or dividing)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"context_parallel: {type(module).__name__}'s mask pattern has no ring form and the "
                         "choice between Ulysses and the gathered fallback reads the group's size: initialise "
                         "torch.distributed first (or pass method='ulysses')")
    world = dist.get_world_size(group)
    hq, hkv = getattr(module, "num_heads", 0), getattr(module, "num_kv_heads", 0)
    return hq > 0 and hkv > 0 and hq % world == 0 and (hkv % world == 0 or world % hkv == 0)


def _wrap(name: str, module: nn.Module, group: Any, layout: str, method: str, backend: str,
          timeout: float | timedelta | None, fallback: str) -> nn.Module:
    """The context-parallel wrapper of one mixer, or ``ValueError`` naming it and why not."""
    where = f"context_parallel: {name or 'the model'} ({type(module).__name__})"
    gathered = functools.partial(ContextParallelGathered, module, group=group, layout=layout, timeout=timeout)
    for cls, why in REFUSED.items():
        if isinstance(module, cls):
            if fallback == "gather":
                return gathered()
            raise ValueError(f"{where} cannot run on a sharded sequence: {why} (fallback='gather' runs it on "
                             f"the gathered sequence)")
    if isinstance(module, (RecurrentMixer, _FeatureAttention)):
        return ContextParallelRecurrent(module, group=group, layout=layout, timeout=timeout)
    problem = _attention_problem(module, method)
    if problem is not None and method == "ring" and fallback == "gather" and _pattern_only(module):
        if _ulysses_fits(module, group):  # a mask pattern: Ulysses holds the whole sequence per head
            return ContextParallel(module, group=group, layout=layout, method="ulysses", backend=backend,
                                   timeout=timeout)
        return gathered()
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return ContextParallel(module, group=group, layout=layout, method=method, backend=backend, timeout=timeout)


def _pattern_only(module: nn.Module) -> bool:
    """A self-attention module whose one obstacle to the ring is its mask pattern (local-global,
    streaming): it runs under Ulysses."""
    return (isinstance(module, MultiHeadAttention) and not isinstance(module, SigmoidAttention)
            and _attention_problem(module, "ulysses") is None)


def context_parallel(
    model: nn.Module,
    group: Any = None,
    layout: str = "contiguous",
    method: str = "ring",
    *,
    backend: str = "auto",
    timeout: float | timedelta | None = None,
    fallback: str = "gather",
) -> nn.Module:
    """Make every mixer inside ``model`` run on a sequence sharded over the ranks of ``group``.

    Softmax attention (MHA and its variants, MLA, differential) runs ring or Ulysses attention
    (``method``), and so do sigmoid attention (``score="sigmoid"``: no normaliser) and FoX (its
    forget gates gathered over the ranks); recurrent mixers (retnet, gla, deltanet,
    gated_deltanet, kda, mamba2, gated_deltaproduct) and feature-map attention (linear, performer)
    pass state summaries between ranks. What has no sharded form under ``method`` takes the
    ``fallback``: with ``"gather"`` (default) a mask pattern (local-global, streaming) under the
    ring runs Ulysses where its heads divide over the ranks, and NSA and Infini-attention (and a
    pattern whose heads do not divide) run on the gathered sequence
    (:class:`~attnzoo.distributed.gathered.ContextParallelGathered`: exact, but that mixer holds
    the whole sequence on every rank); with ``"refuse"`` they are a ``ValueError`` naming them. Afterwards the model takes this rank's shard of the tokens and their
    global positions, e.g. ``model(shard_sequence(tokens, 1, layout=...),
    positions=shard_positions(N, layout=...))`` for a :class:`~attnzoo.DecoderLM`, and returns
    the outputs of the local tokens. ``model`` is modified in place (parameters are shared, not
    copied; their names gain ``.module``) and returned. Apply it *before* ``fully_shard`` / DDP.

    Args:
        model: any module holding attention mixers (not a mixer itself: wrap that directly with
            :class:`ContextParallel` / ``ContextParallelRecurrent``).
        group: a ProcessGroup, a 1-D DeviceMesh (``mesh["cp"]``) or a mesh with a ``"cp"``
            dimension; default the world.
        layout: ``"contiguous"`` or ``"zigzag"`` (torch's head-tail load balancing order).
        method: ``"ring"`` or ``"ulysses"`` for the softmax-attention modules.
        backend: attention backend of each per-rank call.
        timeout: seconds (or a timedelta) for any single network wait.
        fallback: ``"gather"`` or ``"refuse"``: what a mixer without a sharded form does (above).

    Raises:
        ValueError / TypeError before any communication: a mixer that cannot be sharded under
        ``fallback="refuse"`` (named), bad arguments.
    """
    fn = "context_parallel"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}")
    layout = check_layout(layout, fn)
    method = _check_method(method, fn)
    fallback = check_choice(fallback, "fallback", fn, choices=FALLBACKS)
    group = resolve_group(group, fn)
    if isinstance(model, AttentionBase):
        raise TypeError(f"{fn}: wrap a single attention module with ContextParallel(module) (or "
                        "ContextParallelRecurrent for a recurrent mixer)")
    targets: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if not name or isinstance(mod, (ContextParallel, ContextParallelRecurrent, ContextParallelGathered)):
            continue
        if any(name.startswith(t + ".") for t, _ in targets):
            continue  # inside a mixer already chosen (e.g. the compressor of an NSA module)
        if isinstance(mod, MultiHeadAttention) and mod.kv_dim is not None:
            continue  # cross-attention reads the (unsharded) context
        if isinstance(mod, AttentionBase):
            targets.append((name, mod))
    if not targets:
        raise ValueError(f"{fn}: {type(model).__name__} contains no self-attention or recurrent mixer")
    wrapped = [(name, _wrap(name, mod, group, layout, method, backend, timeout, fallback))
               for name, mod in targets]  # validate all before changing anything
    for name, cp in wrapped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, cp)
    return model
