r"""Context parallelism on ``torch.distributed``: ring attention and sequence sharding.

A sequence too long for one device is cut along its length and every rank of a process group
holds one shard of the queries, keys and values. :func:`ring_attention` then computes exact
softmax attention over the *whole* sequence: the K/V shards travel around the ring of ranks
(rank ``r`` sends to ``r + 1`` and receives from ``r - 1``) while every rank attends its queries
to the shard it holds, and the partial results are combined by their log-sum-exp
(:func:`attnzoo.merge_attention`). Sends and receives of the next shard run while the current one
is being used. Besides its own, a rank holds at most two K/V shards at a time (the one in use and
the one arriving; in the backward also their float32 ``dK, dV`` buffers), so per-rank memory for
attention grows as ``N / world_size`` (with a memory-linear backend such as ``tiled``; measured by
``benchmarks/bench_ring.py``, see ``docs/distributed.md``).

Layouts (which global positions a rank holds; ``P`` ranks, global length ``N``):

* ``"contiguous"``: rank ``r`` holds one run of positions, split like ``torch.tensor_split``
  (the first ``N % P`` ranks hold one token more). Uneven shards are handled.
* ``"zigzag"``: the sequence is cut into ``2P`` chunks of ``c = N / (2P)`` tokens and rank ``r``
  holds chunks ``r`` and ``2P - 1 - r``. Under a causal mask every rank then does the same amount
  of work (with ``"contiguous"`` the last rank does ``P`` times the work of the first).
  ``N`` must be divisible by ``2P``.

Backward: a custom autograd function. The K/V shards circulate again, each travelling with the
gradient buffers ``dK, dV`` of its owner; every rank adds its contribution for the shard it holds
and passes the buffer on, so after ``P`` hops each buffer is back home complete. The per-pair
gradients are the flash-attention backward given the *global* log-sum-exp of each query row:

.. math::

    P = e^{S - \text{lse}}, \quad dV \mathrel{+}= P^\top dO, \quad
    dS = P \odot (dO\,V^\top - \delta), \quad \delta = \text{rowsum}(dO \odot O), \quad
    dQ \mathrel{+}= s\,dS\,K, \quad dK \mathrel{+}= s\,dS^\top Q

computed ``block`` query rows at a time (``O(block x N / P)`` memory). GQA never expands K/V:
the ``G = Hq / Hkv`` query heads of a group are folded into the row dimension.

Failure handling: before any send, the ranks exchange the shapes, dtypes and options of their
inputs with one small ``all_gather``; a rank whose inputs are invalid or disagree with the others
makes *every* rank raise ``ValueError`` (no rank is left waiting for a shard that never comes).
Every wait on the network has a timeout (``timeout=`` or the process group's), and a peer that
died or timed out becomes a ``RuntimeError`` naming the rank, the ring step and the peer.

Layout of the package: :mod:`.comm` (process groups and meshes, ring exchange, differentiable
collectives), :mod:`.sharding` (layouts, shard/gather), :mod:`.ring` (ring attention),
:mod:`.ulysses` (all-to-all attention), :mod:`.recurrent` (state scans for recurrent and
feature-map mixers), :mod:`.gathered` (the exact fallback for NSA and Infini-attention: the whole
sequence on every rank), :mod:`.context_parallel` (module wrappers, :func:`context_parallel`).

Positions follow ``docs/conventions.md``: key ``j`` is visible to query ``p`` under ``causal``
iff ``j <= p``, under ``window=(left, right)`` iff ``p - left <= j <= p + right``.
"""


from attnzoo.distributed.context_parallel import (
    METHODS,
    ContextParallel,
    context_parallel,
    documents,
)
from attnzoo.distributed.gathered import ContextParallelGathered
from attnzoo.distributed.recurrent import ContextParallelRecurrent
from attnzoo.distributed.ring import BACKWARD_BLOCK, PAIR_STATS, ring_attention, work_per_rank
from attnzoo.distributed.sharding import LAYOUTS, gather_sequence, shard_positions, shard_sequence
from attnzoo.distributed.ulysses import ulysses_attention

__all__ = [
    "BACKWARD_BLOCK",
    "LAYOUTS",
    "METHODS",
    "PAIR_STATS",
    "ContextParallel",
    "ContextParallelGathered",
    "ContextParallelRecurrent",
    "context_parallel",
    "documents",
    "gather_sequence",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
    "ulysses_attention",
    "work_per_rank",
]
