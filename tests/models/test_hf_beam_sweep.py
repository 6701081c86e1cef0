"""Beam search on every converted decoder ``model_type``: ``generate(num_beams=3)``, whose caches
are reordered to the surviving beams at every step (``reorder``: KV, sliding-window, latent,
recurrent, convolution, indexer, per-layer-embedding and counter caches), equals a beam search
whose every step runs the whole forward (nothing to reorder). Beside it, every registered
attention variant in a two-layer stack with softmax attention; and on 39 families, a left-padded
batch's beams and returns equal transformers' own beam search."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_export as export  # noqa: E402

import attnzoo as az  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.beam_search import beam_search, decoder_beam_search  # noqa: E402
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


@pytest.mark.parametrize("kind", export.decoder_types(UNCACHED_DIFFERS))
def test_cached_beam_search_equals_uncached(kind: str) -> None:
    model = export.language_model(kind)
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


#: families whose left-padded beam search is compared with transformers' (softmax, sliding, softcapped,
#: latent, MoE, Mamba, gated DeltaNet, KDA, short-convolution and shared-block stacks); left out:
#: MiniMax (transformers' cached beam search scores the same hypotheses otherwise than its uncached
#: one: :func:`test_minimax_beam_search_equals_transformers_uncached`) and RecurrentGemma
#: (transformers does not mask the padding; tests/models/test_hf_recurrent_gemma.py)
AGAINST_TRANSFORMERS = (
    "bamba", "bloom", "codegen", "cohere2", "deepseek_v2", "deepseek_v3", "exaone4", "falcon", "falcon_h1",
    "gemma", "gemma2", "gemma3_text", "gemma3n_text", "glm4_moe", "gpt_neox", "gpt_oss", "gptj", "granitemoehybrid",
    "jamba", "kimi_linear", "lfm2", "llama", "llama4_text", "mamba2", "mistral", "mixtral", "mpt", "nemotron_h",
    "olmo2", "olmoe", "opt", "phi3", "qwen2", "qwen3_5_text", "qwen3_moe", "qwen3_next", "smollm3", "starcoder2",
    "zamba2")


@pytest.mark.parametrize("kind", AGAINST_TRANSFORMERS)
def test_left_padded_beam_search_equals_transformers(kind: str) -> None:
    from hf_family_checks import padded

    hf = export.MAKERS[kind](0).eval()
    ours = from_hf(hf).eval()
    x, mask = padded(9, pad=3)
    with torch.no_grad():
        want = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
                           num_beams=K, num_return_sequences=2, do_sample=False, no_repeat_ngram_size=0, min_length=0,
                           repetition_penalty=1.0)
    got = ours.generate(x, NEW, attention_mask=mask.bool(), num_beams=K, num_return_sequences=2)
    assert torch.equal(got, want), (got, want)


def test_minimax_beam_search_equals_transformers_uncached() -> None:
    """transformers' cached MiniMax beam search gives the same hypotheses other scores (so other
    returns) than its own beam search re-running the whole forward each step; attnzoo's cached beam
    search equals the latter, to the scores."""
    from hf_family_checks import padded

    hf = export.MAKERS["minimax"](0).eval()
    ours = from_hf(hf).eval()
    x, mask = padded(9, pad=3)
    rows = mask.repeat_interleave(K, 0)

    def step(t: torch.Tensor) -> torch.Tensor:  # transformers' full forward, no cache
        real = torch.cat([rows, rows.new_ones(t.shape[0], t.shape[1] - rows.shape[1])], dim=1)
        return hf(input_ids=t, attention_mask=real, use_cache=False).logits[:, -1]

    with torch.no_grad():
        want = beam_search(step, x, num_beams=K, max_new_tokens=NEW, eos_token_id=None, num_return_sequences=K)
        got = decoder_beam_search(ours, x, num_beams=K, max_new_tokens=NEW, eos_token_id=None,
                                  num_return_sequences=K, attention_mask=mask.bool())
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-5)
