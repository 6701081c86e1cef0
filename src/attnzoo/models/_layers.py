"""The pieces the open-weight decoder families need on top of :class:`~attnzoo.MultiHeadAttention`:
QK-norm (per head: Qwen 3; over all heads flattened: OLMo 2), an attention-logit softcap
(Gemma 2) and RoPE with Hugging Face's scaling types (``linear``, ``dynamic``, ``yarn``,
``llama3``, ``longrope``, from :mod:`attnzoo.nn.rope_scaling`).

They are built by :class:`~attnzoo.DecoderLM` from its config (``qk_norm``, ``attn_softcap``,
``rope_parameters``); the softmax itself still goes through the attend seam.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.blocks import RMSNorm
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.positional import RotaryEmbedding
from attnzoo.nn.rope_scaling import ROPE_SCALINGS, rope_inv_freq

__all__ = ["QK_NORMS", "DecoderAttention", "QKNormLinear", "ScaledRotaryEmbedding", "build_decoder_attention"]

#: ``qk_norm`` settings: RMSNorm over each head's ``D`` channels, or over all heads' ``H * D``.
QK_NORMS = ("head", "all")


class QKNormLinear(nn.Linear):
    """The fused ``qkv_proj`` (rows ``[q; k; v]``) followed by RMSNorm of the queries and keys.

    Args:
        dim: input width ``C``.
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv``, ``D``.
        mode: ``"head"`` (``q_norm``/``k_norm`` of width ``D``, shared by the heads) or ``"all"``
            (widths ``H * D`` and ``Hkv * D``).
        eps: RMSNorm epsilon.

    Weights: ``weight [(H + 2 Hkv) D, C]``, ``bias``, ``q_norm.weight``, ``k_norm.weight``.
    Shapes: ``[B, N, C] -> [B, N, (H + 2 Hkv) D]``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, mode: str, eps: float,
                 bias: bool, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, device=device, dtype=dtype)
        if mode not in QK_NORMS:
            raise ValueError(f"QKNormLinear: mode must be one of {list(QK_NORMS)}, got {mode!r}")
        self.mode, self.heads, self.kv_heads, self.head_dim = mode, num_heads, num_kv_heads, head_dim
        wq, wk = (head_dim, head_dim) if mode == "head" else (num_heads * head_dim, num_kv_heads * head_dim)
        self.q_norm = RMSNorm(wq, eps, device=device, dtype=dtype)
        self.k_norm = RMSNorm(wk, eps, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        D = self.head_dim
        q, k, v = super().forward(x).split((self.heads * D, self.kv_heads * D, self.kv_heads * D), dim=-1)
        if self.mode == "head":
            q = self.q_norm(q.unflatten(-1, (self.heads, D))).flatten(-2)  # [B, N, H * D]
            k = self.k_norm(k.unflatten(-1, (self.kv_heads, D))).flatten(-2)  # [B, N, Hkv * D]
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        return torch.cat((q, k, v), dim=-1)


class DecoderAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` with QK-norm and an attention-logit softcap.

    Args:
        dim, num_heads: as :class:`MultiHeadAttention` (and every one of its keywords).
        qk_norm: ``None``, ``"head"`` or ``"all"`` (see :class:`QKNormLinear`; before RoPE).
        qk_norm_eps: its RMSNorm epsilon.
        softcap: scores become ``softcap * tanh(scores / softcap)`` (after the scale).

    Shapes: ``[B, N, C] -> [B, N, C]``.
    """

    def __init__(self, dim: int, num_heads: int, *, qk_norm: str | None = None, qk_norm_eps: float = 1e-6,
                 softcap: float | None = None, **kw: Any) -> None:
        super().__init__(dim, num_heads, **kw)
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                    or not softcap > 0):
            raise ValueError(f"DecoderAttention: softcap must be a positive float or None, got {softcap!r}")
        self.softcap = None if softcap is None else float(softcap)
        self.qk_norm = qk_norm
        if qk_norm is not None:
            old = self.qkv_proj
            self.qkv_proj = QKNormLinear(self.dim, self.num_heads, self.num_kv_heads, self.head_dim, mode=qk_norm,
                                         eps=qk_norm_eps, bias=old.bias is not None, device=old.weight.device,
                                         dtype=old.weight.dtype)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Any:
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        return super().attend(q, k, v, **kw)


def build_decoder_attention(dim: int, num_heads: int, **kw: Any) -> nn.Module:
    """A :class:`DecoderAttention` (the factory :class:`~attnzoo.DecoderLM` hands its blocks)."""
    return DecoderAttention(dim, num_heads, **kw)


class ScaledRotaryEmbedding(RotaryEmbedding):
    """RoPE with a Hugging Face ``rope_parameters`` dict (``rope_type`` ``default``, ``linear``,
    ``dynamic``, ``yarn``, ``llama3`` or ``longrope`` and their keys; see
    :func:`attnzoo.nn.rope_scaling.rope_inv_freq`).

    The inverse frequencies follow the positions of each call, as transformers' rotary module:
    ``dynamic`` grows the base once ``max(positions) + 1`` passes ``max_position_embeddings``;
    ``longrope`` switches to ``long_factor`` past ``original_max_position_embeddings``. cos/sin
    are multiplied by the type's attention scaling (``yarn``, ``longrope``).

    Args:
        dim: head dimension ``D``.
        rope_parameters: the dict (``rope_theta`` is the base).
        max_position_embeddings: the model's trained length (``dynamic``; ``yarn``/``longrope``
            without ``factor``).
        rotary_dim: rotated channels (partial rotary); default ``dim``.

    Shapes: as :class:`RotaryEmbedding`.
    """

    def __init__(self, dim: int, rope_parameters: Mapping[str, Any], *, max_position_embeddings: int | None = None,
                 rotary_dim: int | None = None) -> None:
        params = dict(rope_parameters)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ROPE_SCALINGS:
            raise ValueError(f"ScaledRotaryEmbedding: rope_type must be one of {sorted(ROPE_SCALINGS)}, "
                             f"got {rope_type!r}")
        super().__init__(dim, base=float(params.get("rope_theta") or 10000.0), rotary_dim=rotary_dim)
        self.rope_type, self.rope_parameters, self.max_position_embeddings = rope_type, params, max_position_embeddings
        inv, self.attention_scaling = self._scaled(None, torch.device("cpu"))
        self._inv_freq64 = inv.double()
        self._scaled_cache: dict[tuple[Any, torch.device], Tensor] = {}

    def _scaled(self, seq_len: int | None, device: torch.device) -> tuple[Tensor, float]:
        return rope_inv_freq(self.rope_parameters, self.rotary_dim, max_position_embeddings=self.max_position_embeddings,
                             seq_len=seq_len, device=device)

    def _key(self, seq_len: int) -> Any:
        """What the frequencies depend on at ``seq_len`` (None: nothing)."""
        if self.rope_type == "dynamic":
            return max(seq_len, self.max_position_embeddings or 0)
        if self.rope_type == "longrope":
            return seq_len > int(self.rope_parameters.get("original_max_position_embeddings") or 0)
        return None

    def switches_at(self, length: int) -> bool:
        """Whether a sequence growing to ``length`` tokens moves ``longrope`` from its short to
        its long factors (then the keys already rotated should be rotated again)."""
        if self.rope_type != "longrope":
            return False
        return length == int(self.rope_parameters.get("original_max_position_embeddings") or 0) + 1

    def angles(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        seq_len = int(positions.max()) + 1 if positions.numel() else 1
        key = (self._key(seq_len), positions.device)
        inv = self._scaled_cache.get(key)
        if inv is None:
            inv = self._scaled(seq_len if key[0] is not None else None, positions.device)[0]
            if len(self._scaled_cache) > 8:  # dynamic grows one length at a time while decoding
                self._scaled_cache.clear()
            self._scaled_cache[key] = inv
        return positions.to(dtype).unsqueeze(-1) * inv.to(dtype)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        cos, sin = super().cos_sin(positions, dtype)
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rope_type={self.rope_type!r}, base={self.base}"
