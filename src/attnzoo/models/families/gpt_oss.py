"""gpt-oss -> :class:`~attnzoo.DecoderLM`: ``GptOssForCausalLM`` and ``GptOssModel``.

Every layer: a :class:`~attnzoo.MultiHeadAttention` with q/k/v/o biases, one learnable sink
logit per query head (``sinks``), a causal window of ``sliding_window - 1`` keys on the
``sliding_attention`` layers (alternating with ``full_attention``), one YaRN rotary embedding
shared by all layers; then a :class:`~attnzoo.nn.moe.MixtureOfExperts` (router with a bias,
top-k of the logits then a softmax over the ``k``, experts with biases and the clamped SwiGLU
``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``). RMSNorm pre-norm.
Half precision: the RMSNorms scale in float32 (``modeling_gpt_oss.py`` 47-61) with their weights
kept in float32, as ``_keep_in_fp32_modules`` loads them (388).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import moe_from_config, put_moe
from attnzoo.models.hf._state import HFConfig

__all__ = ["DISPATCH", "build_gpt_oss", "convert_gpt_oss"]


def build_gpt_oss(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                  dtype: Any = None) -> DecoderLM:
    """The decoder of a ``GptOssConfig`` (random weights; see the module docstring)."""
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, ("sliding_attention", "full_attention"))
    rope = parts.rotary(hf, parts.rope_params(hf), hf.get("head_dim", C // H))
    ffn = functools.partial(moe_from_config, hf, "interleaved", **kw)
    blocks = [parts.block(C, parts.attention_factory(hf, window=w, rope=rope, sinks=True, **kw), ffn, parts.rms_norm(C, eps, **kw))
              for w in parts.sliding_windows(hf, kinds)]
    return parts.float32_scale_norms(parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw), keep_float32=True)


def convert_gpt_oss(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    return parts.convert_layers(hf, sd, build_gpt_oss, device=device, dtype=dtype, sinks=True,
                                ffn=functools.partial(put_moe, layout="interleaved"))


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"gpt_oss": parts.Dispatch("gpt-oss", convert_gpt_oss, ("GptOssForCausalLM",))}
