"""The GPT-NeoX lineage -> :class:`~attnzoo.DecoderLM`: GPT-NeoX / Pythia (``gpt_neox``), Phi-1 / 1.5 / 2
(``phi``), StableLM (``stablelm``), Persimmon (``persimmon``), GPT-J (``gptj``) and CodeGen (``codegen``),
as ``*ForCausalLM`` and ``*Model`` (one builder and one weight map over a table of families). Line
numbers: transformers 5.25's ``models/<name>/modeling_<name>.py``.

What the six share: LayerNorms with biases (the blocks' and the final one), RoPE on the first
``rotary_dim`` channels of each head only (partial rotary), an MLP of two biased linear maps (StableLM's
gated one aside), multi-head attention with the score scale ``head_dim ** -0.5``. How their layers
differ (:class:`Layout`):

* GPT-NeoX (``modeling_gpt_neox.py``): one ``query_key_value`` projection whose rows are
  ``[q_h; k_h; v_h]`` per head (193-196; permuted into attnzoo's ``[q; k; v]``), biased with ``dense``
  by ``attention_bias``; ``use_parallel_residual`` (default) the two-norm parallel layer
  ``x + attn(ln1(x)) + mlp(ln2(x))`` (260-262; :class:`TwoNormParallelBlock`), else the sequential
  pre-norm layer (264-268); split-half RoPE on ``int(head_dim * partial_rotary_factor)`` channels
  (175-176; the legacy ``rotary_pct`` / ``rotary_emb_base`` keys read too); ``hidden_dropout`` on the
  embeddings (344) and both sub-layer outputs; the untied ``lm_head`` (legacy checkpoints:
  ``embed_out``).
* Phi (``modeling_phi.py``): the one-norm parallel layer ``x + attn(ln(x)) + mlp(ln(x))`` (285-288;
  :class:`~attnzoo.models.families.dense.ParallelBlock`), q/k/v/dense always biased (167), optional
  ``qk_layernorm``: one biased LayerNorm over ``head_dim`` shared by all heads, before RoPE (171-176;
  :class:`LayerNormQKAttention`), GQA, an LM head *with a bias* (400), ``resid_pdrop`` on both sub-layer
  outputs, ``embd_pdrop`` on the embeddings (366).
* StableLM (``modeling_stablelm.py``): a gated bias-free MLP, q/k/v biased by ``use_qkv_bias`` and a
  bias-free ``o_proj`` (242), ``qk_layernorm``: a bias-free LayerNorm *per head* (156-168, 246), GQA,
  ``use_parallel_residual``: the one-norm parallel layer (359-364) instead of the sequential one;
  ``hidden_dropout`` on the MLP output only (363, 371; :class:`DroppedFeedForward`).
* Persimmon (``modeling_persimmon.py``): the fused per-head ``query_key_value`` of GPT-NeoX (216-229),
  ``qk_layernorm`` (default on) as Phi's, the sequential pre-norm layer, squared ReLU, ``hidden_dropout``
  on the MLP output only (343).
* GPT-J (``modeling_gptj.py``): the one-norm parallel layer (239), bias-free q/k/v/out, RoPE on adjacent
  channel pairs (``rotate_every_two``, 67-77) of the first ``rotary_dim`` channels with base 10000
  (46-50, 146-156; ``rotary_dim=None`` rotates ``hidden_size`` channels, which fits a head only when there
  is one head), an LM head with a bias (375), ``resid_pdrop`` on both sub-layer outputs, ``embd_pdrop`` on
  the embeddings (340). Keys ``n_embd``, ``n_head``, ``n_layer``, ``n_inner`` (default ``4 n_embd``).
* CodeGen (``modeling_codegen.py``): GPT-J's layer with one bias-free ``qkv_proj`` whose rows are four
  groups (``mp_num = 4``, 124) of ``[q_g; v_g; k_g]`` (137-139; permuted into ``[q; k; v]``).

Refused by name: an activation without an attnzoo MLP, a partial rotary factor that rotates an odd
number of channels (or none, or more than a head), GPT-J / CodeGen's ``rotary_dim`` (0, odd, wider than
a head, or ``None`` with several heads: transformers' own forward fails there), CodeGen's ``n_embd`` not a
multiple of its four groups, Phi's ``head_dim`` other than ``hidden_size / heads`` with ``qk_layernorm``
(the norm's width; transformers fails), rope types attnzoo's rotary does not know.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._qknorm import HeadLayerNorm, LayerNormQKAttention, QKLayerNorm
from attnzoo.models.families.dense import UNGATED, ParallelBlock
from attnzoo.models.hf._state import HFConfig, Plan, float_dtype, load_qkv_into
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.parts import DecoderParts, LMHead, head_for
from attnzoo.nn.attention import MultiHeadAttention, build_softmax

__all__ = ["DEFAULTS", "DISPATCH", "DroppedFeedForward", "HeadLayerNorm", "LayerNormQKAttention", "Layout",
           "QKLayerNorm", "TwoNormParallelBlock", "build_neox", "canonical", "convert_neox"]


# --------------------------------------------------------------------------- family-local modules
class TwoNormParallelBlock(TransformerBlock):
    """GPT-NeoX's parallel layer (``modeling_gpt_neox.py`` 260-262): the attention and the MLP read
    the residual stream through their own norms and are added to it together,
    ``x + drop(attn(attn_norm(x))) + drop(ffn(ffn_norm(x)))``. Built from :class:`BlockLayers`
    (``norm`` twice). Shapes: ``x [B, N, C] -> [B, N, C]`` (packed ``[1, T, C]`` with ``cu_seqlens``)."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None,  # type: ignore[override]
                key_padding: Tensor | None = None, context_mask: Any = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The arguments of :meth:`TransformerBlock.forward`; no cross-attention."""
        mask = self._self_only(x, context, context_mask, mask, key_padding)
        if self.ffn is None or self.ffn_norm is None:
            raise ValueError(f"{type(self).__name__}: built without a feed-forward layer")
        mixed = self._mix(self.attn_norm(x), mask, cache, positions, cu_seqlens)  # [B, N, C]
        return x + self.dropout(mixed) + self.dropout(self.ffn(self.ffn_norm(x)))


class DroppedFeedForward(FeedForward):
    """:class:`~attnzoo.blocks.FeedForward` with dropout on its *output* (``out_dropout``; StableLM's
    and Persimmon's ``hidden_dropout``, which drops the MLP output and not the attention's). Same
    weights as ``FeedForward``. Shapes: ``[B, N, C] -> [B, N, C]``."""

    def __init__(self, dim: int, hidden: int, activation: str, *, bias: bool, out_dropout: float,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, hidden, activation, bias=bias, device=device, dtype=dtype)
        self.out_dropout = nn.Dropout(out_dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_dropout(super().forward(x))  # [B, N, C]


# --------------------------------------------------------------------------- the families' layouts
@dataclass(frozen=True)
class Layout:
    """One family's layer, read from its (canonical) config: the residual form (``parallel``:
    ``"none"`` sequential pre-norm, ``"shared"`` one norm for both sub-layers, ``"two"`` GPT-NeoX's
    two norms), the biases, the QK LayerNorm, the MLP (an attnzoo :class:`FeedForward` activation;
    ``gated`` ones have ``gate_proj``), the rotated channels and their pairing, the dropouts (on both
    sub-layer outputs, on the MLP output only, on the embeddings) and the LM head's bias."""

    parallel: str
    rotary_dim: int
    activation: str
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool = True
    head_bias: bool = False
    interleaved: bool = False
    qk_layernorm: QKLayerNorm | None = None
    residual_dropout: float = 0.0
    mlp_dropout: float = 0.0
    embed_dropout: float = 0.0


def _ungated(hf: HFConfig, default: str) -> str:
    """The ungated MLP's activation (``hidden_act``) as an attnzoo name."""
    return hf.activation("hidden_act", UNGATED, default)


def _rotary_dim(hf: HFConfig, head_dim: int) -> int:
    """``int(head_dim * partial_rotary_factor)`` (``rope_parameters``' factor, else the top-level one
    :func:`canonical` set), even and in ``[2, head_dim]``."""
    factor = parts.rope_params(hf).get("partial_rotary_factor", hf.raw("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise hf.unsupported(f"partial_rotary_factor={factor!r} (supported: 0 < factor <= 1)")
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise hf.unsupported(f"partial_rotary_factor={factor!r}: {rotary} rotated channels of {head_dim} "
                             f"(supported: an even number >= 2)")
    return rotary


def _qk_norm(hf: HFConfig, *, per_head: bool, bias: bool) -> QKLayerNorm | None:
    """The QK LayerNorm of ``qk_layernorm`` (eps ``layer_norm_eps``), else ``None``."""
    return QKLayerNorm(per_head, bias, hf.req("layer_norm_eps", float)) if hf.req("qk_layernorm", bool) else None


def _layout_gpt_neox(hf: HFConfig, head_dim: int) -> Layout:
    bias, drop = hf.get("attention_bias", True, bool), hf.get("hidden_dropout", 0.0, float)
    return Layout("two" if hf.get("use_parallel_residual", True, bool) else "none", _rotary_dim(hf, head_dim),
                  _ungated(hf, "gelu"), qkv_bias=bias, out_bias=bias, residual_dropout=drop, embed_dropout=drop)


def _layout_phi(hf: HFConfig, head_dim: int) -> Layout:
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    qk = _qk_norm(hf, per_head=False, bias=True)
    if qk is not None and head_dim * H != C:  # q_layernorm is LayerNorm(hidden / heads) (modeling_phi.py 171)
        raise hf.unsupported(f"head_dim={head_dim} with qk_layernorm (the norms' width is hidden_size / "
                             f"num_attention_heads = {C // H})")
    return Layout("shared", _rotary_dim(hf, head_dim), _ungated(hf, "gelu_new"), head_bias=True, qk_layernorm=qk,
                  residual_dropout=hf.get("resid_pdrop", 0.0, float), embed_dropout=hf.get("embd_pdrop", 0.0, float))


def _layout_stablelm(hf: HFConfig, head_dim: int) -> Layout:
    return Layout("shared" if hf.get("use_parallel_residual", False, bool) else "none", _rotary_dim(hf, head_dim),
                  hf.activation("hidden_act", parts.GATED, "silu"), qkv_bias=hf.get("use_qkv_bias", False, bool),
                  out_bias=False, mlp_bias=False, qk_layernorm=_qk_norm(hf, per_head=True, bias=False),
                  mlp_dropout=hf.get("hidden_dropout", 0.0, float))


def _layout_persimmon(hf: HFConfig, head_dim: int) -> Layout:
    return Layout("none", _rotary_dim(hf, head_dim), _ungated(hf, "relu2"),
                  qk_layernorm=_qk_norm(hf, per_head=False, bias=True),
                  mlp_dropout=hf.get("hidden_dropout", 0.0, float))


def _layout_gptj(hf: HFConfig, head_dim: int) -> Layout:
    rotary = hf.raw("rotary_dim")
    if isinstance(rotary, bool) or not isinstance(rotary, int) or not 2 <= rotary <= head_dim or rotary % 2:
        raise hf.unsupported(f"rotary_dim={rotary!r} with head_dim={head_dim} (supported: an even number of channels "
                             f"in [2, head_dim]; rotary_dim=None rotates hidden_size channels)")
    return Layout("shared", rotary, _ungated(hf, "gelu_new"), qkv_bias=False, out_bias=False, head_bias=True,
                  interleaved=True, residual_dropout=hf.get("resid_pdrop", 0.0, float),
                  embed_dropout=hf.get("embd_pdrop", 0.0, float))


# --------------------------------------------------------------------------- config
def _neox_legacy(hf: HFConfig) -> dict[str, Any]:
    """GPT-NeoX's legacy ``rotary_pct`` / ``rotary_emb_base`` (``configuration_gpt_neox.py``,
    ``convert_rope_params_to_dict``) under the canonical names, where those are absent."""
    out: dict[str, Any] = {}
    if hf.has("rotary_pct") and not hf.has("partial_rotary_factor"):
        out["partial_rotary_factor"] = hf.raw("rotary_pct")
    if hf.has("rotary_emb_base") and not hf.has("rope_theta"):
        out["rope_theta"] = hf.raw("rotary_emb_base")
    return out


def _gptj_keys(hf: HFConfig) -> dict[str, Any]:
    """GPT-J's / CodeGen's keys under the canonical names (``n_inner`` ``None``: ``4 n_embd``;
    ``rotary_dim`` ``None``: ``n_embd``, ``modeling_gptj.py`` 56)."""
    C = hf.req("n_embd")
    rotary = hf.data.get("rotary_dim", 64)
    return {"hidden_size": C, "num_attention_heads": hf.req("n_head"), "num_hidden_layers": hf.req("n_layer"),
            "max_position_embeddings": hf.req("n_positions"), "intermediate_size": hf.get("n_inner", 4 * C),
            "layer_norm_eps": hf.req("layer_norm_epsilon", float), "hidden_act": hf.req("activation_function", str),
            "attention_dropout": hf.get("attn_pdrop", 0.0, float), "rotary_dim": C if rotary is None else rotary,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@dataclass(frozen=True)
class Keys:
    """A family's checkpoint names: the base model's prefix in the head classes, the token
    embedding, the layers, each layer's attention (its q/k/v layout: ``"q_k_v"`` three projections,
    ``"per_head"`` one ``query_key_value`` of ``[q_h; k_h; v_h]`` rows per head, ``"mp4"`` CodeGen's
    ``qkv_proj`` in four ``[q_g; v_g; k_g]`` groups) and output projection, its MLP and norms
    (``(ours, theirs)`` pairs), the final norm, and checkpoint buffers to ignore (regexes)."""

    prefix: str
    embedding: str
    layers: str
    attention: str
    qkv: str
    out: str
    mlp: tuple[tuple[str, str], ...]
    norms: tuple[str, ...]
    final_norm: str
    ignore: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """One family: its name and transformers classes, its config defaults (:data:`DEFAULTS`), its
    :class:`Layout` reader ``(canonical hf, head_dim) -> Layout``, its checkpoint :class:`Keys`, and
    whether its heads follow ``num_key_value_heads`` / ``head_dim`` (Phi, StableLM) or always number
    ``num_attention_heads`` of ``hidden / heads``."""

    name: str
    classes: tuple[str, ...]
    defaults: Mapping[str, Any]
    layout: Callable[[HFConfig, int], Layout]
    keys: Keys
    gqa: bool = False


_NEOX_MLP = (("up_proj", "dense_h_to_4h"), ("down_proj", "dense_4h_to_h"))
_PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
_GPTJ_DEFAULTS: dict[str, Any] = {"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16,
                  "rotary_dim": 64, "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                  "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}
_GPTJ_KEYS: dict[str, Any] = dict(prefix="transformer.", embedding="wte", layers="h", attention="attn", out="out_proj",
                  mlp=(("up_proj", "fc_in"), ("down_proj", "fc_out")), norms=("ln_1",), final_norm="ln_f")

#: each family's config defaults (its ``*Config`` class's, for the keys read here) that a
#: ``config.json`` may leave out
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_neox": {"vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
                 "intermediate_size": 24576, "hidden_act": "gelu", "attention_dropout": 0.0, "hidden_dropout": 0.0,
                 "max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "tie_word_embeddings": False,
                 "use_parallel_residual": True, "attention_bias": True, "partial_rotary_factor": 0.25},
    "phi": {"vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
            "num_attention_heads": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
            "hidden_act": "gelu_new", "max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
            "tie_word_embeddings": False, "qk_layernorm": False, "partial_rotary_factor": 0.5},
    "stablelm": {"vocab_size": 50304, "intermediate_size": 6912, "hidden_size": 2560, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
                 "max_position_embeddings": 4096, "layer_norm_eps": 1e-5, "tie_word_embeddings": False,
                 "use_qkv_bias": False, "qk_layernorm": False, "use_parallel_residual": False, "hidden_dropout": 0.0,
                 "attention_dropout": 0.0, "partial_rotary_factor": 0.25},
    "persimmon": {"vocab_size": 262144, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 36,
                  "num_attention_heads": 64, "hidden_act": "relu2", "max_position_embeddings": 16384,
                  "layer_norm_eps": 1e-5, "tie_word_embeddings": False, "qk_layernorm": True, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0, "partial_rotary_factor": 0.5},
    "gptj": _GPTJ_DEFAULTS,
    "codegen": _GPTJ_DEFAULTS,
}

FAMILIES: dict[str, Family] = {
    "gpt_neox": Family("GPT-NeoX", ("GPTNeoXForCausalLM", "GPTNeoXModel"), DEFAULTS["gpt_neox"], _layout_gpt_neox,
                       Keys("gpt_neox.", "embed_in", "layers", "attention", "per_head", "dense", _NEOX_MLP,
                            _PRE_NORMS, "final_layer_norm",
                            (r"(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",))),
    "phi": Family("Phi", ("PhiForCausalLM", "PhiModel"), DEFAULTS["phi"], _layout_phi,
                  Keys("model.", "embed_tokens", "layers", "self_attn", "q_k_v", "dense",
                       (("up_proj", "fc1"), ("down_proj", "fc2")), ("input_layernorm",), "final_layernorm"),
                  gqa=True),
    "stablelm": Family("StableLM", ("StableLmForCausalLM", "StableLmModel"), DEFAULTS["stablelm"], _layout_stablelm,
                       Keys("model.", "embed_tokens", "layers", "self_attn", "q_k_v", "o_proj",
                            tuple((n, n) for n in ("gate_proj", "up_proj", "down_proj")), _PRE_NORMS, "norm"),
                       gqa=True),
    "persimmon": Family("Persimmon", ("PersimmonForCausalLM", "PersimmonModel"), DEFAULTS["persimmon"],
                        _layout_persimmon, Keys("model.", "embed_tokens", "layers", "self_attn", "per_head", "dense",
                                                _NEOX_MLP, _PRE_NORMS, "final_layernorm")),
    "gptj": Family("GPT-J", ("GPTJForCausalLM", "GPTJModel"), DEFAULTS["gptj"], _layout_gptj,
                   Keys(qkv="q_k_v", ignore=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",), **_GPTJ_KEYS)),
    "codegen": Family("CodeGen", ("CodeGenForCausalLM", "CodeGenModel"), DEFAULTS["codegen"], _layout_gptj,
                      Keys(qkv="mp4", ignore=(r"(transformer\.)?h\.\d+\.attn\.causal_mask",), **_GPTJ_KEYS)),
}


def canonical(hf: HFConfig) -> tuple[HFConfig, Family]:
    """``hf`` as transformers reads it, under one set of key names (the family's defaults where a key
    is absent; GPT-J's ``n_embd`` ... as ``hidden_size`` ...; one head count and width where the family
    has no GQA), and its :class:`Family`."""
    model_type = hf.raw("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise hf.unsupported(f"model_type={model_type!r} (this converter: {', '.join(map(repr, FAMILIES))})")
    legacy = _neox_legacy(hf) if model_type == "gpt_neox" else {}
    out = HFConfig({**hf.data, **legacy}, hf.source, hf.arch).with_defaults(family.defaults)
    if model_type in ("gptj", "codegen"):
        out.data.update(_gptj_keys(HFConfig({**out.data, "rotary_dim": hf.data.get("rotary_dim", 64)},
                                            hf.source, hf.arch)))
    if not family.gqa:  # transformers reads neither key for these (modeling_gpt_neox.py 171)
        C, H = out.req("hidden_size"), out.req("num_attention_heads")
        if C % H:
            raise CheckpointFormatError(f"{hf.source}: hidden_size={C} is not a multiple of num_attention_heads={H}")
        out.data.update(head_dim=C // H, num_key_value_heads=H)
    if model_type == "codegen" and out.req("hidden_size") % 4:
        raise hf.unsupported(f"n_embd={out.req('hidden_size')} (CodeGen's qkv_proj is four groups: a multiple of 4)")
    return out, family


# --------------------------------------------------------------------------- the builder
def _attention(cls: type[MultiHeadAttention], dim: int, heads: int, settings: Mapping[str, Any],
               out_bias: bool) -> nn.Module:
    """``cls`` of ``settings`` (q/k/v biased by ``settings["bias"]``), its output projection biased iff
    ``out_bias``."""
    module = build_softmax(cls, dim, heads, **settings)
    if not out_bias and module.out_proj.bias is not None:
        module.out_proj.register_parameter("bias", None)
    return module


def _block(dim: int, layout: Layout, layers: BlockLayers) -> nn.Module:
    if layout.parallel == "two":
        return TwoNormParallelBlock(dim, layers=layers)
    return ParallelBlock(dim, layers) if layout.parallel == "shared" else TransformerBlock(dim, layers=layers)


def build_neox(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of the config's ``model_type`` (random weights; see the module docstring)."""
    hf, family = canonical(hf)
    C, H, depth, D = parts.dims(hf)
    layout, kw = family.layout(hf, D), {"device": device, "dtype": dtype}
    eps, V = hf.req("layer_norm_eps", float), hf.req("vocab_size")
    rope = parts.rotary(hf, parts.rope_params(hf), D, rotary_dim=layout.rotary_dim)
    rope.interleaved = layout.interleaved  # adjacent pairs (GPT-J): the rotation reads the flag
    settings: dict[str, Any] = {**parts.attention_factory(hf, window=None, rope=rope, **kw).keywords,
                                "bias": layout.qkv_bias}
    cls: type[MultiHeadAttention] = MultiHeadAttention
    if layout.qk_layernorm is not None:
        cls, settings["qk_layernorm"] = LayerNormQKAttention, layout.qk_layernorm
    attn = functools.partial(_attention, cls, C, H, settings, layout.out_bias)
    F_ = hf.req("intermediate_size")
    ffn = (functools.partial(DroppedFeedForward, C, F_, layout.activation, bias=layout.mlp_bias,
                             out_dropout=layout.mlp_dropout, **kw) if layout.mlp_dropout
           else functools.partial(FeedForward, C, F_, layout.activation, bias=layout.mlp_bias, **kw))
    norm = functools.partial(nn.LayerNorm, C, eps=eps, **kw)
    layers = BlockLayers(attention=attn, feed_forward=ffn, norm=norm, dropout=layout.residual_dropout)
    blocks = [_block(C, layout, layers) for _ in range(depth)]
    cfg = DecoderConfig(V, C, depth, H, pos="rope", norm="layer", norm_eps=eps, dropout=layout.embed_dropout,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool), max_seq_len=parts.max_positions(hf))
    head = (LMHead(C, V, bias=True, **kw) if head_size is None and layout.head_bias
            else head_for(C, V, head_size, **kw))
    return DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, norm=norm(), head=head), **kw)


# --------------------------------------------------------------------------- weights
def _fused_rows(mode: str, heads: int, head_dim: int) -> Tensor:
    """The row order taking a fused q/k/v projection's rows to attnzoo's ``[q; k; v]``: ``per_head``
    ``[q_h; k_h; v_h]`` per head (GPT-NeoX, Persimmon), ``mp4`` CodeGen's four groups of
    ``[q_g; v_g; k_g]``."""
    if mode == "per_head":
        return torch.arange(3 * heads * head_dim).view(heads, 3, head_dim).transpose(0, 1).reshape(-1)
    C = heads * head_dim
    return torch.arange(3 * C).view(4, 3, C // 4)[:, [0, 2, 1]].transpose(0, 1).reshape(-1)


def _put_attention(plan: Plan, keys: Keys, layout: Layout, o: str, h: str, heads: tuple[int, int, int]) -> None:
    """One layer's attention at ``{o}attn`` from ``{h}{keys.attention}.``: q/k/v (fused or not), the
    output projection, the QK LayerNorms. ``heads``: ``(H, Hkv, D)``."""
    a = f"{h}{keys.attention}."
    if keys.qkv == "q_k_v":
        bias = tuple(f"{a}{n}_proj.bias" for n in "qkv") if layout.qkv_bias else None
        load_qkv_into(plan, f"{o}attn", tuple(f"{a}{n}_proj.weight" for n in "qkv"), bias, layout.qkv_bias)
    else:
        name = "query_key_value" if keys.qkv == "per_head" else "qkv_proj"
        rows = _fused_rows(keys.qkv, heads[0], heads[2])
        for what in ("weight", "bias") if layout.qkv_bias else ("weight",):
            plan.put(f"{o}attn.qkv_proj.{what}", f"{a}{name}.{what}", lambda t, r=rows: t[r])
    plan.put_pairs(f"{o}attn.", a, [("out_proj", keys.out)], bias=layout.out_bias)
    qk = layout.qk_layernorm
    if qk is not None and qk.per_head:  # StableLM: one LayerNorm module per head
        for ours, n in (("q_layernorm", heads[0]), ("k_layernorm", heads[1])):
            plan.put_cat(f"{o}attn.{ours}.weight", [f"{a}{ours}.norms.{j}.weight" for j in range(n)],
                         lambda t, n=n: t.view(n, -1))
    elif qk is not None:
        plan.put_pairs(f"{o}attn.", a, [("q_layernorm", "q_layernorm"), ("k_layernorm", "k_layernorm")])


def _start(hf: HFConfig, sd: dict[str, Tensor], family: Family) -> tuple[dict[str, Tensor], str, int | None]:
    """``(sd, prefix, head_size)``: the checkpoint (GPT-NeoX's legacy ``embed_out`` read as ``lm_head``),
    the base model's prefix when the checkpoint has one (a head class), and the head: ``None`` an LM
    head, ``k`` the rows of a ``score`` head, ``0`` none (a base ``*Model``)."""
    if "embed_out.weight" in sd and "lm_head.weight" not in sd:  # conversion_mapping.py: ^embed_out. -> lm_head.
        sd = {("lm_head." + k[len("embed_out."):] if k.startswith("embed_out.") else k): v for k, v in sd.items()}
    prefix = family.keys.prefix if any(k.startswith(family.keys.prefix) for k in sd) else ""
    if "score.weight" in sd:
        return sd, prefix, int(sd["score.weight"].shape[0])
    return sd, prefix, None if prefix else 0


def convert_neox(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder of the config's ``model_type`` and copy the weights (the head follows them)."""
    hf, family = canonical(hf)
    keys = family.keys
    sd, prefix, head_size = _start(hf, sd, family)
    model = build_neox(hf, head_size=head_size, device=device, dtype=dtype or float_dtype(sd))
    _, H, _, D = parts.dims(hf)
    layout, heads = family.layout(hf, D), (H, hf.get("num_key_value_heads", H), D)
    plan = parts.plan_for(sd, prefix, hf.arch)
    plan.put("tok_emb.weight", f"{keys.embedding}.weight")
    norms = keys.norms[:1] if layout.parallel == "shared" else keys.norms
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"{keys.layers}.{i}."
        _put_attention(plan, keys, layout, o, h, heads)
        plan.put_pairs(f"{o}ffn.", f"{h}mlp.", keys.mlp, bias=layout.mlp_bias)
        plan.put_pairs(o, h, zip(("attn_norm", "ffn_norm"), norms, strict=False))
    plan.put_pairs("", "", [("norm", keys.final_norm)])
    patterns = [r"(\w+\.)?rotary_emb\w*\.\w+", *keys.ignore]
    parts.put_head(plan, head_size, model.tie_embeddings, patterns)
    if head_size is None and layout.head_bias:
        plan.put("lm_head.bias", "lm_head.bias")
    plan.apply(model, ignore=patterns)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``: every :class:`Family`
DISPATCH = {t: parts.Dispatch(f.name, convert_neox, f.classes) for t, f in FAMILIES.items()}
