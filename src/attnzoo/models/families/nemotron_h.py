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
* ``"moe"`` (``E``, Nemotron 3 Nano; modeling 762-892): a
  :class:`~attnzoo.nn.moe.MixtureOfExperts` with ``n_routed_experts`` (alias ``num_local_experts``)
  ungated relu^2 experts (``Experts("relu2")``: ``down(relu(up(x)) ** 2)``, hidden
  ``moe_intermediate_size``, no biases), ``num_experts_per_tok`` per token, routed as
  ``NemotronHTopkRouter`` does (``Routing("sigmoid_topk", norm_topk_prob=norm_topk_prob,
  scaling=routed_scaling_factor, groups=n_group, topk_groups=topk_group)``: float32 logits and
  sigmoid scores, ``gate.e_score_correction_bias`` -> ``score_bias`` choosing but not weighting,
  group-limited choice, the kept scores divided by their sum plus ``1e-20`` when
  ``norm_topk_prob``, times ``routed_scaling_factor``), plus ONE shared expert, a relu^2
  :class:`~attnzoo.FeedForward` of ``moe_shared_expert_intermediate_size`` (``shared_experts``,
  biased with ``mlp_bias``; ``n_shared_experts`` is not read by the modeling, nor here).

attnzoo's :class:`~attnzoo.TransformerBlock` is a mixer and an optional feed-forward, each
pre-norm: ``x1 = x + mixer(attn_norm(x)); x2 = x1 + ffn(ffn_norm(x1))``. That is exactly two
Hugging Face layers, a mixer layer ``j`` and the MLP layer ``j + 1`` after it, so the layers are
paired from the left (:func:`pair_layers`); an ``mlp`` and a ``moe`` layer pair alike (a
"feed-forward layer"):

* a mixer layer ``j`` followed by a feed-forward layer: ONE block ``i`` covering HF layers
  ``j, j + 1`` (``attn_norm`` <- ``layers.{j}.norm``, ``attn`` <- ``layers.{j}.mixer``,
  ``ffn_norm`` <- ``layers.{j+1}.norm``, ``ffn`` <- ``layers.{j+1}.mixer``: a
  :class:`~attnzoo.FeedForward` (``up_proj`` / ``down_proj``) for ``mlp``, the
  :class:`~attnzoo.nn.moe.MixtureOfExperts` for ``moe``);
* a mixer layer not followed by a feed-forward layer: a mixer-only block (``feed_forward=None``).

So ``"M-M*-MM-"`` (8 HF layers) is 5 blocks: ``[M-] [M] [*-] [M] [M-]``, ``"MEM*EM-"`` is
``[ME] [M] [*E] [M-]``, and the model's ``depth`` counts blocks, not Hugging Face layers. A
feed-forward layer with no mixer layer before it (a leading ``-`` / ``E``, or ``--``, ``-E``)
has no block to go into: refused, naming the layer.

Checkpoint names: ``model.embeddings``, ``model.layers.{j}.norm`` / ``.mixer.*``,
``model.norm_f``, ``lm_head`` in memory; saved folders write ``backbone.`` for ``model.``
(transformers renames them on load and back on save): both load. A ``moe`` layer's mixer is
``gate.weight [E, C]``, ``gate.e_score_correction_bias [E]``, ``experts.up_proj [E, I, C]``,
``experts.down_proj [E, C, I]`` and ``shared_experts.{up,down}_proj.weight`` in memory; saved
folders hold one tensor per expert instead, ``experts.{e}.up_proj.weight [I, C]`` /
``experts.{e}.down_proj.weight [C, I]`` (``conversion_mapping.py`` 1783-1799): both load.
``mtp.*`` (multi-token prediction) tensors are ignored, as transformers ignores them.

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

Refused by name: a feed-forward layer with no mixer before it, ``use_bias=True`` (biased Mamba
``in_proj`` / ``out_proj``), a clamped ``time_step_limit``, ``mamba_hidden_act`` other than SiLU,
an ``mlp_hidden_act`` :class:`~attnzoo.FeedForward` does not have; with ``moe`` layers:
``moe_latent_size`` set (the ``fc1_latent_proj`` / ``fc2_latent_proj`` around the experts, which
run in the latent width: not in :class:`~attnzoo.nn.moe.MixtureOfExperts`), ``mlp_hidden_act``
other than ``relu2`` (the routed experts take it too, and attnzoo's ungated experts are relu^2
only), and routing transformers itself cannot run or attnzoo refuses (``n_routed_experts`` not
split by ``n_group`` into groups of >= 2 when ``n_group > 1``, ``topk_group > n_group``,
``num_experts_per_tok`` above what the ``topk_group`` groups hold, ``routed_scaling_factor <= 0``).
``mlp_bias=True`` is reproduced (biases on ``up_proj`` / ``down_proj`` of the MLPs and of the
shared expert; the routed experts never have biases).

In half precision the RMSNorms multiply by their weight in float32 before casting, as
transformers' (modeling 726-742, :class:`~attnzoo.models.families._common.Float32ScaleRMSNorm`),
and the Mamba state is float32 (transformers' ``mamba_ssm_cache_dtype``). The router weight
``gate.weight`` stays float32 whatever the model's dtype (``keep_router_float32``), as transformers
keeps it (``_keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]``, modeling
1106; the Mamba ``A_log`` / ``dt_bias`` are not in it), and the router matmul runs in float32, as
transformers'. One rounding still differs (in float32 they agree): transformers scales the experts'
outputs by float32 weights (attnzoo rounds them to the model's dtype first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import FeedForward
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._mamba import MambaKeys, mamba_factory, put_mamba
from attnzoo.models.hf._state import HFConfig, Plan, float_dtype
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.mamba2 import Mamba2
from attnzoo.nn.moe import Experts, MixtureOfExperts, Routing

__all__ = ["DEFAULTS", "DISPATCH", "FEED_FORWARDS", "LAYER_KINDS", "NEMOTRON_H_KEYS", "build_nemotron_h",
           "convert_nemotron_h", "layer_kinds", "moe_factory", "moe_routing", "pair_layers", "put_nemotron_moe"]

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
    "layer_norm_epsilon": 1e-5, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True}
#: transformers' ``mlp_hidden_act`` names -> :class:`~attnzoo.FeedForward`'s (ungated) activations
MLP_ACTIVATIONS = {"relu2": "relu2", "relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu",
                   "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_MIXERS = ("linear_attention", "full_attention")
#: the feed-forward layer kinds, each paired with the mixer layer before it
FEED_FORWARDS = ("mlp", "moe")
#: the Mamba-2 mixer's keys: ``mamba_head_dim`` is always given (:data:`DEFAULTS`), so the inner
#: width is ``mamba_num_heads * mamba_head_dim`` (``expand`` is not read, as in transformers)
NEMOTRON_H_KEYS = MambaKeys("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "expand",
                            "use_conv_bias", "use_bias", "layer_norm_epsilon", activation="mamba_hidden_act")


def _canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: the legacy keys folded in, :data:`DEFAULTS` where absent,
    ``layers_block_type`` set, and the two options the modeling ignores made explicit
    (``attention_bias`` and ``tie_word_embeddings`` False)."""
    data = hf.with_defaults(DEFAULTS).data
    if hf.data.get("n_routed_experts") is None and hf.data.get("num_local_experts") is not None:
        data["n_routed_experts"] = hf.data["num_local_experts"]  # the config's attribute_map (config 84)
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


def pair_layers(hf: HFConfig, kinds: list[str]) -> list[tuple[int, str | None]]:
    """The blocks as ``(j, ffn)``: block ``i`` covers Hugging Face layer ``j`` (a mixer) and, when
    ``ffn`` is ``"mlp"`` or ``"moe"``, the feed-forward layer ``j + 1`` of that kind (``None``: a
    mixer-only block; see the module docstring). Refused by name: a feed-forward layer with no
    mixer layer right before it."""
    pattern = "".join(_CHARS[t] for t in kinds)
    blocks: list[tuple[int, str | None]] = []
    j = 0
    while j < len(kinds):
        if kinds[j] not in _MIXERS:
            article = "an" if kinds[j] == "mlp" else "a"
            raise hf.unsupported(f"{article} {kinds[j]} layer with no mixer layer before it (layer {j} of the pattern "
                                 f"{pattern!r}: a block is a mixer and the mlp or moe layer after it)")
        ffn = kinds[j + 1] if j + 1 < len(kinds) and kinds[j + 1] in FEED_FORWARDS else None
        blocks.append((j, ffn))
        j += 2 if ffn else 1
    return blocks


def moe_routing(hf: HFConfig) -> Routing:
    """``NemotronHTopkRouter``'s routing (modeling 854-892): sigmoid scores chosen with the
    correction bias, group-limited by ``n_group`` / ``topk_group``, ``norm_topk_prob``,
    ``routed_scaling_factor``; what transformers cannot run or attnzoo cannot express is refused
    by name."""
    E, k = hf.req("n_routed_experts"), hf.req("num_experts_per_tok")
    groups, topk_groups = hf.req("n_group"), hf.req("topk_group")
    scaling = hf.req("routed_scaling_factor", float)
    if groups < 1 or not 1 <= topk_groups <= groups:
        raise hf.unsupported(f"n_group={groups}, topk_group={topk_groups} (need 1 <= topk_group <= n_group)")
    if groups > 1 and (E % groups or E // groups < 2 or k > topk_groups * (E // groups)):
        raise hf.unsupported(f"n_routed_experts={E} in n_group={groups} groups with topk_group={topk_groups} and "
                             f"num_experts_per_tok={k} (need groups of >= 2 experts, and num_experts_per_tok <= "
                             f"topk_group * experts per group)")
    if not scaling > 0 or scaling == float("inf"):
        raise hf.unsupported(f"routed_scaling_factor={scaling!r} (attnzoo's routing scales by a positive factor)")
    if not 1 <= k <= E:
        raise hf.unsupported(f"num_experts_per_tok={k} with n_routed_experts={E}")
    return Routing("sigmoid_topk", norm_topk_prob=hf.req("norm_topk_prob", bool), scaling=scaling, groups=groups,
                   topk_groups=topk_groups)


def moe_factory(hf: HFConfig, act: str, *, device: Any = None, dtype: Any = None) -> Callable[[], nn.Module]:
    """The factory of a ``moe`` layer's :class:`MixtureOfExperts` (``NemotronHMoE``, modeling
    810-851): relu^2 routed experts, one relu^2 shared expert; refuses the latent projections and
    any ``mlp_hidden_act`` but ``relu2`` by name."""
    latent = hf.raw("moe_latent_size")
    if latent is not None:
        raise hf.unsupported(f"moe_latent_size={latent!r} (the fc1_latent_proj / fc2_latent_proj around the experts)")
    if act != "relu2":
        raise hf.unsupported(f"mlp_hidden_act={hf.raw('mlp_hidden_act')!r} with moe layers (the routed experts "
                             f"take it too; attnzoo's ungated experts are relu2 only)")
    C, kw = hf.req("hidden_size"), {"device": device, "dtype": dtype}
    routing = moe_routing(hf)
    shared = functools.partial(FeedForward, C, hf.req("moe_shared_expert_intermediate_size"), act,
                               bias=hf.req("mlp_bias", bool), **kw)
    return lambda: MixtureOfExperts(C, hf.req("moe_intermediate_size"), hf.req("n_routed_experts"),
                                    hf.req("num_experts_per_tok"), routing=routing, experts=Experts("relu2"),
                                    shared_expert=shared(), keep_router_float32=True, **kw)


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
    ffns: dict[str | None, Any] = {
        None: None, "mlp": functools.partial(FeedForward, C, hf.req("intermediate_size"), act,
                                             bias=hf.req("mlp_bias", bool), **kw)}
    if any(ffn == "moe" for _, ffn in blocks_of):
        ffns["moe"] = moe_factory(hf, act, **kw)
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixers[kinds[j]], ffns[ffn], norm) for j, ffn in blocks_of]
    return parts.float32_scale_norms(parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw))


def _saved_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A saved folder's ``backbone.`` prefix read as ``model.`` (transformers' own renaming)."""
    return {("model." + k.removeprefix("backbone.") if k.startswith("backbone.") else k): t for k, t in sd.items()}


def convert_nemotron_h(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them): block ``i`` from the
    Hugging Face layers ``j`` (and ``j + 1``) of :func:`pair_layers`; every checkpoint key is used
    or named (``mtp.*`` ignored); a ``moe`` layer's experts stacked (in memory) or one tensor per
    expert (saved folders)."""
    hf, sd = _canonical(hf), _saved_names(sd)
    prefix, head_size = parts.head_size_of(hf, sd)
    model = build_nemotron_h(hf, head_size=head_size, device=device, dtype=dtype or float_dtype(sd))
    plan = parts.plan_for(sd, prefix, hf.arch)
    plan.put("tok_emb.weight", "embeddings.weight")
    mlp_bias = hf.req("mlp_bias", bool)
    for i, (j, ffn) in enumerate(pair_layers(hf, hf.req("layers_block_type", list))):
        o, h = f"blocks.{i}.", f"layers.{j}."
        block = model.blocks[i]
        if isinstance(block.attn, Mamba2):
            put_mamba(plan, f"{o}attn.", f"{h}mixer.", cast(Mamba2, block.attn))
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}mixer.", bias=False)
        plan.put(f"{o}attn_norm.weight", f"{h}norm.weight")
        if ffn is not None:
            nxt = f"layers.{j + 1}."
            if ffn == "moe":
                put_nemotron_moe(plan, f"{o}ffn.", f"{nxt}mixer.", hf.req("n_routed_experts"), mlp_bias=mlp_bias)
            else:
                plan.put_pairs(f"{o}ffn.", f"{nxt}mixer.", [("up_proj", "up_proj"), ("down_proj", "down_proj")],
                               bias=mlp_bias)
            plan.put(f"{o}ffn_norm.weight", f"{nxt}norm.weight")
    return parts.finish(plan, model, head_size, final_norm="norm_f", ignore=[r"(model\.)?mtp\..*"])


def put_nemotron_moe(plan: Plan, ours: str, theirs: str, num_experts: int, *, mlp_bias: bool) -> None:
    """Plan the :class:`MixtureOfExperts` at ``ours`` (``"blocks.1.ffn."``) from transformers'
    ``NemotronHMoE`` at ``theirs`` (``"layers.2.mixer."``): the router and its correction bias,
    the stacked ``experts.up_proj`` / ``experts.down_proj`` (or, in a saved folder, one
    ``experts.{e}.*_proj.weight`` per expert, stacked here), the shared expert."""
    plan.put(f"{ours}router.weight", f"{theirs}gate.weight")
    plan.put(f"{ours}score_bias", f"{theirs}gate.e_score_correction_bias")
    for name in ("up_proj", "down_proj"):
        if plan.src.has(f"{theirs}experts.{name}") or not plan.src.has(f"{theirs}experts.0.{name}.weight"):
            plan.put(f"{ours}{name}", f"{theirs}experts.{name}")
            continue
        each = [plan.src.take(f"{theirs}experts.{e}.{name}.weight") for e in range(num_experts)]
        if all(t is not None for t in each):
            plan.put_tensor(f"{ours}{name}", torch.stack(cast(list[Tensor], each)),
                            f"{plan.src.prefix}{theirs}experts.*.{name}.weight")
    plan.put_pairs(f"{ours}shared_expert.", f"{theirs}shared_experts.",
                   [("up_proj", "up_proj"), ("down_proj", "down_proj")], bias=mlp_bias)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"nemotron_h": parts.Dispatch("Nemotron-H", convert_nemotron_h, ("NemotronHForCausalLM", "NemotronHModel"))}
