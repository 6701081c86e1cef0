"""HRM text (``hrm_text``) -> :class:`HrmTextLM`: ``HrmTextForCausalLM`` and ``HrmTextModel``.
Line numbers: transformers 5.25's ``models/hrm_text/modeling_hrm_text.py``.

The Hierarchical Reasoning Model's recurrence over two stacks of LLaMA-like layers, a low-level
``L`` stack and a high-level ``H`` stack of ``num_layers_per_stack`` layers each, every stack
ending in a weightless RMSNorm (235-262). With ``z_H`` the token embeddings times
``embedding_scale`` (default ``1 / initializer_range``) and ``z_L`` the learned ``z_L_init [C]``
(a frozen parameter, zeros at init; 368-374)::

    for each of the H_cycles:
        for each of the L_cycles:  z_L = L(z_L + z_H)
        z_H = H(z_H + z_L)
    last hidden state = z_H                               (no further norm)

Each layer (183-232): weightless RMSNorms before the attention and the MLP (float32, cast back),
multi-head attention (no GQA) of ``head_dim`` with RoPE and an element-wise sigmoid output gate
``gate_proj`` (``attention_bias`` on q/k/v/o/gate), a gated MLP (``mlp_bias``). Every *invocation*
of a layer has its own KV cache (transformers' slot ``layer_idx + cycle_offset``, 376-396;
``HrmTextLM.init_cache``). In training, as transformers, an H cycle back-propagates through its
last ``L_bp_cycles`` L cycles only (left-padded with 1s to ``H_cycles`` entries; the earlier ones
run under ``no_grad``); the outputs are the same either way.

``config.json``: ``num_hidden_layers`` is the per-stack count unless ``num_layers_per_stack`` is
set (transformers then rewrites ``num_hidden_layers`` to the number of invocations; configuration
128-137). transformers' ``token_type_ids`` (``prefix_lm``: a bidirectional prefix block) are an input
attnzoo's forward does not take: attnzoo's model is the causal one (transformers without them).

Refused by name: a ``hidden_act`` without a gated attnzoo MLP, ``pretraining_tp`` other than 1,
``H_cycles`` / ``L_cycles`` below 1, rope types attnzoo's rotary does not know.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._devices import cache_dtype
from attnzoo._validate import check_int
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.families.dense import WeightlessRMSNorm, finish_weightless
from attnzoo.models.hf._state import HFConfig, Plan, load_gate_up_into
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.parts import DecoderParts, ScaledEmbedding, head_for

__all__ = ["DEFAULTS", "DISPATCH", "HrmTextLM", "build_hrm_text", "canonical", "convert_hrm_text"]

#: ``HrmTextConfig``'s defaults of the keys read here (configuration 96-123) that a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    "head_dim": 128, "H_cycles": 2, "L_cycles": 3, "L_bp_cycles": [2],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


class HrmTextLM(LayerLoopLM):
    """The HRM recurrence (see the module docstring) over ``blocks``: the ``L`` stack's layers, then
    the ``H`` stack's (``2 P``).

    Args:
        cycles: ``(H_cycles, L_cycles)``.
        backprop: per H cycle, how many of its last L cycles back-propagate (``L_bp_cycles``
            left-padded with 1s).
        stack_norm: the weightless norm ending each stack.
        config, parts, device, dtype: as :class:`~attnzoo.models.loop.LayerLoopLM`.

    Buffer: ``z_L_init [C]``. Decode cache: one per layer invocation, ``H_cycles (L_cycles + 1) P``.
    Shapes: ``tokens [B, N] -> logits [B, N, V]``."""

    def __init__(self, *, cycles: tuple[int, int], backprop: list[int], stack_norm: nn.Module, config: DecoderConfig,
                 parts: DecoderParts, device: Any = None, dtype: Any = None) -> None:
        super().__init__(config=config, parts=parts, device=device, dtype=dtype)
        self.high_cycles, self.low_cycles = int(cycles[0]), int(cycles[1])
        self.backprop, self.stack_norm = [int(b) for b in backprop], stack_norm
        self.per_stack = len(self.blocks) // 2
        self.register_buffer("z_L_init", torch.zeros(config.dim, device=device, dtype=dtype))

    def _slots(self) -> list[int]:
        """The block of each cache slot: per H cycle, ``L_cycles`` passes of the L stack, then the H stack."""
        P = self.per_stack
        cycle = [j for _ in range(self.low_cycles) for j in range(P)] + [P + j for j in range(P)]
        return cycle * self.high_cycles

    @property
    def cache_layers(self) -> int:
        """One cache per layer invocation: ``H_cycles (L_cycles + 1) P``."""
        return self.high_cycles * (self.low_cycles + 1) * self.per_stack

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LayerCaches:
        """One decode cache per layer invocation (transformers' ``layer_idx + cycle_offset``)."""
        check_int(batch_size, "batch_size", "HrmTextLM.init_cache")
        check_int(max_len, "max_len", "HrmTextLM.init_cache")
        p = self.tok_emb.weight
        device, dtype = p.device if device is None else device, cache_dtype(p, dtype)
        return LayerCaches([self.blocks[j].init_cache(batch_size, max_len, device=device, dtype=dtype)
                            for j in self._slots()])

    def _stack(self, h: Tensor, stack: int, slot: int, kw: dict[str, Any], cache: LayerCaches | None) -> Tensor:
        """One pass of stack ``stack`` (0: L, 1: H) on ``h [B, N, C]``, its caches from slot ``slot``."""
        P = self.per_stack
        for j in range(P):
            h = self.blocks[stack * P + j](h, cache=None if cache is None else cache[slot + j], **kw)
        return self.stack_norm(h)

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x`` the scaled embeddings ``[B, N, C]``; returns ``z_H`` after the last H cycle."""
        kw = {"key_padding": key_padding, "positions": self.rotary_positions(positions, key_padding, past, x.shape[1],
                                                                             x.device)}
        high, low = x, self.z_L_init.to(x.dtype).expand_as(x)
        P, L = self.per_stack, self.low_cycles
        for hc in range(self.high_cycles):
            first_grad = L - (self.backprop[hc] if hc < len(self.backprop) else 1)
            for lc in range(L):
                with contextlib.nullcontext() if lc >= first_grad else torch.no_grad():
                    low = self._stack(low + high, 0, (hc * (L + 1) + lc) * P, kw, cache)
            high = self._stack(high + low, 1, (hc * (L + 1) + L) * P, kw, cache)
        return high

    def extra_repr(self) -> str:
        return f"H_cycles={self.high_cycles}, L_cycles={self.low_cycles}, layers_per_stack={self.per_stack}"


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: :data:`DEFAULTS`, ``num_layers_per_stack`` (the legacy
    ``num_hidden_layers`` when absent), ``embedding_scale`` (``1 / initializer_range`` when
    absent), ``L_bp_cycles`` left-padded to ``H_cycles``, as many key/value heads as query heads; the options attnzoo cannot reproduce
    refused by name."""
    out = hf.with_defaults(DEFAULTS)
    out.data.setdefault("num_layers_per_stack", out.req("num_hidden_layers"))
    out.data.setdefault("embedding_scale", 1.0 / out.req("initializer_range", float))
    out.data["num_key_value_heads"] = out.req("num_attention_heads")  # multi-head: a key of its own is ignored
    parts.unsupported_keys(out, {"H_cycles": lambda v: isinstance(v, int) and v >= 1,
                                 "L_cycles": lambda v: isinstance(v, int) and v >= 1})
    out.activation("hidden_act", parts.GATED, "silu")
    raw = out.req("L_bp_cycles", list)
    out.data["L_bp_cycles"] = [1] * max(0, out.req("H_cycles") - len(raw)) + raw
    return out


def _attention(make: Any, bias: bool) -> nn.Module:
    """``make()``, its element-wise output gate given the bias ``attention_bias`` gives transformers' ``gate_proj``."""
    module = make()
    gate = module.frontier.gate_proj
    if bias:
        gate.bias = nn.Parameter(torch.zeros(gate.out_features, device=gate.weight.device, dtype=gate.weight.dtype))
    return module


def build_hrm_text(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> HrmTextLM:
    """The model of an ``HrmTextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, H, _, D = parts.dims(hf)
    V, P, eps, kw = hf.req("vocab_size"), hf.req("num_layers_per_stack"), hf.req("rms_norm_eps", float), \
        {"device": device, "dtype": dtype}
    make = parts.attention_factory(hf, window=None, rope=parts.rotary(hf, parts.rope_params(hf), D),
                                   output_gate="element", **kw)
    attention = functools.partial(_attention, make, hf.req("attention_bias", bool))
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                          bias=hf.req("mlp_bias", bool), **kw)
    norm = functools.partial(WeightlessRMSNorm, C, eps)
    blocks = [parts.block(C, attention, ffn, norm) for _ in range(2 * P)]
    cfg = DecoderConfig(V, C, 2 * P, H, pos="rope", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.req("tie_word_embeddings", bool), max_seq_len=parts.max_positions(hf))
    embedding = ScaledEmbedding(V, C, scale=hf.req("embedding_scale", float), **kw)
    model_parts = DecoderParts(blocks=blocks, embedding=embedding, norm=nn.Identity(),
                               head=head_for(C, V, head_size, **kw))
    return HrmTextLM(cycles=(hf.req("H_cycles"), hf.req("L_cycles")), backprop=hf.req("L_bp_cycles", list),
                     stack_norm=norm(), config=cfg, parts=model_parts, **kw)


def _put_layer(plan: Plan, o: str, h: str, *, bias: bool, mlp_bias: bool) -> None:
    """One layer's gated attention and MLP (its norms have no weights). A saved folder keeps the
    checkpoint's fused names (transformers' ``conversion_mapping.py`` "hrm_text"): ``attn.gqkv_proj``
    (rows ``[gate; q; k; v]``), ``attn.o_proj``, ``mlp.gate_up_proj``; the biases under the module names."""
    fused = f"{h}attn.gqkv_proj.weight"
    if plan.src.has(fused):
        plan.put(f"{o}attn.frontier.gate_proj.weight", fused, lambda w: w[: w.shape[0] // 4])
        plan.put(f"{o}attn.qkv_proj.weight", fused, lambda w: w[w.shape[0] // 4:])
        if bias:
            plan.put_cat(f"{o}attn.qkv_proj.bias", [f"{h}self_attn.{n}_proj.bias" for n in "qkv"])
        plan.put_pairs(f"{o}attn.", f"{h}attn.", [("out_proj", "o_proj")], bias=bias)
        load_gate_up_into(plan, f"{o}ffn.", f"{h}mlp.gate_up_proj.weight")
        plan.put_pairs(f"{o}ffn.", f"{h}mlp.", [("down_proj", "down_proj")], bias=mlp_bias)
        for n in ("gate_proj", "up_proj") if mlp_bias else ():
            plan.put(f"{o}ffn.{n}.bias", f"{h}mlp.{n}.bias")
    else:
        parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias)
        plan.put(f"{o}attn.frontier.gate_proj.weight", f"{h}self_attn.gate_proj.weight")
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.", bias=mlp_bias)
    if bias:
        plan.put(f"{o}attn.frontier.gate_proj.bias", f"{h}self_attn.gate_proj.bias")


def convert_hrm_text(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> HrmTextLM:
    """Build the model and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_hrm_text, device=device, dtype=dtype)
    P = hf.req("num_layers_per_stack")
    bias, mlp_bias = hf.req("attention_bias", bool), hf.req("mlp_bias", bool)
    for s, stack in enumerate(("L_module", "H_module")):
        for j in range(P):
            _put_layer(plan, f"blocks.{s * P + j}.", f"{stack}.layers.{j}.", bias=bias, mlp_bias=mlp_bias)
    plan.put("z_L_init", "z_L_init")
    return finish_weightless(hf, plan, model, head_size)  # type: ignore[return-value]


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"hrm_text": parts.Dispatch("HRM-text", convert_hrm_text, ("HrmTextForCausalLM", "HrmTextModel"))}
