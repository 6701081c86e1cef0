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

__all__ = ["DEFAULTS", "build_granitemoehybrid", "convert_granitemoehybrid"]

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


def _multiplier(hf: HFConfig, key: str) -> float:
    return cast(float, hf.get(key, 1.0, float))


def _positive(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)


def _refuse(hf: HFConfig) -> None:
    """The options attnzoo cannot reproduce, by name."""
    parts.unsupported_keys(hf, {
        "position_embedding_type": lambda v: v in POSITIONS,
        "hidden_act": lambda v: v in (None, "silu", "swish"),  # the Mamba-2 convolutions and the SwiGLUs
        "attention_multiplier": _positive,  # the score scale
        "embedding_multiplier": _positive,
        "logits_scaling": lambda v: v is None or (isinstance(v, (int, float)) and v != 0),
    })
    if hf.raw("position_embedding_type") == "rope":
        factor = parts.rope_params(hf).get("partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):  # transformers rotates the whole head (its cos/sin would not fit)
            raise hf.unsupported(f"partial_rotary_factor={factor!r} (the whole head is rotated)")


def _feed_forward(hf: HFConfig, *, device: Any, dtype: Any) -> Callable[[], nn.Module]:
    """A factory of one layer's feed-forward: the experts with the shared MLP as their shared
    expert, or the shared MLP alone when ``num_local_experts <= 0`` (transformers: ``> 0``)."""
    C, kw = hf.req("hidden_size"), {"device": device, "dtype": dtype}
    shared = parts.gated_mlp(C, hf.req("shared_intermediate_size"), "swiglu", **kw)
    E = hf.req("num_local_experts")
    if E <= 0:
        return shared

    def moe() -> nn.Module:
        return MixtureOfExperts(C, hf.req("intermediate_size"), E, hf.req("num_experts_per_tok"),
                                routing=Routing("topk_softmax"), shared_expert=shared(), **kw)

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
                                                   scale=_multiplier(hf, "attention_multiplier"), **kw),
              "mamba": mamba_factory(hf, BAMBA_KEYS, **kw)}
    ffn, norm = _feed_forward(hf, **kw), parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixers[k], ffn, norm) for k in hybrid_kinds(hf, depth)]
    embed = _multiplier(hf, "embedding_multiplier")
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps,
                         embed_scale=None if embed == 1.0 else embed, **kw)


def _present(plan: Plan, names: Iterable[str]) -> str:
    """The first of ``names`` the checkpoint holds (the first one when none: named as missing)."""
    names = list(names)
    return next((n for n in names if plan.src.has(n)), names[0])


def _put_shared_mlp(plan: Plan, ours: str, theirs: str) -> None:
    """A :class:`~attnzoo.FeedForward` at ``ours`` from the shared MLP at ``theirs``
    (``input_linear`` rows ``[gate; up]``, ``output_linear``)."""
    key = f"{theirs}input_linear.weight"
    plan.put(f"{ours}gate_proj.weight", key, lambda w: w[: w.shape[0] // 2])
    plan.put(f"{ours}up_proj.weight", key, lambda w: w[w.shape[0] // 2:])
    plan.put(f"{ours}down_proj.weight", f"{theirs}output_linear.weight")


def _put_experts(plan: Plan, ours: str, theirs: str) -> None:
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
        if isinstance(block.ffn, MixtureOfExperts):
            _put_experts(plan, f"{o}ffn.", h)
            _put_shared_mlp(plan, f"{o}ffn.shared_expert.", f"{h}shared_mlp.")
            writes += [f"{o}ffn.down_proj", f"{o}ffn.shared_expert.down_proj.weight"]
        else:
            _put_shared_mlp(plan, f"{o}ffn.", f"{h}shared_mlp.")
            writes.append(f"{o}ffn.down_proj.weight")
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    _fold(plan, model, writes, _multiplier(hf, "residual_multiplier"), "residual_multiplier")
    logits_scaling = _multiplier(hf, "logits_scaling")
    norm_transform = None
    if head_size is None and logits_scaling != 1.0:  # the LM head's logits only (a base model: none)
        norm_transform = functools.partial(_divided, by=logits_scaling)
    return parts.finish(plan, model, head_size, norm_transform=norm_transform)


def _divided(t: Tensor, *, by: float) -> Tensor:
    """``t / by`` computed in at least float32 (the final norm's weight: ``[C]``)."""
    return t.to(torch.promote_types(t.dtype, torch.float32)) / by
