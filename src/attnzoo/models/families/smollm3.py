"""SmolLM3 -> :class:`~attnzoo.DecoderLM`: ``SmolLM3ForCausalLM`` and ``SmolLM3Model``.

A LLaMA layout whose layers ``i`` with ``no_rope_layers[i] == 0`` take no positional encoding
at all (NoPE: their attention has no rotary embedding; by default every fourth layer); the
others share one rotary embedding (``rope_parameters``, scaled types included). Sliding layers
(``use_sliding_window`` and ``layer_types``) attend to ``sliding_window - 1`` keys back.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.errors import CheckpointFormatError

__all__ = ["DISPATCH", "build_smollm3", "convert_smollm3"]


def build_smollm3(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                  dtype: Any = None) -> DecoderLM:
    """The decoder of a ``SmolLM3Config`` (random weights; see the module docstring)."""
    parts.unsupported_keys(hf, {"pretraining_tp": lambda v: v in (None, 1)})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, ("sliding_attention", "full_attention"))
    if not hf.get("use_sliding_window", False, bool):
        kinds = ["full_attention"] * depth
    use_rope = hf.get("no_rope_layers", [1] * depth, list)
    if len(use_rope) != depth:
        raise CheckpointFormatError(f"{hf.source}: no_rope_layers has {len(use_rope)} entries for {depth} layers")
    rope = parts.rotary(hf, parts.rope_params(hf), hf.get("head_dim", C // H))
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                    bias=hf.get("mlp_bias", False, bool), **kw)
    blocks = [parts.block(C, parts.attention_factory(hf, window=w, rope=rope if r else None, **kw), ffn, parts.rms_norm(C, eps, **kw))
              for w, r in zip(parts.sliding_windows(hf, kinds), use_rope, strict=True)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def convert_smollm3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    return parts.convert_layers(hf, sd, build_smollm3, device=device, dtype=dtype,
                                ffn=functools.partial(parts.put_mlp, bias=hf.get("mlp_bias", False, bool)))


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"smollm3": parts.Dispatch("SmolLM3", convert_smollm3, ("SmolLM3ForCausalLM",))}
