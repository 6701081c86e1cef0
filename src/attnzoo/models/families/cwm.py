"""Meta CWM (Code World Model, ``cwm``) -> :class:`~attnzoo.DecoderLM`: ``CwmForCausalLM`` and
``CwmModel``. Line numbers: transformers 5.25's ``models/cwm/modular_cwm.py``.

A dense LLaMA decoder (``LlamaDecoderLayer``: pre-norm RMSNorm, a SwiGLU MLP with ``mlp_bias``;
106-109, 120-127) whose attention is Qwen2's (98-103) without any bias (q/k/v rebuilt bias-free,
101-103; ``o_proj`` has none): a causal window of ``sliding_window - 1`` keys on the ``sliding_attention``
layers of ``layer_types`` (default: full on every fourth layer from 0, sliding elsewhere, 82-87;
the model always builds both masks, 120-186), one rotary embedding for every layer (Qwen2's,
``rope_parameters``; by default LLaMA-3's scaled RoPE, theta 1e6, factor 16, 70-79; 94-95).

Refused by name: ``pretraining_tp`` other than 1, a ``hidden_act`` without a gated attnzoo MLP,
``layer_types`` entries other than ``"full_attention"`` / ``"sliding_attention"``, rope types
attnzoo's rotary does not know.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig

__all__ = ["DEFAULTS", "DISPATCH", "build_cwm", "canonical", "convert_cwm"]

TYPES = ("full_attention", "sliding_attention")
#: ``CwmConfig``'s defaults of the keys read here (modular 40-91) that a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "mlp_bias": False, "sliding_window": 8192,
    "rope_parameters": {"rope_theta": 1_000_000.0, "factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: :data:`DEFAULTS`, the default ``layer_types`` (full where
    ``i % 4 == 0``), no attention biases (``CwmConfig`` has no ``attention_bias``)."""
    out = hf.with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    default = [TYPES[i % 4 != 0] for i in range(depth)]
    return HFConfig({**out.data, "attention_bias": False, "layer_types": out.get("layer_types", default, list)},
                    hf.source, hf.arch)


def build_cwm(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``CwmConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                          bias=hf.get("mlp_bias", False, bool), **kw)
    blocks = [parts.block(C, parts.attention_factory(hf, window=w, rope=rope, **kw), ffn, parts.rms_norm(C, eps, **kw))
              for w in parts.sliding_windows(hf, kinds)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def convert_cwm(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    return parts.convert_layers(hf, sd, build_cwm, device=device, dtype=dtype,
                                ffn=functools.partial(parts.put_mlp, bias=hf.get("mlp_bias", False, bool)))


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"cwm": parts.Dispatch("CWM", convert_cwm, ("CwmForCausalLM", "CwmModel"))}
