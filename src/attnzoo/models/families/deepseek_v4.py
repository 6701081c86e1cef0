"""DeepSeek-V4 (transformers ``model_type="deepseek_v4"``: ``DeepseekV4ForCausalLM``,
``DeepseekV4Model``) -> :class:`DeepseekV4LM`, a :class:`~attnzoo.DecoderLM` whose layers run on
``hc_mult`` residual streams.

What transformers computes (``models/deepseek_v4/modeling_deepseek_v4.py`` of transformers 5.25;
the line numbers are that file's; the defaults and legacy keys from ``configuration_deepseek_v4.py``,
``DeepseekV4Config.__post_init__``, l. 231-316 of that file), each reproduced here:

* Streams (``DeepseekV4Model.forward``, l. 1323-1374): the token embedding copied onto ``hc_mult``
  streams ``[B, N, S, C]`` (l. 1356); every layer has two manifold-constrained hyper-connections
  (``DeepseekV4HyperConnection``, l. 884-995, the same mHC as GLM-5-Next's:
  :class:`~attnzoo.models.families.glm5_next.HyperConnection`, reused; the layer, l. 1148-1199); after
  the last layer ``DeepseekV4HyperHead`` (l. 998-1014) collapses the streams,
  ``sum_s (sigmoid(rmsnorm(flat(x)) W_hc * scale + base) + hc_eps)_s x_s`` (:class:`HyperHead`), then
  the final RMSNorm and the head (l. 1373). Positions are ``past .. past + N - 1`` unless given (l. 1341).
* Attention (``DeepseekV4Attention``, l. 764-881; :class:`V4Attention`): one shared key = value head
  (MQA); ``q = rmsnorm_unweighted(q_b(rmsnorm(q_a(x))))`` per head (l. 65-71, 826-829),
  ``kv = rmsnorm(kv_proj(x))``; RoPE *interleaved* (pairs of adjacent channels: ``rotate_half`` /
  ``apply_rotary_pos_emb``, l. 345-369) on the trailing ``qk_rope_head_dim = head_dim *
  partial_rotary_factor`` channels of q and kv, the ``main`` rope (``rope_theta``, unscaled) on sliding
  layers and the ``compress`` rope (``compress_rope_theta`` with the config's scaling; yarn's
  ``attention_factor`` 1) on compressed ones (l. 786; config l. 297-316; :class:`InterleavedRope`);
  a sliding window of ``sliding_window`` keys (the query's own included), softmax scale
  ``head_dim ** -0.5`` with one learnable sink logit per head (``eager_attention_forward``, l. 726-761);
  the output's rope channels rotated back by the query's angle (l. 876); a grouped low-rank output
  projection: ``o_groups`` groups of heads, each through its own block of ``o_a_proj`` to
  ``o_lora_rank``, then ``o_b_proj`` (``DeepseekV4GroupedLinear``, l. 313-342; l. 878-880).
* Compressed layers (``heavily_compressed_attention``: ``DeepseekV4HCACompressor``, l. 372-454;
  ``compressed_sparse_attention``: ``DeepseekV4CSACompressor``, l. 599-711; :class:`Compressor`):
  each closed window of ``m = compress_rates[kind]`` tokens (token indices ``w m .. w m + m - 1``,
  padding included, not the positions) becomes one entry ``rmsnorm(sum_j softmax_j(gate_j + ape_j) kv_j)``
  (softmax per channel, float32) roped at ``w m``, appended to the keys (and values). CSA's
  projections are twice as wide: window ``w``'s entry pools the second halves of its own tokens with
  the first halves of window ``w - 1``'s (none for ``w = 0``). Query ``t`` sees the entry of window
  ``w`` when ``w < (position_t + 1) // m`` (l. 448); HCA with one query token sees every closed
  window (l. 443: no bias, so the padded mask gives them all). CSA further keeps only the entries the
  Lightning Indexer selects (``DeepseekV4Indexer`` / ``IndexerScorer``, l. 457-596;
  :class:`LightningIndexer`): its own CSA-style compressor at ``index_head_dim``, queries
  ``q_b(q_resid)`` roped at the positions, ``score = sum_h w_h(x) H^-1/2 relu(q_h . k) / sqrt(Di)``
  over the visible entries, the ``index_topk`` best kept (l. 580-596, 694-711).
* Feed-forward (``DeepseekV4SparseMoeBlock``, l. 1128-1145; :class:`V4MoE`): routed experts plus one
  shared expert of ``moe_intermediate_size`` (``n_shared_experts`` is not read by transformers), every
  SwiGLU ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (l. 1017-1073; glm5_next's
  :class:`~attnzoo.models.families.glm5_next.ClampedMoE` / ``ClampedSwiGLU``). Router scores
  ``sqrtsoftplus(l) = sqrt(softplus(l))`` or ``sigmoid(l)`` of the logits ``l = x W_r``; ``moe`` layers
  pick the top ``k`` of ``score + e_score_correction_bias`` (``DeepseekV4TopKRouter``, l. 1076-1094),
  ``hash_moe`` layers the experts ``tid2eid[token]`` (``DeepseekV4HashRouter``, l. 1097-1125); the
  picked scores always divided by their sum + 1e-20 (``norm_topk_prob`` is not read), times
  ``routed_scaling_factor``.
* Precision (``_keep_in_fp32_modules_strict``, l. 1240-1252): the RMSNorms (weight applied in
  float32 before the cast, :class:`V4RMSNorm`), hyper-connections, hyper-head, sinks (the scores
  promoted to float32 by them), position biases and correction biases stay float32 in a half-precision
  model: a bfloat16 conversion gives transformers' bfloat16 logits.

Cached decode (:class:`V4Cache`: every token's keys and compressor inputs, the closed windows'
entries) equals transformers' own cached calls. transformers' cached calls and its full forward
differ where the indexer's top-k meets a tie (entries scored exactly 0, every head's ReLU at 0: a
query's top-k runs over the windows closed so far in decode, over the whole sequence in the full
forward, and breaks the tie differently); attnzoo follows transformers in each (cached calls as its
cached calls, the full forward as its full forward); without such a tie cached decode equals the
full forward. Packed sequences (``cu_seqlens``) run each sequence alone (transformers' compressors
would pool windows across sequences). Saved folders use the checkpoint's names (``attn.wq_a``,
``ffn.experts.{e}.w1``, ``hc_attn_fn``, ``head.weight``, ...; transformers' ``conversion_mapping``):
both load; the multi-token-prediction weights (``mtp.*``) are dropped.

Refused by name: ``scoring_func`` other than ``sqrtsoftplus`` / ``sigmoid`` (transformers has no
``softmax`` activation to build it), ``hidden_act`` other than SiLU, ``mlp_bias=True`` (the shared
expert's biases), ``num_key_value_heads != 1`` (V4 has one shared key/value head whatever it says;
refused rather than ignored), a compress ``rope_type`` that depends on the sequence length
(``dynamic``, ``longrope``) or unknown, compress rates other than ``int >= 1``, a rotary width that
is odd, zero or wider than ``head_dim`` (``partial_rotary_factor``) or than ``index_head_dim``,
``o_groups`` not dividing the heads, ``swiglu_limit`` ``None`` or ``<= 0``, unknown layer kinds.
``attention_bias`` is not read by transformers (no biases) and not here either.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.glm5_next as glm5_next
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.families._moe import put_moe
from attnzoo.models.families.kimi_linear import saved_names
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.loop import StreamsLM
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.cache import _LengthCache
from attnzoo.nn.moe import Routing
from attnzoo.nn.rope_scaling import rope_inv_freq

__all__ = ["DEFAULTS", "DISPATCH", "KINDS", "Compressor", "DeepseekV4LM", "HyperHead", "InterleavedRope",
           "LightningIndexer", "V4Attention", "V4Block", "V4Cache", "V4MoE", "V4RMSNorm", "V4Shape",
           "build_deepseek_v4", "canonical", "convert_deepseek_v4"]

#: ``DeepseekV4Config``'s defaults of the keys read here, for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8,
    "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "mlp_bias": False, "attention_dropout": 0.0,
}

#: the attention kinds (``layer_types``) and their legacy ``compress_ratios`` values
KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

#: the checkpoint's names -> transformers' module names (its ``conversion_mapping`` for ``deepseek_v4``)
_SAVED = tuple((re.compile(p), r) for p, r in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^(model\.)?embed\.weight$", r"\1embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^(model\.)?hc_head_(fn|base|scale)$", r"\1hc_head.hc_\2"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"(layers\.\d+\..*)\.norm\.", r"\1.kv_norm."),
    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.w1\.weight$", ".gate_proj.weight"), (r"\.w2\.weight$", ".down_proj.weight"),
    (r"\.w3\.weight$", ".up_proj.weight")))


def _unit_rms(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight over the last dim (transformers' ``DeepseekV4UnweightedRMSNorm``, l. 65-71)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4RMSNorm(nn.Module):
    """transformers' ``DeepseekV4RMSNorm`` (l. 45-62), kept in float32 as its ``_keep_in_fp32_modules_strict``
    (l. 1240-1252): ``(weight * x32 / sqrt(mean(x32^2) + eps)).to(x.dtype)``, the weight applied in float32
    before the cast (attnzoo's :class:`~attnzoo.RMSNorm` casts first, LLaMA's order).

    Weight: ``weight [C]`` (float32). Shapes: ``[..., C] -> [..., C]``.
    """

    def __init__(self, dim: int, eps: float, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# --------------------------------------------------------------------------- rotary
class InterleavedRope(nn.Module):
    """V4's RoPE: angles ``pos * inv_freq`` (``inv_freq [r / 2]`` of a Hugging Face rope dict, times
    the type's attention scaling), each applied to a pair of adjacent channels of the trailing ``r``
    channels (l. 345-369); the leading channels pass through.

    Args:
        params: the rope dict (``rope_type``, ``rope_theta``, the type's keys).
        rotary_dim: ``r`` (even).
        max_positions: ``max_position_embeddings`` (yarn without an original length).
    """

    def __init__(self, params: dict[str, Any], rotary_dim: int, *, max_positions: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        inv, self.scaling = rope_inv_freq(params, rotary_dim, max_position_embeddings=max_positions, device=device)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rotary_dim = rotary_dim

    def angles(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [B, N]`` -> ``(cos, sin)`` ``[B, N, r]`` (each angle repeated for its pair)."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        cos, sin = (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)
        return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x [..., N, D]`` with its trailing ``r`` channels rotated (``cos``/``sin`` broadcast to ``[..., N, r]``)."""
        r = cos.shape[-1]
        keep, rot = x[..., :-r], x[..., -r:]
        swapped = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat([keep, (rot.float() * cos + swapped.float() * sin).to(x.dtype)], dim=-1)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, scaling={self.scaling}"


# --------------------------------------------------------------------------- compressors
class Compressor(nn.Module):
    """Pools each closed window of ``rate`` tokens into one entry (see the module docstring); weights
    under transformers' names: ``kv_proj``, ``gate_proj [k D, C]``, ``position_bias [rate, k D]``
    (float32), ``kv_norm [D]``; ``k = 2`` with ``overlap`` (CSA: window ``w`` also pools the first
    halves of window ``w - 1``), else 1 (HCA).

    Args:
        dim: model width ``C``.
        head_dim: entry width ``D``.
        rate: window length ``m``.
        overlap: CSA's two series.
        rope: the entries' rotary (at ``w m``).
        norm_eps: the entries' RMSNorm epsilon.
    """

    def __init__(self, dim: int, head_dim: int, rate: int, *, overlap: bool, rope: InterleavedRope, norm_eps: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.head_dim, self.rate, self.overlap, self.rope = head_dim, rate, bool(overlap), rope
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = nn.Linear(dim, width, bias=False, **kw)
        self.gate_proj = nn.Linear(dim, width, bias=False, **kw)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, device=device, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(head_dim, norm_eps, device=device)

    @property
    def raw_width(self) -> int:
        """Per token: ``[kv; gate]`` (what a cache keeps)."""
        return 2 * self.kv_proj.out_features

    def project(self, x: Tensor) -> Tensor:
        """``x [B, N, C]`` -> ``[B, N, 2 k D]`` (``[kv; gate]``)."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def forward(self, raw: Tensor, first: int, last: int) -> Tensor:
        """The entries of windows ``first .. last - 1`` ``[B, last - first, D]`` from ``raw [B, L, 2 k D]``
        (every token from index 0, ``L >= last * m``)."""
        B, m, D = raw.shape[0], self.rate, self.head_dim
        n = last - first
        if n <= 0:
            return raw.new_zeros(B, 0, D)
        kv, gate = raw[:, first * m:last * m].view(B, n, m, -1).chunk(2, dim=-1)  # [B, n, m, k D]
        gate = gate + self.position_bias
        if self.overlap:
            prev_kv, prev_gate = kv[..., :D].new_zeros(B, n, m, D), gate.new_full((B, n, m, D), float("-inf"))
            prev_kv[:, 1:], prev_gate[:, 1:] = kv[:, :-1, :, :D], gate[:, :-1, :, :D]
            if first > 0:  # window first - 1's first halves, from the buffer
                pk, pg = raw[:, (first - 1) * m:first * m].chunk(2, dim=-1)
                prev_kv[:, 0], prev_gate[:, 0] = pk[..., :D], (pg + self.position_bias)[..., :D]
            kv = torch.cat([prev_kv, kv[..., D:]], dim=2)  # [B, n, 2m, D]
            gate = torch.cat([prev_gate, gate[..., D:]], dim=2)
        pooled = self.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))  # [B, n, D]
        pos = (torch.arange(first, last, device=raw.device) * m).expand(B, -1)
        cos, sin = self.rope.angles(pos, pooled.dtype)
        return self.rope.rotate(pooled, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rate={self.rate}, overlap={self.overlap}"


class LightningIndexer(nn.Module):
    """CSA's Lightning Indexer (l. 457-596): its own overlapping :class:`Compressor` at
    ``head_dim`` ``Di`` (``compressor``), queries ``q_b_proj(q_resid)`` (``[H Di, rq]``) roped at the
    positions, ``weights_proj [H, C]``; keeps the ``topk`` best visible entries per query.

    Args:
        dim, q_rank: ``C``, ``q_lora_rank``.
        heads, head_dim: ``index_n_heads``, ``index_head_dim``.
        topk: ``index_topk``.
        compressor: the indexer's :class:`Compressor` (``overlap=True``, width ``Di``).
    """

    def __init__(self, dim: int, q_rank: int, *, heads: int, head_dim: int, topk: int, compressor: Compressor,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"bias": False, "device": device, "dtype": dtype}
        self.heads, self.head_dim, self.topk, self.compressor = heads, head_dim, topk, compressor
        self.q_b_proj = nn.Linear(q_rank, heads * head_dim, **kw)
        self.weights_proj = nn.Linear(dim, heads, **kw)

    def forward(self, x: Tensor, q_resid: Tensor, positions: Tensor, keys: Tensor) -> Tensor:
        """``x [B, N, C]``, ``q_resid [B, N, rq]``, ``positions [B, N]``, ``keys [B, T, Di]`` (the
        indexer's entries) -> which entries each query keeps ``[B, N, T]`` (bool)."""
        B, N, _ = x.shape
        T = keys.shape[1]
        if T == 0:
            return torch.zeros(B, N, 0, dtype=torch.bool, device=x.device)
        rope = self.compressor.rope
        cos, sin = rope.angles(positions, x.dtype)
        q = self.q_b_proj(q_resid).view(B, N, self.heads, self.head_dim).transpose(1, 2)
        q = rope.rotate(q, cos[:, None], sin[:, None]).transpose(1, 2)  # [B, N, H, Di]
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # [B, N, H, T]
        scores = F.relu(scores) * self.head_dim ** -0.5
        weights = self.weights_proj(x).float() * self.heads ** -0.5  # [B, N, H]
        index = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [B, N, T]
        closed = (positions + 1) // self.compressor.rate  # [B, N]
        future = torch.arange(T, device=x.device).view(1, 1, -1) >= closed.unsqueeze(-1)
        top = index.masked_fill(future, float("-inf")).topk(min(self.topk, T), dim=-1).indices  # [B, N, k]
        keep = torch.zeros(B, N, T, dtype=torch.bool, device=x.device)
        return keep.scatter_(-1, top, top < closed.unsqueeze(-1))

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, topk={self.topk}"


# --------------------------------------------------------------------------- cache
class V4Cache(_LengthCache):
    """A V4 attention layer's decode cache, written in place by token index: ``kv [B, L, D]`` (the
    shared keys = values), and per compressor (the attention's, the indexer's) the raw ``[kv; gate]``
    of every token ``[B, L, 2 k D]`` and the closed windows' entries ``[B, L // m, D]``. Its state is
    ``length`` (protocol as :class:`~attnzoo.nn.mla.LatentCache`): a window's entry is recomputed from
    the raw tokens whenever it closes."""

    _batch_tensors = ("kv", "raw", "entries")

    def __init__(self, batch_size: int, max_len: int, head_dim: int, compressors: list[Compressor], *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self._batch_size, self.max_len, self.length = batch_size, max_len, 0
        self.kv = torch.zeros(batch_size, max_len, head_dim, **kw)
        self.raw = [torch.zeros(batch_size, max_len, c.raw_width, **kw) for c in compressors]
        self.entries = [torch.zeros(batch_size, max_len // c.rate, c.head_dim, **kw) for c in compressors]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.kv, *self.raw, *self.entries))

    def write_kv(self, kv: Tensor) -> Tensor:
        """Write ``kv [B, n, D]`` at ``length ..`` (``length`` moves in :meth:`advance`); every token's."""
        start, n = self.length, kv.shape[1]
        if start + n > self.max_len:
            raise ValueError(f"V4Cache overflow: {start} tokens cached + {n} new > max_len={self.max_len}")
        self.kv[:, start:start + n] = kv
        return self.kv[:, :start + n]

    def entries_of(self, i: int, compressor: Compressor, raw: Tensor) -> Tensor:
        """Compressor ``i``'s new tokens ``raw [B, n, 2 k D]`` written; the entries of every window closed so far."""
        start, n, m = self.length, raw.shape[1], compressor.rate
        self.raw[i][:, start:start + n] = raw
        done, now = start // m, (start + n) // m
        if now > done:
            self.entries[i][:, done:now] = compressor(self.raw[i][:, :now * m], done, now)
        return self.entries[i][:, :now]

    def advance(self, n: int) -> None:
        self.length += n


# --------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class V4Shape:
    """A V4 attention layer's sizes: width ``dim``, ``heads``, ``head_dim``, ``q_rank``
    (``q_lora_rank``), ``groups`` / ``group_rank`` (``o_groups`` / ``o_lora_rank``), ``window``
    (``sliding_window``: keys a query sees, itself included), ``norm_eps``, ``dropout``."""

    dim: int
    heads: int
    head_dim: int
    q_rank: int
    groups: int
    group_rank: int
    window: int
    norm_eps: float
    dropout: float = 0.0


class V4Attention(nn.Module):
    """A V4 attention layer (see the module docstring): sliding MQA with sinks, plus (``compressor``)
    the compressed entries, kept per query by ``indexer`` (CSA) or by causality alone (HCA).

    Weights under transformers' names: ``q_a_proj [rq, C]``, ``q_a_norm``, ``q_b_proj [H D, rq]``,
    ``kv_proj [D, C]``, ``kv_norm``, ``o_a_proj [G R, H D / G]``, ``o_b_proj [C, G R]``, ``sinks [H]``
    (float32), ``compressor``, ``indexer``.
    Shapes: ``x [B, N, C] -> [B, N, C]``.
    """

    def __init__(self, shape: V4Shape, *, rope: InterleavedRope, compressor: Compressor | None = None,
                 indexer: LightningIndexer | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        s, kw = shape, {"bias": False, "device": device, "dtype": dtype}
        if s.heads % s.groups:
            raise ValueError(f"V4Attention: groups ({s.groups}) must divide heads ({s.heads})")
        self.shape, self.rope, self.compressor, self.indexer = s, rope, compressor, indexer
        self.q_a_proj = nn.Linear(s.dim, s.q_rank, **kw)
        self.q_a_norm = V4RMSNorm(s.q_rank, s.norm_eps, device=device)
        self.q_b_proj = nn.Linear(s.q_rank, s.heads * s.head_dim, **kw)
        self.kv_proj = nn.Linear(s.dim, s.head_dim, **kw)
        self.kv_norm = V4RMSNorm(s.head_dim, s.norm_eps, device=device)
        self.o_a_proj = nn.Linear(s.heads * s.head_dim // s.groups, s.groups * s.group_rank, **kw)
        self.o_b_proj = nn.Linear(s.groups * s.group_rank, s.dim, **kw)
        self.sinks = nn.Parameter(torch.zeros(s.heads, device=device, dtype=torch.float32))

    def _compressors(self) -> list[Compressor]:
        found = [self.compressor, None if self.indexer is None else self.indexer.compressor]
        return [c for c in found if c is not None]

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> V4Cache:
        p = self.kv_proj.weight
        return V4Cache(batch_size, max_len, self.shape.head_dim, self._compressors(), device=device or p.device,
                       dtype=dtype or p.dtype)

    def forward(self, x: Tensor, *, positions: Tensor, key_padding: Tensor | None,
                cache: V4Cache | None = None) -> Tensor:
        """``x [B, N, C]`` (with a cache the new tokens), ``positions [B, N]``, ``key_padding
        [B, past + N]`` (True = real; ``None``: all real) -> ``[B, N, C]``."""
        s, (B, N, _) = self.shape, x.shape
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = _unit_rms(self.q_b_proj(q_resid).view(B, N, s.heads, s.head_dim).transpose(1, 2), s.norm_eps)
        cos, sin = self.rope.angles(positions, x.dtype)  # [B, N, r]
        q = self.rope.rotate(q, cos[:, None], sin[:, None])  # [B, H, N, D]
        kv = self.rope.rotate(self.kv_norm(self.kv_proj(x)), cos, sin)  # [B, N, D]
        past = 0 if cache is None else cache.length
        if cache is not None:
            kv = cache.write_kv(kv)
        lo = max(0, past - s.window + 1)  # keys before lo are outside every query's window
        keys, visible = kv[:, lo:], self._sliding(B, N, past, lo, key_padding, x.device)
        if self.compressor is not None:
            entries, seen = self._compressed(x, q_resid, positions, cache)
            keys, visible = torch.cat([keys, entries], dim=1), torch.cat([visible, seen], dim=-1)
        if cache is not None:
            cache.advance(N)
        out = self._attend(q, keys, visible)  # [B, H, N, D]
        out = self.rope.rotate(out, cos[:, None], -sin[:, None]).transpose(1, 2)  # [B, N, H, D]
        grouped = out.reshape(B, N, s.groups, -1)
        w = self.o_a_proj.weight.view(s.groups, s.group_rank, -1)  # [G, R, H D / G]
        return self.o_b_proj(torch.einsum("bngi,gri->bngr", grouped, w).flatten(2))

    def _sliding(self, B: int, N: int, past: int, lo: int, key_padding: Tensor | None,
                 device: torch.device) -> Tensor:
        """Query ``past + i`` sees key ``j`` when ``past + i - window < j <= past + i`` and ``j`` is real: ``[B, N, K]``."""
        q_idx = past + torch.arange(N, device=device)[:, None]
        k_idx = torch.arange(lo, past + N, device=device)[None, :]
        ok = (k_idx <= q_idx) & (k_idx > q_idx - self.shape.window)
        ok = ok.expand(B, -1, -1)
        return ok if key_padding is None else ok & key_padding[:, None, lo:]

    def _compressed(self, x: Tensor, q_resid: Tensor, positions: Tensor,
                    cache: V4Cache | None) -> tuple[Tensor, Tensor]:
        """The compressed entries ``[B, T, D]`` and which each query sees ``[B, N, T]``."""
        assert self.compressor is not None
        entries = [self._entries(i, c, x, cache) for i, c in enumerate(self._compressors())]
        B, N, T = x.shape[0], x.shape[1], entries[0].shape[1]
        if self.indexer is not None:
            return entries[0], self.indexer(x, q_resid, positions, entries[1])
        if N == 1:  # transformers' HCA gives one query token every closed window (l. 443)
            return entries[0], torch.ones(B, N, T, dtype=torch.bool, device=x.device)
        closed = (positions + 1) // self.compressor.rate
        return entries[0], torch.arange(T, device=x.device).view(1, 1, -1) < closed.unsqueeze(-1)

    @staticmethod
    def _entries(i: int, compressor: Compressor, x: Tensor, cache: V4Cache | None) -> Tensor:
        raw = compressor.project(x)
        if cache is not None:
            return cache.entries_of(i, compressor, raw)
        return compressor(raw, 0, x.shape[1] // compressor.rate)

    def _attend(self, q: Tensor, keys: Tensor, visible: Tensor) -> Tensor:
        """Eager softmax with one sink logit per head (``eager_attention_forward``, l. 726-761): ``[B, H, N, D]``."""
        B, H, N, _ = q.shape
        scores = torch.matmul(q, keys.unsqueeze(1).transpose(-1, -2)) * self.shape.head_dim ** -0.5  # [B, H, N, K]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        sinks = self.sinks.view(1, H, 1, 1).expand(B, H, N, 1)
        logits = torch.cat([scores, sinks], dim=-1)  # promoted: float32 under half-precision scores, as transformers
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        probs = F.dropout(probs, self.shape.dropout, self.training).to(keys.dtype)
        return torch.matmul(probs, keys.unsqueeze(1))

    def extra_repr(self) -> str:
        s = self.shape
        return f"heads={s.heads}, head_dim={s.head_dim}, window={s.window}, groups={s.groups}"


# --------------------------------------------------------------------------- feed-forward
class V4MoE(glm5_next.ClampedMoE):
    """V4's MoE (see the module docstring): :class:`~attnzoo.models.families.glm5_next.ClampedMoE`'s
    clamped SwiGLU experts and shared expert, routed by ``scoring`` (``"sqrtsoftplus"``: ``sqrt(softplus(l))``,
    or ``"sigmoid"``) scores, the top ``k`` of ``score + score_bias`` or, with ``vocab`` (a ``hash_moe``
    layer), the experts ``tid2eid[token]`` (buffer ``[vocab, k]`` long, no ``score_bias``); the picked
    scores divided by their sum + 1e-20, times ``scaling``.

    Shapes: :meth:`forward` ``x [..., C]``, ``tokens`` of ``x``'s leading shape -> ``[..., C]``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, scoring: str, scaling: float,
                 limit: float, vocab: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if scoring not in ("sqrtsoftplus", "sigmoid"):
            raise ValueError(f"V4MoE: scoring must be 'sqrtsoftplus' or 'sigmoid', got {scoring!r}")
        shared = glm5_next.ClampedSwiGLU(dim, hidden, limit, device=device, dtype=dtype)
        super().__init__(dim, hidden, num_experts, top_k, routing=Routing("sigmoid_topk", scaling=scaling),
                         limit=limit, shared_expert=shared, device=device, dtype=dtype)
        self.scoring = scoring
        self.tid2eid: Tensor | None
        if vocab is None:
            self.register_buffer("tid2eid", None)
        else:
            self.register_buffer("score_bias", None)
            self.register_buffer("tid2eid", torch.zeros(vocab, top_k, dtype=torch.long, device=device))

    def forward(self, x: Tensor, tokens: Tensor | None = None) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.dim)  # [T, C]
        logits = self.router(flat)  # [T, E], in x's dtype as transformers' (l. 1089)
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else torch.sigmoid(logits)
        if self.tid2eid is not None:
            if tokens is None:
                raise ValueError("V4MoE: a hash-routed layer needs the token ids")
            experts = self.tid2eid[tokens.reshape(-1)]
        else:
            assert self.score_bias is not None
            experts = torch.topk(scores + self.score_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling
        out = torch.zeros_like(flat)
        for e in torch.unique(experts).tolist():
            token, slot = torch.nonzero(experts == e, as_tuple=True)
            out.index_add_(0, token, (self.expert(e, flat[token]) * weights[token, slot, None]).to(out.dtype))
        assert self.shared_expert is not None
        return (out + self.shared_expert(flat)).view(shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scoring={self.scoring!r}, hashed={self.tid2eid is not None}"


# --------------------------------------------------------------------------- layers and model
class HyperHead(nn.Module):
    """The final collapse of the streams (``DeepseekV4HyperHead``, l. 998-1014): ``hc_fn [S, S C]``,
    ``hc_base [S]``, ``hc_scale [1]`` (float32); ``x [B, N, S, C] -> [B, N, C]``."""

    def __init__(self, dim: int, streams: int, *, eps: float, norm_eps: float,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps, self.norm_eps = float(eps), float(norm_eps)
        self.hc_fn = nn.Parameter(torch.randn(streams, streams * dim, device=device) * 0.02)
        self.hc_base = nn.Parameter(torch.zeros(streams, device=device))
        self.hc_scale = nn.Parameter(torch.ones(1, device=device))

    def forward(self, x: Tensor) -> Tensor:
        flat = _unit_rms(x.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.eps).unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


class V4Block(glm5_next.HyperBlock):
    """One V4 layer on the residual streams (GLM-5-Next's :class:`HyperBlock` parts, its own forward): ``attn_hc`` -> ``attn_norm`` -> ``attn``
    (:class:`V4Attention`), then ``ffn_hc`` -> ``ffn_norm`` -> ``ffn`` (:class:`V4MoE`, given the
    token ids); each result merged into the streams by its hyper-connection (l. 1148-1199).

    Shapes: ``x [B, N, S, C] -> [B, N, S, C]``.
    """

    def forward(self, x: Tensor, *, tokens: Tensor, positions: Tensor,  # type: ignore[override]
                key_padding: Tensor | None, cache: V4Cache | None = None) -> Tensor:
        post, comb, h = self.attn_hc(x)
        h = self.attn(self.attn_norm(h), positions=positions, key_padding=key_padding, cache=cache)
        x = self.attn_hc.merge(x, h, post, comb)
        post, comb, h = self.ffn_hc(x)
        return self.ffn_hc.merge(x, self.ffn(self.ffn_norm(h), tokens), post, comb)


class DeepseekV4LM(StreamsLM):
    """A :class:`~attnzoo.models.loop.LayerLoopLM` of :class:`V4Block` layers on ``streams``
    residual streams: the embedding copied onto every stream, :class:`HyperHead` before the final
    norm. ``positions`` (``[N]`` or ``[B, N]``; default ``past .. past + N - 1``) place the rotaries
    and the compressed entries' causality; the windows count tokens (padding included), as
    transformers'. ``cu_seqlens`` runs each packed sequence alone. Generation and caches as
    :class:`~attnzoo.DecoderLM`."""

    def __init__(self, *, head: HyperHead, config: DecoderConfig, parts: DecoderParts,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(streams=head.hc_fn.shape[0], config=config, parts=parts, device=device, dtype=dtype)
        self.hc_head = head

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The streams ``[B, N, S, C]`` through the blocks, collapsed by :class:`HyperHead`."""
        B, N = tokens.shape
        pos = (past + torch.arange(N, device=tokens.device) if positions is None else positions).expand(B, N)
        h = x.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()  # [B, N, S, C]
        for i, block in enumerate(self.blocks):
            h = block(h, tokens=tokens, positions=pos, key_padding=key_padding, cache=None if cache is None else cache[i])
        return self.hc_head(h)


# --------------------------------------------------------------------------- config
def _rope_dicts(hf: HFConfig, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``rope_parameters`` as ``{"main": ..., "compress": ...}`` (config l. 297-316)."""
    rp = hf.get("rope_parameters", None, dict) or hf.get("rope_scaling", None, dict) or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
    factor = data["partial_rotary_factor"]
    main = {"rope_type": "default", "rope_theta": data["rope_theta"], "partial_rotary_factor": factor}
    compress = {**{k: v for k, v in rp.items() if k not in ("main", "compress")},
                "rope_theta": data["compress_rope_theta"], "partial_rotary_factor": factor}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


def _schedules(hf: HFConfig, data: dict[str, Any], depth: int) -> None:
    """``compress_rates``, ``layer_types``, ``mlp_layer_types`` with the legacy keys folded (config l. 254-280)."""
    rates = dict(hf.get("compress_rates", None, dict) or _DEFAULT_RATES)
    for kind, legacy in (("compressed_sparse_attention", "compress_rate_csa"),
                         ("heavily_compressed_attention", "compress_rate_hca")):
        rates[kind] = hf.raw(legacy, rates.get(kind))
    data["compress_rates"] = rates
    kinds = hf.get("layer_types", None, list)
    ratios = hf.get("compress_ratios", None, list)
    if kinds is None and ratios is not None:
        if any(r not in _RATIO_KINDS for r in ratios):
            raise hf.unsupported(f"compress_ratios={ratios!r} (each one of {sorted(_RATIO_KINDS)})")
        kinds = [_RATIO_KINDS[r] for r in ratios]
    if kinds is None:
        kinds = (["heavily_compressed_attention"] * min(depth, 2)
                 + [KINDS[1] if i % 2 else KINDS[2] for i in range(max(depth - 2, 0))])
    data["layer_types"] = list(kinds[:depth])
    mlps = hf.get("mlp_layer_types", None, list)
    if mlps is None:
        n_hash = hf.get("num_hash_layers", 3)
        mlps = ["hash_moe"] * min(depth, n_hash) + ["moe"] * max(0, depth - n_hash)
    data["mlp_layer_types"] = list(mlps[:depth])


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as ``DeepseekV4Config`` reads it (:data:`DEFAULTS` for absent keys, not for ``None`` ones; the legacy keys
    folded, the schedules and rope dicts filled in); refuses what has no equivalent."""
    data = {**DEFAULTS, **hf.data}  # absent keys only: a None swiglu_limit is refused, not defaulted
    hf = HFConfig(data, hf.source, hf.arch)
    depth, head_dim = hf.req("num_hidden_layers"), hf.req("head_dim")
    if not hf.has("partial_rotary_factor"):
        data["partial_rotary_factor"] = (hf.req("qk_rope_head_dim") / head_dim if hf.has("qk_rope_head_dim")
                                         else 64 / 512)
    _schedules(hf, data, depth)
    data["rope_parameters"] = _rope_dicts(hf, data)
    hf = HFConfig(data, hf.source, hf.arch)
    _check(hf, depth)
    return hf


def _rotary_dim(hf: HFConfig) -> int:
    return int(hf.req("head_dim") * hf.req("partial_rotary_factor", float))


def _check(hf: HFConfig, depth: int) -> None:
    """Refuse by name what transformers would not run or what has no equivalent here."""
    r = _rotary_dim(hf)
    heads = hf.req("num_attention_heads")
    rates = hf.req("compress_rates", dict)
    parts.unsupported_keys(hf, {
        "scoring_func": lambda v: v in ("sqrtsoftplus", "sigmoid"), "hidden_act": lambda v: v in ("silu", "swish"),
        "mlp_bias": lambda v: v is False, "num_key_value_heads": lambda v: v == 1,
        "swiglu_limit": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
        "partial_rotary_factor": lambda v: r >= 2 and r % 2 == 0 and r <= hf.req("head_dim"),
        "index_head_dim": lambda v: v >= r, "o_groups": lambda v: heads % v == 0,
        "compress_rates": lambda v: all(isinstance(rates.get(k), int) and not isinstance(rates.get(k), bool)
                                        and rates[k] >= 1 for k in KINDS[1:])})
    compress = hf.req("rope_parameters", dict)["compress"]
    rope_type = compress.get("rope_type", "default")
    if rope_type not in ("default", "linear", "yarn", "llama3"):
        raise hf.unsupported(f"rope_parameters['compress'] rope_type={rope_type!r} (supported: 'default', "
                             f"'linear', 'yarn', 'llama3')")
    parts.layer_types(hf, depth, KINDS)
    mlps = hf.req("mlp_layer_types", list)
    if len(mlps) != depth or any(t not in ("hash_moe", "moe") for t in mlps):
        raise hf.unsupported(f"mlp_layer_types={mlps!r} (one of 'hash_moe'/'moe' per layer)")


# --------------------------------------------------------------------------- build and convert
def _ropes(hf: HFConfig, device: Any) -> dict[str, InterleavedRope]:
    """The ``main`` and ``compress`` rotaries (shared by the layers: buffers only)."""
    rp, max_pos = hf.req("rope_parameters", dict), parts.max_positions(hf)
    out = {}
    for name in ("main", "compress"):
        p = {k: v for k, v in rp[name].items() if k != "partial_rotary_factor"}
        if p.get("original_max_position_embeddings") is None and hf.has("original_max_position_embeddings"):
            p["original_max_position_embeddings"] = hf.req("original_max_position_embeddings")
        out[name] = InterleavedRope(p, _rotary_dim(hf), max_positions=max_pos, device=device)
    return out


def _attention(hf: HFConfig, i: int, ropes: dict[str, InterleavedRope], kw: dict[str, Any]) -> V4Attention:
    C, D, eps = hf.req("hidden_size"), hf.req("head_dim"), hf.req("rms_norm_eps", float)
    shape = V4Shape(C, hf.req("num_attention_heads"), D, hf.req("q_lora_rank"), hf.req("o_groups"),
                    hf.req("o_lora_rank"), hf.req("sliding_window"), eps, hf.get("attention_dropout", 0.0, float))
    kind = hf.req("layer_types", list)[i]
    if kind == "sliding_attention":
        return V4Attention(shape, rope=ropes["main"], **kw)
    rate, csa = hf.req("compress_rates", dict)[kind], kind == "compressed_sparse_attention"
    compressor = Compressor(C, D, rate, overlap=csa, rope=ropes["compress"], norm_eps=eps, **kw)
    indexer = None
    if csa:
        Di = hf.req("index_head_dim")
        own = Compressor(C, Di, rate, overlap=True, rope=ropes["compress"], norm_eps=eps, **kw)
        indexer = LightningIndexer(C, hf.req("q_lora_rank"), heads=hf.req("index_n_heads"), head_dim=Di,
                                   topk=hf.req("index_topk"), compressor=own, **kw)
    return V4Attention(shape, rope=ropes["compress"], compressor=compressor, indexer=indexer, **kw)


def _layer(hf: HFConfig, i: int, ropes: dict[str, InterleavedRope], kw: dict[str, Any]) -> V4Block:
    C, eps = hf.req("hidden_size"), hf.req("rms_norm_eps", float)
    hashed = hf.req("mlp_layer_types", list)[i] == "hash_moe"
    ffn = V4MoE(C, hf.req("moe_intermediate_size"), hf.req("n_routed_experts"), hf.req("num_experts_per_tok"),
                scoring=hf.req("scoring_func", str), scaling=hf.req("routed_scaling_factor", float),
                limit=hf.req("swiglu_limit", float), vocab=hf.req("vocab_size") if hashed else None, **kw)
    hc = functools.partial(glm5_next.HyperConnection, C, hf.req("hc_mult"), iters=hf.req("hc_sinkhorn_iters"),
                           eps=hf.req("hc_eps", float), norm_eps=eps, device=kw["device"], dtype=torch.float32)
    norm = functools.partial(V4RMSNorm, C, eps, device=kw["device"])
    return V4Block(_attention(hf, i, ropes, kw), ffn, norm, hc)


def build_deepseek_v4(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                      dtype: Any = None) -> DeepseekV4LM:
    """The decoder of a ``DeepseekV4Config`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    V, C, depth, eps = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers"), hf.req(
        "rms_norm_eps", float)
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="none", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool), max_seq_len=parts.max_positions(hf))
    ropes = _ropes(hf, device)
    blocks = [_layer(hf, i, ropes, kw) for i in range(depth)]
    head = HyperHead(C, hf.req("hc_mult"), eps=hf.req("hc_eps", float), norm_eps=eps, device=device)
    return DeepseekV4LM(head=head, config=cfg, parts=DecoderParts(
        blocks=blocks, norm=V4RMSNorm(C, eps, device=device), head=head_for(C, V, head_size, **kw)), **kw)


def _put_attention(plan: Plan, o: str, h: str, kind: str) -> None:
    names = ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj")
    plan.put_pairs(o, h, [(n, n) for n in names], bias=False)
    plan.put(f"{o}sinks", f"{h}sinks")
    if kind == "sliding_attention":
        return
    pairs = [(n, n) for n in ("kv_proj", "gate_proj", "kv_norm")]
    plan.put_pairs(f"{o}compressor.", f"{h}compressor.", pairs, bias=False)
    plan.put(f"{o}compressor.position_bias", f"{h}compressor.position_bias")
    if kind == "compressed_sparse_attention":
        ours, theirs = f"{o}indexer.", f"{h}compressor.indexer."
        plan.put_pairs(f"{ours}compressor.", theirs, pairs, bias=False)
        plan.put(f"{ours}compressor.position_bias", f"{theirs}position_bias")
        plan.put_pairs(ours, theirs, [("q_b_proj", "q_b_proj"), ("weights_proj", "scorer.weights_proj")], bias=False)


def _put_layer(plan: Plan, hf: HFConfig, i: int) -> None:
    o, h = f"blocks.{i}.", f"layers.{i}."
    _put_attention(plan, f"{o}attn.", f"{h}self_attn.", hf.req("layer_types", list)[i])
    put_moe(plan, f"{o}ffn.", f"{h}mlp.", "stacked")
    if hf.req("mlp_layer_types", list)[i] == "hash_moe":
        plan.put(f"{o}ffn.tid2eid", f"{h}mlp.gate.tid2eid", lambda t: t.long())
    else:
        plan.put(f"{o}ffn.score_bias", f"{h}mlp.gate.e_score_correction_bias")
    plan.put_pairs(f"{o}ffn.shared_expert.", f"{h}mlp.shared_experts.",
                   [(n, n) for n in ("gate_proj", "up_proj", "down_proj")], bias=False)
    plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    glm5_next.put_hyper_connections(plan, o, h)


def convert_deepseek_v4(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> nn.Module:
    """Build a DeepSeek-V4 decoder and copy the weights (``DeepseekV4Model``: no head;
    ``DeepseekV4ForCausalLM``: ``lm_head``; saved-folder names too; ``mtp.*`` dropped)."""
    hf = canonical(hf)
    sd = {k: v for k, v in saved_names(sd, _SAVED).items() if not re.match(r"(model\.)?mtp\.", k)}
    model, plan, head_size = parts.start(hf, sd, build_deepseek_v4, device=device, dtype=dtype)
    for i in range(hf.req("num_hidden_layers")):
        _put_layer(plan, hf, i)
    for n in ("hc_fn", "hc_base", "hc_scale"):
        plan.put(f"hc_head.{n}", f"hc_head.{n}")
    parts.finish(plan, model, head_size)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "deepseek_v4": parts.Dispatch("DeepSeek-V4", convert_deepseek_v4, ("DeepseekV4ForCausalLM", "DeepseekV4Model")),
}
