"""Gemma 3n (text) -> :class:`~attnzoo.DecoderLM`: ``Gemma3nForCausalLM`` and ``Gemma3nTextModel``
(``model_type="gemma3n_text"``); and the Gemma 4 unified text decoder built from Gemma 3n's and
Gemma 4's parts, ``Gemma4UnifiedForCausalLM`` and ``Gemma4UnifiedTextModel``
(``model_type="gemma4_unified_text"``, at the end). The multimodal models (``model_type`` ``"gemma3n"``,
``"gemma4_unified"``) are not converted.

Line numbers: transformers 5.25, ``models/gemma3n/modeling_gemma3n.py`` (m.) and
``configuration_gemma3n.py`` (c.). Gemma 3n's decoder is Gemma 4's text decoder
(``families/gemma4.py``: its attention with the q/k/v norms and scale 1, its KV sharing across the
last layers and its per-layer embeddings are reused as they are) without Gemma 4's layer scalar,
keys-as-values, MoE and per-type head widths, and with four parts of its own:

* **AltUp** (``Gemma3nTextAltUp``, m. 976-1072; :class:`AltUp`): the residual is ``K =
  altup_num_inputs`` streams ``[K, B, N, C]``. The embeddings make them (m. 1681-1693,
  :class:`AltUpStreams`): stream 0 is the scaled embeddings ``e``, stream ``j`` is
  ``altup_projections[j-1](e)`` rescaled to the RMS of ``e`` (its own RMS clamped at ``1e-5 ** 0.5``);
  after the last layer the same with ``altup_unembed_projections`` and the RMS of stream 0, then the
  mean of the streams (m. 1717-1731). Each layer *predicts* the streams ``s_i + sum_j P_ij s_j``, with
  ``P [K, K]`` per token from ``prediction_coefs`` of the *modalities* ``tanh(router(norm(s_a) / C))``
  (float32) of the active stream ``a = altup_active_idx``; runs its attention and MLP on the active
  prediction; then *corrects* every prediction: ``p_i + (y - p_a) (1 + correction_coefs(m(y)))_i``
  with ``y`` the layer's output. In training ``altup_coef_clip`` clamps ``prediction_coefs`` in
  place and ``correction_coefs`` where used (m. 1016, 1047-1050), as transformers does.
* **LAuReL** (``Gemma3nTextLaurelBlock``, m. 920-935; :class:`Laurel`): beside the attention,
  ``n + norm(right(left(n)))`` of the normed active prediction ``n`` (rank ``laurel_rank``); the
  layer adds it to the attention's residual sum and divides by ``sqrt(2)`` (m. 1282-1300).
* **Activation sparsity** (``Gemma3nTextMLP``, m. 938-973; :class:`SparseGatedMLP`): on a layer
  with ``activation_sparsity_pattern[i] = s > 0`` the gate's pre-activations ``g [.., F]`` become
  ``relu(g - mean(g) - std(g) * Phi^-1(s))`` over ``F`` (population std; ``Phi^-1`` the standard
  normal quantile, computed in float32 by ``torch.distributions.Normal.icdf`` and cast to ``g``'s
  dtype). ``intermediate_size`` may be one width per layer.
* **Per-layer inputs** (m. 1308-1320): Gemma 4's PLE (:class:`~attnzoo.models.families.gemma4.PerLayerEmbedding`,
  ids outside ``[0, vocab_size_per_layer_input)`` read as 0, m. 1738-1745), but the layer's update
  ``norm(proj(act(gate(x)) * p))`` reads the corrected active stream (times
  ``altup.correct_output_scale`` with ``altup_correct_scale``) and is added to streams ``1 ..`` (not
  stream 0, whatever the active index). ``hidden_size_per_layer_input = 0`` adds nothing (no PLE here).

The rest: norms ``weight * x / sqrt(mean(x^2) + eps)`` applied in float32 (``Gemma3nRMSNorm``,
m. 118-139; :class:`~attnzoo.models.families._common.Float32ScaleRMSNorm`), on both sides of both
sub-layers; embeddings times ``sqrt(C)`` rounded to the weight's dtype; attention as Gemma 4's
(:class:`~attnzoo.models.families.gemma4.Gemma4Attention`, m. 1150-1245): scale 1, q/k RMSNorm
per head, a value RMSNorm without weight, a window of ``sliding_window - 1`` keys on
``sliding_attention`` layers (by default every 5th layer is ``full_attention``, c. 139-142); RoPE per
layer type (``rope_parameters[type]``, c. 176-204: ``default`` over the whole head whatever
``partial_rotary_factor`` says, ``proportional`` as Gemma 4's, the scaled types of
:func:`~attnzoo.models.families._common.rotary`); KV sharing over the last ``num_kv_shared_layers``
layers (default 15; c. 205-236) as Gemma 4's; the final-logit softcap (default 30).

Refused by name: ``altup_active_idx`` outside ``[0, altup_num_inputs)``, a
``partial_rotary_factor`` other than 1 on a scaled rope type (transformers' rotary tables would not fit
the heads), rope types attnzoo has not, ``num_kv_shared_layers`` that leaves a reading layer's type
without an earlier layer computing its keys, a non-gated activation.

**Gemma 4 unified text** (``models/gemma4_unified/modeling_gemma4_unified.py`` (u.) and its
``configuration_gemma4_unified.py``): Gemma 4's text decoder (:func:`~attnzoo.models.families.gemma4.build_gemma4`)
without per-layer embeddings and without the MoE block -- Gemma 3n's RMSNorm (u. 156-174, the same
arithmetic as Gemma 4's), Gemma 4's attention with keys-as-values and per-type head widths
(``per_layer_config``), KV sharing with the double-wide MLP, the layer scalar, proportional RoPE on
the full layers (u. 177-245, 323-433, 455-504). Its defaults differ from Gemma 4's: ``sliding_window``
1024, ``max_position_embeddings`` 262144 (:data:`UNIFIED_DEFAULTS`). Refused by name as in Gemma 4
(``use_bidirectional_attention="all"``, rope types other than ``default`` / ``proportional``,
``per_layer_config`` keys other than the head width and KV heads), and ``num_kv_shared_layers`` equal to
the depth (every layer reusing keys that only an assistant's target model supplies, configuration 196-197).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.gemma4 as gemma4
from attnzoo.blocks import ACTIVATIONS, BlockLayers, FeedForward, RMSNorm, TransformerBlock
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.gemma4 import (
    NORMS,
    TYPES,
    Gemma4Attention,
    Gemma4Embedding,
    KVSharing,
    PerLayerEmbedding,
    PerLayerInput,
    SharedKV,
    sharing_roles,
)
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.loop import StreamsLM
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.attention import build_softmax

__all__ = ["DEFAULTS", "DISPATCH", "UNIFIED_DEFAULTS", "AltUp", "AltUpStreams", "Gemma3nBlock", "Gemma3nLM",
           "Gemma3nPerLayerEmbedding", "Laurel", "SparseGatedMLP", "build_gemma3n", "build_gemma4_unified", "canonical",
           "convert_gemma3n", "convert_gemma4_unified"]

#: ``Gemma3nTextConfig``'s defaults of the keys read here (c. 95-126), for a ``config.json`` that
#: leaves them out (``layer_types``, ``rope_parameters``, ``activation_sparsity_pattern``: :func:`canonical`)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_400, "hidden_size": 2048, "intermediate_size": 16_384, "num_hidden_layers": 35,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "attention_dropout": 0.0, "sliding_window": 512, "final_logit_softcapping": 30.0,
    "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256, "altup_active_idx": 0,
    "altup_coef_clip": 120.0, "altup_correct_scale": True, "altup_num_inputs": 4, "num_kv_shared_layers": 15,
    "laurel_rank": 64,
}
#: ``convert_rope_params_to_dict``'s rope bases (c. 117, 176-204): full layers 1M, sliding 10k
DEFAULT_THETA = {"full_attention": ("rope_theta", 1_000_000.0), "sliding_attention": ("rope_local_base_freq", 10_000.0)}


# --------------------------------------------------------------------------- the layer's parts
class SparseGatedMLP(FeedForward):
    """The gated MLP ``down(act(g) * up(x))`` of a Gemma 3n layer (m. 938-973), with activation
    sparsity ``sparsity > 0``: ``g = relu(gate(x) - mean - std * Phi^-1(sparsity))`` over the hidden
    width (population std; the quantile in float32, cast to ``x``'s dtype, as transformers'). Weights
    as :class:`~attnzoo.blocks.FeedForward` (gated, no biases).

    Shapes: ``[..., C] -> [..., C]``."""

    def __init__(self, dim: int, hidden: int, activation: str, *, sparsity: float, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, hidden, activation, bias=False, device=device, dtype=dtype)
        if not self.gated:
            raise ValueError(f"SparseGatedMLP: a gated activation is needed, got {activation!r}")
        self.sparsity = float(sparsity)
        std = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(self.sparsity, dtype=torch.float32))
        self.cutoff: float | None = float(std) if self.sparsity > 0 else None

    def forward(self, x: Tensor) -> Tensor:
        if self.cutoff is None:
            return super().forward(x)
        assert self.gate_proj is not None
        g = self.gate_proj(x)  # [.., F]
        std = torch.std(g, dim=-1, keepdim=True, unbiased=False)
        g = F.relu(g - (g.mean(dim=-1, keepdim=True) + std * torch.tensor(self.cutoff, dtype=g.dtype, device=g.device)))
        return self.down_proj(self.dropout(self.act(g) * self.up_proj(x)))  # [.., C]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sparsity={self.sparsity:g}"


class Laurel(nn.Module):
    """LAuReL, the learned augmented residual (m. 920-935): ``x + norm(right(left(x)))``. Weights:
    ``left [R, C]``, ``right [C, R]``, ``norm [C]``.

    Shapes: ``[..., C] -> [..., C]``."""

    def __init__(self, dim: int, rank: int, eps: float, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.left = nn.Linear(dim, rank, bias=False, device=device, dtype=dtype)
        self.right = nn.Linear(rank, dim, bias=False, device=device, dtype=dtype)
        self.norm = RMSNorm(dim, eps, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.norm(self.right(self.left(x)))


class AltUp(nn.Module):
    """One layer's AltUp (m. 976-1072) over ``K`` streams with the active one ``active``: the
    prediction before the layer, the correction after it, the optional output scale of the corrected
    active stream (``correct_scale``). ``clip``: ``altup_coef_clip``, applied in training only.
    Weights: ``correct_output_scale [C]``, ``correction_coefs [K, K]``, ``prediction_coefs [K K, K]``,
    ``modality_router [K, C]``, ``router_norm [C]``.

    Shapes: ``predict([K, B, N, C]) -> [K, B, N, C]``; ``correct([K, B, N, C], [B, N, C]) -> [K, B, N, C]``.
    """

    def __init__(self, dim: int, streams: int, active: int, eps: float, *, clip: float | None, correct_scale: bool,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"bias": False, "device": device, "dtype": dtype}
        self.dim, self.streams, self.active = dim, streams, active
        self.clip, self.correct_scale = None if clip is None else float(clip), bool(correct_scale)
        self.correct_output_scale = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        self.correction_coefs = nn.Linear(streams, streams, **kw)
        self.prediction_coefs = nn.Linear(streams, streams * streams, **kw)
        self.modality_router = nn.Linear(dim, streams, **kw)
        self.router_norm = RMSNorm(dim, eps, device=device, dtype=dtype)

    def modalities(self, x: Tensor) -> Tensor:
        """``tanh(router(norm(x) / C))`` (the tanh in float32 at least): ``[B, N, C] -> [B, N, K]``."""
        routed = self.modality_router(self.router_norm(x) * self.dim ** -1.0)
        return torch.tanh(routed.to(torch.promote_types(routed.dtype, torch.float32))).to(x.dtype)

    def predict(self, streams: Tensor) -> Tensor:
        """``s_i + sum_j P_ij s_j`` per token, ``P`` from the active stream's modalities."""
        m = self.modalities(streams[self.active])  # [B, N, K]
        if self.training and self.clip is not None:
            self.prediction_coefs.weight.data.clamp_(-self.clip, self.clip)  # in place, as transformers (m. 1016)
        K = self.streams
        coefs = self.prediction_coefs(m).unflatten(-1, (K, K)).transpose(-1, -2)  # [B, N, j, i] = P_ij
        return torch.matmul(streams.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2) + streams  # [K, B, N, C]

    def correct(self, predictions: Tensor, activated: Tensor) -> Tensor:
        """Every prediction plus the active one's innovation ``activated - p_a`` times ``1 + c_i``."""
        w = self.correction_coefs.weight
        if self.training and self.clip is not None:
            w = w.clamp(-self.clip, self.clip)
        coefs = F.linear(self.modalities(activated), w) + 1.0  # [B, N, K]
        innovation = activated - predictions[self.active]  # [B, N, C]
        return innovation * coefs.permute(2, 0, 1).unsqueeze(-1) + predictions  # [K, B, N, C]

    def scale_output(self, x: Tensor) -> Tensor:
        """The corrected active stream ``[B, N, C]`` times ``correct_output_scale`` (with ``correct_scale``)."""
        if not self.correct_scale:
            return x
        return (x.to(self.correct_output_scale.dtype) * self.correct_output_scale).to(x.dtype)

    def extra_repr(self) -> str:
        return f"streams={self.streams}, active={self.active}, clip={self.clip}, correct_scale={self.correct_scale}"


class Gemma3nPerLayerEmbedding(PerLayerEmbedding):
    """Gemma 4's per-layer inputs with Gemma 3n's lookup (m. 1738-1745): ids outside the per-layer
    vocabulary read row 0. Shapes: ``tokens [B, N]``, ``e [B, N, C]`` -> ``[B, N, L, P]``."""

    def forward(self, tokens: Tensor, e: Tensor) -> Tensor:
        inside = (tokens >= 0) & (tokens < self.embed.num_embeddings)
        return super().forward(torch.where(inside, tokens, 0), e)


class AltUpStreams(nn.Module):
    """The ``K`` streams from the embeddings and back (m. 1681-1693, 1717-1731): ``up[j-1]`` /
    ``down[j-1]`` (``[C, C]`` each) make / read stream ``j >= 1``, each rescaled to stream 0's RMS.

    Shapes: ``spread([B, N, C]) -> [K, B, N, C]``; ``merge([K, B, N, C]) -> [B, N, C]`` (the mean)."""

    def __init__(self, dim: int, streams: int, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.streams = streams
        self.up = nn.ModuleList(nn.Linear(dim, dim, bias=False, device=device, dtype=dtype) for _ in range(streams - 1))
        self.down = nn.ModuleList(nn.Linear(dim, dim, bias=False, device=device, dtype=dtype)
                                  for _ in range(streams - 1))

    @staticmethod
    def _rescaled(x: Tensor, target: Tensor) -> Tensor:
        return x * target / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))

    def spread(self, x: Tensor) -> Tensor:
        target = torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5  # [B, N, 1]
        return torch.stack([x, *(self._rescaled(p(x), target) for p in self.up)])

    def merge(self, streams: Tensor) -> Tensor:
        target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        rest = (self._rescaled(p(s), target) for p, s in zip(self.down, streams[1:], strict=True))
        return torch.mean(torch.stack([streams[0], *rest]), dim=0)


class Gemma3nBlock(TransformerBlock):
    """One Gemma 3n layer (m. 1248-1323) on the streams: AltUp's prediction, the pre/post-normed
    attention (its parts and norms are the :class:`TransformerBlock`'s) with LAuReL beside it, the
    pre/post-normed MLP, AltUp's correction, then the per-layer update on streams ``1 ..``.

    Shapes: ``streams [K, B, N, C]``, ``per_layer_input [B, N, P]`` -> ``[K, B, N, C]``."""

    def __init__(self, dim: int, layers: BlockLayers, *, altup: AltUp, laurel: Laurel,
                 per_layer: PerLayerInput | None) -> None:
        super().__init__(dim, layers=layers)
        self.altup, self.laurel, self.per_layer = altup, laurel, per_layer

    def forward(self, streams: Tensor, per_layer_input: Tensor | None = None, *,  # type: ignore[override]
                key_padding: Tensor | None = None, cache: Any = None, positions: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """``key_padding``, ``cache``, ``positions``, ``cu_seqlens``: as :meth:`TransformerBlock.forward`."""
        if streams.dim() != 4 or streams.shape[0] != self.altup.streams or streams.shape[-1] != self.dim:
            raise ValueError(f"Gemma3nBlock: streams must be [{self.altup.streams}, B, N, {self.dim}], "
                             f"got {tuple(streams.shape)}")
        predictions = self.altup.predict(streams)
        active = predictions[self.altup.active]  # [B, N, C]
        normed = self.attn_norm(active)
        mixed = self._mix(normed, self._self_mask(None, key_padding), cache, positions, cu_seqlens)
        h = (active + self.attn_out_norm(mixed) + self.laurel(normed)) / math.sqrt(2)
        assert self.ffn is not None and self.ffn_norm is not None
        h = h + self.ffn_out_norm(self.ffn(self.ffn_norm(h)))
        out = self.altup.correct(predictions, h)  # [K, B, N, C]
        if self.per_layer is None:
            return out
        if per_layer_input is None:
            raise ValueError("Gemma3nBlock: this layer has per-layer inputs (PLE); pass per_layer_input [B, N, P]")
        update = self.per_layer(self.altup.scale_output(out[self.altup.active]), per_layer_input)
        return torch.cat([out[:1], out[1:] + update])


class Gemma3nLM(StreamsLM):
    """The Gemma 3n decoder: a :class:`~attnzoo.models.loop.StreamsLM` of :class:`Gemma3nBlock`
    layers over AltUp's streams (``altup``, an :class:`AltUpStreams`), handing layer ``i`` its
    per-layer input (``per_layer``, or ``None`` without PLE); packed input runs through the layers
    whole (the KV-sharing layers take the packed row's keys)."""

    packs = True

    def __init__(self, *, per_layer: PerLayerEmbedding | None, altup: AltUpStreams, config: DecoderConfig,
                 parts: DecoderParts, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(streams=altup.streams, config=config, parts=parts, device=device, dtype=dtype)
        self.per_layer, self.altup = per_layer, altup

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x`` the scaled embeddings ``[B, N, C]``; returns the merged streams ``[B, N, C]``."""
        positions = self.rotary_positions(positions, key_padding, past, x.shape[1], x.device, cu_seqlens)
        ple = None if self.per_layer is None else self.per_layer(tokens, x)  # [B, N, L, P]
        streams = self.altup.spread(x)  # [K, B, N, C]
        for i, block in enumerate(self.blocks):
            streams = block(streams, None if ple is None else ple[:, :, i], key_padding=key_padding,
                            cache=None if cache is None else cache[i], positions=positions, cu_seqlens=cu_seqlens)
        return self.altup.merge(streams)


# --------------------------------------------------------------------------- the config
def _rope_parameters(hf: HFConfig) -> dict[str, Any]:
    """``rope_parameters`` as ``convert_rope_params_to_dict`` makes them (c. 176-204): one dict per
    layer type, ``rope_scaling`` folded into the full layers', the legacy bases as defaults."""
    given = hf.get("rope_parameters", None, dict)
    rope = {k: dict(v) for k, v in (given or {}).items() if isinstance(v, dict)}
    if given is None and hf.get("rope_scaling", None, dict) is not None:
        rope.setdefault("full_attention", {"rope_type": "default"}).update(hf.req("rope_scaling", dict))
    for kind, (legacy, theta) in DEFAULT_THETA.items():
        rope.setdefault(kind, {"rope_type": "default"}).setdefault("rope_theta", hf.get(legacy, theta, float))
    return rope


def _per_layer(hf: HFConfig, key: str, depth: int, default: Any, kind: type) -> list[Any]:
    """A key given once for all layers or as one value per layer, as a list of ``depth``."""
    value = hf.raw(key, default)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * depth
    if len(values) != depth:
        raise CheckpointFormatError(f"{hf.source}: {key} has {len(values)} entries for {depth} layers")
    ok = [isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or (v == int(v) and v >= 1))
          for v in values]
    if not all(ok):
        raise CheckpointFormatError(f"{hf.source}: {key} must be {kind.__name__} per layer, got {value!r}")
    return [kind(v) for v in values]


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads a ``Gemma3nTextConfig`` (c. 128-204): :data:`DEFAULTS` where
    absent, ``intermediate_size`` and ``activation_sparsity_pattern`` one per layer (by default 0.95
    on the first 10 layers of a model deeper than 10), ``layer_types`` (every 5th layer full),
    ``rope_parameters`` per layer type."""
    out = hf.with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    out.data["intermediate_size"] = _per_layer(out, "intermediate_size", depth, None, int)
    sparse = 10 if depth > 10 else 0
    out.data["activation_sparsity_pattern"] = _per_layer(
        out, "activation_sparsity_pattern", depth, [0.95] * sparse + [0.0] * (depth - sparse), float)
    if out.get("layer_types", None, list) is None:
        out.data["layer_types"] = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(depth)]
    out.data["rope_parameters"] = _rope_parameters(out)
    return out


def _check(hf: HFConfig) -> None:
    K, active = hf.req("altup_num_inputs"), hf.get("altup_active_idx", 0)
    if K < 1 or not 0 <= active < K:
        raise hf.unsupported(f"altup_active_idx={active} with altup_num_inputs={K} (an index in [0, {K}) expected)")
    for key in ("laurel_rank", "vocab_size_per_layer_input"):
        if hf.req(key) < 1:
            raise CheckpointFormatError(f"{hf.source}: key {key!r} must be >= 1, got {hf.req(key)}")


def _rope(hf: HFConfig, layer_type: str, head_dim: int) -> nn.Module:
    """The rotary embedding of the ``layer_type`` layers (m. 1503-1562): ``default`` and
    ``proportional`` as Gemma 4's, the scaled types as :func:`~attnzoo.models.families._common.rotary`'s."""
    params = parts.rope_params(hf, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("default", "proportional"):
        return gemma4.layer_rope(hf, layer_type, head_dim)
    partial = params.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise hf.unsupported(f"rope_parameters[{layer_type!r}] partial_rotary_factor={partial} with "
                             f"rope_type={rope_type!r} (transformers' rotary table would not fit the heads)")
    return parts.rotary(hf, params, head_dim)


def _attention(hf: HFConfig, kind: str, rope: nn.Module, sharing: KVSharing | None,
               kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """A factory of one layer's :class:`~attnzoo.models.families.gemma4.Gemma4Attention` (m. 1150-1245)."""
    eps = hf.req("rms_norm_eps", float)
    window = hf.req("sliding_window") - 1 if kind == "sliding_attention" else None
    return functools.partial(
        build_softmax, Gemma4Attention, hf.req("hidden_size"), hf.req("num_attention_heads"),
        num_kv_heads=hf.req("num_key_value_heads"), head_dim=hf.req("head_dim"), bias=hf.req("attention_bias", bool),
        window=window, rope=rope, dropout=hf.get("attention_dropout", 0.0, float), qk_norm="head", qk_norm_eps=eps,
        scale=1.0, sharing=sharing, v_norm_eps=eps, **kw)


def _layer(hf: HFConfig, i: int, attention: Callable[[], nn.Module], act: str, kw: dict[str, Any]) -> Gemma3nBlock:
    """Layer ``i``: its attention (``attention``), sparse MLP, AltUp, LAuReL and per-layer update."""
    C, eps = hf.req("hidden_size"), hf.req("rms_norm_eps", float)
    P = hf.get("hidden_size_per_layer_input", 0)
    mlp = functools.partial(SparseGatedMLP, C, hf.raw("intermediate_size")[i], act,
                            sparsity=hf.req("activation_sparsity_pattern", list)[i], **kw)
    layers = BlockLayers(attention=attention, norm=parts.rms_norm(C, eps, **kw), feed_forward=mlp,
                         sublayer_norm="both")
    altup = AltUp(C, hf.req("altup_num_inputs"), hf.get("altup_active_idx", 0), eps,
                  clip=hf.get("altup_coef_clip", None, float), correct_scale=hf.get("altup_correct_scale", True, bool),
                  **kw)
    per_layer = PerLayerInput(C, P, ACTIVATIONS[act][0], eps, **kw) if P else None
    return Gemma3nBlock(C, layers, altup=altup, laurel=Laurel(C, hf.req("laurel_rank"), eps, **kw),
                        per_layer=per_layer)


def build_gemma3n(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                  dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Gemma3nTextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    _check(hf)
    V, C, depth = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    act = hf.activation("hidden_activation", parts.GATED, "gelu_pytorch_tanh")
    ropes = {t: _rope(hf, t, hf.req("head_dim")) for t in sorted(set(kinds))}
    store = SharedKV()
    blocks = []
    for i, (kind, (role, release)) in enumerate(zip(kinds, sharing_roles(hf, kinds), strict=True)):
        sharing = None if role is None else KVSharing(store, kind, role, release)
        blocks.append(_layer(hf, i, _attention(hf, kind, ropes[kind], sharing, kw), act, kw))
    P = hf.get("hidden_size_per_layer_input", 0)
    per_layer = Gemma3nPerLayerEmbedding(hf.req("vocab_size_per_layer_input"), C, depth, P, eps, **kw) if P else None
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="rope", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.req("tie_word_embeddings", bool), max_seq_len=parts.max_positions(hf))
    head = head_for(C, V, head_size, softcap=hf.get("final_logit_softcapping", None, float), **kw)
    model = Gemma3nLM(per_layer=per_layer, altup=AltUpStreams(C, hf.req("altup_num_inputs"), **kw), config=cfg,
                      parts=DecoderParts(blocks=blocks, embedding=Gemma4Embedding(V, C, scale=C ** 0.5, **kw),
                                         norm=RMSNorm(C, eps, **kw), head=head), **kw)
    return parts.float32_scale_norms(model)  # Gemma3nRMSNorm applies its weight in float32 (m. 133-136)


# --------------------------------------------------------------------------- the weights
#: the per-layer-input weights, ``(ours, theirs)``: the model's and each layer's
PLE_MODEL = [("embed", "embed_tokens_per_layer"), ("proj", "per_layer_model_projection"),
             ("norm", "per_layer_projection_norm")]
PLE_LAYER = [("gate", "per_layer_input_gate"), ("proj", "per_layer_projection"), ("norm", "post_per_layer_input_norm")]


def _put_layer(plan: Plan, block: nn.Module, i: int) -> list[str]:
    """Plan layer ``i``; returns the patterns of its checkpoint keys to ignore: a reusing layer's
    keys/values (transformers ignores them too, m. 1615-1621), the empty PLE tensors without PLE."""
    o, h = f"blocks.{i}.", f"layers.{i}."
    if not isinstance(block, Gemma3nBlock) or not isinstance(block.attn, Gemma4Attention):
        raise CheckpointFormatError(f"layer {i} is not a Gemma 3n layer ({type(block).__name__})")
    gemma4.put_attention(plan, f"{o}attn.", f"{h}self_attn.", block.attn)
    parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
    plan.put_pairs(o, h, NORMS, bias=False)
    a, t = f"{o}altup.", f"{h}altup."
    plan.put(f"{a}correct_output_scale", f"{t}correct_output_scale")
    plan.put_pairs(a, t, [(n, n) for n in ("correction_coefs", "prediction_coefs", "modality_router",
                                           "router_norm")], bias=False)
    plan.put_pairs(f"{o}laurel.", f"{h}laurel.", [("left", "linear_left"), ("right", "linear_right"),
                                                  ("norm", "post_laurel_norm")], bias=False)
    skip = [rf"(model\.)?layers\.{i}\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.\w+"] if block.attn.reuses else []
    if block.per_layer is None:
        return [*skip, rf"(model\.)?layers\.{i}\.({'|'.join(t for _, t in PLE_LAYER)})\.weight"]
    plan.put_pairs(f"{o}per_layer.", h, PLE_LAYER, bias=False)
    return skip


def convert_gemma3n(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them); see :func:`_put_layer` for
    the checkpoint keys left unread."""
    model, plan, head_size = parts.start(hf, sd, build_gemma3n, device=device, dtype=dtype)
    if not isinstance(model, Gemma3nLM):
        raise CheckpointFormatError(f"{hf.source}: not a Gemma 3n model")
    ignore = [r"(model\.)?embed_tokens(_per_layer)?\.embed_scale",
              *(p for i, block in enumerate(model.blocks) for p in _put_layer(plan, block, i))]
    for j in range(model.altup.streams - 1):
        plan.put(f"altup.up.{j}.weight", f"altup_projections.{j}.weight")
        plan.put(f"altup.down.{j}.weight", f"altup_unembed_projections.{j}.weight")
    if model.per_layer is None:
        ignore.append(rf"(model\.)?({'|'.join(t for _, t in PLE_MODEL)})\.weight")
    else:
        plan.put_pairs("per_layer.", "", PLE_MODEL, bias=False)
    return parts.finish(plan, model, head_size, ignore=ignore)


# --------------------------------------------------------------------------- Gemma 4 unified text
#: ``Gemma4UnifiedTextConfig``'s defaults where they differ from Gemma 4's (its configuration, 123-149), over
#: :data:`~attnzoo.models.families.gemma4.DEFAULTS`
UNIFIED_DEFAULTS: dict[str, Any] = {**gemma4.DEFAULTS, "max_position_embeddings": 262_144, "sliding_window": 1024}


def _unified(hf: HFConfig) -> HFConfig:
    """A ``Gemma4UnifiedTextConfig`` read as Gemma 4's text config: its defaults, no per-layer
    embeddings and no MoE block (keys of those names, not the unified config's, are ignored as
    transformers ignores them)."""
    out = hf.with_defaults(UNIFIED_DEFAULTS)
    out.data.update(hidden_size_per_layer_input=0, enable_moe_block=False)
    return out


def build_gemma4_unified(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                         dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Gemma4UnifiedTextConfig`` (random weights; see the module docstring)."""
    return gemma4.build_gemma4(_unified(hf), head_size=head_size, device=device, dtype=dtype)


def convert_gemma4_unified(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Gemma 4's conversion of the unified text decoder (the weights have Gemma 4's names)."""
    return gemma4.convert_gemma4(_unified(hf), sd, device=device, dtype=dtype)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "gemma3n_text": parts.Dispatch("Gemma 3n", convert_gemma3n, ("Gemma3nForCausalLM", "Gemma3nTextModel")),
    "gemma4_unified_text": parts.Dispatch("Gemma 4 unified", convert_gemma4_unified,
                                          ("Gemma4UnifiedForCausalLM", "Gemma4UnifiedTextModel")),
}
