"""StepFun Step-3.7-Flash text (``step3p5``) -> :class:`~attnzoo.DecoderLM`: the language model of
``Step3p7ForConditionalGeneration`` (its vision tower and projector are out of scope; the wrapper row
``step3p7`` of :mod:`attnzoo.models.hf.wrappers`) and ``Step3p7TextModel``. Line numbers:
transformers 5.25's ``models/step3p7/modeling_step3p7.py`` (``configuration_step3p7.py`` where it
says so).

Every layer is pre-norm (``input_layernorm``, ``post_attention_layernorm``) around:

* Attention (``Step3p7Attention``, 670-748): GQA with ``num_key_value_heads`` key/value heads and, on
  the ``sliding_attention`` layers of ``layer_types``, their own query-head count
  (``num_sliding_attention_heads``; saved configs: ``per_layer_config``; released ones:
  ``attention_other_setting``); per-head QK RMSNorms before RoPE (714-715); scores scaled by
  ``query_pre_attn_scalar ** -0.5`` (default ``head_dim``); a causal window of ``sliding_window - 1``
  keys on the sliding layers; a sigmoid output gate per head before ``o_proj`` (``g_proj``, 740-742;
  :class:`~attnzoo.nn.parts.OutputGate`). Biases on q/k/v/o by ``attention_bias``.
* RoPE per layer kind (433-493): ``rope_parameters[kind]`` (theta, ``partial_rotary_factor``: the
  first ``int(head_dim * factor)`` channels, split halves); released configs give per-layer
  ``rope_theta`` / ``partial_rotary_factors`` lists, read as transformers reads them (each kind takes
  its first layer's values; ``rope_scaling`` applies to the full layers; configuration 268-290).
* The feed-forward by ``mlp_layer_types`` (released configs: ``moe_layers_enum``; default: dense
  below layer 3): a SwiGLU MLP of ``intermediate_size``, or a MoE (``Step3p7SparseMoeBlock``,
  585-667): the top ``num_experts_per_tok`` of ``sigmoid(logits) + e_score_correction_bias`` (float32)
  weighted by the sigmoids renormalised to sum 1 (no epsilon), times ``moe_router_scaling_factor``,
  plus an always-on (ungated) SwiGLU shared expert of ``share_expert_dim``. Per-layer SwiGLU limits
  clip after the activation, ``min(silu(g), l) * clamp(u, -l, l)`` (0 or ``None``: none):
  ``swiglu_limits`` on the routed experts (``Experts("limited_swiglu")``), ``swiglu_limits_shared``
  on the shared expert *and* on a dense layer's MLP (516-540: the dense MLP reads the shared list).
* Every RMSNorm is Gemma's, ``(1 + w)`` in float32 (496-513): loaded as ``w + 1``
  (:func:`~attnzoo.models.families._common.plus_one`) into norms that apply it in float32.

Multi-token prediction: a checkpoint folder's ``layers.{L + k}`` (``num_nextn_predict_layers`` of
them, Step-3.7-Flash has 3: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` around a decoder
layer; the released names with ``.transformer.`` before them read too, as vLLM reads them) load as the
model's ``mtp`` (:mod:`attnzoo.models.mtp`), built as transformers' ``MtpModel``
builds them (``get_mtp_config``): layer ``k`` of kind ``mtp_layer_types[k]`` and
``mtp_mlp_layer_types[k]`` with ``num_attention_heads`` query heads and the SwiGLU limits of the
*model's* layer ``k`` (transformers' MTP layers restart the layer index at 0, and its config drops the
released lists' MTP entries). The drafts go through the model's head, as transformers' ``MtpModel``
does; a release's per-layer ``shared_head.output`` (vLLM's draft head) is not read. ``from_hf(model)``
has no MTP layers (transformers' model drops them).

Saved folders: transformers writes (and the released checkpoints hold) the text model at the top
(``model.layers``, ``model.embed_tokens``, ``model.norm``) with the MoE in its original names
(``moe.gate.weight``, ``moe.router_bias``, ``moe.gate_proj`` / ``moe.up_proj [E, F, C]``,
``moe.down_proj [E, C, F]``, ``share_expert``): both layouts load. A folder of ``model_type``
``step3p5`` (the text model alone) loads the same way. A ``config.json`` that leaves out keys reads
them as :data:`DEFAULTS` (``Step3p7TextConfig``'s).

Refused by name: layer kinds other than ``full_attention`` / ``sliding_attention`` (a
``sparse_attention_config``'s ``minimax_m3_sparse`` layers: transformers' attention builds no indexer
for them and has no mask for them), ``gating`` other than ``True`` / ``"per-head"`` (transformers'
per-channel gate cannot run: ``[B, N, H * D, 1]`` against ``[B, N, H, D]``, l. 742),
``use_bidirectional_attention``, ``mlp_bias`` (biases on the dense
and shared MLPs only), ``mlp_layer_types`` entries other than ``dense`` / ``sparse``, a negative SwiGLU
limit, a rotated width that is odd or zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_stacked_experts
from attnzoo.models.families.bailing_hybrid import LimitedSwiGLU
from attnzoo.models.families.laguna import rope_of_kind
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.mtp import MTPLayer, MultiTokenPredictor
from attnzoo.nn.moe import Experts, MixtureOfExperts, Routing

__all__ = ["DEFAULTS", "DISPATCH", "build_step3p7", "canonical", "convert_step3p7"]

TYPES = ("full_attention", "sliding_attention")
#: ``Step3p7TextConfig``'s defaults of the keys read here (configuration 138-176)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 128815, "hidden_size": 4096, "intermediate_size": 11264, "num_hidden_layers": 45,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_dropout": 0.0, "num_experts_per_tok": 8,
    "n_routed_experts": 288, "moe_intermediate_size": 1280, "share_expert_dim": 1280, "sliding_window": None,
    "attention_bias": False, "moe_router_scaling_factor": 1.0, "mlp_bias": False, "gating": True,
    "use_bidirectional_attention": False, "num_nextn_predict_layers": 0}
#: the config's ``attribute_map``: a released ``config.json``'s names of the keys read here
ALIASES = {"n_routed_experts": ("moe_num_experts", "num_local_experts"), "num_experts_per_tok": ("moe_top_k",),
           "share_expert_dim": ("share_expert_dims",), "num_key_value_heads": ("num_attention_groups",),
           "num_nextn_predict_layers": ("num_mtp_layers",)}


def _split_mtp_entries(out: HFConfig, n: int) -> None:
    """A released config's per-layer lists padded with the MTP layers' entries: the first ``n`` are
    the model's, the rest go to ``mtp_*`` (``layer_types``, ``mlp_layer_types``) or are dropped
    (the limits, ``rope_theta``, ``partial_rotary_factors``), as transformers splits them
    (configuration 181-205)."""
    padded = n + out.req("num_nextn_predict_layers")
    for key, mtp_key in (("layer_types", "mtp_layer_types"), ("mlp_layer_types", "mtp_mlp_layer_types"),
                         ("swiglu_limits", None), ("swiglu_limits_shared", None), ("rope_theta", None),
                         ("partial_rotary_factors", None)):
        value = out.raw(key)
        if padded > n and isinstance(value, list) and len(value) == padded:
            out.data[key] = value[:n]
            if mtp_key is not None:
                out.data[mtp_key] = value[n:]


def _mlp_types(out: HFConfig, n: int) -> None:
    """``mlp_layer_types`` (and the MTP layers') from a released ``moe_layers_enum`` (the sparse layer
    indices), by default sparse from layer 3 on: the MTP layers then dense (configuration 213-225)."""
    if out.raw("mlp_layer_types") is not None:
        return
    padded = n + out.req("num_nextn_predict_layers")
    enum = out.raw("moe_layers_enum")
    items = enum.split(",") if isinstance(enum, str) else enum
    sparse = set(range(3, n)) if enum is None else {int(i) for i in items if str(i).strip()}
    types = ["sparse" if i in sparse else "dense" for i in range(padded)]
    out.data["mlp_layer_types"] = types[:n]
    if padded > n and out.raw("mtp_mlp_layer_types") is None:
        out.data["mtp_mlp_layer_types"] = types[n:]


def _rope_parameters(out: HFConfig, kinds: list[str]) -> None:
    """``rope_parameters`` keyed by layer kind: a saved config's as they are, else built from the
    per-layer ``rope_theta`` / ``partial_rotary_factors`` (each kind its first layer's; configuration
    268-290)."""
    given = out.raw("rope_parameters") or {}
    theta, factors = out.data.pop("rope_theta", 10000.0), out.data.pop("partial_rotary_factors", None)
    if isinstance(given, dict) and all(isinstance(given.get(k), dict) for k in set(kinds)):
        return
    params: dict[str, Any] = {}
    for kind in sorted(set(kinds)):
        i = kinds.index(kind)
        params[kind] = {"rope_type": "default", "rope_theta": theta[i] if isinstance(theta, list) else theta}
        if factors:
            params[kind]["partial_rotary_factor"] = factors[i]
    scaling = out.raw("rope_scaling")
    if isinstance(scaling, dict) and "full_attention" in params:
        params["full_attention"].update(scaling)
    out.data["rope_parameters"] = params


def _limits(out: HFConfig, key: str, n: int) -> list[float]:
    """A per-layer SwiGLU limit list (0 or ``None``: none), ``n`` zeros when absent."""
    value = out.raw(key)
    if value is None:
        return [0.0] * n
    if not isinstance(value, list) or len(value) != n or any(
            isinstance(v, bool) or not isinstance(v, (int, float, type(None))) for v in value):
        raise out.unsupported(f"{key}={value!r} (supported: a list of {n} numbers or None)")
    if any(v is not None and v < 0 for v in value):
        raise out.unsupported(f"{key}={value!r} (a negative limit)")
    return [float(v or 0.0) for v in value]


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as ``Step3p7TextConfig.__post_init__`` reads it (a released ``config.json``'s names and
    padded lists too; :data:`DEFAULTS` where absent), the options attnzoo cannot reproduce refused."""
    data = dict(hf.data)
    for key, names in ALIASES.items():
        if data.get(key) is None:
            data[key] = next((data[a] for a in names if data.get(a) is not None), None)
            if data[key] is None:
                del data[key]
    out = HFConfig(data, hf.source, hf.arch).with_defaults(DEFAULTS)
    n = out.req("num_hidden_layers")
    _split_mtp_entries(out, n)
    if out.raw("layer_types") is None:
        out.data["layer_types"] = [TYPES[0]] * n
        if out.req("num_nextn_predict_layers") and out.raw("mtp_layer_types") is None:
            out.data["mtp_layer_types"] = [TYPES[0]] * out.req("num_nextn_predict_layers")
    _mlp_types(out, n)
    kinds = parts.layer_types(out, n, TYPES)
    parts.layer_types(out, n, ("dense", "sparse"), key="mlp_layer_types")
    _rope_parameters(out, kinds)
    if out.raw("query_pre_attn_scalar") is None:
        out.data["query_pre_attn_scalar"] = out.req("head_dim")
    out.data["swiglu_limits"], out.data["swiglu_limits_shared"] = (
        _limits(out, k, n) for k in ("swiglu_limits", "swiglu_limits_shared"))
    parts.unsupported_keys(out, {"use_bidirectional_attention": lambda v: not v, "mlp_bias": lambda v: not v,
                                 "pretraining_tp": lambda v: v in (None, 1),
                                 "gating": lambda v: v is True or v == "per-head"})
    return out


def layer_heads(hf: HFConfig, kinds: list[str]) -> list[int]:
    """Each layer's query heads. A config with ``per_layer_config`` (a saved one: layer index, as
    transformers writes it zero-padded, -> overrides) says them alone, ``num_attention_heads`` where it
    says nothing; without it (a released config) ``num_sliding_attention_heads`` (or
    ``attention_other_setting``) on the sliding layers, ``num_attention_heads`` on the others
    (configuration 227-246: the per-layer config defaults to those, ``setdefault``). Overrides of other
    keys, and ``mtp_per_layer_config``, are refused by name."""
    H = hf.req("num_attention_heads")
    if hf.get("mtp_per_layer_config", None, dict):
        raise hf.unsupported(f"mtp_per_layer_config={hf.raw('mtp_per_layer_config')!r} (supported: none)")
    given = hf.get("per_layer_config", None, dict)
    if given is None:
        other = hf.get("attention_other_setting", None, dict) or {}
        sliding = hf.raw("num_sliding_attention_heads") or other.get("num_attention_heads", H)
        return [int(sliding if kind == "sliding_attention" else H) for kind in kinds]
    per_layer: dict[int, Any] = {}
    for key, override in given.items():
        if not str(key).isdigit() or not isinstance(override, dict) or set(override) - {"num_attention_heads"}:
            raise hf.unsupported(f"per_layer_config[{key!r}]={override!r} (supported: a layer index -> "
                                 f"{{'num_attention_heads': n}})")
        per_layer[int(key)] = override
    return [int(per_layer.get(i, {}).get("num_attention_heads", H)) for i in range(len(kinds))]


def _attention(hf: HFConfig, kind: str, heads: int, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """A layer's attention: its heads, QK norms, scale, the window of a sliding layer, the sigmoid gate."""
    view = HFConfig({**hf.data, "num_attention_heads": heads}, hf.source, hf.arch)
    window = parts.sliding_windows(hf, [kind])[0]
    return parts.attention_factory(view, window=window, rope=rope_of_kind(hf, kind), qk_norm="head",
                                   scale=float(hf.req("query_pre_attn_scalar", float)) ** -0.5, output_gate="head", **kw)


def _mlp(dim: int, hidden: int, limit: float, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """A SwiGLU MLP, clipped by ``limit`` when it is not 0."""
    if limit:
        return functools.partial(LimitedSwiGLU, dim, hidden, limit, **kw)
    return parts.gated_mlp(dim, hidden, "swiglu", **kw)


def _ffn(hf: HFConfig, sparse: bool, i: int, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """Layer ``i``'s feed-forward factory: the MoE (``sparse``) or the dense MLP, with layer ``i``'s limits."""
    C, limit = hf.req("hidden_size"), hf.req("swiglu_limits", list)[i]
    shared_limit = hf.req("swiglu_limits_shared", list)[i]
    if not sparse:
        return _mlp(C, hf.req("intermediate_size"), shared_limit, kw)
    routing = Routing("sigmoid_topk", norm_topk_prob=True, norm_eps=0.0,
                      scaling=hf.req("moe_router_scaling_factor", float))
    experts = Experts("limited_swiglu", swiglu_limit=limit) if limit else None
    shared = _mlp(C, hf.req("share_expert_dim"), shared_limit, kw)
    return lambda: MixtureOfExperts(C, hf.req("moe_intermediate_size"), hf.req("n_routed_experts"),
                                    hf.req("num_experts_per_tok"), routing=routing, experts=experts,
                                    shared_expert=shared(), **kw)


def mtp_kinds(hf: HFConfig, mtp: int) -> tuple[list[str], list[str]]:
    """The first ``mtp`` entries of ``mtp_layer_types`` and ``mtp_mlp_layer_types`` (default: full
    attention, a MoE), each checked."""
    kinds, mlps = hf.get("mtp_layer_types", None, list), hf.get("mtp_mlp_layer_types", None, list)
    for key, value, allowed in (("mtp_layer_types", kinds, TYPES), ("mtp_mlp_layer_types", mlps, ("dense", "sparse"))):
        if value is not None and (len(value) < mtp or any(v not in allowed for v in value)):
            raise hf.unsupported(f"{key}={value!r} for {mtp} multi-token-prediction layers (supported: "
                                 f"at least {mtp} entries of {', '.join(map(repr, allowed))})")
    return (list(kinds or [TYPES[0]] * mtp)[:mtp], list(mlps or ["sparse"] * mtp)[:mtp])


def _predictor(hf: HFConfig, mtp: int, kw: dict[str, Any]) -> MultiTokenPredictor:
    """The ``mtp`` multi-token-prediction layers, as transformers' ``get_mtp_config`` builds them
    (module docstring): layer ``k`` of ``mtp_layer_types[k]`` / ``mtp_mlp_layer_types[k]``."""
    C, eps = hf.req("hidden_size"), hf.req("rms_norm_eps", float)
    kinds, mlps = mtp_kinds(hf, mtp)
    if mtp > hf.req("num_hidden_layers"):
        raise hf.unsupported(f"{mtp} multi-token-prediction layers for {hf.req('num_hidden_layers')} layers "
                             f"(transformers' take the limits of the model's first layers)")
    norm = parts.rms_norm(C, eps, **kw)
    return MultiTokenPredictor([MTPLayer(C, parts.block(
        C, _attention(hf, kind, hf.req("num_attention_heads"), kw), _ffn(hf, m == "sparse", k, kw), norm), norm, **kw)
        for k, (kind, m) in enumerate(zip(kinds, mlps, strict=True))])


def build_step3p7(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None,
                  mtp: int = 0) -> DecoderLM:
    """The decoder of a ``Step3p7TextConfig`` (random weights; see the module docstring), with ``mtp``
    multi-token-prediction layers."""
    hf = canonical(hf)
    C, depth = hf.req("hidden_size"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    heads = layer_heads(hf, kinds)
    blocks = [parts.block(C, _attention(hf, kind, heads[i], kw), _ffn(hf, m == "sparse", i, kw),
                          parts.rms_norm(C, eps, **kw))
              for i, (kind, m) in enumerate(zip(kinds, hf.req("mlp_layer_types", list), strict=True))]
    predictor = _predictor(hf, mtp, kw) if mtp else None
    model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, mtp=predictor, **kw)
    return parts.float32_scale_norms(model, keep_float32=True)  # (1 + w) in float32, as transformers


# --------------------------------------------------------------------------- weights
def _put_ffn(plan: Plan, ours: str, theirs: str, sparse: bool) -> None:
    """A dense MLP, or the MoE in memory (``mlp.gate``, ``mlp.experts``, ``mlp.shared_experts``) or
    saved (``moe.*``, ``share_expert``)."""
    if not sparse:
        parts.put_mlp(plan, ours, f"{theirs}mlp.")
        return
    if plan.src.has(f"{theirs}moe.gate.weight"):  # the saved / released names
        moe = f"{theirs}moe."
        plan.put(f"{ours}router.weight", f"{moe}gate.weight")
        plan.put(f"{ours}score_bias", f"{moe}router_bias")
        for name in ("gate_proj", "up_proj", "down_proj"):
            plan.put(f"{ours}{name}", f"{moe}{name}.weight")
        parts.put_mlp(plan, f"{ours}shared_expert.", f"{theirs}share_expert.")
        return
    mlp = f"{theirs}mlp."
    plan.put(f"{ours}router.weight", f"{mlp}gate.weight")
    plan.put(f"{ours}score_bias", f"{mlp}gate.e_score_correction_bias")
    put_stacked_experts(plan, ours, mlp)
    parts.put_mlp(plan, f"{ours}shared_expert.", f"{mlp}shared_experts.")


def _put_layer(plan: Plan, ours: str, theirs: str, sparse: bool, bias: bool) -> None:
    """A decoder layer: attention (every RMSNorm ``w + 1``), the gate, the feed-forward, the norms."""
    parts.put_attention(plan, f"{ours}attn", f"{theirs}self_attn.", bias=bias, qk_norm=True,
                        norm_transform=parts.plus_one)
    plan.put(f"{ours}attn.frontier.gate_proj.weight", f"{theirs}self_attn.g_proj.weight")
    _put_ffn(plan, f"{ours}ffn.", theirs, sparse)
    for o, t in parts.PRE_NORMS:
        plan.put(f"{ours}{o}.weight", f"{theirs}{t}.weight", parts.plus_one)


def convert_step3p7(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; a folder's MTP layers loaded)."""
    hf = canonical(hf)
    depth, prefix = hf.req("num_hidden_layers"), parts.head_size_of(hf, sd)[0]
    sd = _without_transformer_infix(sd, depth)
    mtp = parts.mtp_depths(hf, sd, lambda k: f"{prefix}layers.{depth + k}.eh_proj.weight")
    model, plan, head_size = parts.start(hf, sd, functools.partial(build_step3p7, mtp=mtp), device=device,
                                         dtype=dtype)
    bias = hf.req("attention_bias", bool)
    for i, kind in enumerate(hf.req("mlp_layer_types", list)):
        _put_layer(plan, f"blocks.{i}.", f"layers.{i}.", kind == "sparse", bias)
    mlps = mtp_kinds(hf, mtp)[1]
    for k in range(mtp):
        ours, theirs = f"mtp.layers.{k}.", f"layers.{depth + k}."
        for name in ("enorm", "hnorm"):
            plan.put(f"{ours}{name}.weight", f"{theirs}{name}.weight", parts.plus_one)
        plan.put(f"{ours}eh_proj.weight", f"{theirs}eh_proj.weight")
        plan.put(f"{ours}post_norm.weight", f"{theirs}shared_head.norm.weight", parts.plus_one)
        _put_layer(plan, f"{ours}block.", theirs, mlps[k] == "sparse", bias)
    heads = [rf"(model\.)?layers\.{depth + k}\.shared_head\.output\.weight" for k in range(mtp)]
    return parts.finish(plan, model, head_size, norm_transform=parts.plus_one,
                        ignore=[*parts.layers_past(sd, depth + mtp), *parts.mtp_copies(depth, mtp), *heads])


def _without_transformer_infix(sd: dict[str, Tensor], depth: int) -> dict[str, Tensor]:
    """``sd`` with the released MTP layers' ``layers.{L + k}.transformer.*`` names (their
    ``shared_head`` and norms, as vLLM's ``step3p5_mtp.py`` reads them) as ``layers.{L + k}.*``."""
    out = {}
    for key, value in sd.items():
        m = parts.LAYER_KEY.match(key)
        out[key.replace(".transformer.", ".", 1) if m and int(m.group(1)) >= depth else key] = value
    return out


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"step3p5": parts.Dispatch("Step-3.7-Flash", convert_step3p7, ("Step3p7TextModel",))}
