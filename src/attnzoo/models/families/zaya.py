"""Zaya (``zaya``) -> :class:`ZayaLM`, a :class:`~attnzoo.DecoderLM`: ``ZayaForCausalLM`` and
``ZayaModel`` (Zyphra's ZAYA1: compressed convolutional attention, an MLP router carried from
layer to layer, residual scaling).

Line numbers below are transformers 5.25's ``models/zaya/modeling_zaya.py`` (``M``) and
``configuration_zaya.py`` (``C``). Every layer (``ZayaDecoderLayer``, M 431-476) is::

    a = attn(input_layernorm(h))
    h = (a + b_a) * s_a + (h + r_a) * t_a                 # ZayaResidualScaling (M 479-491)
    m, r = moe(post_attention_layernorm(h), r)            # r: the router state of the previous layer
    h = (m + b_m) * s_m + (h + r_m) * t_m

after the embedding ``h = (E[tokens] + b) * s`` (``input_hidden_states_bias`` / ``_scale``, M 700-701,
759-761); then the final ``norm`` and the head (a bias with ``lm_head_bias``, M 799).

**The attention** (``ZayaAttention`` + ``ZayaCCAProjection`` + ``ZayaQKNorm``, M 143-428), here
:class:`CCAAttention`, a :class:`~attnzoo.MultiHeadAttention` whose projection is replaced:

* the input is multiplied by the padding mask first (the ``"conv"`` mask, M 201-202: a padded token
  feeds zeros to everything below);
* ``q = x W_q``, ``k = x W_k`` (M 215-216); their *residual paths* (M 219-223):
  ``q_res[h] = (q[h] + k[h // g]) / 2`` (``g = H / Hkv``), ``k_res[j] = mean of q_res over group j``;
* ``[q | k]`` (``(H + Hkv) D`` channels) through a causal depthwise convolution of ``cca_time0``
  taps, then a grouped one of ``cca_time1`` taps, ``H + Hkv`` groups of ``D`` channels (one per
  head: it mixes a head's channels), both with biases and no padding of their own: the input is
  left-padded once by ``P = (cca_time0 - 1) + (cca_time1 - 1)`` zeros (M 159-192, 227-237), so the
  first convolution's bias reaches the second one at the sequence start;
  ``q = conv(..)[q part] + q_res``, ``k = conv(..)[k part] + k_res`` (M 239-241). Decoding keeps the
  last ``P`` inputs of the convolution (transformers' conv state, M 206, 228);
* the values: half of the ``Hkv D`` channels from this token (``v_proj_current``), half from the
  *previous* token's ``v_proj_delayed`` projection (M 243-256: at the sequence start the
  projection of a zero token, i.e. its bias), concatenated as ``[current | delayed]`` and then cut
  into heads (with ``Hkv >= 2`` whole heads are current or delayed). Decoding keeps the last
  token's delayed projection (transformers' recurrent state, M 207, 254);
* QK norm (M 261-280): ``q * sqrt(D) / max(|q|, eps)``, the same for ``k`` then times the learned
  ``temp`` of its KV head (zeros at init), ``eps`` the dtype's machine epsilon;
* partial RoPE on the first ``partial_rotary_factor * D`` channels (split halves) with the layer
  kind's own ``rope_parameters`` (``"hybrid"``: theta 5e6, ``"hybrid_sliding"``: 1e4, both 0.5 by
  default, C 96-109; M 47-107, 316-351), softmax attention with the scale ``D ** -0.5``, GQA, a
  window of ``sliding_window - 1`` keys on the ``"hybrid_sliding"`` layers (M 376), ``o_proj``.

The projections are fused as attnzoo's ``qkv_proj`` with rows ``[q; k; v_current; v_delayed]``
(``H D + Hkv D + Hkv D / 2 + Hkv D / 2``: exactly :class:`~attnzoo.MultiHeadAttention`'s ``(H + 2 Hkv) D``);
the decode cache is a :class:`~attnzoo.nn.cache.CacheList` of the KV cache (a ring of
``sliding_window - 1`` keys on sliding layers) and a :class:`CCAState` (the convolution's inputs,
the delayed value). Packed sequences (``cu_seqlens``) restart the convolution and the delayed
value at every boundary.

**The router** (``ZayaRouter`` + ``ZayaRouterMLP``, M 494-570), here :class:`ZayaRouter`:
``u = down_proj(x)`` (``C -> R``, ``router_hidden_size``, with a bias), plus ``r * router_states_scale``
on every layer but the first (EDA: ``r`` is the previous layer's ``u``, M 530-552); the logits over
``E + 1`` classes (the last one a *skip* expert without compute) are
``out_proj(gelu(fc2(gelu(fc1(rmsnorm(u))))))`` (exact GELU, biases on ``fc1`` / ``fc2``);
``p = softmax(logits)``; the one expert (``num_experts_per_tok`` must be 1, C 123-124) is the
argmax of ``p + balancing_biases`` (a float32 buffer of the checkpoint, ``-1`` on the skip class at
init) and its weight the unbiased ``p``, not renormalised; the skip class gives the token a zero
output (M 556-563). The experts (``ZayaExperts``, M 574-610): ``gate_up_proj [E, 2F, C]`` (rows
``[gate; up]``), ``down_proj [E, C, F]``, ``act(gate) * up`` with ``hidden_act`` (SiLU), held by
:class:`ZayaMoE`, a :class:`~attnzoo.nn.moe.MixtureOfExperts` whose router is :class:`ZayaRouter`.

**The layer loop.** The router state passes from layer to layer beside the residual stream:
the model is a :class:`ZayaLM`, a :class:`~attnzoo.models.loop.LayerLoopLM` whose loop hands each
:class:`ZayaLayer` the previous layer's state (none to the first) and takes back the new one, so
cached decoding, packed sequences (the packed row through the layers whole) and
:meth:`~attnzoo.DecoderLM.generate` are ``DecoderLM``'s own. The residual stream is float32 (float64
for a float64 model) whatever the model's dtype, as transformers keeps it (M 453-456, 758-761):
:class:`ZayaEmbedding` returns it so, and each norm reads it cast to its weight's dtype
(:class:`StreamNorm` the final one).

Padding: transformers zeroes a padded token's input to the projections (so its convolution inputs
and delayed value are a zero token's) and hides its keys; so does attnzoo (``attention_mask``): with
left padding a row computes what the row alone computes.

Config keys a ``config.json`` leaves out take ``ZayaConfig``'s defaults (:data:`DEFAULTS`; ``head_dim``
128, not ``hidden_size / heads``). Refused (by name): ``num_experts_per_tok`` other than 1,
``hidden_act`` other than SiLU (the experts'), a layer type other than ``hybrid`` /
``hybrid_sliding``, ``hybrid_sliding`` layers without ``sliding_window``, an unknown ``rope_type``
(the scaled ones attnzoo knows rotate ``partial_rotary_factor * D`` channels, as transformers').
``output_router_logits`` (a training loss) is accepted.

transformers' own cached decode equals its full forward, except with ``cca_time0 = cca_time1 = 1``
(no convolution state, ``P = 0``): its cache then fails in any forward with ``use_cache=True``
(``update_conv_state`` copies the inputs into a zero-width state). That config converts (equal to
transformers' ``use_cache=False`` forward) and decodes here. transformers' convolutions and
delayed values do not restart at packed boundaries (``cu_seq_lens_*``); this packed path does.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._devices import restore_float32
from attnzoo.blocks import RMSNorm
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.families._moe import put_stacked_experts
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.parts import DecoderParts, LMHead, head_for
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.cache import CacheList, SnapshotCache
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions
from attnzoo.nn.moe import MixtureOfExperts
from attnzoo.nn.parts import placed
from attnzoo.nn.positional import RotaryEmbedding, resolve_positions

__all__ = ["DEFAULTS", "DISPATCH", "CCAAttention", "CCAState", "ResidualScaling", "StreamNorm", "ZayaEmbedding",
           "ZayaLM", "ZayaLayer", "ZayaMoE", "ZayaRouter", "build_zaya", "canonical", "convert_zaya"]

#: ``ZayaConfig``'s defaults of the keys read here (C 60-91), for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262272, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 8,
    "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "attention_dropout": 0.0, "moe_intermediate_size": 2048, "num_experts_per_tok": 1,
    "num_experts": 16, "head_dim": 128, "attention_bias": False, "lm_head_bias": False, "router_hidden_size": 256,
    "cca_time0": 2, "cca_time1": 2,
}

#: ``rope_parameters`` when a config has none (C 96-109)
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "hybrid": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
    "hybrid_sliding": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
}

#: the layer kinds of ``layer_types`` (every layer is CCA attention + MoE; the kind picks the window and rope)
TYPES = ("hybrid", "hybrid_sliding")


# --------------------------------------------------------------------------- the embedding, norm and residuals
class ZayaEmbedding(nn.Embedding):
    """The token embedding, shifted and scaled: ``tokens [B, N] -> (E[tokens] + bias) * scale``
    ``[B, N, C]``, float32 (float64 for a float64 model) whatever the weights' dtype (transformers'
    residual stream, M 758-761).

    Weights: ``weight [V, C]`` (tied to an LM head like ``nn.Embedding``'s), ``scale [C]``, ``bias [C]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.scale = nn.Parameter(torch.ones(embedding_dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(embedding_dim, device=device, dtype=dtype))

    def forward(self, tokens: Tensor) -> Tensor:
        h = (super().forward(tokens) + self.bias) * self.scale  # [B, N, C]
        return h.to(torch.promote_types(h.dtype, torch.float32))


class StreamNorm(RMSNorm):
    """The final RMSNorm, reading the float32 residual stream ``[..., C]`` in its weight's dtype (as
    transformers casts its residual before the norm, M 781)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.weight.dtype))


class ResidualScaling(nn.Module):
    """``(y + hidden_states_bias) * hidden_states_scale + (residual + residual_bias) * residual_scale``
    (``ZayaResidualScaling``, M 479-491): ``y, residual [..., C] -> [..., C]``, in the wider dtype of
    the two (the float32 residual stream)."""

    def __init__(self, dim: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.hidden_states_scale = nn.Parameter(torch.ones(dim, **kw))
        self.hidden_states_bias = nn.Parameter(torch.zeros(dim, **kw))
        self.residual_scale = nn.Parameter(torch.ones(dim, **kw))
        self.residual_bias = nn.Parameter(torch.zeros(dim, **kw))

    def forward(self, y: Tensor, residual: Tensor) -> Tensor:
        return ((y + self.hidden_states_bias) * self.hidden_states_scale
                + (residual + self.residual_bias) * self.residual_scale)


# --------------------------------------------------------------------------- attention
class CCAState(SnapshotCache):
    """The decode state of a :class:`CCAAttention` besides its KV cache: ``conv [B, Ch, P]``, the last
    ``P`` inputs of the q/k convolution (zeros at the start), and ``value [B, Hkv D / 2]``, the last
    token's delayed value projection (``None`` at the start: a zero token's). Replaced, not written
    in place (a mark is a snapshot)."""

    _batch_tensors = ("conv", "value")

    snapshot = ("length", "conv", "value")

    def __init__(self, batch_size: int, max_len: int, channels: int, taps: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self._set_sizes(batch_size, max_len=max_len)
        self.channels, self.taps = int(channels), int(taps)
        self._device, self._dtype = device, dtype
        self.conv = torch.zeros(batch_size, self.channels, self.taps, device=device, dtype=dtype)
        self.value: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + (0 if self.value is None else self.value.nbytes)

    def reset(self) -> None:
        self.length = 0
        self.conv = torch.zeros_like(self.conv)
        self.value = None

    def update(self, conv: Tensor, value: Tensor, n: int) -> None:
        """Keep the convolution's last inputs and the delayed value after ``n`` more tokens."""
        if self.length + n > self.max_len:
            raise ValueError(f"CCAState overflow: {self.length} tokens + {n} new > max_len={self.max_len}")
        self.conv, self.value = conv.to(self._dtype), value.to(self._dtype)
        self.length += n

    def __repr__(self) -> str:
        return f"CCAState(batch_size={self.batch_size}, conv=[{self.channels}, {self.taps}], length={self.length})"


class CCAAttention(MultiHeadAttention):
    """ZAYA's compressed convolutional attention (see the module docstring): causal GQA whose q/k
    come through a two-stage causal convolution plus residual paths, whose values are half
    delayed by one token, with an L2 QK norm (a learned key scale per KV head) and partial RoPE.

    Args:
        dim: model width ``C``.
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv``, ``D`` (``Hkv D`` even).
        taps: ``(cca_time0, cca_time1)``, the two convolutions' kernel sizes (``>= 1``).
        bias: biases on ``qkv_proj`` and ``out_proj`` (``attention_bias``; the convolutions always have them).
        window: left window (``sliding_window - 1``) or ``None``.
        rope: the layer's :class:`RotaryEmbedding` (``rotary_dim`` the rotated channels).
        dropout: attention dropout (training only).

    Weights: ``qkv_proj [(H + 2 Hkv) D, C]`` (rows ``[q; k; v_current; v_delayed]``), ``out_proj``,
    ``conv_depthwise`` (``Conv1d``, ``Ch = (H + Hkv) D`` groups), ``conv_grouped`` (``H + Hkv`` groups),
    ``temp [Hkv]``. Shapes: ``forward(x [B, N, C]) -> [B, N, C]``; ``key_padding [B, Nk]`` bool, True
    for real tokens (with a cache ``Nk`` counts every token written, then the new ones). Decode
    cache: a :class:`~attnzoo.nn.cache.CacheList` ``[kv, CCAState]``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, taps: tuple[int, int],
                 bias: bool = False, window: int | None = None, rope: RotaryEmbedding | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__(dim, num_heads, num_kv_heads, None, head_dim, bias, True, window, rope, dropout)
        if (self.num_kv_heads * self.head_dim) % 2 or min(taps) < 1:
            raise ValueError(f"CCAAttention: num_kv_heads * head_dim must be even (half the values are delayed) and "
                             f"both taps >= 1, got {self.num_kv_heads} * {self.head_dim} and taps={taps}")
        self.taps = (int(taps[0]), int(taps[1]))
        self.pad = self.taps[0] + self.taps[1] - 2  # P: the inputs before a token the convolutions read
        ch = (self.num_heads + self.num_kv_heads) * self.head_dim
        self.conv_depthwise = nn.Conv1d(ch, ch, self.taps[0], groups=ch)
        self.conv_grouped = nn.Conv1d(ch, ch, self.taps[1], groups=self.num_heads + self.num_kv_heads)
        self.temp = nn.Parameter(torch.zeros(self.num_kv_heads))

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> CacheList:
        kv = super()._new_cache(batch_size, max_len, device, dtype)
        ch = (self.num_heads + self.num_kv_heads) * self.head_dim
        return CacheList([kv, CCAState(batch_size, max_len, ch, self.pad, device=device, dtype=dtype)])

    def forward(self, x: Tensor, *, key_padding: Tensor | None = None,  # type: ignore[override]
                cache: CacheList | None = None, positions: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """``x [B, N, C]`` (with a cache the new tokens; with ``cu_seqlens`` packed ``[1, T, C]``) -> ``[B, N, C]``."""
        x = self.check_call(x, cache, positions, False, CacheList)
        if cu_seqlens is not None:
            if cache is not None or key_padding is not None or positions is not None:
                raise ValueError("CCAAttention: packed input (cu_seqlens) takes no cache, key_padding or positions")
            return self._packed_cca(x, cu_seqlens)
        B, N, _ = x.shape
        kv, state = (None, None) if cache is None else (cache[0], cast(CCAState, cache[1]))
        start = 0 if kv is None else kv.length
        if key_padding is not None and tuple(key_padding.shape) != (B, start + N):
            raise ValueError(f"CCAAttention: key_padding must be [B, Nk] = [{B}, {start + N}], got "
                             f"{tuple(key_padding.shape)}")
        pad = None if key_padding is None else key_padding[:, start:]
        q, k, v, conv, value = self._project(x, pad, None if state is None else state.conv,
                                             None if state is None else state.value)
        pos = resolve_positions(positions, N, start, x.device, batch=B)
        q, k = self._rotate(q, pos), self._rotate(k, pos)
        if kv is not None and state is not None:
            k, v, _ = kv.update(k, v)
            state.update(conv, value, N)
        mask = None if key_padding is None else key_padding[:, None, None, :]  # [B, 1, 1, Nk]
        out, _ = self._attend_keys(q, k, v, mask, start, start + N - k.shape[2], False, decoding=kv is not None)
        return self.merge_heads(out)  # [B, N, C]

    def _project(self, x: Tensor, pad: Tensor | None, conv: Tensor | None, value: Tensor | None,
                 cu: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(q [B, H, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D], conv, value)`` of the tokens ``x [B, N, C]``
        after the convolution's inputs ``conv [B, Ch, P]`` and the delayed value ``value [B, Hkv D / 2]``
        (``None``: a sequence start); q and k normed, not rotated. ``cu``: packed sequence bounds."""
        B, N, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if pad is not None:
            x = x * pad[..., None].to(x.dtype)  # a padded token is a zero token (M 201-202)
        qk, v_now, v_del = self.qkv_proj(x).split(((H + Hkv) * D, Hkv * D // 2, Hkv * D // 2), dim=-1)
        q_lin, k_lin = qk[..., : H * D].view(B, N, H, D), qk[..., H * D:].view(B, N, Hkv, D)
        q_res = (q_lin + k_lin.repeat_interleave(H // Hkv, dim=2)) * 0.5  # [B, N, H, D] (M 219-222)
        k_res = q_res.view(B, N, Hkv, H // Hkv, D).mean(dim=-2)  # [B, N, Hkv, D] (M 223)
        if cu is None:
            mixed, conv = self._convolve(qk.transpose(1, 2), conv)
            delayed, value = self._delay(v_del, value)
        else:
            runs = [(self._convolve(qk[:, a:b].transpose(1, 2), None)[0], self._delay(v_del[:, a:b], None)[0])
                    for a, b in itertools.pairwise(cu) if b > a]
            mixed, delayed = torch.cat([r[0] for r in runs], dim=2), torch.cat([r[1] for r in runs], dim=1)
        mixed = mixed.transpose(1, 2)  # [B, N, Ch]
        q = mixed[..., : H * D].view(B, N, H, D) + q_res
        k = mixed[..., H * D:].view(B, N, Hkv, D) + k_res
        v = torch.cat([v_now, delayed], dim=-1).view(B, N, Hkv, D)  # [current | delayed], then heads (M 256)
        q, k = self._qk_norm(q, k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), conv, value

    def _convolve(self, seq: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """The two convolutions of ``seq [B, Ch, N]`` after the inputs ``prev [B, Ch, P]`` (zeros when
        ``None``): ``(out [B, Ch, N], the last P inputs [B, Ch, P])``."""
        if prev is None:
            prev = seq.new_zeros(seq.shape[0], seq.shape[1], self.pad)
        full = torch.cat([prev.to(seq.dtype), seq], dim=-1)  # [B, Ch, P + N]
        out = self.conv_grouped(self.conv_depthwise(full))  # [B, Ch, N]
        return out, full[..., full.shape[-1] - self.pad:]

    def _delay(self, v_del: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """``v_del [B, N, Hkv D / 2]`` one token later, after ``prev [B, Hkv D / 2]`` (``None``: the
        projection of a zero token, M 247-251): ``(delayed [B, N, Hkv D / 2], the last v_del)``."""
        if prev is None:
            n = v_del.shape[-1]
            b = self.qkv_proj.bias
            zero = v_del.new_zeros(n) if b is None else b[b.shape[0] - n:].to(v_del.dtype)
            prev = zero.expand(v_del.shape[0], n)
        delayed = torch.cat([prev[:, None].to(v_del.dtype), v_del[:, :-1]], dim=1)
        return delayed, (v_del[:, -1] if v_del.shape[1] else prev)

    def _qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """``q, k [B, N, h, D]`` scaled to norm ``sqrt(D)`` (over ``D``, floored at the dtype's eps),
        ``k`` then times ``temp`` of its KV head (``ZayaQKNorm``, M 271-280)."""
        eps, root = torch.finfo(q.dtype).eps, self.head_dim ** 0.5
        q = q * (root / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (root / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp[None, None, :, None].to(k.dtype)

    def _packed_cca(self, x: Tensor, cu_seqlens: Tensor) -> Tensor:
        """Packed sequences ``x [1, T, C]``: each restarts the convolution, the delayed value and RoPE."""
        cu = packed_cu_seqlens(cu_seqlens, x, type(self).__name__)
        if self.training and self.dropout:
            raise ValueError("CCAAttention: packed input (cu_seqlens) has no attention dropout; use dropout=0.0")
        T = x.shape[1]
        q, k, v, _, _ = self._project(x, None, None, None, [int(c) for c in cu.tolist()])
        pos = packed_positions(cu, T)
        q, k = self._rotate(q, pos), self._rotate(k, pos)
        out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, causal=True,
                               window=self.window, scale=self.scale, backend=self.backend)  # [T, H, D]
        return self.merge_heads(out.transpose(0, 1).unsqueeze(0))  # [1, T, C]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, taps={self.taps}"


# --------------------------------------------------------------------------- the mixture of experts
class ZayaRouter(nn.Module):
    """ZAYA's MLP router (see the module docstring): ``x [T, C]``, the previous layer's state
    ``r [T, R]`` (or ``None``) -> ``(weight [T], expert [T], state [T, R])``; ``expert == E`` is the
    skip class (weight 0).

    Weights: ``down_proj [R, C]`` (+ bias), ``router_states_scale [R]`` (``eda``: not on the first
    layer), ``norm [R]``, ``fc1``, ``fc2`` ``[R, R]`` (+ biases), ``out_proj [E + 1, R]``; buffer
    ``balancing_biases [E + 1]`` (float32, also through half casts).
    """

    def __init__(self, dim: int, router_dim: int, num_experts: int, *, eda: bool, eps: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.num_experts = int(num_experts)
        self.down_proj = nn.Linear(dim, router_dim, bias=True, **kw)
        self.router_states_scale = nn.Parameter(torch.ones(router_dim, **kw)) if eda else None
        self.norm = RMSNorm(router_dim, eps, **kw)
        self.fc1 = nn.Linear(router_dim, router_dim, bias=True, **kw)
        self.fc2 = nn.Linear(router_dim, router_dim, bias=True, **kw)
        self.out_proj = nn.Linear(router_dim, num_experts + 1, bias=False, **kw)
        biases = torch.zeros(num_experts + 1, device=device, dtype=torch.float32)
        biases[-1] = -1.0
        self.register_buffer("balancing_biases", biases)

    def _apply(self, fn: Any, recurse: bool = True) -> ZayaRouter:
        before = self.balancing_biases
        super()._apply(fn, recurse)
        restore_float32(self, "balancing_biases", before)
        return self

    def forward(self, x: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        u = self.down_proj(x)  # [T, R]
        if self.router_states_scale is not None and state is not None:
            u = u + state.to(u.dtype) * self.router_states_scale  # EDA (M 549-550)
        logits = self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(u))))))  # [T, E + 1]
        probs = torch.softmax(logits, dim=-1)
        biased = probs.detach().to(self.balancing_biases.dtype) + self.balancing_biases
        expert = biased.argmax(dim=-1)  # [T]
        weight = probs.gather(-1, expert[:, None])[:, 0].masked_fill(expert == self.num_experts, 0)
        return weight, expert, u


class ZayaMoE(MixtureOfExperts):
    """ZAYA's feed-forward: one SwiGLU expert of ``E`` per token (or none: the skip class), picked
    and weighted by a :class:`ZayaRouter` (held as ``router``; the experts as
    :class:`~attnzoo.nn.moe.MixtureOfExperts`' ``gate_proj`` / ``up_proj`` ``[E, F, C]``, ``down_proj [E, C, F]``).

    Shapes: ``forward(x [B, N, C], state [B, N, R] | None) -> (out [B, N, C], state [B, N, R])``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, router_dim: int, *, eda: bool, eps: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, hidden, num_experts, 1, device=device, dtype=dtype)
        self.router = ZayaRouter(dim, router_dim, num_experts, eda=eda, eps=eps, device=device, dtype=dtype)

    def forward(self, x: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        flat = x.reshape(-1, self.dim)  # [T, C]
        weight, expert, u = self.router(flat, None if state is None else state.reshape(flat.shape[0], -1))
        out = torch.zeros_like(flat)
        for e in torch.unique(expert).tolist():
            if e == self.num_experts:  # the skip class: no compute, zero output
                continue
            token = torch.nonzero(expert == e)[:, 0]
            out.index_add_(0, token, (self.expert(e, flat[token]) * weight[token, None]).to(out.dtype))
        return out.view(x.shape), u.view(*x.shape[:-1], -1)


# --------------------------------------------------------------------------- the layer
class ZayaLayer(nn.Module):
    """One ZAYA layer (see the module docstring): ``attn_norm`` -> :class:`CCAAttention` ``attn`` ->
    ``attn_residual`` (:class:`ResidualScaling`), ``ffn_norm`` -> :class:`ZayaMoE` ``ffn`` (reading the
    previous layer's router state, returning this one's) -> ``ffn_residual``. Decode cache: the
    attention's."""

    def __init__(self, attn_norm: nn.Module, attn: CCAAttention, ffn_norm: nn.Module, ffn: ZayaMoE,
                 residuals: tuple[ResidualScaling, ResidualScaling]) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.attn_residual = attn_norm, attn, residuals[0]
        self.ffn_norm, self.ffn, self.ffn_residual = ffn_norm, ffn, residuals[1]
        self.dim = attn.dim

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> CacheList:
        return cast(CacheList, self.attn.init_cache(batch_size, max_len, device=device, dtype=dtype))

    def forward(self, h: Tensor, state: Tensor | None = None, *, key_padding: Tensor | None = None,
                cache: CacheList | None = None, positions: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``h [B, N, C]`` (the float32 stream; with a cache the new tokens, with ``cu_seqlens`` packed
        ``[1, T, C]``) and the router state ``[B, N, R]`` (``None`` for the first layer) ->
        ``(h [B, N, C], state [B, N, R])``; ``key_padding [B, Nk]`` bool (True = real token)."""
        if not isinstance(h, Tensor) or h.dim() != 3 or h.shape[-1] != self.dim:
            got = tuple(h.shape) if isinstance(h, Tensor) else type(h).__name__
            raise ValueError(f"ZayaLayer: h must be [B, N, {self.dim}], got {got}")
        dt = self.attn.out_proj.weight.dtype
        a = self.attn(self.attn_norm(h.to(dt)), key_padding=key_padding, cache=cache, positions=positions,
                      cu_seqlens=cu_seqlens)
        h = self.attn_residual(a, h)
        m, state = self.ffn(self.ffn_norm(h.to(dt)), state)
        return self.ffn_residual(m, h), state


class ZayaLM(LayerLoopLM):
    """The Zaya decoder: a :class:`~attnzoo.models.loop.LayerLoopLM` of :class:`ZayaLayer` layers
    handing the router state from each to the next; packed input runs whole."""

    packs = True

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x`` the embedded stream ``[B, N, C]``; returns the stream after the last layer."""
        positions = self.rotary_positions(positions, key_padding, past, x.shape[1], x.device, cu_seqlens)
        h, state = x, None
        for i, layer in enumerate(self.blocks):
            h, state = layer(h, state, key_padding=key_padding, cache=None if cache is None else cache[i],
                             positions=positions, cu_seqlens=cu_seqlens)
        return h


# --------------------------------------------------------------------------- the config
def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS` where a key is absent; ``layer_types`` all
    ``hybrid`` and :data:`DEFAULT_ROPE` when absent), its unsupported options refused by name."""
    out = hf.with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    if not out.has("layer_types"):
        out.data["layer_types"] = ["hybrid"] * depth
    if not out.has("rope_parameters"):
        out.data["rope_parameters"] = DEFAULT_ROPE
    parts.unsupported_keys(out, {"num_experts_per_tok": lambda v: v == 1})
    out.activation("hidden_act", {"silu": "swiglu", "swish": "swiglu"}, "silu")
    kinds = parts.layer_types(out, depth, TYPES)
    if "hybrid_sliding" in kinds and not out.has("sliding_window"):
        raise out.unsupported("hybrid_sliding layers without a sliding_window")
    return out


def _rope(hf: HFConfig, kind: str, head_dim: int) -> RotaryEmbedding:
    """The rotary embedding of layer kind ``kind``: ``rope_parameters[kind]`` (M 47-95), the first
    ``partial_rotary_factor * D`` channels."""
    table = hf.req("rope_parameters", dict)
    params = table.get(kind)
    if not isinstance(params, Mapping):
        raise CheckpointFormatError(f"{hf.source}: rope_parameters has no entry for the layer type {kind!r}")
    params = dict(params)
    params.setdefault("rope_theta", DEFAULT_ROPE[kind]["rope_theta"])
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    return cast(RotaryEmbedding, parts.rotary(hf, params, head_dim, rotary_dim=rotary_dim))


def _attention(hf: HFConfig, kind: str, rope: RotaryEmbedding, kw: dict[str, Any]) -> CCAAttention:
    window = hf.req("sliding_window") - 1 if kind == "hybrid_sliding" else None
    with contextlib.nullcontext() if kw["device"] is None else torch.device(kw["device"]):
        attn = CCAAttention(hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_key_value_heads"),
                            hf.req("head_dim"), taps=(hf.req("cca_time0"), hf.req("cca_time1")),
                            bias=hf.req("attention_bias", bool), window=window, rope=rope,
                            dropout=hf.req("attention_dropout", float))
    return cast(CCAAttention, placed(attn, kw["dtype"], keep=(rope,)))


def _layer(hf: HFConfig, i: int, kind: str, rope: RotaryEmbedding, kw: dict[str, Any]) -> ZayaLayer:
    C, eps = hf.req("hidden_size"), hf.req("rms_norm_eps", float)
    moe = ZayaMoE(C, hf.req("moe_intermediate_size"), hf.req("num_experts"), hf.req("router_hidden_size"),
                  eda=i != 0, eps=eps, **kw)
    return ZayaLayer(RMSNorm(C, eps, **kw), _attention(hf, kind, rope, kw), RMSNorm(C, eps, **kw), moe,
                     (ResidualScaling(C, **kw), ResidualScaling(C, **kw)))


def _head(hf: HFConfig, head_size: int | None, kw: dict[str, Any]) -> nn.Module | None:
    """The LM head (with a bias when ``lm_head_bias``), none for the base model."""
    V, C = hf.req("vocab_size"), hf.req("hidden_size")
    if head_size is None and hf.req("lm_head_bias", bool):
        return LMHead(C, V, bias=True, **kw)
    return head_for(C, V, head_size, **kw)


def build_zaya(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> ZayaLM:
    """The decoder of a ``ZayaConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    V, C, depth = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers")
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    ropes = {k: _rope(hf, k, hf.req("head_dim")) for k in sorted(set(kinds))}
    blocks = [_layer(hf, i, k, ropes[k], kw) for i, k in enumerate(kinds)]
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="rope", norm="rms",
                        norm_eps=hf.req("rms_norm_eps", float), tie_embeddings=hf.req("tie_word_embeddings", bool),
                        max_seq_len=parts.max_positions(hf))
    embedding = ZayaEmbedding(V, C, **kw)
    norm = StreamNorm(C, hf.req("rms_norm_eps", float), **kw)
    return ZayaLM(config=cfg, parts=DecoderParts(blocks=blocks, embedding=embedding, norm=norm,
                                                    head=_head(hf, head_size, kw)), **kw)


# --------------------------------------------------------------------------- the weights
#: ``(ours, theirs)`` of a layer's plain tensors (``.weight`` / ``.bias`` spelled out)
_LAYER_NAMES = (
    [("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
     ("attn.temp", "self_attn.qk_norm.temp")]
    + [(f"attn.conv_{n}.{p}", f"self_attn.qkv_proj.conv_qk_{n}.{p}") for n in ("depthwise", "grouped")
       for p in ("weight", "bias")]
    + [(f"{o}_residual.{n}", f"{t}_residual_scale.{n}") for o, t in (("attn", "post_attention"), ("ffn", "post_mlp"))
       for n in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")]
    + [(f"ffn.router.{o}", f"mlp.gate.{t}") for o, t in (
        ("down_proj.weight", "down_proj.weight"), ("down_proj.bias", "down_proj.bias"),
        ("norm.weight", "router_mlp.norm.weight"), ("fc1.weight", "router_mlp.fc1.weight"),
        ("fc1.bias", "router_mlp.fc1.bias"), ("fc2.weight", "router_mlp.fc2.weight"),
        ("fc2.bias", "router_mlp.fc2.bias"), ("out_proj.weight", "router_mlp.out_proj.weight"),
        ("balancing_biases", "balancing_biases"))]
)


def _plan_layer(plan: Plan, i: int, bias: bool) -> None:
    """Layer ``i``'s tensors into block ``i``."""
    o, h = f"blocks.{i}.", f"layers.{i}."
    proj = [f"{h}self_attn.qkv_proj.{n}" for n in ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")]
    plan.put_cat(f"{o}attn.qkv_proj.weight", [f"{p}.weight" for p in proj])
    if bias:
        plan.put_cat(f"{o}attn.qkv_proj.bias", [f"{p}.bias" for p in proj])
    plan.put_pairs(f"{o}attn.", f"{h}self_attn.", [("out_proj", "o_proj")], bias=bias)
    for ours, theirs in _LAYER_NAMES:
        plan.put(o + ours, h + theirs)
    if i:
        plan.put(f"{o}ffn.router.router_states_scale", f"{h}mlp.gate.router_states_scale")
    put_stacked_experts(plan, f"{o}ffn.", f"{h}mlp.")


def convert_zaya(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> ZayaLM:
    """Build a Zaya decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_zaya, device=device, dtype=dtype)
    plan.put("tok_emb.scale", "input_hidden_states_scale")
    plan.put("tok_emb.bias", "input_hidden_states_bias")
    bias = hf.req("attention_bias", bool)
    for i in range(model.depth):
        _plan_layer(plan, i, bias)
    if isinstance(model.lm_head, LMHead) and model.lm_head.bias is not None:
        prefix, plan.src.prefix = plan.src.prefix, ""
        plan.put("lm_head.bias", "lm_head.bias")
        plan.src.prefix = prefix
    return cast(ZayaLM, parts.finish(plan, model, head_size))


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"zaya": parts.Dispatch("Zaya", convert_zaya, ("ZayaForCausalLM", "ZayaModel"))}
