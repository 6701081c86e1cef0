"""Apertus 1.5 text (``apertus1p5_text``) -> :class:`~attnzoo.DecoderLM`: ``Apertus1p5TextForCausalLM``
and ``Apertus1p5TextModel``, the language model of the multimodal ``Apertus1p5ForConditionalGeneration``
(whose EMU3.5 vision tokenizer, a Chameleon VQGAN encoder, and WavTokenizer audio tokenizer only turn
pixels and waveforms into token ids of the shared vocabulary: out of scope here). Line numbers:
transformers 5.25's ``models/apertus1p5/modeling_apertus1p5.py``.

The decoder is Apertus' (``modular_apertus1p5.py`` 584-600: ``ApertusModel`` / ``ApertusForCausalLM``
unchanged; :func:`attnzoo.models.families.dense.build_apertus`): per-head QK RMSNorm before RoPE
(512-513), the norms ``attention_layernorm`` / ``feedforward_layernorm`` (549-550), an ungated MLP
``down(xielu(up(x)))`` (361-374), LLaMA-3-scaled RoPE of theta 1.2e7 by default, no biases unless
``attention_bias``. What 1.5 adds is the vocabulary: ``vocab_size`` (default 266752,
``configuration_apertus1p5.py`` 133) covers the text, visual and audio codes for the input embedding,
while the LM head may be pruned to the text prefix, ``output_vocab_size`` rows (737): the logits are ``[B, N, output_vocab_size]``, the ids the head
can emit are ``0 .. output_vocab_size - 1``, the same token ids (:class:`PrunedLMHead`). With
``tie_word_embeddings`` transformers ties ``lm_head.weight`` to the whole embedding (``_tied_weights_keys``, 726)
whatever ``output_vocab_size`` says, so the logits then cover the whole vocabulary: so here too.

Refused by name: what Apertus refuses (a ``hidden_act`` other than xIELU or the ungated activations
of :data:`attnzoo.models.families.dense.UNGATED`, ``pretraining_tp != 1``, unknown rope types), and an
``output_vocab_size`` outside ``[1, vocab_size]`` (transformers' ``validate_output_vocab_size``, 172-177).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.dense as dense
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.glm5_next import text_key
from attnzoo.models.hf._state import HFConfig

__all__ = ["DEFAULTS", "DISPATCH", "TOKENIZERS", "PrunedLMHead", "build_apertus1p5", "canonical", "convert_apertus1p5",
           "output_rows"]

#: ``Apertus1p5TextConfig``'s defaults that differ from Apertus' (``configuration_apertus1p5.py`` 133, 147)
DEFAULTS: dict[str, Any] = {"vocab_size": 266752, "tie_word_embeddings": False}
#: the multimodal checkpoint's tokenizers (``_keys_to_ignore_on_load_unexpected``, modeling 600)
TOKENIZERS = ("model.vision_tokenizer.", "model.audio_tokenizer.")


class PrunedLMHead(nn.Module):
    """The LM head pruned to the first ``rows`` ids of the vocabulary (Apertus 1.5's
    ``output_vocab_size``): ``logits = x W^T`` with ``weight [rows, C]``. Not an ``nn.Linear`` on
    purpose: :meth:`~attnzoo.DecoderLM.generate` samples from it (ids ``< rows`` are token ids of the
    ``V``-row embedding), where a linear head narrower than the vocabulary reads as a classifier.

    Shapes: ``[B, N, C] -> [B, N, rows]``."""

    def __init__(self, dim: int, rows: int, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.dim, self.rows = int(dim), int(rows)
        self.weight = nn.Parameter(torch.empty(self.rows, self.dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=self.dim ** -0.5)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)  # [B, N, rows]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rows={self.rows}"


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` with :data:`DEFAULTS`, read as an Apertus config (``model_type`` ``apertus``, whose
    defaults :func:`~attnzoo.models.families.dense.canonical` adds)."""
    data = {**hf.with_defaults(DEFAULTS).data, "model_type": "apertus"}
    return dense.canonical(HFConfig(data, hf.source, hf.arch))[0]


def output_rows(hf: HFConfig) -> int | None:
    """The LM head's rows when pruned (``output_vocab_size < vocab_size``, untied), else ``None``."""
    V, rows = hf.req("vocab_size"), hf.raw("output_vocab_size")
    if rows is None:
        return None
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= V:
        raise hf.unsupported(f"output_vocab_size={rows!r} (supported: an int in [1, vocab_size={V}])")
    return None if rows == V or hf.get("tie_word_embeddings", False, bool) else rows


def build_apertus1p5(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """The decoder of an ``Apertus1p5TextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    rows = output_rows(hf)
    model = dense.build_apertus(hf, head_size=head_size, device=device, dtype=dtype)
    if rows is not None and head_size is None:
        model.lm_head = PrunedLMHead(hf.req("hidden_size"), rows, device=device, dtype=dtype)
    return model


def convert_apertus1p5(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (Apertus' weight map; the head follows them). The
    multimodal checkpoint's names load too (``model.language_model.X`` as ``model.X``, its tokenizers'
    weights dropped), as transformers' ``PrefixChange`` for ``apertus1p5_text`` reads them."""
    hf = canonical(hf)
    sd = {text_key(k): v for k, v in sd.items() if not k.startswith(TOKENIZERS)}
    family = dense.FAMILIES["apertus"]
    model, plan, head_size = parts.start(hf, sd, build_apertus1p5, device=device, dtype=dtype)
    for i in range(model.depth):
        dense.put_layer(hf, family, plan, i)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"apertus1p5_text": parts.Dispatch("Apertus 1.5", convert_apertus1p5,
                                              ("Apertus1p5TextForCausalLM", "Apertus1p5TextModel"))}
