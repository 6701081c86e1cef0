"""Speculative decoding (``generate(assistant_model=...)`` / ``generate(prompt_lookup_num_tokens=...)``)
gives the tokens greedy decoding gives: on every converted decoder ``model_type`` and every
registered variant, with an assistant that agrees only in part (so drafts are accepted and
rejected: caches truncated or rolled back), with prompt lookup, with left padding and every
generation rule; and transformers' own prompt lookup decoding writes the same tokens. Beside it,
a family's state cache that now rolls back (the cache pieces: tests/nn/test_cache_truncate.py)."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_export as export  # noqa: E402
import test_mtp  # noqa: E402

import attnzoo as az  # noqa: E402
import hf_seq2seq_checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models import speculative  # noqa: E402
from attnzoo.models._common import LayerCaches  # noqa: E402
from attnzoo.models.parts import DecoderParts  # noqa: E402
from attnzoo.nn.cache import unmarked  # noqa: E402
from attnzoo.variants import VARIANTS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 10
#: dots.3-note's tiny indexer meets score ties where transformers' own cached decode differs from its
#: full forward (tests/models/test_hf_dots3.py); a chunk of drafts meets them as a full forward does
UNCACHED_DIFFERS = {"dots3_note"}


def _perturbed(model: torch.nn.Module, scale: float, seed: int) -> Any:
    """A copy of ``model`` with every weight moved by ``scale`` times its own spread: an assistant
    that agrees with the model on some tokens and not on others."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * (p.std() + 1e-3))
    return other


def _prompt(vocab: int, batch: int = 2) -> torch.Tensor:
    """Rows that repeat themselves, so that prompt lookup finds drafts."""
    x = torch.randint(3, min(vocab, 60), (batch, 4), generator=torch.Generator().manual_seed(1))
    return x.repeat(1, 2)


def _same_as_greedy(model: Any, x: torch.Tensor, lookup: bool = True, **kw: Any) -> None:
    with torch.no_grad():
        want = model.generate(x, NEW, **kw)
        specs: list[dict[str, Any]] = [{"assistant_model": _perturbed(model, 0.5, 3), "num_assistant_tokens": 4,
                                        "assistant_confidence_threshold": 0.0}]
        for spec in specs + ([{"prompt_lookup_num_tokens": 3}] if lookup else []):
            got = model.generate(x, NEW, **kw, **spec)
            assert torch.equal(got, want), (sorted(spec), got, want)


@pytest.mark.parametrize("kind", export.decoder_types(UNCACHED_DIFFERS))
def test_speculative_decoding_equals_greedy_on_every_decoder_type(kind: str) -> None:
    model = export.language_model(kind)
    assert unmarked(model.init_cache(2, 8)) == []  # every cache can take back a rejected draft
    _same_as_greedy(model, _prompt(model.vocab_size), lookup=False)  # the variants below take prompt lookup too


def _noisy(attention: Any, vocab: int = 50, seed: int = 0) -> az.DecoderLM:
    torch.manual_seed(seed)
    model = az.DecoderLM(vocab_size=vocab, dim=32, depth=2, num_heads=4, max_seq_len=64, attention=attention).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distributions far from flat
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_speculative_decoding_equals_greedy_for_every_variant(variant: str) -> None:
    model = _noisy([variant, "mha"])
    x = _prompt(50)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, :2] = False
    _same_as_greedy(model, x, **({} if variant == "nsa" else {"attention_mask": mask}))  # nsa: causal only


@pytest.mark.parametrize("attention", [["mha", "mha"], ["gated_deltanet", "mha"], ["sliding", "mha"],
                                       ["mamba2", "sliding"]], ids=str)
def test_drafts_are_accepted_and_rejected(attention: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality above is not vacuous: rounds keep several tokens (drafts accepted) and fewer
    than ``k + 1`` (drafts rejected), on caches that truncate (keys), roll back (a recurrent
    state) and restore slots (a ring)."""
    model = _noisy(attention, seed=2)
    x, new, k = _prompt(50, batch=1), 24, 3
    kept: list[int] = []
    close = speculative._Cached.close

    def spy(self: Any, keep: int) -> None:
        if self.model is model:
            kept.append(keep)
        close(self, keep)

    monkeypatch.setattr(speculative._Cached, "close", spy)
    with torch.no_grad():
        want = model.generate(x, new)
        got = model.generate(x, new, assistant_model=_perturbed(model, 0.3, 5), num_assistant_tokens=k,
                             assistant_confidence_threshold=0.0)
    assert torch.equal(got, want)
    rounds = [b - a for a, b in zip([x.shape[1], *kept], kept, strict=False)][:-1]  # tokens each round wrote, but the last
    assert max(rounds) > 1 and min(rounds) < k + 1, rounds


def test_every_rule_and_left_padding_with_both_drafters() -> None:
    model = _noisy("mha", seed=4)
    x = _prompt(50, batch=3)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, :3] = False
    mask[2, :1] = False
    rows = model.generate(x, 12, attention_mask=mask)
    settings = {"attention_mask": mask, "eos_token_id": [int(rows[1, -3]), 49], "pad_token_id": 0,
                "repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "suppress_tokens": [7],
                "min_new_tokens": 2, "bad_words_ids": [[int(x[0, 4]), int(x[0, 5])]]}
    with torch.no_grad():
        want = model.generate(x, 12, **settings)
        assert (want[:, -1] == 0).any()  # a row ended and holds the pad
        for spec in ({"assistant_model": _perturbed(model, 0.3, 1), "num_assistant_tokens": 5},
                     {"assistant_model": model, "assistant_confidence_threshold": 0.0},
                     {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3}):
            assert torch.equal(model.generate(x, 12, **settings, **spec), want), sorted(spec)


# --------------------------------------------------------------------------- sampling
V_SMALL, NEW_SAMPLED = 4, 3
SAMPLING = {"temperature": 1.3, "top_k": 3}


def _joint(model: az.DecoderLM, prompt: torch.Tensor) -> torch.Tensor:
    """The exact distribution ``[V ** 3]`` of the 3 tokens sampling writes after ``prompt [1, N]``
    (every continuation enumerated; temperature and top-k written out here, not the library's)."""
    def step(seq: torch.Tensor) -> torch.Tensor:  # [R, L] -> [R, V]
        logits = model(seq)[:, -1].double() / SAMPLING["temperature"]
        kth = logits.topk(SAMPLING["top_k"], dim=-1).values[:, -1:]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

    seqs = prompt.clone()
    probs = torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(NEW_SAMPLED):
            p = step(seqs)  # [R, V]
            probs = (probs[:, None] * p).flatten()
            seqs = torch.cat([seqs.repeat_interleave(V_SMALL, 0), torch.arange(V_SMALL).repeat(seqs.shape[0])[:, None]],
                             1)
    return probs


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit of ``counts`` to ``probs``: its p-value (0 when a cell of
    probability 0 was drawn)."""
    live = probs > 0
    if counts[~live].sum() > 0:
        return 0.0
    expected = probs[live] * counts.sum()
    chi2 = ((counts[live] - expected) ** 2 / expected).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), chi2 / 2.0))


@pytest.mark.parametrize("drafter", ["assistant", "lookup", "mtp"])
def test_speculative_sampling_draws_what_sampling_draws(drafter: str) -> None:
    """Speculative sampling is exact in distribution: 2,000 draws of 3 tokens (two rows a call, so
    that rounds accept several drafts, reject some and add the model's own token) fit the exact
    distribution of the model's sampling, and not the assistant's (which differs). ``mtp``: two
    random multi-token-prediction depths draft (tests/models/test_mtp.py)."""
    model, other = _noisy("mha", vocab=V_SMALL, seed=6), _noisy("mha", vocab=V_SMALL, seed=7)
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    want, theirs = _joint(model, prompt), _joint(other, prompt)
    assert 0.5 * (want - theirs).abs().sum() > 0.2  # a draft-biased result would show
    spec: dict[str, Any] = ({"assistant_model": other, "num_assistant_tokens": 2, "assistant_confidence_threshold": 0.0}
                            if drafter == "assistant" else {"prompt_lookup_num_tokens": 2})
    if drafter == "mtp":
        model, spec = test_mtp.with_mtp(model, 2, seed=8), {"use_mtp": True}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = torch.cat([model.generate(prompt.repeat(2, 1), NEW_SAMPLED, generator=g, **SAMPLING, **spec)[:, -3:]
                         for _ in range(1000)])
    cells = (out * torch.tensor([V_SMALL ** 2, V_SMALL, 1])).sum(1)
    counts = torch.bincount(cells, minlength=V_SMALL ** 3).double()
    assert _chi2_pvalue(counts, want) > 1e-3
    assert _chi2_pvalue(counts, theirs) < 1e-6


def test_speculative_sampling_returns_and_seeds() -> None:
    model, assistant = _noisy("mha", seed=8), _noisy("mha", seed=9)
    x = _prompt(50)
    kw = {"temperature": 0.9, "top_p": 0.9, "num_return_sequences": 3, "assistant_model": assistant}
    with torch.no_grad():
        a = model.generate(x, 6, generator=torch.Generator().manual_seed(3), **kw)
        b = model.generate(x, 6, generator=torch.Generator().manual_seed(3), **kw)
    assert a.shape == (6, x.shape[1] + 6) and torch.equal(a, b)
    assert torch.equal(a[::3, :x.shape[1]], x)  # rows b * R + r
    src, mask = hf_seq2seq_checks.token_source()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bart = from_hf(hf_seq2seq_checks.tiny_bart()).eval()
    with torch.no_grad():
        out = bart.generate(src, 5, src_mask=mask.bool(), temperature=0.8, num_return_sequences=2,
                            assistant_model=_perturbed(bart, 0.2, 1), generator=torch.Generator().manual_seed(0))
    assert out.shape[0] == 6


def test_cross_attention_model_with_prompt_lookup() -> None:
    torch.manual_seed(0)
    cfg = az.blocks.BlockConfig(32, 4, causal=True, cross_attention=True, context_dim=16)
    model = az.DecoderLM(vocab_size=50, dim=32, depth=2, num_heads=4, max_seq_len=64,
                         parts=DecoderParts(blocks=[az.TransformerBlock(config=cfg) for _ in range(2)])).eval()
    x, context = _prompt(50), torch.randn(2, 5, 16)
    cmask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with torch.no_grad():
        want = model.generate(x, NEW, context=context, context_mask=cmask)
        got = model.generate(x, NEW, context=context, context_mask=cmask, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["bart", "marian", "mbart", "t5_seq2seq", "whisper"])
def test_encoder_decoder_speculative_decoding_equals_greedy(kind: str) -> None:
    """``EncoderDecoder.generate``: prompt lookup, an encoder-decoder assistant that encodes the
    source itself (distil-whisper's way) and a decoder assistant that reads the model's encoding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = hf_seq2seq_checks.sweep()[kind](0)
    model = from_hf(hf).eval()
    if getattr(hf, "main_input_name", "input_ids") == "input_features":  # audio: log-mel features
        src = torch.randn(2, hf.config.num_mel_bins, 2 * hf.config.max_source_positions,
                          generator=torch.Generator().manual_seed(0))
        mask = None
    else:
        src, mask = hf_seq2seq_checks.token_source()
        mask = mask.bool()
    with torch.no_grad():
        want = model.generate(src, NEW, src_mask=mask)
        for spec in ({"prompt_lookup_num_tokens": 3},
                     {"assistant_model": _perturbed(model, 0.5, 3), "num_assistant_tokens": 4},
                     {"assistant_model": _perturbed(model.decoder, 0.3, 4), "assistant_confidence_threshold": 0.0}):
            assert torch.equal(model.generate(src, NEW, src_mask=mask, **spec), want), sorted(spec)


def test_prompt_lookup_equals_transformers() -> None:
    """transformers' prompt lookup decoding on a Llama with the same weights writes the same tokens."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ours = from_hf(hf).eval()
    x = _prompt(64, batch=1)
    with torch.no_grad():
        want = hf.generate(x, max_new_tokens=12, min_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3,
                           pad_token_id=0)
        got = ours.generate(x, 12, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)


def test_hybrid_speculative_decoding_equals_transformers_greedy() -> None:
    """On a Qwen3-Next (gated DeltaNet + gated attention) the drafts' DeltaNet states are rolled
    back, so assisted and prompt-lookup decoding write transformers' greedy tokens (transformers
    5.25's own assisted generation and prompt lookup do not, on this model: they keep the states
    of rejected drafts)."""
    cfg = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=0, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ours = from_hf(hf).eval()
    x = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf.generate(x, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
        for spec in ({"assistant_model": _perturbed(ours, 0.3, 2), "num_assistant_tokens": 4},
                     {"prompt_lookup_num_tokens": 3}):
            assert torch.equal(ours.generate(x, 24, **spec), want), sorted(spec)


# --------------------------------------------------------------------------- a family state cache
def test_a_family_state_cache_rolls_back() -> None:
    """Qwen3-Next's linear-state cache now takes part in a model call's transaction: a call that
    raises after its layers ran leaves it as it was."""
    model = export.language_model("qwen3_next")
    cache = model.init_cache(1, 16)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]), cache=cache)
        states = [(c.conv.clone(), c.state.clone()) for c in cache if hasattr(c, "state")]
        assert states
        handle = model.lm_head.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("late")))
        with pytest.raises(RuntimeError, match="late"):
            model(torch.tensor([[6, 7]]), cache=cache)
        handle.remove()
    assert cache.length == 3
    after = [(c.conv, c.state) for c in cache if hasattr(c, "state")]
    assert all(torch.equal(a, b) for s, t in zip(states, after, strict=True) for a, b in zip(s, t, strict=True))


# --------------------------------------------------------------------------- bad input
BAD = [
    ({"prompt_lookup_num_tokens": 3, "assistant_model": "A"}, ValueError, "give one of them"),
    ({"prompt_lookup_num_tokens": 0}, ValueError, "prompt_lookup_num_tokens"),
    ({"prompt_lookup_num_tokens": 2.5}, TypeError, "prompt_lookup_num_tokens"),
    ({"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 0}, ValueError, "max_matching_ngram_size"),
    ({"assistant_model": "A", "num_assistant_tokens": 0}, ValueError, "num_assistant_tokens"),
    ({"assistant_model": "A", "assistant_confidence_threshold": 1.0}, ValueError, "assistant_confidence_threshold"),
    ({"assistant_model": "A", "assistant_confidence_threshold": "high"}, TypeError, "assistant_confidence_threshold"),
    ({"assistant_model": torch.nn.Linear(2, 2)}, TypeError, "assistant_model must be a DecoderLM"),
    ({"assistant_model": "other vocabulary"}, ValueError, "share the model's vocabulary"),
    ({"assistant_model": "short"}, ValueError, r"assistant_model\).*max_seq_len"),
    ({"prompt_lookup_num_tokens": 3, "num_beams": 2}, ValueError, "not beam search"),
]


@pytest.mark.parametrize(("kw", "error", "match"), BAD, ids=[m for _, _, m in BAD])
def test_bad_speculative_settings(kw: dict[str, Any], error: type, match: str) -> None:
    model = _noisy("mha")
    assistants = {"A": model, "other vocabulary": _noisy("mha", vocab=51),
                  "short": az.DecoderLM(vocab_size=50, dim=32, depth=1, num_heads=4, max_seq_len=10)}
    kw = {k: assistants.get(v, v) if k == "assistant_model" and isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(error, match=match):
        model.generate(_prompt(50), 8, **kw)


def test_a_cache_that_cannot_take_back_drafts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Foreign:  # a third-party layer's cache: no mark / rollback, not written by position
        length, batch_size = 0, 2

        def reset(self) -> None: ...

    model = _noisy("mha")
    monkeypatch.setattr(model, "init_cache", lambda *_: LayerCaches([Foreign()]))
    with pytest.raises(TypeError, match=r"neither be truncated nor rolled back: \['Foreign'\]"):
        model.generate(_prompt(50), 4, prompt_lookup_num_tokens=2)


def test_a_cross_attention_assistant_is_refused() -> None:
    cfg = az.blocks.BlockConfig(32, 4, causal=True, cross_attention=True, context_dim=16)
    assistant = az.DecoderLM(vocab_size=50, dim=32, depth=1, num_heads=4, max_seq_len=64,
                             parts=DecoderParts(blocks=[az.TransformerBlock(config=cfg)]))
    with pytest.raises(ValueError, match="has cross-attention but the model runs without a context"):
        _noisy("mha").generate(_prompt(50), 4, assistant_model=assistant)


def test_bad_encoder_decoder_speculation() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bart = from_hf(hf_seq2seq_checks.tiny_bart()).eval()
    src, mask = hf_seq2seq_checks.token_source()
    small = _perturbed(bart, 0.1, 1)
    small.encoder.vocab_size = 5  # an assistant whose encoder reads another vocabulary
    with pytest.raises(ValueError, match=r"\(assistant_model\): src"):
        bart.generate(src, 4, src_mask=mask.bool(), assistant_model=small)
    with pytest.raises(ValueError, match="not beam search"):
        bart.generate(src, 4, src_mask=mask.bool(), prompt_lookup_num_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="share the model's vocabulary"):
        bart.generate(src, 4, src_mask=mask.bool(), assistant_model=_noisy("mha"))


def test_rope_frequencies_that_change_during_generation_are_refused() -> None:
    """``longrope`` switches factors at its original length (and ``dynamic`` grows past
    ``max_position_embeddings``): a chunk of drafts would be rotated otherwise than one token at a time."""
    cfg = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  original_max_position_embeddings=16, pad_token_id=0)
    cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16,
                           "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_hf(transformers.Phi3ForCausalLM(cfg)).eval()
    x = _prompt(64, batch=1)
    assert model.generate(x, 4, prompt_lookup_num_tokens=2).shape == (1, 12)  # within the short factors
    with pytest.raises(ValueError, match=re.escape("longrope RoPE frequencies change")):
        model.generate(x, 12, prompt_lookup_num_tokens=2)


def test_a_later_layers_dynamic_rope_is_refused_too() -> None:
    """Gemma 3 keeps a RoPE per layer kind: the full layers' ``dynamic`` one (past
    ``max_position_embeddings``) is found though the model's first rotary is a plain one."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=12, sliding_window=4, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10.0}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_hf(transformers.Gemma3ForCausalLM(cfg)).eval()
        x = _prompt(64, batch=1)
        assert model.generate(x, 3, prompt_lookup_num_tokens=2).shape == (1, 11)  # within the positions
        with pytest.raises(ValueError, match=re.escape("dynamic RoPE frequencies change")):
            model.generate(x, 12, prompt_lookup_num_tokens=2, extend_context=True)


def test_encoder_decoder_errors_name_its_generate_and_the_assistants_context() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bart = from_hf(hf_seq2seq_checks.tiny_bart()).eval()
    src, mask = hf_seq2seq_checks.token_source()
    with pytest.raises(ValueError, match=r"^EncoderDecoder\.generate: speculative decoding .* not beam search"):
        bart.generate(src, 4, src_mask=mask.bool(), prompt_lookup_num_tokens=2, num_beams=2)
    with pytest.raises(ValueError) as info:
        bart.generate(src, 4, src_mask=mask.bool(), prompt_lookup_num_tokens=0)
    assert "DecoderLM" not in str(info.value) and "prompt_lookup_num_tokens" in str(info.value)
    cfg = az.blocks.BlockConfig(32, 4, causal=True, cross_attention=True, context_dim=7)
    narrow = az.DecoderLM(vocab_size=bart.decoder.vocab_size, dim=32, depth=1, num_heads=4, max_seq_len=64,
                          parts=DecoderParts(blocks=[az.TransformerBlock(config=cfg)]))
    with pytest.raises(ValueError, match=r"assistant_model reads a context of width \[?7"):
        bart.generate(src, 4, src_mask=mask.bool(), assistant_model=narrow)


@pytest.mark.parametrize("kw", [{"num_assistant_tokens": 0}, {"assistant_confidence_threshold": 2.0},
                                {"prompt_lookup_num_tokens": 2, "num_assistant_tokens": 0}], ids=str)
def test_drafting_settings_are_checked_even_unused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(k for k in kw if k != "prompt_lookup_num_tokens"))):
        _noisy("mha").generate(_prompt(50), 4, **kw)
