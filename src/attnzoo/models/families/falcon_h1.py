"""Falcon-H1 -> :class:`~attnzoo.DecoderLM`: ``FalconH1ForCausalLM`` and ``FalconH1Model``.

Every layer runs a Mamba-2 mixer and GQA attention (full rotary) **in parallel** on the normed
input and adds both to the residual stream (a :class:`~attnzoo.nn.parallel.ParallelMixers` of
the two), then a dense SwiGLU ``feed_forward``; norms ``input_layernorm`` / ``pre_ff_layernorm``,
final ``final_layernorm``. The mixer's inner width is ``mamba_d_ssm`` (else ``mamba_expand *
hidden``); its gate: ``y * silu(z)`` without a norm (``mamba_rms_norm=False``, the default), or
the gated RMSNorm before (``mamba_norm_before_gate``) or after the gate.

Falcon-H1's muP multipliers are folded into the weights at load, exactly (every map they scale
is linear): ``ssm_in_multiplier`` and the five ``ssm_multipliers`` into the ``[z | x | B | C |
dt]`` rows of the mixer's ``in_proj``; ``ssm_out_multiplier`` into its ``out_proj``;
``attention_in_multiplier`` into ``q/k/v_proj``, ``key_multiplier`` into ``k_proj``,
``attention_out_multiplier`` into ``o_proj``; ``mlp_multipliers`` (gate, down) into
``gate_proj`` / ``down_proj``; ``lm_head_multiplier`` into the final norm's weight (models with
the LM head; tied embeddings too, the head itself is not touched). ``embedding_multiplier``
scales the token embedding (a :class:`~attnzoo.models.parts.ScaledEmbedding`). The converted
model's weights are therefore the checkpoint's times these factors.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._mamba import BAMBA_KEYS, in_proj_widths, mamba_factory, put_mamba
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.mamba2 import Mamba2
from attnzoo.nn.parallel import ParallelMixers

__all__ = ["DISPATCH", "build_falcon_h1", "convert_falcon_h1", "fold_multipliers"]

KEYS = dataclasses.replace(BAMBA_KEYS, inner="mamba_d_ssm")
NORMS = (("attn_norm", "input_layernorm"), ("ffn_norm", "pre_ff_layernorm"))


def _scalar(hf: HFConfig, key: str) -> float:
    return float(hf.get(key, 1.0, float))


def _pair(hf: HFConfig, key: str, n: int) -> list[float]:
    value = hf.get(key, [1.0] * n, list)
    if len(value) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise CheckpointFormatError(f"{hf.source}: {key} must be {n} numbers, got {value!r}")
    return [float(v) for v in value]


def _gate_norm(hf: HFConfig) -> str:
    if not hf.get("mamba_rms_norm", False, bool):
        return "none"
    return "before_gate" if hf.get("mamba_norm_before_gate", True, bool) else "after_gate"


def build_falcon_h1(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                    dtype: Any = None) -> DecoderLM:
    """The decoder of a ``FalconH1Config`` (random weights; see the module docstring)."""
    parts.unsupported_keys(hf, {"projectors_bias": lambda v: not v, "mlp_bias": lambda v: not v})
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    attention = parts.attention_factory(hf, window=None, rope=parts.rotary(hf, parts.rope_params(hf),
                                                                           hf.get("head_dim", C // H)), **kw)
    mamba = mamba_factory(hf, KEYS, gate_norm=_gate_norm(hf), **kw)
    mixer = functools.partial(_parallel, mamba, attention)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixer, ffn, norm) for _ in range(hf.req("num_hidden_layers"))]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps,
                         embed_scale=_scalar(hf, "embedding_multiplier"), **kw)


def _parallel(mamba: Callable[[], nn.Module], attention: Callable[[], nn.Module]) -> ParallelMixers:
    return ParallelMixers([mamba(), attention()])


def _mamba_rows(hf: HFConfig) -> list[tuple[int, int, float]]:
    """``(start, stop, factor)`` of the ``[z | x | B | C | dt]`` rows of ``in_proj``."""
    scale = _scalar(hf, "ssm_in_multiplier")
    rows, lo = [], 0
    for width, m in zip(in_proj_widths(hf, KEYS), _pair(hf, "ssm_multipliers", 5), strict=True):
        rows.append((lo, lo + width, m * scale))
        lo += width
    return rows


def fold_multipliers(hf: HFConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A copy of ``sd`` with Falcon-H1's multipliers folded into the weights they scale (see the
    module docstring; the LM head's multiplier goes into the final norm when ``sd`` has the
    head)."""
    lm_head = parts.head_size_of(hf, sd)[1] is None
    attn_in, key = _scalar(hf, "attention_in_multiplier"), _scalar(hf, "key_multiplier")
    gate, down = _pair(hf, "mlp_multipliers", 2)
    factors = {"self_attn.q_proj.weight": attn_in, "self_attn.k_proj.weight": attn_in * key,
               "self_attn.k_proj.bias": key, "self_attn.v_proj.weight": attn_in,
               "self_attn.o_proj.weight": _scalar(hf, "attention_out_multiplier"),
               "self_attn.o_proj.bias": _scalar(hf, "attention_out_multiplier"),
               "mamba.out_proj.weight": _scalar(hf, "ssm_out_multiplier"),
               "feed_forward.gate_proj.weight": gate, "feed_forward.down_proj.weight": down}
    rows = _mamba_rows(hf)
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        match = re.search(r"layers\.\d+\.(.+)$", name)
        suffix = match.group(1) if match else ""
        if suffix == "mamba.in_proj.weight":
            t = torch.cat([t[lo:hi] * f for lo, hi, f in rows])
        elif factors.get(suffix, 1.0) != 1.0:
            t = t * factors[suffix]
        elif lm_head and re.fullmatch(r"(model\.)?final_layernorm\.weight", name):
            t = t * _scalar(hf, "lm_head_multiplier")
        out[name] = t
    return out


def convert_falcon_h1(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder, fold the multipliers and copy the weights (the head follows them)."""
    model, plan, head_size = parts.start(hf, fold_multipliers(hf, sd), build_falcon_h1, device=device, dtype=dtype)
    mixers = [cast(ParallelMixers, b.attn).mixers for b in model.blocks]
    bias = hf.get("attention_bias", False, bool)
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        put_mamba(plan, f"{o}attn.mixers.0.", f"{h}mamba.", cast(Mamba2, mixers[i][0]))
        parts.put_attention(plan, f"{o}attn.mixers.1", f"{h}self_attn.", bias=bias)
        parts.put_mlp(plan, f"{o}ffn.", f"{h}feed_forward.")
        plan.put_pairs(o, h, NORMS, bias=False)
    return parts.finish(plan, model, head_size, final_norm="final_layernorm")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"falcon_h1": parts.Dispatch("Falcon-H1", convert_falcon_h1, ("FalconH1ForCausalLM", "FalconH1Model"))}
