"""The classic decoders from before RoPE became the rule -> :class:`~attnzoo.DecoderLM`: Falcon
(``falcon``), StarCoder 1 / SantaCoder (``gpt_bigcode``), BLOOM (``bloom``), MPT (``mpt``), OPT
(``opt``) and GPT-Neo (``gpt_neo``), as ``*ForCausalLM`` and the base ``*Model``. Line numbers:
transformers 5.25's ``models/<name>/modeling_<name>.py``.

* Falcon (``modeling_falcon.py``): one fused ``query_key_value`` in one of three layouts (297-306):
  ``new_decoder_architecture`` groups ``[num_kv_heads, heads / num_kv_heads + 2, D]`` (each group's
  queries, then its key and value), ``multi_query`` is ``[q; k; v]`` with one key/value head, else
  the heads interleave ``[H, 3, D]``; the rows are reordered into attnzoo's ``[q; k; v]`` at load
  (:func:`grouped_rows`). Layers (357-438): sequential pre-norm (``parallel_attn=False``:
  ``input_layernorm``, ``post_attention_layernorm``), parallel with one norm (``x + attn(n) +
  mlp(n)``, dense's :class:`~attnzoo.models.families.dense.ParallelBlock`) or, with
  ``new_decoder_architecture`` and ``num_ln_in_parallel_attn`` 2 (its default there, 368-369),
  parallel with two (``ln_attn``, ``ln_mlp``; GPT-NeoX's layer,
  :class:`~attnzoo.models.families.neox.TwoNormParallelBlock`); ``bias`` on every linear
  layer; an ungated MLP (``activation``, exact GELU by default); RoPE (``rope_parameters``), or with
  ``alibi`` ALiBi whose bias is ``bf16(bf16(slope) * p) / sqrt(D)`` at the key's position ``p``
  counted over the attention mask's real tokens (147-176, 585-596: the product is rounded to
  bfloat16, so it is reproduced as computed, :class:`FalconAlibiAttention`). The combinations
  transformers' own layer cannot run (``new_decoder_architecture`` without ``parallel_attn``;
  ``num_ln_in_parallel_attn`` 2 without the new architecture, or other than 1 or 2; the interleaved
  layout with ``num_kv_heads`` other than the head count) are refused by name.
* GPT-BigCode (``modeling_gpt_bigcode.py``): GPT-2's layer in ``nn.Linear`` form with learned
  absolute positions (``wpe``), one key/value head (``multi_query``: ``c_attn`` rows ``[q; k; v]``,
  201-204) or per-head interleaved ``[H, 3, D]`` (206-212), ``scale_attn_weights`` (the scale 1
  without it, 139); ``add_cross_attention`` is refused.
* BLOOM (``modeling_bloom.py``): a LayerNorm after the token embedding (``word_embeddings_layernorm``,
  425; minimax's :class:`~attnzoo.models.families.minimax.NormedEmbedding`), ALiBi with the paper's
  slopes added to the scaled scores (46-77, 271; :func:`~attnzoo.alibi_slopes`), per-head
  interleaved ``query_key_value`` (``[H, 3, D]``, 215), every linear layer biased, the tanh GELU (121;
  its constant ``0.79788456`` is ``sqrt(2 / pi)`` to 8 digits); with
  ``apply_residual_connection_post_layernorm`` the residuals are taken after the norms (376, 395;
  :class:`ResidualNormBlock`). ``pretraining_tp`` / ``slow_but_exact`` only split the output
  projections' sums (300: the same products, another summation order).
* MPT (``modeling_mpt.py``): ALiBi (43-63) whose slopes, with the ``alibi_bias_max`` of 8 transformers
  always uses (320: the config's value is not passed), are the paper's (:func:`~attnzoo.alibi_slopes`),
  so another value is refused; ``clip_qkv`` (99-100, dense's
  :class:`~attnzoo.models.families.dense.ClampedLinear`), ``softmax_scale`` (77-79), no biases
  anywhere, bias-free LayerNorms (167), an exact-GELU MLP of ``4 * d_model`` (144). transformers'
  ``MptModel`` implements nothing else of the original MosaicML options, so the ones that would change
  the original's outputs are refused by name: ``attn_config.alibi=False``, ``qk_ln``, ``prefix_lm``,
  ``attn_type`` other than ``multihead_attention``, ``logit_scale``, ``no_bias=False``,
  ``expansion_ratio`` other than 4, ``norm_type`` other than a LayerNorm.
* OPT (``modeling_opt.py``): learned positions with an offset of 2 counted over the attention mask
  (``embed_positions``, 46-71; its rows 2.. load as attnzoo's table, rows 0-1 hold only the padded
  slots' vectors), pre- or post-norm layers (``do_layer_norm_before``, 217-253), ``enable_bias``,
  ``layer_norm_elementwise_affine``, the final LayerNorm only with pre-norm layers and not with
  ``_remove_final_layer_norm`` (308), ``project_in`` / ``project_out`` when ``word_embed_proj_dim``
  differs from ``hidden_size`` (296-303: the embedding and the LM head are that narrower width;
  ``project_in`` runs after the token embedding, ``project_out`` after the final norm, so the base
  model's output is ``word_embed_proj_dim`` wide).
* GPT-Neo (``modeling_gpt_neo.py``): ``attention_types`` expanded to one kind per layer, ``local``
  layers attending the ``window_size`` keys up to and including their own (68: a window of
  ``window_size - 1``), unscaled scores (scale 1, 112), q/k/v without biases and a biased output
  projection (88-89), learned positions.

Positions: attnzoo counts a left-padded row's positions over its real tokens, as transformers'
``generate`` does. The ``forward`` of GPT-BigCode and GPT-Neo without ``position_ids`` counts them
from the first slot, padding included (``modeling_gpt_bigcode.py`` 438, ``modeling_gpt_neo.py``
454: a left-padded row then differs there); OPT's positions and Falcon's ALiBi count over the mask
in ``forward`` too, and RoPE / ALiBi on relative distances do not depend on it. Dropout
probabilities (training only) are not carried, as for GPT-2.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.dense import ParallelBlock, clamped_projection, make_attention
from attnzoo.models.families.minimax import NormedEmbedding
from attnzoo.models.families.neox import TwoNormParallelBlock
from attnzoo.models.hf._state import HFConfig, Plan, float_dtype, load_qkv_into
from attnzoo.models.hf.bert import ACTIVATIONS
from attnzoo.models.parts import DecoderParts, LMHead, head_for
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.packing import REFUSAL
from attnzoo.nn.positional import alibi_slopes

__all__ = ["DEFAULTS", "DISPATCH", "FalconAlibiAttention", "ResidualNormBlock", "build_bloom",
           "build_falcon", "build_gpt_bigcode", "build_gpt_neo", "build_mpt", "build_opt", "canonical", "grouped_rows"]

Factory = Callable[[], nn.Module]

#: each config class's defaults of the keys read here (``configuration_<name>.py``), for a
#: ``config.json`` that leaves them out
DEFAULTS: dict[str, dict[str, Any]] = {
    "falcon": {"vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
               "layer_norm_epsilon": 1e-5, "alibi": False, "new_decoder_architecture": False, "multi_query": True,
               "parallel_attn": True, "bias": False, "max_position_embeddings": 2048, "activation": "gelu",
               "tie_word_embeddings": True,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "gpt_bigcode": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                    "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-5,
                    "scale_attn_weights": True, "multi_query": True, "add_cross_attention": False,
                    "tie_word_embeddings": True},
    "bloom": {"vocab_size": 250880, "hidden_size": 64, "n_layer": 2, "n_head": 8, "layer_norm_epsilon": 1e-5,
              "apply_residual_connection_post_layernorm": False, "tie_word_embeddings": True},
    "mpt": {"d_model": 2048, "n_heads": 16, "n_layers": 24, "expansion_ratio": 4, "max_seq_len": 2048,
            "vocab_size": 50368, "layer_norm_epsilon": 1e-5, "no_bias": True, "norm_type": "low_precision_layernorm",
            "tie_word_embeddings": True, "attn_config": {}},
    "opt": {"vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
            "max_position_embeddings": 2048, "do_layer_norm_before": True, "_remove_final_layer_norm": False,
            "num_attention_heads": 12, "activation_function": "relu", "enable_bias": True,
            "layer_norm_elementwise_affine": True, "tie_word_embeddings": True},
    "gpt_neo": {"vocab_size": 50257, "max_position_embeddings": 2048, "hidden_size": 2048, "num_layers": 24,
                "attention_types": [[["global", "local"], 12]], "num_heads": 16, "window_size": 256,
                "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
}
#: ``MptAttentionConfig``'s defaults (``configuration_mpt.py`` 57-66)
MPT_ATTENTION: dict[str, Any] = {"attn_type": "multihead_attention", "clip_qkv": None, "softmax_scale": None,
                                 "prefix_lm": False, "qk_ln": False, "alibi": True, "alibi_bias_max": 8}


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: its family's :data:`DEFAULTS` where a key is absent (the
    legacy ``n_embed`` of Falcon and BLOOM as ``hidden_size``; Falcon's ``ffn_hidden_size`` and
    ``num_kv_heads`` from the width and head count; MPT's ``attn_config`` completed)."""
    model_type = hf.raw("model_type")
    if model_type not in DEFAULTS:
        raise hf.unsupported(f"model_type={model_type!r} (this converter: {', '.join(map(repr, DEFAULTS))})")
    data = dict(hf.data)
    if "n_embed" in data and data.get("hidden_size") is None:
        data["hidden_size"] = data["n_embed"]
    out = HFConfig(data, hf.source, hf.arch).with_defaults(DEFAULTS[model_type])
    if model_type == "falcon":
        out.data["ffn_hidden_size"] = out.get("ffn_hidden_size", 4 * out.req("hidden_size"))
        out.data["num_kv_heads"] = out.get("num_kv_heads", out.req("num_attention_heads"))
    if model_type == "mpt":
        given = out.req("attn_config", dict)
        out.data["attn_config"] = {**MPT_ATTENTION, **{k: v for k, v in given.items() if v is not None}}
    return out


# --------------------------------------------------------------------------- family-local modules
class FalconAlibiAttention(MultiHeadAttention):
    """Falcon's ALiBi (``modeling_falcon.py`` 147-176, 585-596): the scores get the key bias
    ``bf16(bf16(slope_h) * p_j) / sqrt(D)``, ``p_j`` the key's position counted over the real tokens
    of the key-padding mask (its stream index without one), rounded as transformers computes it
    (a bfloat16 product; a float ALiBi of the same slopes is off by up to ``2^-9`` of the bias once
    the slopes are not powers of two). It reaches the attention as an additive float mask with the
    padded keys at ``-inf``; the module takes a bool key mask ``[B, 1, 1, Nk]`` or none. Packed
    input runs one sequence at a time (positions restart per sequence).

    Shapes: as :class:`~attnzoo.MultiHeadAttention`."""

    def _key_bias(self, mask: Any, total: int, x: Tensor) -> Tensor:
        """The additive mask ``[B|1, H, 1, total]`` of the keys ``0 .. total - 1`` (see the class)."""
        cls = type(self).__name__
        if mask is None:
            real = torch.ones(1, 1, 1, total, dtype=torch.bool, device=x.device)
        elif (isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.dim() == 4
              and mask.shape[1:3] == (1, 1) and mask.shape[-1] == total):
            real = mask
        else:
            got = (f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__)
            raise ValueError(f"{cls}: takes a bool key mask [B, 1, 1, {total}] (the real keys) or none, got {got}")
        pos = (real.long().cumsum(-1) - 1) * real  # [B, 1, 1, Nk]: real-token positions, 0 on padding
        slopes = alibi_slopes(self.num_heads, device=x.device).bfloat16().view(1, -1, 1, 1)
        bias = (slopes * pos).to(x.dtype) / math.sqrt(self.head_dim)  # bfloat16 product, then the model's dtype
        return bias.masked_fill(~real, float("-inf"))  # [B, H, 1, Nk]

    def _self(self, x: Tensor, mask: Any, cache: Any, positions: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        total = (0 if cache is None else cache.length) + x.shape[1]
        return super()._self(x, self._key_bias(mask, total, x), cache, positions, return_weights)

    def _packed(self, x: Tensor, cu_seqlens: object, context: object, mask: object, cache: object,
                positions: object, return_weights: bool) -> Tensor:
        raise ValueError(f"{type(self).__name__}: {REFUSAL} runs one sequence at a time (the ALiBi positions "
                         f"restart in each)")


class ResidualNormBlock(TransformerBlock):
    """BLOOM's layer with ``apply_residual_connection_post_layernorm`` (``modeling_bloom.py``
    373-403): the residuals are the normed inputs, ``a = h + drop(attn(h))`` with ``h = attn_norm(x)``,
    then ``g + drop(ffn(g))`` with ``g = ffn_norm(a)``. Built from :class:`~attnzoo.blocks.BlockLayers`.

    Shapes: ``x [B, N, C] -> [B, N, C]`` (packed ``[1, T, C]`` with ``cu_seqlens``)."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None,  # type: ignore[override]
                key_padding: Tensor | None = None, context_mask: Any = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The arguments of :meth:`TransformerBlock.forward` (no ``context``: no cross-attention)."""
        mask = self._self_only(x, context, context_mask, mask, key_padding)
        if self.ffn is None or self.ffn_norm is None:
            raise ValueError("ResidualNormBlock: built without a feed-forward layer")
        h = self.attn_norm(x)  # [B, N, C]
        g = self.ffn_norm(h + self.dropout(self._mix(h, mask, cache, positions, cu_seqlens)))
        return g + self.dropout(self.ffn(g))


# --------------------------------------------------------------------------- shared pieces
def grouped_rows(kv_heads: int, group: int, head_dim: int) -> Tensor:
    """The row order taking a fused projection laid out ``[kv_heads, group + 2, head_dim]`` (each
    key/value head's ``group`` query heads, then its key and its value: Falcon's new architecture;
    ``group=1`` is the per-head interleaved ``[H, 3, D]`` of Falcon, BLOOM and GPT-BigCode) to
    attnzoo's ``[q; k; v]``: ``index [(group + 2) * kv_heads * head_dim]``."""
    idx = torch.arange(kv_heads * (group + 2) * head_dim).view(kv_heads, group + 2, head_dim)
    return torch.cat([idx[:, :group].reshape(-1), idx[:, group].reshape(-1), idx[:, group + 1].reshape(-1)])


def _layer_norm(dim: int, eps: float, kw: Mapping[str, Any], *, bias: bool = True, affine: bool = True) -> Factory:
    return functools.partial(nn.LayerNorm, dim, eps=eps, elementwise_affine=affine, bias=bias and affine, **kw)


def _mlp(dim: int, hidden: int, activation: str, kw: Mapping[str, Any], *, bias: bool = True) -> Factory:
    """The ungated MLP ``down(act(up(x)))``."""
    return functools.partial(FeedForward, dim, hidden, activation, bias=bias, **kw)


def _attention(dim: int, heads: int, kw: Mapping[str, Any], *, kv_heads: int | None = None, bias: bool,
               cls: type[MultiHeadAttention] = MultiHeadAttention, **settings: Any) -> Factory:
    """A factory of one layer's causal attention (``settings``: ``window``, ``rope``, ``scale``,
    ``alibi``, the :func:`~attnzoo.nn.attention.build_softmax` keywords)."""
    return functools.partial(build_softmax, cls, dim, heads, num_kv_heads=kv_heads or heads, head_dim=dim // heads,
                             bias=bias, causal=True, **{k: v for k, v in settings.items() if v is not None}, **kw)


def _decoder(hf: HFConfig, blocks: Sequence[nn.Module], norm: nn.Module, *, dims: tuple[int, int, int],
             pos: str, max_len: int, head_size: int | None, kw: Mapping[str, Any],
             embedding: nn.Module | None = None, head: nn.Module | None = None) -> DecoderLM:
    """The decoder around ``blocks`` (``dims``: vocabulary, width, heads): ``pos`` ``"learned"``
    (a table of ``max_len`` rows), ``"rope"`` (in the attention modules) or ``"none"``, the final
    ``norm``, the head of ``head_size`` (``head``: a given one)."""
    V, C, H = dims
    cfg = DecoderConfig(V, C, len(blocks), H, pos=pos, norm="layer", max_seq_len=max_len,
                        tie_embeddings=hf.get("tie_word_embeddings", True, bool))
    head = head if head is not None else head_for(C, V, head_size, **kw)
    return DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, embedding=embedding, norm=norm, head=head), **kw)


def _start(hf: HFConfig, sd: dict[str, Tensor], build: Callable[..., DecoderLM], prefix: str, *, device: Any,
           dtype: Any, inner: str = "") -> tuple[DecoderLM, Plan, int | None]:
    """``(model, plan, head_size)``: the head from the weights (``score.weight``: a classifier;
    keys under ``prefix + inner``: the LM head; else a base model), the plan reading under the
    model's prefix (``inner``: the base model's own, OPT's ``decoder.``)."""
    full = prefix + inner
    lm = any(k.startswith(full) for k in sd)
    head_size = int(sd["score.weight"].shape[0]) if "score.weight" in sd else None if lm else 0
    model = build(hf, head_size=head_size, device=device, dtype=dtype or float_dtype(sd))
    return model, parts.plan_for(sd, full if lm else inner, hf.arch), head_size


def _finish(plan: Plan, model: DecoderLM, head_size: int | None, final_norm: str | None, *,
            bias: bool = True) -> DecoderLM:
    """Plan the final norm (``{final_norm}.weight`` / ``.bias``) and the head, then copy."""
    if final_norm is not None:
        plan.put_pairs("", "", [("norm", final_norm)], bias=bias)
    ignore: list[str] = []
    parts.put_head(plan, head_size, model.tie_embeddings, ignore)
    plan.apply(model, ignore=ignore)
    return model


def _put_rows(plan: Plan, ours: str, theirs: str, rows: Tensor | None, *, bias: bool) -> None:
    """A fused projection ``{theirs}.weight`` (and ``.bias``) into ``{ours}``, rows reordered by ``rows``."""
    take = None if rows is None else functools.partial(torch.index_select, dim=0, index=rows)
    plan.put(f"{ours}.weight", f"{theirs}.weight", take)
    if bias:
        plan.put(f"{ours}.bias", f"{theirs}.bias", take)


# --------------------------------------------------------------------------- Falcon
def _falcon_layout(hf: HFConfig) -> tuple[str, int, Tensor | None]:
    """``(layer kind, key/value heads, qkv row order)`` of a Falcon config; the combinations
    transformers' layer cannot run are refused by name (module docstring)."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    new, parallel = hf.req("new_decoder_architecture", bool), hf.req("parallel_attn", bool)
    norms = hf.raw("num_ln_in_parallel_attn")
    if norms not in (None, 1, 2):
        raise hf.unsupported(f"num_ln_in_parallel_attn={norms!r} (supported: 1, 2)")
    if new and not parallel:
        raise hf.unsupported("new_decoder_architecture=True with parallel_attn=False")
    if not new and parallel and norms == 2:
        raise hf.unsupported("num_ln_in_parallel_attn=2 without new_decoder_architecture")
    kind = "sequential" if not parallel else "parallel2" if new and norms in (None, 2) else "parallel"
    D, kv = C // H, hf.req("num_kv_heads")
    if new:
        if H % kv:
            raise hf.unsupported(f"num_kv_heads={kv} not dividing num_attention_heads={H}")
        return kind, kv, grouped_rows(kv, H // kv, D)
    if hf.req("multi_query", bool):
        return kind, 1, None
    if kv != H:
        raise hf.unsupported(f"num_kv_heads={kv} with the interleaved layout (multi_query=False; transformers' "
                             f"attention splits {H} key/value heads)")
    return kind, H, grouped_rows(H, 1, D)


def build_falcon(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """Falcon (random weights; module docstring): sequential or parallel layers, RoPE or ALiBi."""
    hf = canonical(hf)
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    kind, kv, _ = _falcon_layout(hf)
    kw, bias, eps = {"device": device, "dtype": dtype}, hf.req("bias", bool), hf.req("layer_norm_epsilon", float)
    if hf.req("alibi", bool):
        attn = _attention(C, H, kw, kv_heads=kv, bias=bias, cls=FalconAlibiAttention)
    else:
        attn = _attention(C, H, kw, kv_heads=kv, bias=bias, rope=parts.rotary(hf, parts.rope_params(hf), C // H))
    ffn = _mlp(C, hf.req("ffn_hidden_size"), hf.activation("activation", ACTIVATIONS, "gelu"), kw, bias=bias)
    layers = BlockLayers(attention=attn, feed_forward=ffn, norm=_layer_norm(C, eps, kw))
    make: Callable[[], nn.Module] = {
        "sequential": lambda: TransformerBlock(C, layers=layers), "parallel": lambda: ParallelBlock(C, layers),
        "parallel2": lambda: TwoNormParallelBlock(C, layers=layers)}[kind]
    return _decoder(hf, [make() for _ in range(depth)], _layer_norm(C, eps, kw)(), dims=(hf.req("vocab_size"), C, H),
                    pos="none" if hf.req("alibi", bool) else "rope", max_len=parts.max_positions(hf),
                    head_size=head_size, kw=kw)


#: Falcon's norms by layer kind: ``(ours, theirs)``
_FALCON_NORMS = {"sequential": [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")],
                 "parallel": [("attn_norm", "input_layernorm")],
                 "parallel2": [("attn_norm", "ln_attn"), ("ffn_norm", "ln_mlp")]}


def convert_falcon(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build Falcon and copy the weights (the fused ``query_key_value`` rows reordered)."""
    hf = canonical(hf)
    model, plan, head_size = _start(hf, sd, build_falcon, "transformer.", device=device, dtype=dtype)
    kind, _, rows = _falcon_layout(hf)
    bias = hf.req("bias", bool)
    plan.put("tok_emb.weight", "word_embeddings.weight")
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"h.{i}."
        _put_rows(plan, f"{o}attn.qkv_proj", f"{h}self_attention.query_key_value", rows, bias=bias)
        plan.put_pairs(o, h, [("attn.out_proj", "self_attention.dense"), ("ffn.up_proj", "mlp.dense_h_to_4h"),
                              ("ffn.down_proj", "mlp.dense_4h_to_h")], bias=bias)
        plan.put_pairs(o, h, _FALCON_NORMS[kind])
    return _finish(plan, model, head_size, "ln_f")


# --------------------------------------------------------------------------- GPT-BigCode
def build_gpt_bigcode(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                      dtype: Any = None) -> DecoderLM:
    """StarCoder 1 / SantaCoder (random weights; module docstring)."""
    hf = canonical(hf)
    parts.unsupported_keys(hf, {"add_cross_attention": lambda v: not v})
    C, H, depth = hf.req("n_embd"), hf.req("n_head"), hf.req("n_layer")
    kw, eps = {"device": device, "dtype": dtype}, hf.req("layer_norm_epsilon", float)
    attn = _attention(C, H, kw, kv_heads=1 if hf.req("multi_query", bool) else H, bias=True,
                      scale=None if hf.req("scale_attn_weights", bool) else 1.0)
    ffn = _mlp(C, hf.get("n_inner", 4 * C), hf.activation("activation_function", ACTIVATIONS), kw)
    blocks = [parts.block(C, attn, ffn, _layer_norm(C, eps, kw)) for _ in range(depth)]
    return _decoder(hf, blocks, _layer_norm(C, eps, kw)(), dims=(hf.req("vocab_size"), C, H), pos="learned",
                    max_len=hf.req("n_positions"), head_size=head_size, kw=kw)


def _put_gpt_layers(plan: Plan, depth: int, attention: Callable[[Plan, str, str], None]) -> None:
    """GPT-2's layer names (``h.{i}.``: ``ln_1``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, biased) around the
    attention, planned by ``attention(plan, ours, theirs)``."""
    for i in range(depth):
        o, h = f"blocks.{i}.", f"h.{i}."
        attention(plan, f"{o}attn", f"{h}attn")
        plan.put_pairs(o, h, [("attn_norm", "ln_1"), ("ffn_norm", "ln_2"), ("ffn.up_proj", "mlp.c_fc"),
                              ("ffn.down_proj", "mlp.c_proj")])


def convert_gpt_bigcode(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build GPT-BigCode and copy the weights (``c_attn`` rows reordered unless multi-query)."""
    hf = canonical(hf)
    model, plan, head_size = _start(hf, sd, build_gpt_bigcode, "transformer.", device=device, dtype=dtype)
    C, H = hf.req("n_embd"), hf.req("n_head")
    rows = None if hf.req("multi_query", bool) else grouped_rows(H, 1, C // H)
    plan.put("tok_emb.weight", "wte.weight")
    plan.put("pos_emb.weight", "wpe.weight")

    def attention(p: Plan, ours: str, theirs: str) -> None:
        _put_rows(p, f"{ours}.qkv_proj", f"{theirs}.c_attn", rows, bias=True)
        p.put_pairs(f"{ours}.", f"{theirs}.", [("out_proj", "c_proj")])

    _put_gpt_layers(plan, model.depth, attention)
    return _finish(plan, model, head_size, "ln_f")


# --------------------------------------------------------------------------- BLOOM
def build_bloom(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """BLOOM (random weights; module docstring)."""
    hf = canonical(hf)
    C, H, depth, V = hf.req("hidden_size"), hf.req("n_head"), hf.req("n_layer"), hf.req("vocab_size")
    kw, eps = {"device": device, "dtype": dtype}, hf.req("layer_norm_epsilon", float)
    layers = BlockLayers(attention=_attention(C, H, kw, bias=True, alibi=True),
                         feed_forward=_mlp(C, 4 * C, "gelu_tanh", kw), norm=_layer_norm(C, eps, kw))
    post = hf.req("apply_residual_connection_post_layernorm", bool)
    blocks = [ResidualNormBlock(C, layers=layers) if post else TransformerBlock(C, layers=layers) for _ in range(depth)]
    embedding = NormedEmbedding(V, C, norm=_layer_norm(C, eps, kw)(), **kw)
    return _decoder(hf, blocks, _layer_norm(C, eps, kw)(), dims=(V, C, H), pos="none",
                    max_len=parts.max_positions(hf), head_size=head_size, kw=kw, embedding=embedding)


def convert_bloom(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build BLOOM and copy the weights (``query_key_value`` rows reordered from ``[H, 3, D]``)."""
    hf = canonical(hf)
    model, plan, head_size = _start(hf, sd, build_bloom, "transformer.", device=device, dtype=dtype)
    C, H = hf.req("hidden_size"), hf.req("n_head")
    rows = grouped_rows(H, 1, C // H)
    plan.put("tok_emb.weight", "word_embeddings.weight")
    plan.put_pairs("tok_emb.", "", [("norm", "word_embeddings_layernorm")])
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"h.{i}."
        _put_rows(plan, f"{o}attn.qkv_proj", f"{h}self_attention.query_key_value", rows, bias=True)
        plan.put_pairs(o, h, [("attn.out_proj", "self_attention.dense"), ("attn_norm", "input_layernorm"),
                              ("ffn_norm", "post_attention_layernorm"), ("ffn.up_proj", "mlp.dense_h_to_4h"),
                              ("ffn.down_proj", "mlp.dense_4h_to_h")])
    return _finish(plan, model, head_size, "ln_f")


# --------------------------------------------------------------------------- MPT
def _mpt_attention(hf: HFConfig) -> dict[str, Any]:
    """MPT's ``attn_config``, the options transformers does not implement refused (module docstring)."""
    attn = hf.req("attn_config", dict)
    checks: dict[str, Callable[[Any], bool]] = {
        "alibi": lambda v: v is True, "qk_ln": lambda v: not v, "prefix_lm": lambda v: not v,
        "attn_type": lambda v: v == "multihead_attention", "alibi_bias_max": lambda v: v == 8}
    for key, ok in checks.items():
        if not ok(attn.get(key)):
            raise hf.unsupported(f"attn_config.{key}={attn.get(key)!r}")
    clip = attn.get("clip_qkv")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
        raise hf.unsupported(f"attn_config.clip_qkv={clip!r} (supported: null or a number > 0)")
    return attn


def build_mpt(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """MPT (random weights; module docstring)."""
    hf = canonical(hf)
    parts.unsupported_keys(hf, {"logit_scale": lambda v: v is None, "no_bias": lambda v: v is True,
                                "expansion_ratio": lambda v: v == 4,
                                "norm_type": lambda v: v in ("low_precision_layernorm", "layernorm")})
    attn_config = _mpt_attention(hf)
    C, H, depth = hf.req("d_model"), hf.req("n_heads"), hf.req("n_layers")
    kw, eps = {"device": device, "dtype": dtype}, hf.req("layer_norm_epsilon", float)
    attn = _attention(C, H, kw, bias=False, alibi=True, scale=attn_config.get("softmax_scale"))
    clip = attn_config.get("clip_qkv")
    clipped = functools.partial(clamped_projection, attn, None if clip is None else float(clip))
    norm = _layer_norm(C, eps, kw, bias=False)
    blocks = [parts.block(C, clipped, _mlp(C, 4 * C, "gelu", kw, bias=False), norm) for _ in range(depth)]
    return _decoder(hf, blocks, norm(), dims=(hf.req("vocab_size"), C, H), pos="none", max_len=hf.req("max_seq_len"),
                    head_size=head_size, kw=kw)


def convert_mpt(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build MPT and copy the weights (``Wqkv`` rows are ``[q; k; v]`` already)."""
    hf = canonical(hf)
    model, plan, head_size = _start(hf, sd, build_mpt, "transformer.", device=device, dtype=dtype)
    plan.put("tok_emb.weight", "wte.weight")
    for i in range(model.depth):
        o = f"blocks.{i}."
        plan.put_pairs(o, o, [("attn.qkv_proj", "attn.Wqkv"), ("attn.out_proj", "attn.out_proj"),
                              ("attn_norm", "norm_1"), ("ffn_norm", "norm_2"), ("ffn.up_proj", "ffn.up_proj"),
                              ("ffn.down_proj", "ffn.down_proj")], bias=False)
    return _finish(plan, model, head_size, "norm_f", bias=False)


# --------------------------------------------------------------------------- OPT
def build_opt(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """OPT (random weights; module docstring): pre- or post-norm, ``project_in`` / ``project_out``."""
    hf = canonical(hf)
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    V, W, pre = hf.req("vocab_size"), hf.get("word_embed_proj_dim", C), hf.req("do_layer_norm_before", bool)
    kw, bias = {"device": device, "dtype": dtype}, hf.req("enable_bias", bool)
    norm = _layer_norm(C, 1e-5, kw, affine=hf.req("layer_norm_elementwise_affine", bool))
    layers = BlockLayers(attention=_attention(C, H, kw, bias=bias), norm=norm, norm_first=pre,
                         feed_forward=_mlp(C, hf.req("ffn_dim"), hf.activation("activation_function", ACTIVATIONS), kw,
                                           bias=bias))
    blocks = [TransformerBlock(C, layers=layers) for _ in range(depth)]
    final = norm() if pre and not hf.req("_remove_final_layer_norm", bool) else nn.Identity()
    embedding = None
    if W != C:  # project_in after the embedding, project_out after the final norm
        embedding = NormedEmbedding(V, W, norm=nn.Linear(W, C, bias=False, **kw), **kw)
        final = nn.Sequential(final, nn.Linear(C, W, bias=False, **kw))
    head = LMHead(W, V, **kw) if head_size is None else head_for(W, V, head_size, **kw)
    return _decoder(hf, blocks, final, dims=(V, C, H), pos="learned", max_len=hf.req("max_position_embeddings"),
                    head_size=head_size, kw=kw, embedding=embedding, head=head)


def convert_opt(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build OPT and copy the weights (``embed_positions`` from its row 2: transformers' offset)."""
    hf = canonical(hf)
    model, plan, head_size = _start(hf, sd, build_opt, "model.", inner="decoder.", device=device, dtype=dtype)
    C, affine, bias = hf.req("hidden_size"), hf.req("layer_norm_elementwise_affine", bool), hf.req("enable_bias", bool)
    projected = hf.get("word_embed_proj_dim", C) != C
    plan.put("tok_emb.weight", "embed_tokens.weight")
    plan.put("pos_emb.weight", "embed_positions.weight", lambda t: t[2:])
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        a = f"{h}self_attn."
        load_qkv_into(plan, f"{o}attn", tuple(f"{a}{n}_proj.weight" for n in "qkv"),
                      tuple(f"{a}{n}_proj.bias" for n in "qkv") if bias else None, bias)
        plan.put_pairs(o, h, [("attn.out_proj", "self_attn.out_proj"), ("ffn.up_proj", "fc1"),
                              ("ffn.down_proj", "fc2")], bias=bias)
        if affine:
            plan.put_pairs(o, h, [("attn_norm", "self_attn_layer_norm"), ("ffn_norm", "final_layer_norm")])
    final = hf.req("do_layer_norm_before", bool) and not hf.req("_remove_final_layer_norm", bool)
    if affine and final:
        plan.put_pairs("", "", [("norm.0" if projected else "norm", "final_layer_norm")])
    if projected:
        plan.put("tok_emb.norm.weight", "project_in.weight")
        plan.put("norm.1.weight", "project_out.weight")
    return _finish(plan, model, head_size, None)


# --------------------------------------------------------------------------- GPT-Neo
def _neo_kinds(hf: HFConfig, depth: int) -> list[str]:
    """``attention_types`` (``[[kinds, repeats], ...]``) expanded to one kind per layer
    (``configuration_gpt_neo.py``: transformers recomputes ``attention_layers`` from it)."""
    kinds: list[str] = []
    for entry in hf.req("attention_types", list):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], (list, tuple))
                and isinstance(entry[1], int)):
            raise hf.unsupported(f"attention_types entry {entry!r} (expected [[kinds...], repeats])")
        kinds += list(entry[0]) * entry[1]
    return parts.layer_types(HFConfig({"layer_types": kinds}, hf.source, hf.arch), depth, ("global", "local"))


def build_gpt_neo(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """GPT-Neo (random weights; module docstring): global and local layers, unscaled scores."""
    hf = canonical(hf)
    C, H, depth = hf.req("hidden_size"), hf.req("num_heads"), hf.req("num_layers")
    kw, eps = {"device": device, "dtype": dtype}, hf.req("layer_norm_epsilon", float)
    ffn = _mlp(C, hf.get("intermediate_size", 4 * C), hf.activation("activation_function", ACTIVATIONS), kw)
    window = hf.req("window_size") - 1
    blocks = []
    for kind in _neo_kinds(hf, depth):
        settings = _attention(C, H, kw, bias=False, scale=1.0, window=window if kind == "local" else None).keywords
        attn = functools.partial(make_attention, C, H, settings, True, None)  # q/k/v unbiased, out_proj biased
        blocks.append(parts.block(C, attn, ffn, _layer_norm(C, eps, kw)))
    return _decoder(hf, blocks, _layer_norm(C, eps, kw)(), dims=(hf.req("vocab_size"), C, H), pos="learned",
                    max_len=hf.req("max_position_embeddings"), head_size=head_size, kw=kw)


def convert_gpt_neo(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build GPT-Neo and copy the weights."""
    hf = canonical(hf)
    model, plan, head_size = _start(hf, sd, build_gpt_neo, "transformer.", device=device, dtype=dtype)
    plan.put("tok_emb.weight", "wte.weight")
    plan.put("pos_emb.weight", "wpe.weight")

    def attention(p: Plan, ours: str, theirs: str) -> None:
        load_qkv_into(p, ours, tuple(f"{theirs}.attention.{n}_proj.weight" for n in "qkv"), None, False)
        p.put_pairs(f"{ours}.", f"{theirs}.attention.", [("out_proj", "out_proj")])

    _put_gpt_layers(plan, model.depth, attention)
    return _finish(plan, model, head_size, "ln_f")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "falcon": parts.Dispatch("Falcon", convert_falcon, ("FalconForCausalLM", "FalconModel")),
    "gpt_bigcode": parts.Dispatch("GPT-BigCode", convert_gpt_bigcode, ("GPTBigCodeForCausalLM", "GPTBigCodeModel")),
    "bloom": parts.Dispatch("BLOOM", convert_bloom, ("BloomForCausalLM", "BloomModel")),
    "opt": parts.Dispatch("OPT", convert_opt, ("OPTForCausalLM", "OPTModel")),
    "mpt": parts.Dispatch("MPT", convert_mpt, ("MptForCausalLM", "MptModel")),
    "gpt_neo": parts.Dispatch("GPT-Neo", convert_gpt_neo, ("GPTNeoForCausalLM", "GPTNeoModel")),
}
