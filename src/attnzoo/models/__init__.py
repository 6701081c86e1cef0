"""Models built from :class:`attnzoo.TransformerBlock`: encoder, decoder LM, encoder-decoder, ViT.

Each model is described by a frozen config with named presets (:mod:`attnzoo.models.config`);
what differs between families is passed as parts (:mod:`attnzoo.models.parts`).
Hugging Face checkpoints convert with :func:`attnzoo.interop.from_hf` (the room
:mod:`attnzoo.models.hf`); a folder (``config.json`` + safetensors) loads with
:func:`attnzoo.interop.load_pretrained`.
"""

from attnzoo.models._common import LayerCaches
from attnzoo.models.config import (
    PRESETS,
    DecoderConfig,
    EncoderConfig,
    Rope,
    Seq2SeqConfig,
    ViTConfig,
)
from attnzoo.models.decoder import DecoderLM, sample_next_token
from attnzoo.models.encoder import TransformerEncoder, cls_pool, max_pool, mean_pool
from attnzoo.models.legacy import decoder_from_dict
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.mtp import MTPLayer, MultiTokenPredictor
from attnzoo.models.parts import DecoderParts, EncoderParts, LMHead, ScaledEmbedding, ViTParts
from attnzoo.models.seq2seq import EncoderDecoder, Transformer
from attnzoo.models.vit import VisionTransformer

__all__ = [
    "PRESETS",
    "DecoderConfig",
    "DecoderLM",
    "DecoderParts",
    "EncoderConfig",
    "EncoderDecoder",
    "EncoderParts",
    "LMHead",
    "LayerCaches",
    "LayerLoopLM",
    "MTPLayer",
    "MultiTokenPredictor",
    "Rope",
    "ScaledEmbedding",
    "Seq2SeqConfig",
    "Transformer",
    "TransformerEncoder",
    "ViTConfig",
    "ViTParts",
    "VisionTransformer",
    "cls_pool",
    "decoder_from_dict",
    "max_pool",
    "mean_pool",
    "sample_next_token",
]
