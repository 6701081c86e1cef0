"""LFM3 (``lfm3``) -> :class:`~attnzoo.DecoderLM`: ``Lfm3ForCausalLM`` and ``Lfm3Model``.

Liquid AI's LFM3 (transformers ``models/lfm3``; line numbers below are ``modeling_lfm3.py`` /
``configuration_lfm3.py`` of transformers 5.25) is LFM2's stack (:mod:`.lfm2`) with a third layer
kind and three changes to the layer. Every layer is pre-norm (modeling 444-500):
``x + post_operator_norm(mixer(operator_norm(x)))``, then
``x + post_ffn_norm(feed_forward(ffn_norm(x)))``; the mixer is chosen by ``layer_types``
(``"conv"``, ``"sliding_attention"``, ``"full_attention"``; config 94-98: by default layer ``i``
is full attention when ``i % 4 == 2``, sliding when ``i % 4 == 0`` and ``i > 0``, else conv):

* ``"conv"``: LFM2's gated short convolution, :class:`~attnzoo.models.families.lfm2.Lfm2ShortConvMixer`
  (``Lfm3ShortConv``, modeling 397-441, the same as ``Lfm2ShortConv``; kernel ``conv_L_cache``,
  ``conv_bias`` on ``in_proj``, the convolution and ``out_proj``).
* attention (modeling 208-284): causal GQA, ``head_dim``, biases by ``attention_bias``, per-head
  RMSNorm of q and k over ``head_dim`` (``q_norm``/``k_norm``, eps ``norm_eps``, before RoPE);
  ``sliding_attention`` layers see ``sliding_window`` keys including their own
  (``window = sliding_window - 1``); with ``use_attention_gate`` each head's output is multiplied
  by ``sigmoid(g_proj(h))`` (``g_proj [H, C]``, no bias, ``h`` the normed layer input) before
  ``o_proj``: an :class:`~attnzoo.nn.parts.OutputGate` of mode ``"head"``.
* RoPE per attention kind (modeling 66-122): ``rope_parameters["sliding_attention"]`` and
  ``["full_attention"]`` (config 86-93: ``default`` base 10k and ``proportional`` base 1M with
  ``partial_rotary_factor`` 0.5). ``default`` rotates the whole head whatever its
  ``partial_rotary_factor`` (LFM3's own ``compute_default_rope_parameters``, modeling 86-110, does
  not read it); ``proportional`` is :class:`ProportionalRotaryEmbedding`; the scaled types
  (``linear``, ``dynamic``, ``yarn``, ``llama3``, ``longrope``) as everywhere
  (:func:`~attnzoo.models.families._common.rotary`), but with a ``partial_rotary_factor`` below 1
  they are refused (transformers' frequencies then cover part of the head while its rotation
  covers all of it: its forward fails).
* ``use_sandwich_norm`` (modeling 456-461): RMSNorms on the mixer and feed-forward outputs
  before the residual add (``sublayer_norm="both"``); off, none (``"input"``).
* Feed-forward (modeling 125-135): SwiGLU ``w2(silu(w1 x) * w3 x)`` of width ``intermediate_size``
  as given (no ``block_auto_adjust_ff_dim``). Plain ``weight * x`` RMSNorms, eps ``norm_eps``;
  final norm ``embedding_norm``; tied embeddings by default.

Keys a ``config.json`` leaves out take ``Lfm3Config``'s defaults (:data:`DEFAULTS`, config 57-82;
``layer_types`` and ``rope_parameters`` as its ``__post_init__`` fills them, :func:`canonical`).
A flat ``rope_parameters`` (not keyed by layer kind; transformers' rotary module fails on it) is
read for both attention kinds. ``sliding_attention`` layers with ``sliding_window=None`` are
refused (transformers fails there too).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.lfm2 import put_short_conv, put_swiglu, short_conv_factory
from attnzoo.models.hf._state import HFConfig
from attnzoo.nn.positional import RotaryEmbedding

__all__ = ["DEFAULTS", "DISPATCH", "ProportionalRotaryEmbedding", "build_lfm3", "canonical", "convert_lfm3", "rotary_for"]

TYPES = ("conv", "sliding_attention", "full_attention")

#: ``Lfm3Config``'s defaults of the keys read here (config 57-82), for a ``config.json`` that
#: leaves them out (``layer_types``, ``rope_parameters``: :func:`canonical`)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 128_000, "hidden_size": 2048, "intermediate_size": 7680, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 128_000, "norm_eps": 1e-5,
    "tie_word_embeddings": True, "conv_bias": False, "conv_L_cache": 7, "head_dim": 128,
    "use_sandwich_norm": True, "use_attention_gate": True, "attention_bias": False, "attention_dropout": 0.0,
}

#: ``Lfm3Config.__post_init__``'s ``rope_parameters`` (config 86-93)
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}

#: ``Lfm3Config.sliding_window``'s default: only where the key is absent (``None`` is kept)
DEFAULT_WINDOW = 256


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """transformers' ``rope_type="proportional"`` (``_compute_proportional_rope_parameters``,
    ``modeling_rope_utils.py`` 194-267 of 5.25): RoPE over the whole head whose last pairs do not turn.

    Channels pair split-half over the whole head, ``(i, i + D / 2)``. With
    ``R = int(partial_rotary_factor * D // 2)``, pair ``i < R`` turns by ``p * theta_i``,
    ``theta_i = base^(-2i / D) / factor`` (the exponent over ``D``, not over the rotated width),
    and the pairs ``i >= R`` have frequency 0 (they pass through). Unlike a partial rotary
    (:class:`RotaryEmbedding` with ``rotary_dim``), the rotated channels are the first ``R`` *and*
    the ``R`` from ``D / 2`` on, and the frequencies are those of the full head.

    Args:
        dim: head dimension ``D`` (even).
        base: ``rope_theta`` (> 1).
        partial_rotary_factor: the share of the head's pairs that turn, in ``[0, 1]``.
        factor: the frequencies are divided by it (finite, > 0; transformers' key check warns that
            ``factor`` is unrecognised for this type, yet its frequencies divide by it).

    Shapes: as :class:`RotaryEmbedding`.
    """

    def __init__(self, dim: int, *, base: float = 10000.0, partial_rotary_factor: float = 1.0,
                 factor: float = 1.0) -> None:
        super().__init__(dim, base=base)
        owner = type(self).__name__
        if isinstance(partial_rotary_factor, bool) or not isinstance(partial_rotary_factor, (int, float)) \
                or not 0 <= partial_rotary_factor <= 1:
            raise ValueError(f"{owner}: partial_rotary_factor must be a number in [0, 1], got {partial_rotary_factor!r}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
            raise ValueError(f"{owner}: factor must be a finite number > 0, got {factor!r}")
        self.partial_rotary_factor, self.factor = float(partial_rotary_factor), float(factor)
        self.turning = int(partial_rotary_factor * self.dim // 2)  # R, as transformers rounds it
        exponents = torch.arange(0, 2 * self.turning, 2, dtype=torch.float64) / self.dim  # [R]
        inv_freq = torch.zeros(self.dim // 2, dtype=torch.float64)  # [D/2]
        inv_freq[: self.turning] = self.base ** -exponents / self.factor
        self._set_inv_freq(inv_freq)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, base={self.base:g}, partial_rotary_factor={self.partial_rotary_factor:g} "
                f"({self.turning} of {self.dim // 2} pairs turn), factor={self.factor:g}")


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads an ``Lfm3Config``: :data:`DEFAULTS` where a key is absent,
    ``sliding_window`` 256 where absent (``None`` kept), ``rope_parameters`` and ``layer_types``
    as ``__post_init__`` sets them when ``None`` (config 84-98)."""
    out = hf.with_defaults(DEFAULTS)
    out.data["sliding_window"] = hf.data.get("sliding_window") if "sliding_window" in hf.data else DEFAULT_WINDOW
    if out.get("rope_parameters", None, dict) is None:
        out.data["rope_parameters"] = {k: dict(v) for k, v in DEFAULT_ROPE.items()}
    if out.get("layer_types", None, list) is None:
        depth = out.req("num_hidden_layers")
        out.data["layer_types"] = ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0
                                   else "conv" for i in range(depth)]
    return out


def rotary_for(hf: HFConfig, layer_type: str, head_dim: int) -> nn.Module:
    """The rotary embedding of the ``layer_type`` attention layers of a canonical ``hf`` (see the
    module docstring); what transformers cannot run is refused by name."""
    params = parts.rope_params(hf, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    partial = params.get("partial_rotary_factor", 1.0)
    partial = 1.0 if partial is None else partial
    if rope_type == "proportional":
        factor = params.get("factor", 1.0)
        try:
            return ProportionalRotaryEmbedding(head_dim, base=float(params["rope_theta"]),
                                               partial_rotary_factor=partial, factor=1.0 if factor is None else factor)
        except ValueError as exc:
            raise hf.unsupported(f"rope_parameters[{layer_type!r}] of rope_type='proportional': {exc}") from exc
    if rope_type != "default" and partial != 1:
        raise hf.unsupported(f"partial_rotary_factor={partial!r} with rope_type={rope_type!r} "
                             f"(rope_parameters[{layer_type!r}]: transformers' LFM3 cannot run it)")
    return parts.rotary(hf, {k: v for k, v in params.items() if k != "partial_rotary_factor"}, head_dim)


def _mixers(hf: HFConfig, kinds: list[str], eps: float, *, device: Any,
            dtype: Any) -> list[Callable[[], nn.Module]]:
    """Each layer's mixer factory: the short convolution, or the attention of its kind (its
    window, its rotary embedding, QK-norm of eps ``norm_eps``, the per-head gate)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    ropes = {k: rotary_for(hf, k, hf.req("head_dim")) for k in sorted(set(kinds) - {"conv"})}
    gate = "head" if hf.req("use_attention_gate", bool) else None
    conv = short_conv_factory(hf, **kw)
    return [conv if k == "conv" else functools.partial(
        parts.attention_factory(hf, window=w, rope=ropes[k], qk_norm="head", output_gate=gate, **kw),
        qk_norm_eps=eps) for k, w in zip(kinds, parts.sliding_windows(hf, kinds), strict=True)]


def build_lfm3(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of an ``Lfm3Config`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, depth, eps = hf.req("hidden_size"), hf.req("num_hidden_layers"), hf.req("norm_eps", float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw)
    norm = parts.rms_norm(C, eps, **kw)
    sublayer = "both" if hf.req("use_sandwich_norm", bool) else "input"
    blocks = [parts.block(C, mixer, ffn, norm, sublayer_norm=sublayer) for mixer in _mixers(hf, kinds, eps, **kw)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


#: our pre-norms and, with ``use_sandwich_norm``, output norms <- transformers' (modeling 454-461)
NORMS = (("attn_norm", "operator_norm"), ("ffn_norm", "ffn_norm"))
SANDWICH = (("attn_out_norm", "post_operator_norm"), ("ffn_out_norm", "post_ffn_norm"))


def convert_lfm3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a LFM3 decoder and copy the weights (the head follows them): per layer ``i`` the
    short convolution (``layers.{i}.conv.``) or the attention (``layers.{i}.self_attn.``: q/k/v/o,
    ``q_norm``/``k_norm``, ``g_proj`` (in a saved folder ``gate_proj``) into the output gate), the
    SwiGLU ``feed_forward`` and the norms."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_lfm3, device=device, dtype=dtype)
    kinds = parts.layer_types(hf, model.depth, TYPES)
    conv_bias, bias = hf.req("conv_bias", bool), hf.req("attention_bias", bool)
    gate, norms = hf.req("use_attention_gate", bool), NORMS + (SANDWICH if hf.req("use_sandwich_norm", bool) else ())
    for i, kind in enumerate(kinds):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if kind == "conv":
            put_short_conv(plan, f"{o}attn.", f"{h}conv.", bias=conv_bias)
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias, qk_norm=True)
            if gate:  # saved folders name it gate_proj (transformers' conversion_mapping["lfm3"] renames it)
                name = "g_proj" if plan.src.has(f"{h}self_attn.g_proj.weight") else "gate_proj"
                plan.put(f"{o}attn.frontier.gate_proj.weight", f"{h}self_attn.{name}.weight")
        put_swiglu(plan, f"{o}ffn.", f"{h}feed_forward.")
        plan.put_pairs(o, h, norms, bias=False)
    return parts.finish(plan, model, head_size, final_norm="embedding_norm")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"lfm3": parts.Dispatch("LFM3", convert_lfm3, ("Lfm3ForCausalLM", "Lfm3Model"))}
