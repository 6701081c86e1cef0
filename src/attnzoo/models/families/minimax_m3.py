"""MiniMax-M3 text (``minimax_m3_vl_text``) -> :class:`~attnzoo.DecoderLM`: ``MiniMaxM3VLForCausalLM`` and
``MiniMaxM3VLTextModel``, the language model of ``MiniMaxM3SparseForConditionalGeneration`` (its vision
tower and projector are out of scope). Line numbers: transformers 5.25's
``models/minimax_m3_vl/modeling_minimax_m3_vl.py``.

Every layer is pre-norm (``input_layernorm``, ``post_attention_layernorm``) around:

* Attention (``MiniMaxM3VLAttention``, 408-490; MiniMax-M2's): GQA without biases, per-head QK
  RMSNorms before RoPE (444-445), RoPE on the first ``head_dim * rope_parameters.partial_rotary_factor``
  channels of each head, split halves (296-317, 365-398). transformers does not read ``rotary_dim``
  (the checkpoints' key; its default 64 says nothing to a 128-wide head): neither does attnzoo. Every
  RMSNorm is Gemma's, ``(1 + w)`` applied in float32 (153-172): loaded as ``w + 1``
  (:func:`~attnzoo.models.families._common.plus_one`).
* On the ``minimax_m3_sparse`` layers of ``layer_types`` (the others ``full_attention``) a lightning
  indexer picks, per query, blocks of ``index_block_size`` keys (``MiniMaxM3VLIndexer``, 493-637;
  :class:`BlockIndexer`): ``index_n_heads`` normed, rotated query heads and one key head of
  ``index_head_dim`` score every key (``q . k``, float32), the keys' maximum scores each block, the
  ``index_local_blocks`` blocks ending at the query's are always kept, then the ``index_topk_blocks``
  best blocks; index head ``g`` selects for the query heads ``g H / Hi ..`` (``repeat_interleave``,
  626). The attention (:class:`~attnzoo.models.families.qwen4_exp.IndexedAttention`) sees the
  selected keys only, on top of causality and padding; its decode cache keeps the index keys.
* Feed-forward: on the ``sparse`` layers of ``mlp_layer_types`` (default: all) a MoE
  (``MiniMaxM3VLSparseMoeBlock``, 234-275): the top ``num_experts_per_tok`` of ``sigmoid(logits) +
  e_score_correction_bias`` weighted by the sigmoids renormalised to sum 1 (no epsilon), times
  ``routed_scaling_factor``, plus a shared expert of ``shared_intermediate_size``; on the ``dense``
  ones an MLP of ``dense_intermediate_size`` (175-191). Experts, shared expert and dense MLP use
  gpt-oss' clamped SwiGLU ``(clamp(u, +-limit) + 1) * g sigmoid(alpha g)``, ``g = min(gate, limit)``
  (``swiglu_alpha``, ``swiglu_limit``; :class:`OaiSwiGLU`); their fused ``gate_up_proj`` rows are
  ``[gate; up]``. transformers forces ``hidden_act`` to ``silu`` and never uses it: neither does attnzoo.

Padding: transformers anchors the indexer's blocks to key *slots* and its query blocks to
``position_ids`` (its own TODO at 524-534: "only right-padding is equivalent"), so a left-padded row
selects other blocks than the same row alone, and its forward (positions = slots) and ``generate``
(positions counted from the mask) disagree with each other. attnzoo anchors both to the positions
counted over the real tokens and leaves the padding out of the blocks: a padded row computes exactly
what the row alone computes, in transformers as here (unpadded, every path equals transformers'). The
full-attention layers are unaffected.

Config files: released checkpoints' ``sparse_attention_config`` (``sparse_attention_freq`` for the
layer kinds, ``sparse_num_index_heads`` ... for the indexer) and ``moe_layer_freq`` are read as
``MiniMaxM3VLTextConfig.__post_init__`` reads them (l. 116-148 of its configuration); saved folders'
``model.mtp.*`` weights are dropped, as transformers drops them (``_keys_to_ignore_on_load_unexpected``).

Refused by name: layer kinds other than these, ``index_head_dim`` smaller than the rotated width
(transformers then rotates the indexer with a truncated cos/sin table that is no rotation),
``index_n_heads`` not dividing ``num_attention_heads``, ``pretraining_tp != 1``, unknown rope types.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_moe
from attnzoo.models.families.bailing_hybrid import LimitedSwiGLU
from attnzoo.models.families.qwen4_exp import IndexedAttention, IndexerCache
from attnzoo.models.hf._state import HFConfig, Plan, load_gate_up_into
from attnzoo.nn.moe import Experts, MixtureOfExperts, Routing

__all__ = ["DEFAULTS", "DISPATCH", "BlockIndexer", "OaiSwiGLU", "build_minimax_m3", "canonical",
           "convert_minimax_m3"]

TYPES = ("full_attention", "minimax_m3_sparse")
#: ``MiniMaxM3VLTextConfig``'s defaults of the keys read here (configuration 77-113)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 3072, "num_hidden_layers": 60,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 524288,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_dropout": 0.0, "num_experts_per_tok": 4,
    "num_local_experts": 128, "dense_intermediate_size": 12288, "shared_intermediate_size": 3072,
    "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "index_n_heads": 4,
    "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16, "index_local_blocks": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5e6}}
#: the legacy ``sparse_attention_config`` keys -> the flat ones (configuration 124-133)
LEGACY_INDEX = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                "index_local_blocks": "sparse_local_block"}


# --------------------------------------------------------------------------- modules
class OaiSwiGLU(LimitedSwiGLU):
    """gpt-oss' clamped SwiGLU as a dense MLP (MiniMax-M3's dense layers and shared experts,
    ``MiniMaxM3VLDenseMLP``, 175-191): ``down((clamp(up(x), -limit, limit) + 1) * g sigmoid(alpha g))``
    with ``g = min(gate(x), limit)``, no biases.

    Weights: ``gate_proj``, ``up_proj [F, C]``, ``down_proj [C, F]``. Shapes: ``[..., C] -> [..., C]``."""

    def __init__(self, dim: int, hidden: int, limit: float, alpha: float, *, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, hidden, limit, device=device, dtype=dtype)
        self.alpha = float(alpha)

    def forward(self, x: Tensor) -> Tensor:
        g = self.gate_proj(x).clamp(max=self.limit)  # [..., F]
        u = self.up_proj(x).clamp(-self.limit, self.limit)
        return self.down_proj((u + 1) * (g * torch.sigmoid(self.alpha * g)))  # [..., C]

    def extra_repr(self) -> str:
        return f"limit={self.limit}, alpha={self.alpha}"


class BlockIndexer(nn.Module):
    """MiniMax-M3's lightning indexer (see the module docstring): ``forward(x [B, N, C], positions
    [B, N], real [B, L], cache) -> [B, H, N, L]`` bool, the keys each query head may attend (``L =
    past + N``; selected blocks, causal by position, real keys only).

    Args:
        dim: ``C``. heads, head_dim: ``index_n_heads`` ``Hi``, ``index_head_dim`` ``Di``.
        block, topk, local: ``index_block_size``, ``index_topk_blocks``, ``index_local_blocks``.
        query_heads: the attention's heads ``H`` (a multiple of ``Hi``).
        rope: the rotary embedding of ``Di``-wide heads (the attention's rotated width and frequencies).
        eps: the RMSNorms' epsilon.

    Weights: ``q_proj [Hi Di, C]``, ``k_proj [Di, C]``, ``q_norm``, ``k_norm [Di]`` (``1 + w`` loaded)."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, windows: tuple[int, int, int], query_heads: int,
                 rope: nn.Module, eps: float, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.heads, self.head_dim, self.query_heads = heads, head_dim, query_heads
        self.block, self.topk, self.local = windows
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False, **kw)
        self.k_proj = nn.Linear(dim, head_dim, bias=False, **kw)
        self.q_norm = parts.Float32ScaleRMSNorm(head_dim, eps, keep_float32=True, **kw)
        self.k_norm = parts.Float32ScaleRMSNorm(head_dim, eps, keep_float32=True, **kw)
        self.rope = rope

    def init_cache(self, batch_size: int, max_len: int, *, device: Any = None, dtype: Any = None) -> IndexerCache:
        p = self.k_proj.weight
        return IndexerCache(batch_size, max_len, self.head_dim, device=device or p.device, dtype=dtype or p.dtype)

    def forward(self, x: Tensor, positions: Tensor, real: Tensor, cache: IndexerCache | None) -> Tensor:
        B, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, N, self.heads, self.head_dim)).transpose(1, 2)  # [B, Hi, N, Di]
        k = self.k_norm(self.k_proj(x)).unsqueeze(1)  # [B, 1, N, Di]
        q, k = self.rope(q, positions), self.rope(k, positions)[:, 0]
        key_pos = positions
        if cache is not None:
            k, key_pos = cache.update(k, positions)
        with torch.no_grad():
            return self.select(q, k, key_pos, real)

    def select(self, q: Tensor, keys: Tensor, key_pos: Tensor, real: Tensor) -> Tensor:
        """The keys ``[B, H, N, L]`` bool of queries ``q [B, Hi, N, Di]`` (the last ``N`` of the ``L``
        tokens) over ``keys [B, L, Di]`` at ``key_pos [B, L]`` (``real [B, L]``: not padding)."""
        B, Hi, N, _ = q.shape
        L, bs = keys.shape[1], self.block
        q_pos = key_pos[:, L - N:]  # [B, N]
        visible = real[:, None] & (key_pos[:, None] <= q_pos[..., None])  # [B, N, L]
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # [B, Hi, N, L]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        nb = -(-L // bs)
        block_of = (key_pos // bs).clamp(max=nb - 1)[:, None, None].expand(B, Hi, N, L)  # [B, Hi, N, L]
        blocks = scores.new_full((B, Hi, N, nb), float("-inf")).scatter_reduce(-1, block_of, scores, "amax")
        if self.local > 0:
            local = (q_pos[..., None] // bs - torch.arange(self.local, device=q.device)).clamp(min=0)  # [B, N, l]
            blocks.scatter_(-1, local[:, None].expand(B, Hi, N, self.local), float("inf"))
        top, index = blocks.topk(min(self.topk, nb), dim=-1)  # [B, Hi, N, k]
        chosen = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, index, top > float("-inf"))
        allowed = chosen.gather(-1, block_of) & visible[:, None]  # [B, Hi, N, L]
        return allowed.repeat_interleave(self.query_heads // Hi, dim=1)  # [B, H, N, L]

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, block={self.block}, topk={self.topk}, "
                f"local={self.local}")


# --------------------------------------------------------------------------- the builder
def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as ``MiniMaxM3VLTextConfig`` reads it: :data:`DEFAULTS`, ``num_experts`` for
    ``num_local_experts``, the legacy ``sparse_attention_config`` / ``moe_layer_freq``, the default
    ``layer_types`` (all full) and ``mlp_layer_types`` (all sparse)."""
    data = dict(hf.data)
    if data.get("num_local_experts") is None and data.get("num_experts") is not None:
        data["num_local_experts"] = data["num_experts"]
    sparse = data.get("sparse_attention_config") or {}
    if not isinstance(sparse, dict):
        raise hf.unsupported(f"sparse_attention_config={sparse!r} (expected a dict)")
    data.update({flat: sparse[legacy] for flat, legacy in LEGACY_INDEX.items() if legacy in sparse})
    out = HFConfig(data, hf.source, hf.arch).with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    if not out.has("layer_types"):
        freq = sparse.get("sparse_attention_freq")
        out.data["layer_types"] = [TYPES[bool(f)] for f in freq] if freq is not None else [TYPES[0]] * depth
    if not out.has("mlp_layer_types"):
        freq = out.raw("moe_layer_freq")
        out.data["mlp_layer_types"] = ["sparse" if f else "dense" for f in freq] if freq else ["sparse"] * depth
    return out


def _rotary_width(hf: HFConfig, head_dim: int) -> int:
    """The rotated channels of a head: ``int(head_dim * partial_rotary_factor)`` (rotary 296-317), even."""
    factor = parts.rope_params(hf).get("partial_rotary_factor", 1.0)
    width = int(head_dim * factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else -1
    if not 0 < width <= head_dim or width % 2:
        raise hf.unsupported(f"partial_rotary_factor={factor!r} ({width} of {head_dim} channels; supported: an "
                             f"even count in (0, head_dim])")
    return width


def _rope(hf: HFConfig, width: int, head_dim: int) -> nn.Module:
    """The rotary embedding of ``head_dim``-wide heads rotating their first ``width`` channels."""
    params = {k: v for k, v in parts.rope_params(hf).items() if k != "partial_rotary_factor"}
    return parts.rotary(hf, params, head_dim, rotary_dim=width if width < head_dim else None)


def _indexed(make: Callable[[], nn.Module], hf: HFConfig, width: int, kw: dict[str, Any]) -> IndexedAttention:
    """A sparse layer's attention: ``make()`` under a :class:`BlockIndexer`'s selection."""
    H, Hi, Di = hf.req("num_attention_heads"), hf.req("index_n_heads"), hf.req("index_head_dim")
    if Di < width:
        raise hf.unsupported(f"index_head_dim={Di} below the {width} rotated channels (transformers rotates the "
                             f"indexer with a truncated cos/sin table)")
    if H % Hi:
        raise hf.unsupported(f"index_n_heads={Hi} (must divide num_attention_heads={H})")
    windows = tuple(hf.req(k) for k in ("index_block_size", "index_topk_blocks"))
    indexer = BlockIndexer(hf.req("hidden_size"), Hi, Di, windows=(*windows, hf.get("index_local_blocks", 1, int)),
                           query_heads=H, rope=_rope(hf, width, Di), eps=hf.req("rms_norm_eps", float), **kw)
    return IndexedAttention(make(), indexer)


def _ffn(hf: HFConfig, sparse: bool, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """A layer's feed-forward factory: the MoE (``sparse``) or the dense clamped-SwiGLU MLP."""
    C, limit, alpha = hf.req("hidden_size"), hf.req("swiglu_limit", float), hf.req("swiglu_alpha", float)
    if not sparse:
        return functools.partial(OaiSwiGLU, C, hf.req("dense_intermediate_size"), limit, alpha, **kw)
    routing = Routing("sigmoid_topk", norm_topk_prob=True, norm_eps=0.0,
                      scaling=hf.req("routed_scaling_factor", float))
    shared = functools.partial(OaiSwiGLU, C, hf.req("shared_intermediate_size"), limit, alpha, **kw)
    return lambda: MixtureOfExperts(C, hf.req("intermediate_size"), hf.req("num_local_experts"),
                                    hf.req("num_experts_per_tok"), routing=routing, shared_expert=shared(),
                                    experts=Experts("clamped_swiglu", swiglu_limit=limit, swiglu_alpha=alpha), **kw)


def build_minimax_m3(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """The decoder of a ``MiniMaxM3VLTextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    mlp = parts.layer_types(hf, depth, ("dense", "sparse"), key="mlp_layer_types")
    width = _rotary_width(hf, D)
    make = parts.attention_factory(hf, window=None, rope=_rope(hf, width, D), qk_norm="head", **kw)
    blocks = [parts.block(C, make if kind == TYPES[0] else functools.partial(_indexed, make, hf, width, kw),
                          _ffn(hf, m == "sparse", kw), parts.rms_norm(C, eps, **kw))
              for kind, m in zip(kinds, mlp, strict=True)]
    model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)
    return parts.float32_scale_norms(model, keep_float32=True)  # (1 + w) in float32, as transformers


# --------------------------------------------------------------------------- weights
def _put_layer(plan: Plan, hf: HFConfig, i: int) -> None:
    """Layer ``i``: attention (and indexer), dense MLP or MoE, norms (every RMSNorm ``w + 1``)."""
    o, h = f"blocks.{i}.", f"layers.{i}."
    sparse_attention = hf.req("layer_types", list)[i] == TYPES[1]
    attn = f"{o}attn.attn" if sparse_attention else f"{o}attn"
    parts.put_attention(plan, attn, f"{h}self_attn.", bias=False, qk_norm=True, norm_transform=parts.plus_one)
    if sparse_attention:
        ours, theirs = f"{o}attn.indexer.", f"{h}self_attn.indexer."
        plan.put_pairs(ours, theirs, [("q_proj", "q_proj"), ("k_proj", "k_proj")], bias=False)
        for n in ("q_norm", "k_norm"):
            plan.put(f"{ours}{n}.weight", f"{theirs}{n}.weight", parts.plus_one)
    ffn, mlp = f"{o}ffn.", f"{h}mlp."
    if hf.req("mlp_layer_types", list)[i] == "sparse":
        put_moe(plan, ffn, mlp, "stacked")
        plan.put(f"{ffn}score_bias", f"{mlp}gate.e_score_correction_bias")
        ffn, mlp = f"{ffn}shared_expert.", f"{mlp}shared_experts."
    load_gate_up_into(plan, ffn, f"{mlp}gate_up_proj.weight")
    plan.put(f"{ffn}down_proj.weight", f"{mlp}down_proj.weight")
    for ours, theirs in parts.PRE_NORMS:
        plan.put(f"{o}{ours}.weight", f"{h}{theirs}.weight", parts.plus_one)


def convert_minimax_m3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; ``mtp`` weights dropped)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_minimax_m3, device=device, dtype=dtype)
    for i in range(model.depth):
        _put_layer(plan, hf, i)
    return parts.finish(plan, model, head_size, norm_transform=parts.plus_one, ignore=[r"(model\.)?mtp\..*"])


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"minimax_m3_vl_text": parts.Dispatch("MiniMax-M3", convert_minimax_m3,
                                                 ("MiniMaxM3VLForCausalLM", "MiniMaxM3VLTextModel"))}
