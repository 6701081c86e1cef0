"""``VisionTransformer`` (Dosovitskiy et al. 2021): patches -> tokens -> pre-norm encoder."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.blocks import AttentionSpec, BlockConfig, TransformerBlock, make_norm
from attnzoo.models._common import FromConfig, init_weights
from attnzoo.models.config import ViTConfig
from attnzoo.models.parts import ViTParts, given_blocks, resolve_parts

__all__ = ["VisionTransformer", "resize_grid"]


def resize_grid(table: Tensor, grid: tuple[int, int], size: tuple[int, int], *, mode: str = "bicubic",
                antialias: bool = False, float32: bool = False) -> Tensor:
    """A position table of a patch grid resized to another grid (``interpolate_pos_encoding`` of
    ViT, DINOv2, CLIP, SigLIP): ``table [gh * gw, C]`` (row-major over ``grid = (gh, gw)``, no prefix
    entries) -> ``[H' * W', C]`` for ``size = (H', W')``, by ``F.interpolate`` (``mode``,
    ``align_corners=False``, ``antialias``; in float32 and cast back if ``float32``). The table
    itself when ``size == grid``."""
    if tuple(size) == tuple(grid):
        return table
    (gh, gw), (h, w), c = grid, size, table.shape[-1]
    if table.shape[0] != gh * gw:
        raise ValueError(f"resize_grid: table has {table.shape[0]} rows, expected {gh} x {gw} = {gh * gw}")
    t = table.reshape(1, gh, gw, c).permute(0, 3, 1, 2)  # [1, C, gh, gw]
    t = F.interpolate(t.float() if float32 else t, size=(h, w), mode=mode, align_corners=False, antialias=antialias)
    return t.permute(0, 2, 3, 1).reshape(h * w, c).to(table.dtype)  # [H' W', C]


class VisionTransformer(FromConfig, nn.Module):
    """Vision Transformer: a conv patch embedding, a class token, learned position embeddings
    (interpolated bicubically to other image sizes), pre-norm blocks, a final norm and a
    classification head.

    Build it from a :class:`~attnzoo.models.ViTConfig` (``config=``, ``from_config``; preset
    ``vit_b16``). The constructor's own keywords (the seven positionals, ``attention``)
    are shorthands for those fields and override ``config``'s when given; every other field goes
    through ``config=``.

    The config's fields:
        image_size: ``S`` or ``(H, W)`` the position table is built for.
        patch_size: ``P`` or ``(Ph, Pw)``; image sides must be multiples of it.
        in_channels: image channels.
        num_classes: classes of the head; ``0`` = no head (:meth:`forward` returns pooled features).
        dim, depth, num_heads: width ``C``, blocks, heads.
        ffn, ffn_hidden, norm, norm_eps, dropout: as in :class:`TransformerBlock`.
        qkv_bias: biases on the attention projections.
        class_token: prepend a learned ``[CLS]`` token.
        pool: ``"cls"`` (the class token) or ``"mean"`` (mean of the patch tokens) for the head.
        pooler: add a ``tanh(Linear(cls))`` pooler (Hugging Face ``ViTModel``), see :meth:`pooler_output`.
        attention, attention_kwargs: the mixer (registry name or factory; non-causal).

    Shapes: ``images [B, in_channels, H, W]`` -> ``logits [B, num_classes]``;
    :meth:`forward_features` -> ``[B, T, C]`` with ``T = (H/Ph)(W/Pw) (+1 with class token)``.
    Weights: ``patch_embed`` (``Conv2d``), ``cls_token [1, 1, C]``, ``pos_embed [1, T, C]``,
    ``blocks``, ``norm``, ``pooler``, ``head``.

    ``parts`` (:class:`~attnzoo.models.parts.ViTParts`): modules used as they are instead of the
    config's — the embedding (patches, prefix tokens, positions), the blocks, the final norm, a
    head with its own pooling — for vision families built from parts (DINOv2, SigLIP, CLIP).
    """

    config_class = ViTConfig

    def __init__(self, image_size: int | tuple[int, int] | None = None, patch_size: int | tuple[int, int] | None = None,
                 in_channels: int | None = None, num_classes: int | None = None, dim: int | None = None,
                 depth: int | None = None, num_heads: int | None = None, *, attention: AttentionSpec | None = None,
                 config: ViTConfig | None = None, parts: ViTParts | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = "VisionTransformer"
        given = {"image_size": image_size, "patch_size": patch_size, "in_channels": in_channels,
                 "num_classes": num_classes, "dim": dim, "depth": depth, "num_heads": num_heads,
                 "attention": attention}
        cfg = ViTConfig.resolve(config, owner, given)
        parts = resolve_parts(parts, ViTParts, owner)
        self.config = cfg
        self.image_size, self.patch_size = cfg.image_size, cfg.patch_size
        self.in_channels, self.num_classes, self.pool = cfg.in_channels, cfg.num_classes, cfg.pool
        self.dim, self.depth, self.num_heads = cfg.dim, cfg.depth, cfg.num_heads
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.grid = (self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1])
        self.num_prefix = 1 if cfg.class_token else 0
        self.embedding = parts.embedding
        if parts.embedding is None:
            self._build_embedding(cfg, kw)
        else:
            self.patch_embed, self.cls_token, self.pos_embed = None, None, None
        self.drop = nn.Dropout(cfg.dropout)
        if parts.blocks is None and cfg.dim % cfg.num_heads:  # given blocks carry their own head widths
            raise ValueError(f"{owner}: dim ({cfg.dim}) must be divisible by num_heads ({cfg.num_heads})")
        self.blocks = nn.ModuleList(given_blocks(parts.blocks, cfg.depth, owner) if parts.blocks is not None else [
            TransformerBlock(config=self.block_config(cfg), **kw) for _ in range(cfg.depth)])
        self.norm = make_norm(cfg.norm, cfg.dim, cfg.norm_eps, **kw) if parts.norm is None else parts.norm
        own_head = self._own_head = parts.head is None
        self.pooler = nn.Linear(cfg.dim, cfg.dim, **kw) if cfg.pooler and own_head else None
        self.head = (nn.Linear(cfg.dim, cfg.num_classes, **kw) if cfg.num_classes else None) if own_head \
            else parts.head
        keep = {name for name, part in (("embedding", parts.embedding), ("blocks", parts.blocks),
                                        ("norm", parts.norm), ("head", parts.head)) if part is not None}
        for name, child in self.named_children():  # given parts keep their own weights
            if name not in keep:
                init_weights(child, depth=cfg.depth)

    def _build_embedding(self, cfg: ViTConfig, kw: dict[str, Any]) -> None:
        """The config's patch embedding, class token and position table."""
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.dim, kernel_size=self.patch_size, stride=self.patch_size,
                                     **kw)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim, **kw)) if cfg.class_token else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix + self.grid[0] * self.grid[1], cfg.dim, **kw))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)

    @staticmethod
    def block_config(cfg: ViTConfig) -> BlockConfig:
        """The pre-norm, non-causal :class:`~attnzoo.blocks.BlockConfig` of every layer
        (``qkv_bias`` on the attention projections, biases in the FFN)."""
        akw = dict(cfg.attention_kwargs or {})
        if isinstance(cfg.attention, str):
            akw.setdefault("bias", cfg.qkv_bias)
        return BlockConfig(cfg.dim, cfg.num_heads, attention=cfg.attention, attention_kwargs=akw or None,
                           causal=False, norm=cfg.norm, norm_eps=cfg.norm_eps, norm_first=True, ffn=cfg.ffn,
                           ffn_hidden=cfg.ffn_hidden, dropout=cfg.dropout, bias=True)

    def _check_images(self, images: object) -> tuple[int, int]:
        owner = "VisionTransformer"
        if not isinstance(images, Tensor):
            raise TypeError(f"{owner}: images must be a tensor [B, {self.in_channels}, H, W], got {type(images).__name__}")
        if images.dim() != 4 or images.shape[1] != self.in_channels:
            raise ValueError(f"{owner}: images must have shape [B, {self.in_channels}, H, W], got {tuple(images.shape)}")
        if not images.is_floating_point():
            raise TypeError(f"{owner}: images must be a float tensor, got {images.dtype}")
        h, w = images.shape[-2:]
        ph, pw = self.patch_size
        if h % ph or w % pw:
            raise ValueError(f"{owner}: image size {h}x{w} is not divisible by the patch size {ph}x{pw}")
        return h // ph, w // pw

    def position_embeddings(self, grid_h: int, grid_w: int) -> Tensor:
        """Position embeddings ``[1, T, C]`` for a ``grid_h x grid_w`` patch grid: the table itself
        for the training grid, else the patch part resized bicubically (``align_corners=False``,
        as Hugging Face's ``interpolate_pos_encoding`` and DINO); the class-token entry is kept."""
        assert self.pos_embed is not None  # built when no embedding part is given
        if (grid_h, grid_w) == self.grid:
            return self.pos_embed
        patch = resize_grid(self.pos_embed[0, self.num_prefix:], self.grid, (grid_h, grid_w))  # [T', C]
        return torch.cat((self.pos_embed[:, : self.num_prefix], patch[None]), dim=1)  # [1, prefix + T', C]

    def forward_features(self, images: Tensor) -> Tensor:
        """Token features after the final norm: ``[B, T, C]`` (class token first when present).
        Any image size that is a multiple of the patch size works (positions are interpolated)."""
        gh, gw = self._check_images(images)
        if self.embedding is not None:
            return self._run_blocks(self.embedding(images))
        assert self.patch_embed is not None  # built when no embedding part is given
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, gh*gw, C]
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x), dim=1)  # [B, T, C]
        return self._run_blocks(x + self.position_embeddings(gh, gw).to(x.dtype))

    def _run_blocks(self, x: Tensor) -> Tensor:
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)  # [B, T, C]
        return self.norm(x)

    def pool_features(self, features: Tensor) -> Tensor:
        """``[B, T, C] -> [B, C]``: the class token or the mean of the patch tokens."""
        if self.pool == "cls":
            return features[:, 0]
        return features[:, self.num_prefix:].mean(dim=1)

    def pooler_output(self, features: Tensor) -> Tensor:
        """``tanh(pooler(features[:, 0]))`` (Hugging Face ``ViTModel.pooler_output``): ``[B, C]``."""
        if self.pooler is None:
            raise ValueError("VisionTransformer: this model has no pooler (build it with pooler=True)")
        return torch.tanh(self.pooler(features[:, 0]))

    def forward(self, images: Tensor) -> Tensor:
        """``images [B, in_channels, H, W]`` -> ``logits [B, num_classes]`` (pooled features
        ``[B, C]`` when ``num_classes == 0``; with a ``ViTParts.head``: what it returns)."""
        features = self.forward_features(images)
        if not self._own_head:
            assert self.head is not None
            return self.head(features)
        pooled = self.pool_features(features)
        return pooled if self.head is None else self.head(pooled)
