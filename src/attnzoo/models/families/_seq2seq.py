"""What the encoder-decoder families of BART's lineage share (``bart.py``: BART / mBART / PLBART,
``marian.py``: Marian / Pegasus, ``m2m_100.py``: M2M100 / NLLB, ``whisper.py``): the encoder layer
that transformers clamps in float16, the half-split sinusoidal table of Whisper and fairseq, and the
weight map of one layer in BART's layout (``self_attn``, ``encoder_attn``, ``fc1`` / ``fc2`` and
their norms), each written once."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_bool, check_int
from attnzoo.blocks import BlockConfig, BlockLayers, TransformerBlock
from attnzoo.models.hf._state import HFConfig, Plan, load_qkv_into

__all__ = ["ACTIVATIONS", "Float16ClampedBlock", "PartlyBiasedLinear", "clamp_float16", "config_token", "put_layer",
           "split_sinusoids", "tied_source"]

#: ``activation_function`` of these families -> :class:`~attnzoo.FeedForward` activation
ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu"}


def config_token(value: object, vocab_size: int | None = None) -> int | None:
    """A special token id of a config as :class:`~attnzoo.EncoderDecoder` keeps it: an int ``>= 0``
    (below ``vocab_size`` when given), or the one entry of such a list; ``None`` otherwise (several
    end tokens: pass ``eos_token_id`` to ``generate``)."""
    if isinstance(value, list):
        value = value[0] if len(value) == 1 else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return None
    return value if vocab_size is None or value < vocab_size else None


def tied_source(hf: HFConfig, sd: Mapping[str, Tensor], keys: Sequence[str]) -> str:
    """The checkpoint key a tied embedding is read from: the first of ``keys`` (``shared``, the stacks'
    ``embed_tokens``, ``lm_head``: copies of one matrix) the state dict holds, ``keys[0]`` when it holds
    none (then reported missing). Copies that differ are refused by name (transformers would untie
    them; reading one would silently change the model)."""
    present = [k for k in keys if k in sd]
    if not present:
        return keys[0]
    first = sd[present[0]]
    for key in present[1:]:
        if sd[key] is not first and (sd[key].shape != first.shape or not torch.equal(sd[key], first)):
            raise hf.unsupported(f"tie_word_embeddings=True with tied copies that differ ({present[0]} vs {key}; "
                                 f"transformers then unties them)")
    return present[0]


def clamp_float16(x: Tensor, *, always: bool) -> Tensor:
    """transformers' float16 guard of these families' encoder layers: in float16, clamp ``x`` to
    ``±(finfo.max - 1000)`` — ``always`` (mBART, Pegasus, M2M100, Whisper) or only when some value is
    not finite (BART, PLBART, Marian; otherwise ``±finfo.max``, a no-op on finite values; NaN stays
    NaN). Other dtypes: unchanged; no host sync. Shapes: any."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(torch.float16).max
    if always:
        return torch.clamp(x, -(top - 1000.0), top - 1000.0)
    limit = torch.where(torch.isfinite(x).all(), top, top - 1000.0)  # 0-dim: no host sync
    return torch.clamp(x, -limit, limit)


class Float16ClampedBlock(TransformerBlock):
    """A :class:`~attnzoo.TransformerBlock` (either norm placement) whose output goes through
    :func:`clamp_float16` (a no-op outside float16): the encoder layer of BART's lineage.

    Build it as the block (from ``layers`` or a ``config``), plus ``always``:
    ``Float16ClampedBlock(C, layers=BlockLayers(...), always=False)``.
    Shapes: ``x [B, N, C] -> [B, N, C]``; the other arguments as :meth:`TransformerBlock.forward`.
    """

    def __init__(self, dim: int | None = None, *, always: bool, layers: BlockLayers | None = None,
                 config: BlockConfig | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, layers=layers, config=config, device=device, dtype=dtype)
        self.always = check_bool(always, "always", "Float16ClampedBlock")

    #: a packed batch (``cu_seqlens``) is taken: :attr:`~attnzoo.TransformerEncoder.packable` reads it
    takes_packed = True

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None,
                key_padding: Tensor | None = None, context_mask: Any = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None,
                context_cu_seqlens: Tensor | None = None) -> Tensor:
        """As :meth:`~attnzoo.TransformerBlock.forward`, the output clamped. Packed sequences
        (``cu_seqlens``) run in any dtype when ``always`` (an elementwise clamp), else not in float16
        (``ValueError``): that clamp's limit depends on whether any value of the whole batch overflowed,
        padding included, which a packed batch does not hold."""
        if cu_seqlens is not None and not self.always and isinstance(x, Tensor) and x.dtype == torch.float16:
            raise ValueError("Float16ClampedBlock: packed input (cu_seqlens) is not taken in float16 with always=False "
                             "(BART, PLBART, Marian): the clamp looks at the whole batch (padding included), which "
                             "packing cannot reproduce; run the model in float32 or bfloat16, or pad the batch")
        out = super().forward(x, context, mask=mask, key_padding=key_padding, context_mask=context_mask,
                              cache=cache, positions=positions, cu_seqlens=cu_seqlens,
                              context_cu_seqlens=context_cu_seqlens)
        return clamp_float16(out, always=self.always)  # [B, N, C]

    def extra_repr(self) -> str:
        return f"always={self.always}"


class PartlyBiasedLinear(nn.Module):
    """A fused projection ``y = x W^T + b`` whose output rows ``[lo, hi)`` have no bias: ``b`` is
    ``bias_kept`` with zeros inserted there (Whisper's key projection, which has no bias where its
    query and value projections have one). The zeros are not parameters, so training cannot move
    them and the model stays a conversion of its checkpoint (:func:`~attnzoo.interop.to_hf`).

    Args:
        in_features, out_features: ``C_in``, ``C_out``.
        unbiased: ``(lo, hi)``, the output rows without a bias (``0 <= lo < hi <= C_out``).

    Weights: ``weight [C_out, C_in]``, ``bias_kept [C_out - (hi - lo)]``; ``bias`` (read-only) the
    full ``[C_out]`` bias. Shapes: ``[..., C_in] -> [..., C_out]``.
    """

    def __init__(self, in_features: int, out_features: int, *, unbiased: tuple[int, int],
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = "PartlyBiasedLinear"
        self.in_features = check_int(in_features, "in_features", owner)
        self.out_features = check_int(out_features, "out_features", owner)
        lo, hi = unbiased
        if not (0 <= check_int(lo, "unbiased[0]", owner, minimum=0) < check_int(hi, "unbiased[1]", owner)
                <= out_features):
            raise ValueError(f"{owner}: unbiased must be rows (lo, hi) with 0 <= lo < hi <= {out_features}, "
                             f"got {unbiased}")
        self.unbiased = (lo, hi)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias_kept = nn.Parameter(torch.zeros(out_features - (hi - lo), device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    @property
    def bias(self) -> Tensor:
        """The full bias ``[C_out]``, zeros on the unbiased rows."""
        lo, hi = self.unbiased
        b = self.bias_kept
        return torch.cat([b[:lo], b.new_zeros(hi - lo), b[lo:]])

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)  # [..., C_out]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, unbiased={self.unbiased}"


def split_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> Tensor:
    """The sinusoidal table of Whisper's encoder and of fairseq (M2M100 / NLLB), float32
    ``[length, channels]``: row ``p`` holds ``sin(p * w_i)`` in its first ``channels / 2`` columns and
    ``cos(p * w_i)`` in the others, ``w_i = max_timescale ** (-i / (channels / 2 - 1))`` — not the
    interleaved table of :class:`~attnzoo.nn.positional.SinusoidalPositionalEncoding`, nor Marian's
    (``-i / (channels / 2)``). ``channels`` even and ``>= 4``."""
    check_int(length, "length", "split_sinusoids")
    check_int(channels, "channels", "split_sinusoids")
    if channels % 2 or channels < 4:
        raise ValueError(f"split_sinusoids: channels must be even and >= 4, got {channels}")
    half = channels // 2
    inv = torch.exp(-math.log(max_timescale) / (half - 1) * torch.arange(half, dtype=torch.float32))  # [C/2]
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]  # [L, C/2]
    return torch.cat([t.sin(), t.cos()], dim=1)  # [L, C]


def _put_attention(plan: Plan, ours: str, theirs: str, *, cross: bool, key_bias: bool) -> None:
    """``{theirs}{q,k,v,out}_proj`` into a self-attention's fused ``qkv_proj`` or a cross-attention's
    ``q_proj`` + ``kv_proj`` (rows ``[k; v]``), and ``out_proj``; without ``key_bias`` (Whisper) the
    key's bias rows are zeros."""
    w = [f"{theirs}{n}_proj.weight" for n in "qkv"]
    b = [f"{theirs}{n}_proj.bias" for n in "qkv"]
    if key_bias and not cross:
        load_qkv_into(plan, ours, tuple(w), tuple(b), True)  # type: ignore[arg-type]
    elif key_bias:
        plan.put_pairs(f"{ours}.", theirs, [("q_proj", "q_proj")])
        plan.put_cat(f"{ours}.kv_proj.weight", w[1:])
        plan.put_cat(f"{ours}.kv_proj.bias", b[1:])
    else:
        _put_without_key_bias(plan, ours, theirs, cross)
    plan.put_pairs(f"{ours}.", theirs, [("out_proj", "out_proj")])


def _put_without_key_bias(plan: Plan, ours: str, theirs: str, cross: bool) -> None:
    """Onto :class:`PartlyBiasedLinear` projections: the query and value biases only."""
    w = [f"{theirs}{n}_proj.weight" for n in "qkv"]
    if cross:
        plan.put_pairs(f"{ours}.", theirs, [("q_proj", "q_proj")])
        plan.put_cat(f"{ours}.kv_proj.weight", w[1:])
        plan.put(f"{ours}.kv_proj.bias_kept", f"{theirs}v_proj.bias")
    else:
        plan.put_cat(f"{ours}.qkv_proj.weight", w)
        plan.put_cat(f"{ours}.qkv_proj.bias_kept", [f"{theirs}q_proj.bias", f"{theirs}v_proj.bias"])


def put_layer(plan: Plan, ours: str, theirs: str, *, cross: bool, key_bias: bool = True) -> None:
    """One layer in BART's layout onto a :class:`~attnzoo.TransformerBlock` (``ours``, ``theirs``:
    prefixes ending in ``.``): ``self_attn`` -> ``attn``, ``self_attn_layer_norm`` -> ``attn_norm``,
    ``fc1`` / ``fc2`` -> ``ffn.up_proj`` / ``ffn.down_proj``, ``final_layer_norm`` -> ``ffn_norm``,
    and with ``cross`` (a decoder layer) ``encoder_attn`` -> ``cross_attn``,
    ``encoder_attn_layer_norm`` -> ``cross_norm``. ``key_bias=False``: the checkpoint's key
    projections have no bias (Whisper: the attention's fused projections are
    :class:`PartlyBiasedLinear`)."""
    _put_attention(plan, f"{ours}attn", f"{theirs}self_attn.", cross=False, key_bias=key_bias)
    pairs = [("attn_norm", "self_attn_layer_norm"), ("ffn_norm", "final_layer_norm"), ("ffn.up_proj", "fc1"),
             ("ffn.down_proj", "fc2")]
    if cross:
        _put_attention(plan, f"{ours}cross_attn", f"{theirs}encoder_attn.", cross=True, key_bias=key_bias)
        pairs.append(("cross_norm", "encoder_attn_layer_norm"))
    plan.put_pairs(ours, theirs, pairs)
