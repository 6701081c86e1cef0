"""Inkling2 (``inkling2_text``) -> :class:`Inkling2LM` (a :class:`~attnzoo.DecoderLM`):
``Inkling2ForCausalLM`` and ``Inkling2TextModel`` (the text model of Thinking Machines' Inkling 2);
Inkling2-loop (``inkling2_loop_text``) -> :class:`Inkling2LoopLM`: ``Inkling2LoopForCausalLM`` and
``Inkling2LoopTextModel`` (the same layers, a span of them looped; last section).

Line numbers below are transformers 5.25's ``models/inkling2/modeling_inkling2.py`` (``modeling``)
and ``configuration_inkling2.py`` (``configuration``). The layers do not sit on one residual stream:
each layer reads its input through a **block attention residual** (``Inkling2BlockAttentionResidual``,
modeling 877-902): the layers are grouped into blocks of ``n_layers_per_attn_res_block``; the inputs
of the block-starting layers (the embedding first) are kept as ``block_states [B, N, S, C]``, and a
layer attends, per token, from one learned query (three for a full layer: the q, k and v inputs)
over the ``S`` block states plus the running partial sum of the current block, all normalised by an
unweighted RMSNorm (epsilon 1e-6, keys and values alike), score scale ``C ** -0.5``
(:class:`BlockAttentionResidual`). A layer ``i`` (``Inkling2SlidingDecoderLayer`` /
``Inkling2FullDecoderLayer``, modeling 905-1024) with input ``h`` (the partial sum)::

    src        = h at layer 0, else attention_input(blocks, h)   # 1 query, or 3 (q, k, v inputs)
    a          = post_attention_convolution(self_attn(input norm(s) of src))
    if i % n_layers_per_attn_res_block == 0:  blocks += [h]; r = a     # a new block starts
    else:                                     r = h + a
    out        = r + post_mlp_convolution(moe(post_attention_layernorm(mlp_input(blocks, r))))

and the model ends with ``norm(final_input(blocks, h))`` (modeling 1461-1482), the logits
softcapped by ``final_logit_softcapping`` (``c * tanh(l / c)``, modeling 1559-1560) over
``unpadded_vocab_size`` rows (modeling 1502). :class:`Inkling2LM` runs the blocks with their states.

* The embedding is RMS-normalised (``Inkling2NormedEmbedding``, modeling 1360-1366):
  :class:`~attnzoo.models.families.minimax.NormedEmbedding`.
* The short convolutions (``Inkling2ShortConvolution``, modeling 341-394; :class:`ShortConv`): a
  causal depthwise convolution of ``conv_kernel_size`` taps in float32 over the inputs with padded
  tokens zeroed, plus the unmasked input, divided by ``sqrt(K + 1)``. They follow the attention and
  the MoE of every layer and the k / v projections of the sliding layers.
* The full layers' k / v convolutions are dynamic (``Inkling2DynamicShortConvolution``, modeling
  397-456; :class:`DynamicShortConv`): the taps are ``static_weight`` (per channel) plus per token
  and kv head ``weight_proj(k or v input)``; tap ``j`` weights the token ``j`` steps back;
  ``(conv + x) / sqrt(2 K + 1)``.
* Queries (``Inkling2QueryProjection``, 459-476): ``linear``, a learned per-head ``scale``, an L2
  clip to ``qk_l2_clip_threshold`` (``x * min(1, t / (|x| + 1e-6))``, 134-145), and in full layers
  the log scale ``1 + log_scaling_alpha * log(max((p + 1) / log_scaling_n_floor, 1))`` of the
  position ``p`` (163-178). Keys (479-529): ``linear``, convolution, L2 clip (no scale); values:
  ``linear``, convolution, an unweighted RMSNorm (``rms_norm_eps``).
* The relative position bias (``Inkling2RelativePositionBias``, 197-228;
  :class:`RelativePositionBias`): per token and head ``r = clip(scale * linear(x))`` (L2 clip to
  ``rel_l2_clip_threshold``, log-scaled in the full layers), the bias of the key ``d`` tokens back
  is ``(r @ proj)[d]`` for ``0 <= d < extent`` (``sliding_window_size`` in sliding layers,
  ``rel_extent`` in full ones), 0 beyond. ``d`` counts slots, as transformers'
  ``get_relative_distance`` (1369-1389) does, not positions: padding slots count.
* The attention (``Inkling2SlidingAttention`` / ``Inkling2FullAttention``, 593-774;
  :class:`Inkling2Attention`): GQA, scale ``head_dim ** -0.5``, the bias added to the scores,
  causal (the sliding layers see ``sliding_window_size`` keys: a window of ``size - 1``), and a
  per-query attention sink ``sink_proj(x)`` (one logit per head and token with a zero value,
  eager_attention_forward 559-590): :func:`attnzoo.attention` with the bias as a float mask and
  its log-sum-exp, the output scaled by ``exp(lse - logaddexp(lse, sink))``. The output is gated,
  ``linear(attn * sigmoid(gate_proj(x)))`` (532-544). The sliding layers have their own head
  counts and width (``swa_*``).
* The MoE (``Inkling2SparseMoeBlock``, 800-874; :class:`SoftcappedMoE`): sigmoid routing in
  float32, picked by ``score + e_score_correction_bias``, the picked scores renormalised
  (``+ 1e-20``) and times ``route_scale``; experts ``down(tanh(g / cg) cg * sigmoid(g) *
  tanh(u / cu) cu)`` with ``cg = mlp_gate_softcap``, ``cu = mlp_up_softcap`` (786-797).

Positions: the log scale reads the token positions (from ``attention_mask`` when given: the first
real token is 0, as transformers' ``generate`` computes them); the relative bias and the window
count slots. transformers' plain forward with a padded ``attention_mask`` and no ``position_ids``
numbers the slots instead (1441-1444): the two agree wherever the log scale is 1 (positions below
``log_scaling_n_floor``: 128000 by default, 8192 for Inkling2-loop) or without left padding.

Caches: :class:`Inkling2Cache` (keys, values and the inputs of the four convolutions, by position).
Packed sequences (``cu_seqlens``) run each sequence alone. Weights load from transformers' module
names and from the checkpoints' own names (``model.llm.*``, interleaved ``w13_weight`` experts,
``attn_res.*`` queries, an unembedding padded to ``vocab_size``), which ``save_pretrained`` writes
(transformers' ``conversion_mapping``, ``"inkling2_text"``). The model's ``vocab_size`` is
``unpadded_vocab_size`` (the logits' width; token ids at or past it are refused); the embedding
keeps its ``vocab_size`` rows. Half precision: the convolutions, the block-residual and message
queries, the message gates' up-projections and the MoE router stay float32 through half casts
and in a half-precision build (transformers' ``_keep_in_fp32_modules_strict``, 1325-1334). The
embedding's ``padding_idx`` (no gradient into ``pad_token_id``'s row) is not kept.

**Inkling2-loop** (``models/inkling2_loop/modeling_inkling2_loop.py``, ``loop_modeling``; its
configuration 98-168): layers ``loop_layer_index_start .. loop_layer_index_end - 1`` run
``loop_num_passes`` times (``Inkling2LoopTextModel.forward``, loop_modeling 1352-1490). The first
pass is plain; each later pass restarts from the hidden and block states before the loop and feeds
loop layer ``j`` the messages ``[B, N, 4, C]`` of ``message_input`` (4 learned queries per loop layer,
:func:`block_attention` over the previous pass's block states past the first one it appended and
its last hidden state; ``Inkling2LoopMessageAttentionResidual``, 147-175). A loop layer
(``Inkling2Loop{Sliding,Full}LoopDecoderLayer``, 957-1041 / 1109-1193) gates its q, k and v inputs
(before the input norms; a sliding layer's one source feeds three gates) and its MoE input by
:class:`MessageGate` (``(1 - tanh(W_f d)) x + tanh(W_m d) m`` with ``d = W_down [rms(x); rms(m)]``,
81-100). Every later pass has its own caches of the loop layers (1398-1401, 1449):
:meth:`Inkling2LoopLM.init_cache` bundles ``L + (passes - 1) * loop layers`` of them. An original
``config.json``'s ``loop_config`` (``core_start``, ``core_end``, ``num_passes``, ``gate_rank``) sets
the loop keys (configuration 140-144); the checkpoint names ``controllers.{attn,k,v,mlp}.*`` and
``middle_cycle_cross_pass_{,kv_}queries`` load too.

Refused (by name): ``scoring_func`` other than ``"sigmoid"``, a layer type other than
``"hybrid"`` / ``"hybrid_sliding"``, quantized (MXFP8 / NVFP4) expert tensors, head counts that do
not divide; for Inkling2-loop a loop transformers' ``validate_architecture`` refuses
(``loop_num_passes < 1``, a start of 0 or either end not a multiple of
``n_layers_per_attn_res_block``) or one past the layers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.functional import attention
from attnzoo.models._common import (
    LayerCaches,
)
from attnzoo.models.config import DecoderConfig
from attnzoo.models.families._moe import put_moe
from attnzoo.models.families.minimax import NormedEmbedding
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.cache import _LengthCache
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.recurrent import wide

__all__ = ["DEFAULTS", "DISPATCH", "LOOP_DEFAULTS", "BlockAttentionResidual", "DynamicShortConv", "HeadShape",
           "Inkling2Attention", "Inkling2Cache", "Inkling2LM", "Inkling2Layer", "Inkling2LoopLM", "MessageGate",
           "MessageInput", "RelativePositionBias", "Settings", "ShortConv", "SoftcappedMoE", "block_attention",
           "build_inkling2", "build_inkling2_loop", "canonical", "canonical_loop", "convert_inkling2",
           "convert_inkling2_loop", "module_names"]

#: ``Inkling2TextConfig``'s defaults of the keys read here (configuration 83-119), for a
#: ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 201024, "unpadded_vocab_size": 200058, "hidden_size": 4608, "num_hidden_layers": 48,
    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "swa_num_attention_heads": 48,
    "swa_num_key_value_heads": 8, "swa_head_dim": 128, "sliding_window_size": 1024, "d_rel": 16,
    "rel_extent": 1024, "log_scaling_n_floor": 128000, "log_scaling_alpha": 0.1, "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6, "conv_kernel_size": 4, "moe_intermediate_size": 2304, "n_routed_experts": 384,
    "num_experts_per_tok": 8, "route_scale": 8.0, "attention_dropout": 0.0, "qk_l2_clip_threshold": 22.627416997969522,
    "rel_l2_clip_threshold": 8.0, "n_layers_per_attn_res_block": 6, "mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0,
    "final_logit_softcapping": 30.0, "scoring_func": "sigmoid",
}

#: ``Inkling2LoopTextConfig``'s defaults where they differ from :data:`DEFAULTS`, and its loop keys
#: (configuration_inkling2_loop 98-137)
LOOP_DEFAULTS: dict[str, Any] = {
    **DEFAULTS, "hidden_size": 2304, "num_hidden_layers": 24, "num_attention_heads": 24, "swa_num_attention_heads": 24,
    "log_scaling_n_floor": 8192, "moe_intermediate_size": 1152, "n_routed_experts": 128, "loop_layer_index_start": 6,
    "loop_layer_index_end": 18, "loop_num_passes": 3, "loop_gate_rank": 64,
}

#: an original config's ``loop_config`` keys -> the config keys they set (configuration_inkling2_loop 140-144)
_LOOP_CONFIG = {"core_start": "loop_layer_index_start", "core_end": "loop_layer_index_end",
                "num_passes": "loop_num_passes", "gate_rank": "loop_gate_rank"}

#: the layer kinds of ``layer_types``
SLIDING, FULL = "hybrid_sliding", "hybrid"

#: the block attention residuals' unweighted RMSNorm epsilon (``Inkling2UnweightedRMSNorm()``, modeling 882)
BLOCK_NORM_EPS = 1e-6

#: the checkpoints' names -> transformers' module names (conversion_mapping ``"inkling2_loop_text"``'s
#: message-gate renames, then ``"inkling2_text"``'s), in order
_SAVED: tuple[tuple[str, str], ...] = (
    (r"controllers\.attn\.", "q_message_gate."), (r"controllers\.(k|v|mlp)\.", r"\1_message_gate."),
    (r"_message_gate\.down_weight$", "_message_gate.down_proj.weight"),
    (r"_message_gate\.gain_weight$", "_message_gate.message_gate_proj.weight"),
    (r"_message_gate\.forget_weight$", "_message_gate.forget_gate_proj.weight"),
    (r"^model\.llm\.unembed\.", "lm_head."), (r"^model\.llm\.", "model."), (r"(^|\.)embed\.weight$", r"\1embed_tokens.weight"),
    (r"(^|\.)embed_norm\.", r"\1embed_tokens.embed_norm."), (r"mlp\.experts\.w2_weight$", "mlp.experts.down_proj"),
    (r"mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"), (r"\.attn\.", ".self_attn."),
    (r"self_attn\.wq_du", "self_attn.q_proj.linear"), (r"self_attn\.wk_dv", "self_attn.k_proj.linear"),
    (r"self_attn\.wv_dv", "self_attn.v_proj.linear"), (r"self_attn\.k_sconv\.", "self_attn.k_proj.sconv."),
    (r"self_attn\.v_sconv\.", "self_attn.v_proj.sconv."),
    (r"self_attn\.rel_logits_proj\.", "self_attn.relative_position_bias."),
    (r"self_attn\.wr_du", "self_attn.relative_position_bias.linear"), (r"self_attn\.q_l2_clip\.", "self_attn.q_proj.norm."),
    (r"self_attn\.rel_l2_clip\.", "self_attn.relative_position_bias.norm."),
    (r"self_attn\.wo_ud", "self_attn.o_proj.linear"), (r"self_attn\.gate_attn", "self_attn.o_proj.gate_proj"),
    (r"self_attn\.attn_sink_proj", "self_attn.sink_proj"), (r"attn_sconv\.", "post_attention_convolution."),
    (r"mlp_sconv\.", "post_mlp_convolution."), (r"(convolution|sconv)\.weight$", r"\1.conv1d.weight"),
    (r"(convolution|sconv)\.static_w$", r"\1.static_weight"), (r"(convolution|sconv)\.weight_proj$", r"\1.weight_proj.weight"),
    (r"mlp_norm", "post_attention_layernorm"), (r"attn_norm", "input_layernorm"),
    (r"(q|k|v)_input_norm", r"\1_input_layernorm"), (r"attn_res\.mlp_queries\.(\d+)$", r"layers.\1.mlp_input.query"),
    (r"attn_res\.output_query$", "final_input.query"),
)


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    """The config-wide numbers of the Inkling2 layers (one object instead of a dozen arguments).

    Args:
        dim: model width ``C``.
        d_rel: the relative states' per-head width.
        conv_size: the short convolutions' taps ``K``.
        qk_clip: the queries' and keys' L2 clip (``qk_l2_clip_threshold``).
        rel_clip: the relative states' L2 clip (``rel_l2_clip_threshold``).
        norm_eps: the RMSNorms' epsilon (the values' unweighted one too).
        log_alpha, log_floor: the full layers' log scale (``log_scaling_alpha``, ``log_scaling_n_floor``).
        block_size: ``n_layers_per_attn_res_block``.
        dropout: the attention-weight dropout (training only).
    """

    dim: int
    d_rel: int
    conv_size: int
    qk_clip: float
    rel_clip: float
    norm_eps: float
    log_alpha: float
    log_floor: int
    block_size: int
    dropout: float = 0.0

    def log_scale(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x [B, N, H, D]`` times ``1 + alpha * log(max((p + 1) / floor, 1))`` of each token's
        position ``p`` (``positions [B or 1, N]``), in float32 (modeling 163-178)."""
        xw = wide(x)
        tau = 1.0 + self.log_alpha * torch.log(((positions + 1).to(xw.dtype) / self.log_floor).clamp(min=1.0))
        return (xw * tau[..., None, None]).to(x.dtype)


@dataclass(frozen=True)
class HeadShape:
    """A layer kind's heads: ``num_heads`` queries, ``num_kv_heads`` keys/values of ``head_dim``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def unweighted_rms(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, in float32; ``x``'s dtype back."""
    xf = wide(x)
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def l2_clip(x: Tensor, threshold: float) -> Tensor:
    """Each vector of the last dim scaled down to L2 norm ``threshold`` when longer (``x * min(1,
    t / (|x| + 1e-6))``, modeling 134-145), in float32."""
    xf = wide(x)
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    return (xf * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)


def _restore_float32(module: nn.Module, before: Mapping[str, Tensor]) -> None:
    """Put ``module``'s parameters ``before`` (name -> value before an ``_apply``) back in float32
    where the cast made them 16-bit."""
    for name, old in before.items():
        now = getattr(module, name)
        if now.dtype in (torch.float16, torch.bfloat16) and old.dtype in (torch.float32, torch.float64):
            setattr(module, name, nn.Parameter(old.to(device=now.device, dtype=torch.float32),
                                               requires_grad=now.requires_grad))


def _apply_keeping_float32(module: nn.Module, names: tuple[str, ...], fn: Any, recurse: bool) -> None:
    """``nn.Module._apply`` on ``module``, then its parameters ``names`` put back in float32 when
    the cast made them 16-bit (transformers keeps Inkling2's convolutions, block-residual queries,
    message gates and router in float32 whatever the model's dtype: ``_keep_in_fp32_modules_strict``,
    modeling 1325-1334)."""
    before = {name: getattr(module, name).detach().clone() for name in names}
    nn.Module._apply(module, fn, recurse)
    _restore_float32(module, before)


class Float32Params(nn.Module):
    """A module whose parameters named in ``FLOAT32`` stay float32 through half-precision casts
    (:func:`_apply_keeping_float32`)."""

    FLOAT32: tuple[str, ...] = ()

    def _apply(self, fn: Any, recurse: bool = True) -> Float32Params:
        _apply_keeping_float32(self, self.FLOAT32, fn, recurse)
        return self


# --------------------------------------------------------------------------- cache
class Inkling2Cache(_LengthCache):
    """One Inkling2 layer's decode cache, written in place by position: ``k [B, Hkv, max_len, D]``,
    ``v`` alike, and the (padding-zeroed) inputs of its four short convolutions, ``conv[name]
    [B, max_len, width]``. A layer call writes at ``length ..`` and advances ``length`` once at its
    end (:meth:`advance`); protocol as :class:`~attnzoo.nn.cache.KVCache`."""

    _batch_tensors = ("k", "v", "conv")

    def __init__(self, batch_size: int, max_len: int, shape: HeadShape, conv_widths: Mapping[str, int], *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self._batch_size, self.max_len, self.length = batch_size, max_len, 0
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.k = torch.zeros(batch_size, shape.num_kv_heads, max_len, shape.head_dim, **kw)
        self.v = torch.zeros_like(self.k)
        self.conv = {name: torch.zeros(batch_size, max_len, w, **kw) for name, w in conv_widths.items()}

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + sum(t.nbytes for t in self.conv.values())

    def _room(self, n: int) -> int:
        if self.length + n > self.max_len:
            raise ValueError(f"Inkling2Cache overflow: {self.length} tokens cached + {n} new > max_len={self.max_len}")
        return self.length

    def context(self, name: str, x: Tensor, taps: int) -> Tensor:
        """Write a convolution's new inputs ``x [B, n, W]``; return the ``taps - 1`` before them
        (zeros before the first token) and ``x``: ``[B, taps - 1 + n, W]``."""
        start = self._room(x.shape[1])
        buf = self.conv[name]
        buf[:, start:start + x.shape[1]] = x.to(buf.dtype)
        lo = max(0, start - taps + 1)
        prev = buf[:, lo:start].to(x.dtype)
        return torch.cat([prev.new_zeros(x.shape[0], taps - 1 - (start - lo), x.shape[2]), prev, x], dim=1)

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v [B, Hkv, n, D]``; return every key and value so far (``[B, Hkv, length + n, D]``)."""
        start = self._room(k.shape[2])
        end = start + k.shape[2]
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        return self.k[:, :, :end], self.v[:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n


def _conv_context(x: Tensor, taps: int, cache: Inkling2Cache | None, name: str) -> Tensor:
    """``[B, taps - 1 + n, W]``: the cached inputs before ``x`` (zeros without a cache) and ``x``."""
    if cache is None:
        return F.pad(x, (0, 0, taps - 1, 0))
    return cache.context(name, x, taps)


# --------------------------------------------------------------------------- convolutions
class ShortConv(Float32Params):
    """Inkling2's short convolution (modeling 341-394): ``(conv(x * real) + x) / sqrt(K + 1)``, a
    causal depthwise convolution of ``K`` taps in float32 (``weight[:, K - 1]`` weights the current
    token), padded tokens zeroed in its input only.

    Weights: ``weight [W, K]``. Shapes: ``x [B, N, W]``, ``real [B, N]`` bool -> ``[B, N, W]``.
    """

    FLOAT32 = ("weight",)

    def __init__(self, width: int, taps: int, name: str, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width, taps, device=device, dtype=torch.float32))
        self.taps, self.name = taps, name

    def forward(self, x: Tensor, real: Tensor | None, cache: Inkling2Cache | None) -> Tensor:
        xf = wide(x)
        masked = xf if real is None else xf * real[..., None]
        ctx = _conv_context(masked, self.taps, cache, self.name).transpose(1, 2)  # [B, W, K - 1 + N]
        y = F.conv1d(ctx, self.weight.to(xf.dtype).unsqueeze(1), groups=ctx.shape[1]).transpose(1, 2)  # [B, N, W]
        return ((y + xf) / math.sqrt(self.taps + 1)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, taps={self.taps}"


class DynamicShortConv(nn.Module):
    """Inkling2's dynamic short convolution of the full layers' keys / values (modeling 397-456):
    tap ``j`` (the token ``j`` steps back) of channel ``c`` in kv head ``h`` weighs
    ``static_weight[j, c] + weight_proj(u)[h, j]`` (``u`` the projection's input, per token);
    ``(conv(x * real) + x) / sqrt(2 K + 1)`` in float32.

    Weights: ``static_weight [K, W]``, ``weight_proj [Hkv K, C]``. Shapes: ``x [B, N, W]``,
    ``u [B, N, C]`` -> ``[B, N, W]``.
    """

    def __init__(self, width: int, dim: int, num_heads: int, taps: int, name: str, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.static_weight = nn.Parameter(torch.zeros(taps, width, device=device, dtype=dtype))
        self.weight_proj = nn.Linear(dim, num_heads * taps, bias=False, device=device, dtype=dtype)
        self.num_heads, self.taps, self.name = num_heads, taps, name

    def forward(self, x: Tensor, u: Tensor, real: Tensor | None, cache: Inkling2Cache | None) -> Tensor:
        B, N, W = x.shape
        H, K = self.num_heads, self.taps
        xf = wide(x)
        taps = (self.static_weight.to(xf.dtype).T.reshape(H, W // H, K)
                + wide(self.weight_proj(u)).to(xf.dtype).view(B, N, H, 1, K))
        masked = xf if real is None else xf * real[..., None]
        ctx = _conv_context(masked, K, cache, self.name)  # [B, K - 1 + N, W]
        windows = ctx.unfold(1, K, 1).flip(-1).reshape(B, N, H, W // H, K)  # [..., j]: j tokens back
        y = (windows * taps).sum(-1).reshape(B, N, W)
        return ((y + xf) / math.sqrt(2 * K + 1)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.static_weight.shape[1]}, heads={self.num_heads}, taps={self.taps}"


# --------------------------------------------------------------------------- attention
class RelativePositionBias(nn.Module):
    """The hidden-state conditioned relative bias (modeling 197-228): ``r = clip(scale * linear(x))``
    per head (log-scaled with ``log_scaling``), bias ``(r @ proj)[d]`` for a key ``d`` slots back,
    ``0 <= d < extent``, else 0.

    Weights: ``linear [H d_rel, C]``, ``scale [H, d_rel]``, ``proj [d_rel, extent]``. Shapes:
    ``x [B, N, C]`` -> ``[B, H, N, M]`` (``M`` keys, the first at slot 0, queries at ``past ..``).
    """

    def __init__(self, s: Settings, num_heads: int, extent: int, *, log_scaling: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.linear = nn.Linear(s.dim, num_heads * s.d_rel, bias=False, **kw)
        self.scale = nn.Parameter(torch.ones(num_heads, s.d_rel, **kw))
        self.proj = nn.Parameter(torch.zeros(s.d_rel, extent, **kw))
        self.settings, self.num_heads, self.extent, self.log_scaling = s, num_heads, extent, log_scaling

    def forward(self, x: Tensor, positions: Tensor, past: int, keys: int) -> Tensor:
        B, N, _ = x.shape
        r = wide(self.linear(x).view(B, N, self.num_heads, -1))
        r = l2_clip(r * self.scale.to(r.dtype), self.settings.rel_clip)
        r = r.to(x.dtype)
        if self.log_scaling:
            r = self.settings.log_scale(r, positions)
        table = (r @ self.proj).transpose(1, 2)  # [B, H, N, extent]
        dist = (torch.arange(past, past + N, device=x.device)[:, None]
                - torch.arange(keys, device=x.device)[None, :])  # [N, M] slots back
        index = dist.clamp(0, self.extent - 1).expand(B, self.num_heads, N, keys)
        bias = table.gather(-1, index)
        return bias.masked_fill((dist < 0) | (dist >= self.extent), 0.0)  # [B, H, N, M]

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, extent={self.extent}, log_scaling={self.log_scaling}"


class Inkling2Attention(nn.Module):
    """One Inkling2 attention (modeling 593-774; the module docstring): a sliding layer
    (``window``: ``sliding_window_size``; static k/v convolutions) or a full one (``window=None``:
    dynamic k/v convolutions, log-scaled queries and relative states).

    Weights: ``q_proj [H D, C]``, ``q_scale [H, D]``, ``k_proj`` / ``v_proj [Hkv D, C]``,
    ``k_conv`` / ``v_conv`` (:class:`ShortConv` or :class:`DynamicShortConv`), ``rel``
    (:class:`RelativePositionBias`), ``sink_proj [H, C]``, ``gate_proj [H D, C]``, ``out_proj [C, H D]``.
    Shapes: ``q_in, k_in, v_in [B, N, C]`` (the same tensor in a sliding layer) -> ``[B, N, C]``.
    """

    def __init__(self, s: Settings, shape: HeadShape, *, window: int | None, extent: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        C, H, Hkv, D = s.dim, shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.settings, self.shape, self.window, self.full = s, shape, window, window is None
        self.q_proj = nn.Linear(C, H * D, bias=False, **kw)
        self.q_scale = nn.Parameter(torch.ones(H, D, **kw))
        self.k_proj = nn.Linear(C, Hkv * D, bias=False, **kw)
        self.v_proj = nn.Linear(C, Hkv * D, bias=False, **kw)
        if self.full:
            self.k_conv: nn.Module = DynamicShortConv(Hkv * D, C, Hkv, s.conv_size, "k", **kw)
            self.v_conv: nn.Module = DynamicShortConv(Hkv * D, C, Hkv, s.conv_size, "v", **kw)
        else:
            self.k_conv = ShortConv(Hkv * D, s.conv_size, "k", device=device)
            self.v_conv = ShortConv(Hkv * D, s.conv_size, "v", device=device)
        self.rel = RelativePositionBias(s, H, extent, log_scaling=self.full, **kw)
        self.sink_proj = nn.Linear(C, H, bias=False, **kw)
        self.gate_proj = nn.Linear(C, H * D, bias=False, **kw)
        self.out_proj = nn.Linear(H * D, C, bias=False, **kw)

    def _conv(self, conv: nn.Module, x: Tensor, u: Tensor, real: Tensor | None, cache: Inkling2Cache | None) -> Tensor:
        return conv(x, u, real, cache) if self.full else conv(x, real, cache)

    def forward(self, q_in: Tensor, k_in: Tensor, v_in: Tensor, *, positions: Tensor,
                key_padding: Tensor | None, cache: Inkling2Cache | None) -> Tensor:
        B, N, _ = q_in.shape
        D, s = self.shape.head_dim, self.settings
        real = None if key_padding is None else key_padding[:, -N:]
        q = wide(self.q_proj(q_in).view(B, N, -1, D))
        q = l2_clip(q * self.q_scale.to(q.dtype), s.qk_clip).to(q_in.dtype)
        if self.full:
            q = s.log_scale(q, positions)
        k = self._conv(self.k_conv, self.k_proj(k_in), k_in, real, cache)
        v = self._conv(self.v_conv, self.v_proj(v_in), v_in, real, cache)
        k = l2_clip(k.view(B, N, -1, D), s.qk_clip).transpose(1, 2)  # [B, Hkv, N, D]
        v = unweighted_rms(v.view(B, N, -1, D), s.norm_eps).transpose(1, 2)
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.keys_values(k, v)
        mask = self.rel(q_in, positions, past, k.shape[2])  # [B, H, N, M] float bias
        if key_padding is not None:
            mask = mask.masked_fill(~key_padding[:, None, None, :], float("-inf"))
        out, lse = attention(q.transpose(1, 2), k, v, mask=mask.to(q.dtype), causal=True,
                             window=None if self.window is None else (self.window - 1, 0), q_offset=past,
                             scale=D ** -0.5, dropout_p=s.dropout if self.training else 0.0, return_lse=True)
        sinks = wide(self.sink_proj(q_in)).transpose(1, 2)  # [B, H, N]
        kept = torch.exp(lse - torch.logaddexp(lse, sinks)).unsqueeze(-1)  # the sink's share removed
        out = (wide(out) * kept).transpose(1, 2).reshape(B, N, -1)  # [B, N, H D]
        gate = torch.sigmoid(wide(self.gate_proj(q_in)))
        return self.out_proj((out * gate).to(q_in.dtype))

    def extra_repr(self) -> str:
        sh = self.shape
        return (f"heads={sh.num_heads}, kv_heads={sh.num_kv_heads}, head_dim={sh.head_dim}, "
                f"{'full' if self.full else f'window={self.window}'}")


# --------------------------------------------------------------------------- layers
class SoftcappedMoE(MixtureOfExperts):
    """A :class:`~attnzoo.nn.moe.MixtureOfExperts` whose experts are Inkling2's softcapped SwiGLU
    (modeling 786-797): ``down(cap(g, gate_cap) * sigmoid(g) * cap(u, up_cap))``, ``cap(x, c) =
    c tanh(x / c)``, in float32. The arguments, weights and routing as the base class's."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, routing: Routing,
                 caps: tuple[float, float], device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=routing, device=device, dtype=dtype)
        self.gate_cap, self.up_cap = (float(c) for c in caps)
        self.router.float()  # float32 whatever the model's dtype, as transformers' ``mlp.gate.weight``

    def _apply(self, fn: Any, recurse: bool = True) -> SoftcappedMoE:
        """Half casts leave the router weight (and ``score_bias``) in float32."""
        before = {"weight": self.router.weight.detach().clone()}
        super()._apply(fn, recurse)
        _restore_float32(self.router, before)
        return self

    def expert(self, e: int, x: Tensor) -> Tensor:
        g = wide(F.linear(x, self.gate_proj[e]))  # [T, F]
        u = wide(F.linear(x, self.up_proj[e]))
        h = torch.tanh(g / self.gate_cap) * self.gate_cap * torch.sigmoid(g) * torch.tanh(u / self.up_cap) * self.up_cap
        return F.linear(h.to(x.dtype), self.down_proj[e])  # [T, C]


def block_attention(query: Tensor, blocks: Tensor, partial: Tensor) -> Tensor:
    """``query [Q, C]`` attending, per token, over ``blocks [B, N, S, C]`` and ``partial [B, N, C]``,
    all normalised by an unweighted RMSNorm (keys and values), scale ``C ** -0.5`` (modeling
    877-902), in ``query``'s dtype (float32): ``[B, N, Q, C]``."""
    states = unweighted_rms(torch.cat([blocks, partial.unsqueeze(-2)], dim=-2).to(query.dtype), BLOCK_NORM_EPS)
    scores = torch.einsum("qc,bnsc->bnqs", query, states) * states.shape[-1] ** -0.5
    return torch.einsum("bnqs,bnsc->bnqc", scores.softmax(-1), states)


class BlockAttentionResidual(Float32Params):
    """Inkling2's block attention residual (modeling 877-902): per token, ``Q`` learned queries
    attend over the block states and the partial sum, all normalised by an unweighted RMSNorm (the
    keys and the values), score scale ``C ** -0.5``; float32.

    Weights: ``query [Q, C]``. Shapes: ``blocks [B, N, S, C]``, ``partial [B, N, C]`` -> ``[B, N, Q, C]``.
    """

    FLOAT32 = ("query",)

    def __init__(self, dim: int, num_queries: int = 1, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(num_queries, dim, device=device, dtype=torch.float32))

    def forward(self, blocks: Tensor, partial: Tensor) -> Tensor:
        return block_attention(self.query, blocks, partial)

    def extra_repr(self) -> str:
        return f"{self.query.shape[1]}, queries={self.query.shape[0]}"


class MessageGate(Float32Params):
    """Inkling2-loop's message gate (modeling_inkling2_loop ``Inkling2LoopMessageGate``):
    ``d = down_proj([rms(x), rms(m)])`` (unweighted RMSNorms, ``eps``), ``(1 - tanh(forget_weight d))
    * x + tanh(message_weight d) * m`` in float32.

    Weights: ``down_proj [r, 2 C]``, ``forget_weight`` / ``message_weight [C, r]`` (float32).
    Shapes: ``x, m [B, N, C]`` -> ``[B, N, C]`` float32.
    """

    FLOAT32 = ("forget_weight", "message_weight")

    def __init__(self, dim: int, rank: int, eps: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.down_proj = nn.Linear(2 * dim, rank, bias=False, device=device, dtype=dtype)
        self.forget_weight = nn.Parameter(torch.zeros(dim, rank, device=device, dtype=torch.float32))
        self.message_weight = nn.Parameter(torch.zeros(dim, rank, device=device, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: Tensor, m: Tensor) -> Tensor:
        x, m = wide(x), wide(m)
        d = torch.cat([unweighted_rms(x, self.eps), unweighted_rms(m, self.eps)], dim=-1)
        d = wide(self.down_proj(d.to(self.down_proj.weight.dtype))).to(self.forget_weight.dtype)
        forget, gain = torch.tanh(F.linear(d, self.forget_weight)), torch.tanh(F.linear(d, self.message_weight))
        return (1 - forget) * x + gain * m


class MessageInput(Float32Params):
    """Inkling2-loop's message attention residual (``Inkling2LoopMessageAttentionResidual``): for
    loop layer ``j``, its 4 queries (q, k, v and MLP messages) attend over the previous pass's block
    states and last hidden state as :func:`block_attention`.

    Weights: ``query [J, 4, C]`` (float32). Shapes: ``blocks [B, N, S, C]``, ``partial [B, N, C]``
    -> ``[B, N, 4, C]``.
    """

    FLOAT32 = ("query",)

    def __init__(self, dim: int, loop_layers: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(loop_layers, 4, dim, device=device, dtype=torch.float32))

    def forward(self, blocks: Tensor, partial: Tensor, j: int) -> Tensor:
        return block_attention(self.query[j], blocks, partial)


class Inkling2Layer(nn.Module):
    """One Inkling2 decoder layer (modeling 905-1024; the module docstring's recurrence).

    Weights: ``attn_input`` (a :class:`BlockAttentionResidual` of 1 query, 3 in a full layer;
    ``None`` in layer 0), ``attn_norms`` (1 RMSNorm, or the q/k/v inputs' 3), ``attn``
    (:class:`Inkling2Attention`), ``attn_conv``, ``ffn_input``, ``ffn_norm``, ``ffn``
    (:class:`SoftcappedMoE`), ``ffn_conv``; a loop layer of Inkling2-loop (``message_rank``) also
    ``gates``: 4 :class:`MessageGate` (q, k, v inputs and the MoE input), used in the passes after
    the first (``messages [B, N, 4, C]``). Shapes: ``x [B, N, C]``, ``blocks [B, N, S, C]`` ->
    ``(x [B, N, C], blocks [B, N, S or S + 1, C])``.
    """

    def __init__(self, s: Settings, attn: Inkling2Attention, ffn: nn.Module, *, layer: int,
                 norm: Callable[[], nn.Module], message_rank: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        inputs = 3 if attn.full else 1
        self.boundary = layer % s.block_size == 0
        self.attn_input = BlockAttentionResidual(s.dim, inputs, device=device) if layer > 0 else None
        self.attn_norms = nn.ModuleList([norm() for _ in range(inputs)])
        self.attn, self.ffn = attn, ffn
        self.attn_conv = ShortConv(s.dim, s.conv_size, "attn", device=device)
        self.ffn_input = BlockAttentionResidual(s.dim, 1, device=device)
        self.ffn_norm = norm()
        self.ffn_conv = ShortConv(s.dim, s.conv_size, "ffn", device=device)
        self.gates = None if message_rank is None else nn.ModuleList(
            [MessageGate(s.dim, message_rank, s.norm_eps, device=device, dtype=dtype) for _ in range(4)])

    def _attention_inputs(self, x: Tensor, blocks: Tensor, messages: Tensor | None) -> list[Tensor]:
        """The normed q, k, v inputs ``[B, N, C]`` (message-gated before the norms in a later pass)."""
        sources = [x] * len(self.attn_norms) if self.attn_input is None else list(self.attn_input(blocks, x).unbind(2))
        norms = list(self.attn_norms)
        if messages is not None and self.gates is not None:
            sources, norms = sources * (3 // len(sources)), norms * (3 // len(norms))
            sources = [g(t, m) for g, t, m in zip(self.gates, sources, messages.unbind(2), strict=False)]
        normed = [norm(t).to(x.dtype) for norm, t in zip(norms, sources, strict=True)]
        return normed * 3 if len(normed) == 1 else normed

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Inkling2Cache:
        sh, C = self.attn.shape, self.attn.out_proj.out_features
        kv = sh.num_kv_heads * sh.head_dim
        return Inkling2Cache(batch_size, max_len, sh, {"k": kv, "v": kv, "attn": C, "ffn": C}, device=device,
                             dtype=dtype)

    def forward(self, x: Tensor, blocks: Tensor, *, key_padding: Tensor | None, positions: Tensor,
                cache: Inkling2Cache | None = None, messages: Tensor | None = None) -> tuple[Tensor, Tensor]:
        dtype, N = x.dtype, x.shape[1]
        real = None if key_padding is None else key_padding[:, -N:]
        q_in, k_in, v_in = self._attention_inputs(x, blocks, messages)
        a = self.attn(q_in, k_in, v_in, positions=positions, key_padding=key_padding, cache=cache)
        a = wide(self.attn_conv(a, real, cache))
        if self.boundary:  # a new block starts: the layer's input becomes a block state
            blocks = torch.cat([blocks, x.unsqueeze(-2)], dim=-2)
            r = a
        else:
            r = wide(x) + a
        h = self.ffn_input(blocks, r)[:, :, 0]
        if messages is not None and self.gates is not None:
            h = self.gates[3](h, messages[:, :, 3])
        m = self.ffn(self.ffn_norm(h).to(dtype))
        out = (r + wide(self.ffn_conv(m, real, cache))).to(dtype)
        if cache is not None:
            cache.advance(N)
        return out, blocks

    def extra_repr(self) -> str:
        return f"boundary={self.boundary}"


class Inkling2LM(LayerLoopLM):
    """A :class:`~attnzoo.models.loop.LayerLoopLM` of :class:`Inkling2Layer` layers carrying the block states,
    closed by ``final_input`` (a :class:`BlockAttentionResidual`) before the final norm.
    ``positions`` feed the full layers' log scale (default: from ``attention_mask``, else
    ``cache.length + 0..N-1``). ``cu_seqlens`` runs each packed sequence alone. Generation, caches
    and the rest as :class:`~attnzoo.DecoderLM`.

    Weights: as :class:`~attnzoo.DecoderLM`'s, plus ``final_input.query [1, C]``.
    """

    def __init__(self, *, config: DecoderConfig, parts: DecoderParts, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(config=config, parts=parts, device=device, dtype=dtype)
        self.final_input = BlockAttentionResidual(config.dim, 1, device=device)

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The layers on the embeddings ``x [B, N, C]``, closed by ``final_input`` (``[B, N, C]``)."""
        if positions is None:
            positions = self.default_positions(key_padding, past, x.shape[1], x.device)
        blocks, h = self._layers(x, key_padding, positions if positions.dim() == 2 else positions[None], cache)
        return self.final_input(blocks, h)[:, :, 0]

    def final(self, h: Tensor) -> Tensor:
        """The final norm, back in the embeddings' dtype (as transformers): what the head reads."""
        return self.norm(h).to(self.tok_emb.weight.dtype)

    def _layers(self, x: Tensor, kp: Tensor | None, positions: Tensor, cache: LayerCaches | None) -> tuple[Tensor, Tensor]:
        """The layers on the embeddings ``x [B, N, C]``: ``(block states [B, N, S, C], last hidden state)``."""
        blocks = x.new_zeros(*x.shape[:2], 0, x.shape[-1])
        for i, layer in enumerate(self.blocks):
            x, blocks = layer(x, blocks, key_padding=kp, positions=positions, cache=None if cache is None else cache[i])
        return blocks, x


class Inkling2LoopLM(Inkling2LM):
    """Inkling2-loop (modeling_inkling2_loop ``Inkling2LoopTextModel``): an :class:`Inkling2LM` whose
    layers ``loop = (start, end, passes)`` run ``passes`` times. Each later pass restarts from the
    state before layer ``start`` and its loop layer ``j`` takes ``messages = message_input(blocks,
    h, j)`` from the previous pass's block states (those appended after ``start``'s) and last hidden
    state ``h``; each pass has its own caches (:meth:`init_cache`: one per layer, then one per loop
    layer and later pass).

    Weights: :class:`Inkling2LM`'s (the loop layers with their ``gates``) plus ``message_input``
    (:class:`MessageInput`).
    """

    def __init__(self, *, config: DecoderConfig, parts: DecoderParts, loop: tuple[int, int, int],
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(config=config, parts=parts, device=device, dtype=dtype)
        self.loop = loop
        self.message_input = MessageInput(config.dim, loop[1] - loop[0], device=device)

    @property
    def cache_layers(self) -> int:
        start, end, passes = self.loop
        return self.depth + (passes - 1) * (end - start)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LayerCaches:
        """One cache per layer, then the loop layers' for every later pass."""
        base = super().init_cache(batch_size, max_len, device=device, dtype=dtype)
        start, end, passes = self.loop
        p = self.tok_emb.weight
        device, dtype = p.device if device is None else device, base[0].k.dtype
        extra = [self.blocks[i].init_cache(batch_size, max_len, device=device, dtype=dtype)
                 for _ in range(passes - 1) for i in range(start, end)]
        return LayerCaches([*base, *extra])

    def _layers(self, x: Tensor, kp: Tensor | None, positions: Tensor, cache: LayerCaches | None) -> tuple[Tensor, Tensor]:
        start, end, passes = self.loop

        def layer(i: int, slot: int, x: Tensor, blocks: Tensor, messages: Tensor | None = None) -> tuple[Tensor, Tensor]:
            return self.blocks[i](x, blocks, key_padding=kp, positions=positions, messages=messages,
                                  cache=None if cache is None else cache[slot])

        blocks = x.new_zeros(*x.shape[:2], 0, x.shape[-1])
        for i in range(end):
            x, blocks = layer(i, i, x, blocks)
            if i == start - 1:
                x0, blocks0 = x, blocks  # the state every pass starts from
        for p in range(1, passes):
            previous, h = blocks[:, :, blocks0.shape[2] + 1:], x
            x, blocks = x0, blocks0
            for j, i in enumerate(range(start, end)):
                x, blocks = layer(i, self.depth + (p - 1) * (end - start) + j, x, blocks, self.message_input(previous, h, j))
        for i in range(end, self.depth):
            x, blocks = layer(i, i, x, blocks)
        return blocks, x

    def extra_repr(self) -> str:
        start, end, passes = self.loop
        return f"loop=layers {start}..{end - 1} x {passes} passes"


# --------------------------------------------------------------------------- config
def _heads_ok(hf: HFConfig, prefix: str) -> None:
    H, Hkv = hf.req(f"{prefix}num_attention_heads"), hf.req(f"{prefix}num_key_value_heads")
    if H % Hkv:
        raise hf.unsupported(f"{prefix}num_attention_heads={H} not a multiple of {prefix}num_key_value_heads={Hkv}")


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS` where a key is absent; ``layer_types``
    full every 6th layer when absent, configuration 123-127), its unsupported options refused by name."""
    out = hf.with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    if not out.has("layer_types"):
        out.data["layer_types"] = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(depth)]
    parts.layer_types(out, depth, (SLIDING, FULL))
    scoring = out.req("scoring_func", str)
    if scoring != "sigmoid":
        raise out.unsupported(f"scoring_func={scoring!r} (supported: 'sigmoid')")
    for prefix in ("", "swa_"):
        _heads_ok(out, prefix)
    return out


def canonical_loop(hf: HFConfig) -> HFConfig:
    """An ``Inkling2LoopTextConfig`` as transformers reads it (:data:`LOOP_DEFAULTS`, an original
    ``loop_config`` overriding the loop keys), checked as :func:`canonical` and its loop refused by
    name when transformers' ``validate_architecture`` would refuse it (or it runs past the layers)."""
    out = canonical(hf.with_defaults(LOOP_DEFAULTS))
    given = hf.raw("loop_config")
    if isinstance(given, Mapping):
        out.data.update({key: given[k] for k, key in _LOOP_CONFIG.items() if given.get(k) is not None})
    start, end = out.req("loop_layer_index_start"), out.req("loop_layer_index_end")
    passes, block, depth = out.req("loop_num_passes"), out.req("n_layers_per_attn_res_block"), out.req("num_hidden_layers")
    out.req("loop_gate_rank")
    for key, value, ok in (("loop_num_passes", passes, passes >= 1), ("loop_layer_index_start", start, 0 < start <= end),
                           ("loop_layer_index_start", start, start % block == 0),
                           ("loop_layer_index_end", end, end % block == 0 and end <= depth)):
        if not ok:
            raise out.unsupported(f"{key}={value} (loop_layer_index_start={start}, loop_layer_index_end={end}, "
                                  f"loop_num_passes={passes}, n_layers_per_attn_res_block={block}, "
                                  f"num_hidden_layers={depth})")
    return out


def loop_of(hf: HFConfig) -> tuple[int, int, int]:
    """``(start, end, passes)`` of a canonical Inkling2-loop config."""
    return hf.req("loop_layer_index_start"), hf.req("loop_layer_index_end"), hf.req("loop_num_passes")


def settings(hf: HFConfig) -> Settings:
    return Settings(dim=hf.req("hidden_size"), d_rel=hf.req("d_rel"), conv_size=hf.req("conv_kernel_size"),
                    qk_clip=hf.req("qk_l2_clip_threshold", float), rel_clip=hf.req("rel_l2_clip_threshold", float),
                    norm_eps=hf.req("rms_norm_eps", float), log_alpha=hf.req("log_scaling_alpha", float),
                    log_floor=hf.req("log_scaling_n_floor"), block_size=hf.req("n_layers_per_attn_res_block"),
                    dropout=hf.req("attention_dropout", float))


def _layer(hf: HFConfig, s: Settings, i: int, kind: str, kw: dict[str, Any], rank: int | None) -> Inkling2Layer:
    pre = "swa_" if kind == SLIDING else ""
    shape = HeadShape(hf.req(f"{pre}num_attention_heads"), hf.req(f"{pre}num_key_value_heads"), hf.req(f"{pre}head_dim"))
    window = hf.req("sliding_window_size") if kind == SLIDING else None
    attn = Inkling2Attention(s, shape, window=window, extent=window or hf.req("rel_extent"), **kw)
    routing = Routing("sigmoid_topk", norm_topk_prob=True, scaling=hf.req("route_scale", float))
    ffn = SoftcappedMoE(s.dim, hf.req("moe_intermediate_size"), hf.req("n_routed_experts"),
                        hf.req("num_experts_per_tok"), routing=routing,
                        caps=(hf.req("mlp_gate_softcap", float), hf.req("mlp_up_softcap", float)), **kw)
    return Inkling2Layer(s, attn, ffn, layer=i, norm=parts.rms_norm(s.dim, s.norm_eps, **kw), message_rank=rank, **kw)


def _parts(hf: HFConfig, loop: tuple[int, int, int] | None, head_size: int | None,
           kw: dict[str, Any]) -> tuple[DecoderConfig, DecoderParts]:
    """The config and parts of a canonical config's model (``loop``: Inkling2-loop's, whose loop
    layers get message gates)."""
    s, depth = settings(hf), hf.req("num_hidden_layers")
    kinds = parts.layer_types(hf, depth, (SLIDING, FULL))
    V = hf.req("unpadded_vocab_size")
    cfg = DecoderConfig(V, s.dim, depth, hf.req("num_attention_heads"), pos="none", norm="rms", norm_eps=s.norm_eps,
                        tie_embeddings=False, max_seq_len=parts.max_positions(hf))
    embedding = NormedEmbedding(hf.req("vocab_size"), s.dim, norm=parts.rms_norm(s.dim, s.norm_eps, **kw)(), **kw)
    rank = None if loop is None else hf.req("loop_gate_rank")
    blocks = [_layer(hf, s, i, kind, kw, rank if loop is not None and loop[0] <= i < loop[1] else None)
              for i, kind in enumerate(kinds)]
    head = head_for(s.dim, V, head_size, softcap=hf.req("final_logit_softcapping", float), **kw)
    return cfg, DecoderParts(blocks=blocks, embedding=embedding, head=head)


def build_inkling2(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> Inkling2LM:
    """The :class:`Inkling2LM` of an ``Inkling2TextConfig`` (random weights)."""
    cfg, p = _parts(canonical(hf), None, head_size, {"device": device, "dtype": dtype})
    return Inkling2LM(config=cfg, parts=p, device=device, dtype=dtype)


def build_inkling2_loop(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                        dtype: Any = None) -> Inkling2LoopLM:
    """The :class:`Inkling2LoopLM` of an ``Inkling2LoopTextConfig`` (random weights)."""
    hf = canonical_loop(hf)
    cfg, p = _parts(hf, loop_of(hf), head_size, {"device": device, "dtype": dtype})
    return Inkling2LoopLM(config=cfg, parts=p, loop=loop_of(hf), device=device, dtype=dtype)


# --------------------------------------------------------------------------- weights
def _deinterleave(w: Tensor) -> Tensor:
    """A checkpoint's ``w13_weight [E, 2F, C]`` (rows gate / up alternating) -> ``[E, 2F, C]`` rows
    ``[gate; up]`` (conversion_mapping's ``Interleave(dim=1)``)."""
    return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)


def module_names(hf: HFConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` under transformers' module names: a checkpoint's own names (``model.llm.*``, what
    ``save_pretrained`` writes) renamed as transformers' ``conversion_mapping`` does, the experts
    de-interleaved, the ``attn_res.attn_queries.{j}`` of layer ``j + 1``, the unembedding cut to
    ``unpadded_vocab_size`` rows. Quantized tensors are refused."""
    quantized = sorted(k for k in sd if re.search(r"_scale(_inv)?$|weight_scale|_blocks$|_amax$|_scale_denominator$", k))
    if quantized:
        raise hf.unsupported(f"quantized weights ({quantized[0]}, ...; dequantize the checkpoint first)")
    if not any(re.search(r"(^|\.)(llm|attn_res|attn)\.", k) for k in sd):
        return sd  # transformers' module names already
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        for pattern, repl in _SAVED:
            key = re.sub(pattern, repl, key)
        found = re.search(r"attn_res\.attn_queries\.(\d+)$", key)
        if found:
            key = key[:found.start()] + f"layers.{int(found.group(1)) + 1}.attention_input.query"
        if key.endswith("mlp.experts.w13_weight"):
            key, t = key.replace("w13_weight", "gate_up_proj"), _deinterleave(t)
        out[key] = t
    queries = [k for k in out if k.endswith("middle_cycle_cross_pass_queries")]
    for key in queries:  # [2 J, C] (q, mlp) and (k, v) per loop layer -> message_input.query [J, 4, C]
        q, kv = out.pop(key).unflatten(0, (-1, 2)), out.pop(f"{key[:-len('queries')]}kv_queries").unflatten(0, (-1, 2))
        out[key.replace("middle_cycle_cross_pass_queries", "message_input.query")] = torch.cat([q[:, :1], kv, q[:, 1:]], 1)
    rows = hf.req("unpadded_vocab_size")
    if "lm_head.weight" in out and out["lm_head.weight"].shape[0] > rows:
        out["lm_head.weight"] = out["lm_head.weight"][:rows]
    return out


def _rows(n: int) -> Callable[[Tensor], Tensor]:
    return lambda t: t.reshape(n, -1)


def _put_attention(plan: Plan, o: str, h: str, full: bool) -> None:
    for ours, theirs in (("q_proj", "q_proj.linear"), ("k_proj", "k_proj.linear"), ("v_proj", "v_proj.linear"),
                         ("gate_proj", "o_proj.gate_proj"), ("out_proj", "o_proj.linear"), ("sink_proj", "sink_proj"),
                         ("rel.linear", "relative_position_bias.linear")):
        plan.put(f"{o}{ours}.weight", f"{h}{theirs}.weight")
    plan.put(f"{o}q_scale", f"{h}q_proj.norm.scale")
    plan.put(f"{o}rel.scale", f"{h}relative_position_bias.norm.scale")
    plan.put(f"{o}rel.proj", f"{h}relative_position_bias.proj")
    for n in "kv":
        if full:
            plan.put(f"{o}{n}_conv.static_weight", f"{h}{n}_proj.sconv.static_weight")
            plan.put(f"{o}{n}_conv.weight_proj.weight", f"{h}{n}_proj.sconv.weight_proj.weight")
        else:
            plan.put(f"{o}{n}_conv.weight", f"{h}{n}_proj.sconv.conv1d.weight", lambda w: w.squeeze(1))


def _put_gates(plan: Plan, o: str, h: str) -> None:
    for j, n in enumerate(("q", "k", "v", "mlp")):
        g = f"{h}{n}_message_gate."
        plan.put(f"{o}gates.{j}.down_proj.weight", f"{g}down_proj.weight")
        plan.put(f"{o}gates.{j}.forget_weight", f"{g}forget_gate_proj.weight")
        plan.put(f"{o}gates.{j}.message_weight", f"{g}message_gate_proj.weight")


def _put_layer(plan: Plan, i: int, full: bool) -> None:
    o, h = f"blocks.{i}.", f"layers.{i}."
    if i > 0:
        plan.put(f"{o}attn_input.query", f"{h}attention_input.query", _rows(3 if full else 1))
    plan.put(f"{o}ffn_input.query", f"{h}mlp_input.query", _rows(1))
    norms = ("q_input_layernorm", "k_input_layernorm", "v_input_layernorm") if full else ("input_layernorm",)
    for j, name in enumerate(norms):
        plan.put(f"{o}attn_norms.{j}.weight", f"{h}{name}.weight")
    plan.put(f"{o}ffn_norm.weight", f"{h}post_attention_layernorm.weight")
    plan.put(f"{o}attn_conv.weight", f"{h}post_attention_convolution.conv1d.weight", lambda w: w.squeeze(1))
    plan.put(f"{o}ffn_conv.weight", f"{h}post_mlp_convolution.conv1d.weight", lambda w: w.squeeze(1))
    _put_attention(plan, f"{o}attn.", f"{h}self_attn.", full)
    put_moe(plan, f"{o}ffn.", f"{h}mlp.", "stacked")
    plan.put(f"{o}ffn.score_bias", f"{h}mlp.gate.e_score_correction_bias")


def _convert(hf: HFConfig, sd: dict[str, Tensor], build: Callable[..., Inkling2LM],
             loop: tuple[int, int, int] | None, *, device: Any, dtype: Any) -> Inkling2LM:
    sd = module_names(hf, sd)
    model, plan, head_size = parts.start(hf, sd, build, device=device, dtype=dtype)
    plan.put("tok_emb.norm.weight", "embed_tokens.embed_norm.weight")
    for i, kind in enumerate(parts.layer_types(hf, model.depth, (SLIDING, FULL))):
        _put_layer(plan, i, kind == FULL)
        if loop is not None and loop[0] <= i < loop[1]:
            _put_gates(plan, f"blocks.{i}.", f"layers.{i}.")
    plan.put("final_input.query", "final_input.query", _rows(1))
    if loop is not None:
        plan.put("message_input.query", "message_input.query")
    return parts.finish(plan, model, head_size)


def convert_inkling2(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> Inkling2LM:
    """Build an Inkling2 decoder (:class:`Inkling2LM`) and copy the weights (transformers' module
    names or the checkpoint's own, see :func:`module_names`)."""
    return _convert(canonical(hf), sd, build_inkling2, None, device=device, dtype=dtype)


def convert_inkling2_loop(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> Inkling2LoopLM:
    """Build an Inkling2-loop decoder (:class:`Inkling2LoopLM`) and copy the weights (the loop
    layers' message gates and ``message_input`` too)."""
    hf = canonical_loop(hf)
    return _convert(hf, sd, build_inkling2_loop, loop_of(hf), device=device, dtype=dtype)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "inkling2_text": parts.Dispatch("Inkling2", convert_inkling2, ("Inkling2ForCausalLM", "Inkling2TextModel")),
    "inkling2_loop_text": parts.Dispatch("Inkling2-loop", convert_inkling2_loop, ("Inkling2LoopForCausalLM", "Inkling2LoopTextModel")),
}
