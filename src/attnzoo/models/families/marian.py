"""Marian (``marian``: the Helsinki-NLP opus-mt translation models) and Pegasus (``pegasus``) ->
:class:`~attnzoo.EncoderDecoder`, as ``MarianMTModel`` / ``PegasusForConditionalGeneration`` (the
LM head) and ``MarianModel`` / ``PegasusModel`` (no head: the decoder's last hidden states
``[B, N, C]``). Line numbers: transformers 5.25's ``models/marian/modeling_marian.py`` (M) and
``configuration_marian.py`` (MC), ``models/pegasus/modeling_pegasus.py`` (P).

Both are BART's encoder-decoder (attention with biases on q/k/v/out, ``scaling = head_dim**-0.5``,
M 136-251; a ``fc1 -> act -> fc2`` feed-forward with biases; LayerNorms of eps 1e-5) with fixed
sinusoidal positions instead of BART's learned ones:

* the position table (M 73-103, P 75-105) is **not interleaved**: row ``p`` is
  ``[sin(p w_0) .. sin(p w_{h-1}), cos(p w_0) .. cos(p w_{C-h-1})]``, ``h = ceil(C / 2)``,
  ``w_i = 10000^(-2i / C)``, computed in float64 by numpy and rounded to float32 (M 79-92):
  :func:`split_sinusoidal_table`. It is an ``nn.Embedding`` frozen parameter
  (``embed_positions.weight``): in the state dict, hence read from the checkpoint when it is
  there (its values are what transformers uses), and rebuilt by ``_init_weights`` when it is not
  (M 401-404) — ``MarianMTModel`` leaves both tables out of its saved files
  (``_keys_to_ignore_on_save``, M 805; ``PegasusModel`` / ``MarianModel`` save them). attnzoo holds
  it as a persistent buffer (:class:`SplitSinusoidalPositions`), computed the same way when the
  checkpoint has none. Positions are ``0..M-1`` in the encoder whatever the padding (M 473) and
  ``cache_length + 0..N-1`` in the decoder (M 571, 594);
* token embeddings times ``sqrt(d_model)`` when ``scale_embedding`` (opus-mt and Pegasus: true;
  M 444, 471, 524, 559);
* Marian's layers are **post-norm** (``x = LN(x + sublayer(x))``, M 255-303, 307-387), with no final
  norm on either stack; Pegasus' are **pre-norm** (MBart's, P 257-310, 314-405) with a final
  ``layer_norm`` after each stack (P 460/540, 578/692);
* ``activation_function``: opus-mt uses ``swish`` (SiLU), Pegasus ``relu``; the class default is
  ``gelu`` (exact);
* the LM head adds ``final_logits_bias`` (a buffer ``[1, V]``, zeros unless trained, M 819/975,
  P 853/977): an :class:`~attnzoo.models.parts.LMHead` with a bias;
* per-stack ``encoder_layers`` / ``decoder_layers``, ``*_attention_heads``, ``*_ffn_dim``;
* float16: the encoder layers clamp their output to ``±(finfo.max - 1000)`` — Marian only when some
  value is not finite (M 299-301), Pegasus always (P 306-308): :class:`Float16ClampedBlock` (no host
  sync; packed input, ``cu_seqlens``, is refused in float16 only for Marian, whose clamp reads the whole
  batch).

Embeddings and ties. Marian's decoder has its own vocabulary ``decoder_vocab_size`` (MC 82-84;
the default is ``vocab_size``) when ``share_encoder_decoder_embeddings`` is false (the opus-mt-tc
models with two vocabularies): ``encoder.embed_tokens [V, C]``, ``decoder.embed_tokens [V_dec, C]``,
the head over ``V_dec`` (M 526, 818-820); when true, one ``shared`` table. ``tie_word_embeddings``
ties, in transformers 5, the whole group of its ``_tied_weights_keys`` (M 633-640, 806-816; P 702-705,
846-848): encoder, decoder and head to ``shared`` (Marian unshared: the head to the decoder's
table). Untied (``tie_word_embeddings: false``), **all** of them are separate, ``shared`` included,
which the forward then never reads. As in transformers' ``from_pretrained`` (``tie_weights``,
``modeling_utils.py`` 2541-2591), a tie whose two tensors are both in the checkpoint with different
values is not made, and a tie reads whichever of its two tensors the file holds
(:func:`embedding_sources`).

``decoder_start_token_id`` (Marian: the pad id, M 726; Pegasus: 0, the pad id too) and
``eos_token_id`` (a one-element list is read as its element, a longer one as none) become the
:class:`~attnzoo.EncoderDecoder`'s. Dropouts map to the blocks (``dropout`` on the sub-layer
outputs and the embeddings, ``activation_dropout`` in the feed-forward, ``attention_dropout`` on the
attention probabilities); the pad row of each embedding gets no gradient (``padding_idx``), as there.

The decoder's positions are the slots ``cache.length + 0..N-1`` whatever ``tgt_mask`` says (as
transformers, M 571: :class:`SplitSinusoidalPositions` sets ``counts_mask = False``).
transformers' generation settings (opus-mt's ``bad_words_ids=[[pad]]``, beams, ``max_length``,
``forced_eos_token_id``) belong to ``generation_config.json``, not to the model: pass beams and
forced tokens to :meth:`~attnzoo.EncoderDecoder.generate` (``bad_words_ids`` has no equivalent there).

Refused by name (:class:`~attnzoo.interop.UnsupportedConfigError`): ``MarianForCausalLM`` /
``PegasusForCausalLM`` (``is_decoder=True`` or ``is_encoder_decoder=False``: a decoder alone), an
``activation_function`` without an attnzoo feed-forward, ``share_encoder_decoder_embeddings`` with
``decoder_vocab_size`` other than ``vocab_size`` (one shared table of two sizes), a ``d_model``
that the heads do not divide. ``encoder_layerdrop`` / ``decoder_layerdrop`` (layers skipped at
random in training) are not reproduced: attnzoo runs every layer, as transformers does in eval mode.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families._seq2seq as shared
from attnzoo._devices import tracing
from attnzoo._validate import check_bool, check_int
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock
from attnzoo.models.config import DecoderConfig, EncoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.parts import DecoderParts, EncoderParts, LMHead, PackedFromZero, ScaledEmbedding
from attnzoo.models.seq2seq import EncoderDecoder
from attnzoo.nn.positional import resolve_positions
from attnzoo.variants import build_attention

__all__ = ["DEFAULTS", "DISPATCH", "VARIANTS", "SinusoidalTokenEmbedding",
           "SplitSinusoidalPositions", "Variant", "build_seq2seq", "convert_seq2seq", "embedding_sources",
           "split_sinusoidal_table"]


_COMMON: dict[str, Any] = {
    "max_position_embeddings": 1024, "encoder_layers": 12, "encoder_ffn_dim": 4096, "encoder_attention_heads": 16,
    "decoder_layers": 12, "decoder_ffn_dim": 4096, "decoder_attention_heads": 16, "encoder_layerdrop": 0.0,
    "decoder_layerdrop": 0.0, "activation_function": "gelu", "d_model": 1024, "dropout": 0.1,
    "attention_dropout": 0.0, "activation_dropout": 0.0, "scale_embedding": False, "is_decoder": False,
    "is_encoder_decoder": True, "tie_word_embeddings": True}
#: each config class's defaults of the keys read here (``configuration_*.py``; a ``config.json`` may
#: leave them out). Marian's ``decoder_vocab_size`` defaults to ``vocab_size`` (MC 82-84).
DEFAULTS: dict[str, dict[str, Any]] = {
    "marian": {**_COMMON, "vocab_size": 58101, "decoder_start_token_id": 58100, "pad_token_id": 58100,
               "eos_token_id": 0, "share_encoder_decoder_embeddings": True},
    "pegasus": {**_COMMON, "vocab_size": 50265, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1},
}


@dataclass(frozen=True)
class Variant:
    """One ``model_type``: its name, the transformers classes, pre-norm layers with a final
    ``layer_norm`` per stack (Pegasus) or post-norm without (Marian), whether the encoder's float16
    clamp is unconditional (Pegasus) or only after an overflow (Marian), and whether the config has
    Marian's two vocabularies (``decoder_vocab_size``, ``share_encoder_decoder_embeddings``)."""

    name: str
    classes: tuple[str, ...]
    pre_norm: bool
    always_clamp: bool
    two_vocabularies: bool


VARIANTS: dict[str, Variant] = {
    "marian": Variant("Marian", ("MarianMTModel", "MarianModel"), pre_norm=False, always_clamp=False,
                      two_vocabularies=True),
    "pegasus": Variant("Pegasus", ("PegasusForConditionalGeneration", "PegasusModel"), pre_norm=True,
                       always_clamp=True, two_vocabularies=False),
}


# --------------------------------------------------------------------------- positions
def split_sinusoidal_table(num_positions: int, dim: int, *, device: torch.device | str | None = None,
                           dtype: torch.dtype | None = None) -> Tensor:
    """Marian's / Pegasus' position table ``[P, C]`` (M 79-92): row ``p`` holds the sines
    ``sin(p / 10000^(2i / C))`` for ``i < ceil(C / 2)``, then the cosines for ``i < floor(C / 2)``
    (not interleaved), computed in float64, rounded to float32 (as transformers), then to ``dtype``
    (default float32). On the ``meta`` device: an empty tensor of that shape."""
    check_int(num_positions, "num_positions", "split_sinusoidal_table")
    check_int(dim, "dim", "split_sinusoidal_table")
    dtype = torch.float32 if dtype is None else dtype
    if torch.device(device or "cpu").type == "meta":
        return torch.empty(num_positions, dim, device="meta", dtype=dtype)
    denom = torch.tensor([10000.0 ** (2 * i / dim) for i in range((dim + 1) // 2)], dtype=torch.float64)  # [h]
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] / denom  # [P, h]
    table = torch.cat([angles.sin(), angles[:, : dim // 2].cos()], dim=1)  # [P, C]
    return table.float().to(device=device, dtype=dtype)


class SplitSinusoidalPositions(nn.Module):
    """``x + weight[positions]`` with Marian's / Pegasus' fixed table (:func:`split_sinusoidal_table`).

    ``weight [P, C]`` is a persistent buffer (saved, not trained): the checkpoint's
    ``embed_positions.weight`` when it has one, else the computed table.

    Args:
        num_positions: ``P`` (``max_position_embeddings``); positions from ``P`` on raise ``ValueError``.
        dim: width ``C``.

    Shapes: ``x [B, N, C]``, ``positions [N] | [B, N] | None`` (default ``0..N-1``) -> ``[B, N, C]``.
    """

    weight: Tensor
    #: :class:`~attnzoo.DecoderLM` passes the slots ``cache.length + 0..N-1``, not the mask's count
    counts_mask = False

    def __init__(self, num_positions: int, dim: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_positions = check_int(num_positions, "num_positions", "SplitSinusoidalPositions")
        self.dim = check_int(dim, "dim", "SplitSinusoidalPositions")
        self.register_buffer("weight", split_sinusoidal_table(num_positions, dim, device=device, dtype=dtype))

    def reset_table(self) -> None:
        """Recompute the table (in place, in the buffer's dtype and device)."""
        with torch.no_grad():
            self.weight.copy_(split_sinusoidal_table(self.num_positions, self.dim, device=self.weight.device,
                                                     dtype=self.weight.dtype))

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        owner = "SplitSinusoidalPositions"
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{owner}: x must be [B, N, C] with C = {self.dim}, got {got}")
        pos = resolve_positions(positions, x.shape[1], 0, self.weight.device, batch=x.shape[0], name="positions")
        if pos.numel() and not tracing() and int(pos.max()) >= self.num_positions:  # eager only: syncs
            raise ValueError(f"{owner}: position {int(pos.max())} is beyond the table's {self.num_positions} "
                             f"positions (max_position_embeddings)")
        return x + self.weight[pos].to(x.dtype)  # [B, N, C]

    def extra_repr(self) -> str:
        return f"num_positions={self.num_positions}, dim={self.dim}"


class SinusoidalTokenEmbedding(PackedFromZero, nn.Module):
    """The encoder's input embedding: ``tok_emb(tokens) * scale + table[positions]`` (positions
    ``0..N-1`` whatever the padding, M 470-475). ``tok_emb`` is a
    :class:`~attnzoo.models.parts.ScaledEmbedding` (``scale``: ``sqrt(C)`` or 1.0) whose pad row gets
    no gradient (``padding_idx``), ``positions`` a :class:`SplitSinusoidalPositions`.

    Shapes: ``tokens [B, N]``, ``token_type_ids`` must be ``None``, ``positions [N] | [B, N] | None``
    -> ``[B, N, C]``.
    """

    def __init__(self, vocab_size: int, dim: int, num_positions: int, *, scale: float,
                 padding_idx: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tok_emb = _embedding(vocab_size, dim, scale, padding_idx, device=device, dtype=dtype)
        self.positions = SplitSinusoidalPositions(num_positions, dim, device=device, dtype=dtype)

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        if token_type_ids is not None:
            raise ValueError("SinusoidalTokenEmbedding: this embedding has no token types; token_type_ids must be None")
        return self.positions(self.tok_emb(tokens), positions)  # [B, N, C]


def _embedding(vocab_size: int, dim: int, scale: float, padding_idx: int | None, *, device: Any,
               dtype: Any) -> ScaledEmbedding:
    """A token table times ``scale``; ``padding_idx`` (when inside the table) gets no gradient, as
    transformers' ``nn.Embedding(V, C, padding_idx)``."""
    emb = ScaledEmbedding(vocab_size, dim, scale=scale, device=device, dtype=dtype)
    nn.init.normal_(emb.weight, 0.0, 0.02)
    if padding_idx is not None and 0 <= padding_idx < vocab_size:
        emb.padding_idx = padding_idx
    return emb


# --------------------------------------------------------------------------- layers
def _layers(hf: HFConfig, v: Variant, stack: str, *, kw: dict[str, Any]) -> BlockLayers:
    """The factories of one stack's layers (``stack``: ``"encoder"`` or ``"decoder"``)."""
    C, H = hf.req("d_model"), hf.req(f"{stack}_attention_heads")
    decoder = stack == "decoder"
    attention = {"bias": True, "dropout": hf.get("attention_dropout", 0.0, float), **kw}
    return BlockLayers(
        attention=functools.partial(build_attention, "mha", C, H, causal=decoder, **attention),
        cross_attention=functools.partial(build_attention, "mha", C, H, kv_dim=C, causal=False, **attention)
        if decoder else None,
        feed_forward=functools.partial(FeedForward, C, hf.req(f"{stack}_ffn_dim"), _activation(hf), bias=True,
                                       dropout=hf.get("activation_dropout", 0.0, float), **kw),
        norm=functools.partial(nn.LayerNorm, C, eps=1e-5, **kw), norm_first=v.pre_norm,
        dropout=hf.get("dropout", 0.0, float))


def _activation(hf: HFConfig) -> str:
    return hf.activation("activation_function", shared.ACTIVATIONS, "gelu")


# --------------------------------------------------------------------------- config
def _read(hf: HFConfig, v: Variant, model_type: str) -> HFConfig:
    """``hf`` with the class defaults (Marian's ``decoder_vocab_size`` from ``vocab_size``), the
    options attnzoo does not reproduce refused by name."""
    out = hf.with_defaults(DEFAULTS[model_type])
    if v.two_vocabularies and not out.has("decoder_vocab_size"):
        out.data["decoder_vocab_size"] = out.req("vocab_size")
    if out.get("is_decoder", False, bool) or not out.get("is_encoder_decoder", True, bool):
        raise hf.unsupported("is_decoder=True / is_encoder_decoder=False (the causal-LM class, a decoder alone; "
                             f"{' and '.join(v.classes)} are converted)")
    _activation(out)
    if v.two_vocabularies and out.get("share_encoder_decoder_embeddings", True, bool) and \
            out.req("decoder_vocab_size") != out.req("vocab_size"):
        raise hf.unsupported(f"share_encoder_decoder_embeddings=True with decoder_vocab_size="
                             f"{out.raw('decoder_vocab_size')} != vocab_size={out.raw('vocab_size')} (one shared "
                             "table of two sizes)")
    C = out.req("d_model")
    for stack in ("encoder", "decoder"):
        H = out.req(f"{stack}_attention_heads")
        if C % H:
            raise hf.unsupported(f"d_model={C} not divisible by {stack}_attention_heads={H}")
    return out


def _vocabularies(hf: HFConfig, v: Variant) -> tuple[int, int]:
    """``(V_src, V_tgt)``: the encoder's and the decoder's (and head's) vocabularies."""
    V = hf.req("vocab_size")
    if v.two_vocabularies and not hf.get("share_encoder_decoder_embeddings", True, bool):
        return V, hf.req("decoder_vocab_size")
    return V, V


# --------------------------------------------------------------------------- ties
#: the embedding roles: the encoder's table, the decoder's, the LM head, the model's ``shared`` table
ROLES = ("shared", "encoder", "decoder", "head")


def _role_keys(prefix: str) -> dict[str, str]:
    return {"shared": f"{prefix}shared.weight", "encoder": f"{prefix}encoder.embed_tokens.weight",
            "decoder": f"{prefix}decoder.embed_tokens.weight", "head": "lm_head.weight"}


def _tie_pairs(hf: HFConfig, v: Variant, head: bool) -> list[tuple[str, str]]:
    """transformers' tied pairs ``(target, source)`` of the roles (``_tied_weights_keys``): none
    unless ``tie_word_embeddings``."""
    if not hf.get("tie_word_embeddings", True, bool):
        return []
    if v.two_vocabularies and not hf.get("share_encoder_decoder_embeddings", True, bool):
        return [("head", "decoder")] if head else []
    return [("encoder", "shared"), ("decoder", "shared")] + ([("head", "shared")] if head else [])


def embedding_sources(hf: HFConfig, v: Variant, sd: dict[str, Tensor], prefix: str, head: bool) -> dict[str, str]:
    """Role (``"encoder"``, ``"decoder"``, ``"head"`` when ``head``) -> the checkpoint key it reads.
    Roles tied together read one key (the first of the group the checkpoint holds, ``shared``
    first; with none, the group's first); a tie is not made when both of its tensors are in ``sd``
    with different values (transformers' ``tie_weights`` at load time). ``shared`` itself is read
    only through a tie."""
    keys = _role_keys(prefix)
    group = {r: r for r in ROLES}

    def find(r: str) -> str:
        while group[r] != r:
            r = group[r]
        return r

    for target, source in _tie_pairs(hf, v, head):
        a, b = sd.get(keys[target]), sd.get(keys[source])
        if a is not None and b is not None and a is not b and not (a.shape == b.shape and torch.equal(a, b)):
            continue  # both in the file and different: transformers does not tie them
        group[find(target)] = find(source)
    out = {}
    for role in ("encoder", "decoder", "head")[: 3 if head else 2]:
        members = [r for r in ROLES if find(r) == find(role)]
        out[role] = next((keys[r] for r in members if keys[r] in sd), keys[members[0]])
    return out


# --------------------------------------------------------------------------- the model
def build_seq2seq(hf: HFConfig, model_type: str, *, head: bool = True, sources: dict[str, str] | None = None,
                  device: Any = None, dtype: Any = None) -> EncoderDecoder:
    """The ``model_type`` (``"marian"`` or ``"pegasus"``) model of ``hf`` with random weights.

    ``head``: the LM head (``*MTModel`` / ``*ForConditionalGeneration``: ``LMHead`` with the
    ``final_logits_bias``), else ``nn.Identity()`` (``*Model``: the decoder's last hidden states).
    ``sources``: role -> checkpoint key (:func:`embedding_sources`); roles reading one key share one
    parameter (default: the config's ties). Returns ``EncoderDecoder``: ``src [B, M]``,
    ``tgt [B, N]`` -> ``[B, N, V_dec]`` (or ``[B, N, C]``)."""
    if model_type not in VARIANTS:
        raise ValueError(f"build_seq2seq: model_type must be one of {sorted(VARIANTS)}, got {model_type!r}")
    check_bool(head, "head", "build_seq2seq")
    v = VARIANTS[model_type]
    hf = _read(hf, v, model_type)
    if sources is None:
        sources = embedding_sources(hf, v, {}, "model." if head else "", head)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    C, P = hf.req("d_model"), hf.req("max_position_embeddings")
    V_src, V_tgt = _vocabularies(hf, v)
    scale = math.sqrt(C) if hf.get("scale_embedding", False, bool) else 1.0
    pad = hf.get("pad_token_id", None)
    dropout = hf.get("dropout", 0.0, float)

    embedding = SinusoidalTokenEmbedding(V_src, C, P, scale=scale, padding_idx=pad, **kw)
    enc_layers = _layers(hf, v, "encoder", kw=kw)
    depth = hf.req("encoder_layers")
    encoder = TransformerEncoder(
        config=EncoderConfig(V_src, C, depth, hf.req("encoder_attention_heads"), max_seq_len=P, pos="sinusoidal",
                             norm_first=v.pre_norm, dropout=dropout),
        parts=EncoderParts(embedding=embedding,
                           blocks=[shared.Float16ClampedBlock(C, layers=enc_layers, always=v.always_clamp)
                                   for _ in range(depth)],
                           norm=nn.LayerNorm(C, eps=1e-5, **kw) if v.pre_norm else nn.Identity()), **kw)

    dec_emb = _embedding(V_tgt, C, scale, pad, **kw)
    if sources["decoder"] == sources["encoder"]:
        dec_emb.weight = embedding.tok_emb.weight
    lm_head: nn.Module = LMHead(C, V_tgt, bias=True, **kw) if head else nn.Identity()
    if isinstance(lm_head, LMHead):
        nn.init.zeros_(lm_head.bias)
        tied = {role: m.weight for role, m in (("encoder", embedding.tok_emb), ("decoder", dec_emb))}
        for role in ("decoder", "encoder"):
            if sources["head"] == sources[role]:
                lm_head.weight = tied[role]
                break
    dec_layers = _layers(hf, v, "decoder", kw=kw)
    decoder = DecoderLM(
        config=DecoderConfig(V_tgt, C, hf.req("decoder_layers"), hf.req("decoder_attention_heads"), max_seq_len=P,
                             pos="sinusoidal", norm="layer", norm_eps=1e-5, dropout=dropout, tie_embeddings=False),
        parts=DecoderParts(blocks=lambda _: TransformerBlock(C, layers=dec_layers), embedding=dec_emb,
                           norm=nn.LayerNorm(C, eps=1e-5, **kw) if v.pre_norm else nn.Identity(), head=lm_head,
                           positions=SplitSinusoidalPositions(P, C, **kw)), **kw)
    start = hf.get("decoder_start_token_id", None)
    return EncoderDecoder(encoder, decoder, decoder_start_token_id=start, eos_token_id=shared.config_token(hf.raw("eos_token_id")))


def _put_positions(plan: Plan, name: str, key: str, module: SplitSinusoidalPositions) -> None:
    """The checkpoint's table when it has one, else the computed one (a constant of the plan)."""
    if plan.src.has(key):
        plan.put(name, key)
    else:
        table = split_sinusoidal_table(module.num_positions, module.dim)
        plan.put_tensor(name, table, f"{plan.src.prefix}{key} (absent: the computed sinusoidal table)")


def convert_seq2seq(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any,
                    model_type: str = "marian") -> EncoderDecoder:
    """Build the ``model_type`` model and copy the weights: the LM head when the weights are under
    ``model.`` (``*MTModel`` / ``*ForConditionalGeneration``), none for the bare ``*Model``; ties as
    transformers makes them (:func:`embedding_sources`); the position tables from the checkpoint,
    or computed when it has none."""
    v = VARIANTS[model_type]
    hf = _read(hf, v, model_type)
    head = any(k.startswith("model.") for k in sd)
    prefix = "model." if head else ""
    sources = embedding_sources(hf, v, sd, prefix, head)
    model = build_seq2seq(hf, model_type, head=head, sources=sources, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(Source(sd, ""), v.name)
    params = dict(model.named_parameters())  # one name per shared parameter: the first
    names = {"encoder": "encoder.embedding.tok_emb.weight", "decoder": "decoder.tok_emb.weight",
             "head": "decoder.lm_head.weight"}
    for role, key in sources.items():
        if names[role] in params:
            plan.put(names[role], key)
    read = set(sources.values())
    ignore = [k for k in _role_keys(prefix).values() if k not in read]  # tied copies, an unused `shared`
    enc = model.encoder
    dec = model.decoder
    assert isinstance(enc, TransformerEncoder) and isinstance(enc.embedding, SinusoidalTokenEmbedding)
    assert isinstance(dec.pos_emb, SplitSinusoidalPositions)
    _put_positions(plan, "encoder.embedding.positions.weight", f"{prefix}encoder.embed_positions.weight",
                   enc.embedding.positions)
    _put_positions(plan, "decoder.pos_emb.weight", f"{prefix}decoder.embed_positions.weight", dec.pos_emb)
    for i in range(enc.depth):
        shared.put_layer(plan, f"encoder.blocks.{i}.", f"{prefix}encoder.layers.{i}.", cross=False)
    for i in range(dec.depth):
        shared.put_layer(plan, f"decoder.blocks.{i}.", f"{prefix}decoder.layers.{i}.", cross=True)
    if v.pre_norm:
        plan.put_pairs("", prefix, [("encoder.norm", "encoder.layer_norm"), ("decoder.norm", "decoder.layer_norm")])
    if head:
        if plan.src.has("final_logits_bias"):
            plan.put("decoder.lm_head.bias", "final_logits_bias", lambda t: t.reshape(-1))
        else:  # an old checkpoint without it: zeros (transformers' _init_weights)
            bias = params["decoder.lm_head.bias"]
            plan.put_tensor("decoder.lm_head.bias", torch.zeros(bias.shape), "final_logits_bias (absent: zeros)")
    plan.apply(model, ignore=[_escape(k) for k in ignore])
    return model


def _escape(key: str) -> str:
    return key.replace(".", r"\.")


def _dispatch(model_type: str) -> parts.Dispatch:
    v = VARIANTS[model_type]
    return parts.Dispatch(v.name, functools.partial(convert_seq2seq, model_type=model_type), v.classes)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH: dict[str, parts.Dispatch] = {t: _dispatch(t) for t in VARIANTS}
