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

from attnzoo.blocks import (
    ACTIVATIONS,
    NORMS,
    SUBLAYER_NORMS,
    AttentionSpec,
    Config,
    _check_bool,
    _check_choice,
    _check_eps,
    _check_positive_float,
    _check_prob,
    _frozen_kwargs,
    check_attention_spec,
)
from attnzoo.models._common import POSITIONS, check_int
from attnzoo.variants import VARIANTS, layer_pattern

__all__ = ["PRESETS", "DecoderConfig", "EncoderConfig", "Seq2SeqConfig", "ViTConfig"]

ROPE_SCALINGS = (None, "linear", "ntk")


def _check_common(cfg: Any, owner: str, names: tuple[str, ...], *, layered: bool = False) -> None:
    """Checks shared by the model configs, for the fields each one has (``layered``: ``attention``
    may be one entry per layer, see :func:`layer_entries`)."""
    for name in names:
        check_int(getattr(cfg, name), name, owner)
    _check_choice(cfg.norm, "norm", NORMS, owner)
    _check_choice(cfg.ffn, "ffn", list(ACTIVATIONS), owner)
    _check_prob(cfg.dropout, "dropout", owner)
    _check_eps(cfg.norm_eps, "norm_eps", owner)
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
    _check_choice(pos, "pos", POSITIONS, owner)
    if pos == "rope" and not takes:
        kinds = {n: VARIANTS[n].positions for n in dict.fromkeys(names)}
        raise ValueError(f"{owner}: pos='rope' but no layer takes a rotary embedding: attention "
                         f"{' / '.join(f'{n!r} (positions: {k})' for n, k in kinds.items())}; use pos='none' "
                         f"(the default for these variants), 'learned' or 'sinusoidal'")
    return pos


def _check_optional_bool(cfg: Any, owner: str, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) is not None:
            _check_bool(getattr(cfg, name), name, owner)


@dataclass(frozen=True)
class DecoderConfig(Config):
    """A :class:`~attnzoo.DecoderLM`: the fields are its keyword arguments (see its docstring).

    ``rope_scaling`` (``None``, ``"linear"`` position interpolation or ``"ntk"``) and
    ``rope_scaling_factor`` (``>= 1``) configure the rotary embedding, next to ``rope_base``;
    ``rope_parameters`` (a Hugging Face dict: ``rope_type`` ``default``/``linear``/``dynamic``/
    ``yarn``/``llama3``/``longrope`` and its keys, ``rope_theta`` defaulting to ``rope_base``)
    replaces both.

    The options of the open-weight families (all off by default): ``qk_norm`` (``"head"``: RMSNorm
    of each query/key head, Qwen 3; ``"all"``: over all heads flattened, OLMo 2) with
    ``qk_norm_eps``; ``attn_softcap`` (attention scores ``c * tanh(s / c)``, Gemma 2);
    ``logit_softcap`` (the same on the output logits); ``sublayer_norm`` (``"input"``,
    ``"both"``, ``"output"``; see :class:`~attnzoo.blocks.BlockConfig`); ``layer_windows`` (one
    entry per layer: the left window of a causal sliding layer, or ``None`` for a full one;
    needs ``attention="mha"``); ``head_size`` (``None``: the LM head over ``vocab_size``;
    ``0``: no head, the model returns the final hidden states ``[B, N, C]``; ``k``: a
    ``k``-way per-token head, e.g. sequence classification read at the last token).
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
    rope_base: float = 10000.0
    rope_scaling: str | None = None
    rope_scaling_factor: float = 1.0
    head_dim: int | None = None
    norm_first: bool = True
    final_norm: bool | None = None
    embed_scale: float | None = None
    cross_attention: bool = False
    context_dim: int | None = None
    rope_parameters: Mapping[str, Any] | None = None
    qk_norm: str | None = None
    qk_norm_eps: float = 1e-6
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    sublayer_norm: str = "input"
    layer_windows: tuple[int | None, ...] | None = None
    head_size: int | None = None

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
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
        for name in ("tie_embeddings", "bias", "norm_first", "cross_attention"):
            _check_bool(getattr(self, name), name, owner)
        _check_optional_bool(self, owner, "final_norm")
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
        _check_positive_float(self.rope_base, "rope_base", owner)
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"{owner}: rope_scaling must be one of {list(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        if _check_positive_float(self.rope_scaling_factor, "rope_scaling_factor", owner) < 1:
            raise ValueError(f"{owner}: rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}")
        if self.embed_scale is not None:
            _check_positive_float(self.embed_scale, "embed_scale", owner)
        if self.context_dim is not None:
            check_int(self.context_dim, "context_dim", owner)
        _check_family_options(self, owner)

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


def _check_family_options(cfg: DecoderConfig, owner: str) -> None:
    """The open-weight family options of a :class:`DecoderConfig`."""
    _frozen_kwargs(cfg, "rope_parameters")
    if cfg.qk_norm is not None:
        _check_choice(cfg.qk_norm, "qk_norm", ("head", "all"), owner)
    _check_eps(cfg.qk_norm_eps, "qk_norm_eps", owner)
    for name in ("attn_softcap", "logit_softcap"):
        if getattr(cfg, name) is not None:
            _check_positive_float(getattr(cfg, name), name, owner)
    _check_choice(cfg.sublayer_norm, "sublayer_norm", SUBLAYER_NORMS, owner)
    if cfg.head_size is not None:
        check_int(cfg.head_size, "head_size", owner, minimum=0)
    if (cfg.qk_norm is not None or cfg.attn_softcap is not None or cfg.layer_windows is not None) \
            and cfg.attention not in ("mha", "sliding"):
        raise ValueError(f"{owner}: qk_norm, attn_softcap and layer_windows need attention='mha' or 'sliding', "
                         f"got {cfg.attention!r}")
    if cfg.layer_windows is not None:
        if cfg.attention != "mha":
            raise ValueError(f"{owner}: layer_windows needs attention='mha', got {cfg.attention!r}")
        windows = tuple(cfg.layer_windows) if isinstance(cfg.layer_windows, (list, tuple)) else None
        if windows is None or len(windows) != cfg.depth:
            raise ValueError(f"{owner}: layer_windows must be a tuple of depth={cfg.depth} entries (int or None), "
                             f"got {cfg.layer_windows!r}")
        for w in windows:
            if w is not None:
                check_int(w, "layer_windows entry", owner, minimum=0)
        object.__setattr__(cfg, "layer_windows", windows)


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
            _check_bool(getattr(self, name), name, owner)
        _check_optional_bool(self, owner, "embed_norm", "final_norm")
        check_int(self.num_labels, "num_labels", owner, minimum=0)
        if self.num_labels and not self.pooler:
            raise ValueError(f"{owner}: num_labels={self.num_labels} classifies the pooled output; set pooler=True")
        if self.dim % self.num_heads:
            raise ValueError(f"{owner}: dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.embed_scale is not None:
            _check_positive_float(self.embed_scale, "embed_scale", owner)
        _check_positive_float(self.rope_base, "rope_base", owner)


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
        _check_choice(self.pos, "pos", POSITIONS, owner)
        for name in ("norm_first", "bias", "tie_embeddings"):
            _check_bool(getattr(self, name), name, owner)
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
        if self.dim % self.num_heads:
            raise ValueError(f"{owner}: dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        for name in ("qkv_bias", "class_token", "pooler"):
            _check_bool(getattr(self, name), name, owner)
        _check_choice(self.pool, "pool", ("cls", "mean"), owner)
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
