"""What the family converters share: typed access to a Hugging Face config and the plan that
maps checkpoint tensors onto an attnzoo model's parameters."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.models.hf.errors import CheckpointFormatError, UnsupportedConfigError, WeightLoadError

__all__ = ["HFConfig", "Plan", "Source", "float_dtype", "load_gate_up_into", "load_qkv_into", "recorded_plans",
           "transpose"]

_MISSING = object()
#: the open :func:`recorded_plans` lists, innermost last
_RECORDING: list[list[Plan]] = []


#: config keys that count or size something: an int ``>= 1`` wherever they are read
SIZE_KEYS = frozenset({"hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim",
                       "intermediate_size", "vocab_size", "max_position_embeddings", "n_embd", "n_head", "n_layer",
                       "n_positions", "n_inner", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                       "qk_rope_head_dim", "v_head_dim", "image_size", "patch_size", "num_channels"})


class HFConfig:
    """A Hugging Face config (the dict of ``config.json`` or ``PretrainedConfig.to_dict()``) with
    checked reads: a missing or mistyped key is a :class:`CheckpointFormatError` naming
    ``source`` (the file, or the model class) and the key.

    Args:
        data: the config mapping.
        source: where it came from, for messages (``"/path/config.json"``, ``"GPT2LMHeadModel.config"``).
        arch: the family name for unsupported-option messages (``"GPT-2"``).
    """

    def __init__(self, data: object, source: str, arch: str = "model") -> None:
        if not isinstance(data, Mapping):
            raise CheckpointFormatError(f"{source}: expected a JSON object (key -> value), got {type(data).__name__}")
        self.data = dict(data)
        self.source = source
        self.arch = arch

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as stored (``default`` when absent or ``None``)."""
        value = self.data.get(key)
        return default if value is None else value

    def _typed(self, key: str, value: Any, kind: type) -> Any:
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
              isinstance(value, int) and not isinstance(value, bool) if kind is int else isinstance(value, kind))
        if not ok:
            raise CheckpointFormatError(f"{self.source}: key {key!r} must be {kind.__name__}, got "
                                        f"{type(value).__name__} ({value!r})")
        if key in SIZE_KEYS and value < 1:  # a zero head count divides the width (ZeroDivisionError)
            raise CheckpointFormatError(f"{self.source}: key {key!r} must be >= 1, got {value!r}")
        return float(value) if kind is float else value

    def req(self, key: str, kind: type = int) -> Any:
        """A required key of type ``kind`` (``int``, ``float``, ``bool``, ``str``, ``dict``, ``list``)."""
        if self.data.get(key) is None:
            raise CheckpointFormatError(f"{self.source}: missing key {key!r} (needed to build the {self.arch} model)")
        return self._typed(key, self.data[key], kind)

    def get(self, key: str, default: Any, kind: type = int) -> Any:
        """An optional key: ``default`` when absent or ``None``, else checked against ``kind``."""
        value = self.data.get(key)
        return default if value is None else self._typed(key, value, kind)

    def first(self, keys: Sequence[str], default: Any, kind: type = int) -> Any:
        """The first of ``keys`` that is set, else ``default``."""
        for key in keys:
            if self.data.get(key) is not None:
                return self._typed(key, self.data[key], kind)
        return default

    def with_defaults(self, defaults: Mapping[str, Any]) -> HFConfig:
        """A copy whose keys absent or ``None`` take ``defaults`` (a ``config.json`` that leaves out
        its config class's defaults, read as transformers reads it); ``None`` values are dropped."""
        return HFConfig({**defaults, **{k: v for k, v in self.data.items() if v is not None}}, self.source, self.arch)

    def unsupported(self, what: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(f"{self.arch}: {what} is not supported by attnzoo.interop ({self.source})")

    def activation(self, key: str, table: Mapping[str, str], default: str = "gelu") -> str:
        """Map the activation named by ``key`` through ``table`` (HF name -> attnzoo name)."""
        act = self.get(key, default, str)
        if act not in table:
            raise self.unsupported(f"{key}={act!r} (supported: {sorted(table)})")
        return table[act]


class Source:
    """The checkpoint's tensors; records which keys were used and which were absent."""

    def __init__(self, sd: dict[str, Tensor], prefix: str = "") -> None:
        self.sd = sd
        self.prefix = prefix
        self.used: set[str] = set()
        self.missing: list[str] = []

    def has(self, key: str) -> bool:
        return self.prefix + key in self.sd

    def take(self, key: str) -> Tensor | None:
        full = self.prefix + key
        if full not in self.sd:
            self.missing.append(full)
            return None
        self.used.add(full)
        return self.sd[full]

    def opt(self, key: str) -> Tensor | None:
        full = self.prefix + key
        if full not in self.sd:
            return None
        self.used.add(full)
        return self.sd[full]


class Plan:
    """Target tensors for the attnzoo model's parameters, with the checkpoint key each came from."""

    def __init__(self, src: Source, arch: str) -> None:
        self.src = src
        self.arch = arch
        self.values: dict[str, tuple[Tensor, str]] = {}

    def put(self, name: str, key: str, transform: Callable[[Tensor], Tensor] | None = None,
            optional: bool = False) -> None:
        t = self.src.opt(key) if optional else self.src.take(key)
        if t is not None:
            self.values[name] = (t if transform is None else transform(t), self.src.prefix + key)

    def put_pairs(self, target: str, source: str, pairs: Iterable[tuple[str, str]], bias: bool = True) -> None:
        """``put`` ``{target}{ours}.weight`` (and ``.bias``) from ``{source}{theirs}`` for each pair."""
        for ours, theirs in pairs:
            self.put(f"{target}{ours}.weight", f"{source}{theirs}.weight")
            if bias:
                self.put(f"{target}{ours}.bias", f"{source}{theirs}.bias")

    def put_cat(self, name: str, keys: Sequence[str], transform: Callable[[Tensor], Tensor] | None = None) -> None:
        parts = [self.src.take(k) for k in keys]
        if all(p is not None for p in parts):
            t = torch.cat([p for p in parts if p is not None], dim=0)
            self.values[name] = (t if transform is None else transform(t),
                                 " + ".join(self.src.prefix + k for k in keys))

    def put_tensor(self, name: str, tensor: Tensor, desc: str) -> None:
        self.values[name] = (tensor, desc)

    def head(self, tied: bool, ignore: list[str]) -> None:
        """The LM head: ignored in the checkpoint when tied to the embeddings, else
        ``lm_head.weight`` (outside the base model's prefix)."""
        if tied:
            ignore.append(r"lm_head\.weight")
        else:
            self.src.prefix = ""
            self.put("lm_head.weight", "lm_head.weight")

    def _problems(self, params: dict[str, Tensor], ignore: Iterable[str]) -> list[str]:
        patterns = [re.compile(p) for p in ignore]
        mismatched = []
        for name, (t, key) in self.values.items():
            if name not in params:
                mismatched.append(f"{key} -> {name}: no such attnzoo parameter")
            elif tuple(t.shape) != tuple(params[name].shape):
                mismatched.append(f"{key}: checkpoint shape {tuple(t.shape)} vs attnzoo {name} "
                                  f"shape {tuple(params[name].shape)}")
        unfilled = sorted(n for n in params if n not in self.values)
        unexpected = sorted(k for k in self.src.sd if k not in self.src.used
                            and not any(p.fullmatch(k) for p in patterns))
        problems = []
        if self.src.missing:
            problems.append(f"missing checkpoint keys {sorted(self.src.missing)}")
        if unexpected:
            problems.append(f"unexpected checkpoint keys {unexpected}")
        if mismatched:
            problems.append(f"shape mismatches {mismatched}")
        if unfilled and not self.src.missing:
            problems.append(f"attnzoo parameters with no source {unfilled}")
        return problems

    def apply(self, model: nn.Module, ignore: Iterable[str] = ()) -> None:
        """Copy every planned tensor into ``model``; raise :class:`WeightLoadError` listing missing
        checkpoint keys, unexpected checkpoint keys, model parameters without a source and shape
        mismatches (all at once)."""
        params = dict(model.named_parameters())
        params.update({n: b for n, b in model.named_buffers() if _is_persistent(model, n)})
        problems = self._problems(params, ignore)
        if problems:
            raise WeightLoadError(f"cannot load {self.arch} weights: " + "; ".join(problems))
        if _RECORDING:
            _RECORDING[-1].append(self)
            return
        with torch.no_grad():
            for name, (t, _) in self.values.items():
                params[name].copy_(t)

    def apply_base(self, model: nn.Module, *, prefix: str, source: str, ignore: Iterable[str] = ()) -> None:
        """:meth:`apply` for an encoder converted from a ``*For*`` checkpoint: the keys outside the
        base model's ``prefix`` (``"roberta."``; ``""``: a base checkpoint, nothing to warn about)
        that no head of ``model`` took and ``ignore`` does not match (the task heads attnzoo has no
        equivalent for: QA, token classification, ...) are named in a ``UserWarning`` (``source``:
        the config file or model) and left out."""
        skip = list(ignore)
        heads = sorted(k for k in self.src.sd if prefix and not k.startswith(prefix) and k not in self.src.used
                       and not any(re.fullmatch(p, k) for p in skip))
        if heads:
            warnings.warn(f"{self.arch}: the task head weights {heads} have no attnzoo equivalent and are ignored "
                          f"({source})", stacklevel=5)
        self.apply(model, ignore=skip + [re.escape(k) for k in heads])


@contextmanager
def recorded_plans() -> Iterator[list[Plan]]:
    """Within this context, :meth:`Plan.apply` checks each plan against its model and appends it to
    the yielded list instead of copying: the planned tensors keep their autograd history from the
    checkpoint's (what :func:`~attnzoo.models.hf.save.to_hf` inverts)."""
    plans: list[Plan] = []
    _RECORDING.append(plans)
    try:
        yield plans
    finally:
        _RECORDING.pop()


def _is_persistent(model: nn.Module, name: str) -> bool:
    mod_name, _, buf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    return buf not in getattr(mod, "_non_persistent_buffers_set", set())


def transpose(x: Tensor) -> Tensor:
    """Conv1D ``[in, out]`` -> Linear ``[out, in]``."""
    return x.t()


def float_dtype(sd: Mapping[str, Tensor]) -> torch.dtype:
    """The dtype of the checkpoint's first floating-point tensor (float32 when none)."""
    for t in sd.values():
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def load_gate_up_into(plan: Plan, ours: str, key: str) -> None:
    """A fused ``gate_up_proj`` weight (rows ``[gate; up]``, Phi3 / GLM-4) at ``key`` into the
    ``{ours}gate_proj.weight`` and ``{ours}up_proj.weight`` of a gated feed-forward."""
    gate_up = plan.src.take(key)
    if gate_up is not None:
        gate, up = gate_up.chunk(2, dim=0)
        plan.put_tensor(f"{ours}gate_proj.weight", gate, f"{key}[:F]")
        plan.put_tensor(f"{ours}up_proj.weight", up, f"{key}[F:]")


def load_qkv_into(plan: Plan, prefix: str, keys: tuple[str, str, str], bias_keys: tuple[str, str, str] | None,
                  has_bias: bool) -> None:
    """Fill ``{prefix}.qkv_proj`` (rows ``[q; k; v]``) from three separate projections; when the
    module has biases but the checkpoint has none for q/k/v, they are zero."""
    plan.put_cat(f"{prefix}.qkv_proj.weight", keys)
    if not has_bias:
        return
    if bias_keys is not None and all(plan.src.has(k) for k in bias_keys):
        plan.put_cat(f"{prefix}.qkv_proj.bias", bias_keys)
        return
    ws = [plan.src.sd.get(plan.src.prefix + k) for k in keys]
    rows = sum(w.shape[0] for w in ws if w is not None)
    ref = next((w for w in ws if w is not None), None)
    if ref is not None:
        plan.put_tensor(f"{prefix}.qkv_proj.bias", torch.zeros(rows, dtype=ref.dtype), "zeros (no q/k/v bias)")
