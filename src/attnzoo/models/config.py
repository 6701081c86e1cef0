"""Frozen configs of the models, with named presets.

Each model is described by one dataclass; the model's keyword constructor is a thin front for
it (``DecoderLM(V, C, L, H, pos="learned")`` is ``DecoderLM(config=DecoderConfig(V, C, L, H,
pos="learned"))``), and presets name the published shapes::

    cfg = DecoderConfig.preset("llama", vocab_size=1000, dim=256, depth=4, num_heads=8, num_kv_heads=2)
    model = DecoderLM.from_config(cfg)

Presets: ``DecoderConfig`` ``gpt2`` (124M), ``llama`` (LLaMA-2 7B), ``mistral`` (Mistral 7B),
``arena_lm``, ``arena_mqar`` (the arena's models for its two tasks, default budget);
``EncoderConfig`` ``bert`` (BERT-base); ``ViTConfig`` ``vit_b16`` (ViT-B/16);
``Seq2SeqConfig`` ``transformer_base`` (Vaswani et al. base). :data:`PRESETS` maps every name
to its config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from attnzoo._validate import (
    check_bool,
    check_choice,
    check_int,
    check_nonnegative_float,
    check_positive_float,
    check_probability,
)
from attnzoo.blocks import (
    ACTIVATIONS,
    NORMS,
    AttentionSpec,
    Config,
    _frozen_kwargs,
    check_attention_spec,
)
from attnzoo.models._common import POSITIONS
from attnzoo.nn.positional import RotaryEmbedding, ScaledRotaryEmbedding
from attnzoo.variants import VARIANTS, layer_pattern

__all__ = ["PRESETS", "DecoderConfig", "EncoderConfig", "Rope", "Seq2SeqConfig", "ViTConfig"]

ROPE_SCALINGS = (None, "linear", "ntk")


def _check_common(cfg: Any, owner: str, names: tuple[str, ...], *, layered: bool = False) -> None:
    """Checks shared by the model configs, for the fields each one has (``layered``: ``attention``
    may be one entry per layer, see :func:`layer_entries`)."""
    for name in names:
        check_int(getattr(cfg, name), name, owner)
    check_choice(cfg.norm, "norm", owner, choices=NORMS)
    check_choice(cfg.ffn, "ffn", owner, choices=list(ACTIVATIONS))
    check_probability(cfg.dropout, "dropout", owner)
    check_nonnegative_float(cfg.norm_eps, "norm_eps", owner)
    if cfg.ffn_hidden is not None:
        check_int(cfg.ffn_hidden, "ffn_hidden", owner)
    _frozen_kwargs(cfg, "attention_kwargs")
    if layered and (isinstance(cfg.attention, (list, tuple)) or (isinstance(cfg.attention, str)
                                                                 and "/" in cfg.attention)):
        object.__setattr__(cfg, "attention", layer_entries(cfg.attention, cfg.depth, owner))
        if cfg.attention_kwargs and not all(isinstance(a, str) for a in cfg.attention):
            raise ValueError(f"{owner}: attention_kwargs {sorted(cfg.attention_kwargs)} only apply when every "
                             f"layer's attention is a registry name")
        return
    check_attention_spec(cfg.attention, cfg.attention_kwargs, owner, instance_ok=False)


def layer_entries(attention: object, depth: int, owner: str) -> tuple[AttentionSpec, ...]:
    """A per-layer attention stack as a tuple of ``depth`` entries.

    ``attention`` is a list/tuple with one entry per layer (a registry name or a callable
    ``(dim, num_heads) -> nn.Module``; ``len == depth``) or a ``/``-separated pattern of registry
    names cycled to the depth (``"gated_deltanet/gated_deltanet/gated_deltanet/mha"``, see
    :func:`attnzoo.variants.layer_pattern`)."""
    if isinstance(attention, str):
        try:
            return layer_pattern(attention, depth)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{owner}: attention pattern {attention!r}: {e}") from None
    entries = tuple(attention)  # type: ignore[arg-type]
    if len(entries) != depth:
        raise ValueError(f"{owner}: attention has {len(entries)} entries but depth={depth}; give one per layer "
                         f"(or a 'a/b/c' pattern string, cycled to the depth)")
    for i, entry in enumerate(entries):
        check_attention_spec(entry, None, f"{owner}: attention[{i}]", instance_ok=False)
    return entries


def resolve_positions(pos: str | None, attention: object, owner: str) -> str:
    """The position scheme of a decoder stack: ``pos`` checked against what its variants declare
    (:attr:`~attnzoo.nn.spec.VariantSpec.positions`), or, for ``pos=None``, the default they expect.

    ``"rope"`` needs at least one layer that applies a rotary embedding (a registry variant declaring
    ``positions="rope"``, or a callable, whose module decides); in a mixed stack it is applied to
    those layers, and the others keep their own order signal (decays, convolutions) or causality.
    Asking ``"rope"`` of a stack none of whose variants takes it is a ``ValueError`` naming them.
    The default is ``"rope"`` when some layer takes it, else ``"none"``."""
    entries = attention if isinstance(attention, tuple) else (attention,)
    names = [a for a in entries if isinstance(a, str)]
    takes = len(names) < len(entries) or any(VARIANTS[n].takes_rope() for n in names)
    if pos is None:
        return "rope" if takes else "none"
    check_choice(pos, "pos", owner, choices=POSITIONS)
    if pos == "rope" and not takes:
        kinds = {n: VARIANTS[n].positions for n in dict.fromkeys(names)}
        raise ValueError(f"{owner}: pos='rope' but no layer takes a rotary embedding: attention "
                         f"{' / '.join(f'{n!r} (positions: {k})' for n, k in kinds.items())}; use pos='none' "
                         f"(the default for these variants), 'learned' or 'sinusoidal'")
    return pos


def _check_optional_bool(cfg: Any, owner: str, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) is not None:
            check_bool(getattr(cfg, name), name, owner)


@dataclass(frozen=True)
class Rope:
    """The rotary embedding a :class:`DecoderConfig`'s layers share (with ``pos="rope"``).

    Fields:
        base: the frequency base (``rope_theta``; 10000 in RoFormer, 500000 in LLaMA 3).
        scaling: ``None``, ``"linear"`` (position interpolation) or ``"ntk"`` (NTK-aware base),
            by ``factor`` (``>= 1``); see :class:`~attnzoo.RotaryEmbedding`.
        parameters: a Hugging Face ``rope_parameters`` dict (``rope_type`` ``default``/``linear``/
            ``dynamic``/``yarn``/``llama3``/``longrope`` and its keys; ``rope_theta`` defaults to
            ``base``), replacing ``scaling``/``factor``: a
            :class:`~attnzoo.nn.positional.ScaledRotaryEmbedding`.

    ``DecoderConfig(rope=...)`` also takes a number (the base) or a Hugging Face dict.
    """

    base: float = 10000.0
    scaling: str | None = None
    factor: float = 1.0
    parameters: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        owner = "Rope"
        check_positive_float(self.base, "base", owner)
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"{owner}: scaling must be one of {list(ROPE_SCALINGS)}, got {self.scaling!r}")
        if check_positive_float(self.factor, "factor", owner) < 1:
            raise ValueError(f"{owner}: factor must be >= 1, got {self.factor}")
        if self.scaling is None and self.factor != 1:
            raise ValueError(f"{owner}: factor={self.factor} applies only with scaling='linear' or 'ntk' (scaling is "
                             f"None: the factor would be ignored)")
        _frozen_kwargs(self, "parameters")

    @classmethod
    def of(cls, value: object, owner: str = "DecoderConfig") -> Rope:
        """``value`` as a :class:`Rope`: a Rope, a number (the base), a dict of these fields (what
        :meth:`DecoderConfig.to_dict` writes) or a Hugging Face rope dict (``rope_type``, ...)."""
        if isinstance(value, Rope):
            return value
        if isinstance(value, Mapping) and value and set(value) <= set(ROPE_FIELDS):
            return cls(**value)
        if isinstance(value, Mapping):
            return cls(base=float(value.get("rope_theta") or 10000.0), parameters=value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls(base=float(value))
        raise TypeError(f"{owner}: rope must be a Rope, a number (the base) or a Hugging Face rope dict, "
                        f"got {type(value).__name__} ({value!r})")

    def module(self, width: int, max_seq_len: int) -> RotaryEmbedding:
        """The rotary embedding of ``width`` channels these settings describe."""
        if self.parameters is not None:
            return ScaledRotaryEmbedding(width, {"rope_theta": self.base, **self.parameters},
                                         max_position_embeddings=max_seq_len)
        return RotaryEmbedding(width, base=self.base, scaling=self.scaling, scaling_factor=self.factor)


ROPE_FIELDS = ("base", "scaling", "factor", "parameters")

#: The fields DecoderConfig had before the per-family options moved into the model's parts
#: (issue 32), with their defaults then; :meth:`DecoderConfig.from_dict` translates them.
LEGACY_DECODER_FIELDS: dict[str, Any] = {
    "rope_base": 10000.0, "rope_scaling": None, "rope_scaling_factor": 1.0, "rope_parameters": None,
    "norm_first": True, "final_norm": None, "embed_scale": None, "cross_attention": False, "context_dim": None,
    "qk_norm": None, "qk_norm_eps": 1e-6, "attn_softcap": None, "logit_softcap": None, "sublayer_norm": "input",
    "layer_windows": None, "head_size": None,
}
#: Where each removed field went (for the error of :meth:`DecoderConfig.from_dict`).
MOVED = {
    "norm_first": "the blocks (BlockConfig.norm_first, DecoderParts(blocks=...))",
    "final_norm": "DecoderParts(norm=...) (nn.Identity() for none)",
    "embed_scale": "DecoderParts(embedding=ScaledEmbedding(V, C, scale=...))",
    "cross_attention": "the blocks (BlockConfig(cross_attention=True, context_dim=...))",
    "context_dim": "the blocks (BlockConfig.context_dim)",
    "qk_norm": "the blocks' attention_kwargs (qk_norm=, qk_norm_eps=)",
    "qk_norm_eps": "the blocks' attention_kwargs (qk_norm_eps=)",
    "attn_softcap": "the blocks' attention_kwargs (softcap=)",
    "logit_softcap": "DecoderParts(head=LMHead(C, V, softcap=...))",
    "sublayer_norm": "the blocks (BlockConfig.sublayer_norm)",
    "layer_windows": "the blocks' attention_kwargs (window= per layer)",
    "head_size": "DecoderParts(head=nn.Linear(C, k, bias=False) or nn.Identity())",
}


def legacy_rope(values: Mapping[str, Any]) -> Rope:
    """The :class:`Rope` of a pre-issue-32 config dict's ``rope_base``/``rope_scaling``/
    ``rope_scaling_factor``/``rope_parameters``."""
    return Rope(base=values.get("rope_base", 10000.0), scaling=values.get("rope_scaling"),
                factor=values.get("rope_scaling_factor", 1.0), parameters=values.get("rope_parameters"))


@dataclass(frozen=True)
class DecoderConfig(Config):
    """A :class:`~attnzoo.DecoderLM`'s stack: the fields every decoder has (see its docstring).

    ``rope`` (a :class:`Rope`; a number is its base, a Hugging Face dict its ``parameters``)
    configures the shared rotary embedding. What differs between families is no field here but
    a part the model takes (:class:`~attnzoo.models.parts.DecoderParts`): blocks with
    cross-attention, QK norms, softcaps, per-layer windows or sub-layer output norms; a scaled
    embedding; a final norm or none; a soft-capped, classification or no head.
    :meth:`from_dict` reads a config dict saved before those fields moved.
    """

    vocab_size: int
    dim: int
    depth: int
    num_heads: int
    attention: AttentionSpec | tuple[AttentionSpec, ...] = "mha"
    attention_kwargs: Mapping[str, Any] | None = None
    num_kv_heads: int | None = None
    max_seq_len: int = 2048
    pos: str | None = None
    norm: str = "layer"
    ffn: str = "gelu"
    ffn_hidden: int | None = None
    tie_embeddings: bool = True
    dropout: float = 0.0
    bias: bool = True
    norm_eps: float = 1e-5
    head_dim: int | None = None
    rope: Rope = Rope()

    # not a field: Config declares PRESETS as a ClassVar
    PRESETS = {  # noqa: RUF012
        "gpt2": {"vocab_size": 50257, "dim": 768, "depth": 12, "num_heads": 12, "max_seq_len": 1024,
                 "pos": "learned", "norm": "layer", "ffn": "gelu_tanh", "tie_embeddings": True, "bias": True},
        "llama": {"vocab_size": 32000, "dim": 4096, "depth": 32, "num_heads": 32, "max_seq_len": 4096,
                  "pos": "rope", "norm": "rms", "norm_eps": 1e-5, "ffn": "swiglu", "ffn_hidden": 11008,
                  "tie_embeddings": False, "bias": False},
        "mistral": {"vocab_size": 32000, "dim": 4096, "depth": 32, "num_heads": 32, "num_kv_heads": 8,
                    "attention": "sliding", "attention_kwargs": {"window": 4095}, "max_seq_len": 32768,
                    "pos": "rope", "norm": "rms", "norm_eps": 1e-5, "ffn": "swiglu", "ffn_hidden": 14336,
                    "tie_embeddings": False, "bias": False},
        # the arena's models (attnzoo.arena.runner, default budget; the variant is chosen per run)
        "arena_lm": {"vocab_size": 76, "dim": 128, "depth": 2, "num_heads": 4, "max_seq_len": 128, "pos": "rope"},
        "arena_mqar": {"vocab_size": 64, "dim": 64, "depth": 2, "num_heads": 4, "max_seq_len": 67,
                       "pos": "learned"},
    }

    def __post_init__(self) -> None:
        owner = "DecoderLM"
        _check_common(self, owner, ("vocab_size", "dim", "depth", "num_heads", "max_seq_len"), layered=True)
        resolve_positions(self.pos, self.attention, owner)
        for name in ("tie_embeddings", "bias"):
            check_bool(getattr(self, name), name, owner)
        if self.head_dim is None and self.dim % self.num_heads:
            raise ValueError(f"{owner}: dim ({self.dim}) must be divisible by num_heads ({self.num_heads}), "
                             f"or pass head_dim")
        if self.head_dim is not None:
            check_int(self.head_dim, "head_dim", owner)
        if self.num_kv_heads is not None:
            check_int(self.num_kv_heads, "num_kv_heads", owner)
            if not isinstance(self.attention, str) and not (
                    isinstance(self.attention, tuple) and any(isinstance(a, str) for a in self.attention)):
                raise ValueError(f"{owner}: num_kv_heads only applies when attention is a registry name")
        object.__setattr__(self, "rope", Rope.of(self.rope, owner))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DecoderConfig:
        """The config of a field dict, also one saved before issue 32 (``to_dict()`` of the
        33-field config): ``rope_base``/``rope_scaling``/``rope_scaling_factor``/``rope_parameters``
        become ``rope``; the other removed fields are accepted at their old defaults. A removed
        field set otherwise describes a part of the model, not its config: ``ValueError`` naming
        it and where it went (:func:`attnzoo.models.legacy.decoder_from_dict` builds the whole
        model from such a dict)."""
        if not isinstance(values, Mapping):
            raise TypeError(f"DecoderConfig.from_dict: values must be a dict, got {type(values).__name__}")
        old = {k: values[k] for k in LEGACY_DECODER_FIELDS if k in values}
        parts = {k: v for k, v in old.items() if k in MOVED and v != LEGACY_DECODER_FIELDS[k]}
        if parts:
            where = "; ".join(f"{k}={v!r} -> {MOVED[k]}" for k, v in parts.items())
            raise ValueError(f"DecoderConfig.from_dict: {sorted(parts)} describe parts of the model, not its "
                             f"config ({where}); attnzoo.models.legacy.decoder_from_dict(values) builds the model")
        new = {k: v for k, v in values.items() if k not in LEGACY_DECODER_FIELDS}
        if "rope" not in new and any(k.startswith("rope_") for k in old):
            new["rope"] = legacy_rope(old)
        cls._check_names(new, "DecoderConfig.from_dict")
        return cls(**new)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, ``rope`` as a dict of its fields (so a config of names and
        numbers serialises as JSON; ``DecoderConfig(**d)`` and :meth:`from_dict` read it back)."""
        return {**super().to_dict(), "rope": {f: getattr(self.rope, f) for f in ROPE_FIELDS}}

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim``, or ``dim // num_heads`` when it is not set."""
        return self.dim // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def resolved_pos(self) -> str:
        """``pos``, or for ``pos=None`` what the layers' variants expect (see :func:`resolve_positions`)."""
        return resolve_positions(self.pos, self.attention, "DecoderLM")

    @property
    def layer_attention(self) -> tuple[AttentionSpec, ...]:
        """The attention entry of every layer (``depth`` entries)."""
        return self.attention if isinstance(self.attention, tuple) else (self.attention,) * self.depth


@dataclass(frozen=True)
class EncoderConfig(Config):
    """A :class:`~attnzoo.TransformerEncoder`: the fields are its keyword arguments (``num_labels``
    and ``mlm_head`` add BERT's sequence-classification and masked-LM heads)."""

    vocab_size: int
    dim: int
    depth: int
    num_heads: int
    max_seq_len: int = 512
    pos: str = "learned"
    type_vocab_size: int = 0
    attention: AttentionSpec = "mha"
    attention_kwargs: Mapping[str, Any] | None = None
    norm: str = "layer"
    norm_eps: float = 1e-5
    norm_first: bool = True
    embed_norm: bool | None = None
    final_norm: bool | None = None
    embed_scale: float | None = None
    ffn: str = "gelu"
    ffn_hidden: int | None = None
    dropout: float = 0.0
    bias: bool = True
    rope_base: float = 10000.0
    pooler: bool = False
    num_labels: int = 0
    mlm_head: bool = False

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "bert": {"vocab_size": 30522, "dim": 768, "depth": 12, "num_heads": 12, "max_seq_len": 512,
                 "pos": "learned", "type_vocab_size": 2, "norm": "layer", "norm_eps": 1e-12, "norm_first": False,
                 "embed_norm": True, "final_norm": False, "ffn": "gelu", "ffn_hidden": 3072, "pooler": True},
    }

    def __post_init__(self) -> None:
        owner = "TransformerEncoder"
        _check_common(self, owner, ("vocab_size", "dim", "depth", "num_heads", "max_seq_len"))
        check_int(self.type_vocab_size, "type_vocab_size", owner, minimum=0)
        resolve_positions(self.pos, self.attention, owner)
        for name in ("norm_first", "bias", "pooler", "mlm_head"):
            check_bool(getattr(self, name), name, owner)
        _check_optional_bool(self, owner, "embed_norm", "final_norm")
        check_int(self.num_labels, "num_labels", owner, minimum=0)
        if self.num_labels and not self.pooler:
            raise ValueError(f"{owner}: num_labels={self.num_labels} classifies the pooled output; set pooler=True")
        if self.embed_scale is not None:
            check_positive_float(self.embed_scale, "embed_scale", owner)
        check_positive_float(self.rope_base, "rope_base", owner)


@dataclass(frozen=True)
class Seq2SeqConfig(Config):
    """A :class:`~attnzoo.Transformer` (encoder-decoder): the fields are its arguments."""

    src_vocab_size: int
    tgt_vocab_size: int
    dim: int = 512
    num_heads: int = 8
    encoder_depth: int = 6
    decoder_depth: int = 6
    ffn: str = "relu"
    ffn_hidden: int | None = None
    norm: str = "layer"
    norm_eps: float = 1e-5
    norm_first: bool = False
    pos: str = "sinusoidal"
    max_seq_len: int = 1024
    dropout: float = 0.1
    bias: bool = True
    attention: AttentionSpec = "mha"
    attention_kwargs: Mapping[str, Any] | None = None
    encoder_attention: AttentionSpec | None = None
    tie_embeddings: bool = False

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "transformer_base": {"src_vocab_size": 37000, "tgt_vocab_size": 37000, "dim": 512, "num_heads": 8,
                             "encoder_depth": 6, "decoder_depth": 6, "ffn_hidden": 2048, "dropout": 0.1},
    }

    def __post_init__(self) -> None:
        owner = "Transformer"
        _check_common(self, owner, ("src_vocab_size", "tgt_vocab_size", "dim", "num_heads", "encoder_depth",
                                    "decoder_depth", "max_seq_len"))
        check_choice(self.pos, "pos", owner, choices=POSITIONS)
        for name in ("norm_first", "bias", "tie_embeddings"):
            check_bool(getattr(self, name), name, owner)
        if self.encoder_attention is not None:
            check_attention_spec(self.encoder_attention, None, owner, instance_ok=False)


@dataclass(frozen=True)
class ViTConfig(Config):
    """A :class:`~attnzoo.VisionTransformer`: the fields are its arguments."""

    image_size: int | tuple[int, int] = 224
    patch_size: int | tuple[int, int] = 16
    in_channels: int = 3
    num_classes: int = 1000
    dim: int = 768
    depth: int = 12
    num_heads: int = 12
    ffn: str = "gelu"
    ffn_hidden: int | None = None
    norm: str = "layer"
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    class_token: bool = True
    pool: str = "cls"
    pooler: bool = False
    dropout: float = 0.0
    attention: AttentionSpec = "mha"
    attention_kwargs: Mapping[str, Any] | None = None

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "vit_b16": {"image_size": 224, "patch_size": 16, "in_channels": 3, "num_classes": 1000, "dim": 768,
                    "depth": 12, "num_heads": 12, "ffn": "gelu", "ffn_hidden": 3072, "norm_eps": 1e-6},
    }

    def __post_init__(self) -> None:
        owner = "VisionTransformer"
        object.__setattr__(self, "image_size", _pair(self.image_size, "image_size", owner))
        object.__setattr__(self, "patch_size", _pair(self.patch_size, "patch_size", owner))
        for side, s, p in zip(("height", "width"), self.image_size, self.patch_size, strict=True):
            if s % p:
                raise ValueError(f"{owner}: image {side} {s} is not divisible by the patch size {p} "
                                 f"(image_size={self.image_size}, patch_size={self.patch_size})")
        _check_common(self, owner, ("in_channels", "dim", "depth", "num_heads"))
        check_int(self.num_classes, "num_classes", owner, minimum=0)
        for name in ("qkv_bias", "class_token", "pooler"):
            check_bool(getattr(self, name), name, owner)
        check_choice(self.pool, "pool", owner, choices=("cls", "mean"))
        if (self.pool == "cls" or self.pooler) and not self.class_token:
            raise ValueError(f"{owner}: pool='cls' and pooler=True need class_token=True")


def _pair(x: object, name: str, owner: str) -> tuple[int, int]:
    if isinstance(x, (tuple, list)) and len(x) == 2:
        return check_int(x[0], name, owner), check_int(x[1], name, owner)
    v = check_int(x, name, owner)
    return v, v


#: Every preset by name (names are unique across the config classes).
PRESETS: dict[str, Config] = {
    name: cls.preset(name)
    for cls in (DecoderConfig, EncoderConfig, Seq2SeqConfig, ViTConfig)
    for name in cls.PRESETS
}
