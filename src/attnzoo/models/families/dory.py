"""Dory (NVIDIA Nemotron-Labs Dory 1.0) -> :class:`~attnzoo.DecoderLM`: ``DoryForCausalLM`` and
``DoryModel`` (``model_type="dory"``), a row of ``families/sparse_moe.py`` (``Variant.own``) that
builds and converts here.

Line numbers: transformers 5.25, ``models/dory/modeling_dory.py`` (m.) and
``configuration_dory.py`` (c.). An nGPT decoder (every hidden state on the unit sphere) whose middle
layers run several times:

* **L2 norms** (``DoryL2Norm``, m. 48-60; :func:`l2_norm`): ``x / sqrt(sum(x^2) + 1e-6)`` over the
  last axis, in float32, without weights.
* **Attention** (``DoryAttention``, m. 213-300; :class:`DoryAttention`): GQA with biases by
  ``attention_bias``; q and k L2-normed per head, RoPE per layer kind (``rope_parameters[kind]``,
  default thetas 1e4 sliding / 1e7 full), the queries then times ``(sqk * sqrt(D) / init) ** 2`` per
  channel (``init``: ``initializer_range``), score scale ``D ** -0.5``, a window of
  ``sliding_window - 1`` keys on ``sliding_attention`` layers (default: full every fourth, c. 85-88);
  the output gated element-wise by ``sigmoid(gate_proj(x) * (s_gate * C ** 0.25 / init) ** 2)``
  (:class:`ScaledOutputGate`), L2-normed over all heads (``attn_sub_norm``), then ``o_proj``.
* **MLP** (``DoryMLP``, m. 302-320; :class:`DoryMLP`): ``down(l2(act(gate(x) * suv_gate * sqrt(C)) *
  up(x) * suv_up * sqrt(C)))``, biases by ``mlp_bias``.
* **Layer** (``DoryDecoderLayer``, m. 322-365; :class:`DoryLayer`): ``h = l2(x)``, ``h = h + |lambda_1
  a| (l2(attn(h)) - h)``, ``h = l2(h)``, ``h + |lambda_2 a| (l2(mlp(h)) - h)`` with ``a =
  ngpt_alpha_init / init``.
* **Loops** (m. 510-560; :class:`DoryLM`, a :class:`~attnzoo.models.loop.LayerLoopLM`): the
  ``n_input_layers`` once; ``s = l2(h)``; ``n_recurrent_loops`` times ``h = l2(h) + s`` then the
  ``n_recurrent_layers``; the ``n_output_layers`` once; the final norm is an L2 norm. Decode caches:
  ``recurrent_kv_cache_mode="per_loop"`` one KV cache per recurrent layer and loop;
  ``"last_loop"`` one per recurrent layer, written by the last loop only (the earlier loops attend
  to its past and their own new tokens; :meth:`DoryLayer.forward` writes and rolls back). Without a
  cache both modes are the same model; with one, ``"last_loop"`` is transformers' approximation
  (its cached decode differs from its full forward), reproduced as transformers computes it.
  Packed sequences run one at a time.
* **Head** (``DoryLMHead``, m. 367-380; :class:`DoryHead`): the logits times
  ``logit_scale / init`` per vocabulary entry, in float32 (rounded to the model's dtype here).
* **Config** (c. 72-95): ``config.json`` lists each layer as an attention block and an ``"mlp"``
  block (``layer_types`` and the layer counts doubled); read as transformers reads it (the counts
  halved, their defaults too). Saved folders (``backbone.``, ``embeddings``, ``g_proj``) and the
  released two-block layout (``layers.{2i}.mixer`` / ``layers.{2i+1}.mixer``, ``attn_alpha`` /
  ``mlp_alpha``; ``conversion_mapping.py`` 168-173) load too.

Refused by name: ``recurrent_kv_cache_mode`` other than ``"per_loop"`` / ``"last_loop"``, layer
kinds other than ``sliding_attention`` / ``full_attention``, activations without an attnzoo
equivalent.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import ACTIVATIONS
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.parts import DecoderParts, LMHead, head_for
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.cache import CacheList
from attnzoo.nn.packing import REFUSAL
from attnzoo.nn.parts import AttentionParts, OutputGate
from attnzoo.nn.positional import resolve_positions

__all__ = ["DEFAULTS", "DISPATCH", "DoryAttention", "DoryHead", "DoryLM", "DoryLayer", "DoryMLP", "L2Norm",
           "ScaledOutputGate", "build_dory", "canonical", "convert_dory", "l2_norm"]

TYPES = ("sliding_attention", "full_attention")
#: ``DoryConfig``'s defaults of the keys read here (c. 49-70), for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 8192,
    "initializer_range": 0.0177, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "sliding_window": 1024, "ngpt_alpha_init": 0.05, "n_input_layers": 8, "n_output_layers": 8,
    "n_recurrent_loops": 2, "recurrent_kv_cache_mode": "per_loop", "attention_dropout": 0.0,
}
#: ``__post_init__``'s RoPE bases per layer kind (c. 89-93)
THETAS = {"sliding_attention": 10_000.0, "full_attention": 10_000_000.0}
EPS = 1e-6  # DoryL2Norm's epsilon (m. 51)


def l2_norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, computed in float32 (float64 kept), rounded
    to ``x``'s dtype. Shapes: ``[..., C] -> [..., C]``."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.pow(2).sum(-1, keepdim=True) + EPS)).to(x.dtype)


class L2Norm(nn.Module):
    """:func:`l2_norm` as a module (no weights). Shapes: ``[..., C] -> [..., C]``."""

    def forward(self, x: Tensor) -> Tensor:
        return l2_norm(x)


class ScaledOutputGate(OutputGate):
    """Dory's element-wise output gate: ``sigmoid(gate_proj(x) * (s_gate * scale) ** 2)``, ``s_gate
    [H D]`` (``scale = C ** 0.25 / initializer_range``). Shapes: as :class:`~attnzoo.nn.parts.OutputGate`."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, scale: float) -> None:
        super().__init__(dim, num_heads, head_dim, "element")
        self.s_gate = nn.Parameter(torch.ones(num_heads * head_dim))
        self.scale = float(scale)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * (self.s_gate * self.scale).square()  # [B, N, H D]


class DoryAttention(MultiHeadAttention):
    """Dory's attention (module docstring): q/k L2-normed per head, rotated, the queries times
    ``(sqk * sqk_scale) ** 2`` (``sqk [H D]``); the gated output L2-normed over all heads before
    ``out_proj``. Its ``parts`` hold the :class:`ScaledOutputGate`.

    Shapes: ``x [B, N, C] -> [B, N, C]``. Packed input: the model runs each sequence alone."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None, *,
                 bias: bool = False, window: int | None = None, rope: Any = None, dropout: float = 0.0,
                 parts: AttentionParts | None = None, sqk_scale: float) -> None:
        super().__init__(dim, num_heads, num_kv_heads, head_dim=head_dim, bias=bias, causal=True, window=window,
                         rope=rope, dropout=dropout, parts=parts)
        self.sqk = nn.Parameter(torch.ones(self.num_heads * self.head_dim))
        self.sqk_scale = float(sqk_scale)

    def _project_self(self, x: Tensor, positions: Tensor | None, start: int, *,
                      rotate: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]`` (normed, rotated, scaled), ``k [B, Hkv, N, D]`` (normed, rotated), ``v``."""
        if not rotate:
            raise ValueError("DoryAttention: the query scale follows the rotation; no unrotated keys (a sink cache)")
        q, k, v = self.project_qkv(x)
        pos = resolve_positions(positions, x.shape[1], start, x.device, batch=x.shape[0])
        q, k = self._rotate(l2_norm(q), pos), self._rotate(l2_norm(k), pos)
        return q * (self.sqk * self.sqk_scale).view(-1, 1, self.head_dim).square(), k, v

    def merge_heads(self, out: Tensor) -> Tensor:
        """``[B, H, N, Dv]`` (gated) -> ``out_proj(l2([B, N, H Dv]))``."""
        B, H, N, Dv = out.shape
        return self.out_proj(l2_norm(out.transpose(1, 2).reshape(B, N, H * Dv)))  # [B, N, C]

    def _packed(self, x: Tensor, cu_seqlens: object, context: object, mask: object, cache: object,
                positions: object, return_weights: bool) -> Tensor:
        raise ValueError(f"DoryAttention: {REFUSAL} runs one sequence at a time (the model's layer loop)")


class DoryMLP(nn.Module):
    """Dory's MLP: ``down(l2(act(gate(x) * suv_gate * s) * up(x) * suv_up * s))``, ``s = sqrt(C)``.
    Shapes: ``[B, N, C] -> [B, N, C]``."""

    def __init__(self, dim: int, hidden: int, act: Callable[[Tensor], Tensor], *, bias: bool, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=bias, **kw), nn.Linear(dim, hidden, bias=bias, **kw)
        self.down_proj = nn.Linear(hidden, dim, bias=bias, **kw)
        self.suv_gate, self.suv_up = nn.Parameter(torch.ones(hidden, **kw)), nn.Parameter(torch.ones(hidden, **kw))
        self.act, self.scale = act, dim ** 0.5

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x) * (self.suv_gate * self.scale)
        up = self.up_proj(x) * (self.suv_up * self.scale)
        return self.down_proj(l2_norm(self.act(gate) * up))


class DoryLayer(nn.Module):
    """One Dory layer (module docstring): the residual interpolates towards the L2-normed updates at
    the rates ``|lambda_1 * scale|``, ``|lambda_2 * scale|`` (``[C]`` each). ``uses``: the decode caches
    it holds (one per loop for a ``per_loop`` recurrent layer).

    Shapes: ``x [B, N, C] -> [B, N, C]``."""

    def __init__(self, attention: DoryAttention, mlp: DoryMLP, *, scale: float, uses: int = 1) -> None:
        super().__init__()
        C = attention.dim
        self.attn, self.mlp = attention, mlp
        w = attention.out_proj.weight
        self.lambda_1 = nn.Parameter(torch.ones(C, device=w.device, dtype=w.dtype))
        self.lambda_2 = nn.Parameter(torch.ones(C, device=w.device, dtype=w.dtype))
        self.scale, self.uses = float(scale), int(uses)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        """The attention's cache, or a :class:`~attnzoo.nn.cache.CacheList` of ``uses`` of them."""
        caches = [self.attn.init_cache(batch_size, max_len, device=device, dtype=dtype) for _ in range(self.uses)]
        return caches[0] if self.uses == 1 else CacheList(caches)

    def forward(self, x: Tensor, *, key_padding: Tensor | None = None, cache: Any = None,
                positions: Tensor | None = None, read_only: bool = False) -> Tensor:
        """``x [B, N, C]``; ``key_padding [B, past + N]`` bool; ``read_only``: attend to the cached past
        and the new tokens without keeping them (a ``last_loop`` loop before the last)."""
        h = l2_norm(x)
        mask = None if key_padding is None else key_padding[:, None, None, :]
        mark = cache.mark() if read_only and cache is not None else None
        a = l2_norm(self.attn(h, mask=mask, cache=cache, positions=positions))
        if mark is not None:
            cache.rollback(mark)
        h = l2_norm(h + (self.lambda_1 * self.scale).abs() * (a - h))
        return h + (self.lambda_2 * self.scale).abs() * (l2_norm(self.mlp(h)) - h)


class DoryHead(LMHead):
    """Dory's LM head: ``(x W^T) * logit_scale * factor`` in float32 (``logit_scale [V]``, ``factor =
    1 / initializer_range``), rounded to ``x``'s dtype. Shapes: ``[B, N, C] -> [B, N, V]``."""

    def __init__(self, dim: int, vocab_size: int, *, factor: float, device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, vocab_size, device=device, dtype=dtype)
        self.logit_scale = nn.Parameter(torch.ones(vocab_size, device=device, dtype=dtype))
        self.factor = float(factor)

    def forward(self, x: Tensor) -> Tensor:
        return (super().forward(x).float() * (self.logit_scale.float() * self.factor)).to(x.dtype)


class DoryLM(LayerLoopLM):
    """Dory's decoder: the input layers, ``loops`` passes through the recurrent layers (each from
    ``l2(h) + l2(input section's output)``), the output layers (module docstring). ``sections``:
    ``(n_input, n_recurrent, loops)``; ``last_loop``: the recurrent layers' caches kept by the last
    loop only. Packed sequences run one at a time."""

    sections: tuple[int, int, int] = (0, 0, 1)
    last_loop: bool = False

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x [B, N, C]`` (the embeddings) -> ``[B, N, C]`` before the final L2 norm."""
        positions = self.rotary_positions(positions, key_padding, past, x.shape[1], x.device)
        n_in, n_rec, loops = self.sections

        def step(i: int, h: Tensor, loop: int | None = None) -> Tensor:
            c = None if cache is None else cache[i]
            read_only = loop is not None and self.last_loop and loop < loops - 1
            if c is not None and loop is not None and not self.last_loop:
                c = c.layers[loop]
            return self.blocks[i](h, key_padding=key_padding, cache=c, positions=positions, read_only=read_only)

        h = x
        for i in range(n_in):
            h = step(i, h)
        start = l2_norm(h)
        for loop in range(loops):
            h = l2_norm(h) + start
            for i in range(n_in, n_in + n_rec):
                h = step(i, h, loop)
        for i in range(n_in + n_rec, len(self.blocks)):
            h = step(i, h)
        return h

    def extra_repr(self) -> str:
        return f"sections={self.sections}, last_loop={self.last_loop}"


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` with :data:`DEFAULTS`, its doubled two-block layout (``"mlp"`` entries in
    ``layer_types``) collapsed as transformers' ``__post_init__`` does (c. 72-80: the counts halved,
    their defaults too), ``layer_types`` and ``rope_parameters`` defaulted, the sections checked."""
    data = hf.with_defaults(DEFAULTS).data
    kinds = data.get("layer_types")
    if isinstance(kinds, list) and "mlp" in kinds:
        data["layer_types"] = kinds[::2]
        for key in ("num_hidden_layers", "n_input_layers", "n_output_layers", "n_recurrent_layers"):
            if isinstance(data.get(key), int):
                data[key] //= 2
    depth = HFConfig(data, hf.source, hf.arch).req("num_hidden_layers")
    data["layer_types"] = parts.layer_types(HFConfig(data, hf.source, hf.arch), depth, TYPES,
                                            default=[TYPES[(i + 1) % 4 == 0] for i in range(depth)])
    if data.get("n_recurrent_layers") is None:
        data["n_recurrent_layers"] = depth - data["n_input_layers"] - data["n_output_layers"]
    if not data.get("rope_parameters"):
        data["rope_parameters"] = {k: {"rope_type": "default", "rope_theta": THETAS[k]} for k in set(data["layer_types"])}
    out = HFConfig(data, hf.source, hf.arch)
    n_in, n_rec, n_out = (out.req(k) for k in ("n_input_layers", "n_recurrent_layers", "n_output_layers"))
    if min(n_in, n_rec, n_out) < 0 or n_in + n_rec + n_out != depth or out.req("n_recurrent_loops") < 1:
        raise CheckpointFormatError(f"{hf.source}: n_input_layers + n_recurrent_layers + n_output_layers "
                                    f"({n_in} + {n_rec} + {n_out}) must be num_hidden_layers ({depth}) and "
                                    f"n_recurrent_loops >= 1")
    mode = out.req("recurrent_kv_cache_mode", str)
    if mode not in ("per_loop", "last_loop"):
        raise hf.unsupported(f"recurrent_kv_cache_mode={mode!r} (supported: 'per_loop', 'last_loop')")
    return out


def _attention(C: int, H: int, settings: dict[str, Any], scales: tuple[float, float], device: Any,
               dtype: Any) -> DoryAttention:
    """A :class:`DoryAttention` of ``settings`` with its gate (``scales``: the gate's, the queries')."""
    D = settings["head_dim"]
    with contextlib.nullcontext() if device is None else torch.device(device):
        gate = AttentionParts(output_gate=ScaledOutputGate(C, H, D, scale=scales[0]))
    return build_softmax(DoryAttention, C, H, parts=gate, sqk_scale=scales[1], device=device, dtype=dtype,
                         **settings)  # type: ignore[return-value]


def build_dory(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``DoryConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, H, depth, D = parts.dims(hf)
    V, init, kw = hf.req("vocab_size"), hf.req("initializer_range", float), {"device": device, "dtype": dtype}
    kinds, n_in, n_rec = hf.req("layer_types", list), hf.req("n_input_layers"), hf.req("n_recurrent_layers")
    loops, last = hf.req("n_recurrent_loops"), hf.req("recurrent_kv_cache_mode", str) == "last_loop"
    act = ACTIVATIONS[hf.activation("hidden_act", parts.GATED, "silu")][0]
    ropes = {k: parts.rotary(hf, parts.rope_params(hf, k), D) for k in set(kinds)}
    blocks = []
    for i, (kind, window) in enumerate(zip(kinds, parts.sliding_windows(hf, kinds), strict=True)):
        settings = {"num_kv_heads": hf.get("num_key_value_heads", H), "head_dim": D, "window": window,
                    "bias": hf.req("attention_bias", bool), "rope": ropes[kind],
                    "dropout": hf.get("attention_dropout", 0.0, float)}
        attn = _attention(C, H, settings, (C ** 0.25 / init, D ** 0.5 / init), device, dtype)
        mlp = DoryMLP(C, hf.req("intermediate_size"), act, bias=hf.req("mlp_bias", bool), **kw)
        uses = loops if n_in <= i < n_in + n_rec and not last else 1
        blocks.append(DoryLayer(attn, mlp, scale=hf.req("ngpt_alpha_init", float) / init, uses=uses))
    cfg = DecoderConfig(V, C, depth, H, pos="rope", norm="rms", tie_embeddings=hf.req("tie_word_embeddings", bool),
                        max_seq_len=parts.max_positions(hf))
    head = DoryHead(C, V, factor=1 / init, **kw) if head_size is None else head_for(C, V, head_size, **kw)
    model = DoryLM(config=cfg, parts=DecoderParts(blocks=blocks, norm=L2Norm(), head=head), **kw)
    model.sections, model.last_loop = (n_in, n_rec, loops), last
    return model


#: the released checkpoints' layer pairs (``layers.{2i}`` attention, ``layers.{2i+1}`` MLP; the rates)
_PAIR = re.compile(r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")
#: a saved folder's names -> the module's (``conversion_mapping.py`` 168-173)
_SAVED = tuple((re.compile(p), r) for p, r in (
    (r"^backbone\.", "model."), (r"(^|\.)embeddings\.", r"\1embed_tokens."), (r"\.self_attn\.g_proj\.", ".self_attn.gate_proj.")))


def _pair_name(m: re.Match[str]) -> str:
    index, name = int(m.group(1)), m.group(2)
    return f"layers.{index // 2}.{ {'attn_alpha': 'lambda_1', 'mlp_alpha': 'lambda_2'}.get(name, ('self_attn', 'mlp')[index % 2])}"


def _module_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` under transformers' module names (saved folders' and the released layout's renamed)."""
    out = {}
    for key, t in sd.items():
        key = _PAIR.sub(_pair_name, key)
        for pattern, repl in _SAVED:
            key = pattern.sub(repl, key)
        out[key] = t
    return out


def _put_layer(plan: Plan, i: int, hf: HFConfig) -> None:
    o, h = f"blocks.{i}.", f"layers.{i}."
    parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.req("attention_bias", bool))
    plan.put_pairs(f"{o}attn.frontier.", f"{h}self_attn.", [("gate_proj", "gate_proj")], bias=False)
    plan.put(f"{o}attn.frontier.gate_proj.s_gate", f"{h}self_attn.s_gate")
    plan.put(f"{o}attn.sqk", f"{h}self_attn.sqk")
    parts.put_mlp(plan, f"{o}mlp.", f"{h}mlp.", bias=hf.req("mlp_bias", bool))
    for ours, theirs in (("mlp.suv_gate", "mlp.suv_gate"), ("mlp.suv_up", "mlp.suv_up"), ("lambda_1", "lambda_1"),
                         ("lambda_2", "lambda_2")):
        plan.put(f"{o}{ours}", f"{h}{theirs}")


def convert_dory(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; no norm weights)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, _module_names(sd), build_dory, device=device, dtype=dtype)
    for i in range(model.depth):
        _put_layer(plan, i, hf)
    patterns = [r"(model\.)?rotary_emb\w*\.\w+"]
    parts.put_head(plan, head_size, model.tie_embeddings, patterns)
    if head_size is None:
        plan.put("lm_head.logit_scale", "lm_head.logit_scale")
    plan.apply(model, ignore=patterns)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"dory": parts.Dispatch("Dory", convert_dory, ("DoryForCausalLM", "DoryModel"))}
