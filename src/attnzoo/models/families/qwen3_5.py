"""Qwen3.5 (text) -> :class:`~attnzoo.DecoderLM`: ``Qwen3_5ForCausalLM`` and ``Qwen3_5TextModel``
(``model_type="qwen3_5_text"``); Qwen3.5-MoE (text): ``Qwen3_5MoeForCausalLM`` and
``Qwen3_5MoeTextModel`` (``model_type="qwen3_5_moe_text"``).

The Qwen3-Next stack (:mod:`attnzoo.models.families.qwen3_next`: gated DeltaNet with grouped
value heads 3 : 1 gated full attention with partial rotary) with dense SwiGLU feed-forwards and
the linear layers' projections stored apart (``in_proj_qkv`` rows ``[q; k; v]``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``). Text positions only: the multimodal rope sections
(``mrope_section``) rotate every frequency by the same text position, which is the plain
(partial) RoPE.

Qwen3.5-MoE is the same stack with Qwen3-Next's MoE (softmax then top-k, always renormalised,
the sigmoid-gated shared expert) on every layer: its config has no ``intermediate_size``,
``decoder_sparse_step``, ``mlp_only_layers`` nor ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._common import Dispatch
from attnzoo.models.families.qwen3_next import convert_qwen3_next, put_deltanet_rest
from attnzoo.models.hf._state import HFConfig, Plan

__all__ = ["DISPATCH", "convert_qwen3_5", "convert_qwen3_5_moe", "put_split_deltanet"]


def put_split_deltanet(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """A :class:`~attnzoo.models.families.qwen3_next.QwenGatedDeltaNet` from Qwen3.5's separate
    projections: ``in_proj_qkvz = [in_proj_qkv; in_proj_z]``, ``in_proj_ba = [in_proj_b; in_proj_a]``."""
    for target, keys in (("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")), ("in_proj_ba", ("in_proj_b", "in_proj_a"))):
        plan.put_cat(f"{ours}{target}.weight", [f"{theirs}{k}.weight" for k in keys])
    put_deltanet_rest(plan, ours, theirs)


def convert_qwen3_5(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    if hf.get("num_experts", 0):
        raise hf.unsupported(f"num_experts={hf.raw('num_experts')} (the Qwen3.5 MoE text model)")
    return convert_qwen3_next(hf, sd, device=device, dtype=dtype, linear_map=put_split_deltanet)




def convert_qwen3_5_moe(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Qwen3.5-MoE: the Qwen3-Next conversion with an MoE on every layer, renormalised top-k."""
    for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
        if hf.has(key):
            raise hf.unsupported(f"{key}={hf.raw(key)!r} (Qwen3.5-MoE has an MoE on every layer, renormalised)")
    hf.req("num_experts")
    fixed = HFConfig({**hf.data, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                      "intermediate_size": hf.req("moe_intermediate_size")}, hf.source, hf.arch)
    return convert_qwen3_next(fixed, sd, device=device, dtype=dtype, linear_map=put_split_deltanet)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "qwen3_5_text": Dispatch("Qwen3.5", convert_qwen3_5, ("Qwen3_5ForCausalLM",)),
    "qwen3_5_moe_text": Dispatch("Qwen3.5-MoE", convert_qwen3_5_moe, ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel")),
}
