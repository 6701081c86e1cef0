"""Mixture-of-experts parts shared by the family builders: the :class:`~attnzoo.nn.moe.MixtureOfExperts`
of a Hugging Face config and the weight maps of transformers' three expert layouts.

Layouts (``E`` experts, hidden ``F``, width ``C``):

* ``"stacked"`` (Qwen3-MoE, Qwen3-Next, Qwen3.5): ``gate.weight [E, C]``, ``experts.gate_up_proj
  [E, 2F, C]`` (rows ``[gate; up]``), ``experts.down_proj [E, C, F]``; ``shared_expert.{gate,up,
  down}_proj`` and ``shared_expert_gate [1, C]``. Saved folders hold one tensor per expert
  instead (``experts.{e}.{gate,up,down}_proj.weight``): both load.
* ``"interleaved"`` (gpt-oss): ``router.weight``/``router.bias``, ``experts.gate_up_proj [E, C, 2F]``
  (columns alternate gate, up) with ``gate_up_proj_bias [E, 2F]``, ``down_proj [E, F, C]`` with
  ``down_proj_bias [E, C]``.
* ``"transposed"`` (Llama-4): ``router.weight``, ``experts.gate_up_proj [E, C, 2F]`` (columns
  ``[gate, up]``), ``experts.down_proj [E, F, C]``, ``shared_expert.{gate,up,down}_proj``.
* ``"deepseek"`` (DeepSeek-V3's MoE, Kimi Linear): the stacked experts, ``gate.weight [E, C]``
  with ``gate.e_score_correction_bias [E]``, ungated ``shared_experts.{gate,up,down}_proj``
  (hidden ``moe_intermediate_size * n_shared_experts``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.blocks import FeedForward
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.moe import Experts, MixtureOfExperts, Routing

__all__ = ["LAYOUTS", "deepseek_moe", "moe_from_config", "put_moe", "put_per_expert", "put_stacked_experts"]

LAYOUTS = ("stacked", "interleaved", "transposed", "deepseek")


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2).contiguous()


def put_moe(plan: Plan, ours: str, theirs: str, layout: str, *, shared: bool = False,
            shared_gate: bool = False) -> None:
    """Plan the weights of the :class:`MixtureOfExperts` at ``ours`` (``"blocks.3.ffn."``) from
    transformers' MoE block at ``theirs`` (``"layers.3.mlp."``) in ``layout`` (see the module
    docstring)."""
    if layout == "deepseek":
        put_moe(plan, ours, theirs, "stacked")
        plan.put(f"{ours}score_bias", f"{theirs}gate.e_score_correction_bias")
        plan.put_pairs(f"{ours}shared_expert.", f"{theirs}shared_experts.",
                       [(n, n) for n in ("gate_proj", "up_proj", "down_proj")], bias=False)
        return  # its shared experts are always there (``shared``/``shared_gate`` do not apply)
    if layout == "stacked" and plan.src.has(f"{theirs}experts.0.gate_proj.weight"):
        plan.put(f"{ours}router.weight", f"{theirs}gate.weight")
        put_per_expert(plan, ours, theirs)
    elif layout == "stacked":
        plan.put(f"{ours}router.weight", f"{theirs}gate.weight")
        put_stacked_experts(plan, ours, theirs)
    elif layout == "interleaved":
        plan.put(f"{ours}router.weight", f"{theirs}router.weight")
        plan.put(f"{ours}router.bias", f"{theirs}router.bias")
        key = f"{theirs}experts.gate_up_proj"
        plan.put(f"{ours}gate_proj", key, lambda w: _t(w[..., ::2]))
        plan.put(f"{ours}up_proj", key, lambda w: _t(w[..., 1::2]))
        plan.put(f"{ours}gate_bias", f"{key}_bias", lambda b: b[..., ::2].contiguous())
        plan.put(f"{ours}up_bias", f"{key}_bias", lambda b: b[..., 1::2].contiguous())
        plan.put(f"{ours}down_proj", f"{theirs}experts.down_proj", _t)
        plan.put(f"{ours}down_bias", f"{theirs}experts.down_proj_bias")
    elif layout == "transposed":
        plan.put(f"{ours}router.weight", f"{theirs}router.weight")
        key = f"{theirs}experts.gate_up_proj"
        plan.put(f"{ours}gate_proj", key, lambda w: _t(w[..., : w.shape[-1] // 2]))
        plan.put(f"{ours}up_proj", key, lambda w: _t(w[..., w.shape[-1] // 2:]))
        plan.put(f"{ours}down_proj", f"{theirs}experts.down_proj", _t)
    else:
        raise ValueError(f"put_moe: layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if shared:
        plan.put_pairs(f"{ours}shared_expert.", f"{theirs}shared_expert.",
                       [(n, n) for n in ("gate_proj", "up_proj", "down_proj")], bias=False)
    if shared_gate:
        plan.put(f"{ours}shared_gate.weight", f"{theirs}shared_expert_gate.weight")


def put_stacked_experts(plan: Plan, ours: str, theirs: str) -> None:
    """The experts of the stacked layout in memory: ``experts.gate_up_proj [E, 2F, C]`` (rows
    ``[gate; up]``) and ``experts.down_proj [E, C, F]``, without the router."""
    key = f"{theirs}experts.gate_up_proj"
    plan.put(f"{ours}gate_proj", key, lambda w: w[:, : w.shape[1] // 2].contiguous())
    plan.put(f"{ours}up_proj", key, lambda w: w[:, w.shape[1] // 2:].contiguous())
    plan.put(f"{ours}down_proj", f"{theirs}experts.down_proj")


def put_per_expert(plan: Plan, ours: str, theirs: str) -> None:
    """The saved-checkpoint form of the stacked layout: ``experts.{e}.{gate,up,down}_proj.weight``."""
    count = 0
    while plan.src.has(f"{theirs}experts.{count}.gate_proj.weight"):
        count += 1
    for name in ("gate_proj", "up_proj", "down_proj"):
        keys = [f"{theirs}experts.{e}.{name}.weight" for e in range(count)]
        parts = [plan.src.take(k) for k in keys]
        if all(p is not None for p in parts):
            plan.put_tensor(f"{ours}{name}", torch.stack([p for p in parts if p is not None]),
                            f"{plan.src.prefix}{theirs}experts.*.{name}.weight")


def moe_from_config(hf: HFConfig, layout: str, *, keep_router_float32: bool = False, device: Any = None,
                    dtype: Any = None) -> nn.Module:
    """The :class:`MixtureOfExperts` of one MoE layer of ``hf`` in the family's ``layout``:
    ``stacked`` (softmax then top-k, ``norm_topk_prob``, a sigmoid-gated shared expert when
    ``shared_expert_intermediate_size`` is set), ``interleaved`` (gpt-oss: top-k then softmax,
    router and expert biases, the clamped SwiGLU), ``transposed`` (Llama-4: sigmoid of the top-k
    logits scaling the expert inputs, an ungated shared expert)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    C = hf.req("hidden_size")
    act = hf.get("hidden_act", "silu", str)
    if layout != "interleaved" and act not in ("silu", "swish"):
        raise hf.unsupported(f"hidden_act={act!r} in the experts (supported: 'silu')")
    if layout == "stacked":
        E = hf.req("num_experts" if hf.has("num_experts") else "num_local_experts")
        k, F_ = hf.req("num_experts_per_tok"), hf.req("moe_intermediate_size")
        shared_hidden = hf.get("shared_expert_intermediate_size", 0) or 0
        shared = FeedForward(C, shared_hidden, "swiglu", bias=False, **kw) if shared_hidden else None
        routing = Routing("softmax_topk", norm_topk_prob=hf.get("norm_topk_prob", False, bool))
        return MixtureOfExperts(C, F_, E, k, routing=routing, shared_expert=shared, shared_gate=shared is not None, **kw)
    if layout == "interleaved":
        E, k = hf.req("num_local_experts"), hf.req("num_experts_per_tok")
        experts = Experts("clamped_swiglu", swiglu_limit=hf.get("swiglu_limit", 7.0, float),
                          swiglu_alpha=hf.get("swiglu_alpha", 1.702, float), bias=True)
        return MixtureOfExperts(C, hf.req("intermediate_size"), E, k, routing=Routing("topk_softmax", bias=True),
                                experts=experts, **kw)
    if layout == "transposed":
        E, k, F_ = hf.req("num_local_experts"), hf.req("num_experts_per_tok"), hf.req("intermediate_size")
        return MixtureOfExperts(C, F_, E, k, routing=Routing("topk_sigmoid", weight_inputs=True),
                                shared_expert=FeedForward(C, F_, "swiglu", bias=False, **kw), **kw)
    if layout == "deepseek":
        return deepseek_moe(hf, keep_router_float32=keep_router_float32, **kw)
    raise ValueError(f"moe_from_config: layout must be one of {list(LAYOUTS)}, got {layout!r}")


def deepseek_moe(hf: HFConfig, *, experts: Experts | None = None,
                 shared_expert: Callable[[int, int], nn.Module] | None = None, keep_router_float32: bool = False,
                 device: Any = None, dtype: Any = None) -> nn.Module:
    """DeepSeek-V3's MoE (sigmoid scores, the correction bias choosing, ``routed_scaling_factor``,
    ``n_shared_experts`` ungated shared experts); the config read under its own names or under
    the names transformers saves (``num_experts``, ``num_experts_per_token``, ...). ``experts``:
    the routed experts (default SwiGLU); ``shared_expert(dim, hidden)``: the shared experts' module
    (default a SwiGLU :class:`FeedForward`), ``hidden = moe_intermediate_size * n_shared_experts``;
    ``keep_router_float32``: the router's weight in float32 whatever the dtype (the families whose
    transformers model lists ``gate.weight`` in ``_keep_in_fp32_modules_strict``)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    groups = hf.first(("n_group", "num_expert_group"), 1) or 1
    topk_groups = hf.first(("topk_group",), 1) or 1
    C, F_ = hf.req("hidden_size"), hf.req("moe_intermediate_size")
    E = hf.first(("n_routed_experts", "num_local_experts", "num_experts"), None)
    k = hf.first(("num_experts_per_tok", "num_experts_per_token"), None)
    if E is None or k is None:
        raise hf.unsupported("a mixture of experts without num_experts / num_experts_per_tok")
    routing = Routing("sigmoid_topk", norm_topk_prob=hf.first(("norm_topk_prob", "moe_renormalize"), True, bool),
                      scaling=hf.get("routed_scaling_factor", 1.0, float), groups=groups, topk_groups=topk_groups)
    n_shared = hf.first(("n_shared_experts", "num_shared_experts"), 0)
    make = shared_expert or functools.partial(FeedForward, activation="swiglu", bias=False, **kw)
    shared = make(C, F_ * n_shared) if n_shared else None
    return MixtureOfExperts(C, F_, E, k, routing=routing, experts=experts, shared_expert=shared,
                            keep_router_float32=keep_router_float32, **kw)
