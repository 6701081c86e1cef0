"""Jamba (``jamba``) -> :class:`~attnzoo.DecoderLM`: ``JambaForCausalLM`` and ``JambaModel``
(AI21's Jamba v0.1, Jamba 1.5 / 1.6 / 1.7 Mini and Large).

Line numbers below are transformers 5.25's ``models/jamba/modeling_jamba.py`` /
``configuration_jamba.py``. A Mamba-1 / attention hybrid with a mixture of experts; every layer
is pre-norm (modeling 844-914)::

    h   = x + mixer(input_layernorm(x))
    out = h + feed_forward(pre_ff_layernorm(h))

with ``weight * x`` RMSNorms of epsilon ``rms_norm_eps`` (modeling 63-81: float32, cast back
before the weight), the final one ``final_layernorm`` (modeling 962, 1021).

* Layer kinds (config 108-125): layer ``i`` mixes with attention where ``i % attn_layer_period ==
  attn_layer_offset``, else with the Mamba-1 mixer; its feed-forward is the mixture of experts
  where ``i % expert_layer_period == expert_layer_offset`` and ``num_experts > 1`` (modeling
  847-851), else the dense SwiGLU ``gate_proj`` / ``up_proj`` / ``down_proj`` (modeling 739-752).
* Attention (modeling 155-207): causal GQA (``num_key_value_heads``), scale ``head_dim ** -0.5``,
  no biases (``q/k/v/o_proj`` are built with ``bias=False`` whatever the config says), and no
  positional encoding at all (``position_ids`` are passed but never read: NoPE).
* The Mamba mixer (``JambaMambaMixer``, modeling 623-736) is Mamba-1's
  (:class:`~attnzoo.models.families.mamba1.Mamba1Mixer`: ``in_proj`` rows ``[x; z]``, the causal
  depthwise ``conv1d`` then SiLU (``hidden_act``), ``x_proj`` rows ``[dt; B; C]``, ``dt_proj`` with
  bias and softplus, the selective scan with ``A_log`` and ``D``, ``silu(z)`` gate, ``out_proj``;
  inner width ``mamba_expand * hidden_size``, ``mamba_d_state``, ``mamba_d_conv``,
  ``mamba_dt_rank`` (``"auto"``: ``ceil(hidden_size / 16)``, config 105), ``mamba_conv_bias``,
  ``mamba_proj_bias`` on ``in_proj`` / ``out_proj``) with RMSNorms *with weights*
  (``dt_layernorm [R]``, ``b_layernorm [N]``, ``c_layernorm [N]``, epsilon ``rms_norm_eps``;
  modeling 676-678, 719-722) on ``dt`` (before ``dt_proj``), ``B`` and ``C``; FalconMamba's are
  weightless. They are the mixer's ``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm`` parts,
  set here after building.
* The mixture of experts (modeling 755-841): a router ``router.weight [E, C]``, a softmax over
  all ``E`` logits in float32, then the top ``num_experts_per_tok``, the kept probabilities *not*
  renormalised (modeling 806-810): ``Routing("softmax_topk", norm_topk_prob=False)``; SwiGLU
  experts ``experts.gate_up_proj [E, 2F, C]`` (rows ``[gate; up]``) and ``experts.down_proj
  [E, C, F]`` in memory; saved folders hold one tensor per expert
  (``experts.{e}.{gate,up,down}_proj.weight``, conversion_mapping's ``"jamba"``): both load.

Padding: transformers zeroes a padded token's mixer input and the convolution's output
(modeling 694, 712), as :class:`Mamba1Mixer` does; its mixer docstring says where the two differ
(padding after a real token; with left padding they agree).

Config keys are read as transformers reads them: keys a ``config.json`` leaves out take
``JambaConfig``'s defaults (:data:`DEFAULTS`, config 67-99; ``num_key_value_heads`` 8), a stored
``num_key_value_heads: null`` means ``num_attention_heads`` (config 102-103). Accepted and
without effect on the outputs: ``use_mamba_kernels``, ``use_mambapy``, ``use_associative_scan`` (implementations of the same
scan), ``output_router_logits`` / ``router_aux_loss_coef`` (the training-only load-balancing
loss, not computed here). Refused: ``hidden_act`` other than SiLU (the convolution's activation,
where attnzoo's mixer has SiLU only).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_per_expert, put_stacked_experts
from attnzoo.models.families.mamba1 import Mamba1Mixer, put_mamba1
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.moe import MixtureOfExperts, Routing

__all__ = ["DEFAULTS", "DISPATCH", "build_jamba", "canonical", "convert_jamba", "layer_kinds"]

#: ``JambaConfig``'s defaults of the keys read here (config 67-99), for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "attention_dropout": 0.0, "num_experts_per_tok": 2, "num_experts": 16,
    "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 8, "attn_layer_offset": 4,
    "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto", "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}

#: the norms of a Jamba layer: (attnzoo, transformers)
NORMS = (("attn_norm", "input_layernorm"), ("ffn_norm", "pre_ff_layernorm"))


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: :data:`DEFAULTS` where a key is absent, ``num_experts``
    (also ``num_local_experts``, its attribute alias), ``num_key_value_heads`` (absent: 8;
    ``None``: ``num_attention_heads``), ``mamba_dt_rank`` resolved, no attention biases (transformers
    builds none)."""
    data = hf.with_defaults(DEFAULTS).data
    if "num_experts" not in hf.data and hf.data.get("num_local_experts") is not None:
        data["num_experts"] = hf.data["num_local_experts"]
    if "num_key_value_heads" in hf.data and hf.data["num_key_value_heads"] is None:  # config 102-103
        data["num_key_value_heads"] = data["num_attention_heads"]
    data["attention_bias"] = False
    out = HFConfig(data, hf.source, hf.arch)
    rank = out.raw("mamba_dt_rank")
    if rank == "auto":
        rank = math.ceil(out.req("hidden_size") / 16)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointFormatError(f"{hf.source}: key 'mamba_dt_rank' must be 'auto' or an integer >= 1, "
                                    f"got {rank!r}")
    out.data["mamba_dt_rank"] = rank
    return out


def _periodic(hf: HFConfig, name: str, depth: int) -> list[bool]:
    """Layer ``i`` is ``name``'s kind where ``i % {name}_layer_period == {name}_layer_offset``."""
    period, offset = hf.req(f"{name}_layer_period"), hf.req(f"{name}_layer_offset")
    if period < 1 or not 0 <= offset < period:
        raise CheckpointFormatError(f"{hf.source}: {name}_layer_offset ({offset}) must be in [0, "
                                    f"{name}_layer_period ({period}))")
    return [i % period == offset for i in range(depth)]


def layer_kinds(hf: HFConfig) -> list[tuple[str, bool]]:
    """``(mixer, moe)`` per layer: ``"attention"`` / ``"mamba"`` and whether its feed-forward is
    the mixture of experts (config 108-125, modeling 847-851)."""
    depth = hf.req("num_hidden_layers")
    attn, experts = _periodic(hf, "attn", depth), _periodic(hf, "expert", depth)
    many = hf.req("num_experts") > 1
    return [("attention" if a else "mamba", e and many) for a, e in zip(attn, experts, strict=True)]


def _mixer(hf: HFConfig, *, device: Any, dtype: Any) -> Mamba1Mixer:
    """One Mamba mixer with its weighted dt / B / C RMSNorms."""
    C, eps, kw = hf.req("hidden_size"), hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    R, N = hf.req("mamba_dt_rank"), hf.req("mamba_d_state")
    mixer = Mamba1Mixer(C, int(hf.req("mamba_expand") * C), N, R, conv_size=hf.req("mamba_d_conv"),
                        conv_bias=hf.req("mamba_conv_bias", bool), bias=hf.req("mamba_proj_bias", bool), **kw)
    mixer.dt_layernorm = parts.rms_norm(R, eps, **kw)()
    mixer.b_layernorm = parts.rms_norm(N, eps, **kw)()
    mixer.c_layernorm = parts.rms_norm(N, eps, **kw)()
    return mixer


def _build(hf: HFConfig, *, head_size: int | None, device: Any, dtype: Any) -> DecoderLM:
    act = hf.get("hidden_act", "silu", str)
    if act not in ("silu", "swish"):
        raise hf.unsupported(f"hidden_act={act!r} (the Mamba convolution's activation; supported: 'silu')")
    C, eps, kw = hf.req("hidden_size"), hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    F_, E, k = hf.req("intermediate_size"), hf.req("num_experts"), hf.req("num_experts_per_tok")
    attention = parts.attention_factory(hf, window=None, rope=None, **kw)  # NoPE, no biases

    def mixer() -> Mamba1Mixer:
        return _mixer(hf, **kw)

    def moe() -> MixtureOfExperts:
        return MixtureOfExperts(C, F_, E, k, routing=Routing("softmax_topk", norm_topk_prob=False), **kw)

    dense, norm = parts.gated_mlp(C, F_, "swiglu", **kw), parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, attention if kind == "attention" else mixer, moe if is_moe else dense, norm)
              for kind, is_moe in layer_kinds(hf)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def build_jamba(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``JambaConfig`` (random weights; see the module docstring)."""
    return _build(canonical(hf), head_size=head_size, device=device, dtype=dtype)


def _put_experts(plan: Plan, ours: str, theirs: str) -> None:
    """The router and experts of the :class:`MixtureOfExperts` at ``ours`` from transformers'
    ``JambaSparseMoeBlock`` at ``theirs`` (stacked in memory, one tensor per expert saved)."""
    plan.put(f"{ours}router.weight", f"{theirs}router.weight")
    if plan.src.has(f"{theirs}experts.0.gate_proj.weight"):
        put_per_expert(plan, ours, theirs)
        return
    put_stacked_experts(plan, ours, theirs)


def convert_jamba(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a Jamba decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, _build, device=device, dtype=dtype)
    bias, conv_bias = hf.req("mamba_proj_bias", bool), hf.req("mamba_conv_bias", bool)
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if isinstance(block.attn, Mamba1Mixer):
            put_mamba1(plan, f"{o}attn.", f"{h}mamba.", bias=bias, conv_bias=conv_bias)
            plan.put_pairs(f"{o}attn.", f"{h}mamba.", [(n, n) for n in ("dt_layernorm", "b_layernorm",
                                                                        "c_layernorm")], bias=False)
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=False)
        if isinstance(block.ffn, MixtureOfExperts):
            _put_experts(plan, f"{o}ffn.", f"{h}feed_forward.")
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}feed_forward.")
        plan.put_pairs(o, h, NORMS, bias=False)
    return parts.finish(plan, model, head_size, final_norm="final_layernorm")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"jamba": parts.Dispatch("Jamba", convert_jamba, ("JambaForCausalLM", "JambaModel"))}
