"""Zamba (``zamba``) -> :class:`~attnzoo.DecoderLM`: ``ZambaForCausalLM`` and ``ZambaModel``
(Zyphra's Zamba-7B v1).

Line numbers below are transformers 5.25's ``models/zamba/modeling_zamba.py`` /
``configuration_zamba.py``. Zamba is Zamba2's ancestor (:mod:`attnzoo.models.families.zamba2`,
whose layer, shared block and model classes are reused here): a stack of Mamba layers
``h' = h + mamba(norm(h))`` (modeling 749-799); at the ``"hybrid"`` layers of
``layers_block_type`` a shared transformer block runs first on ``[h | e]`` (the layer input beside
the token embeddings, width ``2C``), and its output through the layer's own ``linear`` is added to
``h`` before the Mamba layer's norm (modeling 802-855)::

    T  = linear(mlp(pre_ff_layernorm(attn(input_layernorm([h | e])))))   # no residuals inside
    h' = h + mamba(norm(h + T))

What differs from Zamba2:

* **One shared block, no adapters.** With ``tie_word_embeddings`` (the default) every hybrid layer
  uses the first hybrid layer's block (``_tied_weights_keys``, modeling 915-922; the tied copies
  must be equal in a state dict, saved folders keep one); untied, transformers' tying is off and
  every hybrid layer has a block of its own, as here. The MLP is ``down(act(gate(y)) * up(y))``
  (``hidden_act``, GELU by default; modeling 685-698), loaded as the block's fused ``gate_up_proj``
  (rows ``[gate; up]``).
* **The attention** (modeling 151-217) reads ``2C`` channels, has ``attention_head_dim`` heads
  (default ``2C / H``, config 99), GQA, no biases, **no positional encoding**, and the score scale
  ``(head_dim / 2) ** -0.5`` (modeling 171); ``o_proj`` writes ``C``.
* **The Mamba mixer is Mamba-1 with heads** (``ZambaMambaMixer``, modeling 486-682;
  :class:`ZambaMambaMixer` here, on :class:`~attnzoo.models.families.mamba1.Mamba1Mixer`):
  ``in_proj C -> 2I`` whose rows interleave ``x`` and the gate ``z`` (``view(B, -1, 2, N)``,
  modeling 583: row ``2c`` is ``x_c``, row ``2c + 1`` is ``z_c``; permuted to ``[x; z]`` at load),
  the causal depthwise ``conv1d`` then SiLU (``hidden_mamba_act``), then per head ``h`` of
  ``I / n_mamba_heads`` channels its own ``x_proj_weight[h] [R + 2N, I / n]`` (``[dt; B; C]``) and
  ``dt_proj_weight[h] [I / n, R]`` with ``dt_proj_bias`` (modeling 611-619), ``dt = softplus(.)``
  in float32, the selective scan per head with its own ``B`` / ``C`` (``A = -exp(A_log)``,
  ``D``), ``y * silu(z)``, ``out_proj``. The heads are the scan's ``B`` / ``C`` groups
  (:func:`attnzoo.selective_scan` with ``[B, n, N, T]``), so one scan serves them all.

The model is zamba2's :class:`~attnzoo.models.families.zamba2.Zamba2LM` (a ``LayerLoopLM`` handing
every layer the embeddings) of :class:`~attnzoo.models.families.zamba2.Zamba2Layer` layers; the
caches (the shared attention's KV cache per use and the mixer's state), packed sequences
(``cu_seqlens``, through the layers whole) and ``generate`` are ``DecoderLM``'s.

Padding: transformers zeroes a padded token's mixer input and the convolution's output (modeling
579, 598) as :class:`~attnzoo.models.families.mamba1.Mamba1Mixer` does; a padded token does not
decay the state here (transformers' does: only padding after a real token differs).

Config keys a ``config.json`` leaves out take ``ZambaConfig``'s defaults (:data:`DEFAULTS`);
``attention_head_dim``, ``attention_hidden_size``, ``mamba_dt_rank="auto"`` and an absent
``layers_block_type`` (``[m, m, hybrid]`` then hybrid where ``i % attn_layer_period ==
attn_layer_offset``, config 102-110) are derived as transformers derives them. Accepted without
effect on the outputs: ``use_mamba_kernels``, ``use_associative_scan`` (implementations of the
same scan), ``num_logits_to_keep``, the ``time_step_*`` initialisation ranges. Refused by name:
``hidden_mamba_act`` other than SiLU, ``attention_hidden_size`` other than ``2 * hidden_size``
(transformers' forward concatenates two ``C``-wide streams), layer types other than ``hybrid`` /
``mamba`` (``linear_attention``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.zamba2 as zamba2
from attnzoo._validate import check_int
from attnzoo.blocks import RMSNorm
from attnzoo.functional.recurrent.selective_scan import selective_scan
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.mamba1 import Mamba1Mixer
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.mamba2 import Mamba2
from attnzoo.nn.recurrent import wide
from attnzoo.variants import build_attention

__all__ = ["DEFAULTS", "DISPATCH", "ZambaMambaMixer", "build_zamba", "canonical", "convert_zamba"]

#: ``ZambaConfig``'s defaults of the keys read here (configuration_zamba 61-95), for a ``config.json``
#: that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "tie_word_embeddings": True, "hidden_size": 3712, "intermediate_size": 14848,
    "num_hidden_layers": 76, "num_attention_heads": 16, "num_key_value_heads": 16, "n_mamba_heads": 2,
    "hidden_act": "gelu", "hidden_mamba_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    "attention_dropout": 0.0, "attn_layer_period": 6, "attn_layer_offset": 4, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto", "mamba_conv_bias": True, "mamba_proj_bias": False,
}


class ZambaMambaMixer(Mamba1Mixer):
    """Zamba's Mamba-1 mixer with ``num_heads`` heads (transformers' ``ZambaMambaMixer``): Mamba-1's
    ``in_proj``, convolution, ``A_log``, ``D`` and ``out_proj`` (see :class:`Mamba1Mixer`), and per
    head its own ``x_proj`` and ``dt_proj`` over its ``I / num_heads`` channels.

    Args:
        dim, inner, state_size, dt_rank, conv_size, conv_bias, bias, device, dtype: as
            :class:`Mamba1Mixer` (``inner = mamba_expand * C``).
        num_heads: ``n_mamba_heads`` (dividing ``inner``).

    Weights: ``in_proj [2I, C]`` (rows ``[x; z]``), ``conv1d.weight [I, 1, K]``, ``x_proj_weight
    [n, R + 2N, I / n]`` (rows ``[dt; B; C]`` per head), ``dt_proj_weight [n, I / n, R]``,
    ``dt_proj_bias [n, I / n]``, ``A_log [I, N]``, ``D [I]``, ``out_proj [C, I]``.

    Shapes: ``forward(x [B, T, C]) -> [B, T, C]`` (the :class:`RecurrentMixer` protocol: key
    padding, the cache ``[B, I, N, 1]`` + the convolution's last inputs, ``cu_seqlens``).
    """

    def __init__(self, dim: int, inner: int, state_size: int, dt_rank: int, *, num_heads: int, conv_size: int = 4,
                 conv_bias: bool = True, bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, inner, state_size, dt_rank, conv_size=conv_size, conv_bias=conv_bias, bias=bias,
                         device=device, dtype=dtype)
        n = check_int(num_heads, "num_heads", owner="ZambaMambaMixer")
        if self.inner % n:
            raise ValueError(f"ZambaMambaMixer: num_heads ({n}) must divide inner ({self.inner})")
        self.mamba_heads, width, fk = n, self.inner // n, {"device": device, "dtype": dtype}
        del self.x_proj, self.dt_proj  # per head below
        bound = self.dt_rank ** -0.5
        self.x_proj_weight = nn.Parameter(torch.randn(n, self.dt_rank + 2 * self.state_size, width, **fk) * 0.02)
        self.dt_proj_weight = nn.Parameter(torch.empty(n, width, self.dt_rank, **fk).uniform_(-bound, bound))
        self.dt_proj_bias = nn.Parameter(torch.full((n, width), math.log(math.expm1(0.01)), **fk))

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        b, t, n = x.shape[0], x.shape[1], self.mamba_heads
        real = None if pad is None else pad[..., None].to(x.dtype)  # [B, T, 1]
        xs, z = self.in_proj(x if real is None else x * real).chunk(2, dim=-1)  # [B, T, I] each (modeling 579-583)
        xs, last = self.conv1d(xs, conv.get("conv1d"), cu)
        xs = F.silu(xs) if real is None else F.silu(xs) * real  # padded outputs zeroed (modeling 598)
        heads = xs.transpose(1, 2).reshape(b, n, -1, t)  # [B, n, I/n, T]
        params = torch.einsum("hrd,bhdt->bhrt", self.x_proj_weight, heads)  # [B, n, R + 2N, T] (modeling 611)
        dt, bb, cc = params.split([self.dt_rank, self.state_size, self.state_size], dim=2)
        dt = torch.einsum("hdr,bhrt->bhdt", self.dt_proj_weight, dt)  # [B, n, I/n, T]
        dt = F.softplus(wide(dt) + wide(self.dt_proj_bias)[..., None]).reshape(b, -1, t)  # [B, I, T]
        if pad is not None:  # a padded token neither writes nor decays the state
            dt = dt * pad[:, None, :].to(dt.dtype)
        s0 = None if state is None else state[..., 0]
        y, last_state = selective_scan(wide(xs).transpose(1, 2), dt, -wide(self.A_log).exp(), wide(bb), wide(cc),
                                       wide(self.D), wide(z).transpose(1, 2), initial_state=s0,
                                       return_last_state=True, cu_seqlens=cu, chunk_size=self.chunk_size)
        return self.out_proj(y.transpose(1, 2).to(x.dtype)), last_state[..., None], {"conv1d": last}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_heads={self.mamba_heads}"


# --------------------------------------------------------------------------- the config
def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (config 97-114): :data:`DEFAULTS` where a key is absent,
    ``attention_head_dim`` (``2C / H``), ``attention_hidden_size`` (``2C``), ``mamba_dt_rank``
    (``"auto"``: ``ceil(C / 16)``) and ``layers_block_type`` derived when absent."""
    out = hf.with_defaults(DEFAULTS)
    data, C, H = out.data, out.req("hidden_size"), out.req("num_attention_heads")
    depth = out.req("num_hidden_layers")
    if data.get("attention_head_dim") is None:
        data["attention_head_dim"] = 2 * C // H
    if data.get("attention_hidden_size") is None:
        data["attention_hidden_size"] = 2 * C
    if data.get("mamba_dt_rank") == "auto":
        data["mamba_dt_rank"] = math.ceil(C / 16)
    rank = data["mamba_dt_rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointFormatError(f"{hf.source}: key 'mamba_dt_rank' must be 'auto' or an integer >= 1, got {rank!r}")
    if data.get("layers_block_type") is None and data.get("layer_types") is None:
        period, offset = out.req("attn_layer_period"), out.req("attn_layer_offset")
        data["layers_block_type"] = ["linear_attention"] * 2 + ["hybrid"] + [
            "hybrid" if i % period == offset else "linear_attention" for i in range(depth - 3)]
    return out


def _mixer(hf: HFConfig, kw: dict[str, Any]) -> ZambaMambaMixer:
    C = hf.req("hidden_size")
    return ZambaMambaMixer(C, hf.req("mamba_expand") * C, hf.req("mamba_d_state"), hf.req("mamba_dt_rank"),
                           num_heads=hf.req("n_mamba_heads"), conv_size=hf.req("mamba_d_conv"),
                           conv_bias=hf.req("mamba_conv_bias", bool), bias=hf.req("mamba_proj_bias", bool), **kw)


def _uses(hf: HFConfig, count: int, kw: dict[str, Any]) -> list[zamba2.SharedTransformerUse]:
    """The ``count`` hybrid layers' uses of the shared block (one block when tied, else one each):
    its NoPE attention over ``2C`` (scale ``(head_dim / 2) ** -0.5``), the block's fused MLP and the
    layer's ``linear``."""
    C, H, D = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("attention_head_dim")
    s = {"C": C, "H": H, "Hkv": hf.get("num_key_value_heads", H), "D": D, "F": hf.req("intermediate_size")}
    tied = hf.get("tie_word_embeddings", True, bool)
    blocks = [zamba2.shared_block(hf, s, kw) for _ in range(min(count, 1) if tied else count)]
    uses = []
    for i in range(count):
        block = blocks[i % len(blocks)]
        attn = cast(MultiHeadAttention, build_attention(
            "mha", 2 * C, H, num_kv_heads=s["Hkv"], head_dim=D, bias=False, causal=True, rope=None,
            dropout=hf.get("attention_dropout", 0.0, float), scale=(D / 2) ** -0.5, **kw))
        attn.qkv_proj, attn.out_proj = block.qkv_proj, block.out_proj
        uses.append(zamba2.SharedTransformerUse(block, attn, cast(Any, block.gate_up_proj), nn.Linear(C, C, bias=False, **kw)))
    return uses


def build_zamba(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``ZambaConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    parts.unsupported_keys(hf, {"hidden_mamba_act": lambda v: v in ("silu", "swish")})
    V, C, depth = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers")
    if hf.req("attention_hidden_size") != 2 * C:
        raise hf.unsupported(f"attention_hidden_size={hf.req('attention_hidden_size')} (the shared block reads "
                             f"[h | e], 2 * hidden_size = {2 * C} channels)")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = zamba2.layer_kinds(hf, depth)
    uses = iter(_uses(hf, kinds.count("hybrid"), kw))
    blocks = [zamba2.Zamba2Layer(RMSNorm(C, eps, **kw), cast(Mamba2, _mixer(hf, kw)),
                          next(uses) if k == "hybrid" else None) for k in kinds]
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="none", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.get("tie_word_embeddings", True, bool), max_seq_len=parts.max_positions(hf))
    return zamba2.Zamba2LM(config=cfg, parts=DecoderParts(blocks=blocks, norm=RMSNorm(C, eps, **kw),
                                                   head=head_for(C, V, head_size, **kw)), **kw)


# --------------------------------------------------------------------------- the weights
def _interleaved(t: Tensor) -> Tensor:
    """``in_proj``'s rows ``[x_0, z_0, x_1, z_1, ...]`` (modeling 583) -> ``[x; z]``."""
    return torch.cat([t[0::2], t[1::2]])


def put_zamba_mamba(plan: Plan, ours: str, theirs: str, mixer: ZambaMambaMixer) -> None:
    """A :class:`ZambaMambaMixer` at ``ours`` from transformers' ``ZambaMambaMixer`` at ``theirs``."""
    inner, n = mixer.inner, mixer.mamba_heads
    plan.put(f"{ours}in_proj.weight", f"{theirs}in_proj.weight", _interleaved)
    if mixer.proj_bias:
        plan.put(f"{ours}in_proj.bias", f"{theirs}in_proj.bias", _interleaved)
    plan.put_pairs(ours, theirs, [("out_proj", "out_proj")], bias=mixer.proj_bias)
    plan.put_pairs(ours, theirs, [("conv1d", "conv1d")], bias=mixer.conv_bias)
    for name in ("x_proj_weight", "dt_proj_weight"):
        plan.put(f"{ours}{name}", f"{theirs}{name}")
    plan.put(f"{ours}dt_proj_bias", f"{theirs}dt_proj_bias", lambda t: t.reshape(n, inner // n))
    plan.put(f"{ours}A_log", f"{theirs}A_log", lambda t: t.reshape(inner, -1))
    plan.put(f"{ours}D", f"{theirs}D", lambda t: t.reshape(inner))


def _put_shared(plan: Plan, ours: str, theirs: str) -> None:
    """A shared block at ``ours`` from transformers' ``shared_transf`` at ``theirs``."""
    plan.put_cat(f"{ours}qkv_proj.weight", [f"{theirs}self_attn.{n}_proj.weight" for n in "qkv"])
    plan.put_cat(f"{ours}gate_up_proj.weight", [f"{theirs}feed_forward.{n}_proj.weight" for n in ("gate", "up")])
    plan.put_pairs(ours, theirs, [("attn_norm", "input_layernorm"), ("ffn_norm", "pre_ff_layernorm"),
                                  ("out_proj", "self_attn.o_proj"), ("down_proj", "feed_forward.down_proj")],
                   bias=False)


def _claim_tied_copy(plan: Plan, layer: int, source: int) -> None:
    """Mark as read layer ``layer``'s copy of layer ``source``'s shared block (each tensor must
    equal its source: ``tie_word_embeddings=True`` ties them)."""
    src = plan.src
    head = f"{src.prefix}layers.{layer}.shared_transf."
    for key in [k for k in src.sd if k.startswith(head)]:
        twin = f"{src.prefix}layers.{source}.shared_transf.{key[len(head):]}"
        if twin not in src.sd or not torch.equal(src.sd[key], src.sd[twin]):
            raise CheckpointFormatError(f"{key} differs from {twin}, the block it is tied to "
                                        f"(tie_word_embeddings=True ties the shared blocks)")
        src.used.add(key)


def convert_zamba(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a Zamba decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_zamba, device=device, dtype=dtype)
    blocks = cast(Sequence[zamba2.Zamba2Layer], model.blocks)
    for i, block in enumerate(blocks):
        o, h = f"blocks.{i}.", f"layers.{i}." if block.shared is None else f"layers.{i}.mamba_decoder."
        put_zamba_mamba(plan, f"{o}attn.", f"{h}mamba.", cast(ZambaMambaMixer, block.attn))
        plan.put(f"{o}attn_norm.weight", f"{h}input_layernorm.weight")
    for i, source, _ in zamba2.hybrid_sources(model):
        if source == i:
            _put_shared(plan, f"blocks.{i}.shared.block.", f"layers.{i}.shared_transf.")
        else:
            _claim_tied_copy(plan, i, source)
        plan.put(f"blocks.{i}.shared.linear.weight", f"layers.{i}.linear.weight")
    return parts.finish(plan, model, head_size, final_norm="final_layernorm")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"zamba": parts.Dispatch("Zamba", convert_zamba, ("ZambaForCausalLM", "ZambaModel"))}
