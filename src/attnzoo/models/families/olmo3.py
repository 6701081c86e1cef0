"""OLMo 3 -> :class:`~attnzoo.DecoderLM`: ``Olmo3ForCausalLM`` and ``Olmo3Model``.

OLMo 2's layer (QK RMSNorm over all heads of a token, applied to the projections before RoPE;
RMSNorms on the sub-layer *outputs*, none on their inputs) with ``layer_types``: by default three
``sliding_attention`` layers (``sliding_window - 1`` keys back) per ``full_attention`` layer,
each kind with its own rotary embedding (``rope_parameters[layer_type]``).
Half precision: the RMSNorms scale in float32 and round once (``modeling_olmo3.py`` 43-57,
:class:`~attnzoo.models.families._common.Float32ScaleRMSNorm`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig

__all__ = ["DISPATCH", "build_olmo3", "convert_olmo3"]


def build_olmo3(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of an ``Olmo3Config`` (random weights; see the module docstring)."""
    parts.unsupported_keys(hf, {"pretraining_tp": lambda v: v in (None, 1)})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, ("sliding_attention", "full_attention"))
    ropes = {t: parts.rotary(hf, parts.rope_params(hf, t), hf.get("head_dim", C // H)) for t in set(kinds)}
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    blocks = [parts.block(C, parts.attention_factory(hf, window=w, rope=ropes[k], qk_norm="all", **kw), ffn,
                    parts.rms_norm(C, eps, **kw), sublayer_norm="output")
              for k, w in zip(kinds, parts.sliding_windows(hf, kinds), strict=True)]
    return parts.float32_scale_norms(parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw))


def convert_olmo3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them); RMSNorms on the sub-layer outputs."""
    return parts.convert_layers(hf, sd, build_olmo3, device=device, dtype=dtype, qk_norm=True,
                                norms=[("attn_out_norm", "post_attention_layernorm"),
                                       ("ffn_out_norm", "post_feedforward_layernorm")])


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"olmo3": parts.Dispatch("OLMo3", convert_olmo3, ("Olmo3ForCausalLM",))}
