"""Nemotron-H (``nemotron_h``) -> :class:`~attnzoo.DecoderLM`: ``NemotronHForCausalLM`` and
``NemotronHModel`` (NVIDIA Nemotron-H, Nemotron Nano 2).

Every Hugging Face layer is ``x + mixer(norm(x))``: one RMSNorm (``layers.{j}.norm``, epsilon
``layer_norm_epsilon``) and ONE mixer (``layers.{j}.mixer``), of the kind that
``layers_block_type`` lists (or the legacy ``hybrid_override_pattern``, one character a layer;
``num_hidden_layers`` is its length):

* ``"linear_attention"`` (``M``): the Mamba-2 SSD mixer of :mod:`attnzoo.models.families._mamba`
  with ``mamba_num_heads`` heads of ``mamba_head_dim`` channels -- the inner width is
  ``mamba_num_heads * mamba_head_dim`` (``expand`` is not read), ``n_groups`` groups of
  ``ssm_state_size`` for ``B``/``C``, ``conv_kernel``, ``use_conv_bias``;
* ``"full_attention"`` (``*``): causal GQA attention with no positions at all (NoPE), heads of
  ``head_dim`` (from the config), scale ``head_dim ** -0.5``, no biases;
* ``"mlp"`` (``-``): ``down_proj(relu(up_proj(x)) ** 2)``, no gate (``mlp_hidden_act``);
* ``"moe"`` (``E``, Nemotron 3 Nano): refused (below).

attnzoo's :class:`~attnzoo.TransformerBlock` is a mixer and an optional feed-forward, each
pre-norm: ``x1 = x + mixer(attn_norm(x)); x2 = x1 + ffn(ffn_norm(x1))``. That is exactly two
Hugging Face layers, a mixer layer ``j`` and the MLP layer ``j + 1`` after it, so the layers are
paired from the left (:func:`pair_layers`):

* a mixer layer ``j`` followed by an MLP layer: ONE block ``i`` covering HF layers ``j, j + 1``
  (``attn_norm`` <- ``layers.{j}.norm``, ``attn`` <- ``layers.{j}.mixer``, ``ffn_norm`` <-
  ``layers.{j+1}.norm``, ``ffn`` (:class:`~attnzoo.FeedForward`, ``up_proj`` / ``down_proj``) <-
  ``layers.{j+1}.mixer``);
* a mixer layer not followed by an MLP layer: a mixer-only block (``feed_forward=None``).

So ``"M-M*-MM-"`` (8 HF layers) is 5 blocks: ``[M-] [M] [*-] [M] [M-]``, and the model's
``depth`` counts blocks, not Hugging Face layers. An MLP layer with no mixer layer before it (a
leading ``-``, or ``--``) has no block to go into: refused, naming the layer.

Checkpoint names: ``model.embeddings``, ``model.layers.{j}.norm`` / ``.mixer.*``,
``model.norm_f``, ``lm_head`` in memory; saved folders write ``backbone.`` for ``model.``
(transformers renames them on load and back on save): both load. ``mtp.*`` (multi-token
prediction) tensors are ignored, as transformers ignores them.

Read as transformers does (``configuration_nemotron_h.py`` / ``modeling_nemotron_h.py`` of
transformers 5.25):

* the legacy keys ``mamba_n_groups``, ``mamba_d_conv``, ``mamba_dt_limit``, ``mamba_conv_bias``
  override ``n_groups``, ``conv_kernel``, ``time_step_limit``, ``use_conv_bias`` (config 157-167);
  ``layers_block_type`` (``layer_types``) wins over ``hybrid_override_pattern`` (171-177); the
  legacy layer names ``"mamba"`` / ``"attention"`` are remapped; keys a ``config.json`` leaves out
  take the config class's defaults (:data:`DEFAULTS`, config 98-152);
* ``tie_word_embeddings`` is not honoured: ``NemotronHForCausalLM._tied_weights_keys = {}``
  (modeling 1253), so ``lm_head`` is always its own weight (the converted model is untied);
* ``attention_bias`` is ignored: the attention's projections are ``bias=False`` (modeling
  978-981); ``sliding_window`` is ignored too (the model builds only a causal mask, 1229);
* ``expand``, ``mamba_proj_bias``, ``residual_in_fp32`` and ``chunk_size`` do not change the
  result (``expand`` / ``mamba_proj_bias`` / ``residual_in_fp32`` are not read by the modeling;
  the chunk is a schedule of the same scan).

Refused by name: ``moe`` layers (attnzoo's :class:`~attnzoo.nn.moe.MixtureOfExperts` has no
non-gated relu^2 experts nor the latent projections), an MLP layer with no mixer before it,
``use_bias=True`` (biased Mamba ``in_proj`` / ``out_proj``), a clamped ``time_step_limit``,
``mamba_hidden_act`` other than SiLU, an ``mlp_hidden_act`` :class:`~attnzoo.FeedForward` does not
have. ``mlp_bias=True`` is reproduced (biases on ``up_proj`` / ``down_proj``).

In half precision two roundings differ from transformers' (in float32 they agree):
transformers' RMSNorm multiplies by its weight in float32 before casting (attnzoo casts, then
multiplies), and it keeps the Mamba state cache in ``mamba_ssm_cache_dtype`` (float32).
"""

from __future__ import annotations

import functools
from typing import Any, cast

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.blocks import FeedForward
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._mamba import MambaKeys, mamba_factory, put_mamba
from attnzoo.models.hf._state import HFConfig, float_dtype
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.mamba2 import Mamba2

__all__ = ["DEFAULTS", "LAYER_KINDS", "NEMOTRON_H_KEYS", "build_nemotron_h", "convert_nemotron_h", "layer_kinds", "pair_layers"]

#: ``hybrid_override_pattern`` characters -> ``layers_block_type`` names (config 279-282)
LAYER_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_CHARS = {v: k for k, v in LAYER_KINDS.items()}
#: transformers' remap of legacy layer names (``configuration_utils._LEGACY_LAYER_TYPE_REMAP``)
_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
#: legacy config key -> the key it overrides (config 157-167; the others are initialisation only)
_LEGACY_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                "mamba_dt_limit": "time_step_limit", "mamba_conv_bias": "use_conv_bias",
                "mamba_chunk_size": "chunk_size"}
#: ``NemotronHConfig``'s defaults of the keys read here (config 98-152), for a ``config.json``
#: that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 4096, "intermediate_size": 21504, "mlp_hidden_act": "relu2",
    "mlp_bias": False, "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64,
    "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4, "use_conv_bias": True, "use_bias": False,
    "layer_norm_epsilon": 1e-5}
#: transformers' ``mlp_hidden_act`` names -> :class:`~attnzoo.FeedForward`'s (ungated) activations
MLP_ACTIVATIONS = {"relu2": "relu2", "relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu",
                   "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_MIXERS = ("linear_attention", "full_attention")
#: the Mamba-2 mixer's keys: ``mamba_head_dim`` is always given (:data:`DEFAULTS`), so the inner
#: width is ``mamba_num_heads * mamba_head_dim`` (``expand`` is not read, as in transformers)
NEMOTRON_H_KEYS = MambaKeys("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "expand",
                            "use_conv_bias", "use_bias", "layer_norm_epsilon", activation="mamba_hidden_act")


def _canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: the legacy keys folded in, :data:`DEFAULTS` where absent,
    ``layers_block_type`` set, and the two options the modeling ignores made explicit
    (``attention_bias`` and ``tie_word_embeddings`` False)."""
    data = {**DEFAULTS, **{k: v for k, v in hf.data.items() if v is not None}}
    if "num_key_value_heads" in hf.data and hf.data["num_key_value_heads"] is None:  # config 202-203
        data["num_key_value_heads"] = data["num_attention_heads"]
    for old, new in _LEGACY_KEYS.items():
        if old in hf.data:
            data[new] = hf.data[old]
    data["layers_block_type"] = layer_kinds(hf)
    data.update(attention_bias=False, tie_word_embeddings=False)
    return HFConfig(data, hf.source, hf.arch)


def layer_kinds(hf: HFConfig) -> list[str]:
    """One ``layers_block_type`` name per Hugging Face layer: ``layers_block_type`` (or its alias
    ``layer_types``), else ``hybrid_override_pattern``, else transformers' default
    ``["linear_attention", "moe", "full_attention", "mlp"]``."""
    listed = hf.first(("layers_block_type", "layer_types"), None, list)
    if listed is None:
        pattern = hf.get("hybrid_override_pattern", None, str)
        if pattern is None:
            listed = ["linear_attention", "moe", "full_attention", "mlp"]
        else:
            bad = sorted(set(pattern) - set(LAYER_KINDS))
            if bad:
                raise CheckpointFormatError(f"{hf.source}: hybrid_override_pattern {pattern!r} has characters {bad} "
                                            f"(known: {''.join(LAYER_KINDS)})")
            listed = [LAYER_KINDS[c] for c in pattern]
    kinds = [_LEGACY_TYPES.get(t, t) if isinstance(t, str) else t for t in listed]
    bad = [t for t in kinds if t not in _CHARS]
    if bad:
        raise CheckpointFormatError(f"{hf.source}: layers_block_type has unknown types {bad} "
                                    f"(known: {sorted(_CHARS)})")
    if not kinds:
        raise CheckpointFormatError(f"{hf.source}: layers_block_type is empty")
    return kinds


def pair_layers(hf: HFConfig, kinds: list[str]) -> list[tuple[int, bool]]:
    """The blocks as ``(j, with_mlp)``: block ``i`` covers Hugging Face layer ``j`` (a mixer) and,
    when ``with_mlp``, the MLP layer ``j + 1`` (see the module docstring). Refused by name: ``moe``
    layers, an MLP layer with no mixer layer right before it."""
    pattern = "".join(_CHARS[t] for t in kinds)
    moe = [j for j, t in enumerate(kinds) if t == "moe"]
    if moe:
        raise hf.unsupported(f"moe layers (layers {moe} of the pattern {pattern!r}: non-gated relu^2 experts)")
    blocks: list[tuple[int, bool]] = []
    j = 0
    while j < len(kinds):
        if kinds[j] not in _MIXERS:
            raise hf.unsupported(f"an mlp layer with no mixer layer before it (layer {j} of the pattern "
                                 f"{pattern!r}: a block is a mixer and the mlp after it)")
        with_mlp = j + 1 < len(kinds) and kinds[j + 1] == "mlp"
        blocks.append((j, with_mlp))
        j += 2 if with_mlp else 1
    return blocks


def build_nemotron_h(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """The decoder of a ``NemotronHConfig`` (random weights): one block per
    :func:`pair_layers` entry (see the module docstring)."""
    hf = _canonical(hf)
    kinds = hf.req("layers_block_type", list)
    blocks_of = pair_layers(hf, kinds)
    C, eps, kw = hf.req("hidden_size"), hf.req("layer_norm_epsilon", float), {"device": device, "dtype": dtype}
    act = hf.activation("mlp_hidden_act", MLP_ACTIVATIONS, "relu2")
    mixers = {"linear_attention": mamba_factory(hf, NEMOTRON_H_KEYS, **kw),
              "full_attention": parts.attention_factory(hf, window=None, rope=None, **kw)}
    mlp = functools.partial(FeedForward, C, hf.req("intermediate_size"), act, bias=hf.req("mlp_bias", bool), **kw)
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixers[kinds[j]], mlp if with_mlp else None, norm) for j, with_mlp in blocks_of]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _saved_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A saved folder's ``backbone.`` prefix read as ``model.`` (transformers' own renaming)."""
    return {("model." + k.removeprefix("backbone.") if k.startswith("backbone.") else k): t for k, t in sd.items()}


def convert_nemotron_h(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them): block ``i`` from the
    Hugging Face layers ``j`` (and ``j + 1``) of :func:`pair_layers`; every checkpoint key is used
    or named (``mtp.*`` ignored)."""
    hf, sd = _canonical(hf), _saved_names(sd)
    prefix, head_size = parts.head_size_of(hf, sd)
    model = build_nemotron_h(hf, head_size=head_size, device=device, dtype=dtype or float_dtype(sd))
    plan = parts.plan_for(sd, prefix, hf.arch)
    plan.put("tok_emb.weight", "embeddings.weight")
    mlp_bias = hf.req("mlp_bias", bool)
    for i, (j, with_mlp) in enumerate(pair_layers(hf, hf.req("layers_block_type", list))):
        o, h = f"blocks.{i}.", f"layers.{j}."
        block = model.blocks[i]
        if isinstance(block.attn, Mamba2):
            put_mamba(plan, f"{o}attn.", f"{h}mixer.", cast(Mamba2, block.attn))
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}mixer.", bias=False)
        plan.put(f"{o}attn_norm.weight", f"{h}norm.weight")
        if with_mlp:
            nxt = f"layers.{j + 1}."
            plan.put_pairs(f"{o}ffn.", f"{nxt}mixer.", [("up_proj", "up_proj"), ("down_proj", "down_proj")],
                           bias=mlp_bias)
            plan.put(f"{o}ffn_norm.weight", f"{nxt}norm.weight")
    return parts.finish(plan, model, head_size, final_norm="norm_f", ignore=[r"(model\.)?mtp\..*"])
