"""``VisionTransformer`` (Dosovitskiy et al. 2021): patches -> tokens -> pre-norm encoder."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.blocks import ACTIVATIONS, NORMS, AttentionSpec, TransformerBlock, make_norm
from attnzoo.models._common import check_int, init_weights

__all__ = ["VisionTransformer"]


def _pair(x: object, name: str, owner: str) -> tuple[int, int]:
    if isinstance(x, (tuple, list)) and len(x) == 2:
        return check_int(x[0], name, owner), check_int(x[1], name, owner)
    v = check_int(x, name, owner)
    return v, v


class VisionTransformer(nn.Module):
    """Vision Transformer: a conv patch embedding, a class token, learned position embeddings
    (interpolated bicubically to other image sizes), pre-norm blocks, a final norm and a
    classification head.

    Args:
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
    """

    def __init__(
        self,
        image_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_channels: int = 3,
        num_classes: int = 1000,
        dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        *,
        ffn: str = "gelu",
        ffn_hidden: int | None = None,
        norm: str = "layer",
        norm_eps: float = 1e-6,
        qkv_bias: bool = True,
        class_token: bool = True,
        pool: str = "cls",
        pooler: bool = False,
        dropout: float = 0.0,
        attention: AttentionSpec = "mha",
        attention_kwargs: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        owner = "VisionTransformer"
        self.image_size = _pair(image_size, "image_size", owner)
        self.patch_size = _pair(patch_size, "patch_size", owner)
        for side, (s, p) in zip(("height", "width"), zip(self.image_size, self.patch_size, strict=True), strict=True):
            if s % p:
                raise ValueError(f"{owner}: image {side} {s} is not divisible by the patch size {p} "
                                 f"(image_size={self.image_size}, patch_size={self.patch_size})")
        self.in_channels = check_int(in_channels, "in_channels", owner)
        self.num_classes = check_int(num_classes, "num_classes", owner, minimum=0)
        self.dim = check_int(dim, "dim", owner)
        self.depth = check_int(depth, "depth", owner)
        self.num_heads = check_int(num_heads, "num_heads", owner)
        if dim % num_heads:
            raise ValueError(f"{owner}: dim ({dim}) must be divisible by num_heads ({num_heads})")
        if norm not in NORMS:
            raise ValueError(f"{owner}: norm must be one of {NORMS}, got {norm!r}")
        if ffn not in ACTIVATIONS:
            raise ValueError(f"{owner}: ffn must be one of {list(ACTIVATIONS)}, got {ffn!r}")
        if pool not in ("cls", "mean"):
            raise ValueError(f"{owner}: pool must be 'cls' or 'mean', got {pool!r}")
        if (pool == "cls" or pooler) and not class_token:
            raise ValueError(f"{owner}: pool='cls' and pooler=True need class_token=True")
        if isinstance(attention, nn.Module):
            raise TypeError(f"{owner}: attention must be a registry name or a callable (dim, num_heads) -> "
                            f"nn.Module (one module per layer), got an nn.Module instance")
        self.pool = pool
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.grid = (self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1])
        self.num_prefix = 1 if class_token else 0
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=self.patch_size, stride=self.patch_size, **kw)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim, **kw)) if class_token else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix + self.grid[0] * self.grid[1], dim, **kw))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.drop = nn.Dropout(dropout)
        akw = dict(attention_kwargs or {})
        if isinstance(attention, str):
            akw.setdefault("bias", qkv_bias)
        self.blocks = nn.ModuleList([
            TransformerBlock(dim, num_heads, attention=attention, attention_kwargs=akw or None, causal=False,
                             norm=norm, norm_eps=norm_eps, norm_first=True, ffn=ffn, ffn_hidden=ffn_hidden,
                             dropout=dropout, bias=True, **kw)
            for _ in range(depth)
        ])
        self.norm = make_norm(norm, dim, norm_eps, **kw)
        self.pooler = nn.Linear(dim, dim, **kw) if pooler else None
        self.head = nn.Linear(dim, num_classes, **kw) if num_classes else None
        init_weights(self, depth=depth)

    def num_parameters(self) -> int:
        """Number of distinct parameters."""
        return sum(p.numel() for p in self.parameters())

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
        if (grid_h, grid_w) == self.grid:
            return self.pos_embed
        prefix = self.pos_embed[:, : self.num_prefix]  # [1, 1|0, C]
        patch = self.pos_embed[:, self.num_prefix:]  # [1, gh*gw, C]
        gh, gw = self.grid
        patch = patch.reshape(1, gh, gw, self.dim).permute(0, 3, 1, 2)  # [1, C, gh, gw]
        patch = F.interpolate(patch, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        patch = patch.permute(0, 2, 3, 1).reshape(1, grid_h * grid_w, self.dim)  # [1, T', C]
        return torch.cat((prefix, patch), dim=1)

    def forward_features(self, images: Tensor) -> Tensor:
        """Token features after the final norm: ``[B, T, C]`` (class token first when present).
        Any image size that is a multiple of the patch size works (positions are interpolated)."""
        gh, gw = self._check_images(images)
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, gh*gw, C]
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x), dim=1)  # [B, T, C]
        x = self.drop(x + self.position_embeddings(gh, gw).to(x.dtype))
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
        ``[B, C]`` when ``num_classes == 0``)."""
        pooled = self.pool_features(self.forward_features(images))
        return pooled if self.head is None else self.head(pooled)
