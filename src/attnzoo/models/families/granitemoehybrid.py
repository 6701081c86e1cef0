"""Granite 4.0-H (``granitemoehybrid``) -> :class:`~attnzoo.DecoderLM`:
``GraniteMoeHybridForCausalLM`` and ``GraniteMoeHybridModel``.

IBM's Mamba-2 / attention hybrid with a mixture of experts. Each layer is pre-norm::

    h   = x + residual_multiplier * mixer(input_layernorm(x))
    out = h + residual_multiplier * (block_sparse_moe(n) + shared_mlp(n)),  n = post_attention_layernorm(h)

* The mixer (``layer_types`` / ``layers_block_type``: ``"mamba"`` / ``"linear_attention"`` or
  ``"attention"`` / ``"full_attention"``) is Bamba's Mamba-2 SSD mixer
  (:mod:`attnzoo.models.families._mamba`, the same ``mamba_*`` keys, the gated norm's epsilon
  ``rms_norm_eps``), or causal GQA attention whose scores are scaled by ``attention_multiplier``
  (not ``head_dim ** -0.5``), with rotary positions on the whole head when
  ``position_embedding_type == "rope"`` and none otherwise (NoPE: the default and the released
  checkpoints).
* The feed-forward is a :class:`~attnzoo.nn.moe.MixtureOfExperts` (router ``router.weight``,
  top-k of the logits then a softmax over the ``k``; SwiGLU experts ``gate_up_proj [E, 2F, C]``,
  rows ``[gate; up]``, and ``down_proj [E, C, F]``) whose shared expert is the always-on
  ``shared_mlp`` (a SwiGLU of ``shared_intermediate_size``: ``input_linear [2S, C]``, rows
  ``[gate; up]``, then ``output_linear``); with ``num_local_experts == 0`` the shared MLP alone,
  a dense :class:`~attnzoo.FeedForward`. Saved folders name the experts
  ``block_sparse_moe.input_linear`` / ``output_linear`` / ``router.layer`` (transformers renames
  them on load and back on save): both load.
* The token embeddings are multiplied by ``embedding_multiplier`` (a
  :class:`~attnzoo.models.parts.ScaledEmbedding`); the final norm is ``model.norm``; the logits
  are divided by ``logits_scaling``.

Two of the multipliers are folded into weights at load (exact: each multiplies the output of a
linear map):

* ``residual_multiplier`` into every weight that writes into the residual stream: the mixers'
  ``out_proj`` (Mamba-2's, and attention's ``o_proj`` with its bias), the experts' ``down_proj``
  and the shared MLP's ``down_proj`` (``output_linear``).
* ``1 / logits_scaling`` into the final norm's weight of a ``*ForCausalLM`` (the head is linear
  and the RMSNorm's weight multiplies its input, so this holds with tied embeddings too); a base
  ``*Model`` returns the final norm's output unscaled, as transformers does.

So the converted model is the plain pre-norm :class:`~attnzoo.TransformerBlock` stack;
:func:`build_granitemoehybrid` (random weights) builds the same structure, with the two
multipliers absorbed in whatever weights it is given (its own random ones are not scaled).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._mamba import BAMBA_KEYS, mamba_factory, put_mamba
from attnzoo.models.families.bamba import hybrid_kinds
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.mamba2 import Mamba2
from attnzoo.nn.moe import MixtureOfExperts, Routing

__all__ = ["CHECKS", "DEFAULTS", "DISPATCH", "build_granitemoehybrid", "convert_granitemoehybrid", "embed_scale",
           "experts_factory", "finish_folded", "multiplier", "put_experts", "put_feed_forward", "put_shared_mlp",
           "refuse_partial_rotary"]

#: transformers' ``GraniteMoeHybridConfig`` defaults of the keys read here that a ``config.json``
#: may leave out (where the shared helpers would assume another value or require the key)
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "mamba_n_heads": 128, "mamba_d_state": 256,
                            "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024}

#: ``position_embedding_type`` values: ``"rope"``, or no positions (transformers applies RoPE only
#: for ``"rope"``; ``None`` / ``"nope"`` are the documented others)
POSITIONS = (None, "nope", "rope")


def _with_defaults(hf: HFConfig) -> HFConfig:
    """``hf`` with :data:`DEFAULTS` filled in where the config leaves a key out (or ``None``)."""
    return hf.with_defaults(DEFAULTS)


def multiplier(hf: HFConfig, key: str) -> float:
    """One of Granite's multipliers (``embedding_multiplier``, ``residual_multiplier``,
    ``attention_multiplier``, ``logits_scaling``): 1.0 when absent."""
    return cast(float, hf.get(key, 1.0, float))


def _positive(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)


#: The checks (``key -> ok(value)``, for :func:`~attnzoo.models.families._common.unsupported_keys`)
#: of the Granite options shared by the Granite families: SwiGLU feed-forwards, a positive score
#: scale and embedding multiplier, a non-zero logit divisor.
CHECKS: dict[str, Callable[[Any], bool]] = {
    "hidden_act": lambda v: v in (None, "silu", "swish"),  # the Mamba-2 convolutions and the SwiGLUs
    "attention_multiplier": _positive,  # the score scale
    "embedding_multiplier": _positive,
    "logits_scaling": lambda v: v is None or (isinstance(v, (int, float)) and v != 0),
}


def refuse_partial_rotary(hf: HFConfig) -> None:
    """Refuse a ``partial_rotary_factor`` other than 1 by name (transformers' Granite attention
    rotates the whole head: its cos/sin of a partial factor would not fit)."""
    factor = parts.rope_params(hf).get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise hf.unsupported(f"partial_rotary_factor={factor!r} (the whole head is rotated)")


def embed_scale(hf: HFConfig) -> float | None:
    """The token embedding's scale (``embedding_multiplier``; ``None``: a plain embedding)."""
    embed = multiplier(hf, "embedding_multiplier")
    return None if embed == 1.0 else embed


def _refuse(hf: HFConfig) -> None:
    """The options attnzoo cannot reproduce, by name."""
    parts.unsupported_keys(hf, {"position_embedding_type": lambda v: v in POSITIONS, **CHECKS})
    if hf.raw("position_embedding_type") == "rope":
        refuse_partial_rotary(hf)


def _feed_forward(hf: HFConfig, *, device: Any, dtype: Any) -> Callable[[], nn.Module]:
    """A factory of one layer's feed-forward: the experts with the shared MLP as their shared
    expert, or the shared MLP alone when ``num_local_experts <= 0`` (transformers: ``> 0``)."""
    C, kw = hf.req("hidden_size"), {"device": device, "dtype": dtype}
    shared = parts.gated_mlp(C, hf.req("shared_intermediate_size"), "swiglu", **kw)
    if hf.req("num_local_experts") <= 0:
        return shared
    return experts_factory(hf, shared, **kw)


def experts_factory(hf: HFConfig, shared: Callable[[], nn.Module] | None, *, device: Any,
                    dtype: Any) -> Callable[[], nn.Module]:
    """A factory of Granite's :class:`MixtureOfExperts` (``num_local_experts`` SwiGLU experts of
    ``intermediate_size``, the top ``num_experts_per_tok`` logits then a softmax over them), with
    the module ``shared()`` as its always-on shared expert (``shared=None``: none)."""
    C, E, k, F_ = (hf.req(n) for n in ("hidden_size", "num_local_experts", "num_experts_per_tok",
                                       "intermediate_size"))

    def moe() -> nn.Module:
        return MixtureOfExperts(C, F_, E, k, routing=Routing("topk_softmax"),
                                shared_expert=None if shared is None else shared(), device=device, dtype=dtype)

    return moe


def build_granitemoehybrid(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                           dtype: Any = None) -> DecoderLM:
    """The decoder of a ``GraniteMoeHybridConfig`` (random weights; see the module docstring)."""
    hf = _with_defaults(hf)
    _refuse(hf)
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    rope = (parts.rotary(hf, parts.rope_params(hf), hf.get("head_dim", C // H))
            if hf.raw("position_embedding_type") == "rope" else None)
    mixers = {"attention": parts.attention_factory(hf, window=None, rope=rope,
                                                   scale=multiplier(hf, "attention_multiplier"), **kw),
              "mamba": mamba_factory(hf, BAMBA_KEYS, **kw)}
    ffn, norm = _feed_forward(hf, **kw), parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixers[k], ffn, norm) for k in hybrid_kinds(hf, depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=embed_scale(hf), **kw)


def _present(plan: Plan, names: Iterable[str]) -> str:
    """The first of ``names`` the checkpoint holds (the first one when none: named as missing)."""
    names = list(names)
    return next((n for n in names if plan.src.has(n)), names[0])


def put_shared_mlp(plan: Plan, ours: str, theirs: str) -> None:
    """A :class:`~attnzoo.FeedForward` at ``ours`` from the shared MLP at ``theirs``
    (``input_linear`` rows ``[gate; up]``, ``output_linear``)."""
    key = f"{theirs}input_linear.weight"
    plan.put(f"{ours}gate_proj.weight", key, lambda w: w[: w.shape[0] // 2])
    plan.put(f"{ours}up_proj.weight", key, lambda w: w[w.shape[0] // 2:])
    plan.put(f"{ours}down_proj.weight", f"{theirs}output_linear.weight")


def put_experts(plan: Plan, ours: str, theirs: str) -> None:
    """The router and experts of the :class:`MixtureOfExperts` at ``ours`` from
    ``{theirs}block_sparse_moe.`` (in memory: ``router.weight``, ``experts.gate_up_proj``,
    ``experts.down_proj``; in a saved folder: ``router.layer.weight``, ``input_linear.weight``,
    ``output_linear.weight``)."""
    moe = f"{theirs}block_sparse_moe."
    plan.put(f"{ours}router.weight", _present(plan, (f"{moe}router.weight", f"{moe}router.layer.weight")))
    key = _present(plan, (f"{moe}experts.gate_up_proj", f"{moe}input_linear.weight"))
    plan.put(f"{ours}gate_proj", key, lambda w: w[:, : w.shape[1] // 2])
    plan.put(f"{ours}up_proj", key, lambda w: w[:, w.shape[1] // 2:])
    plan.put(f"{ours}down_proj", _present(plan, (f"{moe}experts.down_proj", f"{moe}output_linear.weight")))


def _fold(plan: Plan, model: nn.Module, names: Iterable[str], factor: float, why: str) -> None:
    """Multiply the planned tensors ``names`` by ``factor`` (in the dtype of the parameter each
    fills: one rounding, as the copy would do)."""
    if factor == 1.0:
        return
    for name in names:
        if name in plan.values:
            t, key = plan.values[name]
            plan.values[name] = (t.to(model.get_parameter(name).dtype) * factor, f"{key} x {why}")


def put_feed_forward(plan: Plan, ours: str, theirs: str, ffn: nn.Module) -> list[str]:
    """Plan one layer's feed-forward ``ffn`` at ``ours`` (``"blocks.3.ffn."``) from the layer
    ``theirs`` (``"layers.3."``): the experts (:func:`put_experts`) and their shared expert when
    it has one, or a dense shared MLP alone. Returns the names of the planned weights that write
    into the residual stream (for :func:`finish_folded`)."""
    if not isinstance(ffn, MixtureOfExperts):
        put_shared_mlp(plan, ours, f"{theirs}shared_mlp.")
        return [f"{ours}down_proj.weight"]
    put_experts(plan, ours, theirs)
    if ffn.shared_expert is None:
        return [f"{ours}down_proj"]
    put_shared_mlp(plan, f"{ours}shared_expert.", f"{theirs}shared_mlp.")
    return [f"{ours}down_proj", f"{ours}shared_expert.down_proj.weight"]


def finish_folded(plan: Plan, model: DecoderLM, hf: HFConfig, head_size: int | None,
                  writes: Iterable[str]) -> DecoderLM:
    """:func:`~attnzoo.models.families._common.finish` with Granite's ``residual_multiplier``
    folded into the planned weights ``writes`` (those writing into the residual stream) and
    ``1 / logits_scaling`` into the final norm of an LM head (a base model: unscaled)."""
    _fold(plan, model, writes, multiplier(hf, "residual_multiplier"), "residual_multiplier")
    logits_scaling = multiplier(hf, "logits_scaling")
    norm_transform = None
    if head_size is None and logits_scaling != 1.0:  # the LM head's logits only (a base model: none)
        norm_transform = functools.partial(_divided, by=logits_scaling)
    return parts.finish(plan, model, head_size, norm_transform=norm_transform)


def convert_granitemoehybrid(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them), folding
    ``residual_multiplier`` and ``logits_scaling`` in (see the module docstring)."""
    hf = _with_defaults(hf)
    model, plan, head_size = parts.start(hf, sd, build_granitemoehybrid, device=device, dtype=dtype)
    bias = hf.get("attention_bias", False, bool)
    writes: list[str] = []  # the weights that write into the residual stream
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if isinstance(block.attn, Mamba2):
            put_mamba(plan, f"{o}attn.", f"{h}mamba.", cast(Mamba2, block.attn))
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias)
            writes += [f"{o}attn.out_proj.bias"] if bias else []
        writes.append(f"{o}attn.out_proj.weight")
        writes += put_feed_forward(plan, f"{o}ffn.", h, block.ffn)
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    return finish_folded(plan, model, hf, head_size, writes)


def _divided(t: Tensor, *, by: float) -> Tensor:
    """``t / by`` computed in at least float32 (the final norm's weight: ``[C]``)."""
    return t.to(torch.promote_types(t.dtype, torch.float32)) / by


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "granitemoehybrid": parts.Dispatch("Granite 4.0-H", convert_granitemoehybrid, ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridModel")),
}
