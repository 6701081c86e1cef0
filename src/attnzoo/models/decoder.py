"""``DecoderLM``: a decoder-only language model (GPT-2 and LLaMA/Mistral shapes) with generation."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._devices import cache_dtype, tracing
from attnzoo._validate import (
    check_bool,
    check_int,
)
from attnzoo.blocks import (
    AttentionSpec,
    BlockConfig,
    TransformerBlock,
    check_context_presence,
    make_norm,
)
from attnzoo.models._common import (
    FromConfig,
    LayerCaches,
    check_left_padding,
    check_padding_mask,
    check_tokens,
    init_weights,
    key_padding_bias,
    position_table,
    positions_from_mask,
    rotary_for,
)
from attnzoo.models.beam_search import check_search, decoder_beam_search
from attnzoo.models.config import DecoderConfig
from attnzoo.models.generation import (
    GenerationRules,
    _sample,
    check_end_tokens,
    fill_token,
    repeat_rows,
    sample_next_token,
)
from attnzoo.models.mtp import head_logits
from attnzoo.models.parts import Blocks, DecoderParts, LMHead, given_blocks, resolve_parts
from attnzoo.models.speculative import Speculation, check_speculation, speculative_generate
from attnzoo.nn.cache import transaction
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions
from attnzoo.nn.positional import RotaryEmbedding, ScaledRotaryEmbedding
from attnzoo.variants import VARIANTS

__all__ = ["DecoderLM", "GenerationRules", "head_width", "outer_config", "sample_next_token", "shared_rotaries"]


#: The fields that shape the blocks a DecoderLM builds; with given blocks they must keep their defaults.
_BLOCK_FIELDS = ("attention", "attention_kwargs", "num_kv_heads", "ffn", "ffn_hidden")


def _given_blocks(blocks: Blocks, cfg: DecoderConfig) -> list[nn.Module]:
    """``blocks``: one module per layer, or a factory ``layer -> module``; checked against ``cfg``."""
    owner = "DecoderLM"
    given = given_blocks(blocks, cfg.depth, owner)
    defaults = DecoderConfig(1, 1, 1, 1)
    stray = [f for f in _BLOCK_FIELDS if getattr(cfg, f) != getattr(defaults, f)]
    if stray:
        raise ValueError(f"{owner}: blocks=... are built by the caller, so {stray} would be ignored; build those "
                         f"settings into the blocks")
    return given


def shared_rotaries(cfg: DecoderConfig) -> dict[int, nn.Module]:
    """The rotary embeddings the layers of ``cfg`` share, one per width their variants rotate (most
    take the head width; see :attr:`~attnzoo.nn.spec.VariantSpec.rope_dim`), built from
    ``cfg.rope`` (:meth:`~attnzoo.models.config.Rope.module`). Empty unless ``pos="rope"``; a
    rotary embedding given in ``attention_kwargs["rope"]`` is used as is."""
    ropes: dict[int, nn.Module] = {}
    pos, head_dim = cfg.resolved_pos, cfg.resolved_head_dim
    for entry in dict.fromkeys(cfg.layer_attention):
        width = VARIANTS[entry].rope_channels(head_dim) if isinstance(entry, str) else head_dim
        if width in ropes:
            continue
        rope = rotary_for(pos, entry, cfg.attention_kwargs, width, cfg.rope.base, cfg.rope.scaling, cfg.rope.factor)
        given = (cfg.attention_kwargs or {}).get("rope")
        if rope is not None and cfg.rope.parameters is not None and given is not rope:
            rope = cfg.rope.module(width, cfg.max_seq_len)
        if rope is not None:
            ropes[width] = rope
    return ropes


def outer_config(cfg: DecoderConfig) -> DecoderConfig:
    """``cfg`` with its block fields at their defaults (and ``pos`` resolved): the config of a
    :class:`DecoderLM` given blocks that a builder made from ``cfg`` (with
    :meth:`DecoderLM.block_config`, changing what its layers do differently)."""
    defaults = DecoderConfig(1, 1, 1, 1)
    return cfg.replace(pos=cfg.resolved_pos, **{f: getattr(defaults, f) for f in _BLOCK_FIELDS})


def _first_rotary(blocks: Sequence[nn.Module]) -> nn.Module | None:
    """The first rotary embedding inside given blocks (``longrope`` generation looks at it)."""
    return next((m for b in blocks for m in b.modules() if isinstance(m, RotaryEmbedding)), None)


def _given_positions(positions: nn.Module, pos: str) -> nn.Module:
    """A ``DecoderParts.positions`` module, which stands for an absolute position kind."""
    if pos not in ("learned", "sinusoidal"):
        raise ValueError(f"DecoderLM: parts.positions adds absolute positions, so the config's pos must be "
                         f"'learned' or 'sinusoidal', got pos={pos!r}")
    return positions


def _tie(head: nn.Module, embedding: nn.Module, cfg: DecoderConfig) -> bool:
    """Tie an :class:`LMHead` to the embedding's ``weight [V, C]`` when ``tie_embeddings``."""
    if not (cfg.tie_embeddings and isinstance(head, LMHead)):
        return False
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.shape != head.weight.shape:
        raise ValueError(f"DecoderLM: tie_embeddings=True ties the LMHead [{head.out_features}, {head.in_features}] "
                         f"to the embedding's weight, but the embedding has "
                         f"{'no weight' if weight is None else f'a weight of shape {tuple(weight.shape)}'}; "
                         f"set tie_embeddings=False")
    head.weight = weight
    return True


def head_width(head: nn.Module) -> int | None:
    """The output width of a head (0: ``Identity``), or ``None`` when it cannot be told."""
    if isinstance(head, nn.Identity):
        return 0
    return head.out_features if isinstance(head, nn.Linear) else None


class DecoderLM(FromConfig, nn.Module):
    """Decoder-only language model: token embedding, a stack of causal :class:`TransformerBlock`
    (pre-norm), a final norm and an LM head.

    Covers GPT-2 (learned positions, LayerNorm, ``gelu_tanh``, tied head) and LLaMA/Mistral
    (RoPE, RMSNorm, SwiGLU, GQA, sliding window, untied head) through its config. What differs
    between families is passed as parts (:class:`~attnzoo.models.parts.DecoderParts`): blocks
    built elsewhere (cross-attention to a ``context`` such as ViT features for captioning, QK
    norms, per-layer windows, softcaps), a scaled embedding, another final norm, a soft-capped,
    classification or no head::

        cfg = DecoderConfig(V, C, L, H, norm="rms", ffn="geglu_tanh", pos="rope")
        gemma_like = DecoderLM(config=cfg, parts=DecoderParts(embedding=ScaledEmbedding(V, C, scale=C ** 0.5),
                                                              head=LMHead(C, V, softcap=30.0)))

    Build it from a :class:`~attnzoo.models.DecoderConfig` (``DecoderLM.from_config(cfg)``,
    ``DecoderLM(config=cfg)``; presets ``gpt2``, ``llama``, ``mistral``, ``arena_lm``,
    ``arena_mqar``). The constructor's own keywords (``vocab_size``, ``dim``, ``depth``,
    ``num_heads``, ``attention``, ``num_kv_heads``, ``max_seq_len``, ``pos``) are shorthands for
    those fields and override ``config``'s when given; every other field goes through ``config=``
    (an unknown keyword is a ``TypeError`` naming it); ``parts`` the modules; ``device``/``dtype``
    place the parameters built here.

    The config's fields:
        vocab_size: vocabulary ``V``.
        dim: width ``C``.
        depth: number of blocks.
        num_heads: query heads.
        attention: a registry name (``mha``, ``mqa``, ``gqa``, ``sliding``, ``local_global``,
            ``linear``, ``performer``, ``infini``, ...), a callable ``(dim, num_heads) -> nn.Module``
            called once per layer, or one entry per layer (a list, or a ``"a/b/c"`` pattern).
        attention_kwargs: extra builder arguments (``window``, ``bias``, ...).
        num_kv_heads: KV heads for ``mha``/``gqa`` (GQA when ``< num_heads``).
        max_seq_len: the longest sequence: size of the learned/sinusoidal table and the bound for
            :meth:`generate` (prompt + new tokens).
        pos: ``"rope"`` (rotary, in the attention; applied by the softmax-family variants, the
            others, e.g. ``linear``/``performer``/``infini``, take no RoPE and rely on causality),
            ``"learned"``, ``"sinusoidal"`` or ``"none"``.
        norm: ``"layer"`` or ``"rms"``; ``norm_eps`` its epsilon.
        ffn: feed-forward activation (``relu``, ``relu2``, ``gelu``, ``gelu_tanh``, ``silu``, ``swiglu``,
            ``geglu``); ``ffn_hidden`` its hidden width.
        tie_embeddings: the LM head shares the token embedding matrix.
        dropout: residual/FFN/embedding dropout (attention-weight dropout: ``attention_kwargs``).
        bias: biases in the attention projections (unless ``attention_kwargs`` sets ``bias``) and
            the FFN.
        head_dim: per-head width (default ``dim // num_heads``; only for registry attention that
            accepts it).
        rope: the rotary embedding's :class:`~attnzoo.models.config.Rope` (base, ``linear``/``ntk``
            scaling, or a Hugging Face ``rope_parameters`` dict).

    Shapes: ``tokens [B, N]`` long -> ``logits [B, N, V]`` (with a given head: what it returns); the
    ids are checked against ``input_vocab_size``, the embedding's rows (a given embedding may hold more
    than ``V``: Molmo2's additional vocabulary).
    Weights: ``tok_emb``, ``pos_emb`` (learned), ``blocks[i]`` (see :class:`TransformerBlock`),
    ``norm``, ``lm_head``.
    """

    config_class = DecoderConfig

    def __init__(self, vocab_size: int | None = None, dim: int | None = None, depth: int | None = None,
                 num_heads: int | None = None, *, attention: AttentionSpec | Sequence[AttentionSpec] | None = None,
                 num_kv_heads: int | None = None, max_seq_len: int | None = None, pos: str | None = None,
                 config: DecoderConfig | None = None, parts: DecoderParts | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        cfg = DecoderConfig.resolve(config, "DecoderLM", {
            "vocab_size": vocab_size, "dim": dim, "depth": depth, "num_heads": num_heads, "attention": attention,
            "num_kv_heads": num_kv_heads, "max_seq_len": max_seq_len, "pos": pos})
        parts = resolve_parts(parts, DecoderParts, "DecoderLM")
        self.config = cfg
        self.vocab_size, self.dim, self.depth, self.num_heads = cfg.vocab_size, cfg.dim, cfg.depth, cfg.num_heads
        self.max_seq_len, self.pos, self.head_dim = cfg.max_seq_len, cfg.resolved_pos, cfg.resolved_head_dim
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        given = None if parts.blocks is None else _given_blocks(parts.blocks, cfg)
        ropes = {} if given is not None else shared_rotaries(cfg)
        self.rope = ropes.get(self.head_dim, next(iter(ropes.values()), None)) if given is None \
            else _first_rotary(given)
        built = {name for name, part in (("tok_emb", parts.embedding), ("blocks", given), ("norm", parts.norm),
                                         ("lm_head", parts.head), ("pos_emb", parts.positions)) if part is None}
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim, **kw) if parts.embedding is None else parts.embedding
        # the ids the embedding reads: a given table may hold more rows than the head has outputs (Molmo2's
        # image / video tokens, ``additional_vocab_size``)
        self.input_vocab_size = max(cfg.vocab_size, int(getattr(self.tok_emb, "num_embeddings", cfg.vocab_size)))
        self.pos_emb = position_table(self.pos, cfg.dim, cfg.max_seq_len, **kw) if parts.positions is None \
            else _given_positions(parts.positions, self.pos)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(given if given is not None else [
            TransformerBlock(config=self.block_config(cfg, ropes, i), **kw) for i in range(cfg.depth)])
        self.norm = make_norm(cfg.norm, cfg.dim, cfg.norm_eps, **kw) if parts.norm is None else parts.norm
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size, **kw) if parts.head is None else parts.head
        self.tie_embeddings = _tie(self.lm_head, self.tok_emb, cfg)
        if self.tie_embeddings and parts.embedding is not None:
            built.discard("lm_head")  # tied to a given embedding: its weight is the embedding's
        for name, child in self.named_children():  # given parts keep their own weights
            if name in built:
                init_weights(child, depth=cfg.depth)
        self.cross_attention = any(getattr(b, "cross_attn", None) is not None for b in self.blocks)
        self.mtp = parts.mtp
        widths = sorted({m.dim for m in parts.mtp.layers if m.dim != cfg.dim}) if parts.mtp is not None else []
        if widths:
            raise ValueError(f"DecoderLM: parts.mtp has layers of width {widths[0]}, the model's dim is {cfg.dim}")

    @classmethod
    def with_blocks(cls, config: DecoderConfig, change: Callable[[BlockConfig, int], BlockConfig], *,
                    parts: DecoderParts | None = None, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> DecoderLM:
        """The decoder ``config`` describes, with each layer's :class:`~attnzoo.blocks.BlockConfig`
        (:meth:`block_config`, the shared rotary embedding included) first passed through
        ``change(block_config, layer)``: what a family's layers do differently (cross-attention,
        a layer's window, QK norms, sub-layer output norms, post-norm)::

            captioner = DecoderLM.with_blocks(cfg, lambda b, i: b.replace(cross_attention=True, context_dim=768))

        The blocks are initialised as the model's own; ``parts`` gives the other parts (its
        ``blocks`` must be ``None``). The model's config is :func:`outer_config` of ``config``."""
        owner = "DecoderLM.with_blocks"
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"{owner}: config must be a DecoderConfig, got {type(config).__name__}")
        if not callable(change):
            raise TypeError(f"{owner}: change must be a callable (BlockConfig, layer) -> BlockConfig, "
                            f"got {type(change).__name__}")
        parts = DecoderParts() if parts is None else parts
        if not isinstance(parts, DecoderParts) or parts.blocks is not None:
            raise TypeError(f"{owner}: parts must be a DecoderParts without blocks (they are built here), got {parts!r}")
        ropes = shared_rotaries(config)
        configs = [change(cls.block_config(config, ropes, i), i) for i in range(config.depth)]
        bad = [type(c).__name__ for c in configs if not isinstance(c, BlockConfig)]
        if bad:
            raise TypeError(f"{owner}: change must return a BlockConfig, got {bad[0]}")
        blocks = nn.ModuleList([TransformerBlock(config=c, device=device, dtype=dtype) for c in configs])
        init_weights(blocks, depth=config.depth)
        return cls(config=outer_config(config), parts=dataclasses.replace(parts, blocks=list(blocks)), device=device,
                   dtype=dtype)

    @staticmethod
    def block_config(cfg: DecoderConfig, rope: nn.Module | Mapping[int, nn.Module] | None = None,
                     layer: int | None = None) -> BlockConfig:
        """The causal pre-norm :class:`~attnzoo.blocks.BlockConfig` of layer ``layer`` (``None``:
        any layer of a uniform stack): a registry builder gets ``bias``, ``head_dim``,
        ``num_kv_heads`` (in a mixed stack: the layers whose variant takes it) and the shared
        ``rope`` (one module, or ``{width: module}`` from :func:`shared_rotaries`; only layers
        whose variant takes a rotary embedding) unless ``attention_kwargs`` sets them. A family
        builder starts from it and changes what its layers do differently (``replace``)."""
        akw = dict(cfg.attention_kwargs or {})
        uniform = not isinstance(cfg.attention, tuple)
        if layer is None and not uniform:
            raise ValueError(f"DecoderLM.block_config: a per-layer stack needs layer= (0..{cfg.depth - 1})")
        attention = cfg.attention if uniform else cfg.attention[layer]  # type: ignore[index]
        if isinstance(attention, str):
            spec = VARIANTS[attention]
            akw.setdefault("bias", cfg.bias)
            if cfg.num_kv_heads is not None and (uniform or "num_kv_heads" in spec.options):
                akw.setdefault("num_kv_heads", cfg.num_kv_heads)
            if cfg.head_dim is not None:
                akw.setdefault("head_dim", cfg.head_dim)
            if isinstance(rope, Mapping):
                rope = rope.get(spec.rope_channels(cfg.resolved_head_dim)) if spec.takes_rope() else None
            if rope is not None:
                akw["rope"] = rope
            elif spec.takes_rope() and cfg.resolved_pos != "rope":
                akw.setdefault("rope", False)  # pos says none: a module with a default rotary (MLA) drops it
        return BlockConfig(cfg.dim, cfg.num_heads, attention=attention, attention_kwargs=akw or None,
                           causal=True, norm=cfg.norm, norm_eps=cfg.norm_eps, ffn=cfg.ffn,
                           ffn_hidden=cfg.ffn_hidden, dropout=cfg.dropout, bias=cfg.bias)

    # ----------------------------------------------------------------- helpers
    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LayerCaches:
        """One decode cache per layer (what each layer's attention module builds), bundled; ``dtype``
        by default that of the layers' first linear weight (the keys' dtype: an embedding or norm a
        family keeps in float32 does not decide it)."""
        check_int(batch_size, "batch_size", "DecoderLM.init_cache")
        check_int(max_len, "max_len", "DecoderLM.init_cache")
        p = next((m.weight for m in self.blocks.modules() if isinstance(m, nn.Linear)), self.tok_emb.weight)
        device = p.device if device is None else device
        dtype = cache_dtype(p, dtype)  # the autocast dtype under torch.autocast (the keys' dtype)
        return LayerCaches([b.init_cache(batch_size, max_len, device=device, dtype=dtype) for b in self.blocks])

    def embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token (+ absolute position) embeddings ``[B, N, C]``; ``positions`` ``[N]`` or ``[B, N]``
        (default ``0..N-1``)."""
        x = self.tok_emb(tokens)  # [B, N, C]
        if self.pos_emb is not None:
            x = self.pos_emb(x, positions)  # [B, N, C]
        return self.drop(x)

    def _check_positions(self, positions: object, batch: int, n: int) -> Tensor:
        if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            raise TypeError(f"DecoderLM: positions must be an int tensor [N] or [B, N], got "
                            f"{positions.dtype if isinstance(positions, Tensor) else type(positions).__name__}")
        if tuple(positions.shape) not in ((n,), (batch, n)):
            raise ValueError(f"DecoderLM: positions must have shape [N] = [{n}] or [B, N] = [{batch}, {n}], "
                             f"got {tuple(positions.shape)}")
        return positions.long()

    @property
    def cache_layers(self) -> int:
        """The layer caches :meth:`init_cache` bundles: one per layer (a model that runs some layers
        more than once holds more)."""
        return self.depth

    def _cache_length(self, cache: object, batch: int) -> int:
        """The tokens already in ``cache`` (0 without one), checked: the :attr:`cache_layers`
        caches of :meth:`init_cache`, built for ``batch`` rows."""
        if cache is None:
            return 0
        owner, count = type(self).__name__, self.cache_layers
        if not isinstance(cache, LayerCaches) or len(cache) != count:
            raise TypeError(f"{owner}: cache must come from {owner}.init_cache ({count} layer caches), got {cache!r}")
        if cache.batch_size != batch:
            raise ValueError(f"{owner}: cache was built for batch size {cache.batch_size}, tokens have {batch}")
        return cache.length

    def _context_mask(self, context: Tensor | None, context_mask: Tensor | None, batch: int) -> Tensor | None:
        """Check ``context`` against the model's cross-attention; ``context_mask [B, M]`` ->
        ``[B, 1, 1, M]`` bool."""
        owner = "DecoderLM"
        if not check_context_presence(self.cross_attention, context, context_mask, owner, "the model",
                                      "give it blocks built with BlockConfig(cross_attention=True)"):
            return None
        if context_mask is None:
            return None
        if not isinstance(context, Tensor) or context.dim() != 3:
            got = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
            raise ValueError(f"{owner}: context must be [B, M, C], got {got}")
        return key_padding_bias(check_padding_mask(context_mask, batch, context.shape[1], owner, "context_mask"))

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        tokens: Tensor,
        *,
        cache: LayerCaches | None = None,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        context_cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """Args:
            tokens: ``[B, N]`` token ids (with a cache: the new tokens only).
            cache: from :meth:`init_cache`; the new tokens sit at positions ``cache.length ...``.
            positions: absolute positions ``[N]`` or ``[B, N]`` (default: from ``attention_mask``
                when given, else ``cache.length + 0..N-1``).
            attention_mask: ``[B, L]`` bool, True for real tokens, ``L = N`` (no cache) or
                ``cache.length + N`` (every token written so far, then the new ones). Padded keys
                are hidden; positions count real tokens only (left padding for generation).
            context: ``[B, M, context_dim]`` for a model whose blocks have cross-attention.
            context_mask: ``[B, M]`` bool, True for real context tokens.
            cu_seqlens: packed documents: ``tokens [1, T]`` hold ``S`` sequences end to end and
                ``cu_seqlens`` (int32 ``[S+1]``) their cumulative lengths; positions restart at 0 in
                every sequence and no token attends across a boundary (equal to running each alone).
                Not with a cache, ``positions`` or ``attention_mask``; ``context`` only packed too.
            context_cu_seqlens: with ``cu_seqlens`` on a cross-attention model: ``context [1, Tm, C]``
                holds ``S`` context sequences end to end (int32 ``[S+1]``, the same ``S``), and
                sequence ``i`` of ``tokens`` cross-attends to context sequence ``i`` only (packed
                encoder-decoder pairs; no ``context_mask``).

        Returns: ``logits [B, N, V]``. With a cache the call is all-or-nothing: when it raises anywhere
        (in any layer, the final norm or the head; a ``KeyboardInterrupt`` too), no layer's cache changes.
        """
        return self._run(tokens, cache, (positions, attention_mask, context, context_mask),
                         (cu_seqlens, context_cu_seqlens), head=True)

    def hidden_states(self, tokens: Tensor, *, cache: LayerCaches | None = None, positions: Tensor | None = None,
                      attention_mask: Tensor | None = None, context: Tensor | None = None,
                      context_mask: Tensor | None = None, cu_seqlens: Tensor | None = None,
                      context_cu_seqlens: Tensor | None = None) -> Tensor:
        """The final hidden states ``[B, N, C]``: :meth:`forward` without the head (after the final
        norm, what the head reads: transformers' last ``hidden_states``). The same arguments, the
        same all-or-nothing cache. A multi-token-prediction module (:mod:`attnzoo.models.mtp`)
        reads them."""
        return self._run(tokens, cache, (positions, attention_mask, context, context_mask),
                         (cu_seqlens, context_cu_seqlens), head=False)

    def mtp_logits(self, tokens: Tensor, *, attention_mask: Tensor | None = None,
                   hidden: Tensor | None = None) -> list[Tensor]:
        """The multi-token-prediction layers' logits over a sequence (the training loss of DeepSeek-V3's
        MTP; :mod:`attnzoo.models.mtp`): entry ``i`` (one per depth) is ``[B, N - 1 - i, V]``, its
        row ``j`` predicting token ``j + i + 2`` from the tokens up to ``j + i + 1`` (the last row
        predicts past the sequence: drop it for a loss).

        Args:
            tokens: ``[B, N]`` token ids.
            attention_mask: ``[B, N]`` bool, True for real tokens (left padding, as :meth:`forward`).
            hidden: ``[B, N, C]``, the model's :meth:`hidden_states` of ``tokens`` when already at
                hand (training the MTP layers of a frozen model: computed once); default computed.
        """
        owner = "DecoderLM.mtp_logits"
        if self.mtp is None:
            raise ValueError(f"{owner}: the model has no multi-token-prediction layers (DecoderParts(mtp=...); "
                             f"a checkpoint's load when its folder holds them)")
        check_tokens(tokens, self.input_vocab_size, owner)
        B, N = tokens.shape
        am = None if attention_mask is None else check_padding_mask(attention_mask, B, N, owner)
        if hidden is not None and (not isinstance(hidden, Tensor) or not hidden.is_floating_point()
                                   or tuple(hidden.shape) != (B, N, self.dim)):
            got = (f"{tuple(hidden.shape)} {hidden.dtype}" if isinstance(hidden, Tensor) else type(hidden).__name__)
            raise ValueError(f"{owner}: hidden must be the floating hidden states [B, N, C] = [{B}, {N}, {self.dim}], "
                             f"got {got}")
        h = self.hidden_states(tokens, attention_mask=am) if hidden is None else hidden  # [B, N, C]
        pos = torch.arange(N, device=tokens.device).expand(B, N) if am is None else positions_from_mask(am)
        out = []
        for i, layer in enumerate(self.mtp.layers):
            rows = max(N - 1 - i, 0)
            if rows == 0:  # nothing left to predict
                out.append(self.lm_head(h[:, :0]))
                continue
            h = layer(self.tok_emb(tokens[:, i + 1:i + 1 + rows]), h[:, :rows], positions=pos[:, :rows] + i + 1,
                      key_padding=None if am is None else am[:, :rows])  # [B, rows, C]
            out.append(head_logits(self.lm_head, h))  # [B, rows, V]
        return out

    def _run(self, tokens: Tensor, cache: LayerCaches | None, given: tuple[Any, Any, Any, Any],
             packed: tuple[Any, Any], *, head: bool) -> Tensor:
        """:meth:`forward` (``head``) or :meth:`hidden_states`; ``given``: ``(positions, attention_mask,
        context, context_mask)``, ``packed``: ``(cu_seqlens, context_cu_seqlens)``."""
        positions, attention_mask, context, context_mask = given
        if isinstance(cache, LayerCaches) and not cache.in_transaction:
            # one transaction over every layer's cache, which the layers' own calls join (nn/cache.py)
            return transaction(cache, lambda: self._run(tokens, cache, given, packed, head=head))
        owner = "DecoderLM"
        check_tokens(tokens, self.input_vocab_size, owner)
        B, N = tokens.shape
        if packed[0] is not None or packed[1] is not None:
            return self._packed(tokens, packed[0], (context, context_mask, packed[1]), head, cache, positions,
                                attention_mask)
        past = self._cache_length(cache, B)
        kp: Tensor | None = None
        if attention_mask is not None:
            am = check_padding_mask(attention_mask, B, past + N, owner)
            kp = am  # [B, past + N]
            if positions is None and getattr(self.pos_emb, "counts_mask", True):
                positions = positions_from_mask(am)[:, past:]  # [B, N]
        if positions is not None:
            positions = self._check_positions(positions, B, N)
            if (self.pos in ("learned", "sinusoidal") and positions.numel() and not tracing()
                    and int(positions.max()) >= self.max_seq_len):  # eager only: syncs
                raise ValueError(f"{owner}: position {int(positions.max())} is beyond the model's "
                                 f"{self.max_seq_len} positions (max_seq_len)")
        elif past + N > self.max_seq_len and self.pos in ("learned", "sinusoidal"):
            raise ValueError(f"{owner}: sequence of {past + N} tokens (cache {past} + new {N}) is longer than the "
                             f"model's {self.max_seq_len} positions (max_seq_len)")
        context_mask = self._context_mask(context, context_mask, B)
        emb_pos = positions
        if emb_pos is None and self.pos_emb is not None and past:
            emb_pos = torch.arange(past, past + N, device=tokens.device)
        x = self.embed(tokens, emb_pos)  # [B, N, C]
        attn_pos = positions if self.pos == "rope" else None
        for i, block in enumerate(self.blocks):
            x = block(x, context, key_padding=kp, context_mask=context_mask,
                      cache=None if cache is None else cache[i], positions=attn_pos)  # [B, N, C]
        x = self.norm(x)  # [B, N, C]
        return self.lm_head(x) if head else x  # [B, N, V]

    def _packed(self, tokens: Tensor, cu_seqlens: Tensor | None, context: tuple[Any, Any, Any], head: bool,
                *unsupported: object) -> Tensor:
        """Logits ``[1, T, V]`` of packed sequences (see :meth:`forward`; without ``head``: the hidden
        states ``[1, T, C]``); ``context``: ``(context, context_mask, context_cu_seqlens)``."""
        if any(u is not None for u in unsupported):
            raise ValueError("DecoderLM: packed input (cu_seqlens) takes no cache, positions or attention_mask")
        if tokens.shape[0] != 1:
            raise ValueError(f"DecoderLM: packed input (cu_seqlens given) must be one row of tokens [1, T]; got "
                             f"tokens {tuple(tokens.shape)} (pack the sequences end to end, lengths in cu_seqlens)")
        if cu_seqlens is None:
            raise ValueError("DecoderLM: context_cu_seqlens (packed context) needs cu_seqlens (the packed tokens)")
        cu = packed_cu_seqlens(cu_seqlens, tokens.unsqueeze(-1), "DecoderLM")
        memory, context_cu = self._packed_context(context, cu)
        pos = self.packed_token_positions(tokens, cu)  # restarting per sequence
        if self.pos in ("learned", "sinusoidal") and pos.numel() and int(pos.max()) >= self.max_seq_len:
            raise ValueError(f"DecoderLM: a packed sequence of {int(pos.max()) + 1} tokens is longer than the "
                             f"model's {self.max_seq_len} positions (max_seq_len; cu_seqlens gives its length)")
        x = self.embed(tokens, pos)  # [1, T, C]
        for block in self.blocks:
            if memory is None:
                x = block(x, cu_seqlens=cu)  # [1, T, C]
            else:
                x = block(x, memory, cu_seqlens=cu, context_cu_seqlens=context_cu)  # [1, T, C]
        x = self.norm(x)  # [1, T, C]
        return self.lm_head(x) if head else x  # [1, T, V]

    def _packed_context(self, context: tuple[Any, Any, Any], cu: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """``(context [1, Tm, C], context_cu_seqlens [S+1])`` of a packed call, checked against the
        model's cross-attention and ``cu`` (the tokens' ``S``); ``(None, None)`` without context."""
        memory, memory_mask, memory_cu = context
        owner = "DecoderLM"
        if memory_mask is not None:
            raise ValueError(f"{owner}: packed input (cu_seqlens) takes no context_mask: the packed context "
                             f"sequences are unpadded (context_cu_seqlens gives their lengths)")
        self._context_mask(memory, None, 1)  # context given iff the model has cross-attention
        if memory is None:
            if memory_cu is not None:
                raise ValueError(f"{owner}: context_cu_seqlens given without context")
            return None, None
        if not isinstance(memory, Tensor) or memory.dim() != 3 or memory.shape[0] != 1:
            got = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
            raise ValueError(f"{owner}: packed input (cu_seqlens) needs a packed context [1, Tm, C], got {got}")
        if memory_cu is None:
            raise ValueError(f"{owner}: packed input (cu_seqlens) with a context needs context_cu_seqlens (int32 "
                             f"[S+1], the context's S = {cu.numel() - 1} sequences end to end), got None")
        memory_cu = packed_cu_seqlens(memory_cu, memory, f"{owner} (context_cu_seqlens)")
        if memory_cu.numel() != cu.numel():
            raise ValueError(f"{owner}: context_cu_seqlens must describe as many sequences as cu_seqlens: expected "
                             f"[S+1] = [{cu.numel()}] entries, got {memory_cu.numel()}")
        return memory, memory_cu

    def packed_token_positions(self, tokens: Tensor, cu_seqlens: Tensor) -> Tensor:
        """The absolute positions ``[T]`` of packed ``tokens [1, T]`` (checked ``cu_seqlens [S+1]``):
        0 at the start of every sequence. A model that numbers positions otherwise (M2M100: counted
        from the token ids) overrides it."""
        return packed_positions(cu_seqlens, tokens.shape[1])

    # --------------------------------------------------------------- generate
    def _check_generate(self, n: int, new: int, eos_token_id: object, extend_context: object = False,
                        owner: str = "DecoderLM.generate") -> tuple[int, ...]:
        """The head, ``eos_token_id``, ``extend_context`` and the length bound of :meth:`generate`
        (the sampling settings: :func:`check_sampling`); returns the end tokens
        (:func:`~attnzoo.models.generation.check_end_tokens`)."""
        width = head_width(self.lm_head)
        if width is not None and width != self.vocab_size:
            raise ValueError(f"{owner}: the model has no LM head (its head is {type(self.lm_head).__name__} "
                             f"with {width} outputs, vocab_size={self.vocab_size}); nothing to sample")
        check_bool(extend_context, "extend_context", owner)
        eos = check_end_tokens(eos_token_id, self.vocab_size, owner)
        if n + new > self.max_seq_len and self.pos in ("rope", "none") and extend_context:
            warnings.warn(f"{owner}: generating {n + new} tokens, past the model's {self.max_seq_len} positions "
                          f"(max_seq_len); quality beyond the trained length is not guaranteed", stacklevel=4)
            return eos
        hint = ("pass extend_context=True to go past it" if self.pos in ("rope", "none")
                else f"its {self.pos} position table has no more rows")
        if n > self.max_seq_len:
            raise ValueError(f"{owner}: prompt of {n} tokens is longer than the model's {self.max_seq_len} "
                             f"positions (max_seq_len; {hint})")
        if n + new > self.max_seq_len:
            raise ValueError(f"{owner}: prompt ({n}) + max_new_tokens ({new}) = {n + new} exceeds the model's "
                             f"{self.max_seq_len} positions (max_seq_len; {hint})")
        return eos

    def _check_prompt(self, prompt: object, max_new_tokens: object, owner: str) -> tuple[int, int]:
        """``prompt [B, N]`` token ids with ``B >= 1`` and ``max_new_tokens >= 0``: ``(N, max_new_tokens)``."""
        check_tokens(prompt, self.input_vocab_size, owner, "prompt")
        B, n = prompt.shape  # type: ignore[union-attr]
        if B == 0:
            raise ValueError(f"{owner}: prompt must hold at least one row [B, N] with B >= 1, got {(B, n)}")
        return n, check_int(max_new_tokens, "max_new_tokens", owner, minimum=0)

    def _speculation(self, settings: tuple[object, ...], n: int, new: int, beams: int, extend_context: bool,
                     context: bool = False, owner: str = "DecoderLM.generate") -> Speculation | None:
        """The speculative ``settings`` of :meth:`generate` (``use_mtp`` last) checked (:func:`check_speculation`), and
        what speculative decoding needs besides: one beam, an assistant that has the positions, and
        RoPE frequencies that stay the same while it runs (``None``: no speculation)."""
        *drafting, use_mtp = settings
        if check_bool(use_mtp, "use_mtp", owner) and self.mtp is None:
            raise ValueError(f"{owner}: use_mtp=True drafts with the model's multi-token-prediction layers, and "
                             f"this model has none (DecoderParts(mtp=...); a checkpoint's load when its folder "
                             f"holds them)")
        spec = check_speculation(*drafting, self.vocab_size, owner, context, self.mtp if use_mtp else None)
        if spec is None:
            return None
        if beams > 1:
            raise ValueError(f"{owner}: speculative decoding (assistant_model / prompt_lookup_num_tokens / use_mtp) "
                             f"is greedy or sampled, not beam search: num_beams must be 1, got {beams}")
        varying = [m.rope_type for m in self.modules() if isinstance(m, ScaledRotaryEmbedding)  # every layer's
                   and m.varies_between(n + 1, n + new)]
        if varying:
            raise ValueError(f"{owner}: speculative decoding checks several tokens in one forward, and the "
                             f"{varying[0]} RoPE frequencies change between {n + 1} and {n + new} tokens "
                             f"(a draft would be rotated otherwise than greedy decoding rotates it); generate "
                             f"without assistant_model / prompt_lookup_num_tokens")
        if spec.assistant is not None:
            spec.assistant._check_generate(n, new, None, extend_context, f"{owner} (assistant_model)")  # type: ignore[attr-defined]
        return spec

    def _decode_step(self, tokens: Tensor, cache: LayerCaches, positions: Tensor | None, attention_mask: Tensor | None,
                     context: Tensor | None, context_mask: Tensor | None) -> Tensor:
        """Logits ``[B, V]`` after the last of ``tokens [B, L]`` (the others are in ``cache``).
        When ``longrope`` moves to its long factors at this length, the cache is rebuilt from
        every token so all keys are rotated again (as transformers' Phi3 generation does)."""
        if isinstance(self.rope, ScaledRotaryEmbedding) and self.rope.switches_at(tokens.shape[1]):
            cache.reset()
            return self._last_logits(tokens, cache, None, attention_mask, context, context_mask)
        return self(tokens[:, -1:], cache=cache, positions=positions, attention_mask=attention_mask,
                    context=context, context_mask=context_mask)[:, -1]  # one position: no hook to pay

    def _last_logits(self, tokens: Tensor, cache: LayerCaches, positions: Tensor | None,
                     attention_mask: Tensor | None, context: Tensor | None, context_mask: Tensor | None) -> Tensor:
        """Logits ``[B, V]`` after the last of ``tokens [B, N]`` fed through ``cache``: the forward
        with the head applied to the last position only (transformers' ``logits_to_keep=1``: a
        prompt's prefill does not pay ``N`` rows of the ``[C, V]`` head)."""
        handle = self.lm_head.register_forward_pre_hook(lambda _, args: (args[0][:, -1:], *args[1:]))
        try:
            return self(tokens, cache=cache, positions=positions, attention_mask=attention_mask, context=context,
                        context_mask=context_mask)[:, -1]
        finally:
            handle.remove()

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        attention_mask: Tensor | None = None,
        generator: torch.Generator | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        extend_context: bool = False,
        suppress_tokens: Sequence[int] | None = None,
        min_new_tokens: int = 0,
        no_repeat_ngram_size: int = 0,
        repetition_penalty: float = 1.0,
        pad_token_id: int | None = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return_sequences: int = 1,
        min_length: int = 0,
        min_p: float | None = None,
        bad_words_ids: Sequence[Sequence[int]] | None = None,
        assistant_model: DecoderLM | None = None,
        num_assistant_tokens: int = 20,
        assistant_confidence_threshold: float = 0.4,
        prompt_lookup_num_tokens: int | None = None,
        max_matching_ngram_size: int = 2,
        use_mtp: bool = False,
    ) -> Tensor:
        """Autoregressive generation with the per-layer caches (prefill once, then one token a step).

        Args:
            prompt: ``[B, N]`` token ids; batched prompts of different lengths are left-padded and
                described by ``attention_mask``.
            max_new_tokens: tokens to generate (``>= 0``).
            temperature: ``0`` = greedy; else sampling at this temperature (finite, ``> 0``).
            top_k: keep only the ``k`` most likely tokens when sampling (``>= 1``).
            top_p: nucleus sampling threshold in ``(0, 1]``.
            min_p: when sampling, keep only the tokens at least ``min_p`` (in ``[0, 1]``) times as
                likely as the most likely one (transformers' ``min_p``, after ``top_p``).
            eos_token_id: the end token, or a sequence of them (Llama 3's and Qwen's generation
                configs list several): a row that wrote one then holds ``pad_token_id``;
                generation stops early when every row has ended.
            attention_mask: ``[B, N]`` bool, True for real prompt tokens: left padding only (in
                each row, once a token is real every later one is; ``ValueError`` otherwise).
            generator: a ``torch.Generator`` for reproducible sampling.
            context, context_mask: for cross-attention models (see :meth:`forward`).
            extend_context: let a RoPE (or position-free) model generate past ``max_seq_len``, with
                a warning (as transformers does); otherwise that is a ``ValueError``.
            suppress_tokens: token ids never generated (transformers' ``suppress_tokens``: their
                logits set to ``-inf``).
            bad_words_ids: token sequences never completed (transformers' ``bad_words_ids``): the
                last token of one is forbidden after the others; a one-token one never generated
                (an end token is dropped from them, as transformers drops it).
            min_new_tokens: no end token is generated before this many new tokens
                (transformers' ``min_new_tokens``).
            min_length: nor before the row holds this many tokens, the prompt's ``N`` (padding
                included) counted (transformers' ``min_length``).
            no_repeat_ngram_size: ``n > 0``: no token that would repeat an ``n``-gram of the row
                (prompt included; transformers' ``no_repeat_ngram_size``).
            repetition_penalty: ``p > 0`` (``1``: off): the logit ``s`` of every token already in the
                row (prompt included, padding not) becomes ``s / p`` if ``s >= 0`` else ``s * p``
                (transformers' ``repetition_penalty``; Qwen's configs use 1.05).
            pad_token_id: what an ended row holds after its end token (default: the first end token;
                beam search: as transformers, the first end token also when this is ``0``).
            num_beams: ``K > 1``: beam search as transformers runs it
                (:mod:`attnzoo.models.beam_search`), the caches reordered at every step; not with
                sampling settings.
            length_penalty, early_stopping: of beam search (``True`` / ``False`` / ``"never"``).
            num_return_sequences: ``R >= 1`` results per prompt row (rows ``b * R + r``): the ``R``
                best hypotheses of beam search (``R <= K``), or ``R`` independent samples; greedy
                decoding has one.
            assistant_model: speculative decoding (:mod:`attnzoo.models.speculative`): a smaller
                ``DecoderLM`` with the same vocabulary drafts up to ``num_assistant_tokens`` tokens
                (its own greedy or sampled choices, the same rules applied), stopping early when a draft's probability is below
                ``assistant_confidence_threshold`` (``0``: never), and one forward of this model
                checks them (transformers' ``assistant_model``, whose defaults these are). With a
                ``context``, an assistant with cross-attention reads the same context. Greedy: the
                tokens greedy decoding gives; sampling: speculative sampling, distributed as
                sampling draws (not the same draws); not with beams.
            prompt_lookup_num_tokens: speculative decoding with drafts looked up in the row itself:
                up to this many tokens that followed the earliest earlier occurrence of the row's
                last ``n``-gram (``n <= max_matching_ngram_size``; transformers' prompt lookup
                decoding), greedy or sampled as with an assistant.
            use_mtp: speculative decoding drafted by the model's own multi-token-prediction layers
                (``DecoderParts(mtp=...)``, loaded with a DeepSeek-V3 / GLM-4.5 / ERNIE-4.5 checkpoint that
                holds them; transformers' ``use_mtp``): one draft per depth a round, greedy or sampled as
                with an assistant.

        Returns: ``[B * R, N + T]`` long, ``T <= max_new_tokens`` (fewer only when every row ended).
        """
        owner = "DecoderLM.generate"
        n, new = self._check_prompt(prompt, max_new_tokens, owner)
        sampling, beams, length_penalty, early_stopping, returns = check_search(
            temperature, top_k, top_p, min_p, generator, num_beams, length_penalty, early_stopping,
            num_return_sequences, owner)
        eos = self._check_generate(n, new, eos_token_id, extend_context)
        spec = self._speculation((assistant_model, num_assistant_tokens, assistant_confidence_threshold,
                                  prompt_lookup_num_tokens, max_matching_ngram_size, use_mtp), n, new, beams,
                                 extend_context, context is not None)
        rules = GenerationRules.checked(suppress_tokens, min_new_tokens, eos, self.vocab_size, owner,
                                        no_repeat_ngram_size, repetition_penalty, min_length, n, bad_words_ids)
        fill = fill_token(pad_token_id, eos, self.vocab_size, owner)
        full_mask = None if attention_mask is None else check_left_padding(attention_mask, prompt, new, owner)
        if beams > 1:
            return decoder_beam_search(self, prompt, context, context_mask, num_beams=beams, max_new_tokens=new,
                                       eos_token_id=eos or None, length_penalty=length_penalty,
                                       early_stopping=early_stopping, rules=rules, pad_token_id=pad_token_id,
                                       num_return_sequences=returns,
                                       attention_mask=None if full_mask is None else full_mask[:, :n]).tokens
        prompt, full_mask, context, context_mask = repeat_rows(returns, prompt, full_mask, context, context_mask)
        if new == 0:
            return prompt.clone()
        if spec is not None:
            return speculative_generate(self, prompt, new, full_mask, rules, fill, spec, context, context_mask, owner,
                                        None if sampling[0] == 0.0 else sampling, generator)
        return self._sampled(prompt, new, full_mask, rules, fill, sampling, generator, context, context_mask)

    def _sampled(self, prompt: Tensor, new: int, full_mask: Tensor | None, rules: GenerationRules, fill: int | None,
                 sampling: tuple[float, int | None, float | None], generator: torch.Generator | None,
                 context: Tensor | None, context_mask: Tensor | None) -> Tensor:
        """Greedy or sampled decoding of :meth:`generate` on checked arguments: ``prompt [B, N]``,
        ``full_mask [B, N + new]`` (the prompt's left padding, then real), ``fill`` the token of
        ended rows. Returns ``[B, N + T]``."""
        (B, n), dev = prompt.shape, prompt.device
        cache = self.init_cache(B, n + new)
        tokens = torch.empty(B, n + new, dtype=torch.long, device=dev)
        tokens[:, :n] = prompt
        positions = positions_from_mask(full_mask[:, :n]) if full_mask is not None else None
        logits = self._last_logits(prompt, cache, positions, None if full_mask is None else full_mask[:, :n],
                                   context, context_mask)  # [B, V]
        next_pos = None if positions is None else positions[:, -1:] + 1  # [B, 1]
        ends = torch.tensor(rules.eos, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        written = n
        for t in range(new):
            scores = rules.apply(logits.float(), t, tokens[:, :n + t],  # in float32, as transformers
                                 None if full_mask is None else full_mask[:, :n + t])
            tok = _sample(scores, *sampling, generator)  # [B]
            if fill is not None:
                tok = torch.where(done, torch.full_like(tok, fill), tok)
                done = done | torch.isin(tok, ends)
            tokens[:, n + t] = tok
            written = n + t + 1
            if t == new - 1 or bool(done.all()):
                break
            am = None if full_mask is None else full_mask[:, :written]
            logits = self._decode_step(tokens[:, :written], cache, next_pos, am, context, context_mask)
            if next_pos is not None:
                next_pos = next_pos + 1
        return tokens[:, :written]
