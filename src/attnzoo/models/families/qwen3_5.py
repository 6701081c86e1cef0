"""Qwen3.5 (text) -> :class:`~attnzoo.DecoderLM`: ``Qwen3_5ForCausalLM`` and ``Qwen3_5TextModel``
(``model_type="qwen3_5_text"``).

The Qwen3-Next stack (:mod:`attnzoo.models.families.qwen3_next`: gated DeltaNet with grouped
value heads 3 : 1 gated full attention with partial rotary) with dense SwiGLU feed-forwards and
the linear layers' projections stored apart (``in_proj_qkv`` rows ``[q; k; v]``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``). Text positions only: the multimodal rope sections
(``mrope_section``) rotate every frequency by the same text position, which is the plain
(partial) RoPE.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.qwen3_next import convert_qwen3_next, put_deltanet_rest
from attnzoo.models.hf._state import HFConfig, Plan

__all__ = ["convert_qwen3_5", "put_split_deltanet"]


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


