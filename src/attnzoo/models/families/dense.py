"""Dense decoders of the LLaMA line -> :class:`~attnzoo.DecoderLM`: Cohere2, EXAONE 4, Ministral 3,
Seed-OSS, Apertus, GLM-4, Granite 3.x (``granite``), StarCoder2 (``starcoder2``), Command R
(``cohere``), OLMo 1 (``olmo``), GLM-4-9B (``glm``), ERNIE-4.5 (``ernie4_5``), HunYuan-V1-Dense
(``hunyuan_v1_dense``), Helium (``helium``), Arcee AFM (``arcee``), Nemotron-4 (``nemotron``), Ministral
(``ministral``), VaultGemma (``vaultgemma``), Jais-2 (``jais2``), HyperCLOVA X (``hyperclovax``), Granite-SWA
(``granite_swa``), EXAONE 3.x (``exaone``), InternLM3 (``internlm3``), IQuest-Coder (``iquestcoder``), NanoChat
(``nanochat``) and BitNet (``bitnet``), as ``*ForCausalLM`` and ``*Model`` (one converter, dispatching on
``model_type``); and the text decoders of GLM-4.1V (``glm4v_text``), GLM-OCR (``glm_ocr_text``: GLM-4.1V's without
q/k/v biases, ``modeling_glm_ocr.py`` 193-195; its release's MTP layer ``layers.16`` unloaded, 324), PaddleOCR-VL
(``paddleocr_vl_text``), Granite-4-Vision (``granite4_vision_text``: Granite's; its deepstack features enter
only with images), HunYuan-VL (``hunyuan_vl_text``: HunYuan-V1-Dense's under a multimodal RoPE that is the 1-D
one on text), Cosmos3-Edge (``cosmos3_edge_text``: Arcee's layers with the MLP at ``fc1`` / ``fc2``), Molmo2
(``molmo2_text``) and Emu3 (``emu3_text_model``: LLaMA with residual dropout). Line numbers: transformers 5.25's ``models/<name>/modeling_<name>.py``.

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
  times ``logit_scale`` (498); ``use_qk_norm`` (Command R+): bias-free LayerNorms over each query
  and key head, weights ``[heads, head_dim]``, before RoPE (228-256;
  :class:`~attnzoo.models.families._qknorm.LayerNormQKAttention`).
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
* HunYuan-VL's text model (``hunyuan_vl_text``, ``modeling_hunyuan_vl.py``): HunYuan-V1-Dense's layer
  (509-647) under a multimodal RoPE whose 3 or 4 position streams (``mrope_section``, released as
  ``xdrope_section``) are equal on text, i.e. the 1-D RoPE (105-190); the released ``rope_scaling``
  type ``xdrope`` is ``dynamic`` (``configuration_hunyuan_vl.py``), ties its head by default, and the
  released ``config.json`` spells ``head_dim`` / ``vocab_size`` / ``pad_token_id`` as
  ``attention_head_dim`` / ``org_vocab_size`` / ``pad_id``.
* Helium (``modeling_helium.py``): LLaMA with adjacent-pair RoPE (163, 192-193), q/k/v biases by
  ``attention_bias`` and an unbiased ``o_proj`` of ``[hidden, hidden]`` (215-223: ``heads *
  head_dim != hidden_size`` is refused, transformers' own forward fails there), MLP biases.
* Arcee AFM (``modeling_arcee.py``): LLaMA with Nemotron's ungated MLP ``down(act(up(x)))``
  (56-61; ReLU² by default), biased by ``mlp_bias``.
* Nemotron-4 (``modeling_nemotron.py``): LayerNorm1P (``weight + 1`` with a bias, 62-80; loaded
  as a LayerNorm of ``weight + 1``), the ungated MLP (172-183; ReLU² by default), RoPE on the first
  ``partial_rotary_factor`` (default 0.5) of each head, halves rotated (158-168), q/k/v/o biases
  by ``attention_bias``.

* Ministral (``modeling_ministral.py``): Mistral's layer (no biases, 150-154) with a window of
  ``sliding_window - 1`` keys on the ``sliding_attention`` layers of ``layer_types`` (155); absent, every
  layer is sliding when a ``sliding_window`` is set, else full (``configuration_ministral.py`` 91-94).
  transformers' forward asks the config for a window even then (``create_sliding_window_causal_mask``
  raises on ``sliding_window=None``): an unwindowed Ministral runs here only.
* VaultGemma (``modeling_vaultgemma.py``): Gemma 2 without the norms on the sub-layer outputs
  (``input_layernorm``, ``pre_feedforward_layernorm`` only, 242-244): ``1 + w`` RMSNorms scaled in float32,
  embeddings times ``sqrt(hidden)`` (371), scores times ``query_pre_attn_scalar ** -0.5`` (172) and
  soft-capped by ``attn_logit_softcapping`` (226), logits by ``final_logit_softcapping`` (511-514; the
  softcaps' defaults only where the key is absent: ``null`` is none), sliding / full layers alternating
  from a sliding first by default, tanh-GeGLU (``hidden_activation``), q/k/v/o biased by ``attention_bias``.
* Jais-2 (``modeling_jais2.py``): LLaMA's layer with biased LayerNorms (205-206, 316), the ungated MLP
  ``down(act(up(x)))`` (50-55; ReLU² by default) biased by ``mlp_bias`` and q/k/v/o by ``attention_bias``
  (both on by default): Nemotron-4's decoder with the whole head rotated.
* HyperCLOVA X (``modeling_hyperclovax.py``): LLaMA with muP multipliers, the score scale
  ``attention_multiplier`` (default ``head_dim ** -0.5``, 190), the embeddings times
  ``embedding_multiplier`` (395), each sub-layer output times ``residual_multiplier`` (327, 334) and the
  logits *times* ``logits_scaling`` (496: Granite divides), and with ``use_post_norm`` (Peri-LN, the
  default) RMSNorms on the sub-layer outputs (``post_norm1`` / ``post_norm2``, 276-281). The residual
  multiplier is folded into the output norms' weights (into ``o_proj`` / ``down_proj`` without them), the
  logit one into the final norm of an LM head.
* Granite-SWA (``modeling_granite_swa.py``): Granite's layer and multipliers (folded as Granite's) with
  one learnable sink logit per query head (``sinks``: the ``sigmoid(logsumexp - sink)`` output rescaling,
  109-117, is a softmax denominator term), a window of ``sliding_window - 1`` keys on the sliding layers
  (``layer_types``; absent, every fourth layer full from the first) and a RoPE base per layer
  (``layer_rope_theta``, ``0`` a NoPE layer; 395-398, 456-457): GraniteMoe-SWA's dense sibling.
* EXAONE 3.x, InternLM3, IQuest-Coder (``exaone``, ``internlm3``, ``iquestcoder``): transformers builds
  ``LlamaForCausalLM`` / ``LlamaModel`` for them (their ``modular_*.py`` hold a config only): LLaMA with
  q/k/v/o biased by ``attention_bias`` and the MLP by ``mlp_bias``, each with its own defaults. EXAONE's
  checkpoints (and transformers' ``save_pretrained`` folders) name the weights ``transformer.h.{i}.attn.attention``,
  ``ln_1``, ``mlp.c_fc_0`` ... (``conversion_mapping.py`` "exaone"), read as transformers' names; EXAONE's
  ``num_layers`` / ``layer_norm_epsilon`` / ``activation_function`` and InternLM3's ``qkv_bias`` / ``bias``
  config keys are read as transformers' (their ``attribute_map``). IQuest-Coder's ``clip_qkv`` and
  ``use_sliding_window`` (which transformers' config refuses) are refused by name.
* NanoChat (``modeling_nanochat.py``): RMSNorms without weights (44-56) everywhere, the embeddings
  normed before the first layer too (394; minimax's
  :class:`~attnzoo.models.families.minimax.NormedEmbedding`), an ungated ReLU² MLP ``fc2(act(fc1(x)))``
  (254-260), weightless per-head QK RMSNorms after RoPE (220-224; before it here: a rotation keeps the
  norm), a RoPE turning the other way (``rotate_half`` gives ``(x2, -x1)``, 167-171: converted by negating the
  second half of each query / key head's rows) and the logit softcap ``final_logit_softcapping``.
* BitNet (``modeling_bitnet.py``; the unquantized weights as transformers holds them): LLaMA with an
  RMSNorm before ``o_proj`` (``attn_sub_norm``, 177/217: hidden_size wide, so ``heads * head_dim`` must
  be ``hidden_size``) and before ``down_proj`` (``ffn_sub_norm``, 74-77; :class:`SubNormLinear`) and a
  gated ReLU² MLP (:class:`SubNormFeedForward`); a ``quantization_config`` (ternary BitLinear layers) is
  refused by name.
* Cosmos3-Edge's text decoder (``modular_cosmos3_edge.py``, ``cosmos3_edge_text``): LLaMA's layer with an
  ungated ReLU² MLP at ``mlp.fc1`` / ``mlp.fc2`` (CLIP's names, ``mlp_bias``; Arcee's builder) under Qwen3-VL's
  multimodal RoPE, whose three position streams are equal on text: the 1-D RoPE (default theta ``1e8``).
  The released checkpoints' generator tensors (``*_moe_gen``, ``add_*_proj``, ``time_embedder``, ...,
  which transformers ignores) are dropped with the wrapper's towers (:mod:`attnzoo.models.hf.wrappers`).
* Molmo2's text decoder (``modeling_molmo2.py``, ``molmo2_text``): OLMo 2's attention (225-311) with the QK
  RMSNorm per head (``qk_norm_type="qwen3"``) or over the whole projection (``"olmo"``), q/k/v biases by
  ``attention_bias``, pre-norms or norms on the sub-layer outputs (``norm_after``, 330-381), the scaled RoPE
  on ``rope_scaling_layers`` only (the others unscaled, 629-700), and an embedding of ``vocab_size +
  additional_vocab_size`` rows under a head of ``vocab_size``. Its released layout (what transformers'
  ``save_pretrained`` writes too: fused ``att_proj`` / ``ff_proj``, ``wte.embedding`` + ``wte.new_embedding``)
  is read by :func:`_molmo2_names`.

Adjacent-pair RoPE is attnzoo's ``interleaved`` rotary (:class:`~attnzoo.nn.positional.RotaryEmbedding`),
so the q/k weights are copied as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.granitemoehybrid as granite
from attnzoo.blocks import ACTIVATIONS, BlockLayers, FeedForward, RMSNorm, TransformerBlock
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._qknorm import LayerNormQKAttention, QKLayerNorm
from attnzoo.models.families.granitemoe_swa import layer_thetas
from attnzoo.models.families.minimax import NormedEmbedding
from attnzoo.models.families.sparse_moe import PostRopeNormAttention
from attnzoo.models.hf._state import HFConfig, Plan, load_gate_up_into, load_qkv_into
from attnzoo.models.parts import DecoderParts, LMHead, head_for
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.positional import resolve_positions

__all__ = ["DISPATCH", "FAMILIES", "XIELU", "ClampedLinear", "Family", "ParallelBlock", "ScaledLMHead",
           "SubNormFeedForward", "SubNormLinear", "TemperedAttention", "WeightlessRMSNorm", "build_dense",
           "build_granite", "build_starcoder2", "canonical", "clamped_projection", "convert_dense", "finish_weightless",
           "make_attention", "parallel_decoder", "put_layer", "weightless_qk_norms"]

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
        mask = self._self_only(x, context, context_mask, mask, key_padding)
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
def make_attention(dim: int, heads: int, settings: Mapping[str, Any], out_bias: bool,
                    temperature: tuple[float, float] | None) -> nn.Module:
    """A (tempered) :class:`MultiHeadAttention` of ``settings`` whose output projection has a bias
    iff ``out_bias`` (the q/k/v biases follow ``settings["bias"]``); with ``settings["qk_layernorm"]``
    a :class:`~attnzoo.models.families._qknorm.LayerNormQKAttention` (Command R's ``use_qk_norm``)."""
    cls = TemperedAttention if temperature else LayerNormQKAttention if "qk_layernorm" in settings else MultiHeadAttention
    module = build_softmax(cls, dim, heads, **settings)
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
               softcap: float | None = None, qk_layernorm: QKLayerNorm | None = None,
               kw: Mapping[str, Any]) -> Callable[[], nn.Module]:
    """A factory of one layer's attention (:func:`~attnzoo.models.families._common.attention_factory`'s
    settings) with the q/k/v and output biases ``biases``, the score ``softcap`` (``None``: none) and
    per-head QK LayerNorms ``qk_layernorm`` (``None``: none)."""
    base = parts.attention_factory(hf, window=window, rope=rope, qk_norm=qk_norm, **kw)
    settings = {**base.keywords, "bias": biases[0], "causal": True}
    if softcap is not None:
        settings["softcap"] = softcap
    if qk_layernorm is not None:
        settings["qk_layernorm"] = qk_layernorm
    return functools.partial(make_attention, hf.req("hidden_size"), hf.req("num_attention_heads"), settings,
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
    blocks: list[nn.Module] = [
        ParallelBlock(C, BlockLayers(attention=_attention(hf, window=w, rope=rope if w is not None else None,
                                                          biases=(bias, bias), kw=kw), feed_forward=ffn, norm=norm))
        for w in parts.sliding_windows(hf, kinds)]
    return parallel_decoder(hf, blocks, norm, eps, head_size, kw)


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


def build_emu3_text(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Emu3's text model: LLaMA (q/k/v/o biases by ``attention_bias``, MLP biases by ``mlp_bias``) whose layers
    also drop out both sub-layer outputs at ``attention_dropout`` in training (``modeling_emu3.py`` 244-283)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                          bias=hf.get("mlp_bias", False, bool), **kw)
    bias = hf.get("attention_bias", False, bool)
    blocks = [_block(C, _attention(hf, window=None, rope=rope, biases=(bias, bias), kw=kw), ffn,
                     parts.rms_norm(C, eps, **kw), dropout=hf.get("attention_dropout", 0.0, float))
              for _ in range(depth)]
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


def build_starcoder2(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """StarCoder2: biased LayerNorms, an ungated biased MLP, one window on every layer (module docstring)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("norm_epsilon", 1e-5, float), {"device": device, "dtype": dtype}
    bias = hf.get("use_bias", True, bool)
    ffn = functools.partial(FeedForward, C, hf.req("intermediate_size"), _ungated(hf, "gelu_pytorch_tanh"), bias=bias,
                            **kw)
    window = hf.get("sliding_window", None)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, **kw)
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    attn = _attention(hf, window=None if window is None else window - 1, rope=rope, biases=(bias, bias), kw=kw)
    blocks = [_block(C, attn, ffn, norm, dropout=hf.get("residual_dropout", 0.0, float)) for _ in range(depth)]
    head = head_for(C, hf.req("vocab_size"), head_size, **kw)
    return _decoder_with(hf, blocks, norm(), kind="layer", eps=eps, head=head,
                         tie=hf.get("tie_word_embeddings", True, bool), kw=kw,
                         dropout=hf.get("embedding_dropout", 0.0, float))


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


def build_glm_ocr_text(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                       dtype: Any = None) -> DecoderLM:
    """GLM-OCR's text decoder: GLM-4.1V's layer with bias-free q/k/v projections (its attention class
    makes none, whatever a config's ``attention_bias`` says)."""
    return build_glm4(HFConfig({**hf.data, "attention_bias": False}, hf.source, hf.arch), head_size=head_size,
                      device=device, dtype=dtype)


def _finish_glm_ocr(hf: HFConfig, plan: Plan, model: DecoderLM, head_size: int | None) -> DecoderLM:
    """The released checkpoint's multi-token-prediction layer (``layers.{num_hidden_layers}``, which
    transformers leaves unloaded) dropped."""
    return parts.finish(plan, model, head_size, ignore=parts.layers_past(plan.src.sd, model.depth))


def parallel_decoder(hf: HFConfig, blocks: list[nn.Module], norm: Callable[[], nn.Module], eps: float,
                      head_size: int | None, kw: Mapping[str, Any]) -> DecoderLM:
    """Cohere's decoder around parallel ``blocks``: the final bias-free LayerNorm ``norm`` and the
    head times ``logit_scale`` (a plain head for a base model or a score head)."""
    C, V = hf.req("hidden_size"), hf.req("vocab_size")
    head = (ScaledLMHead(C, V, scale=hf.get("logit_scale", 0.0625, float), **kw) if head_size is None
            else head_for(C, V, head_size, **kw))
    return _decoder_with(hf, blocks, norm(), kind="layer", eps=eps, head=head,
                         tie=hf.get("tie_word_embeddings", True, bool), kw=kw)


def _decoder_with(hf: HFConfig, blocks: Sequence[nn.Module], norm: nn.Module, *, kind: str, eps: float,
                  head: nn.Module | None, tie: bool, kw: Mapping[str, Any], embedding: nn.Module | None = None,
                  dropout: float = 0.0) -> DecoderLM:
    """The :class:`DecoderLM` around ``blocks`` with the family's own final ``norm`` (a config
    ``norm=kind`` of ``eps``), ``head``, token ``embedding`` (``None``: a plain one) and embedding
    ``dropout``, for the families whose final norm :func:`~attnzoo.models.families._common.decoder`'s
    RMSNorm is not."""
    C, H, V = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("vocab_size")
    cfg = DecoderConfig(V, C, len(blocks), H, pos="rope", norm=kind, norm_eps=eps, dropout=dropout, tie_embeddings=tie,
                        max_seq_len=parts.max_positions(hf))
    return DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, embedding=embedding, norm=norm, head=head), **kw)


def build_cohere(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Command R (``cohere``): Cohere2's parallel layer with interleaved RoPE on every layer, no
    windows; ``use_qk_norm`` (Command R+): bias-free LayerNorms per query / key head, with a weight
    row per head, before RoPE (module docstring)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("layer_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    bias = hf.get("attention_bias", False, bool)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, bias=False, **kw)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    qk = QKLayerNorm(per_head=True, bias=False, eps=eps) if hf.get("use_qk_norm", False, bool) else None
    attn = _attention(hf, window=None, rope=_rope(hf, D, interleaved=True), biases=(bias, bias), qk_layernorm=qk,
                      kw=kw)
    blocks: list[nn.Module] = [ParallelBlock(C, BlockLayers(attention=attn, feed_forward=ffn, norm=norm))
                               for _ in range(depth)]
    return parallel_decoder(hf, blocks, norm, eps, head_size, kw)


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
    return _ernie(hf, head_size, {"device": device, "dtype": dtype}, interleaved=True)


def _ernie(hf: HFConfig, head_size: int | None, kw: dict[str, Any], *, interleaved: bool) -> DecoderLM:
    """ERNIE-4.5's dense decoder, its RoPE on adjacent pairs (``interleaved``) or split halves."""
    ffn = parts.gated_mlp(hf.req("hidden_size"), hf.req("intermediate_size"),
                          hf.activation("hidden_act", parts.GATED, "silu"), bias=_ernie_bias(hf)[0], **kw)
    return _llama_like(hf, head_size, kw, biases=_ernie_bias(hf), ffn=ffn, interleaved=interleaved)


def build_paddleocr_vl_text(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                            dtype: Any = None) -> DecoderLM:
    """PaddleOCR-VL's text decoder: ERNIE-4.5 (dense) rotating split halves (Qwen2-VL's multimodal RoPE,
    the 1-D RoPE on text), not adjacent pairs."""
    return _ernie(hf, head_size, {"device": device, "dtype": dtype}, interleaved=False)


def build_arcee(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Arcee AFM: LLaMA with the ungated MLP ``down(act(up(x)))`` (ReLU² by default)."""
    kw = {"device": device, "dtype": dtype}
    ffn = functools.partial(FeedForward, hf.req("hidden_size"), hf.req("intermediate_size"), _ungated(hf, "relu2"),
                            bias=hf.get("mlp_bias", False, bool), **kw)
    bias = hf.get("attention_bias", False, bool)
    return _llama_like(hf, head_size, kw, biases=(bias, bias), ffn=ffn, interleaved=False)


def _molmo2_ropes(hf: HFConfig, depth: int, head_dim: int) -> list[nn.Module]:
    """Molmo2's rotary per layer: ``rope_parameters`` on the layers of ``rope_scaling_layers`` (every
    layer when absent), the unscaled RoPE of the same theta on the others (one module of each)."""
    params = parts.rope_params(hf)
    scaled = parts.rotary(hf, params, head_dim)
    layers = hf.get("rope_scaling_layers", None, list)
    if layers is None:
        return [scaled] * depth
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise hf.unsupported(f"rope_scaling_layers={layers!r} (supported: a list of layer indices)")
    plain = parts.rotary(hf, {"rope_type": "default", "rope_theta": params["rope_theta"]}, head_dim)
    return [scaled if i in layers else plain for i in range(depth)]


def build_molmo2_text(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                      dtype: Any = None) -> DecoderLM:
    """Molmo2's text decoder: OLMo 2's attention with the QK RMSNorm per head (``qk_norm_type="qwen3"``)
    or over all heads (``"olmo"``), q/k/v biases by ``attention_bias`` (none on ``o_proj``), pre-norms or,
    with ``norm_after``, norms on the sub-layer outputs, a gated MLP, the scaled RoPE on
    ``rope_scaling_layers`` only, and an embedding of ``vocab_size + additional_vocab_size`` rows (the
    image / video special tokens) under a head of ``vocab_size``."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    qk = hf.get("qk_norm_type", "qwen3", str)
    if qk not in MOLMO2_QK_NORMS:
        raise hf.unsupported(f"qk_norm_type={qk!r} (supported: {', '.join(map(repr, MOLMO2_QK_NORMS))})")
    extra = hf.get("additional_vocab_size", 128, int)
    if extra < 0:
        raise hf.unsupported(f"additional_vocab_size={extra} (supported: >= 0)")
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    where = "output" if hf.get("norm_after", False, bool) else "input"
    blocks = [parts.block(C, _attention(hf, window=None, rope=rope, biases=_helium_biases(hf),
                                        qk_norm=MOLMO2_QK_NORMS[qk], kw=kw),
                          ffn, parts.rms_norm(C, eps, **kw), sublayer_norm=where)
              for rope in _molmo2_ropes(hf, depth, D)]
    embedding = nn.Embedding(hf.req("vocab_size") + extra, C, **kw)
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embedding=embedding, **kw)


#: Molmo2's released names (``conversion_mapping.py`` "Molmo2TextModel") -> transformers', per layer
MOLMO2_NAMES = (("attn_norm.", "input_layernorm."), ("ff_norm.", "post_attention_layernorm."),
                ("self_attn.attn_out.", "self_attn.o_proj."), ("mlp.ff_out.", "mlp.down_proj."))


def _molmo2_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` (the text model's; ``model.`` prefixed or not) with Molmo2's released layout, which
    transformers' ``save_pretrained`` writes too, read as transformers' in-memory one: the fused
    ``self_attn.att_proj`` (rows ``[q; k; v]``, the queries as wide as ``attn_out``'s input) split,
    ``mlp.ff_proj`` (rows ``[up; gate]``) chunked, ``wte.embedding`` and ``wte.new_embedding`` (the
    additional vocabulary) concatenated; the other names per :data:`MOLMO2_NAMES`. A dict already in
    transformers' layout is returned as it is."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        stem, _, leaf = key.rpartition(".")
        if stem.endswith("self_attn.att_proj"):
            attn = stem[: -len("att_proj")]
            q = sd[f"{attn}attn_out.weight" if f"{attn}attn_out.weight" in sd else f"{attn}o_proj.weight"].shape[1]
            kv = (t.shape[0] - q) // 2
            for name, part in zip("qkv", t.split([q, kv, kv], dim=0), strict=True):
                out[f"{attn}{name}_proj.{leaf}"] = part
        elif stem.endswith("mlp.ff_proj"):
            mlp = stem[: -len("ff_proj")]
            out[f"{mlp}up_proj.{leaf}"], out[f"{mlp}gate_proj.{leaf}"] = t.chunk(2, dim=0)
        elif key.endswith("wte.new_embedding"):
            continue
        elif key.endswith("wte.embedding"):
            extra = sd.get(key[: -len("embedding")] + "new_embedding")
            out[key[: -len("wte.embedding")] + "embed_tokens.weight"] = t if extra is None else torch.cat([t, extra])
        else:
            for theirs, ours in MOLMO2_NAMES:
                key = key.replace(f".{theirs}", f".{ours}")
            out[re.sub(r"(^|\.)ln_f\.", r"\1norm.", key)] = t
    return out


#: Molmo2's ``qk_norm_type`` -> attnzoo's QK RMSNorm (per head, or over the whole projection)
MOLMO2_QK_NORMS = {"qwen3": "head", "olmo": "all"}


def _molmo2_norms(hf: HFConfig) -> Sequence[tuple[str, str]]:
    """Molmo2's two norms: before the sub-layers, or on their outputs with ``norm_after``."""
    if not hf.get("norm_after", False, bool):
        return parts.PRE_NORMS
    return [("attn_out_norm", "input_layernorm"), ("ffn_out_norm", "post_attention_layernorm")]


def build_cosmos3_edge_text(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                            dtype: Any = None) -> DecoderLM:
    """Cosmos3-Edge's text decoder: Arcee's (the MLP at ``fc1`` / ``fc2``); its multimodal RoPE is the
    unscaled one only (``rope_type="default"``, as its config requires), the 1-D RoPE on text."""
    rope_type = parts.rope_params(hf).get("rope_type", "default")
    if rope_type != "default":
        raise hf.unsupported(f"rope_type={rope_type!r} (supported: 'default', the only one Cosmos3-Edge defines)")
    return build_arcee(hf, head_size=head_size, device=device, dtype=dtype)


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


def clamped_projection(attention: Callable[[], nn.Module], clip: float | None) -> nn.Module:
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
    C, _, depth, D = parts.dims(hf)
    kw = {"device": device, "dtype": dtype}
    norm = functools.partial(nn.LayerNorm, C, eps=1e-5, elementwise_affine=False, **kw)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    bias = hf.get("attention_bias", False, bool)
    attn = functools.partial(clamped_projection, _attention(hf, window=None, rope=_rope(hf, D), biases=(bias, bias), kw=kw),
                             _clip_qkv(hf))
    blocks = [_block(C, attn, ffn, norm) for _ in range(depth)]
    head = head_for(C, hf.req("vocab_size"), head_size, **kw)
    return _decoder_with(hf, blocks, norm(), kind="layer", eps=1e-5, head=head,
                         tie=hf.get("tie_word_embeddings", False, bool), kw=kw)


def build_glm(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """GLM-4 (``glm``): LLaMA's pre-norm layer with GLM-4-0414's fused ``gate_up_proj``, q/k/v
    biases only and partial interleaved RoPE (module docstring)."""
    return _build_glm(hf, "input", head_size=head_size, device=device, dtype=dtype)


def _hunyuan_rope(hf: HFConfig, head_dim: int) -> nn.Module:
    """HunYuan's RoPE: ``dynamic`` with an ``alpha`` is a fixed NTK base ``theta * alpha ** (D / (D - 2))``
    (``modeling_hunyuan_v1_dense.py`` 296-307, 342-358); other types as usual. The released configs'
    ``rope_scaling: {"type": "dynamic", "alpha": ...}`` reads as ``rope_parameters`` (the rows' alias)."""
    params = parts.rope_params(hf)
    alpha = params.get("alpha")
    if params.get("rope_type", params.get("type")) == "dynamic" and alpha:
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


def build_hunyuan_vl_text(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                          dtype: Any = None) -> DecoderLM:
    """HunYuan-VL's text decoder: HunYuan-V1-Dense's. Its multimodal RoPE (``mrope_section``: the rotated
    pairs split between position axes) is the 1-D RoPE on text, every axis at the token's position
    (``modeling_hunyuan_vl.py`` 551-577); a released config's ``rope_type`` ``"xdrope"`` is ``"dynamic"``
    (``configuration_hunyuan_vl.py`` 240-252)."""
    params = dict(hf.get("rope_parameters", {}, dict))
    if params.get("rope_type", params.get("type")) == "xdrope":
        params = {k: v for k, v in params.items() if k != "type"} | {"rope_type": "dynamic"}
        hf = HFConfig({**hf.data, "rope_parameters": params}, hf.source, hf.arch)
    return build_hunyuan_v1_dense(hf, head_size=head_size, device=device, dtype=dtype)


def _ungated(hf: HFConfig, default: str) -> str:
    """attnzoo's name (:data:`UNGATED`) of the config's ``hidden_act``; another one refused by name."""
    act = hf.get("hidden_act", default, str)
    if act not in UNGATED:
        raise hf.unsupported(f"hidden_act={act!r} (supported: {', '.join(map(repr, UNGATED))})")
    return UNGATED[act]


def _layer_norm_decoder(hf: HFConfig, eps: float, rotary_dim: int | None, *, head_size: int | None,
                        kw: Mapping[str, Any]) -> DecoderLM:
    """A pre-norm decoder of biased LayerNorms (``eps``), q/k/v/o biased by ``attention_bias``, the
    ungated MLP ``down(act(up(x)))`` biased by ``mlp_bias`` (ReLU² by default) and RoPE on the first
    ``rotary_dim`` channels of each head (``None``: all): Nemotron-4, Jais-2."""
    C, _, depth, D = parts.dims(hf)
    ffn = functools.partial(FeedForward, C, hf.req("intermediate_size"), _ungated(hf, "relu2"),
                            bias=hf.get("mlp_bias", False, bool), **kw)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, **kw)
    bias = hf.get("attention_bias", False, bool)
    rope = _rope(hf, D, rotary_dim=rotary_dim)
    blocks = [_block(C, _attention(hf, window=None, rope=rope, biases=(bias, bias), kw=kw), ffn, norm)
              for _ in range(depth)]
    head = head_for(C, hf.req("vocab_size"), head_size, **kw)
    return _decoder_with(hf, blocks, norm(), kind="layer", eps=eps, head=head,
                         tie=hf.get("tie_word_embeddings", False, bool), kw=kw)


def build_nemotron(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Nemotron-4: LayerNorm1P (``weight + 1``, with bias; loaded as a LayerNorm of ``weight + 1``),
    an ungated MLP (squared ReLU by default), partial RoPE on the first channels (module docstring)."""
    return _layer_norm_decoder(hf, hf.get("norm_eps", 1e-5, float), _glm4_rotary_dim(hf, parts.dims(hf)[3]),
                               head_size=head_size, kw={"device": device, "dtype": dtype})


def build_jais2(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Jais-2: LLaMA's layer with biased LayerNorms, the ungated MLP (ReLU² by default), q/k/v/o and
    MLP biases (module docstring)."""
    return _layer_norm_decoder(hf, hf.get("layer_norm_eps", 1e-5, float), None, head_size=head_size,
                               kw={"device": device, "dtype": dtype})


def build_ministral(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Ministral: Mistral's layer with a window on the ``sliding_attention`` layers (module docstring)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES, default=[TYPES[0] if hf.has("sliding_window") else TYPES[1]] * depth)
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    blocks = [parts.block(C, _attention(hf, window=w, rope=rope, biases=(False, False), kw=kw), ffn,
                          parts.rms_norm(C, eps, **kw)) for w in parts.sliding_windows(hf, kinds)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _none_or_positive(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)


def build_vaultgemma(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """VaultGemma: Gemma 2 without the sub-layer output norms (module docstring)."""
    parts.unsupported_keys(hf, {k: _none_or_positive for k in (
        "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")})
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES, default=[TYPES[i % 2] for i in range(depth)])
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"),
                          hf.activation("hidden_activation", parts.GATED, "gelu_pytorch_tanh"), **kw)
    bias, scale = hf.get("attention_bias", False, bool), hf.get("query_pre_attn_scalar", 256, float) ** -0.5
    blocks = [parts.block(C, _attention(hf, window=w, rope=rope, biases=(bias, bias),
                                        softcap=hf.get("attn_logit_softcapping", None, float),
                                        kw={**kw, "scale": scale}), ffn, parts.rms_norm(C, eps, **kw))
              for w in parts.sliding_windows(hf, kinds)]
    model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=C ** 0.5,
                          logit_softcap=hf.get("final_logit_softcapping", None, float), **kw)
    return parts.float32_scale_norms(model, keep_float32=True)  # (1 + w) scaled in float32, as transformers


#: HyperCLOVA X's multipliers attnzoo reproduces: a positive score scale and embedding multiplier,
#: a non-zero logit multiplier (it is folded into the final norm as ``1 / (1 / s)``)
HCX_CHECKS: dict[str, Callable[[Any], bool]] = {
    "attention_multiplier": _none_or_positive, "embedding_multiplier": _none_or_positive,
    "logits_scaling": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0)}


def build_hyperclovax(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                      dtype: Any = None) -> DecoderLM:
    """HyperCLOVA X: LLaMA with muP multipliers and Peri-LN output norms (module docstring; the
    residual and logit multipliers are folded in at load)."""
    parts.unsupported_keys(hf, HCX_CHECKS)
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                          bias=hf.get("mlp_bias", False, bool), **kw)
    bias = hf.get("attention_bias", False, bool)
    attn = _attention(hf, window=None, rope=parts.rotary(hf, parts.rope_params(hf), D), biases=(bias, bias),
                      kw={**kw, "scale": hf.get("attention_multiplier", D ** -0.5, float)})
    sublayer_norm = "both" if hf.get("use_post_norm", True, bool) else "input"
    blocks = [parts.block(C, attn, ffn, parts.rms_norm(C, eps, **kw), sublayer_norm=sublayer_norm)
              for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=granite.embed_scale(hf), **kw)


def _granite_decoder(hf: HFConfig, *, kinds: Sequence[str], thetas: Sequence[float], sinks: bool,
                     head_size: int | None, kw: Mapping[str, Any]) -> DecoderLM:
    """Granite's decoder (the score scale ``attention_multiplier``, the embedding multiplier; the
    residual and logit ones are folded in at load) with the layer kinds ``kinds`` (a window on the
    sliding ones), each layer's RoPE base ``thetas`` (``0``: NoPE) and sink logits iff ``sinks``."""
    C, _, _, D = parts.dims(hf)
    parts.unsupported_keys(hf, granite.CHECKS)
    granite.refuse_partial_rotary(hf)
    eps, params = hf.get("rms_norm_eps", 1e-6, float), parts.rope_params(hf)
    ropes = {t: parts.rotary(hf, {**params, "rope_theta": t}, D) for t in set(thetas) if t}
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", bias=hf.get("mlp_bias", False, bool), **kw)
    bias = hf.get("attention_bias", False, bool)
    akw = {**kw, "scale": granite.multiplier(hf, "attention_multiplier"), **({"sinks": True} if sinks else {})}
    blocks = [parts.block(C, _attention(hf, window=w, rope=ropes.get(t), biases=(bias, bias), kw=akw), ffn,
                          parts.rms_norm(C, eps, **kw))
              for w, t in zip(parts.sliding_windows(hf, kinds), thetas, strict=True)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=granite.embed_scale(hf), **kw)


def build_granite(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Granite 3.x: LLaMA with the score scale ``attention_multiplier`` and the embedding multiplier
    (the residual multiplier and ``logits_scaling`` are folded in at load: module docstring)."""
    depth = hf.req("num_hidden_layers")
    return _granite_decoder(hf, kinds=[TYPES[1]] * depth, thetas=[float(parts.rope_params(hf)["rope_theta"])] * depth,
                            sinks=False, head_size=head_size, kw={"device": device, "dtype": dtype})


def build_granite_swa(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                      dtype: Any = None) -> DecoderLM:
    """Granite-SWA: Granite with sink logits, sliding / full layers (``layer_types``; absent, every
    fourth layer full from the first) and a RoPE base per layer (``layer_rope_theta``, 0: NoPE)."""
    depth = hf.req("num_hidden_layers")
    kinds = parts.layer_types(hf, depth, TYPES, default=[TYPES[1] if i % 4 == 0 else TYPES[0] for i in range(depth)])
    return _granite_decoder(hf, kinds=kinds, thetas=layer_thetas(hf, depth), sinks=True, head_size=head_size,
                            kw={"device": device, "dtype": dtype})


def build_llama_variant(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                        dtype: Any = None) -> DecoderLM:
    """LLaMA under its own ``model_type`` (EXAONE 3.x, InternLM3, IQuest-Coder: transformers builds
    ``LlamaForCausalLM`` / ``LlamaModel`` for them): q/k/v/o biased by ``attention_bias``, the
    gated MLP by ``mlp_bias``."""
    kw = {"device": device, "dtype": dtype}
    ffn = parts.gated_mlp(hf.req("hidden_size"), hf.req("intermediate_size"),
                          hf.activation("hidden_act", parts.GATED, "silu"), bias=hf.get("mlp_bias", False, bool), **kw)
    bias = hf.get("attention_bias", False, bool)
    return _llama_like(hf, head_size, kw, biases=(bias, bias), ffn=ffn, interleaved=False)


def build_iquestcoder(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                      dtype: Any = None) -> DecoderLM:
    """IQuest-Coder: :func:`build_llama_variant`; ``clip_qkv`` and ``use_sliding_window`` (options of
    the original code that transformers' config refuses) refused by name."""
    parts.unsupported_keys(hf, {"clip_qkv": lambda v: v is None, "use_sliding_window": lambda v: not v})
    return build_llama_variant(hf, head_size=head_size, device=device, dtype=dtype)


class WeightlessRMSNorm(nn.Module):
    """NanoChat's RMSNorm without a weight (``modeling_nanochat.py`` 45-57): ``x / sqrt(mean(x^2) + eps)``
    over the last axis, half precision normalised in float32 and cast back. Shapes: ``[..., C] -> [..., C]``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = int(dim), float(eps)

    def forward(self, x: Tensor) -> Tensor:
        wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
        return F.rms_norm(wide, (self.dim,), None, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def weightless_qk_norms(attention: Callable[[], nn.Module]) -> nn.Module:
    """``attention()`` (built with ``qk_norm="head"``) whose q/k norm weights are fixed ones
    (non-persistent buffers, not parameters): NanoChat's weightless QK RMSNorm. transformers applies
    it after RoPE (220-224), attnzoo before: the same, a rotation keeps each head's mean square."""
    module = attention()
    frontier = module.frontier
    for name in ("q_norm_weight", "k_norm_weight"):
        ones = torch.ones_like(getattr(frontier, name)).detach()
        delattr(frontier, name)
        frontier.register_buffer(name, ones, persistent=False)
    return module


def build_nanochat(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """NanoChat: weightless RMSNorms (the embeddings normed too), weightless QK norms, ReLU² MLP,
    the final-logit softcap (module docstring)."""
    C, _, depth, D = parts.dims(hf)
    eps, kw, V = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}, hf.req("vocab_size")
    norm = functools.partial(WeightlessRMSNorm, C, eps)
    ffn = functools.partial(FeedForward, C, hf.req("intermediate_size"), _ungated(hf, "relu2"), bias=False, **kw)
    bias = hf.get("attention_bias", False, bool)
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    attn = functools.partial(weightless_qk_norms,
                             _attention(hf, window=None, rope=rope, biases=(bias, bias), qk_norm="head", kw=kw))
    blocks = [_block(C, attn, ffn, norm) for _ in range(depth)]
    head = head_for(C, V, head_size, softcap=hf.get("final_logit_softcapping", None, float), **kw)
    return _decoder_with(hf, blocks, norm(), kind="rms", eps=eps, head=head, kw=kw,
                         tie=hf.get("tie_word_embeddings", False, bool),
                         embedding=NormedEmbedding(V, C, norm=norm(), **kw))


def _nanochat_qkv(hf: HFConfig, t: Tensor) -> Tensor:
    """NanoChat's RoPE turns the other way (``rotate_half`` gives ``(x2, -x1)``, 167-171):
    ``rope_nanochat(q) = S rope(S q)``, ``S`` negating the second half of each head, and ``S``
    cancels in the scores (and in the weightless norms). So the query and key rows of the second
    half of each head of the fused ``qkv_proj`` ``t`` (weight ``[(H + 2 Hkv) D, C]`` or bias) are negated."""
    _, H, _, D = parts.dims(hf)
    Hkv = hf.get("num_key_value_heads", H)
    sign = torch.ones(H + 2 * Hkv, D, dtype=t.dtype, device=t.device)
    sign[: H + Hkv, D // 2:] = -1
    return t * sign.view(-1, *([1] * (t.dim() - 1)))


class SubNormLinear(nn.Linear):
    """BitNet's projections out of a sub-layer (``modeling_bitnet.py`` 74-77, 177, 217): a linear map
    of its RMS-normed input, ``W rmsnorm(x) (+ b)``; the norm's weight ``sub_norm.weight [in]``.
    Shapes: ``[..., in] -> [..., out]``."""

    def __init__(self, in_features: int, out_features: int, *, eps: float, bias: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.sub_norm = RMSNorm(in_features, eps, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.sub_norm(x))


class SubNormFeedForward(FeedForward):
    """BitNet's MLP (``modeling_bitnet.py`` 64-77): ``down(rmsnorm(act(gate(x)) * up(x)))``, gated with
    the function of an ungated ``activation`` (ReLU² by default); ``down_proj`` a :class:`SubNormLinear`.
    Shapes: ``[B, N, C] -> [B, N, C]``."""

    def __init__(self, dim: int, hidden: int, activation: str, *, eps: float, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, hidden, "swiglu", bias=False, device=device, dtype=dtype)
        self.act, self.activation = ACTIVATIONS[activation][0], activation
        self.down_proj = SubNormLinear(hidden, dim, eps=eps, device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r} (gated)"


def _sub_normed(attention: Callable[[], nn.Module], eps: float) -> nn.Module:
    """``attention()`` with its ``out_proj`` a :class:`SubNormLinear` of the same shape (BitNet's ``attn_sub_norm``)."""
    module = attention()
    old = module.out_proj
    module.out_proj = SubNormLinear(old.in_features, old.out_features, eps=eps, bias=old.bias is not None,
                                    device=old.weight.device, dtype=old.weight.dtype)
    return module


def build_bitnet(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """BitNet b1.58 (unquantized weights): LLaMA with RMSNorms inside the sub-layers, before ``o_proj``
    and ``down_proj``, and a gated ReLU² MLP (module docstring)."""
    parts.unsupported_keys(hf, {"quantization_config": lambda v: v is None})
    C, H, depth, D = parts.dims(hf)
    if H * D != C:  # attn_sub_norm is hidden_size wide (modeling_bitnet.py 177): transformers' own forward fails
        raise hf.unsupported(f"head_dim={D} with num_attention_heads={H}: {H * D} channels != hidden_size={C}")
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    bias = hf.get("attention_bias", False, bool)
    attn = functools.partial(_sub_normed, _attention(hf, window=None, rope=parts.rotary(hf, parts.rope_params(hf), D),
                                                     biases=(bias, bias), kw=kw), eps)
    ffn = functools.partial(SubNormFeedForward, C, hf.req("intermediate_size"), _ungated(hf, "relu2"), eps=eps, **kw)
    blocks = [parts.block(C, attn, ffn, parts.rms_norm(C, eps, **kw)) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


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


def _put_fc(hf: HFConfig, plan: Plan, ours: str, theirs: str) -> None:
    """The ungated MLP as ``fc1``, ``fc2`` (NanoChat's, Cosmos3-Edge's), biased by ``mlp_bias``."""
    plan.put_pairs(ours, theirs, [("up_proj", "fc1"), ("down_proj", "fc2")], bias=hf.get("mlp_bias", False, bool))


def _hyperclovax_norms(hf: HFConfig) -> Sequence[tuple[str, str]]:
    """HyperCLOVA X's norms: the pre-norms and, with ``use_post_norm`` (Peri-LN), ``post_norm1`` /
    ``post_norm2`` on the sub-layer outputs."""
    if not hf.get("use_post_norm", True, bool):
        return parts.PRE_NORMS
    return [*parts.PRE_NORMS, ("attn_out_norm", "post_norm1"), ("ffn_out_norm", "post_norm2")]


#: the weights of a layer that write into the residual stream (Granite's ``residual_multiplier``)
_WRITES = ("attn.out_proj.weight", "attn.out_proj.bias", "ffn.down_proj.weight", "ffn.down_proj.bias")
#: HyperCLOVA X with Peri-LN: the output norms write into the residual stream (after their weight)
_POST_NORMS = ("attn_out_norm.weight", "ffn_out_norm.weight")


def _finish_granite(hf: HFConfig, plan: Plan, model: DecoderLM, head_size: int | None) -> DecoderLM:
    """Granite's ``residual_multiplier`` folded into every weight writing into the residual stream,
    ``1 / logits_scaling`` into the final norm of an LM head (:func:`granitemoehybrid.finish_folded`)."""
    return granite.finish_folded(plan, model, hf, head_size, [n for n in plan.values if n.endswith(_WRITES)])


def _finish_hyperclovax(hf: HFConfig, plan: Plan, model: DecoderLM, head_size: int | None) -> DecoderLM:
    """HyperCLOVA X's ``residual_multiplier`` folded into the Peri-LN output norms' weights (into the
    out / down projections without them) and its logit *multiplier* ``logits_scaling`` (Granite's
    divides) into the final norm of an LM head."""
    post = hf.get("use_post_norm", True, bool)
    writes = [n for n in plan.values if n.endswith(_POST_NORMS if post else _WRITES)]
    divisor = HFConfig({**hf.data, "logits_scaling": 1.0 / hf.get("logits_scaling", 1.0, float)}, hf.source, hf.arch)
    return granite.finish_folded(plan, model, divisor, head_size, writes)


def finish_weightless(hf: HFConfig, plan: Plan, model: DecoderLM, head_size: int | None) -> DecoderLM:
    """No final norm weight (OLMo 1, NanoChat): the head, then the copy of :func:`_common.finish`."""
    patterns = [r"(model\.)?rotary_emb\w*\.\w+"]
    parts.put_head(plan, head_size, model.tie_embeddings, patterns)
    plan.apply(model, ignore=patterns)
    return model


#: EXAONE 3.x checkpoints' own names -> transformers' (its ``conversion_mapping.py`` "exaone"; a
#: transformers ``save_pretrained`` folder is written with the checkpoint's names)
EXAONE_NAMES = ((r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.h\.", "model.layers."),
                (r"^transformer\.ln_f\.", "model.norm."), (r"\.attn\.attention\.", ".self_attn."),
                (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."), (r"\.ln_1\.", ".input_layernorm."),
                (r"\.ln_2\.", ".post_attention_layernorm."), (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
                (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj."))
#: EXAONE 3.x's own config keys -> transformers' (``ExaoneConfig.attribute_map``)
EXAONE_KEYS = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
               "activation_function": "hidden_act"}


def _exaone_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` with EXAONE 3.x's checkpoint names read as transformers' (:data:`EXAONE_NAMES`)."""
    def renamed(key: str) -> str:
        for pattern, new in EXAONE_NAMES:
            key = re.sub(pattern, new, key)
        return key
    return {renamed(k): v for k, v in sd.items()}


@dataclass(frozen=True)
class Family:
    """One family's builder, config defaults (what ``config.json`` may leave out) and weight map."""

    build: Callable[..., DecoderLM]
    defaults: Mapping[str, Any]
    norms: Sequence[tuple[str, str]] | Callable[[HFConfig], Sequence[tuple[str, str]]]  # (ours, theirs) per layer
    biases: Callable[[HFConfig], tuple[bool, bool]]
    qk_norm: bool = False
    ffn: Callable[[HFConfig, Plan, str, str], None] = _put_mlp
    pattern: int | None = None  # the default sliding_window_pattern, for families with layer_types
    absent: Mapping[str, Any] = field(default_factory=dict)  # defaults only where the key is absent (null: none)
    layer_norm: bool = False  # LayerNorms with biases (StarCoder2), the final one included
    post_rope_norm: bool = False  # HunYuan: query_layernorm / key_layernorm at attn.frontier.{q,k}_norm_weight
    norm_transform: Callable[[Tensor], Tensor] | None = None  # Nemotron's LayerNorm1P: weight + 1
    sinks: bool = False  # sink logits: self_attn.sinks at attn.frontier.sinks
    qkv: Callable[[HFConfig, Tensor], Tensor] | None = None  # a transform of the fused qkv_proj weight and bias
    aliases: Mapping[str, str] = field(default_factory=dict)  # a config.json's own keys -> transformers' names
    rename: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None  # checkpoint names -> transformers'
    finish: Callable[[HFConfig, Plan, DecoderLM, int | None], DecoderLM] | None = None  # else _common.finish
    name: str = ""  # the family's name (messages, ``MODEL_TYPES``)
    classes: tuple[str, ...] = ()  # the transformers classes that convert


#: GLM-4-0414's norms on both sides of each sub-layer (ours, theirs)
_GLM4_NORMS = [("attn_norm", "input_layernorm"), ("attn_out_norm", "post_self_attn_layernorm"),
               ("ffn_norm", "post_attention_layernorm"), ("ffn_out_norm", "post_mlp_layernorm")]


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
                      [("attn_norm", "input_layernorm")], _attention_bias(False), pattern=4,
                      absent={"sliding_window": 4096},
        name="Cohere2", classes=("Cohere2ForCausalLM", "Cohere2Model")),
    "exaone4": Family(build_exaone4, {"rms_norm_eps": 1e-5, "hidden_act": "silu"},
                      [("attn_out_norm", "post_attention_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm")],
                      _no_bias, qk_norm=True, pattern=4, absent={"sliding_window": 4096},
        name="EXAONE 4", classes=("Exaone4ForCausalLM", "Exaone4Model")),
    "ministral3": Family(build_ministral3, {
        "rms_norm_eps": 1e-5, "head_dim": 128, "max_position_embeddings": 262144, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                            "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}},
        parts.PRE_NORMS, _no_bias,
        name="Ministral 3", classes=("Ministral3ForCausalLM", "Ministral3Model")),
    # Emu3's text model (Emu3ForCausalLM; Emu3ForConditionalGeneration's text_model): LLaMA with residual dropout
    "emu3_text_model": Family(build_emu3_text, {"rms_norm_eps": 1e-5, "max_position_embeddings": 9216, "hidden_act": "silu",
                                                "tie_word_embeddings": False, "attention_dropout": 0.1,
                                                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                              parts.PRE_NORMS, _attention_bias(False), ffn=_put_seed_mlp,
        name="Emu3 text", classes=("Emu3ForCausalLM", "Emu3TextModel")),
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
                   _GLM4_NORMS,
                   _attention_bias(True, False), ffn=_put_gate_up,
        name="GLM-4", classes=("Glm4ForCausalLM", "Glm4Model")),
    # GLM-4.1V's text decoder: GLM-4's layer; its multimodal RoPE is the 1-D one on text (equal streams)
    "glm4v_text": Family(build_glm4, {"rms_norm_eps": 1e-5, "attention_bias": True, "partial_rotary_factor": 1.0,
                                      "max_position_embeddings": 32768, "hidden_act": "silu",
                                      "num_key_value_heads": 2},
                         _GLM4_NORMS,
                         _attention_bias(True, False), ffn=_put_gate_up,
        name="GLM-4.1V text", classes=("Glm4vTextModel",)),
    # GLM-OCR's text decoder: GLM-4.1V's without q/k/v biases; its checkpoint's MTP layer dropped
    "glm_ocr_text": Family(build_glm_ocr_text, {"rms_norm_eps": 1e-5, "partial_rotary_factor": 1.0,
                                                "max_position_embeddings": 131072, "hidden_act": "silu",
                                                "num_key_value_heads": 8},
                           _GLM4_NORMS,
                           _no_bias, ffn=_put_gate_up, finish=_finish_glm_ocr,
        name="GLM-OCR text", classes=("GlmOcrTextModel",)),
    "granite": Family(build_granite, {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "hidden_act": "silu"},
                      parts.PRE_NORMS, _attention_bias(False), ffn=_put_seed_mlp, finish=_finish_granite,
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
    "paddleocr_vl_text": Family(build_paddleocr_vl_text, {
        "rms_norm_eps": 1e-5, "head_dim": 128, "max_position_embeddings": 131072, "hidden_act": "silu",
        "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        parts.PRE_NORMS, _ernie_bias, ffn=_put_ernie_mlp,
        name="PaddleOCR-VL text", classes=("PaddleOCRTextModel",)),
    "arcee": Family(build_arcee, {"rms_norm_eps": 1e-5, "hidden_act": "relu2", "max_position_embeddings": 4096,
                                  "tie_word_embeddings": False,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                    parts.PRE_NORMS, _attention_bias(False), ffn=_put_up_down,
        name="Arcee", classes=("ArceeForCausalLM", "ArceeModel")),
    "olmo": Family(build_olmo, {"max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": False,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                   (), _attention_bias(False), finish=finish_weightless,
        name="OLMo", classes=("OlmoForCausalLM", "OlmoModel")),
    "glm": Family(build_glm, {"rms_norm_eps": 1.5625e-7, "head_dim": 128, "attention_bias": True,
                              "max_position_embeddings": 131072, "hidden_act": "silu", "tie_word_embeddings": False},
                  parts.PRE_NORMS, _attention_bias(True, False), ffn=_put_gate_up,
        name="GLM", classes=("GlmForCausalLM", "GlmModel")),
    "hunyuan_v1_dense": Family(build_hunyuan_v1_dense, {
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        parts.PRE_NORMS, _attention_bias(False), post_rope_norm=True, aliases={"rope_scaling": "rope_parameters"},
        name="HunYuan-V1-Dense", classes=("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Model")),
    "hunyuan_vl_text": Family(build_hunyuan_vl_text, {
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        parts.PRE_NORMS, _attention_bias(False), post_rope_norm=True,
        aliases={"attention_head_dim": "head_dim", "org_vocab_size": "vocab_size", "pad_id": "pad_token_id",
                 "rope_scaling": "rope_parameters"},
        name="HunYuan-VL text", classes=("HunYuanVLTextModel",)),
    "nemotron": Family(build_nemotron, {"norm_eps": 1e-5, "hidden_act": "relu2", "max_position_embeddings": 4096,
                                        "tie_word_embeddings": False,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                       parts.PRE_NORMS, _attention_bias(False), ffn=_put_up_down, layer_norm=True,
                       norm_transform=parts.plus_one,
        name="Nemotron", classes=("NemotronForCausalLM", "NemotronModel")),
    "ministral": Family(build_ministral, {"rms_norm_eps": 1e-6, "num_key_value_heads": 8, "hidden_act": "silu",
                                          "max_position_embeddings": 131072, "tie_word_embeddings": False},
                        parts.PRE_NORMS, _no_bias, absent={"sliding_window": 4096},
        name="Ministral", classes=("MinistralForCausalLM", "MinistralModel")),
    "vaultgemma": Family(build_vaultgemma, {
        "rms_norm_eps": 1e-6, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "query_pre_attn_scalar": 256},
        [("attn_norm", "input_layernorm"), ("ffn_norm", "pre_feedforward_layernorm")], _attention_bias(False),
        absent={"sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        norm_transform=parts.plus_one,
        name="VaultGemma", classes=("VaultGemmaForCausalLM", "VaultGemmaModel")),
    "jais2": Family(build_jais2, {"layer_norm_eps": 1e-5, "hidden_act": "relu2", "attention_bias": True,
                                  "mlp_bias": True, "max_position_embeddings": 8192, "tie_word_embeddings": False},
                    parts.PRE_NORMS, _attention_bias(True), ffn=_put_up_down, layer_norm=True,
        name="Jais-2", classes=("Jais2ForCausalLM", "Jais2Model")),
    "hyperclovax": Family(build_hyperclovax, {"rms_norm_eps": 1e-6, "hidden_act": "silu",
                                              "max_position_embeddings": 2048, "tie_word_embeddings": False,
                                              "use_post_norm": True},
                          _hyperclovax_norms, _attention_bias(False), ffn=_put_seed_mlp, finish=_finish_hyperclovax,
        name="HyperCLOVA X", classes=("HyperCLOVAXForCausalLM", "HyperCLOVAXModel")),
    "granite_swa": Family(build_granite_swa, {"rms_norm_eps": 1e-5, "num_key_value_heads": 4, "hidden_act": "silu",
                                              "max_position_embeddings": 8192, "tie_word_embeddings": True},
                          parts.PRE_NORMS, _attention_bias(False), ffn=_put_seed_mlp, sinks=True,
                          absent={"sliding_window": 128}, finish=_finish_granite,
        name="Granite-SWA", classes=("GraniteSWAForCausalLM", "GraniteSWAModel")),
    "exaone": Family(build_llama_variant, {"rms_norm_eps": 1e-5, "num_key_value_heads": 8, "hidden_act": "silu",
                                           "max_position_embeddings": 4096, "tie_word_embeddings": False,
                                           "rope_theta": 500000.0},
                     parts.PRE_NORMS, _attention_bias(False), ffn=_put_seed_mlp, aliases=EXAONE_KEYS,
                     rename=_exaone_names,
        name="EXAONE", classes=("LlamaForCausalLM", "LlamaModel")),
    "internlm3": Family(build_llama_variant, {"rms_norm_eps": 1e-5, "num_key_value_heads": 2, "head_dim": 128,
                                              "hidden_act": "silu", "max_position_embeddings": 32768,
                                              "tie_word_embeddings": False},
                        parts.PRE_NORMS, _attention_bias(False), ffn=_put_seed_mlp,
                        aliases={"qkv_bias": "attention_bias", "bias": "mlp_bias"},
        name="InternLM3", classes=("LlamaForCausalLM", "LlamaModel")),
    "iquestcoder": Family(build_iquestcoder, {"rms_norm_eps": 1e-5, "num_key_value_heads": 8, "head_dim": 128,
                                              "hidden_act": "silu", "max_position_embeddings": 131072,
                                              "tie_word_embeddings": False},
                          parts.PRE_NORMS, _attention_bias(False), ffn=_put_seed_mlp,
        name="IQuest-Coder", classes=("LlamaForCausalLM", "LlamaModel")),
    "nanochat": Family(build_nanochat, {"rms_norm_eps": 1e-6, "hidden_act": "relu2", "max_position_embeddings": 2048,
                                        "tie_word_embeddings": False},
                       (), _attention_bias(False), ffn=_put_fc, qkv=_nanochat_qkv,
                       absent={"final_logit_softcapping": 15.0}, finish=finish_weightless,
        name="NanoChat", classes=("NanoChatForCausalLM", "NanoChatModel")),
    "bitnet": Family(build_bitnet, {"rms_norm_eps": 1e-5, "num_key_value_heads": 5, "hidden_act": "relu2",
                                    "max_position_embeddings": 2048, "tie_word_embeddings": False,
                                    "rope_theta": 500000.0},
                     [*parts.PRE_NORMS, ("attn.out_proj.sub_norm", "self_attn.attn_sub_norm"),
                      ("ffn.down_proj.sub_norm", "mlp.ffn_sub_norm")], _attention_bias(False),
        name="BitNet", classes=("BitNetForCausalLM", "BitNetModel")),
    # Cosmos3-Edge's text decoder: Arcee's layers (ReLU² MLP) with the MLP at fc1 / fc2 under Qwen3-VL's
    # multimodal RoPE (the 1-D RoPE on text: three equal position streams)
    "cosmos3_edge_text": Family(build_cosmos3_edge_text, {
        "rms_norm_eps": 1e-5, "head_dim": 128, "hidden_act": "relu2", "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e8}},
        parts.PRE_NORMS, _attention_bias(False), ffn=_put_fc,
        name="Cosmos3-Edge text", classes=("Cosmos3EdgeTextModel",)),
    "molmo2_text": Family(build_molmo2_text, {
        "rms_norm_eps": 1e-6, "head_dim": 128, "num_key_value_heads": 8, "hidden_act": "silu",
        "max_position_embeddings": 36864, "tie_word_embeddings": False, "additional_vocab_size": 128,
        "qk_norm_type": "qwen3", "norm_after": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        _molmo2_norms, _helium_biases, qk_norm=True, aliases={"qkv_bias": "attention_bias", "layer_norm_eps": "rms_norm_eps"},
        rename=_molmo2_names,
        name="Molmo2 text", classes=("Molmo2TextModel",)),
}
#: Granite-4-Vision's text decoder: Granite's (its deepstack features enter only with images; the wrapper's
#: head divides by ``logits_scaling`` as Granite's does)
FAMILIES["granite4_vision_text"] = dataclasses.replace(FAMILIES["granite"], name="Granite-4-Vision text",
                                                       classes=("Granite4VisionTextModel",))


def canonical(hf: HFConfig) -> tuple[HFConfig, Family]:
    """``hf`` as transformers reads it (a ``config.json``'s own keys under transformers' names, the
    family's defaults where a key is absent; ``layer_types`` from ``sliding_window_pattern``) and its
    :class:`Family`."""
    model_type = hf.raw("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise hf.unsupported(f"model_type={model_type!r} (this converter: {', '.join(map(repr, FAMILIES))})")
    data = dict(hf.data)
    for alias, key in family.aliases.items():
        if alias in data and data.get(key) is None:
            data[key] = data.pop(alias)
    out = HFConfig(data, hf.source, hf.arch).with_defaults(family.defaults)
    out.data.update({k: v for k, v in family.absent.items() if k not in data})
    if family.pattern is not None and out.has("sliding_window"):
        out = _pattern_types(out, family.pattern)
    return out, family


def build_dense(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of the config's ``model_type`` (random weights; see the module docstring)."""
    out, family = canonical(hf)
    return family.build(out, head_size=head_size, device=device, dtype=dtype)


def _transformed(plan: Plan, names: Sequence[str], fn: Callable[[Tensor], Tensor]) -> None:
    """The planned tensors ``names`` (those planned) replaced by ``fn`` of them."""
    for name in names:
        if name in plan.values:
            t, key = plan.values[name]
            plan.values[name] = (fn(t), key)


def put_layer(hf: HFConfig, family: Family, plan: Plan, i: int) -> None:
    """Plan layer ``i``: attention (biases, QK norms, sinks), MLP (``family.ffn``) and norms."""
    o, h = f"blocks.{i}.", f"layers.{i}.self_attn."
    qkv_bias, out_bias = family.biases(hf)
    load_qkv_into(plan, f"{o}attn", tuple(f"{h}{n}_proj.weight" for n in "qkv"),
                  tuple(f"{h}{n}_proj.bias" for n in "qkv") if qkv_bias else None, qkv_bias)
    if family.qkv is not None:
        _transformed(plan, [f"{o}attn.qkv_proj.weight", f"{o}attn.qkv_proj.bias"], functools.partial(family.qkv, hf))
    plan.put_pairs(f"{o}attn.", h, [("out_proj", "o_proj")], bias=out_bias)
    if family.post_rope_norm:
        for n, theirs in (("q_norm", "query_layernorm"), ("k_norm", "key_layernorm")):
            plan.put(f"{o}attn.frontier.{n}_weight", f"{h}{theirs}.weight")
    if family.qk_norm:
        for n in ("q_norm", "k_norm"):
            plan.put(f"{o}attn.frontier.{n}_weight", f"{h}{n}.weight")
    if family.sinks:
        plan.put(f"{o}attn.frontier.sinks", f"{h}sinks")
    if hf.get("use_qk_norm", False, bool):  # Command R+'s per-head LayerNorms (the only dense family with the key)
        plan.put_pairs(f"{o}attn.", h, [("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")], bias=False)
    family.ffn(hf, plan, f"{o}ffn.", f"layers.{i}.mlp.")
    for ours, theirs in family.norms(hf) if callable(family.norms) else family.norms:
        plan.put(f"{o}{ours}.weight", f"layers.{i}.{theirs}.weight", family.norm_transform)
        if family.layer_norm:
            plan.put(f"{o}{ours}.bias", f"layers.{i}.{theirs}.bias")


def convert_dense(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> nn.Module:
    """Build the decoder of the config's ``model_type`` and copy the weights (the head follows them)."""
    hf, family = canonical(hf)
    if family.rename is not None:
        sd = family.rename(sd)
    model, plan, head_size = parts.start(hf, sd, family.build, device=device, dtype=dtype)
    for i in range(model.depth):
        put_layer(hf, family, plan, i)
    if family.layer_norm:
        plan.put("norm.bias", "norm.bias")
    if family.finish is not None:
        return family.finish(hf, plan, model, head_size)
    return parts.finish(plan, model, head_size, norm_transform=family.norm_transform)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``: every ``Family``
DISPATCH = {t: parts.Dispatch(f.name, convert_dense, f.classes) for t, f in FAMILIES.items()}
