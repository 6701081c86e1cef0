"""Transformer building blocks: ``RMSNorm``, ``FeedForward``, ``TransformerBlock`` and the
frozen configs they are described by (``Config``, ``BlockConfig``; the models' configs build on
them in :mod:`attnzoo.models.config`).

A :class:`TransformerBlock` is one residual layer built from layer factories
(:class:`BlockLayers`): a token mixer (any attention module of this library, chosen by
registry name, passed as an instance or built by a factory), optional cross-attention to a
``context`` (an encoder's output), and a feed-forward network, each wrapped in a normalisation
and a residual connection::

    pre-norm  (GPT-2, LLaMA, ViT):   x = x + attn(norm(x));   x = x + ffn(norm(x))
    post-norm (Transformer, BERT):   x = norm(x + attn(x));   x = norm(x + ffn(x))

LayerNorm is ``torch.nn.LayerNorm``. Weight names (used by ``attnzoo.interop``): ``attn_norm``,
``attn``, ``cross_norm``, ``cross_attn``, ``ffn_norm``, ``ffn`` (``up_proj``, ``gate_proj``,
``down_proj``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import (
    check_bool,
    check_choice,
    check_int,
    check_nonnegative_float,
    check_probability,
)
from attnzoo.masks import Mask
from attnzoo.masks import key_padding as key_padding_mask
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.cache import CompositeCache
from attnzoo.nn.frontier import packed_cu_seqlens
from attnzoo.nn.packing import check_packed_call, run_packed, run_packed_cross
from attnzoo.variants import build_attention, variant_names

__all__ = ["ACTIVATIONS", "NORMS", "BlockCache", "BlockConfig", "BlockLayers", "Config", "FeedForward", "RMSNorm",
           "TransformerBlock", "check_context_presence", "make_norm"]

def _gelu_tanh(x: Tensor) -> Tensor:
    """GELU's tanh approximation (a named function: modules holding it pickle, a lambda does not)."""
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: Tensor) -> Tensor:
    """CLIP's ``quick_gelu``: ``x * sigmoid(1.702 x)``, a sigmoid approximation of GELU (OpenAI's CLIP checkpoints)."""
    return x * torch.sigmoid(1.702 * x)


def _relu2(x: Tensor) -> Tensor:
    """Squared ReLU (So et al. 2021, "Primer"; Nemotron-H's MLPs): ``relu(x)^2``."""
    return torch.square(F.relu(x))


#: Activation names accepted by :class:`FeedForward`; the gated ones multiply ``act(gate(x))``
#: by ``up(x)`` (Shazeer 2020, "GLU variants improve Transformer").
ACTIVATIONS: dict[str, tuple[Callable[[Tensor], Tensor], bool]] = {
    "relu": (F.relu, False),
    "gelu": (F.gelu, False),  # exact (erf) GELU: BERT, ViT
    "gelu_tanh": (_gelu_tanh, False),  # GPT-2's "gelu_new"
    "quick_gelu": (_quick_gelu, False),  # CLIP
    "silu": (F.silu, False),
    "relu2": (_relu2, False),  # Nemotron-H, Primer
    "swiglu": (F.silu, True),  # LLaMA, Mistral
    "geglu": (F.gelu, True),
    "geglu_tanh": (_gelu_tanh, True),  # Gemma's gated gelu_pytorch_tanh
}
#: Where a pre-norm block normalises its sub-layers: ``"input"`` (GPT-2, LLaMA), ``"both"`` the
#: input and the output before the residual add (Gemma 2), ``"output"`` only the output (OLMo 2).
SUBLAYER_NORMS = ("input", "both", "output")
NORMS = ("layer", "rms")


def _check_input(x: object, dim: int, owner: str, name: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"{owner}: {name} must have shape [B, N, C] with C={dim}, got {tuple(x.shape)}")
    return x


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang & Sennrich 2019), as in LLaMA and Mistral.

    ``y = weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in float32 for
    half-precision inputs and cast back before the weight is applied (the LLaMA convention).

    Args:
        dim: normalised width ``C``.
        eps: added to the mean square.

    Shapes: ``[..., C] -> [..., C]``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim = check_int(dim, "dim", "RMSNorm")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"RMSNorm: eps must be a float >= 0, got {eps!r}")
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"RMSNorm: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: x must have shape [..., {self.dim}], got {tuple(x.shape)}")
        if not x.is_floating_point():  # an int input came back truncated to zeros
            raise TypeError(f"RMSNorm: x must be a floating-point tensor, got dtype {x.dtype}")
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, (self.dim,), self.weight.to(x.dtype), self.eps)
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y.to(x.dtype)).to(x.dtype)  # x's dtype under autocast too (float32 weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def make_norm(kind: str, dim: int, eps: float, *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> nn.Module:
    """``"layer"`` -> ``torch.nn.LayerNorm``; ``"rms"`` -> :class:`RMSNorm`."""
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps, device=device, dtype=dtype)
    if kind == "rms":
        return RMSNorm(dim, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


def default_ffn_hidden(dim: int, activation: str) -> int:
    """``4 * dim``; for gated activations ``2/3`` of that rounded up to a multiple of 8 (same
    parameter count as the ungated network, the LLaMA rule)."""
    if ACTIVATIONS[activation][1]:
        return 8 * math.ceil(8 * dim / 3 / 8)
    return 4 * dim


class FeedForward(nn.Module):
    """Position-wise feed-forward network.

    ``down(act(up(x)))``, or with a gated activation (``"swiglu"``, ``"geglu"``)
    ``down(act(gate(x)) * up(x))``; dropout on the hidden activations.

    Args:
        dim: model width ``C``.
        hidden: hidden width ``F``; default :func:`default_ffn_hidden`.
        activation: one of ``relu``, ``gelu`` (exact), ``gelu_tanh``, ``silu``, ``swiglu``,
            ``geglu``.
        bias: biases on the projections.
        dropout: dropout probability on the hidden activations.

    Weights: ``up_proj [F, C]``, ``gate_proj [F, C]`` (gated only), ``down_proj [C, F]``.
    Shapes: ``[B, N, C] -> [B, N, C]`` (any leading dimensions work).
    """

    def __init__(self, dim: int, hidden: int | None = None, activation: str = "gelu", *, bias: bool = True,
                 dropout: float = 0.0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim = check_int(dim, "dim", "FeedForward")
        self.activation = check_choice(activation, "activation", "FeedForward", choices=ACTIVATIONS)
        check_bool(bias, "bias", "FeedForward")
        self.hidden = default_ffn_hidden(dim, activation) if hidden is None else check_int(hidden, "hidden", "FeedForward")
        self.act, self.gated = ACTIVATIONS[activation]
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.up_proj = nn.Linear(dim, self.hidden, bias=bias, **kw)
        self.gate_proj = nn.Linear(dim, self.hidden, bias=bias, **kw) if self.gated else None
        self.down_proj = nn.Linear(self.hidden, dim, bias=bias, **kw)
        self.dropout = nn.Dropout(check_probability(dropout, "dropout", "FeedForward"))

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"FeedForward: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"FeedForward: x must have shape [..., {self.dim}], got {tuple(x.shape)}")
        if self.gate_proj is not None:
            h = self.act(self.gate_proj(x)) * self.up_proj(x)  # [B, N, F]
        else:
            h = self.act(self.up_proj(x))  # [B, N, F]
        return self.down_proj(self.dropout(h))  # [B, N, C]

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


AttentionSpec = str | nn.Module | Callable[[int, int], nn.Module]
Factory = Callable[[], nn.Module]


class Config:
    """Base of the frozen model and block configs (dataclasses): named presets, validated
    ``replace``, and :meth:`resolve`, which the model constructors' shape keywords go through.

    A subclass lists its presets in ``PRESETS`` (name -> field values); ``Cls.preset(name,
    **overrides)`` builds one. Every field is validated when a config is made, so a bad value
    fails where it is written, naming the field.
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def field_names(cls) -> list[str]:
        """The config's fields, in declaration order."""
        return [f.name for f in fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def _check_names(cls, names: Iterable[str], owner: str) -> None:
        known = cls.field_names()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise TypeError(f"{owner}: unknown option{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(repr(n) for n in unknown)}; {cls.__name__} fields are {known}")

    @classmethod
    def preset_names(cls) -> list[str]:
        """Names accepted by :meth:`preset`."""
        return list(cls.PRESETS)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Any:
        """The preset ``name`` with ``overrides`` applied (unknown field -> ``TypeError``)."""
        if not isinstance(name, str) or name not in cls.PRESETS:
            raise ValueError(f"{cls.__name__}.preset: unknown preset {name!r}; expected one of {cls.preset_names()}")
        cls._check_names(overrides, f"{cls.__name__}.preset")
        return cls(**{**cls.PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied and validated (unknown field -> ``TypeError``)."""
        self._check_names(changes, f"{type(self).__name__}.replace")
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (shallow: values are not copied)."""
        return {n: getattr(self, n) for n in self.field_names()}

    @classmethod
    def resolve(cls, config: object, owner: str, given: dict[str, Any]) -> Any:
        """The config a constructor builds from: ``config`` (or the field defaults) updated with
        the arguments in ``given`` that are not ``None`` (a constructor's explicit keywords default
        to ``None``: "not given", so the config's value stands)."""
        cls._check_names(given, owner)
        values = {k: v for k, v in given.items() if v is not None}
        for name, value in values.items():  # DecoderLM(cfg): a config where a size was expected
            if isinstance(value, Config):
                raise TypeError(f"{owner}: {name} got a {type(value).__name__}; pass a config as "
                                f"config=..., e.g. {owner}(config=cfg)")
        if config is None:
            missing = [f.name for f in fields(cls)  # type: ignore[arg-type]
                       if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
            if missing:
                raise TypeError(f"{owner}: {', '.join(missing)} must be given without config= "
                                f"(or pass config={cls.__name__}(...))")
            return cls(**values)
        if not isinstance(config, cls):
            raise TypeError(f"{owner}: config must be a {cls.__name__}, got {type(config).__name__}")
        return config.replace(**values) if values else config


def _picklable(value: object) -> bool:
    """Whether a config value survives ``pickle`` (names, modules and module-level functions do;
    a lambda or a local function does not)."""
    if isinstance(value, (str, nn.Module)) or value is None:
        return True
    try:
        pickle.dumps(value)
    except Exception:  # pickle raises PicklingError, AttributeError, TypeError, ... by object
        return False
    return True


def state_without_unpicklable_config(state: dict[str, Any]) -> dict[str, Any]:
    """A module's ``__getstate__`` dict with its ``config`` dropped (``None``) when an attention
    factory in it cannot be pickled, so ``torch.save(model)`` works as it does for the
    modules the factory built."""
    cfg = state.get("config")
    if isinstance(cfg, Config) and not all(_picklable(getattr(cfg, n, None)) for n in ("attention",
                                                                                      "encoder_attention")):
        state = {**state, "config": None}
    return state


def _frozen_kwargs(config: Any, name: str) -> None:
    """Store a private copy of a mapping field (``None`` stays), so the caller's dict can change."""
    value = getattr(config, name)
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise TypeError(f"{type(config).__name__}: {name} must be a dict, got {type(value).__name__}")
    object.__setattr__(config, name, dict(value))


@dataclass(frozen=True)
class BlockLayers:
    """The layer factories a :class:`TransformerBlock` is built from.

    ``attention``, ``feed_forward`` and ``cross_attention`` are called once; ``norm`` once per
    sub-layer (each gets its own weights). Each returns an ``nn.Module`` taking and returning
    ``[B, N, C]``; the attention module follows the attention protocol
    (``forward(x, *, mask=None, cache=None, positions=None)``, ``init_cache``).
    ``feed_forward=None`` builds a mixer-only layer (no feed-forward sub-layer and no norm for
    it: Mamba-2's and Nemotron-H's mixer layers).
    """

    attention: Factory
    feed_forward: Factory | None
    norm: Factory
    cross_attention: Factory | None = None
    norm_first: bool = True
    dropout: float = 0.0
    context_dim: int | None = None
    sublayer_norm: str = "input"


def build_mixer(attention: AttentionSpec, dim: int, num_heads: int, *, causal: bool,
                attention_kwargs: Mapping[str, Any] | None = None, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, owner: str = "TransformerBlock") -> nn.Module:
    """Build a token mixer from a registry name, a module instance or a ``(dim, num_heads)`` factory."""
    kwargs = dict(attention_kwargs or {})
    if isinstance(attention, str):
        if device is not None:
            kwargs.setdefault("device", device)
        if dtype is not None:
            kwargs.setdefault("dtype", dtype)
        return build_attention(attention, dim, num_heads, causal=causal, **kwargs)
    if isinstance(attention, nn.Module):
        return attention
    module = attention(dim, num_heads)
    if not isinstance(module, nn.Module):
        raise TypeError(f"{owner}: the attention factory must return an nn.Module, got {type(module).__name__}")
    return module


def check_attention_spec(attention: object, attention_kwargs: object, owner: str, *,
                         instance_ok: bool = True) -> None:
    """A registry name, a callable ``(dim, num_heads) -> nn.Module`` or (blocks only) a module;
    ``attention_kwargs`` only with a registry name."""
    if isinstance(attention, str):
        if attention not in variant_names():
            raise ValueError(f"{owner}: unknown attention {attention!r}; expected one of {variant_names()}, "
                             f"an nn.Module or a callable (dim, num_heads) -> nn.Module")
        return
    if isinstance(attention, nn.Module) and not instance_ok:
        raise TypeError(f"{owner}: attention must be a registry name or a callable (dim, num_heads) -> "
                        f"nn.Module (one module per layer), got an nn.Module instance")
    if not isinstance(attention, nn.Module) and not callable(attention):
        raise TypeError(f"{owner}: attention must be a registry name, an nn.Module or a callable, "
                        f"got {type(attention).__name__}")
    if attention_kwargs:
        raise ValueError(f"{owner}: attention_kwargs {sorted(attention_kwargs)} only apply when attention is a "
                         f"registry name")


@dataclass(frozen=True)
class BlockConfig(Config):
    """What one :class:`TransformerBlock` is: the argument set of the keyword constructor.

    Fields:
        dim, num_heads: width ``C`` and attention heads.
        attention: the self-attention: a registry name (``"mha"``, ``"gqa"``, ``"sliding"``, ...
            see :func:`attnzoo.variants.variant_names`), an ``nn.Module`` with the attention
            protocol, or a callable ``(dim, num_heads) -> nn.Module``.
        attention_kwargs: extra arguments for the registry builder (``window``, ``rope``,
            ``num_kv_heads``, ``bias``, ``dropout`` (on attention weights), ``head_dim``, ...).
        causal: causal self-attention (only used with a registry name).
        cross_attention: add a cross-attention sub-layer reading ``context``; ``context_dim`` its
            width (default ``dim``).
        norm: ``"layer"`` (``torch.nn.LayerNorm``) or ``"rms"`` (:class:`RMSNorm`); ``norm_eps``.
        norm_first: pre-norm (GPT/LLaMA/ViT) or post-norm (original Transformer, BERT).
        ffn: :class:`FeedForward` activation; ``ffn_hidden`` its hidden width.
        dropout: on each sub-layer's output (before the residual add) and in the FFN.
        bias: biases in the cross-attention and the FFN (the self-attention takes its own ``bias``
            from ``attention_kwargs``; registry modules default to ``True``).
        sublayer_norm: with ``norm_first``, which side of the self-attention and FFN sub-layers is
            normalised: ``"input"`` (default), ``"both"`` (also their outputs, before the
            residual add: ``attn_out_norm``, ``ffn_out_norm``; Gemma 2) or ``"output"`` (only the
            outputs; OLMo 2).
    """

    dim: int
    num_heads: int
    attention: AttentionSpec = "mha"
    attention_kwargs: Mapping[str, Any] | None = None
    causal: bool = False
    cross_attention: bool = False
    context_dim: int | None = None
    norm: str = "layer"
    norm_eps: float = 1e-5
    norm_first: bool = True
    ffn: str = "gelu"
    ffn_hidden: int | None = None
    dropout: float = 0.0
    bias: bool = True
    sublayer_norm: str = "input"

    def __post_init__(self) -> None:
        owner = "TransformerBlock"
        check_choice(self.sublayer_norm, "sublayer_norm", owner, choices=SUBLAYER_NORMS)
        if self.sublayer_norm != "input" and not self.norm_first:
            raise ValueError(f"{owner}: sublayer_norm={self.sublayer_norm!r} needs norm_first=True")
        _frozen_kwargs(self, "attention_kwargs")
        dim, heads = check_int(self.dim, "dim", owner), check_int(self.num_heads, "num_heads", owner)
        if dim % heads and not (self.attention_kwargs or {}).get("head_dim"):
            raise ValueError(f"{owner}: dim ({dim}) must be divisible by num_heads ({heads}), "
                             f"or pass attention_kwargs={{'head_dim': ...}}")
        check_choice(self.norm, "norm", owner, choices=NORMS)
        check_choice(self.ffn, "ffn", owner, choices=list(ACTIVATIONS))
        for name in ("causal", "cross_attention", "norm_first", "bias"):
            check_bool(getattr(self, name), name, owner)
        check_probability(self.dropout, "dropout", owner)
        check_nonnegative_float(self.norm_eps, "norm_eps", owner)
        if self.ffn_hidden is not None:
            check_int(self.ffn_hidden, "ffn_hidden", owner)
        if self.context_dim is not None:
            check_int(self.context_dim, "context_dim", owner)
            if not self.cross_attention:
                raise ValueError(f"{owner}: context_dim={self.context_dim} given but cross_attention=False")
        check_attention_spec(self.attention, self.attention_kwargs, owner)

    def layers(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> BlockLayers:
        """The layer factories this config describes (modules on ``device`` in ``dtype``)."""
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        akw = self.attention_kwargs or {}

        def attention() -> nn.Module:
            return build_mixer(self.attention, self.dim, self.num_heads, causal=self.causal, attention_kwargs=akw,
                               device=device, dtype=dtype)

        def cross() -> nn.Module:
            return build_attention("mha", self.dim, self.num_heads, kv_dim=self.context_dim or self.dim,
                                   head_dim=akw.get("head_dim"), bias=self.bias, causal=False, **kw)

        return BlockLayers(
            attention=attention,
            feed_forward=functools.partial(FeedForward, self.dim, self.ffn_hidden, self.ffn, bias=self.bias,
                                           dropout=self.dropout, **kw),
            norm=functools.partial(make_norm, self.norm, self.dim, self.norm_eps, **kw),
            cross_attention=cross if self.cross_attention else None,
            norm_first=self.norm_first, dropout=self.dropout,
            context_dim=(self.context_dim or self.dim) if self.cross_attention else None,
            sublayer_norm=self.sublayer_norm)


class TransformerBlock(nn.Module):
    """One transformer layer: self-attention, optional cross-attention, feed-forward.

    Built from layer factories (:class:`BlockLayers`), or from a :class:`BlockConfig`, or from
    the common fields as keywords (``attention``, ``attention_kwargs``, ``causal``, ``norm``,
    ``ffn``, ``norm_first``; the others, e.g. ``cross_attention``, ``ffn_hidden``, ``dropout``,
    ``sublayer_norm``, through ``config=``)::

        TransformerBlock(64, 4, attention="gqa", causal=True, norm="rms", ffn="swiglu")
        TransformerBlock(config=BlockConfig(64, 4, norm_first=False, cross_attention=True))
        TransformerBlock(64, layers=BlockLayers(attention=..., feed_forward=..., norm=...))

    Args:
        dim: model width ``C``.
        num_heads: attention heads (not used with ``layers``).
        attention, attention_kwargs, causal, norm, ffn, norm_first: the :class:`BlockConfig`
            fields of the same names; ``None`` (the default) keeps the config's value (or the
            field's default without a config).
        config: a :class:`BlockConfig`; the keywords above override its fields.
        layers: the factories to build from (then neither ``config`` nor the keywords).
        device, dtype: of the parameters built from a config.

    Shapes: ``x [B, N, C]``, ``context [B, M, context_dim]`` -> ``[B, N, C]``.
    """

    def __init__(self, dim: int | None = None, num_heads: int | None = None, *,
                 attention: AttentionSpec | None = None, attention_kwargs: Mapping[str, Any] | None = None,
                 causal: bool | None = None, norm: str | None = None, ffn: str | None = None,
                 norm_first: bool | None = None, config: BlockConfig | None = None, layers: BlockLayers | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = "TransformerBlock"
        self.config: BlockConfig | None = None
        given = {"dim": dim, "num_heads": num_heads, "attention": attention, "attention_kwargs": attention_kwargs,
                 "causal": causal, "norm": norm, "ffn": ffn, "norm_first": norm_first}
        if layers is None:
            self.config = BlockConfig.resolve(config, owner, given)
            layers = self.config.layers(device=device, dtype=dtype)
            dim, num_heads = self.config.dim, self.config.num_heads
        elif config is not None or any(v is not None for v in list(given.values())[2:]):
            extra = sorted(k for k, v in list(given.items())[2:] if v is not None)
            raise TypeError(f"{owner}: layers=... builds the block by itself; config and the keywords {extra} "
                            f"cannot be combined with it")
        elif not isinstance(layers, BlockLayers):
            raise TypeError(f"{owner}: layers must be a BlockLayers, got {type(layers).__name__}")
        self.dim = check_int(dim, "dim", owner)
        self.norm_first = check_bool(layers.norm_first, "norm_first", owner)
        self.attn_norm = _built(layers.norm, "norm", owner)
        self.attn = _built(layers.attention, "attention", owner)
        self.num_heads: int | None = num_heads if num_heads is not None else getattr(self.attn, "num_heads", None)
        self.cross_norm: nn.Module | None = None
        self.cross_attn: nn.Module | None = None
        if layers.cross_attention is not None:
            self.cross_norm = _built(layers.norm, "norm", owner)
            self.cross_attn = _built(layers.cross_attention, "cross_attention", owner)
        self.context_dim = None if self.cross_attn is None else (layers.context_dim or self.dim)
        self.ffn_norm: nn.Module | None = None
        self.ffn: nn.Module | None = None
        if layers.feed_forward is not None:  # None: a mixer-only layer
            self.ffn_norm = _built(layers.norm, "norm", owner)
            self.ffn = _built(layers.feed_forward, "feed_forward", owner)
        self.attn_out_norm, self.ffn_out_norm = _sublayer_norms(layers, self, owner)
        self.dropout = nn.Dropout(check_probability(layers.dropout, "dropout", owner))

    def __getstate__(self) -> dict[str, Any]:
        return state_without_unpicklable_config(super().__getstate__())

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        """The decode cache: the self-attention's cache, or with cross-attention a
        :class:`BlockCache` that also keeps the context's projected keys/values (computed on the
        first call; one cache serves one context, ``reset()`` before another)."""
        self_cache = self.attn.init_cache(batch_size, max_len, device=device, dtype=dtype)
        if self.cross_attn is None:
            return self_cache
        return BlockCache(self_cache, device=device, dtype=dtype)

    def _self_only(self, x: Tensor, context: Tensor | None, context_mask: Any, mask: Any,
                   key_padding: Tensor | None) -> Any:
        """For a block subclass without cross-attention (a parallel or differently-normed layer):
        check ``x [B, N, C]`` and that no context was given (``ValueError`` naming the class), and
        return ``mask`` combined with ``key_padding`` (:meth:`_self_mask`)."""
        owner = type(self).__name__
        if context is not None or context_mask is not None:
            raise ValueError(f"{owner}: no cross-attention; context and context_mask must be None")
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{owner}: x must be [B, N, C] with C={self.dim}, got {got}")
        return self._self_mask(mask, key_padding)

    def _self_mask(self, mask: Any, key_padding: Tensor | None) -> Any:
        """Combine a user mask with a key-padding mask ``[B, Nk]`` in the form the mixer takes: a
        ``[B, 1, 1, Nk]`` tensor for :class:`MultiHeadAttention` (the fused kernels' fast path),
        an :func:`attnzoo.masks.key_padding` ``Mask`` for other mixers (linear, performer, ...)."""
        if key_padding is None:
            return mask
        if not isinstance(self.attn, MultiHeadAttention) or isinstance(mask, Mask):
            kp_mask = key_padding_mask(key_padding)
            return kp_mask if mask is None else mask & kp_mask
        kp4 = key_padding[:, None, None, :]  # [B, 1, 1, Nk]
        if mask is None:
            return kp4
        if not isinstance(mask, Tensor):
            raise TypeError(f"TransformerBlock: mask must be a tensor or an attnzoo.masks.Mask, got {type(mask).__name__}")
        if mask.dtype == torch.bool:
            return mask & kp4
        return mask.masked_fill(~kp4, float("-inf"))

    def _mix(self, h: Tensor, mask: Any, cache: Any, positions: Tensor | None,
             cu_seqlens: Tensor | None = None) -> Tensor:
        if cu_seqlens is not None:  # the mixer's fused path, else one sequence at a time (attnzoo.nn.packing)
            cu = check_packed_call("TransformerBlock", h, cu_seqlens, mask=mask, cache=cache, positions=positions)
            return run_packed(self.attn, h, cu)
        kw: dict[str, Any] = {}
        if mask is not None:
            kw["mask"] = mask
        if cache is not None:
            kw["cache"] = cache
        if positions is not None:
            kw["positions"] = positions
        return self.attn(h, **kw)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Any = None,
        key_padding: Tensor | None = None,
        context_mask: Any = None,
        cache: Any = None,
        positions: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        context_cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """Args:
            x: ``[B, N, C]`` (with a cache: the new tokens only).
            context: ``[B, M, context_dim]``, required iff the block has cross-attention.
            mask: self-attention mask (bool True = attend, float bias, or ``az.masks.Mask``),
                applied on top of the mixer's own causal/window pattern.
            key_padding: ``[B, Nk]`` bool, True for real keys (``Nk = N``, or with a cache every
                token written so far plus the new ones); passed to the mixer in the form it takes.
            context_mask: cross-attention mask broadcastable to ``[B, H, N, M]`` (e.g. the
                context's key padding as ``[B, 1, 1, M]``).
            cache: the self-attention cache from :meth:`init_cache`.
            positions: absolute positions ``[N]`` or ``[B, N]`` for RoPE.
            cu_seqlens: packed sequences in ``x [1, T, C]`` (int32 ``[S+1]``), passed to the mixer.
            context_cu_seqlens: with ``cu_seqlens`` and cross-attention: ``context [1, Tk, context_dim]``
                holds ``S`` packed context sequences (int32 ``[S+1]``, the same ``S``); sequence ``i`` of
                ``x`` cross-attends to context sequence ``i`` only (an encoder-decoder's packed pairs).

        Returns: ``[B, N, C]``.
        """
        _check_input(x, self.dim, "TransformerBlock")
        context_cu_seqlens = self._check_context(x, context, context_cu_seqlens, cu_seqlens)
        if key_padding is not None:
            if not isinstance(key_padding, Tensor) or key_padding.dtype != torch.bool or key_padding.dim() != 2 \
                    or key_padding.shape[0] != x.shape[0]:
                got = (f"{tuple(key_padding.shape)} {key_padding.dtype}" if isinstance(key_padding, Tensor)
                       else type(key_padding).__name__)
                raise ValueError(f"TransformerBlock: key_padding must be a bool tensor [B, Nk] with B={x.shape[0]}, "
                                 f"got {got}")
            mask = self._self_mask(mask, key_padding)
        cross_cache = None
        if isinstance(cache, BlockCache):
            assert context is not None and self.cross_attn is not None
            cross_cache = cache.cross(self.cross_attn, context)
            cache = cache.self_cache
        drop = self.dropout
        packed = (cu_seqlens, context_cu_seqlens)
        if self.norm_first:
            x = x + drop(self.attn_out_norm(self._mix(self.attn_norm(x), mask, cache, positions, cu_seqlens)))
            if self.cross_attn is not None:
                assert self.cross_norm is not None
                x = x + drop(self._cross(self.cross_norm(x), context, context_mask, cross_cache, packed))
            if self.ffn is None:
                return x
            return x + drop(self.ffn_out_norm(self.ffn(self.ffn_norm(x))))
        x = self.attn_norm(x + drop(self._mix(x, mask, cache, positions, cu_seqlens)))
        if self.cross_attn is not None:
            assert self.cross_norm is not None
            x = self.cross_norm(x + drop(self._cross(x, context, context_mask, cross_cache, packed)))
        if self.ffn is None:
            return x
        return self.ffn_norm(x + drop(self.ffn(x)))

    def _check_context(self, x: Tensor, context: object, context_cu_seqlens: object,
                       cu_seqlens: object) -> Tensor | None:
        """``context`` given iff the block has cross-attention, ``[B, M, context_dim]`` with x's batch;
        ``context_cu_seqlens`` (returned validated, on x's device) with ``cu_seqlens`` exactly when a
        cross-attention block runs packed pairs."""
        owner = "TransformerBlock"
        if not check_context_presence(self.cross_attn is not None, context, context_cu_seqlens, owner,
                                      "the block", "build it with cross_attention=True"):
            return None
        context = _check_input(context, self.context_dim or self.dim, owner, "context")
        if context.shape[0] != x.shape[0]:
            raise ValueError(f"{owner}: context batch {context.shape[0]} != x batch {x.shape[0]}")
        if (cu_seqlens is None) != (context_cu_seqlens is None):
            raise ValueError(f"{owner}: packed cross-attention needs both cu_seqlens (x's sequences) and "
                             f"context_cu_seqlens (the context's), got only "
                             f"{'cu_seqlens' if context_cu_seqlens is None else 'context_cu_seqlens'}")
        if context_cu_seqlens is None:
            return None
        return packed_cu_seqlens(context_cu_seqlens, context, f"{owner} (context_cu_seqlens)")

    def _cross(self, h: Tensor, context: Tensor | None, context_mask: Any, cache: Any,
               packed: tuple[Tensor | None, Tensor | None] = (None, None)) -> Tensor:
        """The cross-attention sub-layer of ``h [B, N, C]``; ``packed``: ``(cu_seqlens,
        context_cu_seqlens)`` of packed pairs (then no ``context_mask`` or cache)."""
        assert self.cross_attn is not None and context is not None
        cu, context_cu = packed
        if cu is not None and context_cu is not None:
            cu = check_packed_call("TransformerBlock", h, cu, context_mask=context_mask, cache=cache)
            return run_packed_cross(self.cross_attn, h, context, cu, context_cu)
        if cache is None:
            return self.cross_attn(h, context, mask=context_mask)
        return self.cross_attn(h, context, mask=context_mask, cache=cache)


def check_context_presence(cross: bool, context: object, extra: object, owner: str, unit: str, hint: str) -> bool:
    """``context`` (and ``extra``, an argument that only goes with it: a context mask or lengths) given
    only to a ``unit`` with cross-attention (``cross``), and ``context`` always to one; ``ValueError``
    naming ``owner`` otherwise (``hint``: how to build one with cross-attention). Returns ``cross``."""
    if not cross and (context is not None or extra is not None):
        raise ValueError(f"{owner}: context given but {unit} has no cross-attention ({hint})")
    if cross and context is None:
        raise ValueError(f"{owner}: {unit} has cross-attention; pass context [B, M, C]")
    return cross


def _sublayer_norms(layers: BlockLayers, block: TransformerBlock, owner: str) -> tuple[nn.Module, nn.Module]:
    """The output norms of the self-attention and FFN sub-layers (``Identity`` unless
    ``sublayer_norm`` is ``"both"`` or ``"output"``); with ``"output"`` the input norms of
    ``block`` become ``Identity``."""
    kind = check_choice(layers.sublayer_norm, "sublayer_norm", owner, choices=SUBLAYER_NORMS)
    if kind == "input":
        return nn.Identity(), nn.Identity()
    if not layers.norm_first:
        raise ValueError(f"{owner}: sublayer_norm={kind!r} needs norm_first=True")
    if kind == "output":
        block.attn_norm = nn.Identity()
        block.ffn_norm = None if block.ffn is None else nn.Identity()
    return _built(layers.norm, "norm", owner), nn.Identity() if block.ffn is None else _built(layers.norm, "norm", owner)


def _built(factory: Callable[[], nn.Module], name: str, owner: str) -> nn.Module:
    """Call a layer factory and check that it made a module."""
    if not callable(factory):
        raise TypeError(f"{owner}: the {name} factory must be callable, got {type(factory).__name__}")
    module = factory()
    if not isinstance(module, nn.Module):
        raise TypeError(f"{owner}: the {name} factory must return an nn.Module, got {type(module).__name__}")
    return module


class BlockCache(CompositeCache):
    """Decode cache of a block with cross-attention: the self-attention's cache plus the
    context's keys/values (projected once, on the first call). Cache protocol: ``length`` and
    ``batch_size`` (of the self-attention cache), ``reset()`` (forgets the context too),
    ``mark()``/``rollback()``/``commit()`` over both (a rollback also forgets a context cache
    built after the mark)."""

    def __init__(self, self_cache: Any, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.self_cache = self_cache
        self.cross_cache: Any = None
        self._device, self._dtype = device, dtype

    @property
    def length(self) -> int:
        return int(self.self_cache.length)

    @property
    def batch_size(self) -> int:
        return int(self.self_cache.batch_size)

    def reset(self) -> None:
        self.self_cache.reset()
        self.cross_cache = None

    def parts(self) -> list[Any]:
        """The self-attention cache, and the context's once built."""
        return [self.self_cache] + ([] if self.cross_cache is None else [self.cross_cache])

    def sequence_parts(self) -> list[Any]:
        """The self-attention cache: the one that holds the block's tokens (the context's is kept
        when the tokens are truncated)."""
        return [self.self_cache]

    def mark(self) -> object:
        return (self.cross_cache, super().mark())

    def rollback(self, mark: object) -> None:
        if not isinstance(mark, tuple) or len(mark) != 2:
            raise TypeError(f"BlockCache.rollback: expected a mark from mark(), got {type(mark).__name__}")
        self.cross_cache = mark[0]
        super().rollback(mark[1])

    def commit(self, mark: object) -> None:
        if not isinstance(mark, tuple) or len(mark) != 2:
            raise TypeError(f"BlockCache.commit: expected a mark from mark(), got {type(mark).__name__}")
        super().commit(mark[1])

    def cross(self, module: nn.Module, context: Tensor) -> Any:
        """The cross-attention cache, built for ``context [B, M, C]`` on first use."""
        if self.cross_cache is None:
            self.cross_cache = module.init_cache(self.batch_size, context.shape[1], device=self._device,
                                                 dtype=self._dtype)
        return self.cross_cache
