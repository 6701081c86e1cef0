"""Whisper (OpenAI's speech recogniser) -> :class:`~attnzoo.EncoderDecoder`: ``model_type``
``whisper`` (openai/whisper-tiny ... large-v3, whisper-large-v3-turbo, distil-whisper), as
``WhisperForConditionalGeneration`` (the tied ``proj_out`` head: logits ``[B, N, V]``) and
``WhisperModel`` (no head: the decoder's hidden states ``[B, N, C]``). Line numbers: transformers
5.25's ``models/whisper/modeling_whisper.py`` (configuration: ``configuration_whisper.py``).

The encoder reads log-mel features ``[B, num_mel_bins, 2 * max_source_positions]``, not token ids
(:class:`WhisperAudioEncoder`, 544-645): ``gelu(conv1)`` (kernel 3, padding 1), ``gelu(conv2)``
(kernel 3, stride 2, padding 1; 617-618) halve the frames to ``max_source_positions``, plus the
position table ``embed_positions`` (621-623), then pre-norm layers (364-417) and a final
``layer_norm``. The decoder (648-822, a :class:`~attnzoo.DecoderLM` with cross-attention) is a
token embedding plus a learned position table (no offset, :class:`WhisperPositionalEmbedding`
206-214), pre-norm layers with self-attention, cross-attention to the encoder's output and the
feed-forward (420-511), a final ``layer_norm``, and ``proj_out`` tied to the token embedding
(990-1122, ``tie_word_embeddings``; an untied ``proj_out.weight`` is loaded as its own head).

Quirks reproduced:

* ``k_proj`` has **no bias** where ``q_proj``, ``v_proj`` and ``out_proj`` have one (281-284):
  attnzoo's fused projections have a bias on the query and value rows only
  (:class:`~attnzoo.models.families._seq2seq.PartlyBiasedLinear`: the key rows' zeros are not
  parameters), so a fine-tuned model writes back with :func:`~attnzoo.interop.to_hf` exactly.
* The encoder's position table is stored in the checkpoint (``encoder.embed_positions.weight``,
  a frozen ``nn.Embedding`` initialised with :func:`split_sinusoids`, 57-66 and 527-533: sines in
  the first half of the channels, cosines in the second, not interleaved) and is loaded as it is,
  a fixed table (a persistent buffer, not trained). A checkpoint without it gets the sinusoids.
* Queries are scaled by ``head_dim ** -0.5`` before the product (312): the same scale.
* ``scale_embedding`` is read by transformers (569, 672) but never applied: ignored here too.
* The encoder takes exactly ``2 * max_source_positions`` frames (611-615: a ``ValueError`` names
  the expected shape) and no mask (transformers ignores ``attention_mask``, 606-608; attnzoo
  refuses one rather than ignore it); the decoder's cross-attention has no mask (810).
* In float16 every encoder layer clamps its output to ``±(finfo.max - 1000)`` (412-415;
  :class:`~attnzoo.models.families._seq2seq.Float16ClampedBlock`), the decoder layers do not.
* Decoder positions are ``0..N-1`` (plus the cache length; 776-787), bounded by
  ``max_target_positions`` (the decoder's ``max_seq_len``). With a left-padded ``tgt_mask``
  attnzoo counts positions over the real tokens, as transformers' ``generate`` does
  (``prepare_inputs_for_generation``, 1013-1024), not its plain forward (``0..N-1`` whatever the
  mask).
* Dropouts (``dropout`` residual, ``attention_dropout``, ``activation_dropout``) are kept for
  training; ``encoder_layerdrop`` / ``decoder_layerdrop`` (training-time layer skipping) and
  SpecAugment (``apply_spec_augment``: training-time feature masking, 847-891) are not reproduced:
  both are no-ops in eval mode, where the conversion is exact. ``pad_token_id``'s
  ``padding_idx`` (a frozen gradient for that embedding row) is not kept.

Generation: :meth:`EncoderDecoder.generate` is greedy, sampled or beam-search decoding with a KV cache; give
Whisper's task tokens as ``decoder_prompt`` (``<|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>``). transformers' ``WhisperGenerationMixin`` logic (timestamps, language
detection, ``suppress_tokens`` / ``begin_suppress_tokens``, long-form chunking, temperature
fallback) is not reproduced.

Refused by name: ``WhisperForAudioClassification`` (an encoder with a classifier, no decoder),
``WhisperForCausalLM`` (the decoder alone, an assistant model for speculative decoding), an
``activation_function`` attnzoo has no feed-forward for, ``d_model`` not divisible by the heads.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families._seq2seq as shared
from attnzoo._validate import check_int
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock, make_norm
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.parts import DecoderParts, LMHead
from attnzoo.models.seq2seq import EncoderDecoder
from attnzoo.nn.attention import MultiHeadAttention, build_softmax

__all__ = ["DEFAULTS", "DISPATCH", "WhisperAudioEncoder", "build_whisper", "convert_whisper"]

#: ``WhisperConfig``'s defaults of the keys read here (``configuration_whisper.py`` 126-163)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 51865, "num_mel_bins": 80, "d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6,
    "decoder_layers": 4, "decoder_attention_heads": 6, "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536,
    "activation_function": "gelu", "max_source_positions": 1500, "max_target_positions": 448,
    "decoder_start_token_id": 50257, "eos_token_id": 50256, "tie_word_embeddings": True, "dropout": 0.0,
    "attention_dropout": 0.0, "activation_dropout": 0.0}

#: transformers' ``nn.LayerNorm`` default epsilon (Whisper's norms take no config key)
EPS = 1e-5


def _attention(dim: int, heads: int, *, causal: bool = False, cross: bool = False, dropout: float = 0.0,
               device: Any = None, dtype: Any = None) -> nn.Module:
    """Whisper's attention: q/k/v/out projections with biases but the key's (a
    :class:`~attnzoo.models.families._seq2seq.PartlyBiasedLinear`), scale
    ``head_dim ** -0.5``; ``cross``: queries from the decoder, keys/values from the encoder."""
    attn = build_softmax(MultiHeadAttention, dim, heads, bias=True, causal=causal, kv_dim=dim if cross else None,
                         dropout=dropout, device=device, dtype=dtype)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    if cross:  # rows [k; v]: the keys unbiased
        attn.kv_proj = shared.PartlyBiasedLinear(dim, 2 * dim, unbiased=(0, dim), **kw)
    else:  # rows [q; k; v]
        attn.qkv_proj = shared.PartlyBiasedLinear(dim, 3 * dim, unbiased=(dim, 2 * dim), **kw)
    return attn


def _layers(dim: int, heads: int, ffn_dim: int, activation: str, *, decoder: bool, dropout: float = 0.0,
            attention_dropout: float = 0.0, activation_dropout: float = 0.0, device: Any = None,
            dtype: Any = None) -> BlockLayers:
    """The factories of one pre-norm layer (LayerNorm eps 1e-5, biased feed-forward)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    attn = functools.partial(_attention, dim, heads, dropout=attention_dropout, **kw)
    return BlockLayers(attention=functools.partial(attn, causal=decoder),
                       cross_attention=functools.partial(attn, cross=True) if decoder else None,
                       feed_forward=functools.partial(FeedForward, dim, ffn_dim, activation, bias=True,
                                                      dropout=activation_dropout, **kw),
                       norm=functools.partial(make_norm, "layer", dim, EPS, **kw), dropout=dropout)


class WhisperAudioEncoder(nn.Module):
    """Whisper's audio encoder: log-mel features ``[B, num_mel_bins, 2 * max_source_positions]`` ->
    ``gelu(conv1)`` (kernel 3, padding 1) -> ``gelu(conv2)`` (kernel 3, stride 2, padding 1) ->
    ``[B, max_source_positions, C]`` plus the fixed position table ``embed_positions`` -> pre-norm
    blocks (:class:`~attnzoo.models.families._seq2seq.Float16ClampedBlock`) -> ``layer_norm``.

    Args:
        num_mel_bins: mel channels ``F`` of the features.
        dim: model width ``C`` (even: the sinusoidal table).
        num_heads: attention heads (``C % num_heads == 0``).
        depth: blocks.
        ffn_dim: the feed-forward's hidden width.
        max_source_positions: frames after the stride-2 convolution ``M`` (1500 for 30 s of audio);
            the features have ``2 * M`` frames, no more and no fewer.
        activation: the feed-forward activation (:class:`~attnzoo.FeedForward`'s names).
        dropout, attention_dropout, activation_dropout: training dropouts (residual and after the
            positions, attention weights, feed-forward hidden).

    Weights: ``conv1 [C, F, 3]``, ``conv2 [C, C, 3]`` (with biases), ``blocks[i]`` (``attn.qkv_proj``,
    ``attn.out_proj``, ``attn_norm``, ``ffn.up_proj``, ``ffn.down_proj``, ``ffn_norm``),
    ``layer_norm``; the persistent buffer ``embed_positions [M, C]`` (:func:`split_sinusoids`
    until a checkpoint's table is loaded; not trained, as transformers freezes it).

    Shapes: ``forward(features [B, F, 2M], attention_mask=None) -> [B, M, C]``.
    """

    embed_positions: Tensor

    def __init__(self, num_mel_bins: int, dim: int, num_heads: int, depth: int, ffn_dim: int,
                 max_source_positions: int, *, activation: str = "gelu", dropout: float = 0.0,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = type(self).__name__
        self.num_mel_bins = check_int(num_mel_bins, "num_mel_bins", owner)
        self.dim = check_int(dim, "dim", owner)
        self.num_heads = check_int(num_heads, "num_heads", owner)
        self.depth = check_int(depth, "depth", owner)
        self.max_source_positions = check_int(max_source_positions, "max_source_positions", owner)
        if dim % num_heads:
            raise ValueError(f"{owner}: dim={dim} must be divisible by num_heads={num_heads}")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.conv1 = nn.Conv1d(num_mel_bins, dim, kernel_size=3, padding=1, **kw)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1, **kw)
        self.register_buffer("embed_positions", shared.split_sinusoids(max_source_positions, dim).to(**kw))
        self.drop = nn.Dropout(dropout)
        layers = _layers(dim, num_heads, check_int(ffn_dim, "ffn_dim", owner), activation, decoder=False,
                         dropout=dropout, attention_dropout=attention_dropout, activation_dropout=activation_dropout,
                         **kw)
        self.blocks = nn.ModuleList([shared.Float16ClampedBlock(dim, layers=layers, always=True) for _ in range(depth)])
        self.layer_norm = make_norm("layer", dim, EPS, **kw)

    @property
    def num_frames(self) -> int:
        """The features' frames: ``2 * max_source_positions``."""
        return 2 * self.max_source_positions

    def forward(self, features: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """``features [B, num_mel_bins, 2 * max_source_positions]`` (float) -> ``[B, max_source_positions, C]``.
        ``attention_mask`` must be ``None``: Whisper attends to every frame (pad the audio with silence)."""
        owner = type(self).__name__
        if attention_mask is not None:
            raise ValueError(f"{owner}: attention_mask must be None (Whisper reads all {self.num_frames} frames; "
                             f"pad shorter audio with silence, as WhisperFeatureExtractor does)")
        want = f"[B, num_mel_bins, 2*max_source_positions] = [B, {self.num_mel_bins}, {self.num_frames}]"
        if not isinstance(features, Tensor):
            raise TypeError(f"{owner}: features must be a torch.Tensor {want}, got {type(features).__name__}")
        if not features.is_floating_point():
            raise TypeError(f"{owner}: features must be log-mel values (a float tensor {want}), got {features.dtype}")
        if features.dim() != 3 or features.shape[0] == 0 or features.shape[1:] != (self.num_mel_bins, self.num_frames):
            raise ValueError(f"{owner}: features must have shape {want}, got {tuple(features.shape)}")
        x = nn.functional.gelu(self.conv1(features))  # [B, C, 2M]
        x = nn.functional.gelu(self.conv2(x)).transpose(1, 2)  # [B, M, C]
        x = self.drop(x + self.embed_positions.to(x.dtype))
        for block in self.blocks:
            x = block(x)
        return self.layer_norm(x)  # [B, M, C]

    def extra_repr(self) -> str:
        return (f"num_mel_bins={self.num_mel_bins}, dim={self.dim}, num_heads={self.num_heads}, depth={self.depth}, "
                f"max_source_positions={self.max_source_positions}")


def _read(hf: HFConfig) -> HFConfig:
    """``hf`` with ``WhisperConfig``'s defaults; the options attnzoo cannot reproduce refused."""
    hf = hf.with_defaults(DEFAULTS)
    hf.activation("activation_function", shared.ACTIVATIONS)
    C = hf.req("d_model")
    for key in ("encoder_attention_heads", "decoder_attention_heads"):
        if C % hf.req(key):
            raise hf.unsupported(f"{key}={hf.raw(key)!r} that does not divide d_model={C}")
    if C % 2 or C < 4:
        raise hf.unsupported(f"d_model={C} (the sinusoidal position table needs an even width >= 4)")
    return hf


def build_whisper(hf: HFConfig, *, head: bool = True, tied: bool = True, device: Any = None,
                  dtype: Any = None) -> EncoderDecoder:
    """The model of a Whisper config (random weights; see the module docstring): a
    :class:`WhisperAudioEncoder` and a :class:`~attnzoo.DecoderLM` with cross-attention; ``head``:
    the ``proj_out`` LM head (``tied`` to the token embedding, or its own), else none (``WhisperModel``:
    the decoder's hidden states)."""
    hf = _read(hf)
    act = hf.activation("activation_function", shared.ACTIVATIONS)
    V, C = hf.req("vocab_size"), hf.req("d_model")
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    drops = {"dropout": hf.get("dropout", 0.0, float), "attention_dropout": hf.get("attention_dropout", 0.0, float),
             "activation_dropout": hf.get("activation_dropout", 0.0, float)}
    encoder = WhisperAudioEncoder(hf.req("num_mel_bins"), C, hf.req("encoder_attention_heads"), hf.req("encoder_layers"),
                                  hf.req("encoder_ffn_dim"), hf.req("max_source_positions"), activation=act, **drops,
                                  **kw)
    H, depth = hf.req("decoder_attention_heads"), hf.req("decoder_layers")
    layers = _layers(C, H, hf.req("decoder_ffn_dim"), act, decoder=True, **drops, **kw)
    cfg = DecoderConfig(V, C, depth, H, pos="learned", norm="layer", norm_eps=EPS, bias=True,
                        max_seq_len=hf.req("max_target_positions"), dropout=drops["dropout"],
                        tie_embeddings=head and tied)
    lm_head = (LMHead(C, V, **kw) if head else nn.Identity())
    decoder = DecoderLM(config=cfg, parts=DecoderParts(blocks=[TransformerBlock(C, layers=layers) for _ in range(depth)],
                                                       head=lm_head), **kw)
    return EncoderDecoder(encoder, decoder, decoder_start_token_id=shared.config_token(hf.raw("decoder_start_token_id"), V),
                          eos_token_id=shared.config_token(hf.raw("eos_token_id"), V))


def _refuse_heads(hf: HFConfig, sd: dict[str, Tensor]) -> str:
    """The base model's prefix (``"model."`` under ``proj_out``, ``""`` for ``WhisperModel``); the
    classes that are not an encoder-decoder refused by name."""
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    if not any(k.startswith(f"{prefix}decoder.") for k in sd):
        raise hf.unsupported("WhisperForAudioClassification (an audio classifier: the encoder without a decoder, "
                             "with projector/classifier heads)")
    if not any(k.startswith(f"{prefix}encoder.") for k in sd):
        raise hf.unsupported("WhisperForCausalLM (the decoder alone, without its audio encoder): convert the "
                             "WhisperForConditionalGeneration it comes from")
    return prefix


def convert_whisper(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> EncoderDecoder:
    """Build the model (``WhisperForConditionalGeneration``: with the ``proj_out`` head; ``WhisperModel``:
    none) and copy every weight with a :class:`~attnzoo.models.hf._state.Plan` (so
    :func:`~attnzoo.interop.to_hf` writes it back)."""
    prefix = _refuse_heads(hf, sd)
    head = bool(prefix)
    tied = hf.get("tie_word_embeddings", True, bool)
    model = build_whisper(hf, head=head, tied=tied, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(Source(sd, prefix), hf.arch)
    ignore: list[str] = []
    enc, dec = "encoder.", "decoder."
    plan.put_pairs(enc, enc, [("conv1", "conv1"), ("conv2", "conv2"), ("layer_norm", "layer_norm")])
    if plan.src.has(f"{enc}embed_positions.weight"):
        plan.put(f"{enc}embed_positions", f"{enc}embed_positions.weight")
    else:  # a file without the frozen table: transformers' initial sinusoids
        table = shared.split_sinusoids(*model.encoder.embed_positions.shape)
        plan.put_tensor(f"{enc}embed_positions", table, "split_sinusoids (not in the checkpoint)")
    for i in range(len(model.encoder.blocks)):
        shared.put_layer(plan, f"{enc}blocks.{i}.", f"{enc}layers.{i}.", cross=False, key_bias=False)
    plan.put(f"{dec}tok_emb.weight", f"{dec}embed_tokens.weight")
    plan.put(f"{dec}pos_emb.weight", f"{dec}embed_positions.weight")
    for i in range(model.decoder.depth):
        shared.put_layer(plan, f"{dec}blocks.{i}.", f"{dec}layers.{i}.", cross=True, key_bias=False)
    plan.put_pairs(dec, dec, [("norm", "layer_norm")])
    if head:
        if tied:
            ignore.append(r"proj_out\.weight")
        else:
            plan.src.prefix = ""
            plan.put(f"{dec}lm_head.weight", "proj_out.weight")
    plan.apply(model, ignore=ignore)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"whisper": parts.Dispatch("Whisper", convert_whisper, ("WhisperForConditionalGeneration", "WhisperModel"))}
