"""Dense decoders of the LLaMA line -> :class:`~attnzoo.DecoderLM`: Cohere2, EXAONE 4, Ministral 3,
Seed-OSS, Apertus, GLM-4, Granite 3.x (``granite``), StarCoder2 (``starcoder2``), Command R
(``cohere``), OLMo 1 (``olmo``), GLM-4-9B (``glm``), ERNIE-4.5 (``ernie4_5``), HunYuan-V1-Dense
(``hunyuan_v1_dense``), Helium (``helium``), Arcee AFM (``arcee``) and Nemotron-4 (``nemotron``), as
``*ForCausalLM`` and ``*Model`` (one converter, dispatching on ``model_type``). Line numbers:
transformers 5.25's ``models/<name>/modeling_<name>.py``.

* Cohere2 (Command R7B / Command A; ``modeling_cohere2.py``): a *parallel* layer
  ``x + attn(ln(x)) + mlp(ln(x))`` with one bias-free LayerNorm (288-312, 88-102;
  :class:`ParallelBlock`); ``layer_types`` (default: 3 sliding : 1 full, from
  ``sliding_window_pattern``, ``configuration_cohere2.py`` 95-101); the sliding layers rotate
  adjacent channel pairs (``repeat_interleave`` 81, ``rotate_half`` 142-147), the full layers have
  no positions (222-223); the logits times ``logit_scale`` (476; :class:`ScaledLMHead`); a
  bias-free LayerNorm at the end; ``head_dim`` (``hidden / heads`` unless the config gives one).
* EXAONE 4 (``modeling_exaone4.py``): OLMo 2's layer (norms on the sub-layer outputs, 308/314)
  with per-head QK RMSNorm before RoPE (229-230); with a ``sliding_window`` only the sliding layers
  rotate, the full ones have no positions (234-235); no biases.
* Ministral 3 (``modeling_ministral3.py``): Mistral's layer (one ``sliding_window`` for every
  layer, 168/367) whose queries, after RoPE, are multiplied by
  ``1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings))`` at their
  position ``p`` (105-107, 147-151; :class:`TemperedAttention`). transformers' ``forward``
  without ``position_ids`` counts positions from the first slot (left padding included),
  ``generate`` from the attention mask; attnzoo takes the positions it is given, else those of
  the attention mask (``generate``'s).
* Seed-OSS (``modeling_seed_oss.py``): LLaMA with q/k/v biases (``attention_bias``) apart from the
  output projection's (``attention_out_bias``, 180), MLP biases (``mlp_bias``, 75-77) and the
  ``residual_dropout`` on both sub-layer outputs (83, 224: the block's dropout, training only).
* Apertus (``modeling_apertus.py``): per-head QK RMSNorm before RoPE (240-241), the norms
  ``attention_layernorm`` / ``feedforward_layernorm`` (292/306), an ungated MLP
  ``down(act(up(x)))`` (43-58) with the xIELU activation (``activations.py`` 281-288, its
  ``alpha_p``, ``alpha_n``, ``beta``, ``eps`` per layer; :class:`XIELU`).
* GLM-4-0414 (``modeling_glm4.py``): norms on both sides of both sub-layers (``input_layernorm``,
  ``post_self_attn_layernorm``, ``post_attention_layernorm``, ``post_mlp_layernorm``; 96-110),
  the fused ``gate_up_proj`` (rows ``[gate; up]``, 54-61), q/k/v biases without an output bias
  (220), RoPE on the first ``partial_rotary_factor`` (default 0.5) of each head, adjacent pairs
  (176-195).

* Granite 3.x (``modeling_granite.py``): LLaMA with four multipliers: the token embeddings times
  ``embedding_multiplier`` (388), the attention scores times ``attention_multiplier`` instead of
  ``head_dim ** -0.5`` (124), each sub-layer output times ``residual_multiplier`` before the residual
  add (275, 280), the logits divided by ``logits_scaling`` (489); biases on q/k/v/o by
  ``attention_bias`` (129-138), on the MLP by ``mlp_bias`` (210-212). The residual multiplier and
  ``1 / logits_scaling`` are folded into the weights at load, as for Granite 4.0-H
  (:func:`~attnzoo.models.families.granitemoehybrid.finish_folded`).
* StarCoder2 (``modeling_starcoder2.py``): LayerNorms with biases (``norm_epsilon``; 212-213, 323), an
  ungated MLP ``c_proj(act(c_fc(x)))`` (53-66; ``gelu_pytorch_tanh`` by default) and q/k/v/o, all
  biased by ``use_bias`` (57-58, 153-156); one causal window of ``sliding_window - 1`` keys on every
  layer when set (193, 358); ``residual_dropout`` on both sub-layer outputs (66, 199-200: the block's
  dropout) and ``embedding_dropout`` after the embedding (368: the decoder's), training only.

* Command R (``modeling_cohere.py``): Cohere2's parallel layer (338) with interleaved RoPE
  (``repeat_interleave`` 107) on every layer, no windows, bias-free LayerNorms (51), the logits
  times ``logit_scale`` (498); ``use_qk_norm`` (per-head LayerNorms whose weights are
  ``[heads, head_dim]``, 228-256) is refused.
* OLMo 1 (``modeling_olmo.py``): LLaMA with non-parametric LayerNorms (eps 1e-5, 48-60; no norm
  weights at all) and ``clip_qkv`` clamping the q, k and v projections before RoPE (235-238;
  :class:`ClampedLinear` on the fused ``qkv_proj``); q/k/v/o biases by ``attention_bias``.
* GLM-4-9B (``glm``, ``modeling_glm.py``): LLaMA's pre-norm layer with the fused ``gate_up_proj``
  (53-61), q/k/v biases without an output bias (220) and RoPE on the first
  ``partial_rotary_factor`` (default 0.5) of each head, adjacent pairs (151-195).
* ERNIE-4.5 dense (``modeling_ernie4_5.py``): LLaMA with adjacent-pair RoPE (107, 176-177) and every
  projection biased by ``use_bias`` (97-99, 199-202).
* HunYuan-V1-Dense (``modeling_hunyuan_v1_dense.py``): LLaMA whose per-head query/key RMSNorms
  come *after* RoPE (199-201; Hunyuan-A13B's
  :class:`~attnzoo.models.families.sparse_moe.PostRopeNormAttention`), so absolute positions matter;
  ``dynamic`` RoPE with an ``alpha`` is the fixed NTK base ``theta * alpha ** (D / (D - 2))``
  (342-358).
* Helium (``modeling_helium.py``): LLaMA with adjacent-pair RoPE (163, 192-193), q/k/v biases by
  ``attention_bias`` and an unbiased ``o_proj`` of ``[hidden, hidden]`` (215-223: ``heads *
  head_dim != hidden_size`` is refused, transformers' own forward fails there), MLP biases.
* Arcee AFM (``modeling_arcee.py``): LLaMA with Nemotron's ungated MLP ``down(act(up(x)))``
  (56-61; ReLU² by default), biased by ``mlp_bias``.
* Nemotron-4 (``modeling_nemotron.py``): LayerNorm1P (``weight + 1`` with a bias, 62-80; loaded
  as a LayerNorm of ``weight + 1``), the ungated MLP (172-183; ReLU² by default), RoPE on the first
  ``partial_rotary_factor`` (default 0.5) of each head, halves rotated (158-168), q/k/v/o biases
  by ``attention_bias``.

Adjacent-pair RoPE is attnzoo's ``interleaved`` rotary (:class:`~attnzoo.nn.positional.RotaryEmbedding`),
so the q/k weights are copied as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.granitemoehybrid as granite
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.sparse_moe import PostRopeNormAttention
from attnzoo.models.hf._state import HFConfig, Plan, load_gate_up_into, load_qkv_into
from attnzoo.models.parts import DecoderParts, LMHead, head_for
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.positional import resolve_positions

__all__ = ["DISPATCH", "XIELU", "ClampedLinear", "ParallelBlock", "ScaledLMHead",
           "TemperedAttention", "build_dense", "build_granite", "build_starcoder2", "convert_dense"]

TYPES = ("sliding_attention", "full_attention")
#: ungated activations of Apertus' MLP besides xIELU -> :class:`~attnzoo.blocks.FeedForward`'s names
UNGATED = {"relu": "relu", "gelu": "gelu", "silu": "silu", "relu2": "relu2", "gelu_pytorch_tanh": "gelu_tanh",
           "gelu_new": "gelu_tanh"}


# --------------------------------------------------------------------------- family-local modules
class ParallelBlock(TransformerBlock):
    """Cohere's parallel layer (``modeling_cohere2.py`` 288-312): one norm, then the attention and
    the MLP of the same normalised input added to the residual together,
    ``x + drop(attn(n)) + drop(ffn(n))``, ``n = attn_norm(x)``. Built from :class:`BlockLayers`
    (its ``norm`` once: ``ffn_norm`` is ``None``).

    Shapes: ``x [B, N, C] -> [B, N, C]``."""

    def __init__(self, dim: int, layers: BlockLayers) -> None:
        super().__init__(dim, layers=layers)
        self.ffn_norm = None

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None,  # type: ignore[override]
                key_padding: Tensor | None = None, context_mask: Any = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The arguments of :meth:`TransformerBlock.forward` (no ``context``: no cross-attention)."""
        if context is not None or context_mask is not None:
            raise ValueError("ParallelBlock: no cross-attention; context and context_mask must be None")
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"ParallelBlock: x must be [B, N, {self.dim}], got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if key_padding is not None:
            mask = self._self_mask(mask, key_padding)
        assert self.ffn is not None
        h = self.attn_norm(x)  # [B, N, C]
        return x + self.dropout(self._mix(h, mask, cache, positions, cu_seqlens)) + self.dropout(self.ffn(h))


class ScaledLMHead(LMHead):
    """:class:`~attnzoo.models.parts.LMHead` whose logits are multiplied by ``scale`` (Cohere's
    ``logit_scale``, ``modeling_cohere2.py`` 476). Shapes: ``[B, N, C] -> [B, N, V]``."""

    def __init__(self, dim: int, vocab_size: int, *, scale: float, device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, vocab_size, device=device, dtype=dtype)
        self.scale = float(scale)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"


class TemperedAttention(MultiHeadAttention):
    """:class:`~attnzoo.MultiHeadAttention` whose queries (after QK-norm and RoPE) are multiplied
    by ``1 + beta * log(1 + floor(p / span))`` at their position ``p`` (Ministral 3's
    ``get_llama_4_attn_scale``, ``modeling_ministral3.py`` 105-107, 147-151); ``temperature =
    (beta, span)`` is set after building (``None``: plain attention). Packed input runs one
    sequence at a time (positions restart per sequence).

    Shapes: as :class:`~attnzoo.MultiHeadAttention`."""

    temperature: tuple[float, float] | None = None

    def _project_self(self, x: Tensor, positions: Tensor | None, start: int, *,
                      rotate: bool) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super()._project_self(x, positions, start, rotate=rotate)
        if self.temperature is None:
            return q, k, v
        beta, span = self.temperature
        B, N, _ = x.shape
        pos = resolve_positions(positions, N, start, x.device, batch=B)  # [N] or [B, N]
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        scale = 1.0 + beta * torch.log1p(torch.floor(pos.to(wide) / span))  # [N] | [B, N]
        return q * scale.unsqueeze(-1).unsqueeze(-3).to(q.dtype), k, v  # [.., 1, N, 1] over [B, H, N, D]

    def _packed(self, x: Tensor, cu_seqlens: object, context: object, mask: object, cache: object,
                positions: object, return_weights: bool) -> Tensor:
        if self.temperature is not None:
            raise ValueError("TemperedAttention: packed input (cu_seqlens) runs one sequence at a time here "
                             "(the query temperature needs each token's position)")
        return super()._packed(x, cu_seqlens, context, mask, cache, positions, return_weights)


class XIELU(nn.Module):
    """The xIELU activation (Huang & Schlag 2024; transformers' ``XIELUActivation``,
    ``activations.py`` 231-288): ``ap x^2 + beta x`` for ``x > 0``, else
    ``an (expm1(min(x, eps)) - x) + beta x``, ``ap = softplus(alpha_p)``,
    ``an = beta + softplus(alpha_n)``. Weights: ``alpha_p [1]``, ``alpha_n [1]``; buffers ``beta``,
    ``eps`` (scalars, as the checkpoints keep them). Shapes: ``[...] -> [...]``."""

    def __init__(self, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.alpha_p = nn.Parameter(torch.zeros(1, **kw))
        self.alpha_n = nn.Parameter(torch.zeros(1, **kw))
        self.register_buffer("beta", torch.tensor(0.5, **kw))
        self.register_buffer("eps", torch.tensor(-1e-6, **kw))

    def forward(self, x: Tensor) -> Tensor:
        ap = F.softplus(self.alpha_p)
        an = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, ap * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * an + self.beta * x)


class XIELUFeedForward(FeedForward):
    """Apertus' MLP (``modeling_apertus.py`` 43-58): ``down(xielu(up(x)))``, no biases; the
    activation's weights at ``act_fn``. Shapes: ``[B, N, C] -> [B, N, C]``."""

    def __init__(self, dim: int, hidden: int, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, hidden, "relu", bias=False, device=device, dtype=dtype)
        self.act_fn = XIELU(device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.dropout(self.act_fn(self.up_proj(x))))  # [B, N, C]


# --------------------------------------------------------------------------- shared builders
def _make_attention(dim: int, heads: int, settings: Mapping[str, Any], out_bias: bool,
                    temperature: tuple[float, float] | None) -> nn.Module:
    """A (tempered) :class:`MultiHeadAttention` of ``settings`` whose output projection has a bias
    iff ``out_bias`` (the q/k/v biases follow ``settings["bias"]``)."""
    module = build_softmax(TemperedAttention if temperature else MultiHeadAttention, dim, heads, **settings)
    out = module.out_proj
    if out_bias and out.bias is None:
        out.bias = nn.Parameter(torch.zeros(out.out_features, device=out.weight.device, dtype=out.weight.dtype))
    elif not out_bias and out.bias is not None:
        out.register_parameter("bias", None)
    if temperature:
        module.temperature = temperature
    return module


def _attention(hf: HFConfig, *, window: int | None, rope: nn.Module | None, biases: tuple[bool, bool],
               qk_norm: str | None = None, temperature: tuple[float, float] | None = None,
               kw: Mapping[str, Any]) -> Callable[[], nn.Module]:
    """A factory of one layer's attention (:func:`~attnzoo.models.families._common.attention_factory`'s
    settings) with the q/k/v and output biases ``biases``."""
    base = parts.attention_factory(hf, window=window, rope=rope, qk_norm=qk_norm, **kw)
    settings = {**base.keywords, "bias": biases[0], "causal": True}
    return functools.partial(_make_attention, hf.req("hidden_size"), hf.req("num_attention_heads"), settings,
                             biases[1], temperature)


def _rope(hf: HFConfig, head_dim: int, *, interleaved: bool = False, rotary_dim: int | None = None) -> nn.Module:
    rope = parts.rotary(hf, parts.rope_params(hf), head_dim, rotary_dim=rotary_dim)
    rope.interleaved = interleaved  # adjacent pairs: the rotation reads the flag (RotaryEmbedding.rotate)
    return rope


def _block(dim: int, attention: Callable[[], nn.Module], ffn: Callable[[], nn.Module], norm: Callable[[], nn.Module],
           *, sublayer_norm: str = "input", dropout: float = 0.0) -> TransformerBlock:
    return TransformerBlock(dim, layers=BlockLayers(attention=attention, feed_forward=ffn, norm=norm,
                                                    sublayer_norm=sublayer_norm, dropout=dropout))


def _pattern_types(hf: HFConfig, default_pattern: int) -> HFConfig:
    """``layer_types`` from the legacy ``sliding_window_pattern`` (every ``p``-th layer full, the
    others sliding) when the config has none (``configuration_cohere2.py`` 95-101,
    ``configuration_exaone4.py`` 100-107)."""
    if hf.has("layer_types"):
        return hf
    pattern = hf.raw("sliding_window_pattern", default_pattern)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise hf.unsupported(f"sliding_window_pattern={pattern!r} without layer_types (supported: an int >= 1)")
    out = HFConfig(dict(hf.data), hf.source, hf.arch)
    out.data["layer_types"] = [TYPES[0] if (i + 1) % pattern else TYPES[1] for i in range(hf.req("num_hidden_layers"))]
    return out


# --------------------------------------------------------------------------- the families
def build_cohere2(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Cohere2: parallel blocks, interleaved RoPE on sliding layers, NoPE full layers (module docstring)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("layer_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    rope = _rope(hf, D, interleaved=True)
    bias = hf.get("attention_bias", False, bool)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, bias=False, **kw)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    blocks = [ParallelBlock(C, BlockLayers(attention=_attention(hf, window=w, rope=rope if w is not None else None,
                                                                biases=(bias, bias), kw=kw), feed_forward=ffn, norm=norm))
              for w in parts.sliding_windows(hf, kinds)]
    return _parallel_decoder(hf, blocks, norm, eps, head_size, kw)


def build_exaone4(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """EXAONE 4: output norms, per-head QK norm, NoPE full layers when windowed (module docstring)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    windowed = hf.get("sliding_window", None) is not None
    kinds = parts.layer_types(hf, depth, TYPES) if windowed else ["full_attention"] * depth
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    blocks = [parts.block(C, _attention(hf, window=w, rope=rope if w is not None or not windowed else None,
                                        biases=(False, False), qk_norm="head", kw=kw),
                          ffn, parts.rms_norm(C, eps, **kw), sublayer_norm="output")
              for w in parts.sliding_windows(hf, kinds)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _temperature(hf: HFConfig) -> tuple[float, float] | None:
    """Ministral 3's ``(llama_4_scaling_beta, original_max_position_embeddings)`` of ``rope_parameters``
    (``None``: no ``llama_4_scaling_beta``, or 0)."""
    params = parts.rope_params(hf)
    beta = params.get("llama_4_scaling_beta")
    if beta in (None, 0, 0.0):
        return None
    span = params.get("original_max_position_embeddings")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not isinstance(span, (int, float)) or span <= 0:
        raise hf.unsupported(f"llama_4_scaling_beta={beta!r} with original_max_position_embeddings={span!r} "
                             f"(supported: numbers, the span > 0)")
    return float(beta), float(span)


def build_ministral3(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """Ministral 3: Mistral with the query temperature (module docstring)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    rope, temperature = parts.rotary(hf, parts.rope_params(hf), D), _temperature(hf)
    window = hf.get("sliding_window", None)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    blocks = [parts.block(C, _attention(hf, window=None if window is None else window - 1, rope=rope,
                                        biases=(False, False), temperature=temperature, kw=kw),
                          ffn, parts.rms_norm(C, eps, **kw)) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _seed_biases(hf: HFConfig) -> tuple[bool, bool]:
    return hf.get("attention_bias", True, bool), hf.get("attention_out_bias", False, bool)


def build_seed_oss(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Seed-OSS: LLaMA with separate q/k/v and output biases, MLP biases, residual dropout."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                          bias=hf.get("mlp_bias", False, bool), **kw)
    blocks = [_block(C, _attention(hf, window=None, rope=rope, biases=_seed_biases(hf), kw=kw), ffn,
                     parts.rms_norm(C, eps, **kw), dropout=hf.get("residual_dropout", 0.0, float))
              for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def build_apertus(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Apertus: per-head QK norm, ungated xIELU MLP (module docstring)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    act, F_ = hf.get("hidden_act", "xielu", str), hf.req("intermediate_size")
    if act == "xielu":
        ffn: Callable[[], nn.Module] = functools.partial(XIELUFeedForward, C, F_, **kw)
    elif act in UNGATED:
        ffn = functools.partial(FeedForward, C, F_, UNGATED[act], bias=False, **kw)
    else:
        raise hf.unsupported(f"hidden_act={act!r} (supported: 'xielu', {', '.join(map(repr, UNGATED))})")
    bias = hf.get("attention_bias", False, bool)
    blocks = [parts.block(C, _attention(hf, window=None, rope=rope, biases=(bias, bias), qk_norm="head", kw=kw), ffn,
                          parts.rms_norm(C, eps, **kw)) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def build_granite(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Granite 3.x: LLaMA with the score scale ``attention_multiplier`` and the embedding multiplier
    (the residual multiplier and ``logits_scaling`` are folded in at load: module docstring)."""
    C, _, depth, D = parts.dims(hf)
    parts.unsupported_keys(hf, granite.CHECKS)
    granite.refuse_partial_rotary(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", bias=hf.get("mlp_bias", False, bool), **kw)
    bias = hf.get("attention_bias", False, bool)
    attn = _attention(hf, window=None, rope=rope, biases=(bias, bias),
                      kw={**kw, "scale": granite.multiplier(hf, "attention_multiplier")})
    blocks = [parts.block(C, attn, ffn, parts.rms_norm(C, eps, **kw)) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=granite.embed_scale(hf), **kw)


def build_starcoder2(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """StarCoder2: biased LayerNorms, an ungated biased MLP, one window on every layer (module docstring)."""
    C, H, depth, D = parts.dims(hf)
    eps, kw = hf.get("norm_epsilon", 1e-5, float), {"device": device, "dtype": dtype}
    act, bias = hf.get("hidden_act", "gelu_pytorch_tanh", str), hf.get("use_bias", True, bool)
    if act not in UNGATED:
        raise hf.unsupported(f"hidden_act={act!r} (supported: {', '.join(map(repr, UNGATED))})")
    ffn = functools.partial(FeedForward, C, hf.req("intermediate_size"), UNGATED[act], bias=bias, **kw)
    window = hf.get("sliding_window", None)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, **kw)
    attn = _attention(hf, window=None if window is None else window - 1, rope=parts.rotary(hf, parts.rope_params(hf), D),
                      biases=(bias, bias), kw=kw)
    blocks = [_block(C, attn, ffn, norm, dropout=hf.get("residual_dropout", 0.0, float)) for _ in range(depth)]
    V = hf.req("vocab_size")
    cfg = DecoderConfig(V, C, depth, H, pos="rope", norm="layer", norm_eps=eps, dropout=hf.get("embedding_dropout", 0.0, float),
                        tie_embeddings=hf.get("tie_word_embeddings", True, bool), max_seq_len=parts.max_positions(hf))
    return DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, norm=norm(), head=head_for(C, V, head_size, **kw)), **kw)


def _glm4_rotary_dim(hf: HFConfig, head_dim: int) -> int:
    """``int(head_dim * partial_rotary_factor)`` (default 0.5, ``configuration_glm4.py`` 76), even."""
    factor = parts.rope_params(hf).get("partial_rotary_factor", hf.raw("partial_rotary_factor", 0.5))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise hf.unsupported(f"partial_rotary_factor={factor!r} (supported: 0 < factor <= 1)")
    rotary = int(head_dim * factor)
    if rotary % 2:
        raise hf.unsupported(f"partial_rotary_factor={factor!r}: {rotary} rotated channels of {head_dim} (odd)")
    return rotary


def _build_glm(hf: HFConfig, sublayer_norm: str, *, head_size: int | None, device: Any, dtype: Any) -> DecoderLM:
    """GLM-4's layer: fused ``gate_up_proj``, q/k/v biases only, partial interleaved RoPE; the norms
    on the inputs (``glm``) or on both sides of each sub-layer (``glm4``, GLM-4-0414)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1.5625e-7, float), {"device": device, "dtype": dtype}
    rope = _rope(hf, D, interleaved=True, rotary_dim=_glm4_rotary_dim(hf, D))
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    bias = hf.get("attention_bias", True, bool)
    blocks = [parts.block(C, _attention(hf, window=None, rope=rope, biases=(bias, False), kw=kw), ffn,
                          parts.rms_norm(C, eps, **kw), sublayer_norm=sublayer_norm) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def build_glm4(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """GLM-4-0414: norms on both sides, partial interleaved RoPE, q/k/v biases only."""
    return _build_glm(hf, "both", head_size=head_size, device=device, dtype=dtype)


def _parallel_decoder(hf: HFConfig, blocks: list[nn.Module], norm: Callable[[], nn.Module], eps: float,
                      head_size: int | None, kw: Mapping[str, Any]) -> DecoderLM:
    """Cohere's decoder around parallel ``blocks``: the final bias-free LayerNorm ``norm`` and the
    head times ``logit_scale`` (a plain head for a base model or a score head)."""
    C, H, V = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("vocab_size")
    cfg = DecoderConfig(V, C, len(blocks), H, pos="rope", norm="layer", norm_eps=eps,
                        tie_embeddings=hf.get("tie_word_embeddings", True, bool), max_seq_len=parts.max_positions(hf))
    head = (ScaledLMHead(C, V, scale=hf.get("logit_scale", 0.0625, float), **kw) if head_size is None
            else head_for(C, V, head_size, **kw))
    return DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, norm=norm(), head=head), **kw)


def build_cohere(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Command R (``cohere``): Cohere2's parallel layer with interleaved RoPE on every layer, no
    windows; ``use_qk_norm`` (per-head LayerNorms with per-head weights) refused (module docstring)."""
    parts.unsupported_keys(hf, {"use_qk_norm": lambda v: not v})
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("layer_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    bias = hf.get("attention_bias", False, bool)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, bias=False, **kw)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    attn = _attention(hf, window=None, rope=_rope(hf, D, interleaved=True), biases=(bias, bias), kw=kw)
    blocks: list[nn.Module] = [ParallelBlock(C, BlockLayers(attention=attn, feed_forward=ffn, norm=norm))
                               for _ in range(depth)]
    return _parallel_decoder(hf, blocks, norm, eps, head_size, kw)


def _llama_like(hf: HFConfig, head_size: int | None, kw: Mapping[str, Any], *, biases: tuple[bool, bool],
                ffn: Callable[[], nn.Module], interleaved: bool) -> DecoderLM:
    """A pre-norm RMSNorm LLaMA decoder with the q/k/v and output ``biases``, the MLP ``ffn`` and
    RoPE on adjacent pairs iff ``interleaved`` (Helium, ERNIE-4.5, Arcee)."""
    C, _, depth, D = parts.dims(hf)
    eps = hf.get("rms_norm_eps", 1e-6, float)
    rope = _rope(hf, D, interleaved=interleaved)
    blocks = [parts.block(C, _attention(hf, window=None, rope=rope, biases=biases, kw=kw), ffn,
                          parts.rms_norm(C, eps, **kw)) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _helium_biases(hf: HFConfig) -> tuple[bool, bool]:
    return hf.get("attention_bias", False, bool), False


def build_helium(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Helium: LLaMA with interleaved RoPE, q/k/v biases without an output bias, MLP biases."""
    kw = {"device": device, "dtype": dtype}
    C, H, _, D = parts.dims(hf)
    if H * D != C:  # o_proj is [C, C] (modeling_helium.py 223): transformers' own forward fails
        raise hf.unsupported(f"head_dim={D} with num_attention_heads={H}: {H * D} channels != hidden_size={C}")
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                          bias=hf.get("mlp_bias", False, bool), **kw)
    return _llama_like(hf, head_size, kw, biases=_helium_biases(hf), ffn=ffn, interleaved=True)


def _ernie_bias(hf: HFConfig) -> tuple[bool, bool]:
    bias = hf.get("use_bias", False, bool)
    return bias, bias


def build_ernie4_5(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                   dtype: Any = None) -> DecoderLM:
    """ERNIE-4.5 (dense): LLaMA with interleaved RoPE, every projection biased by ``use_bias``."""
    kw = {"device": device, "dtype": dtype}
    ffn = parts.gated_mlp(hf.req("hidden_size"), hf.req("intermediate_size"),
                          hf.activation("hidden_act", parts.GATED, "silu"), bias=_ernie_bias(hf)[0], **kw)
    return _llama_like(hf, head_size, kw, biases=_ernie_bias(hf), ffn=ffn, interleaved=True)


def build_arcee(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Arcee AFM: LLaMA with the ungated MLP ``down(act(up(x)))`` (ReLU² by default)."""
    kw = {"device": device, "dtype": dtype}
    act = hf.get("hidden_act", "relu2", str)
    if act not in UNGATED:
        raise hf.unsupported(f"hidden_act={act!r} (supported: {', '.join(map(repr, UNGATED))})")
    ffn = functools.partial(FeedForward, hf.req("hidden_size"), hf.req("intermediate_size"), UNGATED[act],
                            bias=hf.get("mlp_bias", False, bool), **kw)
    bias = hf.get("attention_bias", False, bool)
    return _llama_like(hf, head_size, kw, biases=(bias, bias), ffn=ffn, interleaved=False)


class ClampedLinear(nn.Linear):
    """OLMo's ``clip_qkv`` (``modeling_olmo.py`` 235-238): a linear map whose outputs are clamped to
    ``[-clip, clip]`` (attnzoo's fused ``qkv_proj``: the q, k and v projections clamped alike,
    before RoPE). Shapes: ``[..., in] -> [..., out]``."""

    def __init__(self, in_features: int, out_features: int, *, clip: float, bias: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.clip = float(clip)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).clamp(-self.clip, self.clip)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, clip={self.clip:g}"


def _clamped(attention: Callable[[], nn.Module], clip: float | None) -> nn.Module:
    """``attention()`` with its fused ``qkv_proj`` replaced by a :class:`ClampedLinear` of the same shape."""
    module = attention()
    if clip is not None:
        old = module.qkv_proj
        module.qkv_proj = ClampedLinear(old.in_features, old.out_features, clip=clip, bias=old.bias is not None,
                                        device=old.weight.device, dtype=old.weight.dtype)
    return module


def _clip_qkv(hf: HFConfig) -> float | None:
    clip = hf.raw("clip_qkv", None)
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0:
        raise hf.unsupported(f"clip_qkv={clip!r} (supported: null or a number > 0)")
    return float(clip)


def build_olmo(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """OLMo 1: LLaMA with non-parametric LayerNorms (eps 1e-5, ``modeling_olmo.py`` 48-60) and
    ``clip_qkv`` (:class:`ClampedLinear`)."""
    C, H, depth, D = parts.dims(hf)
    kw = {"device": device, "dtype": dtype}
    norm = functools.partial(nn.LayerNorm, C, eps=1e-5, elementwise_affine=False, **kw)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    bias = hf.get("attention_bias", False, bool)
    attn = functools.partial(_clamped, _attention(hf, window=None, rope=_rope(hf, D), biases=(bias, bias), kw=kw),
                             _clip_qkv(hf))
    blocks = [_block(C, attn, ffn, norm) for _ in range(depth)]
    V = hf.req("vocab_size")
    cfg = DecoderConfig(V, C, depth, H, pos="rope", norm="layer", norm_eps=1e-5,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool), max_seq_len=parts.max_positions(hf))
    return DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, norm=norm(), head=head_for(C, V, head_size, **kw)),
                     **kw)


def build_glm(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """GLM-4 (``glm``): LLaMA's pre-norm layer with GLM-4-0414's fused ``gate_up_proj``, q/k/v
    biases only and partial interleaved RoPE (module docstring)."""
    return _build_glm(hf, "input", head_size=head_size, device=device, dtype=dtype)


def _hunyuan_rope(hf: HFConfig, head_dim: int) -> nn.Module:
    """HunYuan's RoPE: ``dynamic`` with an ``alpha`` is a fixed NTK base ``theta * alpha ** (D / (D - 2))``
    (``modeling_hunyuan_v1_dense.py`` 296-307, 342-358); other types as usual."""
    params = parts.rope_params(hf)
    alpha = params.get("alpha")
    if params.get("rope_type") == "dynamic" and alpha:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise hf.unsupported(f"rope_parameters alpha={alpha!r} (supported: a number > 0)")
        base = float(params["rope_theta"]) * float(alpha) ** (head_dim / (head_dim - 2))
        return parts.rotary(hf, {"rope_type": "default", "rope_theta": base}, head_dim)
    return parts.rotary(hf, params, head_dim)


def build_hunyuan_v1_dense(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                           dtype: Any = None) -> DecoderLM:
    """HunYuan-V1-Dense: LLaMA with per-head QK RMSNorm after RoPE (Hunyuan-A13B's
    :class:`~attnzoo.models.families.sparse_moe.PostRopeNormAttention`)."""
    C, H, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    bias = hf.get("attention_bias", False, bool)
    base = parts.attention_factory(hf, window=None, rope=_hunyuan_rope(hf, D), **kw)
    attn = functools.partial(build_softmax, PostRopeNormAttention, C, H,
                             **{**base.keywords, "bias": bias, "qk_norm": "head", "qk_norm_eps": eps})
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    blocks = [parts.block(C, attn, ffn, parts.rms_norm(C, eps, **kw)) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def build_nemotron(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Nemotron-4: LayerNorm1P (``weight + 1``, with bias; loaded as a LayerNorm of ``weight + 1``),
    an ungated MLP (squared ReLU by default), partial RoPE on the first channels (module docstring)."""
    C, H, depth, D = parts.dims(hf)
    eps, kw = hf.get("norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    act = hf.get("hidden_act", "relu2", str)
    if act not in UNGATED:
        raise hf.unsupported(f"hidden_act={act!r} (supported: {', '.join(map(repr, UNGATED))})")
    ffn = functools.partial(FeedForward, C, hf.req("intermediate_size"), UNGATED[act],
                            bias=hf.get("mlp_bias", False, bool), **kw)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, **kw)
    bias = hf.get("attention_bias", False, bool)
    rope = _rope(hf, D, rotary_dim=_glm4_rotary_dim(hf, D))
    blocks = [_block(C, _attention(hf, window=None, rope=rope, biases=(bias, bias), kw=kw), ffn, norm)
              for _ in range(depth)]
    V = hf.req("vocab_size")
    cfg = DecoderConfig(V, C, depth, H, pos="rope", norm="layer", norm_eps=eps,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool), max_seq_len=parts.max_positions(hf))
    return DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, norm=norm(), head=head_for(C, V, head_size, **kw)),
                     **kw)


# --------------------------------------------------------------------------- weights
def _put_mlp(hf: HFConfig, plan: Plan, ours: str, theirs: str) -> None:
    """The gated MLP without biases (the families whose transformers MLP has none, whatever ``mlp_bias`` says)."""
    parts.put_mlp(plan, ours, theirs)


def _put_seed_mlp(hf: HFConfig, plan: Plan, ours: str, theirs: str) -> None:
    """Seed-OSS' gated MLP, biased by ``mlp_bias``."""
    parts.put_mlp(plan, ours, theirs, bias=hf.get("mlp_bias", False, bool))


def _put_gate_up(hf: HFConfig, plan: Plan, ours: str, theirs: str) -> None:
    """GLM-4's fused ``gate_up_proj`` (rows ``[gate; up]``) and ``down_proj``."""
    load_gate_up_into(plan, ours, f"{theirs}gate_up_proj.weight")
    plan.put_pairs(ours, theirs, [("down_proj", "down_proj")], bias=False)


def _put_c_mlp(hf: HFConfig, plan: Plan, ours: str, theirs: str) -> None:
    """StarCoder2's ungated MLP (``c_fc``, ``c_proj``), biased by ``use_bias``."""
    plan.put_pairs(ours, theirs, [("up_proj", "c_fc"), ("down_proj", "c_proj")], bias=hf.get("use_bias", True, bool))


def _put_ernie_mlp(hf: HFConfig, plan: Plan, ours: str, theirs: str) -> None:
    """ERNIE-4.5's gated MLP, biased by ``use_bias``."""
    parts.put_mlp(plan, ours, theirs, bias=hf.get("use_bias", False, bool))


def _put_up_down(hf: HFConfig, plan: Plan, ours: str, theirs: str) -> None:
    """Arcee's ungated MLP (``up_proj``, ``down_proj``), biased by ``mlp_bias``."""
    plan.put_pairs(ours, theirs, [("up_proj", "up_proj"), ("down_proj", "down_proj")],
                   bias=hf.get("mlp_bias", False, bool))


def _use_bias(hf: HFConfig) -> tuple[bool, bool]:
    bias = hf.get("use_bias", True, bool)
    return bias, bias


def _put_xielu_mlp(hf: HFConfig, plan: Plan, ours: str, theirs: str) -> None:
    """Apertus' ``up_proj``, ``down_proj`` and, with xIELU, ``act_fn.{alpha_p, alpha_n}`` and the buffers
    ``act_fn.{beta, eps}`` where the checkpoint has them."""
    plan.put_pairs(ours, theirs, [("up_proj", "up_proj"), ("down_proj", "down_proj")], bias=False)
    if hf.get("hidden_act", "xielu", str) != "xielu":
        return
    for name in ("alpha_p", "alpha_n"):
        plan.put(f"{ours}act_fn.{name}", f"{theirs}act_fn.{name}")
    for name, default in (("beta", 0.5), ("eps", -1e-6)):  # transformers' initial values where a checkpoint has none
        if plan.src.has(f"{theirs}act_fn.{name}"):
            plan.put(f"{ours}act_fn.{name}", f"{theirs}act_fn.{name}")
        else:
            plan.put_tensor(f"{ours}act_fn.{name}", torch.tensor(default), f"{name}={default} (transformers' default)")


@dataclass(frozen=True)
class Family:
    """One family's builder, config defaults (what ``config.json`` may leave out) and weight map."""

    build: Callable[..., DecoderLM]
    defaults: Mapping[str, Any]
    norms: Sequence[tuple[str, str]]
    biases: Callable[[HFConfig], tuple[bool, bool]]
    qk_norm: bool = False
    ffn: Callable[[HFConfig, Plan, str, str], None] = _put_mlp
    pattern: int | None = None  # the default sliding_window_pattern, for families with layer_types
    window: int | None = None  # the default sliding_window (only where the key is absent: null means none)
    layer_norm: bool = False  # LayerNorms with biases (StarCoder2), the final one included
    folded: bool = False  # Granite: residual_multiplier and logits_scaling folded into the weights
    post_rope_norm: bool = False  # HunYuan: query_layernorm / key_layernorm at attn.frontier.{q,k}_norm_weight
    norm_transform: Callable[[Tensor], Tensor] | None = None  # Nemotron's LayerNorm1P: weight + 1
    weightless: bool = False  # non-parametric norms (OLMo 1): no norm weights at all
    name: str = ""  # the family's name (messages, ``MODEL_TYPES``)
    classes: tuple[str, ...] = ()  # the transformers classes that convert


def _attention_bias(default: bool, out: bool | None = None) -> Callable[[HFConfig], tuple[bool, bool]]:
    def biases(hf: HFConfig) -> tuple[bool, bool]:
        bias = hf.get("attention_bias", default, bool)
        return bias, bias if out is None else out
    return biases


def _no_bias(hf: HFConfig) -> tuple[bool, bool]:
    return False, False


FAMILIES: dict[str, Family] = {
    "cohere2": Family(build_cohere2, {"logit_scale": 0.0625, "layer_norm_eps": 1e-5, "tie_word_embeddings": True,
                                      "max_position_embeddings": 8192, "hidden_act": "silu"},
                      [("attn_norm", "input_layernorm")], _attention_bias(False), pattern=4, window=4096,
        name="Cohere2", classes=("Cohere2ForCausalLM", "Cohere2Model")),
    "exaone4": Family(build_exaone4, {"rms_norm_eps": 1e-5, "hidden_act": "silu"},
                      [("attn_out_norm", "post_attention_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm")],
                      _no_bias, qk_norm=True, pattern=4, window=4096,
        name="EXAONE 4", classes=("Exaone4ForCausalLM", "Exaone4Model")),
    "ministral3": Family(build_ministral3, {
        "rms_norm_eps": 1e-5, "head_dim": 128, "max_position_embeddings": 262144, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                            "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}},
        parts.PRE_NORMS, _no_bias,
        name="Ministral 3", classes=("Ministral3ForCausalLM", "Ministral3Model")),
    "seed_oss": Family(build_seed_oss, {"rms_norm_eps": 1e-6, "head_dim": 128, "attention_bias": True,
                                        "attention_out_bias": False, "residual_dropout": 0.1,
                                        "attention_dropout": 0.1, "max_position_embeddings": 524288},
                       parts.PRE_NORMS, _seed_biases, ffn=_put_seed_mlp,
        name="Seed-OSS", classes=("SeedOssForCausalLM", "SeedOssModel")),
    "apertus": Family(build_apertus, {
        "rms_norm_eps": 1e-5, "hidden_act": "xielu", "max_position_embeddings": 65536,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 12e6, "factor": 8.0,
                            "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        [("attn_norm", "attention_layernorm"), ("ffn_norm", "feedforward_layernorm")], _attention_bias(False),
        qk_norm=True, ffn=_put_xielu_mlp,
        name="Apertus", classes=("ApertusForCausalLM", "ApertusModel")),
    "glm4": Family(build_glm4, {"rms_norm_eps": 1.5625e-7, "head_dim": 128, "attention_bias": True,
                                "max_position_embeddings": 131072, "hidden_act": "silu"},
                   [("attn_norm", "input_layernorm"), ("attn_out_norm", "post_self_attn_layernorm"),
                    ("ffn_norm", "post_attention_layernorm"), ("ffn_out_norm", "post_mlp_layernorm")],
                   _attention_bias(True, False), ffn=_put_gate_up,
        name="GLM-4", classes=("Glm4ForCausalLM", "Glm4Model")),
    "granite": Family(build_granite, {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "hidden_act": "silu"},
                      parts.PRE_NORMS, _attention_bias(False), ffn=_put_seed_mlp, folded=True,
        name="Granite", classes=("GraniteForCausalLM", "GraniteModel")),
    "starcoder2": Family(build_starcoder2, {"norm_epsilon": 1e-5, "hidden_act": "gelu_pytorch_tanh", "use_bias": True,
                                            "tie_word_embeddings": True, "max_position_embeddings": 4096},
                         parts.PRE_NORMS, _use_bias, ffn=_put_c_mlp, layer_norm=True,
        name="StarCoder2", classes=("Starcoder2ForCausalLM", "Starcoder2Model")),
    "cohere": Family(build_cohere, {"logit_scale": 0.0625, "layer_norm_eps": 1e-5, "tie_word_embeddings": True,
                                    "max_position_embeddings": 8192, "hidden_act": "silu",
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
                     [("attn_norm", "input_layernorm")], _attention_bias(False),
        name="Cohere", classes=("CohereForCausalLM", "CohereModel")),
    "helium": Family(build_helium, {"rms_norm_eps": 1e-8, "head_dim": 128, "max_position_embeddings": 4096,
                                    "hidden_act": "silu", "tie_word_embeddings": False,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
                     parts.PRE_NORMS, _helium_biases, ffn=_put_seed_mlp,
        name="Helium", classes=("HeliumForCausalLM", "HeliumModel")),
    "ernie4_5": Family(build_ernie4_5, {"rms_norm_eps": 1e-5, "head_dim": 128, "max_position_embeddings": 131072,
                                        "hidden_act": "silu", "tie_word_embeddings": True,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
                       parts.PRE_NORMS, _ernie_bias, ffn=_put_ernie_mlp,
        name="ERNIE-4.5", classes=("Ernie4_5ForCausalLM", "Ernie4_5Model")),
    "arcee": Family(build_arcee, {"rms_norm_eps": 1e-5, "hidden_act": "relu2", "max_position_embeddings": 4096,
                                  "tie_word_embeddings": False,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                    parts.PRE_NORMS, _attention_bias(False), ffn=_put_up_down,
        name="Arcee", classes=("ArceeForCausalLM", "ArceeModel")),
    "olmo": Family(build_olmo, {"max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": False,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                   (), _attention_bias(False), weightless=True,
        name="OLMo", classes=("OlmoForCausalLM", "OlmoModel")),
    "glm": Family(build_glm, {"rms_norm_eps": 1.5625e-7, "head_dim": 128, "attention_bias": True,
                              "max_position_embeddings": 131072, "hidden_act": "silu", "tie_word_embeddings": False},
                  parts.PRE_NORMS, _attention_bias(True, False), ffn=_put_gate_up,
        name="GLM", classes=("GlmForCausalLM", "GlmModel")),
    "hunyuan_v1_dense": Family(build_hunyuan_v1_dense, {
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        parts.PRE_NORMS, _attention_bias(False), post_rope_norm=True,
        name="HunYuan-V1-Dense", classes=("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Model")),
    "nemotron": Family(build_nemotron, {"norm_eps": 1e-5, "hidden_act": "relu2", "max_position_embeddings": 4096,
                                        "tie_word_embeddings": False,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                       parts.PRE_NORMS, _attention_bias(False), ffn=_put_up_down, layer_norm=True,
                       norm_transform=parts.plus_one,
        name="Nemotron", classes=("NemotronForCausalLM", "NemotronModel")),
}


def canonical(hf: HFConfig) -> tuple[HFConfig, Family]:
    """``hf`` as transformers reads it (the family's defaults where a key is absent; ``layer_types``
    from ``sliding_window_pattern``) and its :class:`Family`."""
    model_type = hf.raw("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise hf.unsupported(f"model_type={model_type!r} (this converter: {', '.join(map(repr, FAMILIES))})")
    out = hf.with_defaults(family.defaults)
    if family.window is not None and "sliding_window" not in hf.data:
        out.data["sliding_window"] = family.window
    if family.pattern is not None and out.has("sliding_window"):
        out = _pattern_types(out, family.pattern)
    return out, family


def build_dense(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of the config's ``model_type`` (random weights; see the module docstring)."""
    out, family = canonical(hf)
    return family.build(out, head_size=head_size, device=device, dtype=dtype)


def convert_dense(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> nn.Module:
    """Build the decoder of the config's ``model_type`` and copy the weights (the head follows them)."""
    hf, family = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, family.build, device=device, dtype=dtype)
    qkv_bias, out_bias = family.biases(hf)
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}.self_attn."
        load_qkv_into(plan, f"{o}attn", tuple(f"{h}{n}_proj.weight" for n in "qkv"),
                      tuple(f"{h}{n}_proj.bias" for n in "qkv") if qkv_bias else None, qkv_bias)
        plan.put_pairs(f"{o}attn.", h, [("out_proj", "o_proj")], bias=out_bias)
        if family.post_rope_norm:
            for n, theirs in (("q_norm", "query_layernorm"), ("k_norm", "key_layernorm")):
                plan.put(f"{o}attn.frontier.{n}_weight", f"{h}{theirs}.weight")
        if family.qk_norm:
            for n in ("q_norm", "k_norm"):
                plan.put(f"{o}attn.frontier.{n}_weight", f"{h}{n}.weight")
        family.ffn(hf, plan, f"{o}ffn.", f"layers.{i}.mlp.")
        for ours, theirs in family.norms:
            plan.put(f"{o}{ours}.weight", f"layers.{i}.{theirs}.weight", family.norm_transform)
            if family.layer_norm:
                plan.put(f"{o}{ours}.bias", f"layers.{i}.{theirs}.bias")
    if family.layer_norm:
        plan.put("norm.bias", "norm.bias")
    if family.folded:  # every weight writing into the residual stream: the out and down projections
        writes = [n for n in plan.values if n.endswith(_WRITES)]
        return granite.finish_folded(plan, model, hf, head_size, writes)
    if family.weightless:  # no final norm weight: the head and the copy of parts.finish
        patterns = [r"(model\.)?rotary_emb\w*\.\w+"]
        parts.put_head(plan, head_size, model.tie_embeddings, patterns)
        plan.apply(model, ignore=patterns)
        return model
    return parts.finish(plan, model, head_size, norm_transform=family.norm_transform)


#: the weights of a layer that write into the residual stream (Granite's ``residual_multiplier``)
_WRITES = ("attn.out_proj.weight", "attn.out_proj.bias", "ffn.down_proj.weight", "ffn.down_proj.bias")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``: every ``Family``
DISPATCH = {t: parts.Dispatch(f.name, convert_dense, f.classes) for t, f in FAMILIES.items()}
