"""Beam search on every converted decoder ``model_type``: ``generate(num_beams=3)``, whose caches
are reordered to the surviving beams at every step (``reorder``: KV, sliding-window, latent,
recurrent, convolution, indexer, per-layer-embedding and counter caches), equals a beam search
whose every step runs the whole forward (nothing to reorder). Beside it, every registered
attention variant in a two-layer stack with softmax attention."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_export as export  # noqa: E402

import attnzoo as az  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.beam_search import beam_search  # noqa: E402
from attnzoo.variants import VARIANTS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW, K = 6, 3
#: model types whose cached decode differs from their full forward by design: dots.3-note's tiny
#: indexer meets score ties where transformers' own cached decode differs from its full forward,
#: and attnzoo follows each (tests/models/test_hf_dots3.py)
UNCACHED_DIFFERS = {"dots3_note": "indexer ties: cached decode follows transformers' cached decode"}


def _equal_to_uncached(model: az.DecoderLM, x: torch.Tensor) -> None:
    with torch.no_grad():
        eos = int(model.generate(x, 3)[0, -1])  # a token the model writes: some beams end early
        want = beam_search(lambda t: model(t)[:, -1], x, num_beams=K, max_new_tokens=NEW, eos_token_id=eos,
                           num_return_sequences=K).tokens
    got = model.generate(x, NEW, num_beams=K, eos_token_id=eos, num_return_sequences=K)
    assert torch.equal(got, want), (got, want)


def _decoder_types() -> list[str]:
    """The swept model types but the encoders, vision towers and encoder-decoders."""
    others = {"bert", "vit", *export.encoders.sweep(), *export.vision.sweep(), *export.seq2seq.sweep()}
    return sorted(set(export.MAKERS) - others - set(UNCACHED_DIFFERS))


@pytest.mark.parametrize("kind", _decoder_types())
def test_cached_beam_search_equals_uncached(kind: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dropped vision tower or MTP layer, with a warning
        model: Any = from_hf(export.MAKERS[kind](0)).eval()
    if not isinstance(model, az.DecoderLM) or model.lm_head is None or isinstance(model.lm_head, torch.nn.Identity):
        pytest.skip(f"{kind} converts to {type(model).__name__} without an LM head: nothing to search")
    _equal_to_uncached(model, torch.randint(3, 60, (2, 5), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_beam_search_equals_uncached_for_every_variant(variant: str) -> None:
    torch.manual_seed(0)
    model = az.DecoderLM(vocab_size=50, dim=32, depth=2, num_heads=4, max_seq_len=64,
                         attention=[variant, "mha"]).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distributions far from flat, so that the beams differ
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    _equal_to_uncached(model, torch.randint(0, 50, (2, 5), generator=g))
