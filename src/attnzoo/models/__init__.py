"""Models built from :class:`attnzoo.TransformerBlock`: encoder, decoder LM, encoder-decoder, ViT.

Hugging Face checkpoints convert with :func:`attnzoo.interop.from_hf`; a BERT-style folder
(``config.json`` + ``model.safetensors``) loads with :meth:`TransformerEncoder.from_pretrained`.
"""

from attnzoo.models._common import LayerCaches
from attnzoo.models.decoder import DecoderLM, sample_next_token
from attnzoo.models.encoder import TransformerEncoder, cls_pool, max_pool, mean_pool
from attnzoo.models.seq2seq import Transformer
from attnzoo.models.vit import VisionTransformer

__all__ = [
    "DecoderLM",
    "LayerCaches",
    "Transformer",
    "TransformerEncoder",
    "VisionTransformer",
    "cls_pool",
    "max_pool",
    "mean_pool",
    "sample_next_token",
]
