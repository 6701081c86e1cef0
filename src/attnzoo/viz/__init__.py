"""See what attention does: capture weights from any model, plot them, draw masks and positions.

* :func:`capture_attention` records the weights of every attention module of a model, by layer
  and head, without changing the model's outputs (:mod:`attnzoo.viz.capture`).
* :func:`plot_attention` draws one head or a grid of heads as heat maps with token labels.
* :func:`parse_mask`, :func:`mask_to_text`, :func:`plot_mask` turn a mask expression such as
  ``"causal & window(4,0)"`` into a picture in the terminal or a PNG (:mod:`attnzoo.viz.maskexpr`).
* :func:`plot_positional` draws the sinusoidal table, the RoPE frequencies and the ALiBi biases.
* :func:`load_model` reads a Hugging Face model folder with a tokenizer (arena checkpoints:
  :func:`attnzoo.arena.load_arena_model`).

Plotting needs matplotlib (``pip install 'attnzoo[plot]'``); it is imported only when a plot is
drawn. Everything else needs torch only.
"""

from __future__ import annotations

from attnzoo.viz.capture import AttentionCapture, capture_attention
from attnzoo.viz.maskexpr import dense_mask, mask_to_text, parse_mask
from attnzoo.viz.models import Tokenize, load_model
from attnzoo.viz.plots import plot_attention, plot_mask, plot_positional

__all__ = [
    "AttentionCapture",
    "Tokenize",
    "capture_attention",
    "dense_mask",
    "load_model",
    "mask_to_text",
    "parse_mask",
    "plot_attention",
    "plot_mask",
    "plot_positional",
]
