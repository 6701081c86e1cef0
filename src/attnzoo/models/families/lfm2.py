"""LFM2 (``lfm2``) -> :class:`~attnzoo.DecoderLM`: ``Lfm2ForCausalLM`` and ``Lfm2Model``; and
LFM2-MoE (``lfm2_moe``): ``Lfm2MoeForCausalLM`` and ``Lfm2MoeModel`` (below).

Liquid AI's LFM2 (transformers ``models/lfm2``; line numbers below are ``modeling_lfm2.py`` /
``configuration_lfm2.py`` of transformers 5.25). Every layer is pre-norm (modeling 418-461):
``x + mixer(operator_norm(x))``, then ``x + feed_forward(ffn_norm(x))``; the mixer is chosen by
``layer_types`` (``"conv"`` or ``"full_attention"``; config 81-88: from ``full_attn_idxs`` when
absent, every layer attention when both are):

* ``"conv"``: :class:`Lfm2ShortConvMixer` (modeling 370-415): ``in_proj`` ``C -> 3C`` chunked
  into ``B, C, x``; ``B * x`` through a causal depthwise conv1d of kernel ``conv_L_cache`` with
  NO activation; ``C * conv``, then ``out_proj``. ``conv_bias`` puts a bias on all three. At a
  padded token transformers zeroes the mixer's *input* (``apply_mask_to_padding_states`` before
  ``in_proj``, modeling 261-270, 405), so with ``conv_bias`` a padded token feeds
  ``b_B * b_x`` (not zeros) to the convolution; this is reproduced as is.
* ``"full_attention"``: causal GQA (modeling 201-258) with per-head RMSNorm of q and k over
  ``head_dim`` (``q_layernorm``/``k_layernorm``, eps ``norm_eps``, before RoPE), RoPE on the whole
  head, no biases, output ``out_proj``.
* Feed-forward (modeling 111-128): SwiGLU ``w2(silu(w1 x) * w3 x)`` (w1 gate, w3 up, w2 down);
  with ``block_auto_adjust_ff_dim`` the width is ``int(2 * intermediate_size / 3)``, then (unless
  ``block_ffn_dim_multiplier`` is ``None``) times the multiplier and rounded up to a multiple of
  ``block_multiple_of`` (:func:`ff_dim`).
* Plain ``weight * x`` RMSNorms (modeling 44-62), eps ``norm_eps``; final norm
  ``embedding_norm``; tied embeddings by default.

Config keys are read as transformers reads them (:func:`canonical`): the legacy ``block_ff_dim``
and ``tie_embedding`` override ``intermediate_size`` / ``tie_word_embeddings`` (config 90-91), and
keys a ``config.json`` leaves out take ``Lfm2Config``'s defaults (:data:`DEFAULTS`, config 58-79).

LFM2-MoE (transformers ``models/lfm2_moe``; line numbers ``modeling_lfm2_moe.py`` /
``configuration_lfm2_moe.py`` of 5.25) is the same stack (the same short-conv mixer, modeling
455-500, and QK-normed attention, modeling 286-343; the same pre-norm layer, modeling 503-550;
``layer_types`` entries ``"conv"`` / ``"full_attention"``, the two masks of modeling 637-640)
whose feed-forward depends on the layer (modeling 512-516):

* layers ``i < num_dense_layers``: the SwiGLU ``w1``/``w3``/``w2`` of width ``intermediate_size``
  as given (``Lfm2MoeMLP``, modeling 118-128: LFM2's ``block_auto_adjust_ff_dim`` does not apply,
  the config has no ``block_*`` keys);
* the others: a :class:`~attnzoo.nn.moe.MixtureOfExperts` (``Lfm2MoeSparseMoeBlock``, modeling
  171-213): router ``gate.weight [E, C]``, scores ``sigmoid(logits)``; with ``use_expert_bias``
  the ``k`` experts of largest ``sigmoid + expert_bias`` (``expert_bias [E]``, a float32 buffer:
  our ``score_bias``) keep their sigmoid, else the ``k`` largest sigmoids (a zero ``score_bias``);
  ``norm_topk_prob`` divides them by their sum ``+ 1e-6`` (``Routing(norm_eps=1e-6)``), then
  ``routed_scaling_factor`` multiplies them; SwiGLU experts ``experts.gate_up_proj [E, 2I, C]``
  (rows ``[gate; up]``) and ``experts.down_proj [E, C, I]`` (``I = moe_intermediate_size``;
  ``Lfm2MoeExperts``, modeling 131-168), no shared expert. Saved folders hold one tensor per expert instead,
  ``experts.{e}.w1/w3/w2.weight`` (transformers' ``conversion_mapping`` stacks them on load and
  splits them on save): both load.

Its config (:func:`canonical_moe`) takes ``Lfm2MoeConfig``'s defaults (:data:`MOE_DEFAULTS`,
config 65-90) and folds ``tie_embedding`` in (config 92-94), but reads none of LFM2's other legacy
keys (``block_ff_dim``, ``full_attn_idxs``): ``layer_types`` is required, as transformers indexes
it per layer (modeling 506; ``None`` fails there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_moe
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.recurrent import RecurrentMixer, ShortConv

__all__ = ["DEFAULTS", "DISPATCH", "MOE_DEFAULTS", "Lfm2ShortConvMixer", "build_lfm2", "build_lfm2_moe", "canonical",
           "canonical_moe", "convert_lfm2", "convert_lfm2_moe", "ff_dim", "moe_factory", "put_lfm2_moe",
           "put_short_conv", "put_swiglu", "short_conv_factory"]

TYPES = ("conv", "full_attention")

#: ``Lfm2Config``'s defaults of the keys read here (config 58-79; ``rope_theta``: ``default_theta``,
#: config 56), for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128_000, "norm_eps": 1e-5,
    "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "conv_bias": False, "conv_L_cache": 3,
    "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
}

#: ``Lfm2MoeConfig``'s defaults of the keys read here (configuration_lfm2_moe 65-90; ``rope_theta``:
#: ``default_theta``, 63)
MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
    "num_hidden_layers": 32, "max_position_embeddings": 128_000, "norm_eps": 1e-5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "conv_bias": False,
    "conv_L_cache": 3, "num_dense_layers": 2, "num_experts_per_tok": 4, "num_experts": 32, "use_expert_bias": True,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True,
}

#: ``Lfm2MoeTopKRouter``'s ``sum + 1e-6`` under ``norm_topk_prob`` (modeling 192-193)
MOE_NORM_EPS = 1e-6

#: the SwiGLU projections, ours and transformers' (``w1`` gate, ``w3`` up, ``w2`` down): the dense
#: MLPs' names, and each expert's in a saved LFM2-MoE folder (``conversion_mapping["lfm2_moe"]``)
SWIGLU = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


class Lfm2ShortConvMixer(RecurrentMixer):
    """LFM2's gated short-convolution mixer (transformers' ``Lfm2ShortConv``).

    ``y = out_proj(C * conv(B * x))`` with ``[B | C | x] = in_proj(h)``, ``conv`` a causal
    depthwise convolution of kernel ``conv_size`` over tokens (no activation).

    Args:
        dim: model width ``C``.
        conv_size: the kernel (``conv_L_cache``), >= 1.
        bias: biases on ``in_proj``, the convolution and ``out_proj`` (``conv_bias``).
        device, dtype: of the parameters.

    Weights: ``in_proj [3C, C]`` (rows ``[B; C; x]``), ``conv.weight [C, 1, K]``
    (:class:`~attnzoo.nn.recurrent.ShortConv`: ``nn.Conv1d``'s layout), ``out_proj [C, C]``.

    The attention protocol of :class:`~attnzoo.nn.recurrent.RecurrentMixer`: ``forward(x, *,
    mask=, cache=, positions=, cu_seqlens=)``. Key padding zeroes the padded tokens of the input
    (before ``in_proj``, as transformers does: with ``bias`` those tokens feed the convolution
    ``b_B * b_x``, without it zeros, and a left-padded row then equals the row alone); packed
    sequences (``cu_seqlens``) each restart the convolution from zeros.

    Decode cache: a :class:`~attnzoo.nn.recurrent.RecurrentCache` whose convolution entry
    ``"conv" [B, C, K - 1]`` (the last inputs ``B * x``) is the whole memory of the layer. The
    mixer has no recurrent state, but the cache protocol carries one (the cache is built from
    ``state_shape`` and :meth:`RecurrentCache.update` checks the state's shape), so
    ``state_shape`` is the smallest one, ``(1, 1, 1)`` (4 bytes a row), passed through unchanged.
    """

    def __init__(self, dim: int, conv_size: int = 3, *, bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        dim = check_int(dim, "dim", owner="Lfm2ShortConvMixer")
        # one "head" of width dim, layout "qkv": the base makes qkv_proj [3C, C] and out_proj [C, C]
        # (the base's checks read out_proj); qkv_proj is LFM2's in_proj, renamed
        super().__init__(dim, 1, head_dim=dim, bias=bias, layout="qkv", factory=fk)
        self.in_proj = self.qkv_proj
        del self.qkv_proj
        self.conv_bias = bias
        self.conv_size = check_int(conv_size, "conv_size", owner="Lfm2ShortConvMixer")
        self.conv = ShortConv(dim, self.conv_size, bias, fk)
        self.conv_channels = {"conv": dim}
        self.state_shape = (1, 1, 1)

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        if pad is not None:  # transformers zeroes the input of a padded token (modeling 405); where: a NaN stays out
            x = torch.where(pad[..., None], x, x.new_zeros(()))
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # [B, N, C] each (modeling 406-407)
        y, last = self.conv(b * h, conv.get("conv"), cu)  # no activation (modeling 410)
        if state is None:
            state = x.new_zeros(x.shape[0], *self.state_shape)
        return self.out_proj(c * y), state, {"conv": last}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, conv_size={self.conv_size}, bias={self.conv_bias}"


def _read(hf: HFConfig, defaults: Mapping[str, Any]) -> HFConfig:
    """What both configs read alike: ``defaults`` where a key is absent, ``tie_embedding`` folded
    into ``tie_word_embeddings``, and the attention's options the modeling fixes made explicit (no
    biases, no dropout: modeling 213-216, 252)."""
    data = hf.with_defaults(defaults).data
    if hf.data.get("tie_embedding") is not None:
        data["tie_word_embeddings"] = hf.data["tie_embedding"]
    data.update(attention_bias=False, attention_dropout=0.0)
    return HFConfig(data, hf.source, hf.arch)


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads an ``Lfm2Config``: :data:`DEFAULTS` where a key is absent, the
    legacy keys ``block_ff_dim`` / ``tie_embedding`` folded in (config 90-91), ``layer_types`` set
    (from ``full_attn_idxs``, else every layer attention; config 81-88), no attention biases or
    dropout."""
    out = _read(hf, DEFAULTS)
    if "block_ffn_dim_multiplier" in hf.data and hf.data["block_ffn_dim_multiplier"] is None:
        out.data["block_ffn_dim_multiplier"] = None  # None skips the multiplier and the rounding (modeling 118)
    if hf.data.get("block_ff_dim") is not None:
        out.data["intermediate_size"] = hf.data["block_ff_dim"]
    if out.get("layer_types", None, list) is None:
        depth = out.req("num_hidden_layers")
        idxs = out.get("full_attn_idxs", list(range(depth)), list)
        out.data["layer_types"] = ["full_attention" if i in idxs else "conv" for i in range(depth)]
    return out


def canonical_moe(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads an ``Lfm2MoeConfig``: :data:`MOE_DEFAULTS` where a key is
    absent, ``tie_embedding`` folded in (config 92-94), no attention biases or dropout;
    ``layer_types`` required (see the module docstring)."""
    out = _read(hf, MOE_DEFAULTS)
    out.req("layer_types", list)
    return out


def _size(hf: HFConfig, key: str) -> int:
    """The integer ``key``, which must be >= 1."""
    value = hf.req(key)
    if value < 1:
        raise CheckpointFormatError(f"{hf.source}: key {key!r} must be >= 1, got {value!r}")
    return int(value)


def ff_dim(hf: HFConfig) -> int:
    """The SwiGLU width of ``Lfm2MLP`` (modeling 114-122)."""
    width = hf.req("intermediate_size")
    if not hf.get("block_auto_adjust_ff_dim", True, bool):
        return int(width)
    width = int(2 * width / 3)
    if hf.raw("block_ffn_dim_multiplier") is None:
        return width
    multiple = hf.req("block_multiple_of")
    if multiple < 1:
        raise CheckpointFormatError(f"{hf.source}: key 'block_multiple_of' must be >= 1, got {multiple!r}")
    width = int(hf.req("block_ffn_dim_multiplier", float) * width)
    width = multiple * ((width + multiple - 1) // multiple)
    if width < 1:
        raise CheckpointFormatError(f"{hf.source}: the feed-forward width is {width} (intermediate_size "
                                    f"{hf.req('intermediate_size')}, block_ffn_dim_multiplier "
                                    f"{hf.raw('block_ffn_dim_multiplier')})")
    return width


def short_conv_factory(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> Callable[[], nn.Module]:
    """The factory of a ``"conv"`` layer's :class:`Lfm2ShortConvMixer`: kernel ``conv_L_cache``
    (>= 1, else named), biases by ``conv_bias`` (LFM2, LFM2-MoE and LFM3 alike)."""
    return functools.partial(Lfm2ShortConvMixer, hf.req("hidden_size"), _size(hf, "conv_L_cache"),
                             bias=hf.req("conv_bias", bool), device=device, dtype=dtype)


def _decoder(hf: HFConfig, ffns: Sequence[Callable[[], nn.Module]], *, head_size: int | None, device: Any,
             dtype: Any) -> DecoderLM:
    """The stack of a canonical config: layer ``i``'s mixer by ``layer_types``, its feed-forward
    from the factory ``ffns[i]``."""
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.req("norm_eps", float), {"device": device, "dtype": dtype}
    D = hf.get("head_dim", C // H)
    kinds = parts.layer_types(hf, depth, TYPES)
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    # the QK-norm's epsilon is norm_eps (modeling 217-218), not rms_norm_eps (attention_factory's)
    attention = functools.partial(parts.attention_factory(hf, window=None, rope=rope, qk_norm="head", **kw),
                                  qk_norm_eps=eps)
    conv = short_conv_factory(hf, **kw)
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, conv if k == "conv" else attention, ffn, norm) for k, ffn in zip(kinds, ffns, strict=True)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def build_lfm2(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of an ``Lfm2Config`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    ffn = parts.gated_mlp(hf.req("hidden_size"), ff_dim(hf), "swiglu", device=device, dtype=dtype)
    return _decoder(hf, [ffn] * hf.req("num_hidden_layers"), head_size=head_size, device=device, dtype=dtype)


def dense_layers(hf: HFConfig) -> int:
    """How many leading layers of an ``Lfm2MoeConfig`` are dense (``layer_idx < num_dense_layers``,
    modeling 512-516), in ``[0, num_hidden_layers]``."""
    return min(max(hf.req("num_dense_layers"), 0), hf.req("num_hidden_layers"))


def moe_factory(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> Callable[[], nn.Module]:
    """The factory of an LFM2-MoE sparse layer's :class:`MixtureOfExperts` (see the module
    docstring); a ``routed_scaling_factor`` that is not a finite positive number is refused by name."""
    E, k = _size(hf, "num_experts"), _size(hf, "num_experts_per_tok")
    if k > E:  # transformers' topk fails too
        raise CheckpointFormatError(f"{hf.source}: num_experts_per_tok={k} is more than num_experts={E}")
    scaling = hf.req("routed_scaling_factor", float)
    if not 0 < scaling < float("inf"):
        raise hf.unsupported(f"routed_scaling_factor={scaling!r} (attnzoo's routing scales by a finite positive "
                             f"factor)")
    routing = Routing("sigmoid_topk", norm_topk_prob=hf.req("norm_topk_prob", bool), scaling=scaling,
                      norm_eps=MOE_NORM_EPS)
    return functools.partial(MixtureOfExperts, hf.req("hidden_size"), _size(hf, "moe_intermediate_size"), E, k,
                             routing=routing, device=device, dtype=dtype)


def build_lfm2_moe(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                   dtype: Any = None) -> DecoderLM:
    """The decoder of an ``Lfm2MoeConfig`` (random weights; see the module docstring)."""
    hf = canonical_moe(hf)
    dense, depth, kw = dense_layers(hf), hf.req("num_hidden_layers"), {"device": device, "dtype": dtype}
    ffns = [parts.gated_mlp(hf.req("hidden_size"), hf.req("intermediate_size"), "swiglu", **kw)] * dense
    ffns += [moe_factory(hf, **kw)] * (depth - dense) if dense < depth else []
    return _decoder(hf, ffns, head_size=head_size, **kw)


def put_short_conv(plan: Plan, ours: str, theirs: str, *, bias: bool) -> None:
    """A :class:`Lfm2ShortConvMixer` at ``ours`` from transformers' ``Lfm2ShortConv`` at ``theirs``."""
    plan.put_pairs(ours, theirs, [("in_proj", "in_proj"), ("conv", "conv"), ("out_proj", "out_proj")], bias=bias)


def put_lfm2_attention(plan: Plan, ours: str, theirs: str) -> None:
    """``Lfm2Attention``: q/k/v into ``qkv_proj`` (rows ``[q; k; v]``), ``out_proj`` (not ``o_proj``),
    ``q_layernorm``/``k_layernorm`` into the per-head QK-norm."""
    plan.put_cat(f"{ours}qkv_proj.weight", [f"{theirs}{n}_proj.weight" for n in "qkv"])
    plan.put(f"{ours}out_proj.weight", f"{theirs}out_proj.weight")
    for n in ("q", "k"):
        plan.put(f"{ours}frontier.{n}_norm_weight", f"{theirs}{n}_layernorm.weight")


def put_swiglu(plan: Plan, ours: str, theirs: str) -> None:
    """A :class:`~attnzoo.FeedForward` at ``ours`` from ``Lfm2MLP`` / ``Lfm2MoeMLP`` at ``theirs``
    (``w1`` gate, ``w3`` up, ``w2`` down)."""
    plan.put_pairs(ours, theirs, SWIGLU, bias=False)


def put_lfm2_moe(plan: Plan, ours: str, theirs: str, num_experts: int, *, expert_bias: bool) -> None:
    """Plan the :class:`MixtureOfExperts` at ``ours`` (``"blocks.3.ffn."``) from
    ``Lfm2MoeSparseMoeBlock`` at ``theirs`` (``"layers.3.feed_forward."``): the router
    ``gate.weight``, the stacked experts (in memory) or one ``experts.{e}.w1/w3/w2.weight`` per
    expert (saved folders), ``expert_bias`` into ``score_bias`` (zeros without ``use_expert_bias``:
    the plain top-k of the sigmoids)."""
    if not plan.src.has(f"{theirs}experts.0.w1.weight"):
        put_moe(plan, ours, theirs, "stacked")  # gate.weight, experts.gate_up_proj (rows [gate; up]), down_proj
    else:
        plan.put(f"{ours}router.weight", f"{theirs}gate.weight")
        for name, saved in SWIGLU:
            each = [plan.src.take(f"{theirs}experts.{e}.{saved}.weight") for e in range(num_experts)]
            if all(t is not None for t in each):
                plan.put_tensor(f"{ours}{name}", torch.stack([t for t in each if t is not None]),
                                f"{plan.src.prefix}{theirs}experts.*.{saved}.weight")
    if expert_bias:
        plan.put(f"{ours}score_bias", f"{theirs}expert_bias")
    else:
        plan.put_tensor(f"{ours}score_bias", torch.zeros(num_experts, dtype=torch.float32),
                        "(use_expert_bias=False: no bias)")


def _convert(hf: HFConfig, sd: dict[str, Tensor], build: Callable[..., DecoderLM],
             put_ffn: Callable[[Plan, str, str, int], None], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder of the canonical ``hf`` and copy the weights (the head follows them):
    the mixers and norms of every layer here, layer ``i``'s feed-forward by ``put_ffn(plan, ours,
    theirs, i)``."""
    model, plan, head_size = parts.start(hf, sd, build, device=device, dtype=dtype)
    kinds = parts.layer_types(hf, model.depth, TYPES)
    bias = hf.req("conv_bias", bool)
    for i, kind in enumerate(kinds):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if kind == "conv":
            put_short_conv(plan, f"{o}attn.", f"{h}conv.", bias=bias)
        else:
            put_lfm2_attention(plan, f"{o}attn.", f"{h}self_attn.")
        put_ffn(plan, f"{o}ffn.", f"{h}feed_forward.", i)
        plan.put_pairs(o, h, [("attn_norm", "operator_norm"), ("ffn_norm", "ffn_norm")], bias=False)
    return parts.finish(plan, model, head_size, final_norm="embedding_norm")


def convert_lfm2(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build an LFM2 decoder and copy the weights (the head follows them)."""
    return _convert(canonical(hf), sd, build_lfm2, lambda plan, ours, theirs, _: put_swiglu(plan, ours, theirs),
                    device=device, dtype=dtype)


def convert_lfm2_moe(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build an LFM2-MoE decoder and copy the weights (the head follows them)."""
    hf = canonical_moe(hf)
    dense, experts, bias = dense_layers(hf), hf.req("num_experts"), hf.req("use_expert_bias", bool)

    def put_ffn(plan: Plan, ours: str, theirs: str, i: int) -> None:
        if i < dense:
            put_swiglu(plan, ours, theirs)
        else:
            put_lfm2_moe(plan, ours, theirs, experts, expert_bias=bias)

    return _convert(hf, sd, build_lfm2_moe, put_ffn, device=device, dtype=dtype)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "lfm2": parts.Dispatch("LFM2", convert_lfm2, ("Lfm2ForCausalLM", "Lfm2Model")),
    "lfm2_moe": parts.Dispatch("LFM2-MoE", convert_lfm2_moe, ("Lfm2MoeForCausalLM", "Lfm2MoeModel")),
}
