"""DINOv2 (``model_type="dinov2"``), DINOv2 with registers (``"dinov2_with_registers"``) and DINOv3
(``"dinov3_vit"``) -> :class:`~attnzoo.VisionTransformer`: ``Dinov2Model``, ``Dinov2ForImageClassification``,
``Dinov2WithRegistersModel``, ``Dinov2WithRegistersForImageClassification``, ``DINOv3ViTModel``
(transformers 5.25, ``models/dinov2/modeling_dinov2.py``,
``models/dinov2_with_registers/modeling_dinov2_with_registers.py`` and ``models/dinov3_vit/modeling_dinov3_vit.py``;
line numbers below are those files', ``d2:``, ``reg:`` and ``v3:``).

The model is a pre-norm ViT built from parts:

* the embedding (:class:`DinoEmbedding`): a conv patch embedding (``d2:`` 40-68; the pixels cast to
  its weight's dtype), the class token first, plus the learned position table (class entry + a
  square grid of patch entries); at another patch grid the patch entries are resized bicubically
  **in float32** to the new grid, ``align_corners=False`` (``d2:`` 87-123), with ``antialias=True``
  for the registers family only (``reg:`` 119-125, it matters when shrinking); then, with
  registers, the register tokens are inserted after the class token, **without** positions
  (``reg:`` 146-150). The ``mask_token`` (masked-image pretraining, only used with
  ``bool_masked_pos``) is a parameter the embedding holds, so that ``to_hf`` writes it back;
* per layer (``d2:`` 294-326): ``x + ls1 * o_proj(attn(norm1(x)))`` then ``x + ls2 * mlp(norm2(x))``,
  the layer scales :class:`LayerScale` (a per-channel ``lambda1``, 228-234) in the block's output-norm
  slots (``attn_out_norm`` / ``ffn_out_norm``); the attention has biases on ``o_proj`` always and on
  q/k/v when ``qkv_bias`` (zeros otherwise); the MLP is ``fc2(act(fc1(x)))`` of width
  ``int(hidden_size * mlp_ratio)`` (237-251) or, with ``use_swiglu_ffn``, a biased SwiGLU of width
  ``(int(int(hidden_size * mlp_ratio) * 2 / 3) + 7) // 8 * 8`` (254-267, always SiLU);
* a final LayerNorm; the head (:class:`ClassMeanHead`): the base model's ``pooler_output`` is the
  normed class token (416); the classifier reads ``concat(class token, mean of the patch tokens)``
  (``[B, 2C]``; 456-459, the register tokens left out of the mean, ``reg:`` 466-468) into a linear
  layer (an identity when ``num_labels == 0``).

Discrepancies found in transformers: its position interpolation resizes to the target grid by
``size=`` (no ``scale_factor`` and none of the original DINO's ``+0.1`` offsets), and returns the
table unchanged only when the patch count matches **and** the image is square in pixels (``d2:`` 101);
at the training grid both give the same numbers, since a bicubic resize to the same size is exact.
A non-square image works at any grid. The position table must be a square grid (``d2:`` 111-112
reshape it so): configs whose ``image_size // patch_size`` grid is not square, or whose image size is
not a multiple of the patch size, are refused by name; so are the ``Dinov2Backbone`` class (its
feature maps are not a :class:`~attnzoo.VisionTransformer` output) and activations outside the
table. ``drop_path_rate`` (stochastic depth, training only) is accepted and not reproduced: the
converted model trains without it; the dropouts are kept.

DINOv3 (:class:`PatchRopeViT`, :func:`build_dinov3`) has the same blocks and layer scales but no
position table: the tokens are ``[class, registers, patches]`` (``v3:`` 60-90) and every attention
rotates the queries and keys of the **patch** tokens only by a 2-D RoPE of the patch centres
(:class:`PatchRope`; ``v3:`` 96-208, 245-268), so any image size works without interpolation;
q/k/v/o biases each by their flag (``query_bias`` ... ``proj_bias``, zeros where off; 278-341),
the MLP or gated MLP of ``intermediate_size`` with ``mlp_bias`` (353-381); ``pooler_output`` is the
normed class token (546). The hub's ``layer.*`` and transformers 5's ``model.layer.*`` names both
load. Refused: heads whose width is not a multiple of 4, activations outside the tables, the
``DINOv3ViTBackbone`` class. The training-time jitter of the patch coordinates
(``pos_embed_shift`` / ``_jitter`` / ``_rescale``, ``v3:`` 190-196) is accepted and not reproduced
(it applies in train mode only).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int
from attnzoo.blocks import FeedForward, TransformerBlock
from attnzoo.models.config import ViTConfig
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype, load_qkv_into
from attnzoo.models.hf.bert import ACTIVATIONS
from attnzoo.models.parts import ViTParts
from attnzoo.models.vit import VisionTransformer, resize_grid
from attnzoo.nn.positional import RotaryEmbedding
from attnzoo.variants import build_attention

__all__ = ["BIASES", "DEFAULTS", "DISPATCH", "PREFIXES", "ClassMeanHead", "DinoEmbedding", "LayerScale", "PatchRope",
           "PatchRopeViT", "build_dinov2", "build_dinov3", "convert_dinov2", "convert_dinov3", "empty_registers",
           "swiglu_hidden", "with_layer_scales"]

_COMMON: dict[str, Any] = {
    "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "mlp_ratio": 4, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "layer_norm_eps": 1e-6, "image_size": 224,
    "num_channels": 3, "qkv_bias": True, "layerscale_value": 1.0, "drop_path_rate": 0.0, "use_swiglu_ffn": False}
#: the config classes' defaults (``configuration_dinov2.py``, ``configuration_dinov2_with_registers.py``) for
#: the keys a ``config.json`` may leave out, by ``model_type``
DEFAULTS: dict[str, dict[str, Any]] = {
    "dinov2": {**_COMMON, "patch_size": 14, "use_mask_token": True},
    "dinov2_with_registers": {**_COMMON, "patch_size": 16, "num_register_tokens": 4},
    "dinov3_vit": {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 6,
                   "hidden_act": "gelu", "attention_dropout": 0.0, "layer_norm_eps": 1e-5, "rope_theta": 100.0,
                   "image_size": 224, "patch_size": 16, "num_channels": 3, "query_bias": True, "key_bias": False,
                   "value_bias": True, "proj_bias": True, "mlp_bias": True, "layerscale_value": 1.0,
                   "drop_path_rate": 0.0, "use_gated_mlp": False, "num_register_tokens": 0}}
#: DINOv3's per-projection bias flags (q, k, v, o)
BIASES = ("query_bias", "key_bias", "value_bias", "proj_bias")
#: the base model's prefix inside the classifier class, by ``model_type``
PREFIXES = {"dinov2": "dinov2.", "dinov2_with_registers": "dinov2_with_registers."}


class LayerScale(nn.Module):
    """A learned per-channel scale (Touvron et al. 2021, "Going deeper with image transformers";
    DINOv2's ``LayerScale``): ``y = x * gamma``, ``gamma [C]`` initialised to ``init_value``
    (small, e.g. ``1e-5``, so that a deep residual stack starts near the identity).

    Use it as the output-norm slot of a pre-norm :class:`~attnzoo.TransformerBlock`
    (``block.attn_out_norm`` / ``block.ffn_out_norm``, see :func:`with_layer_scales`): the block then
    computes ``x + gamma * sublayer(norm(x))``.

    Shapes: ``[..., C]`` -> ``[..., C]``. Weight: ``gamma [C]``.
    """

    def __init__(self, dim: int, init_value: float = 1e-5, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim = check_int(dim, "dim", "LayerScale")
        self.gamma = nn.Parameter(torch.full((dim,), float(init_value), device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma  # [..., C]

    def extra_repr(self) -> str:
        return f"{self.dim}"


def with_layer_scales(block: TransformerBlock, init_value: float = 1e-5, *, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> TransformerBlock:
    """``block`` (pre-norm, input norms only) with a :class:`LayerScale` on each sub-layer's output
    before its residual add (the ``attn_out_norm`` / ``ffn_out_norm`` slots): ``x + ls(f(norm(x)))``."""
    block.attn_out_norm = LayerScale(block.dim, init_value, device=device, dtype=dtype)
    if block.ffn is not None:
        block.ffn_out_norm = LayerScale(block.dim, init_value, device=device, dtype=dtype)
    return block


class DinoEmbedding(nn.Module):
    """DINOv2's input embedding as a :class:`~attnzoo.models.ViTParts` embedding: patches by a
    strided convolution, the class token first, a learned position table (class entry + a square
    ``grid x grid`` of patch entries) added, resized to other patch grids by :meth:`positions`; then
    ``registers`` learned register tokens (no positions) inserted after the class token.

    Args:
        in_channels, dim: image channels, width ``C``.
        patch_size: ``(Ph, Pw)``.
        grid: the side of the position table's square patch grid (``None``: no table, the positions are
            the attention's, DINOv3's :class:`PatchRope`).
        registers: register tokens ``R`` (``0``: none, no parameter).
        mask_token: hold a ``mask_token [1, C]`` (masked-image pretraining; not used by :meth:`forward`).
        antialias: antialiased bicubic resizing of the positions (DINOv2 with registers).

    Shapes: ``images [B, in_channels, H, W]`` -> ``[B, 1 + R + (H/Ph)(W/Pw), C]``.
    Weights: ``patch_embed`` (``Conv2d``), ``cls_token [1, 1, C]``, ``pos_embed [1, 1 + grid^2, C]``,
    ``register_tokens [1, R, C]``, ``mask_token [1, C]``.
    """

    def __init__(self, in_channels: int, dim: int, patch_size: tuple[int, int], grid: int | None, *,
                 registers: int = 0, mask_token: bool = True, antialias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.dim, self.grid, self.antialias = dim, grid, antialias
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size, **kw)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim, **kw))
        rows = None if grid is None else 1 + check_int(grid, "grid", "DinoEmbedding") ** 2
        self.pos_embed = None if rows is None else nn.Parameter(torch.zeros(1, rows, dim, **kw))
        check_int(registers, "registers", "DinoEmbedding", minimum=0)
        self.register_tokens = nn.Parameter(torch.zeros(1, registers, dim, **kw)) if registers else None
        self.mask_token = nn.Parameter(torch.zeros(1, dim, **kw)) if mask_token else None
        for p in (self.pos_embed, self.cls_token):
            if p is not None:
                nn.init.trunc_normal_(p, std=0.02)

    @property
    def num_prefix(self) -> int:
        """Tokens before the patches: the class token and the registers."""
        return 1 + (0 if self.register_tokens is None else self.register_tokens.shape[1])

    def positions(self, grid_h: int, grid_w: int) -> Tensor:
        """``[1, 1 + grid_h * grid_w, C]``: the table at its own grid, else its patch entries resized
        bicubically in float32 (``align_corners=False``, ``antialias`` as built) and cast back."""
        if self.pos_embed is None or self.grid is None:
            raise ValueError("DinoEmbedding: built without a position table (grid=None)")
        if (grid_h, grid_w) == (self.grid, self.grid):
            return self.pos_embed
        patch = resize_grid(self.pos_embed[0, 1:], (self.grid, self.grid), (grid_h, grid_w), antialias=self.antialias,
                            float32=True)  # [gh*gw, C]
        return torch.cat((self.pos_embed[:, :1], patch[None]), dim=1)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images.to(self.patch_embed.weight.dtype))  # [B, C, gh, gw]
        grid_h, grid_w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)  # [B, gh*gw, C]
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if self.pos_embed is not None:
            x = x + self.positions(grid_h, grid_w)
        if self.register_tokens is None:
            return x  # [B, 1 + gh*gw, C]
        registers = self.register_tokens.expand(x.shape[0], -1, -1)
        return torch.cat((x[:, :1], registers, x[:, 1:]), dim=1)  # [B, 1 + R + gh*gw, C]


class ClassMeanHead(nn.Module):
    """DINOv2's heads: without a ``classifier``, the class token ``features[:, 0]`` (``pooler_output``);
    with one, ``classifier(concat(features[:, 0], mean(features[:, num_prefix:])))`` (the mean over
    the patch tokens, after the class and register tokens).

    Shapes: ``features [B, T, C]`` -> ``[B, C]``, or ``[B, K]`` through a classifier ``Linear(2C, K)``
    (``[B, 2C]`` through ``nn.Identity``). Weights: the classifier's.
    """

    def __init__(self, num_prefix: int, classifier: nn.Module | None = None) -> None:
        super().__init__()
        self.num_prefix = check_int(num_prefix, "num_prefix", "ClassMeanHead")
        self.classifier = classifier

    def forward(self, features: Tensor) -> Tensor:
        cls = features[:, 0]  # [B, C]
        if self.classifier is None:
            return cls
        return self.classifier(torch.cat((cls, features[:, self.num_prefix:].mean(dim=1)), dim=-1))  # [B, K]

    def extra_repr(self) -> str:
        return f"num_prefix={self.num_prefix}"


def empty_registers(sd: dict[str, Tensor]) -> list[str]:
    """The ``[1, 0, C]`` register tables of a checkpoint without registers (the embedding holds none),
    as ``ignore`` patterns."""
    return [re.escape(k) for k, t in sd.items() if k.endswith("embeddings.register_tokens") and not t.numel()]


def swiglu_hidden(dim: int, mlp_ratio: float) -> int:
    """DINOv2's SwiGLU width: two thirds of ``int(dim * mlp_ratio)``, rounded up to a multiple of 8."""
    return (int(int(dim * mlp_ratio) * 2 / 3) + 7) // 8 * 8


def _pair(hf: HFConfig, key: str) -> tuple[int, int]:
    value = hf.raw(key)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    v = hf.req(key)
    return v, v


def _grid(hf: HFConfig) -> tuple[tuple[int, int], tuple[int, int], int]:
    """``(image_size, patch_size, grid side)``; a non-square or inexact table grid refused."""
    size, patch = _pair(hf, "image_size"), _pair(hf, "patch_size")
    if size[0] % patch[0] or size[1] % patch[1]:
        raise hf.unsupported(f"image_size={hf.raw('image_size')} not a multiple of patch_size={hf.raw('patch_size')}")
    gh, gw = size[0] // patch[0], size[1] // patch[1]
    if gh != gw:
        raise hf.unsupported(f"a non-square position grid {gh}x{gw} (image_size={hf.raw('image_size')}, "
                             f"patch_size={hf.raw('patch_size')}; transformers reshapes the table to a square)")
    return size, patch, gh


def _blocks(hf: HFConfig, C: int, H: int, kw: dict[str, Any]) -> list[nn.Module]:
    """One pre-norm block per layer: attention (``o_proj`` biased), the MLP or SwiGLU, two layer scales."""
    ratio = hf.get("mlp_ratio", 4, float)
    if hf.get("use_swiglu_ffn", False, bool):
        ffn = functools.partial(FeedForward, C, swiglu_hidden(C, ratio), "swiglu", bias=True, **kw)
    else:
        ffn = functools.partial(FeedForward, C, int(C * ratio), hf.activation("hidden_act", ACTIVATIONS), bias=True,
                                **kw)
    attn = functools.partial(build_attention, "mha", C, H, head_dim=hf.get("head_dim", C // H), causal=False,
                             bias=True, dropout=hf.get("attention_probs_dropout_prob", 0.0, float), **kw)
    norm = functools.partial(nn.LayerNorm, C, eps=hf.get("layer_norm_eps", 1e-6, float), **kw)
    scale = hf.get("layerscale_value", 1.0, float)
    return [with_layer_scales(parts.block(C, attn, ffn, norm), scale, **kw) for _ in range(hf.req("num_hidden_layers"))]


def build_dinov2(hf: HFConfig, *, model_type: str = "dinov2", classifier: int | None = None, device: Any = None,
                 dtype: Any = None) -> VisionTransformer:
    """The model of a DINOv2 config (random weights; see the module docstring). ``classifier``:
    ``None`` the base model (output: the class token), else the classifier's labels (``0``: its
    identity classifier, output ``[B, 2C]``)."""
    hf = hf.with_defaults(DEFAULTS[model_type])
    if "Dinov2Backbone" in hf.get("architectures", [], list) or "Dinov2WithRegistersBackbone" in hf.get(
            "architectures", [], list):
        raise hf.unsupported("the Backbone class (supported: the *Model and *ForImageClassification classes)")
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    size, patch, grid = _grid(hf)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    family = model_type == "dinov2_with_registers"
    embedding = DinoEmbedding(hf.get("num_channels", 3), C, patch, grid,
                              registers=hf.get("num_register_tokens", 0) if family else 0,
                              mask_token=family or hf.get("use_mask_token", True, bool), antialias=family, **kw)
    linear = None if not classifier else nn.Linear(2 * C, classifier, **kw)
    head = ClassMeanHead(embedding.num_prefix, None if classifier is None else linear or nn.Identity())
    blocks = _blocks(hf, C, H, kw)
    cfg = ViTConfig(size, patch, embedding.patch_embed.in_channels, classifier or 0, C, len(blocks), H,
                    norm_eps=hf.get("layer_norm_eps", 1e-6, float), dropout=hf.get("hidden_dropout_prob", 0.0, float))
    norm = nn.LayerNorm(C, eps=cfg.norm_eps, **kw)
    return VisionTransformer(config=cfg, parts=ViTParts(embedding=embedding, blocks=blocks, norm=norm, head=head), **kw)


def _put_layer(plan: Plan, i: int, *, qkv_bias: bool, swiglu: bool, legacy: bool) -> None:
    """Layer ``i``: transformers 5's names, or (``legacy``: the hub's checkpoints and the folders
    ``save_pretrained`` writes) ``attention.attention.{query,key,value}``, ``attention.output.dense`` and
    the fused SwiGLU ``mlp.weights_in`` (rows ``[gate; up]``) / ``mlp.weights_out``."""
    o, h = f"blocks.{i}.", f"encoder.layer.{i}."
    names = ("attention.attention.query", "attention.attention.key", "attention.attention.value") if legacy else \
        tuple(f"attention.{n}_proj" for n in "qkv")
    load_qkv_into(plan, f"{o}attn", tuple(f"{h}{n}.weight" for n in names),
                  tuple(f"{h}{n}.bias" for n in names) if qkv_bias else None, True)
    if swiglu and legacy:
        for suffix in ("weight", "bias"):
            for j, name in enumerate(("gate_proj", "up_proj")):
                plan.put(f"{o}ffn.{name}.{suffix}", f"{h}mlp.weights_in.{suffix}", lambda t, j=j: t.chunk(2)[j])
    mlp = [("down_proj", "weights_out" if legacy else "down_proj")] if swiglu else [("up_proj", "fc1"),
                                                                                   ("down_proj", "fc2")]
    if swiglu and not legacy:
        mlp += [("gate_proj", "gate_proj"), ("up_proj", "up_proj")]
    plan.put_pairs(f"{o}ffn.", f"{h}mlp.", mlp)
    out = "attention.output.dense" if legacy else "attention.o_proj"
    plan.put_pairs(o, h, [("attn.out_proj", out), ("attn_norm", "norm1"), ("ffn_norm", "norm2")])
    plan.put(f"{o}attn_out_norm.gamma", f"{h}layer_scale1.lambda1")
    plan.put(f"{o}ffn_out_norm.gamma", f"{h}layer_scale2.lambda1")


def convert_dinov2(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any,
                   model_type: str = "dinov2") -> VisionTransformer:
    """Build the model and copy the weights; the head follows them (the family prefix: the
    classifier class, ``classifier.weight`` its labels; no prefix: the base model)."""
    hf = hf.with_defaults(DEFAULTS[model_type])
    prefix = PREFIXES[model_type] if any(k.startswith(PREFIXES[model_type]) for k in sd) else ""
    labels = None if not prefix else int(sd["classifier.weight"].shape[0]) if "classifier.weight" in sd else 0
    model = build_dinov2(hf, model_type=model_type, classifier=labels, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(Source(sd, prefix), hf.arch)
    plan.put_pairs("embedding.", "embeddings.", [("patch_embed", "patch_embeddings.projection")])
    for ours, theirs in (("cls_token", "cls_token"), ("pos_embed", "position_embeddings"),
                         ("register_tokens", "register_tokens"), ("mask_token", "mask_token")):
        if getattr(model.embedding, ours) is not None:
            plan.put(f"embedding.{ours}", f"embeddings.{theirs}")
    legacy = not plan.src.has("encoder.layer.0.attention.o_proj.weight")
    for i in range(model.depth):
        _put_layer(plan, i, qkv_bias=hf.get("qkv_bias", True, bool), swiglu=hf.get("use_swiglu_ffn", False, bool),
                   legacy=legacy)
    plan.put_pairs("", "", [("norm", "layernorm")])
    if labels:
        plan.src.prefix = ""
        plan.put_pairs("head.", "", [("classifier", "classifier")])
    plan.apply(model, ignore=empty_registers(sd))
    return model


class PatchRope(RotaryEmbedding):
    """DINOv3's 2-D rotary embedding (``v3:`` 86-173, 243-268): a patch at row ``y``, column ``x`` of a
    ``gh x gw`` grid has the centre ``(cy, cx) = (2 (y + 1/2) / gh - 1, 2 (x + 1/2) / gw - 1)`` in
    ``[-1, 1]``; its angles are ``2 pi cy f_j`` then ``2 pi cx f_j`` with ``f_j = base^(-4j / D)``,
    ``j < D / 4`` (``D / 2`` angles, rotate-half pairing); the class and register tokens are not rotated.

    The attention's ``positions`` are token **codes** (:meth:`codes`: ``0`` for a prefix token, the
    patch's ``(gh, gw, y, x)`` packed in base ``2^15`` plus one otherwise), so that the patch grid of
    any image size reaches the rotation through the ordinary ``positions`` argument.

    Shapes: :meth:`cos_sin` ``codes [N]`` (or ``[B, N]``) -> ``cos, sin [1, 1, N, D / 2]`` (``[B, 1, N, D / 2]``).
    """

    SIDE = 1 << 15

    def __init__(self, head_dim: int, *, base: float) -> None:
        if check_int(head_dim, "head_dim", "PatchRope") % 4:
            raise ValueError(f"PatchRope: head_dim must be a multiple of 4 (two axes, rotated pairs), got {head_dim}")
        super().__init__(head_dim, base=base)
        inv = 1 / self.base ** torch.arange(0, 1, 4 / head_dim, dtype=torch.float32, device="cpu")  # as DINOv3
        self._set_inv_freq(inv.double())

    @classmethod
    def codes(cls, num_prefix: int, grid_h: int, grid_w: int, device: torch.device | str | None = None) -> Tensor:
        """``[num_prefix + grid_h * grid_w]`` int64: ``0`` for the prefix tokens, then the patches row by row."""
        if not 0 < grid_h < cls.SIDE or not 0 < grid_w < cls.SIDE:
            raise ValueError(f"PatchRope: a patch grid side must be below {cls.SIDE}, got {grid_h}x{grid_w}")
        y, x = torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device), indexing="ij")
        patch = ((grid_h * cls.SIDE + grid_w) * cls.SIDE + y.flatten()) * cls.SIDE + x.flatten() + 1
        return torch.cat((torch.zeros(num_prefix, dtype=torch.long, device=device), patch))

    def cos_sin(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        code = positions.clamp_min(1) - 1  # [N]; a prefix token (code 0) decodes to the centre (0, 0): no rotation
        S = self.SIDE
        x, y, gw, gh = code % S, code // S % S, code // S**2 % S, code // S**3
        centre = torch.stack(((y.to(dtype) + 0.5) / gh.clamp_min(1).to(dtype),
                              (x.to(dtype) + 0.5) / gw.clamp_min(1).to(dtype)), dim=-1) * 2.0 - 1.0  # [N, 2]
        angles = (2 * math.pi * centre)[..., None] * self.inv_freq(positions.device, dtype)  # [N, 2, D/4]
        angles = angles.flatten(-2)  # [N, D/2] or [B, N, D/2]
        angles = angles[None, None] if angles.dim() == 2 else angles[:, None]  # [1 | B, 1, N, D/2]
        return torch.cos(angles), torch.sin(angles)


class PatchRopeViT(VisionTransformer):
    """A :class:`~attnzoo.VisionTransformer` whose blocks get the :meth:`PatchRope.codes` of the
    image's patch grid as ``positions`` (DINOv3: no position table; every attention carries a
    :class:`PatchRope`). Shapes as :class:`~attnzoo.VisionTransformer`."""

    def forward_features(self, images: Tensor) -> Tensor:
        grid_h, grid_w = self._check_images(images)
        if self.embedding is None:
            raise ValueError("PatchRopeViT: build it with a ViTParts embedding (no position table: the positions "
                             "are the attention's PatchRope)")
        x = self.drop(self.embedding(images))  # [B, T, C]
        codes = PatchRope.codes(x.shape[1] - grid_h * grid_w, grid_h, grid_w, x.device)
        for block in self.blocks:
            x = block(x, positions=codes)
        return self.norm(x)


def build_dinov3(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> PatchRopeViT:
    """The model of a ``DINOv3ViTConfig`` (random weights): patches + class + register tokens, pre-norm
    blocks with :class:`PatchRope` attention (per-projection biases), layer scales, the MLP or gated
    MLP of ``intermediate_size``, a final LayerNorm; the output is the normed class token."""
    hf = hf.with_defaults(DEFAULTS["dinov3_vit"])
    if "DINOv3ViTBackbone" in hf.get("architectures", [], list):
        raise hf.unsupported("the Backbone class (supported: DINOv3ViTModel)")
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    if C % H or C // H % 4:
        raise hf.unsupported(f"hidden_size={C} with num_attention_heads={H} (the 2-D RoPE needs heads of a width "
                             f"that is a multiple of 4)")
    size, patch = _pair(hf, "image_size"), _pair(hf, "patch_size")
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    embedding = DinoEmbedding(hf.get("num_channels", 3), C, patch, None, registers=hf.get("num_register_tokens", 0),
                              **kw)
    F_ = hf.req("intermediate_size")
    gated = hf.get("use_gated_mlp", False, bool)
    act = hf.activation("hidden_act", parts.GATED if gated else ACTIVATIONS)
    ffn = functools.partial(FeedForward, C, F_, act, bias=hf.get("mlp_bias", True, bool), **kw)
    bias = any(hf.get(k, True, bool) for k in BIASES)
    rope = PatchRope(C // H, base=hf.get("rope_theta", 100.0, float))
    attn = functools.partial(build_attention, "mha", C, H, causal=False, bias=bias, rope=rope,
                             dropout=hf.get("attention_dropout", 0.0, float), **kw)
    norm = functools.partial(nn.LayerNorm, C, eps=hf.get("layer_norm_eps", 1e-5, float), **kw)
    scale = hf.get("layerscale_value", 1.0, float)
    blocks = [with_layer_scales(parts.block(C, attn, ffn, norm), scale, **kw) for _ in range(hf.req("num_hidden_layers"))]
    cfg = ViTConfig(size, patch, embedding.patch_embed.in_channels, 0, C, len(blocks), H, norm_eps=norm.keywords["eps"])
    return PatchRopeViT(config=cfg, parts=ViTParts(embedding=embedding, blocks=blocks, norm=norm(),
                                                   head=ClassMeanHead(embedding.num_prefix)), **kw)


def _put_biases(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """``{ours}.qkv_proj.bias`` / ``out_proj.bias`` from the projections that have one
    (``query_bias``, ``key_bias``, ``value_bias``, ``proj_bias``), zeros for the others."""
    weight = plan.src.sd[plan.src.prefix + f"{theirs}q_proj.weight"]
    pieces, names = [], []
    for flag, n in zip(BIASES[:3], "qkv", strict=True):
        taken = plan.src.take(f"{theirs}{n}_proj.bias") if hf.get(flag, True, bool) else None
        pieces.append(torch.zeros(weight.shape[0], dtype=weight.dtype) if taken is None else taken)
        names.append(f"{theirs}{n}_proj.bias" if taken is not None else "zeros")
    plan.put_tensor(f"{ours}.qkv_proj.bias", torch.cat(pieces), " + ".join(names))
    if hf.get("proj_bias", True, bool):
        plan.put(f"{ours}.out_proj.bias", f"{theirs}o_proj.bias")
    else:
        plan.put_tensor(f"{ours}.out_proj.bias", torch.zeros(weight.shape[1], dtype=weight.dtype), "zeros")


def convert_dinov3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> PatchRopeViT:
    """Build the model and copy the weights (transformers 5's ``model.layer.*`` or the hub's ``layer.*``)."""
    hf = hf.with_defaults(DEFAULTS["dinov3_vit"])
    model = build_dinov3(hf, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(Source(sd), hf.arch)
    plan.put_pairs("embedding.", "embeddings.", [("patch_embed", "patch_embeddings")])
    plan.put("embedding.cls_token", "embeddings.cls_token")
    if model.embedding.register_tokens is not None:
        plan.put("embedding.register_tokens", "embeddings.register_tokens")
    plan.put("embedding.mask_token", "embeddings.mask_token", lambda t: t.reshape(1, -1))
    layers = "model.layer." if "model.layer.0.norm1.weight" in sd else "layer."
    mlp = ["up_proj", "down_proj"] + (["gate_proj"] if hf.get("use_gated_mlp", False, bool) else [])
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"{layers}{i}."
        plan.put_cat(f"{o}attn.qkv_proj.weight", [f"{h}attention.{n}_proj.weight" for n in "qkv"])
        plan.put(f"{o}attn.out_proj.weight", f"{h}attention.o_proj.weight")
        if any(hf.get(k, True, bool) for k in BIASES):
            _put_biases(plan, f"{o}attn", f"{h}attention.", hf)
        plan.put_pairs(f"{o}ffn.", f"{h}mlp.", [(n, n) for n in mlp], bias=hf.get("mlp_bias", True, bool))
        plan.put_pairs(o, h, [("attn_norm", "norm1"), ("ffn_norm", "norm2")])
        plan.put(f"{o}attn_out_norm.gamma", f"{h}layer_scale1.lambda1")
        plan.put(f"{o}ffn_out_norm.gamma", f"{h}layer_scale2.lambda1")
    plan.put_pairs("", "", [("norm", "norm")])
    plan.apply(model, ignore=[r"rope_embeddings\.inv_freq", *empty_registers(sd)])
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "dinov2": parts.Dispatch("DINOv2", convert_dinov2, ("Dinov2Model", "Dinov2ForImageClassification")),
    "dinov2_with_registers": parts.Dispatch(
        "DINOv2-with-registers", functools.partial(convert_dinov2, model_type="dinov2_with_registers"),
        ("Dinov2WithRegistersModel", "Dinov2WithRegistersForImageClassification")),
    "dinov3_vit": parts.Dispatch("DINOv3-ViT", convert_dinov3, ("DINOv3ViTModel",))}
