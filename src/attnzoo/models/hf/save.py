"""attnzoo -> Hugging Face: a converted model's weights written back in its checkpoint's layout.

Every converter of :func:`~attnzoo.interop.from_hf` / :func:`~attnzoo.interop.load_pretrained` maps
checkpoint tensors onto the model's parameters through a :class:`~attnzoo.models.hf._state.Plan`
of copies, slices, concatenations, transposes and affine steps (Gemma's ``1 + w`` norms, folded
multipliers, zero padding): ``y = T(x) = J x + b`` in which every parameter element comes from at
most one checkpoint element (``y_j = a_j x_i + b_j``). The inverse is read off the converter
itself, so one function serves every family: ``b = T(0)``, ``a = T(1) - T(0)``, and by autograd
through the converter's own transforms ``x_i = sum_j a_j (y_j - b_j) / sum_j a_j^2`` (the least
squares solution, exact when the elements that share a source agree). The result is checked by
converting it again: a parameter that no checkpoint gives (a zero padding or constant that
training moved, two copies of one checkpoint tensor that drifted apart, a converter step that is
not of that form) is refused by name. Checkpoint elements the model has no counterpart for (a
dropped multi-token-prediction layer, rotary buffers) keep their values.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.models.config import Rope
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.hf._state import HFConfig, recorded_plans
from attnzoo.models.hf.convert import MODEL_TYPES, _build, read_config
from attnzoo.models.hf.errors import WeightLoadError
from attnzoo.models.hf.safetensors import INSTALL_HINT, load_state_dict_from_folder

__all__ = ["ExportError", "hf_config", "save_pretrained", "to_hf"]

#: files of a checkpoint folder that hold weights (replaced by ``save_pretrained``, not copied)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


class ExportError(WeightLoadError):
    """An attnzoo model whose parameters no checkpoint of the target architecture converts to
    (the message names the parameter, its checkpoint source and how far it is)."""


def _planned(model_type: str, hf: HFConfig, sd: Mapping[str, Tensor], strict_prefix: bool) -> dict[str, Any]:
    """``{parameter name: (tensor, checkpoint source)}`` of the conversion of ``sd`` (the model
    built on the meta device, nothing copied): the tensors keep their autograd history from ``sd``."""
    with recorded_plans() as plans:
        _build(model_type, hf, dict(sd), "meta", None, strict_prefix=strict_prefix)
    values: dict[str, Any] = {}
    for plan in plans:
        values.update(plan.values)
    return values


def _targets(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters and persistent buffers (what a plan fills)."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    for name, buf in model.named_buffers():
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if attr not in getattr(mod, "_non_persistent_buffers_set", set()):
            out[name] = buf.detach()
    return out


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _check_matches(values: Mapping[str, Any], targets: Mapping[str, Tensor], arch: str, what: str) -> None:
    missing = sorted(n for n in values if n not in targets)
    shapes = [f"{n}: {tuple(targets[n].shape)} vs {tuple(t.shape)} ({src})"
              for n, (t, src) in values.items() if n in targets and targets[n].shape != t.shape]
    extra = sorted(n for n in targets if n not in values)
    if missing or shapes or extra:
        detail = "; ".join(s for s in (f"parameters it lacks {missing[:5]}" if missing else "",
                                       f"shapes that differ {shapes[:5]}" if shapes else "",
                                       f"parameters the {arch} layout has no source for {extra[:5]}" if extra else "")
                           if s)
        raise ExportError(f"{what}: the attnzoo model is not a conversion of this {arch} architecture ({detail})")


def _solve(values0: Mapping[str, Any], values1: Mapping[str, Any], targets: Mapping[str, Tensor],
           leaves: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """``{checkpoint key: (x, covered)}``: the least-squares inverse of the planned map at the
    model's parameters, and which elements of each checkpoint tensor some parameter reads."""
    outs, num_out, den_out = [], [], []
    for name, (t0, _) in values0.items():
        if t0.requires_grad:
            y = targets[name].to(t0.dtype)
            outs.append(t0)
            num_out.append(y - t0.detach())
            t1 = values1[name][0].to(t0.dtype)
            den_out.append(torch.where(t1 == t0.detach(), 0.0, t1 - t0.detach()))  # constants (inf too): 0
    keys = list(leaves)
    if not outs:
        return {}
    inputs = [leaves[k] for k in keys]
    num = torch.autograd.grad(outs, inputs, num_out, retain_graph=True, allow_unused=True)
    den = torch.autograd.grad(outs, inputs, den_out, allow_unused=True)
    solved: dict[str, tuple[Tensor, Tensor]] = {}
    for key, n, d in zip(keys, num, den, strict=True):
        if n is None or d is None:
            continue
        covered = d != 0
        if covered.any():
            solved[key] = (torch.where(covered, n / torch.where(covered, d, torch.ones_like(d)), 0.0), covered)
    return solved


def _verify(values: Mapping[str, Any], values0: Mapping[str, Any], targets: Mapping[str, Tensor],
            eps: float, arch: str, what: str) -> None:
    """Every parameter equal to the conversion of the solved checkpoint, to rounding."""
    worst: tuple[float, str, str] | None = None
    for name, (got, src) in values.items():
        y = targets[name].to(torch.float64)
        got = got.detach().to(torch.float64)
        base = values0[name][0].detach().to(torch.float64)
        bound = 4 * eps * (y.abs() + (y - base).abs() + base.abs()) + 1e-30
        off = ((got - y).abs() > bound) & (got != y)  # equal infinities match
        if bool(off.any()):
            err = float((got - y).abs().nan_to_num(nan=float("inf")).max())
            if worst is None or err > worst[0]:
                worst = (err, name, src)
    if worst is not None:
        err, name, src = worst
        raise ExportError(f"{what}: parameter {name!r} (from {src}) cannot be written as {arch} weights: no "
                          f"checkpoint converts to it (off by up to {err:.3g}). A part the conversion fixes "
                          "(a zero padding, a constant) has changed, or two parameters read from one checkpoint "
                          "tensor now differ")


def _aliases(sd: Mapping[str, Tensor]) -> dict[str, str]:
    """Each key -> the first key viewing the same memory the same way (transformers' tied blocks
    and embeddings share one tensor under several names)."""
    first: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    out = {}
    for key, t in sd.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        out[key] = first.setdefault(ident, key) if t.device.type != "meta" and t.numel() else key
    return out


def _solve_with(model: nn.Module, model_type: str, hf: HFConfig, sd: Mapping[str, Tensor], fixed: set[str], *,
                what: str, strict_prefix: bool) -> dict[str, Tensor]:
    """:func:`_invert` with the checkpoint tensors ``fixed`` held at their values (not solved for)."""
    arch = MODEL_TYPES.get(model_type, model_type)
    alias = _aliases(sd)
    floats = {k: v for k, v in sd.items() if v.is_floating_point() and k not in fixed and alias[k] == k}
    work = torch.float64 if any(v.dtype == torch.float64 for v in floats.values()) else torch.float32

    def probe(tensors: Mapping[str, Tensor]) -> dict[str, Any]:
        return _planned(model_type, hf, {k: tensors.get(alias[k], v) for k, v in sd.items()}, strict_prefix)

    targets = _targets(model)
    with torch.inference_mode(False), torch.enable_grad():  # the probe differentiates, whatever the caller's mode
        leaves = {k: torch.zeros(v.shape, dtype=work, requires_grad=True) for k, v in floats.items()}
        values0 = probe(leaves)
        _check_matches(values0, targets, arch, what)
        with torch.no_grad():
            values1 = probe({k: torch.ones(v.shape, dtype=work) for k, v in floats.items()})
        solved = _solve(values0, values1, targets, leaves)
    del values1
    out = {}
    with torch.no_grad():
        for key, (x, covered) in solved.items():
            out[key] = torch.where(covered, x, floats[key].to(work)).to(floats[key].dtype)
        again = probe(out)
    eps = max([_eps(work), *(_eps(t.dtype) for t in out.values())])
    _verify(again, values0, targets, eps, arch, what)
    kept = {k: sd[k] for k in fixed}  # read as they are: not left unwritten
    return {**kept, **{k: out[alias[k]] for k in sd if alias[k] in out}}


def _invert(model: nn.Module, model_type: str, hf: HFConfig, sd: Mapping[str, Tensor], *, what: str,
            strict_prefix: bool = False) -> dict[str, Tensor]:
    """The checkpoint tensors (keys and dtypes of ``sd``) whose conversion is ``model``'s
    parameters: the keys some parameter reads, each tensor whole (elements no parameter reads keep
    ``sd``'s values). A converter that multiplies a weight by a learned scalar (Inkling's
    ``gate.global_scale`` folded into the experts) is affine once the scalars are held: tried
    second, with the scalars kept as they are, when the first solution does not verify."""
    try:
        return _solve_with(model, model_type, hf, sd, set(), what=what, strict_prefix=strict_prefix)
    except ExportError as first:
        scalars = {k for k, v in sd.items() if v.is_floating_point() and v.numel() == 1}
        if not scalars:
            raise
        try:
            return _solve_with(model, model_type, hf, sd, scalars, what=what, strict_prefix=strict_prefix)
        except ExportError:
            raise first from None


#: a DeepSeek-V3-layout MTP layer's copies of the embedding and the head: ``(layer, name)``
_MTP_COPY = re.compile(r"(?:model\.)?layers\.(\d+)\.(embed_tokens|shared_head\.head)\.weight")


def _with_mtp_copies(model: nn.Module, sd: Mapping[str, Tensor], written: dict[str, Tensor]) -> dict[str, Tensor]:
    """``written`` with the MTP layers' copies of the embedding and the head (unread: transformers'
    ``MtpModel`` and attnzoo read the model's) set to ``model``'s embedding / head, as the released
    checkpoints hold them, so that other readers of the copies see the model's weights."""
    if getattr(model, "mtp", None) is None:
        return written
    weights = {"embed_tokens": getattr(getattr(model, "tok_emb", None), "weight", None),
               "shared_head.head": getattr(getattr(model, "lm_head", None), "weight", None)}
    for key, old in sd.items():
        m = _MTP_COPY.fullmatch(key)
        new = None if m is None or key in written else weights[m.group(2)]
        if isinstance(new, Tensor) and new.shape == old.shape:
            written[key] = new.detach().to(old.dtype, copy=True)
    return written


@contextlib.contextmanager
def _without_mtp(model: nn.Module, what: str) -> Iterator[None]:
    """``model`` seen without its multi-token-prediction layers (``mtp``), with a warning: a
    transformers model has no place for them (transformers reads them from the checkpoint folder
    when ``generate(use_mtp=True)`` asks)."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        yield
        return
    warnings.warn(f"{what}: the model's multi-token-prediction layers (mtp.*) are not written: a transformers "
                  f"model does not hold them; save_pretrained(model, folder, like=checkpoint) writes them",
                  stacklevel=4)
    model.mtp = None
    try:
        yield
    finally:
        model.mtp = mtp


def _uncovered(sd: Mapping[str, Tensor], written: Mapping[str, Tensor]) -> list[str]:
    """Floating checkpoint tensors the export left as they were (tied copies of written ones and
    empty tensors, e.g. DINOv2's register table of zero registers, aside)."""
    shared = {t.untyped_storage().data_ptr() for k, t in sd.items() if k in written and t.device.type != "meta"}
    return sorted(k for k, t in sd.items() if t.is_floating_point() and t.numel() and k not in written
                  and t.untyped_storage().data_ptr() not in shared)


def _warn_kept(what: str, kept: list[str]) -> None:
    kept = [k for k in kept if "rotary_emb" not in k and not k.endswith("inv_freq")]
    if kept:
        warnings.warn(f"{what}: {len(kept)} checkpoint tensors have no counterpart in the attnzoo model and keep "
                      f"their values: {kept[:6]}{' ...' if len(kept) > 6 else ''}", stacklevel=3)


#: the attention modules a native model may have, for :func:`hf_config` (name -> has a window)
_PLAIN_ATTENTION = {"MultiHeadAttention": False, "GroupedQueryAttention": False, "MultiQueryAttention": False,
                    "SlidingWindowAttention": True}


def _refuse_native(why: str) -> ExportError:
    return ExportError(f"hf_config: {why}; a native DecoderLM exports as LLaMA (pos='rope', norm='rms', "
                       "ffn='swiglu'), Mistral (the same with attention='sliding'), GPT-NeoX (pos='rope', "
                       "norm='layer', ffn='gelu', bias=True, attention='mha': the arena's models) or GPT-2 "
                       "(pos='learned', norm='layer', ffn='gelu_tanh', bias=True, attention='mha')")


def _attention_shape(model: DecoderLM) -> tuple[int, int | None]:
    """``(num_kv_heads, left window or None)``, the same in every layer, of plain softmax attention."""
    shapes = set()
    for block in model.blocks:
        attn = getattr(block, "attn", None)
        kind = type(attn).__name__
        if kind not in _PLAIN_ATTENTION or getattr(block, "cross_attn", None) is not None:
            raise _refuse_native(f"a layer's attention is {kind} (plain softmax attention only)")
        if getattr(attn, "scale", None) is not None or getattr(attn, "softcap", None) is not None:
            raise _refuse_native(f"a layer's attention has a custom scale or softcap ({kind})")
        window = attn.window[0] if _PLAIN_ATTENTION[kind] else None
        shapes.add((attn.num_kv_heads, window))
    if len(shapes) != 1:
        raise _refuse_native(f"the layers differ in key/value heads or window: {sorted(shapes, key=str)}")
    return shapes.pop()


def _rope_keys(rope: Rope) -> dict[str, Any]:
    if rope.parameters is not None:
        return {"rope_parameters": dict(rope.parameters)}
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": rope.base}
    if rope.scaling == "linear":
        params.update(rope_type="linear", factor=rope.factor)
    return {"rope_parameters": params}


#: attnzoo feed-forward activations -> BERT's ``hidden_act``
_BERT_ACTS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def _refuse_encoder(why: str) -> ExportError:
    return ExportError(f"hf_config: {why}; a native TransformerEncoder exports as BERT (pos='learned', "
                       "norm='layer', norm_first=False, embed_norm, no final norm, bias=True, attention='mha', "
                       "type_vocab_size >= 1, ffn gelu / gelu_tanh / relu / silu, no parts given)")


def _bert_config(model: TransformerEncoder) -> dict[str, Any]:
    """The ``BertConfig`` (as a dict) of a native encoder of BERT's architecture, and its class in
    ``"architectures"`` (``BertModel``, ``BertForMaskedLM`` or ``BertForSequenceClassification``)."""
    cfg = model.config
    if model.embedding is not None or model.given_blocks:
        raise _refuse_encoder("the model was built from given parts")
    kinds = (cfg.pos, cfg.norm, cfg.norm_first, isinstance(model.embed_norm, nn.LayerNorm),
             isinstance(model.norm, nn.Identity), cfg.bias, cfg.attention, cfg.attention_kwargs, cfg.embed_scale)
    if kinds != ("learned", "layer", False, True, True, True, "mha", None, None) or not cfg.type_vocab_size \
            or cfg.ffn not in _BERT_ACTS:
        raise _refuse_encoder(f"pos={cfg.pos!r}, norm={cfg.norm!r}, norm_first={cfg.norm_first}, ffn={cfg.ffn!r}, "
                              f"bias={cfg.bias}, attention={cfg.attention!r}, type_vocab_size={cfg.type_vocab_size}")
    if cfg.mlm_head and cfg.pooler:
        raise _refuse_encoder("a pooler and a masked-LM head together (BertForPreTraining adds a next-sentence head)")
    arch = "BertForSequenceClassification" if cfg.num_labels else "BertForMaskedLM" if cfg.mlm_head else "BertModel"
    out = {"model_type": "bert", "architectures": [arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
           "num_hidden_layers": cfg.depth, "num_attention_heads": cfg.num_heads,
           "intermediate_size": model.blocks[0].ffn.hidden, "hidden_act": _BERT_ACTS[cfg.ffn],
           "max_position_embeddings": cfg.max_seq_len, "type_vocab_size": cfg.type_vocab_size,
           "layer_norm_eps": cfg.norm_eps, "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": 0.0}
    return {**out, "num_labels": cfg.num_labels} if cfg.num_labels else out


def hf_config(model: nn.Module) -> dict[str, Any]:
    """The ``transformers`` config (a dict for ``transformers.AutoConfig.for_model(**d)``) of the
    Hugging Face family whose conversion has the architecture of a native :class:`~attnzoo.DecoderLM`
    (one built from a :class:`~attnzoo.models.DecoderConfig`, e.g. by the arena or a preset): LLaMA
    (``pos='rope'``, ``norm='rms'``, ``ffn='swiglu'``; MHA, GQA or MQA), Mistral (the same with
    ``attention='sliding'``), GPT-NeoX with sequential residuals (``pos='rope'``, ``norm='layer'``,
    ``ffn='gelu'``, ``bias=True``, MHA: the arena's language models) or GPT-2 (``pos='learned'``,
    ``norm='layer'``, ``ffn='gelu_tanh'``, ``bias=True``, MHA); of a native
    :class:`~attnzoo.TransformerEncoder` of BERT's architecture (learned positions, post-norm
    LayerNorm, an embedding norm, token types, biases, MHA): BERT, its class in ``"architectures"``
    (``BertModel`` with or without the pooler, ``BertForMaskedLM``, ``BertForSequenceClassification``).
    :func:`to_hf` with no ``hf_model`` builds it and checks the outputs.

    Raises:
        TypeError: ``model`` is not a ``DecoderLM`` or ``TransformerEncoder``.
        ExportError: an architecture none of them has (named: the attention kind, a softcap, a
            position or norm or feed-forward kind, given parts).
    """
    if isinstance(model, TransformerEncoder):
        return _bert_config(model)
    if not isinstance(model, DecoderLM):
        raise TypeError(f"hf_config: model must be a DecoderLM or a TransformerEncoder, got {type(model).__name__}")
    cfg = model.config
    kv_heads, window = _attention_shape(model)
    shared = {"vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.depth, "tie_word_embeddings": cfg.tie_embeddings}
    ffn_hidden = model.blocks[0].ffn.hidden
    kinds = (cfg.resolved_pos, cfg.norm, cfg.ffn)
    if kinds == ("rope", "rms", "swiglu"):
        out = {"model_type": "mistral" if window is not None else "llama", **shared, "hidden_size": cfg.dim,
               "intermediate_size": ffn_hidden, "num_attention_heads": cfg.num_heads,
               "num_key_value_heads": kv_heads, "head_dim": model.head_dim, "max_position_embeddings": cfg.max_seq_len,
               "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", **_rope_keys(cfg.rope)}
        if window is not None:
            return {**out, "sliding_window": window + 1}
        return {**out, "attention_bias": cfg.bias, "mlp_bias": cfg.bias}
    plain = cfg.bias and kv_heads == cfg.num_heads and window is None and model.head_dim * cfg.num_heads == cfg.dim
    if kinds == ("rope", "layer", "gelu") and plain and cfg.rope.parameters is None:
        rope = {**_rope_keys(cfg.rope)["rope_parameters"], "partial_rotary_factor": 1.0}
        return {"model_type": "gpt_neox", **shared, "hidden_size": cfg.dim, "num_attention_heads": cfg.num_heads,
                "intermediate_size": ffn_hidden, "hidden_act": "gelu", "max_position_embeddings": cfg.max_seq_len,
                "layer_norm_eps": cfg.norm_eps, "use_parallel_residual": False, "attention_bias": True,
                "rope_parameters": rope}
    if kinds == ("learned", "layer", "gelu_tanh") and plain:
        return {"model_type": "gpt2", **shared, "n_embd": cfg.dim, "n_head": cfg.num_heads,
                "n_layer": cfg.depth, "n_positions": cfg.max_seq_len, "n_inner": ffn_hidden,
                "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new"}
    raise _refuse_native(f"pos={cfg.resolved_pos!r}, norm={cfg.norm!r}, ffn={cfg.ffn!r}, bias={cfg.bias}")


def to_hf(model: nn.Module, hf_model: nn.Module | None = None) -> nn.Module:
    """Write an attnzoo model's weights into a ``transformers`` model of the architecture it was
    converted from (the inverse of :func:`~attnzoo.interop.from_hf`): afterwards
    ``from_hf(hf_model)`` has ``model``'s parameters, so both give the same logits.

    The typical use: convert, fine-tune with attnzoo (packed sequences, any backend), write back,
    ``hf_model.save_pretrained(folder)``. ``hf_model`` is changed in place (its dtype kept) and
    returned; its tensors the attnzoo model has no counterpart for (a dropped multi-token-prediction
    layer) keep their values, with a warning.

    Args:
        model: the attnzoo model (its parameters in any dtype).
        hf_model: a ``transformers`` model whose ``from_hf`` conversion has ``model``'s parameter
            names and shapes (the same config; a fresh ``AutoModelForCausalLM.from_config`` will do).

    Raises:
        TypeError: ``model`` or ``hf_model`` is not an ``nn.Module`` / has no Hugging Face config.
        ValueError: ``hf_model``'s ``model_type`` is not converted by attnzoo.
        ExportError: the model does not fit ``hf_model``'s architecture (names and shapes listed),
            or a parameter no checkpoint converts to (named).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_hf: model must be an nn.Module, got {type(model).__name__}")
    if hf_model is None:
        return _native_to_hf(model)
    if not isinstance(hf_model, nn.Module):
        raise TypeError(f"to_hf: hf_model must be an nn.Module or None, got {type(hf_model).__name__}")
    name = type(hf_model).__name__
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"to_hf: hf_model ({name}) has no Hugging Face config")
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"to_hf: hf_model has model_type {model_type!r}; attnzoo converts {list(MODEL_TYPES)}")
    hf = HFConfig(config.to_dict(), f"{name}.config", MODEL_TYPES[model_type])
    sd = hf_model.state_dict()
    what = f"to_hf({name})"
    with _without_mtp(model, what):
        written = _invert(model, model_type, hf, {k: v.detach() for k, v in sd.items()}, what=what,
                          strict_prefix=name == "BertModel")
    with torch.no_grad():
        for key, value in written.items():
            sd[key].copy_(value)
    params = {n for n, _ in hf_model.named_parameters()}
    _warn_kept(what, [k for k in _uncovered(sd, written) if k in params])
    return hf_model


def _native_outputs(model: nn.Module, hf_model: nn.Module, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """``(ours, theirs)``: the logits, or for an encoder the output of its head (hidden states,
    masked-LM or classifier logits)."""
    with torch.no_grad():
        if not isinstance(model, TransformerEncoder):
            return model(tokens).float(), hf_model(input_ids=tokens).logits.float()
        hidden = model(tokens)
        r = hf_model(input_ids=tokens)
        if model.config.num_labels:
            return model.classify(hidden).float(), r.logits.float()
        if model.config.mlm_head:
            return model.mlm_logits(hidden).float(), r.logits.float()
        return hidden.float(), r.last_hidden_state.float()


def _native_to_hf(model: nn.Module) -> nn.Module:
    """:func:`to_hf` of a native ``DecoderLM`` / ``TransformerEncoder``: the family of
    :func:`hf_config`, built by transformers in the model's dtype, filled, and its outputs checked
    against the model's."""
    config = hf_config(model)
    try:
        import transformers
    except ImportError as e:
        raise ImportError("to_hf builds a transformers model: pip install 'attnzoo[hf]'") from e
    param = next(model.parameters())
    arch = config.pop("architectures", None)
    hf_config_obj = transformers.AutoConfig.for_model(**config)
    if arch is None:
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config_obj, dtype=param.dtype,
                                                                attn_implementation="eager")
    else:
        kw = {"add_pooling_layer": model.pooler is not None} if arch[0] == "BertModel" else {}
        hf_model = getattr(transformers, arch[0])._from_config(hf_config_obj, dtype=param.dtype,
                                                               attn_implementation="eager", **kw)
    to_hf(model, hf_model.to(param.device))
    tokens = torch.randint(0, config["vocab_size"], (1, min(16, model.max_seq_len)),
                           generator=torch.Generator().manual_seed(0)).to(param.device)
    was_training = model.training
    model.eval()
    hf_model.eval()
    ours, theirs = _native_outputs(model, hf_model, tokens)
    model.train(was_training)
    err = float((ours - theirs).abs().max() / ours.abs().max().clamp_min(1e-12))
    if err > (1e-4 if param.dtype in (torch.float32, torch.float64) else 3e-2):
        raise ExportError(f"to_hf: the {config['model_type']} model built for this {type(model).__name__} gives "
                          f"other outputs (max relative difference {err:.3g}): a part of the model hf_config "
                          "does not see")
    return hf_model


def save_pretrained(model: nn.Module, folder: str | os.PathLike[str], *,
                    like: str | os.PathLike[str] | None = None) -> Path:
    """Save an attnzoo model as a Hugging Face checkpoint folder. With ``like``, without
    ``transformers``: the layout (``config.json``, tensor names and dtypes) of the folder ``like``
    it was loaded from (:func:`~attnzoo.interop.load_pretrained`), the weights ``model``'s. ``folder``
    gets ``model.safetensors`` and a copy of every other file of ``like`` (config, tokenizer,
    generation config); ``load_pretrained(folder)`` then has ``model``'s parameters. Tensors the
    model has no counterpart for keep ``like``'s values (with a warning). Without ``like``, a native
    ``DecoderLM`` is saved as the family :func:`hf_config` names (``to_hf(model).save_pretrained``).

    Args:
        model: the attnzoo model.
        folder: the output folder (created; must not be ``like``).
        like: the checkpoint folder whose conversion has ``model``'s parameter names and shapes, or
            ``None`` for a native model.

    Returns:
        ``Path(folder)``.

    Raises:
        ImportError: the ``safetensors`` package is missing (``pip install safetensors``).
        ValueError: ``folder`` is ``like``, or ``like``'s ``model_type`` is not converted.
        ExportError: as :func:`to_hf`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_pretrained: model must be an nn.Module, got {type(model).__name__}")
    if like is None:
        to_hf(model).save_pretrained(folder)
        return Path(folder)
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(f"save_pretrained writes .safetensors files: {INSTALL_HINT}") from e
    src, dst = Path(like), Path(folder)
    hf = read_config(src)
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"save_pretrained: folder must differ from like ({str(src)!r}): the checkpoint is read "
                         "while the new one is written")
    model_type = hf.raw("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"save_pretrained: like has model_type {model_type!r} in {hf.source}; attnzoo converts "
                         f"{list(MODEL_TYPES)}")
    sd = load_state_dict_from_folder(src)
    what = f"save_pretrained(like={str(src)!r})"
    written = _with_mtp_copies(model, sd, _invert(model, model_type, hf, sd, what=what))
    _warn_kept(what, _uncovered(sd, written))
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name not in _WEIGHT_FILES and not item.name.endswith(".safetensors"):
            shutil.copy2(item, dst / item.name)
    tensors = {k: written.get(k, v).contiguous() for k, v in sd.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
