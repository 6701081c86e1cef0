"""Hugging Face interop: convert ``transformers`` models, load checkpoint folders, tokenize.

* :func:`from_hf` converts a ``transformers`` model instance (``BertModel``, ``GPT2LMHeadModel`` /
  ``GPT2Model``, ``LlamaForCausalLM``, ``MistralForCausalLM``, ``ViTModel``,
  ``ViTForImageClassification``) into the equivalent attnzoo model with the same weights.
* :func:`load_pretrained` / :func:`load_bert` build the model straight from a folder holding
  ``config.json`` and ``model.safetensors`` (or sharded safetensors, or ``pytorch_model.bin``);
  neither ``transformers`` nor ``safetensors`` is needed (:func:`read_safetensors` is a small
  reader written with torch only).
* :class:`WordPieceTokenizer` reads a BERT ``vocab.txt`` (uncased/cased basic tokenisation and
  greedy longest-match WordPiece, as ``BertTokenizer``).

Weight conventions handled here (see ``docs/models.md``):

* GPT-2 stores projections as ``Conv1D`` with weights ``[in, out]``: transposed into
  ``nn.Linear``'s ``[out, in]``. ``c_attn`` rows (after the transpose) are ``[q; k; v]``.
* LLaMA/Mistral checkpoints in Hugging Face layout already use split-half RoPE (the conversion
  script permuted Meta's interleaved q/k rows), so their q/k weights are copied as they are into
  attention with ``RotaryEmbedding(interleaved=False)``.
* Mistral's ``sliding_window=W`` (a query sees itself and ``W - 1`` keys before it) is
  ``SlidingWindowAttention(window=W - 1)``.
* BERT is post-norm; ViT is pre-norm with a final LayerNorm; both use exact GELU.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "WeightLoadError",
    "WordPieceTokenizer",
    "from_hf",
    "load_bert",
    "load_pretrained",
    "load_state_dict_from_folder",
    "read_safetensors",
]

SUPPORTED_ARCHITECTURES = ("BertModel", "GPT2LMHeadModel", "GPT2Model", "LlamaForCausalLM", "MistralForCausalLM",
                           "ViTModel", "ViTForImageClassification")


class WeightLoadError(ValueError):
    """A checkpoint's state dict does not match the model built from its config."""


# ----------------------------------------------------------------------------- safetensors
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a ``.safetensors`` file with torch only (no ``safetensors`` package needed).

    Format: an 8-byte little-endian header length, a JSON header mapping each name to its
    ``dtype``, ``shape`` and ``data_offsets`` (relative to the end of the header), then the raw
    little-endian data. The returned CPU tensors share one buffer read from the file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"read_safetensors: no such file {str(p)!r}")
    size = p.stat().st_size
    buf = bytearray(size)
    with open(p, "rb") as f:
        if f.readinto(buf) != size:
            raise ValueError(f"read_safetensors: could not read all {size} bytes of {str(p)!r}")
    if size < 8:
        raise ValueError(f"read_safetensors: {str(p)!r} is too short to be a safetensors file")
    n = int.from_bytes(buf[:8], "little")
    if n <= 0 or 8 + n > size:
        raise ValueError(f"read_safetensors: {str(p)!r} has an invalid header length {n} (file size {size})")
    header = json.loads(buf[8: 8 + n].decode("utf-8"))
    base = 8 + n
    out: dict[str, Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"read_safetensors: tensor {name!r} has unsupported dtype {info['dtype']!r} "
                             f"(supported: {sorted(_ST_DTYPES)})")
        shape = [int(s) for s in info["shape"]]
        start, end = (int(o) for o in info["data_offsets"])
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dt).element_size()
        if end - start != numel * itemsize or base + end > size:
            raise ValueError(f"read_safetensors: tensor {name!r} has inconsistent offsets {start}..{end} for "
                             f"shape {shape} {info['dtype']}")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dt)
        else:
            out[name] = torch.frombuffer(buf, dtype=dt, count=numel, offset=base + start).reshape(shape)
    return out


def load_state_dict_from_folder(folder: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The checkpoint of a Hugging Face model folder: ``model.safetensors``, sharded safetensors
    (``model.safetensors.index.json``) or ``pytorch_model.bin`` (loaded with ``weights_only``)."""
    d = Path(folder)
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    if single.is_file():
        return read_safetensors(single)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        sd: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            sd.update(read_safetensors(d / shard))
        return sd
    binary = d / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {str(d)!r}")


def _read_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    d = Path(folder)
    if not d.is_dir():
        raise FileNotFoundError(f"not a directory: {str(d)!r}")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"no config.json in {str(d)!r}")
    return json.loads(cfg.read_text())


# ----------------------------------------------------------------------------- state mapping
class _Source:
    """The checkpoint's tensors; records which keys were used and which were absent."""

    def __init__(self, sd: dict[str, Tensor], prefix: str = "") -> None:
        self.sd = sd
        self.prefix = prefix
        self.used: set[str] = set()
        self.missing: list[str] = []

    def has(self, key: str) -> bool:
        return self.prefix + key in self.sd

    def take(self, key: str) -> Tensor | None:
        full = self.prefix + key
        if full not in self.sd:
            self.missing.append(full)
            return None
        self.used.add(full)
        return self.sd[full]

    def opt(self, key: str) -> Tensor | None:
        full = self.prefix + key
        if full not in self.sd:
            return None
        self.used.add(full)
        return self.sd[full]


class _Plan:
    """Target tensors for the attnzoo model's parameters, with the checkpoint key each came from."""

    def __init__(self, src: _Source, arch: str) -> None:
        self.src = src
        self.arch = arch
        self.values: dict[str, tuple[Tensor, str]] = {}

    def put(self, name: str, key: str, transform: Callable[[Tensor], Tensor] | None = None,
            optional: bool = False) -> None:
        t = self.src.opt(key) if optional else self.src.take(key)
        if t is not None:
            self.values[name] = (t if transform is None else transform(t), self.src.prefix + key)

    def put_cat(self, name: str, keys: Sequence[str], transform: Callable[[Tensor], Tensor] | None = None) -> None:
        parts = [self.src.take(k) for k in keys]
        if all(p is not None for p in parts):
            t = torch.cat([p for p in parts if p is not None], dim=0)
            self.values[name] = (t if transform is None else transform(t),
                                 " + ".join(self.src.prefix + k for k in keys))

    def put_tensor(self, name: str, tensor: Tensor, desc: str) -> None:
        self.values[name] = (tensor, desc)

    def apply(self, model: nn.Module, ignore: Iterable[str] = ()) -> None:
        """Copy every planned tensor into ``model``; raise :class:`WeightLoadError` listing missing
        checkpoint keys, unexpected checkpoint keys, model parameters without a source and shape
        mismatches (all at once)."""
        patterns = [re.compile(p) for p in ignore]
        params = dict(model.named_parameters())
        params.update({n: b for n, b in model.named_buffers() if _is_persistent(model, n)})
        mismatched = []
        for name, (t, key) in self.values.items():
            if name not in params:
                mismatched.append(f"{key} -> {name}: no such attnzoo parameter")
            elif tuple(t.shape) != tuple(params[name].shape):
                mismatched.append(f"{key}: checkpoint shape {tuple(t.shape)} vs attnzoo {name} "
                                  f"shape {tuple(params[name].shape)}")
        unfilled = sorted(n for n in params if n not in self.values)
        unexpected = sorted(k for k in self.src.sd if k not in self.src.used
                            and not any(p.fullmatch(k) for p in patterns))
        problems = []
        if self.src.missing:
            problems.append(f"missing checkpoint keys {sorted(self.src.missing)}")
        if unexpected:
            problems.append(f"unexpected checkpoint keys {unexpected}")
        if mismatched:
            problems.append(f"shape mismatches {mismatched}")
        if unfilled and not self.src.missing:
            problems.append(f"attnzoo parameters with no source {unfilled}")
        if problems:
            raise WeightLoadError(f"cannot load {self.arch} weights: " + "; ".join(problems))
        with torch.no_grad():
            for name, (t, _) in self.values.items():
                params[name].copy_(t)


def _is_persistent(model: nn.Module, name: str) -> bool:
    mod_name, _, buf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    return buf not in getattr(mod, "_non_persistent_buffers_set", set())


def _t(x: Tensor) -> Tensor:
    """Conv1D ``[in, out]`` -> Linear ``[out, in]``."""
    return x.t()


def _cfg(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


def _unsupported(arch: str, what: str) -> WeightLoadError:
    return WeightLoadError(f"{arch}: {what} is not supported by attnzoo.interop")


_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
        "silu": "silu", "swish": "silu"}
_GATED_ACT = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}


def _activation(cfg: dict[str, Any], arch: str, key: str, gated: bool = False) -> str:
    act = cfg.get(key, "gelu")
    table = _GATED_ACT if gated else _ACT
    if act not in table:
        raise _unsupported(arch, f"{key}={act!r} (supported: {sorted(table)})")
    return table[act]


def _float_dtype(sd: dict[str, Tensor]) -> torch.dtype:
    for t in sd.values():
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def _load_qkv_into(plan: _Plan, prefix: str, keys: tuple[str, str, str], bias_keys: tuple[str, str, str] | None,
                   has_bias: bool) -> None:
    """Fill ``{prefix}.qkv_proj`` (rows ``[q; k; v]``) from three separate projections; when the
    module has biases but the checkpoint has none for q/k/v, they are zero."""
    plan.put_cat(f"{prefix}.qkv_proj.weight", keys)
    if not has_bias:
        return
    if bias_keys is not None and all(plan.src.has(k) for k in bias_keys):
        plan.put_cat(f"{prefix}.qkv_proj.bias", bias_keys)
    else:
        ws = [plan.src.sd.get(plan.src.prefix + k) for k in keys]
        rows = sum(w.shape[0] for w in ws if w is not None)
        ref = next((w for w in ws if w is not None), None)
        if ref is not None:
            plan.put_tensor(f"{prefix}.qkv_proj.bias", torch.zeros(rows, dtype=ref.dtype), "zeros (no q/k/v bias)")


# ----------------------------------------------------------------------------- BERT
def _bert(cfg: dict[str, Any], sd: dict[str, Tensor], *, device: Any, dtype: Any,
          strict_prefix: bool = False) -> nn.Module:
    from attnzoo.models import TransformerEncoder

    arch = "BERT"
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise _unsupported(arch, f"position_embedding_type={cfg['position_embedding_type']!r}")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise _unsupported(arch, "a BERT decoder (is_decoder/add_cross_attention)")
    prefix = "bert." if not strict_prefix and any(k.startswith("bert.") for k in sd) else ""
    src = _Source(sd, prefix)
    has_pooler = src.has("pooler.dense.weight")
    C, L = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    model = TransformerEncoder(
        int(cfg["vocab_size"]), C, L, int(cfg["num_attention_heads"]),
        max_seq_len=int(cfg.get("max_position_embeddings", 512)), pos="learned",
        type_vocab_size=int(cfg.get("type_vocab_size", 2)), norm="layer",
        norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), norm_first=False, embed_norm=True, final_norm=False,
        ffn=_activation(cfg, arch, "hidden_act"), ffn_hidden=int(cfg["intermediate_size"]), pooler=has_pooler,
        device=device, dtype=dtype or _float_dtype(sd))
    plan = _Plan(src, arch)
    plan.put("tok_emb.weight", "embeddings.word_embeddings.weight")
    plan.put("pos_emb.weight", "embeddings.position_embeddings.weight")
    if model.type_emb is not None:
        plan.put("type_emb.weight", "embeddings.token_type_embeddings.weight")
    plan.put("embed_norm.weight", "embeddings.LayerNorm.weight")
    plan.put("embed_norm.bias", "embeddings.LayerNorm.bias")
    for i in range(L):
        h, o = f"encoder.layer.{i}.", f"blocks.{i}."
        _load_qkv_into(plan, o + "attn", tuple(f"{h}attention.self.{n}.weight" for n in ("query", "key", "value")),
                       tuple(f"{h}attention.self.{n}.bias" for n in ("query", "key", "value")), True)
        plan.put(o + "attn.out_proj.weight", h + "attention.output.dense.weight")
        plan.put(o + "attn.out_proj.bias", h + "attention.output.dense.bias")
        plan.put(o + "attn_norm.weight", h + "attention.output.LayerNorm.weight")
        plan.put(o + "attn_norm.bias", h + "attention.output.LayerNorm.bias")
        plan.put(o + "ffn.up_proj.weight", h + "intermediate.dense.weight")
        plan.put(o + "ffn.up_proj.bias", h + "intermediate.dense.bias")
        plan.put(o + "ffn.down_proj.weight", h + "output.dense.weight")
        plan.put(o + "ffn.down_proj.bias", h + "output.dense.bias")
        plan.put(o + "ffn_norm.weight", h + "output.LayerNorm.weight")
        plan.put(o + "ffn_norm.bias", h + "output.LayerNorm.bias")
    if has_pooler:
        plan.put("pooler.weight", "pooler.dense.weight")
        plan.put("pooler.bias", "pooler.dense.bias")
    # position_ids is a non-persistent buffer in recent versions but present in older files;
    # pre-training heads (cls.*) of BertFor* checkpoints are not part of the encoder.
    plan.apply(model, ignore=[r"(bert\.)?embeddings\.position_ids", r"cls\..*"] if prefix else
               [r"embeddings\.position_ids"])
    return model


# ----------------------------------------------------------------------------- GPT-2
def _gpt2(cfg: dict[str, Any], sd: dict[str, Tensor], *, device: Any, dtype: Any) -> nn.Module:
    from attnzoo.models import DecoderLM

    arch = "GPT-2"
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        raise _unsupported(arch, "scale_attn_by_inverse_layer_idx=True")
    if cfg.get("add_cross_attention"):
        raise _unsupported(arch, "add_cross_attention=True")
    prefix = "transformer." if any(k.startswith("transformer.") for k in sd) else ""
    src = _Source(sd, prefix)
    C, L, H = int(cfg["n_embd"]), int(cfg["n_layer"]), int(cfg["n_head"])
    tie = bool(cfg.get("tie_word_embeddings", True)) or "lm_head.weight" not in sd
    akw: dict[str, Any] = {}
    if not cfg.get("scale_attn_weights", True):
        akw["scale"] = 1.0
    model = DecoderLM(
        int(cfg["vocab_size"]), C, L, H, attention="mha", attention_kwargs=akw or None,
        max_seq_len=int(cfg.get("n_positions", 1024)), pos="learned", norm="layer",
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), ffn=_activation(cfg, arch, "activation_function"),
        ffn_hidden=int(_cfg(cfg, "n_inner", default=4 * C)), tie_embeddings=tie, bias=True,
        device=device, dtype=dtype or _float_dtype(sd))
    plan = _Plan(src, arch)
    plan.put("tok_emb.weight", "wte.weight")
    plan.put("pos_emb.weight", "wpe.weight")
    for i in range(L):
        h, o = f"h.{i}.", f"blocks.{i}."
        plan.put(o + "attn_norm.weight", h + "ln_1.weight")
        plan.put(o + "attn_norm.bias", h + "ln_1.bias")
        plan.put(o + "attn.qkv_proj.weight", h + "attn.c_attn.weight", _t)  # rows [q; k; v]
        plan.put(o + "attn.qkv_proj.bias", h + "attn.c_attn.bias")
        plan.put(o + "attn.out_proj.weight", h + "attn.c_proj.weight", _t)
        plan.put(o + "attn.out_proj.bias", h + "attn.c_proj.bias")
        plan.put(o + "ffn_norm.weight", h + "ln_2.weight")
        plan.put(o + "ffn_norm.bias", h + "ln_2.bias")
        plan.put(o + "ffn.up_proj.weight", h + "mlp.c_fc.weight", _t)
        plan.put(o + "ffn.up_proj.bias", h + "mlp.c_fc.bias")
        plan.put(o + "ffn.down_proj.weight", h + "mlp.c_proj.weight", _t)
        plan.put(o + "ffn.down_proj.bias", h + "mlp.c_proj.bias")
    plan.put("norm.weight", "ln_f.weight")
    plan.put("norm.bias", "ln_f.bias")
    ignore = [r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)"]
    if tie:
        ignore.append(r"lm_head\.weight")
    else:
        plan.src.prefix = ""
        plan.put("lm_head.weight", "lm_head.weight")
    plan.apply(model, ignore=ignore)
    return model


# ----------------------------------------------------------------------------- LLaMA / Mistral
def _rope(cfg: dict[str, Any], arch: str, head_dim: int) -> nn.Module:
    """The RotaryEmbedding of a LLaMA-family config: ``rope_theta`` and the ``default`` or
    ``linear`` (position interpolation) rope types, split-half pairing."""
    from attnzoo.nn.positional import RotaryEmbedding

    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise _unsupported(arch, f"partial_rotary_factor={partial}")
    base = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RotaryEmbedding(head_dim, base=base)
    if rope_type == "linear":
        return RotaryEmbedding(head_dim, base=base, scaling="linear", scaling_factor=float(params["factor"]))
    raise _unsupported(arch, f"rope_type={rope_type!r} (supported: 'default', 'linear')")


def _llama(cfg: dict[str, Any], sd: dict[str, Tensor], *, device: Any, dtype: Any, arch: str) -> nn.Module:
    from attnzoo.models import DecoderLM

    C, L, H = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    Hkv = int(_cfg(cfg, "num_key_value_heads", default=H))
    D = int(_cfg(cfg, "head_dim", default=C // H))
    attn_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    if cfg.get("pretraining_tp", 1) not in (None, 1):
        raise _unsupported(arch, f"pretraining_tp={cfg['pretraining_tp']}")
    window = cfg.get("sliding_window") if arch == "Mistral" else None
    layer_types = cfg.get("layer_types")
    if window is not None and layer_types and any(t != "sliding_attention" for t in layer_types):
        raise _unsupported(arch, "mixed full/sliding layer_types")
    akw: dict[str, Any] = {"bias": attn_bias, "num_kv_heads": Hkv, "rope": _rope(cfg, arch, D)}
    attention = "mha"
    if window is not None:
        attention = "sliding"
        akw["window"] = int(window) - 1  # HF: q - k < W  ->  W - 1 keys before the query
    tie = bool(cfg.get("tie_word_embeddings", False))
    model = DecoderLM(
        int(cfg["vocab_size"]), C, L, H, attention=attention, attention_kwargs=akw,
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)), pos="rope", norm="rms",
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), ffn=_activation(cfg, arch, "hidden_act", gated=True),
        ffn_hidden=int(cfg["intermediate_size"]), tie_embeddings=tie, bias=mlp_bias,
        head_dim=D if D != C // H or C % H else None,
        device=device, dtype=dtype or _float_dtype(sd))
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    plan = _Plan(_Source(sd, prefix), arch)
    plan.put("tok_emb.weight", "embed_tokens.weight")
    for i in range(L):
        h, o = f"layers.{i}.", f"blocks.{i}."
        _load_qkv_into(plan, o + "attn", tuple(f"{h}self_attn.{n}_proj.weight" for n in "qkv"),
                       tuple(f"{h}self_attn.{n}_proj.bias" for n in "qkv") if attn_bias else None, attn_bias)
        plan.put(o + "attn.out_proj.weight", h + "self_attn.o_proj.weight")
        if attn_bias:
            plan.put(o + "attn.out_proj.bias", h + "self_attn.o_proj.bias")
        for ours, theirs in (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")):
            plan.put(f"{o}ffn.{ours}.weight", f"{h}mlp.{theirs}.weight")
            if mlp_bias:
                plan.put(f"{o}ffn.{ours}.bias", f"{h}mlp.{theirs}.bias")
        plan.put(o + "attn_norm.weight", h + "input_layernorm.weight")
        plan.put(o + "ffn_norm.weight", h + "post_attention_layernorm.weight")
    plan.put("norm.weight", "norm.weight")
    ignore = [r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"(model\.)?rotary_emb\.inv_freq"]
    if tie:
        ignore.append(r"lm_head\.weight")
    else:
        plan.src.prefix = ""
        plan.put("lm_head.weight", "lm_head.weight")
    plan.apply(model, ignore=ignore)
    return model


# ----------------------------------------------------------------------------- ViT
def _vit(cfg: dict[str, Any], sd: dict[str, Tensor], *, device: Any, dtype: Any, classifier: bool) -> nn.Module:
    from attnzoo.models import VisionTransformer

    arch = "ViT"
    if cfg.get("pooler_act", "tanh") != "tanh":
        raise _unsupported(arch, f"pooler_act={cfg['pooler_act']!r}")
    prefix = "vit." if any(k.startswith("vit.") for k in sd) else ""
    src = _Source(sd, prefix)
    C, L = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    has_pooler = src.has("pooler.dense.weight")
    if has_pooler and int(_cfg(cfg, "pooler_output_size", default=C)) != C:
        raise _unsupported(arch, f"pooler_output_size={cfg['pooler_output_size']} != hidden_size")
    num_classes = 0
    if classifier:
        w = sd.get("classifier.weight")
        num_classes = int(w.shape[0]) if w is not None else len(cfg.get("id2label") or {}) or 2
    model = VisionTransformer(
        cfg.get("image_size", 224), cfg.get("patch_size", 16), int(cfg.get("num_channels", 3)), num_classes, C, L,
        int(cfg["num_attention_heads"]), ffn=_activation(cfg, arch, "hidden_act"),
        ffn_hidden=int(cfg["intermediate_size"]), norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), qkv_bias=True,
        pooler=has_pooler, device=device, dtype=dtype or _float_dtype(sd))
    plan = _Plan(src, arch)
    plan.put("cls_token", "embeddings.cls_token")
    plan.put("pos_embed", "embeddings.position_embeddings")
    plan.put("patch_embed.weight", "embeddings.patch_embeddings.projection.weight")
    plan.put("patch_embed.bias", "embeddings.patch_embeddings.projection.bias")
    new_layout = src.has("layers.0.attention.q_proj.weight")
    for i in range(L):
        o = f"blocks.{i}."
        if new_layout:  # transformers >= 5
            h = f"layers.{i}."
            qkv = tuple(f"{h}attention.{n}_proj.weight" for n in "qkv")
            qkv_b = tuple(f"{h}attention.{n}_proj.bias" for n in "qkv")
            out, up, down = h + "attention.o_proj", h + "mlp.fc1", h + "mlp.fc2"
        else:  # transformers 4 checkpoints
            h = f"encoder.layer.{i}."
            qkv = tuple(f"{h}attention.attention.{n}.weight" for n in ("query", "key", "value"))
            qkv_b = tuple(f"{h}attention.attention.{n}.bias" for n in ("query", "key", "value"))
            out, up, down = h + "attention.output.dense", h + "intermediate.dense", h + "output.dense"
        _load_qkv_into(plan, o + "attn", qkv, qkv_b, True)
        plan.put(o + "attn.out_proj.weight", out + ".weight")
        plan.put(o + "attn.out_proj.bias", out + ".bias")
        plan.put(o + "ffn.up_proj.weight", up + ".weight")
        plan.put(o + "ffn.up_proj.bias", up + ".bias")
        plan.put(o + "ffn.down_proj.weight", down + ".weight")
        plan.put(o + "ffn.down_proj.bias", down + ".bias")
        plan.put(o + "attn_norm.weight", h + "layernorm_before.weight")
        plan.put(o + "attn_norm.bias", h + "layernorm_before.bias")
        plan.put(o + "ffn_norm.weight", h + "layernorm_after.weight")
        plan.put(o + "ffn_norm.bias", h + "layernorm_after.bias")
    plan.put("norm.weight", "layernorm.weight")
    plan.put("norm.bias", "layernorm.bias")
    if has_pooler:
        plan.put("pooler.weight", "pooler.dense.weight")
        plan.put("pooler.bias", "pooler.dense.bias")
    if classifier:
        plan.src.prefix = ""
        plan.put("head.weight", "classifier.weight")
        plan.put("head.bias", "classifier.bias")
    plan.apply(model, ignore=[r"(vit\.)?embeddings\.mask_token"])
    return model


# ----------------------------------------------------------------------------- entry points
def _build(arch_name: str, cfg: dict[str, Any], sd: dict[str, Tensor], device: Any, dtype: Any) -> nn.Module:
    if arch_name in ("BertModel", "bert"):
        return _bert(cfg, sd, device=device, dtype=dtype, strict_prefix=arch_name == "BertModel")
    if arch_name in ("GPT2LMHeadModel", "GPT2Model", "gpt2"):
        return _gpt2(cfg, sd, device=device, dtype=dtype)
    if arch_name in ("LlamaForCausalLM", "llama"):
        return _llama(cfg, sd, device=device, dtype=dtype, arch="LLaMA")
    if arch_name in ("MistralForCausalLM", "mistral"):
        return _llama(cfg, sd, device=device, dtype=dtype, arch="Mistral")
    if arch_name in ("ViTModel", "ViTForImageClassification", "vit"):
        classifier = arch_name == "ViTForImageClassification" or (arch_name == "vit" and "classifier.weight" in sd)
        return _vit(cfg, sd, device=device, dtype=dtype, classifier=classifier)
    raise ValueError(f"unknown architecture {arch_name!r}; attnzoo.interop supports {list(SUPPORTED_ARCHITECTURES)}")


def from_hf(hf_model: nn.Module, *, device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> nn.Module:
    """Convert a Hugging Face ``transformers`` model into the equivalent attnzoo model.

    ``BertModel`` -> :class:`~attnzoo.TransformerEncoder` (post-norm, with the pooler if present);
    ``GPT2LMHeadModel``/``GPT2Model``, ``LlamaForCausalLM``, ``MistralForCausalLM`` ->
    :class:`~attnzoo.DecoderLM`; ``ViTModel``/``ViTForImageClassification`` ->
    :class:`~attnzoo.VisionTransformer`. The result has the same weights, dtype and device (unless
    given) and the same train/eval mode. Raises ``ValueError`` for an unknown architecture or an
    unsupported configuration option, :class:`WeightLoadError` listing every missing, unexpected
    or mis-shaped key when the state dict does not match.
    """
    if not isinstance(hf_model, nn.Module):
        raise TypeError(f"from_hf: expected a transformers model (nn.Module), got {type(hf_model).__name__}")
    name = type(hf_model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"from_hf: unknown architecture {name!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"from_hf: {name} has no Hugging Face config")
    cfg = config.to_dict()
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    first = next(iter(hf_model.parameters()))
    model = _build(name, cfg, sd, device if device is not None else first.device,
                   dtype if dtype is not None else first.dtype)
    model.train(hf_model.training)
    return model


def load_pretrained(folder: str | os.PathLike[str], *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """Build an attnzoo model from a Hugging Face folder (``config.json`` + weights) without
    ``transformers``: ``model_type`` ``bert``, ``gpt2``, ``llama``, ``mistral`` or ``vit``.
    The model is returned in eval mode."""
    cfg = _read_config(folder)
    model_type = cfg.get("model_type")
    if model_type not in ("bert", "gpt2", "llama", "mistral", "vit"):
        raise ValueError(f"load_pretrained: unknown model_type {model_type!r} in {folder}/config.json; "
                         f"supported: bert, gpt2, llama, mistral, vit")
    sd = load_state_dict_from_folder(folder)
    return _build(model_type, cfg, sd, device, dtype).eval()


def load_bert(folder: str | os.PathLike[str], *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> nn.Module:
    """A BERT-style encoder (:class:`~attnzoo.TransformerEncoder`, eval mode) from a folder with
    ``config.json`` and ``model.safetensors`` (e.g. sentence-transformers' all-MiniLM-L6-v2).
    ``BertFor*`` checkpoints work too (the ``bert.`` prefix is stripped, task heads ignored)."""
    cfg = _read_config(folder)
    if cfg.get("model_type") != "bert":
        raise ValueError(f"load_bert: {folder}/config.json has model_type {cfg.get('model_type')!r}, expected 'bert'")
    sd = load_state_dict_from_folder(folder)
    return _build("bert", cfg, sd, device, dtype).eval()


# ----------------------------------------------------------------------------- tokenizer
def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class WordPieceTokenizer:
    """BERT's tokenizer: basic tokenisation then greedy longest-match-first WordPiece.

    Basic tokenisation: drop control characters, map whitespace to spaces, surround CJK
    characters with spaces, lower-case and strip accents (when ``lowercase``), split on
    whitespace and punctuation. WordPiece: each word becomes the longest vocabulary prefix, then
    ``##``-prefixed continuations; a word with no split (or longer than ``max_chars_per_word``) is
    ``[UNK]``. Sequences are ``[CLS] ... [SEP]``, truncated to ``max_length``.

    Args:
        vocab: path to ``vocab.txt`` (one token per line, id = line number) or a token list.
        lowercase: lower-case and strip accents (uncased models).
    """

    def __init__(self, vocab: str | os.PathLike[str] | Sequence[str], *, lowercase: bool = True,
                 unk_token: str = "[UNK]", cls_token: str = "[CLS]", sep_token: str = "[SEP]",
                 pad_token: str = "[PAD]", max_chars_per_word: int = 100) -> None:
        if isinstance(vocab, (str, os.PathLike)):
            tokens = Path(vocab).read_text(encoding="utf-8").split("\n")
            if tokens and tokens[-1] == "":
                tokens = tokens[:-1]
        elif isinstance(vocab, Sequence):
            tokens = list(vocab)
        else:
            raise TypeError(f"WordPieceTokenizer: vocab must be a path or a list of tokens, got {type(vocab).__name__}")
        self.vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            self.vocab.setdefault(tok.rstrip("\r"), i)
        for name, tok in (("unk_token", unk_token), ("cls_token", cls_token), ("sep_token", sep_token),
                          ("pad_token", pad_token)):
            if tok not in self.vocab:
                raise ValueError(f"WordPieceTokenizer: {name} {tok!r} is not in the vocabulary")
        self.lowercase = lowercase
        self.unk_id, self.cls_id = self.vocab[unk_token], self.vocab[cls_token]
        self.sep_id, self.pad_id = self.vocab[sep_token], self.vocab[pad_token]
        self.unk_token = unk_token
        self.max_chars_per_word = max_chars_per_word
        self.specials = {unk_token, cls_token, sep_token, pad_token, "[MASK]"}

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> WordPieceTokenizer:
        """From a model folder's ``vocab.txt`` (``do_lower_case`` from ``tokenizer_config.json``)."""
        d = Path(folder)
        lowercase = True
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            lowercase = bool(json.loads(tc.read_text()).get("do_lower_case", True))
        return cls(d / "vocab.txt", lowercase=lowercase)

    def _basic(self, text: str) -> list[str]:
        chars = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD:
                continue
            cat = unicodedata.category(ch)
            if ch in "\t\n\r" or cat == "Zs":
                chars.append(" ")
            elif cat in ("Cc", "Cf"):
                continue
            elif _is_cjk(cp):
                chars.append(f" {ch} ")
            else:
                chars.append(ch)
        words: list[str] = []
        for word in "".join(chars).split():
            if word in self.specials:
                words.append(word)
                continue
            if self.lowercase:
                word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                               if unicodedata.category(c) != "Mn")
            current = ""
            for c in word:
                if _is_punctuation(c):
                    if current:
                        words.append(current)
                        current = ""
                    words.append(c)
                else:
                    current += c
            if current:
                words.append(current)
        return words

    def _wordpiece(self, word: str) -> list[str]:
        if word in self.specials:
            return [word]
        if len(word) > self.max_chars_per_word:
            return [self.unk_token]
        pieces: list[str] = []
        start = 0
        while start < len(word):
            end = len(word)
            piece = None
            while start < end:
                cand = word[start:end] if start == 0 else "##" + word[start:end]
                if cand in self.vocab:
                    piece = cand
                    break
                end -= 1
            if piece is None:
                return [self.unk_token]
            pieces.append(piece)
            start = end
        return pieces

    def tokenize(self, text: str) -> list[str]:
        """``text`` -> WordPiece tokens (without ``[CLS]``/``[SEP]``)."""
        if not isinstance(text, str):
            raise TypeError(f"WordPieceTokenizer: text must be a str, got {type(text).__name__}")
        return [p for w in self._basic(text) for p in self._wordpiece(w)]

    def encode(self, text: str, max_length: int | None = 512) -> list[int]:
        """``[CLS] tokens [SEP]`` ids, truncated so the whole fits ``max_length``."""
        ids = [self.vocab[t] for t in self.tokenize(text)]
        if max_length is not None:
            if max_length < 2:
                raise ValueError(f"WordPieceTokenizer: max_length must be >= 2, got {max_length}")
            ids = ids[: max_length - 2]
        return [self.cls_id, *ids, self.sep_id]

    def __call__(self, texts: str | Sequence[str], max_length: int | None = 512) -> dict[str, Tensor]:
        """Batch-encode with right padding: ``{"input_ids": [B, N] long, "attention_mask": [B, N]
        bool}`` (True for real tokens)."""
        batch = [texts] if isinstance(texts, str) else list(texts)
        if not batch:
            raise ValueError("WordPieceTokenizer: need at least one text")
        seqs = [self.encode(t, max_length) for t in batch]
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = True
        return {"input_ids": ids, "attention_mask": mask}
