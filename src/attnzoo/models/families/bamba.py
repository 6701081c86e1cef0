"""Bamba -> :class:`~attnzoo.DecoderLM`: ``BambaForCausalLM`` and ``BambaModel``.

A Mamba-2 / attention hybrid (IBM's Bamba): every layer is pre-norm (``input_layernorm`` before
the mixer, ``pre_ff_layernorm`` before a dense SwiGLU ``feed_forward``); the mixer is a Mamba-2
SSD mixer (:mod:`attnzoo.models.families._mamba`), or, at the layers of ``attn_layer_indices``,
causal GQA attention with rotary positions on half of each head (``partial_rotary_factor`` 0.5,
which transformers fixes for Bamba). The final norm is ``final_layernorm``.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._mamba import BAMBA_KEYS, mamba_factory, put_mamba
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.mamba2 import Mamba2

__all__ = ["DISPATCH", "build_bamba", "convert_bamba", "hybrid_kinds"]

#: the norms of a Bamba layer: (attnzoo, transformers)
NORMS = (("attn_norm", "input_layernorm"), ("ffn_norm", "pre_ff_layernorm"))


def hybrid_kinds(hf: HFConfig, depth: int) -> list[str]:
    """``"attention"`` at the layers of ``attn_layer_indices``, ``"mamba"`` elsewhere (also read
    from ``layers_block_type`` / ``layer_types`` where a config lists them)."""
    listed = hf.first(("layers_block_type", "layer_types"), None, list)
    if listed is not None:
        if len(listed) != depth:
            raise CheckpointFormatError(f"{hf.source}: layers_block_type has {len(listed)} entries for {depth} layers")
        names = {"attention": "attention", "full_attention": "attention", "mamba": "mamba",
                 "linear_attention": "mamba"}
        if any(t not in names for t in listed):
            raise hf.unsupported(f"layer types {sorted(set(listed) - set(names))} (supported: {sorted(names)})")
        return [names[t] for t in listed]
    indices = hf.get("attn_layer_indices", [], list)
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < depth for i in indices):
        raise CheckpointFormatError(f"{hf.source}: attn_layer_indices must be layer numbers in [0, {depth}), "
                                    f"got {indices!r}")
    return ["attention" if i in indices else "mamba" for i in range(depth)]


def build_bamba(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``BambaConfig`` (random weights; see the module docstring)."""
    parts.unsupported_keys(hf, {"mlp_bias": lambda v: not v})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    D = hf.get("head_dim", C // H)
    params = parts.rope_params(hf)
    rope = parts.rotary(hf, params, D, rotary_dim=int(D * float(params.get("partial_rotary_factor", 0.5))))
    mixers = {"attention": parts.attention_factory(hf, window=None, rope=rope, **kw),
              "mamba": mamba_factory(hf, BAMBA_KEYS, **kw)}
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixers[k], ffn, norm) for k in hybrid_kinds(hf, depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def convert_bamba(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    model, plan, head_size = parts.start(hf, sd, build_bamba, device=device, dtype=dtype)
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if isinstance(block.attn, Mamba2):
            put_mamba(plan, f"{o}attn.", f"{h}mamba.", cast(Mamba2, block.attn))
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.get("attention_bias", False, bool))
        parts.put_mlp(plan, f"{o}ffn.", f"{h}feed_forward.")
        plan.put_pairs(o, h, NORMS, bias=False)
    return parts.finish(plan, model, head_size, final_norm="final_layernorm")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"bamba": parts.Dispatch("Bamba", convert_bamba, ("BambaForCausalLM", "BambaModel"))}
