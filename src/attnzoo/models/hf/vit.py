"""ViT (``ViTModel``, ``ViTForImageClassification``) -> :class:`~attnzoo.VisionTransformer`.

Pre-norm with a final LayerNorm and exact GELU; both the transformers 4 (``encoder.layer``)
and 5 (``layers``) state-dict layouts load.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.models.config import ViTConfig
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype, load_qkv_into
from attnzoo.models.hf.bert import ACTIVATIONS
from attnzoo.models.vit import VisionTransformer

__all__ = ["convert_vit", "vit_config"]


def _size(hf: HFConfig, key: str, default: int) -> int | tuple[int, int]:
    value = hf.raw(key, default)
    if isinstance(value, list):
        value = tuple(value)
    return value


def vit_config(hf: HFConfig, *, pooler: bool, num_classes: int) -> ViTConfig:
    """The :class:`ViTConfig` of a ViT config (``pooler``: the checkpoint has one)."""
    if hf.get("pooler_act", "tanh", str) != "tanh":
        raise hf.unsupported(f"pooler_act={hf.raw('pooler_act')!r}")
    C = hf.req("hidden_size")
    if pooler and hf.get("pooler_output_size", C) != C:
        raise hf.unsupported(f"pooler_output_size={hf.raw('pooler_output_size')} != hidden_size")
    return ViTConfig(
        _size(hf, "image_size", 224), _size(hf, "patch_size", 16), hf.get("num_channels", 3), num_classes, C,
        hf.req("num_hidden_layers"), hf.req("num_attention_heads"), ffn=hf.activation("hidden_act", ACTIVATIONS),
        ffn_hidden=hf.req("intermediate_size"), norm_eps=hf.get("layer_norm_eps", 1e-12, float), qkv_bias=True,
        pooler=pooler)


def _layer(plan: Plan, i: int, new_layout: bool) -> None:
    o = f"blocks.{i}."
    if new_layout:  # transformers >= 5
        h = f"layers.{i}."
        qkv = tuple(f"{h}attention.{n}_proj" for n in "qkv")
        pairs = [("attn.out_proj", "attention.o_proj"), ("ffn.up_proj", "mlp.fc1"), ("ffn.down_proj", "mlp.fc2")]
    else:  # transformers 4 checkpoints
        h = f"encoder.layer.{i}."
        qkv = tuple(f"{h}attention.attention.{n}" for n in ("query", "key", "value"))
        pairs = [("attn.out_proj", "attention.output.dense"), ("ffn.up_proj", "intermediate.dense"),
                 ("ffn.down_proj", "output.dense")]
    load_qkv_into(plan, o + "attn", tuple(k + ".weight" for k in qkv), tuple(k + ".bias" for k in qkv), True)
    plan.put_pairs(o, h, [*pairs, ("attn_norm", "layernorm_before"), ("ffn_norm", "layernorm_after")])


def convert_vit(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any, classifier: bool) -> VisionTransformer:
    """Build the ViT and copy the weights (``vit.`` prefix of the classifier class)."""
    prefix = "vit." if any(k.startswith("vit.") for k in sd) else ""
    src = Source(sd, prefix)
    num_classes = 0
    if classifier:
        w = sd.get("classifier.weight")
        num_classes = int(w.shape[0]) if w is not None else len(hf.get("id2label", {}, dict)) or 2
    cfg = vit_config(hf, pooler=src.has("pooler.dense.weight"), num_classes=num_classes)
    model = VisionTransformer.from_config(cfg, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(src, "ViT")
    plan.put("cls_token", "embeddings.cls_token")
    plan.put("pos_embed", "embeddings.position_embeddings")
    plan.put_pairs("", "", [("patch_embed", "embeddings.patch_embeddings.projection")])
    new_layout = src.has("layers.0.attention.q_proj.weight")
    for i in range(cfg.depth):
        _layer(plan, i, new_layout)
    plan.put_pairs("", "", [("norm", "layernorm")])
    if cfg.pooler:
        plan.put_pairs("", "", [("pooler", "pooler.dense")])
    if classifier:
        plan.src.prefix = ""
        plan.put_pairs("", "", [("head", "classifier")])
    plan.apply(model, ignore=[r"(vit\.)?embeddings\.mask_token"])
    return model
