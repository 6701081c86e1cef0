"""CLIP (Radford et al. 2021) -> attnzoo: the vision tower (``model_type="clip_vision_model"``:
``CLIPVisionModel``, ``CLIPVisionModelWithProjection``; ``model_type="clip"``: ``CLIPModel``'s vision
tower, ``CLIPForImageClassification``) as a :class:`~attnzoo.VisionTransformer`, and the text tower
(``model_type="clip_text_model"``: ``CLIPTextModel``, ``CLIPTextModelWithProjection``) as a
:class:`~attnzoo.TransformerEncoder` (transformers 5.25, ``models/clip/modeling_clip.py``; line numbers
below are that file's).

The vision tower (:func:`build_clip_vision`):

* the embedding (138-218, :class:`PatchEmbedding`): a bias-free ``Conv2d`` of ``patch_size`` stride,
  the ``class_embedding`` prepended, learned positions ``position_embedding [1 + (S/P)^2, C]`` added;
  for another image size the patch positions are resized bicubically (``align_corners=False``), the
  class entry kept (``interpolate_pos_encoding``, 161-200: the table as it is when the grid is the
  trained one and the image square, else the interpolation; transformers needs
  ``interpolate_pos_encoding=True`` for that, attnzoo always interpolates); then ``pre_layrnorm``
  before the blocks (631-632), inside the embedding part;
* pre-norm layers (353-383): ``x + out_proj(attn(layer_norm1(x)))``, ``x + fc2(act(fc1(layer_norm2(x))))``,
  q/k/v/out projections with biases, scale ``head_dim^-1/2``; the MLP's ``hidden_act``
  (``quick_gelu``: ``x * sigmoid(1.702 x)``, OpenAI's checkpoints; ``gelu``: LAION's), an
  :class:`~attnzoo.FeedForward`;
* no final norm: ``last_hidden_state`` is the last layer's output (639), ``norm`` an identity;
* the heads: ``pooler_output = post_layernorm(last_hidden_state[:, 0])`` (640-641) and
  ``image_embeds = visual_projection(pooler_output)`` (941-942, bias-free), :class:`ClassTokenPooler`;
  ``CLIPForImageClassification``: ``classifier(mean(last_hidden_state[:, 1:]))`` (989-992; its
  ``post_layernorm`` weights are not used and are left out of the conversion), the
  :class:`~attnzoo.VisionTransformer`'s own ``pool="mean"`` head; ``num_labels=0`` (an identity
  classifier): the mean itself.

``CLIPModel`` converts as its vision tower with the projection: ``forward(images)`` is
``get_image_features(pixel_values).pooler_output`` — in transformers 5.25 ``get_image_features``
returns a ``BaseModelOutputWithPooling`` whose ``pooler_output`` holds the projected embeddings
(709-743), not a tensor —, ``forward_features`` its ``last_hidden_state``; the text tower,
``text_projection`` and ``logit_scale`` are dropped with a warning naming them (convert
``CLIPTextModelWithProjection`` for the text side).

The text tower (:func:`build_clip_text`): token + learned absolute positions (221-256: positions
``0..N-1`` whatever the padding), the same pre-norm layers under a **causal** mask combined with the
padding mask (533-545), ``final_layer_norm`` (549) as the encoder's final norm. The pooled output
(551-571), :class:`EOSPooler`, is the encoder's ``classifier`` part, so that
``model.classify(hidden, mask)`` returns ``pooler_output`` (``CLIPTextModel``) or ``text_embeds``
(``CLIPTextModelWithProjection``, ``text_projection`` applied, 877-878); see :class:`EOSPooler` for
where it reads (transformers' rule needs the token ids: ``classifier(hidden, mask, tokens=ids)``).

The same builders convert MetaCLIP 2 (``models/metaclip_2/``: ``metaclip_2_vision_model``,
``metaclip_2`` — ``MetaClip2Model``'s vision tower, ``MetaClip2ForImageClassification`` —,
``metaclip_2_text_model``), whose modules, weights and defaults are CLIP's but for the text pooling:
always the first ``eos_token_id``, no legacy rule (modeling_metaclip_2.py 461-490), and Chinese-CLIP's
vision tower (``chinese_clip_vision_model``: ``ChineseCLIPVisionModel``, CLIP's vision model). Not
converted: ``ChineseCLIPModel`` / ``ChineseCLIPTextModel`` (``chinese_clip``, ``chinese_clip_text_model``:
a BERT text tower with its pooler, and the image-text model's input is the text).

Refused by name: a ``hidden_act`` outside ``quick_gelu``, ``gelu``, ``gelu_new``,
``gelu_pytorch_tanh``, ``relu``, ``silu`` / ``swish``; a non-integer ``image_size`` / ``patch_size``
(transformers' position table is a square grid); an ``eos_token_id`` that is not one integer.
``attention_dropout`` changes nothing in eval and is accepted.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_choice
from attnzoo.blocks import FeedForward
from attnzoo.models._common import check_padding_mask
from attnzoo.models.config import EncoderConfig, ViTConfig
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.hf.bert import ACTIVATIONS as BERT_ACTIVATIONS
from attnzoo.models.hf.bert import put_layer
from attnzoo.models.parts import EncoderParts, ViTParts
from attnzoo.models.vit import VisionTransformer, resize_grid
from attnzoo.variants import build_attention

__all__ = ["ACTIVATIONS", "CLIP_LAYER", "DISPATCH", "TEXT_DEFAULTS", "VISION_DEFAULTS", "ClassTokenPooler",
           "EOSPooler", "PatchEmbedding", "build_clip_text", "build_clip_vision", "convert_clip", "convert_clip_text",
           "convert_clip_vision"]

#: CLIP's (and SigLIP's) names of a layer's sub-modules, in :data:`attnzoo.models.hf.bert.BERT_LAYER`'s order
CLIP_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "layer_norm1",
              "mlp.fc1", "mlp.fc2", "layer_norm2")
#: transformers' activation names -> attnzoo's (:data:`attnzoo.blocks.ACTIVATIONS`)
ACTIVATIONS = {**BERT_ACTIVATIONS, "quick_gelu": "quick_gelu"}
#: ``CLIPVisionConfig``'s defaults (configuration_clip.py) for the keys a folder may leave out
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
    "attention_dropout": 0.0}
#: ``CLIPTextConfig``'s defaults
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
    "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
    "attention_dropout": 0.0, "eos_token_id": 49407}
#: ``eos_token_id`` of the configs written before transformers PR #24773: the pooled token is then
#: the one with the largest id (modeling_clip.py 551-561)
LEGACY_EOS = 2


class PatchEmbedding(nn.Module):
    """A ViT patch embedding with a learned position table: ``Conv2d`` patches of ``patch_size``
    (``[B, Cin, H, W] -> [B, (H/P)(W/P), C]``), a learned class token prepended (``class_token``),
    ``position_embedding`` added — for another grid than ``image_size / patch_size`` the patch
    positions resized bicubically (``align_corners=False``; the class entry kept, see
    :meth:`positions`) — then ``norm`` (CLIP's ``pre_layrnorm``; ``None``: none).

    Weights: ``patch_embed`` (``Conv2d``, bias iff ``conv_bias``), ``class_embedding [C]``,
    ``position_embedding [T, C]`` (``T = (S/P)^2 (+1)``), ``norm``'s.
    Shapes: ``images [B, in_channels, H, W]`` (``H``, ``W`` multiples of ``patch_size``) -> ``[B, T', C]``.
    """

    def __init__(self, image_size: int, patch_size: int, in_channels: int, dim: int, *, class_token: bool = True,
                 conv_bias: bool = False, norm: nn.Module | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.patch_size, self.dim, self.grid = patch_size, dim, image_size // patch_size
        self.num_prefix = 1 if class_token else 0
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size, bias=conv_bias, **kw)
        self.class_embedding = nn.Parameter(torch.randn(dim, **kw) * dim ** -0.5) if class_token else None
        self.position_embedding = nn.Parameter(torch.randn(self.num_prefix + self.grid ** 2, dim, **kw) * 0.02)
        self.norm = nn.Identity() if norm is None else norm

    def positions(self, grid_h: int, grid_w: int) -> Tensor:
        """The position table ``[T, C]`` of a ``grid_h x grid_w`` patch grid: the table itself for the
        trained (square) grid, else its patch part ``[S/P, S/P, C]`` resized bicubically to
        ``[grid_h, grid_w, C]`` after the prefix entries (transformers' ``interpolate_pos_encoding``)."""
        if (grid_h, grid_w) == (self.grid, self.grid):
            return self.position_embedding
        patch = resize_grid(self.position_embedding[self.num_prefix:], (self.grid, self.grid), (grid_h, grid_w))
        return torch.cat((self.position_embedding[: self.num_prefix], patch))  # [T', C]

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images.to(self.patch_embed.weight.dtype))  # [B, C, gh, gw]
        gh, gw = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)  # [B, gh*gw, C]
        if self.class_embedding is not None:
            x = torch.cat((self.class_embedding.expand(x.shape[0], 1, -1), x), dim=1)  # [B, T, C]
        return self.norm(x + self.positions(gh, gw))

    def extra_repr(self) -> str:
        return f"grid={self.grid}x{self.grid}, prefix={self.num_prefix}"


class ClassTokenPooler(nn.Module):
    """A vision head of the class token: ``projection(norm(features[:, 0]))`` (CLIP's
    ``post_layernorm`` then ``visual_projection``; ``projection=None``: the normed token, CLIP's
    ``pooler_output``). Weights: ``norm``'s, ``projection``'s.
    Shapes: ``features [B, T, C]`` -> ``[B, C]`` (or ``[B, P]`` with a projection to ``P``)."""

    def __init__(self, norm: nn.Module, projection: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = norm
        self.projection = projection

    def forward(self, features: Tensor) -> Tensor:
        pooled = self.norm(features[:, 0])  # [B, C]
        return pooled if self.projection is None else self.projection(pooled)


class EOSPooler(nn.Module):
    """CLIP's text pooling (``CLIPTextModel``, 551-571) as a :class:`~attnzoo.models.EncoderParts`
    classifier: the hidden state of one token per row, then ``projection`` (``text_projection``;
    ``None``: the pooled state, ``pooler_output``).

    Which token: with ``tokens`` (the ids) transformers' rule — ``eos_token_id == 2`` (the configs
    from before transformers PR #24773) and ``legacy_eos``: the token with the largest id (the first of
    them), else the first ``eos_token_id`` (slot 0 when a row has none; MetaCLIP 2 always reads so,
    ``legacy_eos=False``). Without ``tokens`` (what
    :meth:`~attnzoo.TransformerEncoder.classify` passes): the last real token of ``attention_mask``
    (the last slot without a mask), where CLIP's tokenizer puts the end-of-text token; the two agree
    on tokenizer output except a left-padded batch padded with the end-of-text token (transformers'
    non-legacy rule then reads the first pad). Where the rule lands on a padded slot (a left-padded
    row without the end-of-text id: slot 0) the value read is unspecified, as every padded position's.

    Weights: ``projection [P, C]`` (bias-free) if any.
    Shapes: ``hidden [B, N, C]``, ``attention_mask [B, N] | None``, ``tokens [B, N] | None`` -> ``[B, C]``
    (``[B, P]`` projected).
    """

    def __init__(self, eos_token_id: int, projection: nn.Module | None = None, *, legacy_eos: bool = True) -> None:
        super().__init__()
        self.eos_token_id = int(eos_token_id)
        self.legacy = legacy_eos and self.eos_token_id == LEGACY_EOS
        self.projection = projection

    def index(self, hidden: Tensor, attention_mask: Tensor | None = None, tokens: Tensor | None = None) -> Tensor:
        """The pooled slot of each row: ``[B]`` (long)."""
        B, N = hidden.shape[:2]
        if tokens is not None:
            ids = tokens.to(torch.int)
            return (ids if self.legacy else (ids == self.eos_token_id).int()).argmax(dim=-1)
        if attention_mask is None:
            return torch.full((B,), N - 1, dtype=torch.long, device=hidden.device)
        real = check_padding_mask(attention_mask, B, N, "EOSPooler")
        slots = torch.arange(N, device=hidden.device).expand(B, N)
        return torch.where(real, slots, -1).amax(dim=-1).clamp(min=0)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None, tokens: Tensor | None = None) -> Tensor:
        idx = self.index(hidden, attention_mask, tokens)  # [B]
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]  # [B, C]
        return pooled if self.projection is None else self.projection(pooled)

    def extra_repr(self) -> str:
        rule = "largest id (legacy)" if self.legacy else f"first id {self.eos_token_id}"
        return f"eos: {rule}"


def _blocks(hf: HFConfig, *, causal: bool, kw: dict[str, Any]) -> list[nn.Module]:
    """CLIP's pre-norm layers (``CLIPEncoderLayer``): biased attention (causal for the text tower), the
    MLP of ``hidden_act``, LayerNorms of ``layer_norm_eps``."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    attn = functools.partial(build_attention, "mha", C, H, causal=causal, bias=True,
                             dropout=hf.get("attention_dropout", 0.0, float), **kw)
    ffn = functools.partial(FeedForward, C, hf.req("intermediate_size"), hf.activation("hidden_act", ACTIVATIONS),
                            bias=True, **kw)
    norm = functools.partial(nn.LayerNorm, C, eps=hf.get("layer_norm_eps", 1e-5, float), **kw)
    return [parts.block(C, attn, ffn, norm) for _ in range(hf.req("num_hidden_layers"))]


def _square(hf: HFConfig, key: str) -> int:
    value = hf.raw(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise hf.unsupported(f"{key}={value!r} (CLIP's position table is a square grid: an int)")
    return hf.req(key)


def build_clip_vision(hf: HFConfig, *, head: str, out: int = 0, device: Any = None,
                      dtype: Any = None) -> VisionTransformer:
    """The vision tower of a ``CLIPVisionConfig`` (random weights; see the module docstring) with the
    head ``"pooler"`` (:class:`ClassTokenPooler`, projected to ``out`` if ``out``) or ``"mean"`` (the
    mean of the patch tokens, then a classifier of ``out`` classes if ``out``)."""
    check_choice(head, "head", "build_clip_vision", choices=("pooler", "mean"))
    hf = hf.with_defaults(VISION_DEFAULTS)
    image, patch = _square(hf, "image_size"), _square(hf, "patch_size")
    C, eps = hf.req("hidden_size"), hf.get("layer_norm_eps", 1e-5, float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    blocks = _blocks(hf, causal=False, kw=kw)
    embedding = PatchEmbedding(image, patch, hf.req("num_channels"), C, norm=nn.LayerNorm(C, eps=eps, **kw), **kw)
    pooler = None
    if head == "pooler":
        projection = nn.Linear(C, out, bias=False, **kw) if out else None
        pooler = ClassTokenPooler(nn.LayerNorm(C, eps=eps, **kw), projection)
    cfg = ViTConfig(image, patch, hf.req("num_channels"), out if head == "mean" else 0, C, len(blocks),
                    hf.req("num_attention_heads"), ffn_hidden=hf.req("intermediate_size"), norm_eps=eps,
                    qkv_bias=True, pool="mean")
    return VisionTransformer(config=cfg, parts=ViTParts(embedding=embedding, blocks=blocks, norm=nn.Identity(),
                                                        head=pooler), **kw)


def put_layers(plan: Plan, depth: int) -> None:
    """The ``encoder.layers.{i}`` of either tower into ``blocks.{i}``."""
    for i in range(depth):
        put_layer(plan, f"blocks.{i}.", f"encoder.layers.{i}.", CLIP_LAYER)


def _convert_vision(hf: HFConfig, sd: dict[str, Tensor], *, head: str, out: int, device: Any, dtype: Any,
                    ignore: list[str]) -> VisionTransformer:
    """Build the vision tower and plan its weights (under ``vision_model.`` when the checkpoint has it);
    the projection (``visual_projection``) or the classifier outside that prefix."""
    prefix = "vision_model." if any(k.startswith("vision_model.") for k in sd) else ""
    model = build_clip_vision(hf, head=head, out=out, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(Source(sd, prefix), hf.arch)
    plan.put("embedding.patch_embed.weight", "embeddings.patch_embedding.weight")
    plan.put("embedding.class_embedding", "embeddings.class_embedding")
    plan.put("embedding.position_embedding", "embeddings.position_embedding.weight")
    plan.put_pairs("embedding.", "", [("norm", "pre_layrnorm")])
    put_layers(plan, model.depth)
    if head == "pooler":
        plan.put_pairs("head.", "", [("norm", "post_layernorm")])
    else:  # CLIPForImageClassification reads the patch tokens before post_layernorm (989-992)
        ignore.append(re.escape(f"{prefix}post_layernorm.") + r"\w+")
    plan.src.prefix = ""
    if head == "pooler" and out:
        plan.put("head.projection.weight", "visual_projection.weight")
    elif out:
        plan.put_pairs("", "", [("head", "classifier")])
    plan.apply(model, ignore=ignore)
    return model


def convert_clip_vision(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> VisionTransformer:
    """``CLIPVisionModel`` (``forward`` = ``pooler_output``) or, with ``visual_projection.weight``,
    ``CLIPVisionModelWithProjection`` (``forward`` = ``image_embeds``)."""
    proj = sd.get("visual_projection.weight")
    return _convert_vision(hf, sd, head="pooler", out=0 if proj is None else int(proj.shape[0]), device=device,
                           dtype=dtype, ignore=[])


def convert_clip(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> VisionTransformer:
    """A ``clip`` checkpoint (a ``CLIPConfig``): ``CLIPModel`` (``text_model.*`` present) as its vision
    tower with ``visual_projection`` (``forward`` = ``get_image_features(...).pooler_output``), the
    text tower dropped with a warning; else ``CLIPForImageClassification`` (``forward`` = ``logits``)."""
    vision = HFConfig(hf.get("vision_config", {}, dict), f"{hf.source} (vision_config)", hf.arch)
    text = sorted(k for k in sd if k.startswith("text_model.") or k in ("text_projection.weight", "logit_scale"))
    if not text:
        classifier = sd.get("classifier.weight")
        return _convert_vision(vision, sd, head="mean", out=0 if classifier is None else int(classifier.shape[0]),
                               device=device, dtype=dtype, ignore=[])
    warnings.warn(f"{hf.arch}: the image-text model converts as its vision tower with the projection (forward = "
                  f"get_image_features); the text tower and the contrastive head have no counterpart in it and "
                  f"are dropped: text_model.* ({sum(k.startswith('text_model.') for k in text)} tensors), "
                  f"text_projection.weight, logit_scale ({hf.source}); convert a CLIPTextModelWithProjection "
                  f"for the text side", stacklevel=4)
    proj = sd.get("visual_projection.weight")
    return _convert_vision(vision, sd, head="pooler", out=0 if proj is None else int(proj.shape[0]), device=device,
                           dtype=dtype, ignore=[re.escape(k) for k in text])


def _eos(hf: HFConfig) -> int:
    value = hf.raw("eos_token_id")
    if not isinstance(value, int) or isinstance(value, bool):
        raise hf.unsupported(f"eos_token_id={value!r} (the pooled token needs one integer id)")
    return value


def build_clip_text(hf: HFConfig, *, projection: int = 0, legacy_eos: bool = True, device: Any = None,
                    dtype: Any = None) -> TransformerEncoder:
    """The text tower of a ``CLIPTextConfig`` (random weights; see the module docstring): a causal
    pre-norm :class:`~attnzoo.TransformerEncoder` with learned positions, ``final_layer_norm`` and the
    :class:`EOSPooler` classifier (projected to ``projection`` if ``projection``; ``legacy_eos``: see there)."""
    hf = hf.with_defaults(TEXT_DEFAULTS)
    V, C, H = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_attention_heads")
    eps = hf.get("layer_norm_eps", 1e-5, float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    pooler = EOSPooler(_eos(hf), nn.Linear(C, projection, bias=False, **kw) if projection else None,
                       legacy_eos=legacy_eos)
    blocks = _blocks(hf, causal=True, kw=kw)
    cfg = EncoderConfig(V, C, len(blocks), H, max_seq_len=hf.req("max_position_embeddings"), pos="learned",
                        type_vocab_size=0, norm="layer", norm_eps=eps, norm_first=True, embed_norm=False,
                        ffn_hidden=hf.req("intermediate_size"))
    return TransformerEncoder(config=cfg, parts=EncoderParts(blocks=blocks, norm=nn.LayerNorm(C, eps=eps, **kw),
                                                             classifier=pooler), **kw)


def convert_clip_text(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any,
                      legacy_eos: bool = True) -> TransformerEncoder:
    """``CLIPTextModel`` or, with ``text_projection.weight``, ``CLIPTextModelWithProjection``
    (``text_model.`` prefix): ``forward`` = ``last_hidden_state``, ``classify(hidden, mask)`` =
    ``pooler_output`` / ``text_embeds`` (``legacy_eos=False``: MetaCLIP 2's pooling, see :class:`EOSPooler`)."""
    proj = sd.get("text_projection.weight")
    model = build_clip_text(hf, projection=0 if proj is None else int(proj.shape[0]), legacy_eos=legacy_eos,
                            device=device, dtype=dtype or float_dtype(sd))
    prefix = "text_model." if any(k.startswith("text_model.") for k in sd) else ""
    plan = Plan(Source(sd, prefix), hf.arch)
    plan.put("tok_emb.weight", "embeddings.token_embedding.weight")
    plan.put("pos_emb.weight", "embeddings.position_embedding.weight")
    put_layers(plan, model.depth)
    plan.put_pairs("", "", [("norm", "final_layer_norm")])
    if proj is not None:
        plan.src.prefix = ""
        plan.put("classifier.projection.weight", "text_projection.weight")
    plan.apply(model)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "clip_vision_model": parts.Dispatch("CLIP vision", convert_clip_vision, (
        "CLIPVisionModel", "CLIPVisionModelWithProjection")),
    "clip": parts.Dispatch("CLIP", convert_clip, ("CLIPModel", "CLIPForImageClassification")),
    "clip_text_model": parts.Dispatch("CLIP text", convert_clip_text, ("CLIPTextModel", "CLIPTextModelWithProjection")),
    "metaclip_2_vision_model": parts.Dispatch("MetaCLIP 2 vision", convert_clip_vision, (
        "MetaClip2VisionModel", "MetaClip2VisionModelWithProjection")),
    "metaclip_2": parts.Dispatch("MetaCLIP 2", convert_clip, ("MetaClip2Model", "MetaClip2ForImageClassification")),
    "metaclip_2_text_model": parts.Dispatch("MetaCLIP 2 text", functools.partial(convert_clip_text, legacy_eos=False), (
        "MetaClip2TextModel", "MetaClip2TextModelWithProjection")),
    "chinese_clip_vision_model": parts.Dispatch("Chinese-CLIP vision", convert_clip_vision, ("ChineseCLIPVisionModel",)),
}
