"""Qwen4-Exp (text) -> :class:`~attnzoo.DecoderLM`: ``Qwen4ExpForCausalLM`` and ``Qwen4ExpTextModel``
(``model_type="qwen4_exp_text"``). Line numbers: transformers 5.25,
``models/qwen4_exp/modeling_qwen4_exp.py``.

**Hyper-connections.** The residual stream is ``S = hc_count`` copies of the width ``C``: the
embedding is repeated ``S`` times (l. 1585) and every sub-layer reads and writes it through a
:class:`GatedResidual` (``Qwen4ExpTextGatedResidual``, l. 1112-1147): ``xn = RMSNorm_per_stream(x)``
(one ``1 + w`` RMSNorm of width ``C`` per stream, ``hc_norm``), the sub-layer's input
``mean_s(sigmoid(up(silu(down(xn) / S)))_s * xn_s)`` and the write-back weights
``inj = 2 sigmoid(block_inject(xn) / S)`` ``[S]``; the layer then adds ``inj_s * out`` to stream ``s``
of the un-normalised ``x`` (l. 1420-1430). The model ends with the same read (``hyper_connection_mixer``,
no write-back: there is no final norm, l. 1598) before ``lm_head``. Here every layer is a
:class:`~attnzoo.TransformerBlock` of width ``S C`` (identity norms) whose mixer is a
:class:`HyperMixer` and whose feed-forward a :class:`HyperFeedForward` (each: read, the inner module,
write-back); the final norm part is the read (``GatedResidual(combine=False)``).

**Layers** (``layer_types``, ``full_attention`` read as ``indexed_attention``, configuration l. 169-179):

* ``linear_attention``: Qwen3.5's gated DeltaNet (l. 537-721; split ``in_proj_qkv``/``z``/``b``/``a``,
  :class:`~attnzoo.models.families.qwen3_next.QwenGatedDeltaNet`), ``silu`` output gate only.
* ``indexed_attention`` (:class:`IndexedAttention`): Qwen3-Next's gated attention (per-head QK
  ``1 + w`` RMSNorm, partial rotary, element-wise ``sigmoid`` output gate; l. 926-1010) over the keys a
  QSA indexer selects (:class:`QSAIndexer`, l. 769-886): one projection gives ``Hi`` query heads and
  one key head of width ``Di`` (``1 + w`` RMSNorms, the attention's rotary on the first
  ``rotary_dim`` channels of the queries); per row, the visible (real, causal) keys are grouped in
  order into blocks of ``r = indexer_compress_ratio`` (anchored at the row's first real token); a
  block's key is the float mean of its raw keys, normalised, rotated at the block's first token's
  position; a query scores each complete block ``sum_h relu(q_h . k_blk) / sqrt(Di)`` and keeps the
  ``indexer_budget / r`` best, plus the incomplete tail block. The selection is a boolean mask over
  the exact attention (l. 873-886, 963-969). With a cache the raw index keys and their positions are
  kept (l. 813-816, 1566-1571).
* ``mlp``: Qwen3.5-MoE's sparse MoE (softmax, top-k, ``norm_topk_prob``, sigmoid-gated shared
  expert; l. 1013-1109) on every layer.

**PLE** (``ple_layer_ids``, one-indexed, linear layers only; :class:`PerLayerEmbedding`, l. 1299-1375):
before the layer's read, ``x += gv + silu(conv(RMSNorm(gv)))`` where, from the layer's n-gram embedding
``e`` (:class:`NGramEmbedding`, l. 1150-1296: per n-gram order ``2..ngram_size`` and head, the
XOR of the last tokens times seeded odd multipliers (splitmix64), modulo a per-head prime, looked up
in one table; the history stops at ``eos_token_id``, padded tokens read as ``eos``),
``g_s = signed_sqrt(<RMSNorm(key_proj(e))_s, RMSNorm(x)_s> / sqrt(C))``,
``gv_s = sigmoid(g_s) value_proj(e)`` and ``conv`` a depthwise causal conv of kernel
``ple_conv_kernel_size`` and dilation ``ngram_size``. The model is a :class:`Qwen4ExpLM`, a
:class:`~attnzoo.models.loop.LayerLoopLM` whose layer loop copies the embedding onto the streams and
runs each PLE layer's :class:`PerLayerEmbedding` (held by the layer's :class:`HyperMixer`) on the
token ids before the layer.

Padding: the DeltaNet zeroes padded tokens (l. 594), PLE zeroes its conv inputs and reads padded ids
as ``eos`` (l. 1364-1366, 1577-1581). Packed sequences (``cu_seqlens``) run one sequence at a time,
so a packed batch equals each sequence alone; transformers' eager model
has no packed path for these layers (its PLE n-gram and conv cross the boundaries).

Exact ties at the indexer's cut (several blocks scoring ``0`` after the ReLU: frequent with few index
heads) are broken as transformers' ``torch.topk`` breaks them: those queries' scores go through
``torch.topk`` one query at a time, as in transformers (the other queries are selected batched).
Multi-token prediction (``mtp.*``) and vision weights are not part of the causal LM: ignored.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import moe_from_config, put_moe
from attnzoo.models.families.qwen3_5 import put_split_deltanet
from attnzoo.models.families.qwen3_next import (
    QwenGatedDeltaNet,
    put_gated_attention,
    real_keys,
)
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.loop import StreamsLM
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.cache import CacheList, RowsCache

__all__ = ["DISPATCH", "GatedResidual", "GroupedRMSNorm", "HyperFeedForward", "HyperMixer", "IndexedAttention",
           "NGramEmbedding", "PerLayerEmbedding", "QSAIndexer", "Qwen4ExpLM", "build_qwen4_exp", "convert_qwen4_exp"]

KINDS = ("linear_attention", "indexed_attention")


class GroupedRMSNorm(nn.Module):
    """RMSNorm over each group of ``group`` channels of ``[..., width]``, computed in float32 (or
    float64) and
    times ``weight [width]`` (transformers' ``1 + w``, loaded as ``w + 1``), back in the input dtype
    (``Qwen4ExpTextRMSNorm``, l. 154-179)."""

    def __init__(self, width: int, group: int, eps: float, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if width % group:
            raise ValueError(f"GroupedRMSNorm: width ({width}) must be a multiple of group ({group})")
        self.group, self.eps = group, float(eps)
        self.weight = nn.Parameter(torch.ones(width, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, self.group))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (h * self.weight.to(h.dtype)).type_as(x)


class GatedResidual(nn.Module):
    """The gated read and write-back of ``streams`` residual streams of width ``dim`` (see the module
    docstring). ``combine=False``: the read only (the model's final mixer).

    Weights: ``norm.weight [S C]``, ``down.weight [rank, S C]``, ``up.weight [S C, rank]``,
    ``inject.weight [S, S C]``. ``forward(x [B, N, S C]) -> [B, N, C]`` (the read)."""

    def __init__(self, dim: int, streams: int, rank: int, eps: float, *, combine: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.dim, self.streams = dim, streams
        self.norm = GroupedRMSNorm(streams * dim, dim, eps, **kw)
        self.down = nn.Linear(streams * dim, rank, bias=False, **kw)
        self.up = nn.Linear(rank, streams * dim, bias=False, **kw)
        self.inject = nn.Linear(streams * dim, streams, bias=False, **kw) if combine else None

    def read(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(h [B, N, C], inj [B, N, S] or None)``: the sub-layer's input and write-back weights."""
        xn = self.norm(x)
        w = torch.sigmoid(self.up(F.silu(self.down(xn) / self.streams))).unflatten(-1, (self.streams, self.dim))
        h = (w * xn.unflatten(-1, (self.streams, self.dim))).mean(dim=-2)
        inj = None if self.inject is None else 2 * torch.sigmoid(self.inject(xn) / self.streams)
        return h, inj

    def write(self, out: Tensor, inj: Tensor) -> Tensor:
        """The update ``inj_s * out`` of every stream ``[B, N, S C]``."""
        return (out.unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)

    def forward(self, x: Tensor) -> Tensor:
        return self.read(x)[0]


_MASK64, _GAMMA = (1 << 64) - 1, 0x9E3779B97F4A7C15


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd hash multipliers of one PLE layer (l. 1157-1166)."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_primes(base: int, first: int, count: int) -> list[int]:
    """The ``count`` consecutive primes after the first ``first`` primes above ``base - 1``
    (every n-gram head's table size, l. 1206-1211)."""
    primes, p = [], base - 1
    while len(primes) < first + count:
        p += 1
        while not _is_prime(p):
            p += 1
        primes.append(p)
    return primes[first:]


class NGramEmbedding(nn.Module):
    """The hashed n-gram embedding of one PLE layer (``Qwen4ExpTextNGramEmbedding``): for orders
    ``2..ngram_size``, ``heads_per_ngram`` heads each, ids ``XOR_p tok[t - p] * m_p mod P_h`` (the
    history stops at ``eos``) looked up in one table of ``sum P_h`` rows (padded to ``divisor``).
    ``forward(ids [B, N], history [B, ngram_size - 1]) -> [B, N, embed_dim]``."""

    def __init__(self, vocab_size: int, embed_dim: int, *, ngram_size: int, heads_per_ngram: int,
                 vocab_base: int, divisor: int, seed: int, ple_index: int, eos: int, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.ngram_size, self.heads_per_ngram, self.eos = ngram_size, heads_per_ngram, eos
        heads = (ngram_size - 1) * heads_per_ngram
        sizes = head_primes(vocab_base, ple_index * heads, heads)
        offsets = [sum(sizes[:i]) for i in range(heads)]
        mult = ngram_multipliers(vocab_size, ngram_size, ple_index, seed)
        self.register_buffer("multipliers", torch.tensor(mult, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long, device=device), persistent=False)
        rows = -(-sum(sizes) // divisor) * divisor
        self.table = nn.Embedding(rows, embed_dim // heads, device=device, dtype=dtype)

    def _shift(self, ids: Tensor, shift: int) -> Tensor:
        """``ids`` moved right by ``shift`` inside each ``eos``-delimited segment (``eos`` outside;
        ``_shift_right_ignore_eos``, l. 1224-1240)."""
        if shift == 0:
            return ids
        B, T = ids.shape
        t = torch.arange(T, device=ids.device)
        eos_at = torch.where(ids == self.eos, t, -1)
        prev = torch.cat([eos_at.new_full((B, 1), -1), torch.cummax(eos_at, dim=1).values[:, :-1]], dim=1)
        src = t - shift
        shifted = ids.gather(1, src.clamp_min(0).expand(B, -1))
        valid = (t - prev - 1 >= shift) & (src >= 0)
        return torch.where(valid, shifted, torch.full_like(ids, self.eos))

    def forward(self, ids: Tensor, history: Tensor) -> Tensor:
        full = torch.cat([history, ids], dim=1)  # [B, ctx + N]
        shifted = [self._shift(full, s) for s in range(self.ngram_size)]
        blocks = []
        for n in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.multipliers[0]
            for p in range(1, n):
                mixed = torch.bitwise_xor(mixed, shifted[p] * self.multipliers[p])
            h = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
            blocks.append(torch.remainder(mixed.unsqueeze(-1), self.sizes[h]) + self.offsets[h])
        rows = torch.cat(blocks, dim=-1)[:, -ids.shape[1]:]  # [B, N, heads]
        return self.table(rows).flatten(-2)  # [B, N, embed_dim]


class PLECache(RowsCache):
    """Decode cache of a :class:`PerLayerEmbedding`: the last ``ngram_size - 1`` token ids
    ``ids [B, ctx]`` (``eos`` at the start) and the conv's last inputs ``conv [B, P, S C]``."""

    _batch_tensors = ("ids", "conv")

    def __init__(self, batch_size: int, ctx: int, conv: int, width: int, eos: int, *, device: Any,
                 dtype: Any) -> None:
        self.batch_size, self.length, self.eos = batch_size, 0, eos
        self.ids = torch.full((batch_size, ctx), eos, dtype=torch.long, device=device)
        self.conv = torch.zeros(batch_size, conv, width, device=device, dtype=dtype)

    def reset(self) -> None:
        self.length = 0
        self.ids = torch.full_like(self.ids, self.eos)  # new tensors: a mark may hold the old ones
        self.conv = torch.zeros_like(self.conv)


class PerLayerEmbedding(nn.Module):
    """PLE of one layer (``Qwen4ExpTextPLELayer``; see the module docstring):
    ``forward(x [B, N, S C], ids [B, N], real [B, N] or None, cache) -> [B, N, S C]`` (the update).
    Weights: ``ngram.table``, ``key_proj [S C, E]``, ``value_proj [C, E]``, ``norm_key``,
    ``norm_query``, ``norm_conv`` (``[S C]``), ``conv_weight [S C, K]``."""

    def __init__(self, ngram: NGramEmbedding, dim: int, streams: int, embed_dim: int, conv_kernel: int,
                 eps: float, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.ngram, self.dim, self.streams, self.width = ngram, dim, streams, streams * dim
        self.dilation, self.state_len = ngram.ngram_size, (conv_kernel - 1) * ngram.ngram_size
        self.key_proj = nn.Linear(embed_dim, self.width, bias=False, **kw)
        self.value_proj = nn.Linear(embed_dim, dim, bias=False, **kw)
        self.norm_key, self.norm_query, self.norm_conv = (GroupedRMSNorm(self.width, dim, eps, **kw)
                                                          for _ in range(3))
        self.conv_weight = nn.Parameter(torch.zeros(self.width, conv_kernel, **kw))

    def init_cache(self, batch_size: int, max_len: int, *, device: Any = None, dtype: Any = None) -> PLECache:
        """A :class:`PLECache` (its size does not depend on ``max_len``)."""
        return PLECache(batch_size, self.ngram.ngram_size - 1, self.state_len, self.width, self.ngram.eos,
                        device=device, dtype=dtype)

    def forward(self, x: Tensor, ids: Tensor, real: Tensor | None, cache: PLECache | None) -> Tensor:
        B, N, _ = x.shape
        if real is not None:
            ids = torch.where(real, ids, self.ngram.eos)
        history = ids.new_full((B, self.ngram.ngram_size - 1), self.ngram.eos) if cache is None else cache.ids
        e = self.ngram(ids, history)  # [B, N, E]
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (self.streams, self.dim))
        query = self.norm_query(x).unflatten(-1, (self.streams, self.dim))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.dim)  # [B, N, S, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gv = torch.sigmoid(gate) * self.value_proj(e).unsqueeze(-2)  # [B, N, S, C]
        gvn, gv = self.norm_conv(gv.flatten(-2)), gv.flatten(-2)
        if real is not None:
            keep = real.unsqueeze(-1).to(gv.dtype)
            gv, gvn = gv * keep, gvn * keep
        prefix = gvn.new_zeros(B, self.state_len, self.width) if cache is None else cache.conv.to(gvn.dtype)
        full = torch.cat([prefix, gvn], dim=1)  # [B, P + N, S C]
        conv = F.conv1d(full.transpose(1, 2), self.conv_weight.unsqueeze(1).to(gvn.dtype), groups=self.width,
                        dilation=self.dilation)  # [B, S C, N]
        if cache is not None:
            cache.ids = torch.cat([cache.ids, ids], dim=1)[:, -history.shape[1]:]
            cache.conv = full[:, -self.state_len:].to(cache.conv.dtype)
            cache.length += N
        return gv + F.silu(conv).transpose(1, 2)


class IndexerCache(RowsCache):
    """Decode cache of a :class:`QSAIndexer`: the raw index keys ``keys [B, S, Di]`` and the positions
    ``positions [B, S]`` of every token written (``S = max_len``)."""

    _batch_tensors = ("keys", "positions")
    truncatable = True  # written by position: slots past ``length`` are unused

    def __init__(self, batch_size: int, max_len: int, head_dim: int, *, device: Any, dtype: Any) -> None:
        self.batch_size, self.length = batch_size, 0
        self.keys = torch.zeros(batch_size, max_len, head_dim, device=device, dtype=dtype)
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)

    def reset(self) -> None:
        self.length = 0

    def update(self, keys: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``keys [B, N, Di]`` at ``positions [B, N]``; return every key and position so far."""
        end = self.length + keys.shape[1]
        if end > self.keys.shape[1]:
            raise ValueError(f"IndexerCache: {end} tokens exceed the cache's max_len={self.keys.shape[1]}")
        self.keys[:, self.length:end] = keys.to(self.keys.dtype)
        self.positions[:, self.length:end] = positions
        self.length = end
        return self.keys[:, :end].to(keys.dtype), self.positions[:, :end]


class QSAIndexer(nn.Module):
    """The QSA token indexer (``Qwen4ExpTextQSAIndexer``; see the module docstring):
    ``forward(x [B, N, C], positions [B, N], real [B, L], cache) -> [B, 1, N, L]`` bool, the keys each
    query may attend (``L = past + N``). Weights: ``proj [(Hi + 1) Di, C]``, ``q_norm``, ``k_norm``
    (``[Di]``)."""

    def __init__(self, dim: int, heads: int, head_dim: int, budget: int, ratio: int, rope: nn.Module,
                 eps: float, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.heads, self.head_dim, self.ratio, self.topk = heads, head_dim, ratio, budget // ratio
        self.proj = nn.Linear(dim, (heads + 1) * head_dim, bias=False, **kw)
        self.q_norm = GroupedRMSNorm(head_dim, head_dim, eps, **kw)
        self.k_norm = GroupedRMSNorm(head_dim, head_dim, eps, **kw)
        self.rope = rope

    def init_cache(self, batch_size: int, max_len: int, *, device: Any = None, dtype: Any = None) -> IndexerCache:
        return IndexerCache(batch_size, max_len, self.head_dim, device=device, dtype=dtype)

    def forward(self, x: Tensor, positions: Tensor, real: Tensor, cache: IndexerCache | None) -> Tensor:
        q, keys = self.proj(x).split([self.heads * self.head_dim, self.head_dim], dim=-1)
        q = self.rope(self.q_norm(q.unflatten(-1, (self.heads, self.head_dim))).transpose(1, 2), positions)
        key_pos = positions
        if cache is not None:
            keys, key_pos = cache.update(keys, positions)
        return self.select(q, keys, key_pos, real)

    def _blocks(self, keys: Tensor, key_pos: Tensor, real: Tensor, nb: int) -> Tensor:
        """The rotated block keys ``[B, nb]`` x ``Di`` of the first ``nb`` complete blocks of each row."""
        B, D = keys.shape[0], keys.shape[-1]
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)[:, : nb * self.ratio]  # real keys first
        grouped = keys.gather(1, order.unsqueeze(-1).expand(-1, -1, D)).view(B, nb, self.ratio, D)
        pooled = self.k_norm(grouped.float().mean(dim=2).to(keys.dtype))  # [B, nb, Di]
        starts = key_pos.gather(1, order.view(B, nb, self.ratio)[..., 0])  # [B, nb]
        return self.rope(pooled.unsqueeze(1), starts).squeeze(1)

    def _top(self, scores: Tensor, valid: Tensor, complete: Tensor) -> Tensor:
        """``[B, N, nb]`` bool: each query's ``topk`` best valid blocks. Where equal scores straddle the
        cut (blocks scoring 0 after the ReLU), the query's scores go through ``torch.topk`` as
        transformers calls it (l. 857), so the same tied blocks win."""
        nb = scores.shape[-1]
        masked = scores.masked_fill(~valid, float("-inf"))
        ranked, order = torch.sort(masked, dim=-1, descending=True, stable=True)
        place = torch.empty_like(order).scatter_(-1, order, torch.arange(nb, device=scores.device).expand_as(order))
        top = valid & (place < self.topk)  # [B, N, nb]
        if nb > self.topk:
            ties = (complete > self.topk) & (ranked[..., self.topk - 1] == ranked[..., self.topk])  # [B, N]
            for b, i in ties.nonzero().tolist():
                picked = torch.topk(scores[b, i, : int(complete[b, i])], self.topk, dim=0).indices
                top[b, i] = False
                top[b, i, picked] = True
        return top

    def select(self, q: Tensor, keys: Tensor, key_pos: Tensor, real: Tensor) -> Tensor:
        """The selection mask ``[B, 1, N, L]`` of queries ``q [B, Hi, N, Di]`` (the last ``N`` of the
        ``L`` tokens) over the raw index keys ``keys [B, L, Di]`` at ``key_pos [B, L]``."""
        B, _, N, _ = q.shape
        L = keys.shape[1]
        rank = real.long().cumsum(1) - 1  # [B, L]: rank among the row's real keys
        seen = (rank + 1)[:, L - N:]  # [B, N]: real keys visible to each query
        complete = seen // self.ratio  # [B, N]: its complete blocks
        nb = int(complete.max()) if complete.numel() else 0
        block_of = (rank.clamp_min(0) // self.ratio).clamp(max=max(nb - 1, 0))  # [B, L]
        chosen = torch.zeros(B, N, L, dtype=torch.bool, device=q.device)
        if nb > 0:
            kb = self._blocks(keys, key_pos, real, nb)  # [B, nb, Di]
            scores = torch.einsum("bhnd,bjd->bnjh", q.float(), kb.float()).relu().sum(-1) / math.sqrt(self.head_dim)
            valid = torch.arange(nb, device=q.device) < complete.unsqueeze(-1)  # [B, N, nb]
            chosen = self._top(scores, valid, complete).gather(-1, block_of.unsqueeze(1).expand(B, N, L))
        tail = rank.unsqueeze(1) >= (complete * self.ratio).unsqueeze(-1)  # [B, N, L]
        causal = torch.arange(L, device=q.device) <= torch.arange(L - N, L, device=q.device).unsqueeze(-1)
        return (real.unsqueeze(1) & causal & (chosen | tail)).unsqueeze(1)


class IndexedAttention(nn.Module):
    """Attention over the keys a :class:`QSAIndexer` selects: ``attn`` (a causal
    :class:`~attnzoo.MultiHeadAttention`) under the indexer's mask. Attention protocol:
    ``forward(x [B, N, C], *, mask=None, cache=None, positions=None) -> [B, N, C]`` (``mask``: a key
    padding, bool ``[B, L]``-like or an :mod:`attnzoo.masks` key-padding ``Mask``)."""

    def __init__(self, attn: nn.Module, indexer: QSAIndexer) -> None:
        super().__init__()
        self.attn, self.indexer = attn, indexer
        self.num_heads = getattr(attn, "num_heads", None)

    def init_cache(self, batch_size: int, max_len: int, *, device: Any = None, dtype: Any = None) -> CacheList:
        """The attention's key/value cache and an :class:`IndexerCache`."""
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        return CacheList([self.attn.init_cache(batch_size, max_len, **kw),
                          self.indexer.init_cache(batch_size, max_len, **kw)])

    def forward(self, x: Tensor, *, mask: Any = None, cache: CacheList | None = None,
                positions: Tensor | None = None) -> Tensor:
        B, N, _ = x.shape
        kv, idx = (None, None) if cache is None else cache.layers
        past = 0 if idx is None else idx.length
        real = real_keys(mask, B, past + N, x.device)
        pos = torch.arange(past, past + N, device=x.device) if positions is None else positions.long()
        allowed = self.indexer(x, pos.expand(B, N), real, idx)  # [B, 1, N, past + N]
        kw: dict[str, Any] = {} if positions is None else {"positions": positions}
        return self.attn(x, mask=allowed, cache=kv, **kw)


class HyperMixer(nn.Module):
    """A layer's token mixer on the hyper-connected stream ``x [B, N, S C]``: the
    :class:`GatedResidual` read, the ``mixer`` (attention protocol) and the write-back; returns the
    update ``[B, N, S C]``. A PLE layer's :class:`PerLayerEmbedding` ``ple`` is held here (its
    weights and cache belong to the layer) and run by :class:`Qwen4ExpLM` on the token ids before
    the layer."""

    def __init__(self, residual: GatedResidual, mixer: nn.Module, *, ple: PerLayerEmbedding | None = None) -> None:
        super().__init__()
        self.residual, self.mixer, self.ple = residual, mixer, ple

    def init_cache(self, batch_size: int, max_len: int, *, device: Any = None, dtype: Any = None) -> Any:
        """The mixer's cache, with PLE a :class:`~attnzoo.nn.cache.CacheList` of it and a :class:`PLECache`."""
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        own = self.mixer.init_cache(batch_size, max_len, **kw)
        return own if self.ple is None else CacheList([own, self.ple.init_cache(batch_size, max_len, **kw)])

    def forward(self, x: Tensor, *, mask: Any = None, cache: Any = None, positions: Tensor | None = None) -> Tensor:
        own = cache.layers[0] if self.ple is not None and cache is not None else cache
        h, inj = self.residual.read(x)
        kw = {k: v for k, v in (("mask", mask), ("cache", own), ("positions", positions)) if v is not None}
        return self.residual.write(self.mixer(h, **kw), inj)  # type: ignore[arg-type]


class HyperFeedForward(nn.Module):
    """A layer's feed-forward on the hyper-connected stream: the :class:`GatedResidual` read, ``ffn``
    (``[B, N, C] -> [B, N, C]``), the write-back. ``x [B, N, W] -> [B, N, W]`` (the update)."""

    def __init__(self, residual: GatedResidual, ffn: nn.Module) -> None:
        super().__init__()
        self.residual, self.ffn = residual, ffn

    def forward(self, x: Tensor) -> Tensor:
        h, inj = self.residual.read(x)
        return self.residual.write(self.ffn(h), inj)  # type: ignore[arg-type]


class Qwen4ExpLM(StreamsLM):
    """The Qwen4-Exp decoder: a :class:`~attnzoo.models.loop.LayerLoopLM` whose loop copies the token
    embedding onto ``streams`` residual streams (``[B, N, S C]``), adds each PLE layer's per-layer
    embedding of the token ids before the layer, and runs the layers (:class:`HyperMixer` /
    :class:`HyperFeedForward` blocks); the final norm is the streams' read (``[B, N, C]``)."""

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x [B, N, C]`` -> the streams ``[B, N, S C]`` after the last layer."""
        positions = self.rotary_positions(positions, key_padding, past, x.shape[1], x.device, cu_seqlens)
        real = None if key_padding is None else key_padding[:, past:]  # [B, N]
        h = x.repeat(1, 1, self.streams)  # [B, N, S C]
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache[i]
            ple = block.attn.ple
            if ple is not None:
                h = h + ple(h, tokens, real, None if layer_cache is None else layer_cache.layers[1])
            h = block(h, key_padding=key_padding, cache=layer_cache, positions=positions)
        return h



def _check(hf: HFConfig) -> None:
    """Refuse, by name, what the conversion does not reproduce."""
    parts.unsupported_keys(hf, {
        "hidden_act": lambda v: v in (None, "silu", "swish"),
        "output_gate_type": lambda v: v in (None, "silu", "swish"),
        "attention_bias": lambda v: not v,
        "indexer_n_heads": lambda v: isinstance(v, int) and v > 0,
        "indexer_kv_heads": lambda v: v == 1,
    })
    budget, ratio = hf.req("indexer_budget"), hf.req("indexer_compress_ratio")
    if ratio < 1 or budget < 1 or budget % ratio:
        raise hf.unsupported(f"indexer_budget={budget} with indexer_compress_ratio={ratio} "
                             f"(the budget must be a positive multiple of the ratio)")


def _kinds(hf: HFConfig, depth: int) -> list[str]:
    """``layer_types`` with ``full_attention`` read as ``indexed_attention``; without it every
    ``full_attention_interval``-th layer (default 4) is indexed (configuration l. 169-179)."""
    types = hf.get("layer_types", None, list)
    if types is None:
        every = hf.get("full_attention_interval", 4)
        types = [KINDS[1] if (i + 1) % every == 0 else KINDS[0] for i in range(depth)]
    types = [KINDS[1] if t == "full_attention" else t for t in types]
    return parts.layer_types(HFConfig({**hf.data, "layer_types": types}, hf.source, hf.arch), depth, KINDS)


def _ple_layers(hf: HFConfig, kinds: list[str]) -> list[int]:
    """The 0-based PLE layers (``ple_layer_ids`` is one-indexed; linear layers only)."""
    ids = sorted(set(hf.get("ple_layer_ids", None, list) or []))
    bad = [i for i in ids if not 1 <= i <= len(kinds) or kinds[i - 1] != "linear_attention"]
    if bad:
        raise hf.unsupported(f"ple_layer_ids={ids} (layers {bad} are not linear_attention layers)")
    return [i - 1 for i in ids]


def _eos(hf: HFConfig) -> int:
    eos = hf.raw("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        raise hf.unsupported(f"eos_token_id={hf.raw('eos_token_id')!r} with PLE layers (an int is needed)")
    return eos


def _ple(hf: HFConfig, index: int, streams: int, eps: float, kw: dict[str, Any]) -> PerLayerEmbedding:
    """The :class:`PerLayerEmbedding` of the ``index``-th PLE layer."""
    C, V = hf.req("hidden_size"), hf.req("vocab_size")
    E = hf.get("ple_embed_dim", None) or C
    n, per = hf.get("ngram_size", 3), hf.get("heads_per_ngram", 8)
    if n < 2 or per < 1 or E % ((n - 1) * per):
        raise hf.unsupported(f"ple_embed_dim={E} with ngram_size={n}, heads_per_ngram={per}")
    ngram = NGramEmbedding(V, E, ngram_size=n, heads_per_ngram=per,
                           vocab_base=hf.get("ngram_vocab_size_base", 20_000_000),
                           divisor=hf.get("make_ngram_vocab_size_divisible_by", 128), seed=hf.get("seed", 1234),
                           ple_index=index, eos=_eos(hf), **kw)
    return PerLayerEmbedding(ngram, C, streams, E, hf.get("ple_conv_kernel_size", 4), eps, **kw)


def _indexed(hf: HFConfig, eps: float, kw: dict[str, Any]) -> IndexedAttention:
    """One ``indexed_attention`` mixer (the gated attention under a :class:`QSAIndexer`)."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    D, Di = hf.get("head_dim", C // H), hf.req("indexer_head_dim")
    params = parts.rope_params(hf)
    rot = int(D * float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0, float))))
    if rot > Di:
        raise hf.unsupported(f"indexer_head_dim={Di} below the rotary width {rot}")
    attn = parts.attention_factory(hf, window=None, rope=parts.rotary(hf, params, D, rotary_dim=rot),
                                   qk_norm="head", output_gate="element", **kw)()
    indexer = QSAIndexer(C, hf.req("indexer_n_heads"), Di, hf.req("indexer_budget"),
                         hf.req("indexer_compress_ratio"), parts.rotary(hf, params, Di, rotary_dim=rot), eps, **kw)
    return IndexedAttention(attn, indexer)


def _moe_config(hf: HFConfig) -> HFConfig:
    """``hf`` with transformers' default ``norm_topk_prob=True`` written in (a file may omit it)."""
    return HFConfig({**hf.data, "norm_topk_prob": hf.get("norm_topk_prob", True, bool)}, hf.source, hf.arch)


def build_qwen4_exp(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                    dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Qwen4ExpTextConfig`` (random weights; see the module docstring)."""
    _check(hf)
    C, V, depth = hf.req("hidden_size"), hf.req("vocab_size"), hf.req("num_hidden_layers")
    S, rank, eps = hf.get("hc_count", 4), hf.get("hc_lowrank", 320), hf.get("rms_norm_eps", 1e-6, float)
    if S < 2:
        raise hf.unsupported(f"hc_count={S} (Qwen4-Exp needs at least 2 streams)")
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    kinds = _kinds(hf, depth)
    ple = {i: n for n, i in enumerate(_ple_layers(hf, kinds))}
    linear = functools.partial(QwenGatedDeltaNet, C, hf.req("linear_num_key_heads"), hf.req("linear_num_value_heads"),
                               hf.req("linear_key_head_dim"), hf.req("linear_value_head_dim"),
                               hf.get("linear_conv_kernel_dim", 4), norm_eps=eps, **kw)
    moe_hf, residual = _moe_config(hf), functools.partial(GatedResidual, C, S, rank, eps, **kw)

    def mixer(i: int) -> HyperMixer:
        inner = linear() if kinds[i] == "linear_attention" else _indexed(hf, eps, kw)
        return HyperMixer(residual(), inner, ple=_ple(hf, ple[i], S, eps, kw) if i in ple else None)

    blocks = [parts.block(S * C, functools.partial(mixer, i),
                          lambda: HyperFeedForward(residual(), moe_from_config(moe_hf, "stacked", **kw)), nn.Identity)
              for i in range(depth)]
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="rope", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool), max_seq_len=parts.max_positions(hf))
    return Qwen4ExpLM(streams=S, config=cfg, parts=DecoderParts(
        blocks=blocks, norm=residual(combine=False), head=head_for(C, V, head_size, **kw)), **kw)


def _put_residual(plan: Plan, ours: str, theirs: str, *, combine: bool = True) -> None:
    plan.put(f"{ours}norm.weight", f"{theirs}hc_norm.weight", parts.plus_one)
    plan.put(f"{ours}down.weight", f"{theirs}input_mix_weight_down.weight")
    plan.put(f"{ours}up.weight", f"{theirs}input_mix_weight_up.weight")
    if combine:
        plan.put(f"{ours}inject.weight", f"{theirs}block_inject_weight.weight")


def _put_ple(plan: Plan, ours: str, theirs: str) -> None:
    """A :class:`PerLayerEmbedding`; the n-gram table whole or in ``shard_{i}`` rows (saved folders)."""
    table = f"{theirs}ple_embedding.ngram_embedding."
    if plan.src.has(f"{table}weight"):
        plan.put(f"{ours}ngram.table.weight", f"{table}weight")
    else:
        count = 0
        while plan.src.has(f"{table}shard_{count}.weight"):
            count += 1
        plan.put_cat(f"{ours}ngram.table.weight", [f"{table}shard_{i}.weight" for i in range(max(count, 1))])
    for n in ("key_proj", "value_proj"):
        plan.put(f"{ours}{n}.weight", f"{theirs}{n}.weight")
    for n in ("norm_key", "norm_query", "norm_conv"):
        plan.put(f"{ours}{n}.weight", f"{theirs}{n}.weight", parts.plus_one)
    plan.put(f"{ours}conv_weight", f"{theirs}conv1d.weight", lambda w: w[:, 0].contiguous())


def _put_indexed(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    put_gated_attention(plan, f"{ours}attn", theirs, hf)
    plan.put(f"{ours}indexer.proj.weight", f"{theirs}indexer.index_qk_proj.weight")
    plan.put(f"{ours}indexer.q_norm.weight", f"{theirs}indexer.q_layernorm.weight", parts.plus_one)
    plan.put(f"{ours}indexer.k_norm.weight", f"{theirs}indexer.k_layernorm.weight", parts.plus_one)


def convert_qwen4_exp(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> nn.Module:
    """Build a Qwen4-Exp decoder and copy the weights (the head follows them)."""
    model, plan, head_size = parts.start(hf, sd, build_qwen4_exp, device=device, dtype=dtype)
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        _put_residual(plan, f"{o}attn.residual.", f"{h}attn_hyper_connection.")
        _put_residual(plan, f"{o}ffn.residual.", f"{h}mlp_hyper_connection.")
        if isinstance(block.attn.mixer, IndexedAttention):
            _put_indexed(plan, f"{o}attn.mixer.", f"{h}self_attn.", hf)
        else:
            put_split_deltanet(plan, f"{o}attn.mixer.", f"{h}linear_attn.", hf)
        if block.attn.ple is not None:
            _put_ple(plan, f"{o}attn.ple.", f"{h}ple.")
        put_moe(plan, f"{o}ffn.ffn.", f"{h}mlp.", "stacked", shared=True, shared_gate=True)
    _put_residual(plan, "norm.", "hyper_connection_mixer.", combine=False)
    ignore = [r"(model\.)?rotary_emb\w*\.\w+", r"(model\.)?mtp\..*", r"(model\.)?visual\..*",
              r"(model\.)?layers\.\d+\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_\w+)"]
    parts.put_head(plan, head_size, model.tie_embeddings, ignore)
    plan.apply(model, ignore=ignore)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "qwen4_exp_text": parts.Dispatch("Qwen4-Exp", convert_qwen4_exp, ("Qwen4ExpForCausalLM", "Qwen4ExpTextModel")),
}
