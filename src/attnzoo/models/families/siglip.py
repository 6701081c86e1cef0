"""SigLIP and SigLIP 2 vision towers (``siglip_vision_model``, ``siglip``, ``siglip2_vision_model``) ->
:class:`~attnzoo.VisionTransformer`: the image encoder of SigLIP and of PaliGemma / Gemma 3 / many VLMs.
Line numbers: transformers 5.25's ``models/siglip/modeling_siglip.py`` (``models/siglip2/modeling_siglip2.py``
where marked "SigLIP2").

The tower (``SiglipVisionModel``, 552-618):

* a conv patch embedding (``patch_embedding``, ``padding="valid"``: an image side that is not a multiple
  of the patch size has its last pixels ignored) plus a learned position table, **no class token**
  (116-186); the table is resized for another image size by ``interpolate_pos_encoding`` (137-173):
  bicubic, ``align_corners=False``, on the ``sqrt(T) x sqrt(T)`` grid, skipped only when the patch count
  and the table agree and the image is square: :meth:`VisionTransformer.position_embeddings
  <attnzoo.VisionTransformer.position_embeddings>` does exactly that (it is the config's own
  embedding with ``class_token=False``). transformers resizes only when asked
  (``interpolate_pos_encoding=True``; else another size fails); attnzoo always does.
* pre-norm blocks (``layer_norm1`` -> attention with biased q/k/v/out, ``layer_norm2`` -> ``fc1`` ->
  ``hidden_act`` (``gelu_pytorch_tanh``) -> ``fc2``; 250-357): the config's own
  :class:`~attnzoo.TransformerBlock`; then ``post_layernorm`` (the final norm);
* with ``vision_use_head`` the multihead attention-pooling head (``SiglipMultiheadAttentionPoolingHead``,
  621-643): :class:`AttentionPoolingHead`, whose output is ``pooler_output`` (what ``forward`` returns).
  Without it transformers' ``pooler_output`` is ``None``; ``forward`` then returns the mean of the
  tokens (the pooling of ``SiglipForImageClassification``). The head follows the weights
  (``head.probe``).

``siglip``: ``SiglipForImageClassification`` (834-907) is the tower, the mean of the patch tokens and
``classifier`` (``nn.Identity`` when ``num_labels=0``: ``forward`` returns the mean); the tower's
attention-pooling head weights, which its logits never read, are left out (``to_hf`` keeps the target's).
``SiglipModel`` (646-831) converts as its **vision tower**: ``forward(images)`` is
``get_image_features(images).pooler_output`` (704-737; in 5.25 ``get_image_features`` returns the vision
model's whole ``BaseModelOutputWithPooling``; ``SiglipModel.forward``'s ``image_embeds`` are that
pooler output L2-normalised), ``forward_features`` its ``last_hidden_state``; the text tower,
``logit_scale`` and ``logit_bias`` are dropped, named in a ``UserWarning``. Checkpoints of transformers 4
(``vision_model.`` prefix on ``SiglipVisionModel``) load as well.

``siglip2_vision_model`` (``Siglip2VisionModel``, SigLIP2 482-567, NaFlex): a ``Linear`` patch embedding
over flattened patches (each patch's pixels in ``(row, column, channel)`` order, the image
processor's ``convert_image_to_patches``) and positions resized per image to its patch grid
``spatial_shapes`` from the ``sqrt(num_patches)``-square table by an antialiased bilinear resize in
float32 (SigLIP2 130-199, the weights of ``F.interpolate(mode="bilinear", antialias=True,
align_corners=False)``): :class:`FlatPatchEmbedding` takes whole images ``[B, C, H, W]`` and patchifies
them, which is transformers' computation for a batch of one image size without padding
(``pixel_attention_mask`` all ones, ``spatial_shapes = (H/P, W/P)``). A NaFlex batch of several
sizes padded to ``max_num_patches`` is not one tensor of images: convert each image alone (its real
tokens and its pooled output equal transformers' in the padded batch). The attention-pooling head
ignores padded keys there (``key_padding`` of :class:`AttentionPoolingHead`).

Refused by name: activations without an attnzoo feed-forward (``quick_gelu``, ...), a ``hidden_size``
that ``num_attention_heads`` does not divide, SigLIP2's ``num_patches`` that is not a square and a
non-square or list ``patch_size``. ``attention_dropout`` changes nothing in eval and is accepted.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.clip as clip
from attnzoo.blocks import FeedForward
from attnzoo.models.config import ViTConfig
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.hf.bert import ACTIVATIONS
from attnzoo.models.parts import ViTParts
from attnzoo.models.vit import VisionTransformer, resize_grid
from attnzoo.variants import build_attention

__all__ = ["DEFAULTS", "DISPATCH", "SIGLIP2_DEFAULTS", "AttentionPoolingHead", "FlatPatchEmbedding", "build_siglip",
           "convert_siglip", "convert_siglip2_vision", "convert_siglip_vision", "put_attention_pool", "put_layers",
           "vision_config"]

#: ``SiglipVisionConfig``'s defaults (configuration_siglip.py) for the keys a folder may leave out
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
    "attention_dropout": 0.0, "vision_use_head": True}
#: ``Siglip2VisionConfig``'s: no ``image_size``, a ``num_patches`` table
SIGLIP2_DEFAULTS: dict[str, Any] = {**{k: v for k, v in DEFAULTS.items() if k != "image_size"}, "num_patches": 256}


class AttentionPoolingHead(nn.Module):
    """Multihead attention pooling (MAP; Lee et al. 2019, "Set Transformer"; the head of SigLIP,
    Zhai et al. 2023): one learned probe query attends over the tokens, then a pre-norm MLP residual::

        h   = Attn(q = probe, k = v = features)      # [B, 1, C], H heads, softmax(q k^T / sqrt(D)) v
        out = (h + mlp(norm(h)))[:, 0]               # [B, C]

    The attention is a cross-attention :class:`~attnzoo.MultiHeadAttention` (``kv_dim=C``, biases):
    ``torch.nn.MultiheadAttention``'s ``in_proj_weight`` rows ``[q; k; v]`` are its ``q_proj`` and
    ``kv_proj`` (rows ``[k; v]``), its ``out_proj`` the same.

    Args:
        dim: width ``C``.
        num_heads: heads ``H`` (``C % H == 0``).
        mlp: the feed-forward ``[B, 1, C] -> [B, 1, C]`` (SigLIP: ``fc2(act(fc1(.)))``, a
            :class:`~attnzoo.FeedForward`).
        norm: the norm before it (SigLIP: ``LayerNorm``).

    Weights: ``probe [1, 1, C]``, ``attn`` (``q_proj``, ``kv_proj``, ``out_proj``), ``norm``, ``mlp``.
    Shapes: ``features [B, T, C]``, ``key_padding [B, T]`` bool (True = a real token) or ``None`` ->
    ``[B, C]``.
    """

    def __init__(self, dim: int, num_heads: int, *, mlp: nn.Module, norm: nn.Module,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"AttentionPoolingHead: dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.dim, self.num_heads = dim, num_heads
        self.probe = nn.Parameter(torch.randn(1, 1, dim, device=device, dtype=dtype) * dim ** -0.5)
        self.attn = build_attention("mha", dim, num_heads, kv_dim=dim, causal=False, bias=True, device=device,
                                    dtype=dtype)
        self.norm = norm
        self.mlp = mlp

    def forward(self, features: Tensor, key_padding: Tensor | None = None) -> Tensor:
        if not isinstance(features, Tensor) or features.dim() != 3 or features.shape[-1] != self.dim:
            got = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
            raise ValueError(f"AttentionPoolingHead: features must have shape [B, T, {self.dim}], got {got}")
        mask = None if key_padding is None else key_padding.bool()[:, None, None, :]  # [B, 1, 1, T]
        probe = self.probe.expand(features.shape[0], -1, -1).to(features.dtype)  # [B, 1, C]
        h = self.attn(probe, features, mask=mask)  # [B, 1, C]
        return (h + self.mlp(self.norm(h)))[:, 0]  # [B, C]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}"


class FlatPatchEmbedding(nn.Module):
    """SigLIP 2's NaFlex patch embedding on whole images: the image cut into ``P x P`` patches, each
    flattened in ``(row, column, channel)`` order (transformers' ``convert_image_to_patches``), a
    ``Linear`` over them, plus the learned ``g x g`` position table resized to the image's patch grid
    ``(H/P, W/P)`` by a bilinear, antialiased (``align_corners=False``) resize computed in float32 and
    rounded to the table's dtype (SigLIP2's ``resize_positional_embeddings``)::

        x[b, i*gw + j] = W . patch(b, i, j) + bias + resize(pos_embed, (gh, gw))[i, j]

    Args:
        in_channels, patch_size, dim: ``Cin``, ``P``, ``C``.
        grid: ``g``, the table's side (``num_patches = g^2``).

    Weights: ``patch_embedding [C, P*P*Cin]`` (+ bias), ``pos_embed [g*g, C]``.
    Shapes: ``images [B, Cin, H, W]`` (``H``, ``W`` multiples of ``P``) -> ``[B, (H/P)(W/P), C]``.
    """

    def __init__(self, in_channels: int, patch_size: int, dim: int, grid: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_channels, self.patch_size, self.dim, self.grid = in_channels, patch_size, dim, grid
        self.patch_embedding = nn.Linear(in_channels * patch_size * patch_size, dim, device=device, dtype=dtype)
        self.pos_embed = nn.Parameter(torch.randn(grid * grid, dim, device=device, dtype=dtype) * 0.02)

    def positions(self, grid_h: int, grid_w: int) -> Tensor:
        """``[grid_h * grid_w, C]``: the table resized to a ``grid_h x grid_w`` grid (antialiased
        bilinear in float32; the table itself at its own grid, which that resize leaves unchanged)."""
        return resize_grid(self.pos_embed, (self.grid, self.grid), (grid_h, grid_w), mode="bilinear", antialias=True,
                           float32=True)

    def forward(self, images: Tensor) -> Tensor:
        B, c, h, w = images.shape
        p = self.patch_size
        gh, gw = h // p, w // p
        patches = images.reshape(B, c, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(B, gh * gw, p * p * c)
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))  # [B, T, C]
        return x + self.positions(gh, gw)

    def extra_repr(self) -> str:
        return f"in_channels={self.in_channels}, patch_size={self.patch_size}, dim={self.dim}, grid={self.grid}"


def vision_config(hf: HFConfig) -> HFConfig:
    """A ``siglip`` config's ``vision_config`` (its defaults filled in) as an :class:`HFConfig`."""
    return HFConfig(hf.req("vision_config", dict), f"{hf.source}: vision_config", hf.arch).with_defaults(DEFAULTS)


def _mlp(hf: HFConfig, kw: dict[str, Any]) -> FeedForward:
    return FeedForward(hf.req("hidden_size"), hf.req("intermediate_size"), hf.activation("hidden_act", ACTIVATIONS),
                       bias=True, **kw)


def _vit_config(hf: HFConfig, *, image_size: int, num_classes: int) -> ViTConfig:
    """The pre-norm, class-token-free :class:`ViTConfig` of a SigLIP vision config; the image size
    is rounded down to a multiple of the patch size (what the ``"valid"`` convolution reads)."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    if C % H:
        raise hf.unsupported(f"hidden_size={C} with num_attention_heads={H} (not a divisor)")
    patch = hf.req("patch_size")
    return ViTConfig(image_size - image_size % patch, patch, hf.req("num_channels"), num_classes, C,
                     hf.req("num_hidden_layers"), H, ffn=hf.activation("hidden_act", ACTIVATIONS),
                     ffn_hidden=hf.req("intermediate_size"), norm_eps=hf.get("layer_norm_eps", 1e-6, float),
                     qkv_bias=True, class_token=False, pool="mean")


def build_siglip(hf: HFConfig, *, pool_head: bool, num_classes: int = 0, embedding: nn.Module | None = None,
                 image_size: int | None = None, device: Any = None, dtype: Any = None) -> VisionTransformer:
    """The vision tower of a SigLIP vision config (random weights; see the module docstring): with the
    attention-pooling head (``pool_head``), or the mean of the tokens and a classifier of
    ``num_classes`` (``0``: none); ``embedding``: a given embedding part (SigLIP2's)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    cfg = _vit_config(hf, image_size=image_size or hf.req("image_size"), num_classes=num_classes)
    head = None
    if pool_head:
        norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, **kw)
        head = AttentionPoolingHead(cfg.dim, cfg.num_heads, mlp=_mlp(hf, kw), norm=norm, **kw)
    return VisionTransformer(config=cfg, parts=ViTParts(embedding=embedding, head=head), **kw)


def put_layers(plan: Plan, depth: int) -> None:
    """The encoder layers (``encoder.layers.{i}.``) into the blocks and ``post_layernorm`` into the final norm."""
    clip.put_layers(plan, depth)  # CLIP's layer names
    plan.put_pairs("", "", [("norm", "post_layernorm")])


def put_attention_pool(plan: Plan, ours: str, theirs: str, dim: int) -> None:
    """A ``SiglipMultiheadAttentionPoolingHead`` at ``theirs`` into an :class:`AttentionPoolingHead` at ``ours``
    (``in_proj_*`` rows ``[q; k; v]`` -> ``attn.q_proj`` and ``attn.kv_proj``)."""
    plan.put(f"{ours}probe", f"{theirs}probe")
    for suffix in ("weight", "bias"):
        key = f"{theirs}attention.in_proj_{suffix}"
        t = plan.src.take(key)
        if t is not None:
            desc = plan.src.prefix + key
            plan.put_tensor(f"{ours}attn.q_proj.{suffix}", t[:dim], f"{desc}[:C]")
            plan.put_tensor(f"{ours}attn.kv_proj.{suffix}", t[dim:], f"{desc}[C:]")
    plan.put_pairs(ours, theirs, [("attn.out_proj", "attention.out_proj"), ("norm", "layernorm"),
                                  ("mlp.up_proj", "mlp.fc1"), ("mlp.down_proj", "mlp.fc2")])


def _tower(hf: HFConfig, sd: dict[str, Tensor], *, classifier: bool, ignore: list[str], device: Any,
           dtype: Any) -> tuple[VisionTransformer, Plan]:
    """Build the SigLIP tower and plan its weights (``vision_model.`` prefix or none): the
    attention-pooling head when its weights are there, unless ``classifier`` (the mean of the tokens
    and ``classifier.weight``'s rows of classes, none without it)."""
    src = Source(sd, "vision_model." if any(k.startswith("vision_model.") for k in sd) else "")
    w = sd.get("classifier.weight") if classifier else None
    num_classes = 0 if w is None else int(w.shape[0])
    pool_head = src.has("head.probe") and not classifier
    if src.has("head.probe") and not pool_head:
        ignore.append(re.escape(src.prefix) + r"head\..*")
    model = build_siglip(hf, pool_head=pool_head, num_classes=num_classes, device=device,
                         dtype=dtype or float_dtype(sd))
    plan = Plan(src, hf.arch)
    plan.put_pairs("", "embeddings.", [("patch_embed", "patch_embedding")])
    plan.put("pos_embed", "embeddings.position_embedding.weight", lambda t: t.unsqueeze(0))
    put_layers(plan, model.depth)
    if pool_head:
        put_attention_pool(plan, "head.", "head.", model.dim)
    return model, plan


def convert_siglip_vision(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> VisionTransformer:
    """``SiglipVisionModel``: the tower, its attention-pooling head if the weights have one."""
    ignore: list[str] = []
    model, plan = _tower(hf.with_defaults(DEFAULTS), sd, classifier=False, ignore=ignore, device=device, dtype=dtype)
    plan.apply(model, ignore=ignore)
    return model


def convert_siglip(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> VisionTransformer:
    """``siglip``: ``SiglipForImageClassification`` (mean of the tokens, ``classifier``; none with
    ``num_labels=0``) or ``SiglipModel`` (its vision tower; the text tower dropped with a warning)."""
    vis = vision_config(hf)
    dual = any(k.startswith("text_model.") or k in ("logit_scale", "logit_bias") for k in sd)
    ignore: list[str] = []
    model, plan = _tower(vis, sd, classifier=not dual, ignore=ignore, device=device, dtype=dtype)
    if model.head is not None and not dual:
        plan.src.prefix = ""
        plan.put_pairs("", "", [("head", "classifier")])
    if dual:
        text = sorted(k for k in sd if not k.startswith("vision_model."))
        warnings.warn(f"{hf.arch}: SiglipModel converts as its vision tower (forward = get_image_features(...)"
                      f".pooler_output); {len(text)} tensors of the text tower and the logit scale/bias have no "
                      f"attnzoo counterpart and are dropped: text_model.*, logit_scale, logit_bias ({hf.source})",
                      stacklevel=4)
        ignore.extend(re.escape(k) for k in text)
    plan.apply(model, ignore=ignore)
    return model


def convert_siglip2_vision(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> VisionTransformer:
    """``Siglip2VisionModel`` (NaFlex) on whole images: :class:`FlatPatchEmbedding` + the SigLIP tower."""
    hf = hf.with_defaults(SIGLIP2_DEFAULTS)
    patch, n = hf.raw("patch_size"), hf.req("num_patches")
    if not isinstance(patch, int) or isinstance(patch, bool):
        raise hf.unsupported(f"patch_size={patch!r} (SigLIP2 patches are square: one int)")
    grid = math.isqrt(n)
    if grid * grid != n:
        raise hf.unsupported(f"num_patches={n} (the position table is a square grid: a square number)")
    src = Source(sd, "vision_model." if any(k.startswith("vision_model.") for k in sd) else "")
    kw: dict[str, Any] = {"device": device, "dtype": dtype or float_dtype(sd)}
    C = hf.req("hidden_size")
    embedding = FlatPatchEmbedding(hf.req("num_channels"), patch, C, grid, **kw)
    model = build_siglip(hf, pool_head=src.has("head.probe"), embedding=embedding, image_size=grid * patch, **kw)
    plan = Plan(src, hf.arch)
    plan.put_pairs("embedding.", "embeddings.", [("patch_embedding", "patch_embedding")])
    plan.put("embedding.pos_embed", "embeddings.position_embedding.weight")
    put_layers(plan, model.depth)
    if src.has("head.probe"):
        put_attention_pool(plan, "head.", "head.", C)
    plan.apply(model)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "siglip_vision_model": parts.Dispatch("SigLIP vision", convert_siglip_vision, ("SiglipVisionModel",)),
    "siglip": parts.Dispatch("SigLIP", convert_siglip, ("SiglipForImageClassification", "SiglipModel")),
    "siglip2_vision_model": parts.Dispatch("SigLIP2 vision", convert_siglip2_vision, ("Siglip2VisionModel",)),
}
