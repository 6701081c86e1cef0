"""What the per-layer family builders share: the layer types of a Hugging Face config, one
rotary embedding per layer kind, a :class:`~attnzoo.TransformerBlock` from parts, the decoder
around a list of blocks, and the weight-map pieces (attention, gated MLP, norms, head).

A family file builds its blocks (``layer -> TransformerBlock``), each with its own attention
module carrying its own rotary embedding (or none: a NoPE layer), and hands them to
:func:`decoder`; then it plans its weights with the helpers here and :meth:`Plan.apply`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.blocks import BlockLayers, FeedForward, RMSNorm, TransformerBlock, make_norm
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype, load_qkv_into
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.mtp import MultiTokenPredictor
from attnzoo.models.parts import DecoderParts, ScaledEmbedding, head_for
from attnzoo.nn.positional import RotaryEmbedding, ScaledRotaryEmbedding
from attnzoo.nn.rope_scaling import ROPE_SCALINGS, rope_inv_freq
from attnzoo.variants import build_attention

__all__ = ["GATED", "PRE_NORMS", "Dispatch", "Float32ScaleRMSNorm", "attention_factory", "block", "convert_layers",
           "decoder", "dims", "finish", "float32_scale_norms", "fuse_qkv_convs", "gated_mlp", "head_size_of", "layer_types",
           "plan_for", "plus_one", "put_attention", "put_head", "put_mlp", "rms_norm", "rope_params", "rotary",
           "sliding_windows", "start", "unsupported_keys"]

#: transformers' activation names -> attnzoo's gated FeedForward activations
GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
         "gelu_new": "geglu_tanh"}

#: A pre-norm layer's RMSNorms: ``input_layernorm`` before the attention, ``post_attention_layernorm``
#: before the MLP.
PRE_NORMS = (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"))
#: Gemma 2's four norms of a layer, before and after each sub-layer (ours, theirs)
GEMMA_NORMS = (("attn_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
               ("ffn_norm", "pre_feedforward_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm"))


def plus_one(t: Tensor) -> Tensor:
    """Gemma's RMSNorm multiplies by ``1 + weight``: loaded as ``weight + 1``, in float32 (or
    float64) whatever the checkpoint's dtype. A bfloat16 checkpoint loaded into a float32 model
    keeps ``1 + w`` exact, as transformers computes it at run time (rounded to bfloat16 first,
    a weight near 0 lost its low bits: 0.34 relative logits error on a random Qwen3-Next); the
    copy into a bfloat16 model rounds it once, unless the norm keeps its weight in float32
    (:class:`Float32ScaleRMSNorm`'s ``keep_float32``)."""
    return t.to(torch.promote_types(t.dtype, torch.float32)) + 1.0


class Float32ScaleRMSNorm(RMSNorm):
    """:class:`~attnzoo.blocks.RMSNorm` that, for a half-precision input, multiplies by its weight in
    float32 and rounds once: ``(weight * x32 / rms(x32)).to(x.dtype)``.

    transformers' Gemma / Qwen3-Next ``1 + weight`` norms compute ``(norm(x.float()) * (1.0 +
    weight.float())).type_as(x)`` (``modeling_qwen3_next.py`` 135-140), OLMo-3 / OLMo-hybrid /
    gpt-oss / Nemotron-H / Lara-mini ``(weight * hidden_states).to(input_dtype)``: one rounding.
    :class:`RMSNorm` follows LLaMA (``weight * hidden_states.to(input_dtype)``, two roundings),
    which in bfloat16 took a random Qwen3.5's logits to 0.81 relative error (transformers': 0.08).

    Args:
        dim, eps: as :class:`RMSNorm`.
        keep_float32: the weight stays float32 under half-precision casts (``.to``, ``.half()``):
            a ``1 + w`` weight (see :func:`plus_one`) rounded to 16 bits is off by up to 2^-9 in
            every channel alike, an error the hidden states then carry coherently (transformers
            keeps ``w`` and adds 1 in float32; gpt-oss' checkpoints keep these norms in float32).

    Float32 and float64 inputs: as :class:`RMSNorm`. Shapes: ``[..., C] -> [..., C]``."""

    def __init__(self, dim: int, eps: float = 1e-6, *, keep_float32: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, eps, device=device, dtype=torch.float32 if keep_float32 else dtype)
        self.keep_float32 = bool(keep_float32)

    def forward(self, x: Tensor) -> Tensor:
        if (not isinstance(x, Tensor) or not x.is_floating_point() or x.dtype in (torch.float32, torch.float64)
                or x.dim() == 0 or x.shape[-1] != self.dim):
            return super().forward(x)  # full precision, or the argument errors
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> Float32ScaleRMSNorm:
        before = self.weight.data
        super()._apply(fn, recurse)
        w = self.weight
        if (self.keep_float32 and w.dtype in (torch.float16, torch.bfloat16) and before.device.type != "meta"
                and before.dtype in (torch.float32, torch.float64)):
            w.data = before.to(device=w.device, dtype=torch.float32)
            if w.grad is not None:
                w.grad = w.grad.float()
        return self

    def extra_repr(self) -> str:
        return super().extra_repr() + (", keep_float32=True" if self.keep_float32 else "")


def float32_scale_norms(model: nn.Module, *, keep_float32: bool = False) -> nn.Module:
    """``model`` with every :class:`~attnzoo.blocks.RMSNorm` (that class exactly: the blocks' and the
    final norm) replaced in place by a :class:`Float32ScaleRMSNorm` (``keep_float32``: its weight
    in float32), same names, same state dict: for the families whose transformers norms apply the
    weight in float32. Call it before loading the weights."""
    for name, module in list(model.named_modules()):
        if type(module) is RMSNorm:
            parent, _, attr = name.rpartition(".")
            wide = Float32ScaleRMSNorm(module.dim, module.eps, keep_float32=keep_float32, device="meta")
            weight = module.weight
            wide.weight = nn.Parameter(weight.detach().float(), weight.requires_grad) if keep_float32 else weight
            setattr(model.get_submodule(parent) if parent else model, attr, wide)
    return model


@dataclass(frozen=True)
class Dispatch:
    """How :func:`attnzoo.interop.from_hf` reaches a family: its name (messages,
    ``MODEL_TYPES``), its converter ``(hf, sd, *, device, dtype) -> model`` and the transformers
    classes it converts. A family module lists its own as ``DISPATCH`` (``model_type`` -> Dispatch)."""

    name: str
    convert: Callable[..., nn.Module]
    classes: tuple[str, ...]


def dims(hf: HFConfig) -> tuple[int, int, int, int]:
    """``(C, H, depth, head_dim)`` of a decoder config (``head_dim`` defaults to ``C // H``);
    ``pretraining_tp`` other than 1 refused."""
    unsupported_keys(hf, {"pretraining_tp": lambda v: v in (None, 1)})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    return C, H, depth, hf.get("head_dim", C // H)


def unsupported_keys(hf: HFConfig, checks: Mapping[str, Callable[[Any], bool]]) -> None:
    """Refuse, by name, every option whose value fails its check (``key -> ok(value)``)."""
    for key, ok in checks.items():
        value = hf.raw(key)
        if not ok(value):
            raise hf.unsupported(f"{key}={value!r}")


def layer_types(hf: HFConfig, depth: int, allowed: Sequence[str], *, key: str = "layer_types",
                default: Sequence[str] | None = None) -> list[str]:
    """The per-layer kinds under ``key`` (one per layer, each in ``allowed``); when absent
    ``default``, or ``full_attention`` everywhere."""
    types = hf.get(key, None, list)
    if types is None:
        return list(default) if default is not None else ["full_attention"] * depth
    if len(types) != depth:
        raise CheckpointFormatError(f"{hf.source}: {key} has {len(types)} entries for {depth} layers")
    what = key[:-1].replace("_", " ")  # "layer type", "mlp layer type"
    for t in types:
        if t not in allowed:
            raise hf.unsupported(f"{what} {t!r} (supported: {', '.join(map(repr, allowed))})")
    return list(types)


def rope_params(hf: HFConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The rope dict of a layer kind: ``rope_parameters[layer_type]`` when the config keys it by
    layer type (Gemma3, OLMo3), else ``rope_parameters`` (with the legacy ``rope_scaling`` /
    ``rope_theta`` keys folded in)."""
    params = dict(hf.get("rope_scaling", {}, dict))
    params.update(hf.get("rope_parameters", {}, dict))
    if layer_type is not None and isinstance(params.get(layer_type), Mapping):
        params = dict(params[layer_type])
    elif any(isinstance(v, Mapping) for v in params.values()):
        params = dict(next(v for v in params.values() if isinstance(v, Mapping)))
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0, float))
    return params


def rotary(hf: HFConfig, params: Mapping[str, Any], head_dim: int, *, rotary_dim: int | None = None) -> nn.Module:
    """The rotary embedding of ``params`` (a Hugging Face rope dict): a :class:`RotaryEmbedding`
    for ``default``, a :class:`ScaledRotaryEmbedding` for the scaled types (checked by computing
    the frequencies once)."""
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    base = float(params["rope_theta"])
    if rope_type == "default":
        return RotaryEmbedding(head_dim, base=base, rotary_dim=rotary_dim)
    if rope_type not in ROPE_SCALINGS:
        raise hf.unsupported(f"rope_type={rope_type!r} (supported: {', '.join(map(repr, ROPE_SCALINGS))})")
    p = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    if p.get("original_max_position_embeddings") is None and hf.has("original_max_position_embeddings"):
        p["original_max_position_embeddings"] = hf.req("original_max_position_embeddings")
    max_pos = max_positions(hf)
    try:
        rope_inv_freq(p, rotary_dim or head_dim, max_position_embeddings=max_pos)
    except ValueError as exc:
        raise CheckpointFormatError(f"{hf.source}: rope parameters: {exc}") from exc
    return ScaledRotaryEmbedding(head_dim, p, max_position_embeddings=max_pos, rotary_dim=rotary_dim)


def block(dim: int, attention: Callable[[], nn.Module], feed_forward: Callable[[], nn.Module] | None,
          norm: Callable[[], nn.Module], *, sublayer_norm: str = "input") -> TransformerBlock:
    """A pre-norm :class:`TransformerBlock` from its parts' factories (``feed_forward=None``: a
    mixer-only layer)."""
    return TransformerBlock(dim, layers=BlockLayers(attention=attention, feed_forward=feed_forward, norm=norm,
                                                    sublayer_norm=sublayer_norm))


def gated_mlp(dim: int, hidden: int, activation: str, *, bias: bool = False, device: Any = None,
              dtype: Any = None) -> Callable[[], nn.Module]:
    """A factory of the dense gated MLP (``gate_proj``, ``up_proj``, ``down_proj``)."""
    return functools.partial(FeedForward, dim, hidden, activation, bias=bias, device=device, dtype=dtype)


def rms_norm(dim: int, eps: float, *, device: Any = None, dtype: Any = None) -> Callable[[], nn.Module]:
    return functools.partial(make_norm, "rms", dim, eps, device=device, dtype=dtype)


def head_size_of(hf: HFConfig, sd: Mapping[str, Tensor]) -> tuple[str, int | None]:
    """``(prefix, head_size)`` of a checkpoint: ``"model."`` for the head classes; ``head_size``
    ``None`` (the LM head), ``0`` (a base ``*Model``: no head) or the rows of ``score.weight``."""
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    if "score.weight" in sd:
        return prefix, int(sd["score.weight"].shape[0])
    if not prefix and "lm_head.weight" not in sd and not any(
            str(a).endswith("ForCausalLM") for a in hf.get("architectures", [], list)):
        return prefix, 0
    return prefix, None


def mtp_depths(hf: HFConfig, sd: Mapping[str, Tensor], key: Callable[[int], str | None]) -> int:
    """The multi-token-prediction layers to load: those the checkpoint holds (``key(k)``, a tensor
    of layer ``k``, present for ``k = 0, 1, ...``; ``None``: no such layer), at most the config's
    ``num_nextn_predict_layers`` / ``num_mtp_layers`` / ``mtp_num_hidden_layers`` (transformers' ``use_mtp`` reads that many;
    the rest are dropped)."""
    k = 0
    while key(k) in sd:
        k += 1
    limit = hf.first(("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers"), None)
    return k if limit is None else min(k, int(limit))


def put_mtp(plan: Plan, ours: str, theirs: str) -> None:
    """The parts of a multi-token-prediction layer around its block, DeepSeek-V3's names
    (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` -> ``post_norm``; the block: the
    family's own layer names under ``{ours}block.``)."""
    plan.put_pairs(ours, theirs, [("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                                  ("post_norm", "shared_head.norm")], bias=False)


#: a checkpoint key of layer ``i`` (group 1): ``[model.]layers.{i}.``
LAYER_KEY = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def layers_past(sd: Mapping[str, Tensor], depth: int) -> list[str]:
    """The patterns of a checkpoint's layers ``layers.{j >= depth}`` (multi-token-prediction layers
    transformers does not load: ``_keys_to_ignore_on_load_unexpected``), one per such layer held."""
    extra = {int(m.group(1)) for k in sd if (m := LAYER_KEY.match(k)) and int(m.group(1)) >= depth}
    return [rf"(model\.)?layers\.{j}\..*" for j in sorted(extra)]


def mtp_copies(depth: int, mtp: int) -> list[str]:
    """The patterns of the MTP layers' copies of the embedding and the head (``embed_tokens``,
    ``shared_head.head``): unused, as transformers' ``MtpModel`` reads the model's."""
    return [rf"(model\.)?layers\.{depth + k}\.(shared_head\.head|embed_tokens)\.weight" for k in range(mtp)]


def max_positions(hf: HFConfig) -> int:
    """The model's positions: ``max_position_embeddings``, or ``model_max_length`` where a config
    stores it under that name (Kimi Linear's ``to_dict()`` and ``config.json``), else 2048."""
    return int(hf.first(("max_position_embeddings", "model_max_length"), 2048))


def decoder(hf: HFConfig, blocks: Sequence[nn.Module], *, head_size: int | None, norm_eps: float,
            embed_scale: float | None = None, logit_softcap: float | None = None, heads: int | None = None,
            embedding: nn.Module | None = None, mtp: MultiTokenPredictor | None = None, device: Any = None,
            dtype: Any = None) -> DecoderLM:
    """The :class:`DecoderLM` around ``blocks`` (one per layer, each attention with its own
    rotary embedding and positions): the token embedding (times ``embed_scale``; or the module
    ``embedding``, e.g. MiniMax's normalised one), the final RMSNorm, the head of ``head_size``
    (see :func:`~attnzoo.models.parts.head_for`), the multi-token-prediction layers ``mtp``.
    ``heads``: the config's head count where it has no ``num_attention_heads`` (an attention-free
    stack)."""
    V, C = hf.req("vocab_size"), hf.req("hidden_size")
    cfg = DecoderConfig(V, C, len(blocks), heads or hf.req("num_attention_heads"), pos="rope", norm="rms", norm_eps=norm_eps,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool),
                        max_seq_len=max_positions(hf))
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    if embedding is not None and embed_scale is not None:
        raise ValueError("decoder: give embed_scale or embedding, not both")
    if embed_scale is not None:
        embedding = ScaledEmbedding(V, C, scale=embed_scale, **kw)
    parts = DecoderParts(blocks=blocks, embedding=embedding,
                         head=head_for(C, V, head_size, softcap=logit_softcap, **kw), mtp=mtp)
    return DecoderLM(config=cfg, parts=parts, **kw)


def put_attention(plan: Plan, ours: str, theirs: str, *, bias: bool, qk_norm: bool = False,
                  norm_transform: Callable[[Tensor], Tensor] | None = None, sinks: bool = False) -> None:
    """q/k/v/o projections (``qkv_proj`` rows ``[q; k; v]``, ``out_proj``), the QK-norm weights
    and the sink logits of a :class:`~attnzoo.MultiHeadAttention` at ``ours`` from
    ``{theirs}{q,k,v,o}_proj``, ``q_norm``/``k_norm``, ``sinks``."""
    load_qkv_into(plan, ours, tuple(f"{theirs}{n}_proj.weight" for n in "qkv"),
                  tuple(f"{theirs}{n}_proj.bias" for n in "qkv") if bias else None, bias)
    plan.put_pairs(f"{ours}.", theirs, [("out_proj", "o_proj")], bias=bias)
    if qk_norm:
        for n in ("q_norm", "k_norm"):
            plan.put(f"{ours}.frontier.{n}_weight", f"{theirs}{n}.weight", norm_transform)
    if sinks:
        plan.put(f"{ours}.frontier.sinks", f"{theirs}sinks")


def put_mlp(plan: Plan, ours: str, theirs: str, *, bias: bool = False) -> None:
    """A gated MLP (``gate_proj``, ``up_proj``, ``down_proj``) at ``ours`` from ``theirs``."""
    plan.put_pairs(ours, theirs, [(n, n) for n in ("gate_proj", "up_proj", "down_proj")], bias=bias)


def put_head(plan: Plan, head_size: int | None, tied: bool, ignore: list[str]) -> None:
    """The final norm is planned by the family; this plans ``lm_head`` / ``score`` (or nothing)."""
    plan.src.prefix = ""
    if head_size is None:
        plan.head(tied, ignore)
    elif head_size > 0:
        plan.put("lm_head.weight", "score.weight")
    if head_size is not None:
        ignore.append(r"lm_head\.weight")


def fuse_qkv_convs(sd: dict[str, Tensor], owner: str) -> dict[str, Tensor]:
    """Saved folders keep a linear layer's short convolutions apart (``{owner}.q_conv1d.weight``,
    ``k_conv1d``, ``v_conv1d``); transformers' module fuses them by rows into ``{owner}.conv1d.weight``.
    Returns ``sd`` with every such triple fused (in place)."""
    for key in [k for k in sd if k.endswith(f"{owner}.q_conv1d.weight")]:
        head = key[: -len("q_conv1d.weight")]
        sd[f"{head}conv1d.weight"] = torch.cat([sd.pop(f"{head}{n}_conv1d.weight") for n in "qkv"])
    return sd


def plan_for(sd: dict[str, Tensor], prefix: str, arch: str) -> Plan:
    """A :class:`Plan` reading ``sd`` under ``prefix``."""
    return Plan(Source(sd, prefix), arch)


def attention_factory(hf: HFConfig, *, window: int | None, rope: nn.Module | None, qk_norm: str | None = None,
                      sinks: bool = False, scale: float | None = None, output_gate: str | None = None,
                      device: Any = None, dtype: Any = None) -> Callable[[], nn.Module]:
    """A factory of the causal :class:`~attnzoo.MultiHeadAttention` of one layer: GQA heads,
    ``head_dim``, ``attention_bias``, a left ``window`` (``sliding_window - 1``) or ``None``,
    its own ``rope`` (``None``: a NoPE layer), QK RMSNorm (``"head"``/``"all"``, eps
    ``rms_norm_eps``), learnable sinks, an output gate (``"head"``/``"element"``)."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    kw: dict[str, Any] = {
        "num_kv_heads": hf.get("num_key_value_heads", H), "head_dim": hf.get("head_dim", C // H),
        "bias": hf.get("attention_bias", False, bool), "causal": True, "window": window, "rope": rope,
        "dropout": hf.get("attention_dropout", 0.0, float), "device": device, "dtype": dtype}
    if qk_norm is not None:
        kw.update(qk_norm=qk_norm, qk_norm_eps=hf.get("rms_norm_eps", 1e-6, float))
    if sinks:
        kw["sinks"] = True
    if output_gate is not None:
        kw["output_gate"] = output_gate
    if scale is not None:
        kw["scale"] = scale
    return functools.partial(build_attention, "mha", C, H, **kw)


def sliding_windows(hf: HFConfig, kinds: Sequence[str]) -> list[int | None]:
    """The left window (``sliding_window - 1``) of each ``sliding_attention`` layer, ``None`` else."""
    window = hf.get("sliding_window", None)
    if "sliding_attention" in kinds and window is None:
        raise hf.unsupported("sliding_attention layers without a sliding_window")
    return [window - 1 if k == "sliding_attention" else None for k in kinds]


def start(hf: HFConfig, sd: dict[str, Tensor], build: Callable[..., DecoderLM], *, device: Any,
          dtype: Any) -> tuple[DecoderLM, Plan, int | None]:
    """``(model, plan, head_size)`` of a conversion: the head from the weights, the decoder built
    by ``build(hf, head_size=, device=, dtype=)`` (dtype: the checkpoint's unless given), a plan
    reading under the checkpoint's prefix with the token embedding planned."""
    prefix, head_size = head_size_of(hf, sd)
    model = build(hf, head_size=head_size, device=device, dtype=dtype or float_dtype(sd))
    plan = plan_for(sd, prefix, hf.arch)
    plan.put("tok_emb.weight", "embed_tokens.weight")
    return model, plan, head_size


def finish(plan: Plan, model: DecoderLM, head_size: int | None, *,
           norm_transform: Callable[[Tensor], Tensor] | None = None, ignore: Sequence[str] = (),
           final_norm: str = "norm") -> DecoderLM:
    """Plan the final norm (the checkpoint's ``{final_norm}.weight``) and the head, then copy every
    planned tensor (the rotary buffers of the checkpoint and the patterns ``ignore`` are not
    expected to match anything)."""
    plan.put("norm.weight", f"{final_norm}.weight", norm_transform)
    patterns = [r"(model\.)?rotary_emb\w*\.\w+", *ignore]
    put_head(plan, head_size, model.tie_embeddings, patterns)
    plan.apply(model, ignore=patterns)
    return model


def convert_layers(hf: HFConfig, sd: dict[str, Tensor], build: Callable[..., DecoderLM], *, device: Any,
                   dtype: Any, ffn: Callable[[Plan, str, str], None] = put_mlp,
                   norms: Sequence[tuple[str, str]] = PRE_NORMS, qk_norm: bool = False,
                   sinks: bool = False) -> DecoderLM:
    """A conversion (:func:`start`, then :func:`finish`) of a decoder whose every layer ``i`` is
    ``layers.{i}.self_attn`` (:func:`put_attention` with the checkpoint's ``attention_bias``,
    ``qk_norm`` and ``sinks``), ``layers.{i}.mlp`` (planned by ``ffn(plan, ours, theirs)``) and the
    norms ``norms`` (``(ours, theirs)`` pairs, weights only)."""
    model, plan, head_size = start(hf, sd, build, device=device, dtype=dtype)
    bias = hf.get("attention_bias", False, bool)
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias, qk_norm=qk_norm, sinks=sinks)
        ffn(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, norms, bias=False)
    return finish(plan, model, head_size)
