"""Generation settings of transformers' ``generate`` that decoder-only models and encoder-decoders
share: several end tokens and the pad of ended rows (``eos_token_id=[...]``, ``pad_token_id``),
``repetition_penalty``, beam search of a decoder-only model (``DecoderLM.generate(num_beams=...)``,
left-padded prompts) and ``num_return_sequences``. Each is token-identical to transformers'
``generate`` on a converted model with the same weights (Llama, Qwen3-Next's hybrid stack with
linear-attention caches, BART), and bad arguments are refused by name. Cached beam search on every
converted model type and variant: ``test_hf_beam_sweep.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attnzoo as az

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 10
#: processors transformers would read from the model's config, switched off unless a test sets them
OFF = {"no_repeat_ngram_size": 0, "min_length": 0, "repetition_penalty": 1.0, "do_sample": False}


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any]:
    transformers = pytest.importorskip("transformers")
    from attnzoo.interop import from_hf
    from hf_family_checks import SMALL, hf_model

    hf = hf_model(transformers.LlamaConfig(num_hidden_layers=2, **SMALL))
    return hf, from_hf(hf).eval()


@pytest.fixture(scope="module")
def qwen3_next() -> tuple[Any, Any]:
    """Qwen3-Next: gated DeltaNet layers (recurrent + convolution caches) and a softmax layer."""
    transformers = pytest.importorskip("transformers")
    from attnzoo.interop import from_hf
    from hf_family_checks import SMALL, hf_model

    cfg = transformers.Qwen3NextConfig(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, decoder_sparse_step=1, **SMALL)
    hf = hf_model(cfg)
    return hf, from_hf(hf).eval()


def _prompts(n: int = 7, pad: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    from hf_family_checks import padded

    return padded(n, pad=pad)


def _ended_tokens(ours: Any, x: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Two tokens the rows' greedy continuations hold at different steps (so rows end apart)."""
    out = ours.generate(x, NEW, attention_mask=mask.bool())[:, x.shape[1]:]
    first, second = int(out[0, 2]), int(out[1, 5])
    return [first, second] if first != second else [first]


# ------------------------------------------------------------------ end tokens, pad, repetition penalty
@pytest.mark.parametrize("pad", [0, 5, None])
def test_several_end_tokens_and_pad_equal_transformers(llama: Any, pad: int | None) -> None:
    hf, ours = llama
    x, mask = _prompts()
    eos = _ended_tokens(ours, x, mask)
    fill = eos[0] if pad is None else pad
    want = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=fill,
                       **OFF)
    got = ours.generate(x, NEW, attention_mask=mask.bool(), eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(got, want), (eos, got, want)
    assert bool(torch.isin(got[:, x.shape[1]:], torch.tensor(eos)).any(1).all()), "a row did not end: a weak test"


def test_bad_words_equal_transformers(llama: Any) -> None:
    """Two-token words the rows would write (their 2nd and 3rd new tokens) and a one-token word, greedy
    and with beams: never completed, as transformers' ``NoBadWordsLogitsProcessor``."""
    hf, ours = llama
    x, mask = _prompts()
    first = ours.generate(x, NEW, attention_mask=mask.bool())[:, x.shape[1]:]
    words = [first[0, 1:3].tolist(), first[1, 1:3].tolist(), [int(first[0, 5])]]
    for beams in (1, 3):
        want = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
                           bad_words_ids=words, num_beams=beams, **OFF)
        got = ours.generate(x, NEW, attention_mask=mask.bool(), bad_words_ids=words, num_beams=beams)
        assert torch.equal(got, want), (beams, got, want)
    assert not torch.equal(ours.generate(x, NEW, attention_mask=mask.bool(), bad_words_ids=words[:2]),
                           ours.generate(x, NEW, attention_mask=mask.bool())), "the words changed nothing"


def test_min_length_counts_the_prompt_as_transformers(llama: Any) -> None:
    hf, ours = llama
    x, mask = _prompts()
    eos = _ended_tokens(ours, x, mask)
    for least in (x.shape[1] + 4, x.shape[1] - 2):  # 4 new tokens; already reached
        want = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0,
                           **{**OFF, "min_length": least})
        got = ours.generate(x, NEW, attention_mask=mask.bool(), eos_token_id=eos, pad_token_id=0, min_length=least)
        assert torch.equal(got, want), (least, got, want)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers(llama: Any, penalty: float) -> None:
    """Left padding is not penalised (transformers' ``prompt_ignore_length``); the prompt is."""
    hf, ours = llama
    x, mask = _prompts()
    want = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
                       **{**OFF, "repetition_penalty": penalty})
    got = ours.generate(x, NEW, attention_mask=mask.bool(), repetition_penalty=penalty)
    assert torch.equal(got, want), (got, want)
    assert not torch.equal(got, ours.generate(x, NEW, attention_mask=mask.bool())), "the penalty changed nothing"


def _greedy_with_hf_penalty(model: az.DecoderLM, x: torch.Tensor, n: int, penalty: float) -> torch.Tensor:
    """Greedy decoding through the same caches, transformers' penalty processor on float32 logits."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    proc = RepetitionPenaltyLogitsProcessor(penalty)
    cache = model.init_cache(x.shape[0], x.shape[1] + n)
    with torch.no_grad():
        logits, out = model(x, cache=cache)[:, -1], x
        for t in range(n):
            tok = proc(out, logits.float()).argmax(-1)
            out = torch.cat([out, tok[:, None]], dim=1)
            if t < n - 1:
                logits = model(tok[:, None], cache=cache)[:, -1]
    return out


@pytest.mark.parametrize("seed", [8, 0, 1])
def test_repetition_penalty_of_a_bfloat16_model_is_taken_in_float32(seed: int) -> None:
    """transformers casts the logits to float32 before its processors: a penalised bfloat16 logit
    rounded in bfloat16 can tie an unpenalised one (seed 8 did, before the cast)."""
    pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = az.DecoderLM(vocab_size=64, dim=32, depth=2, num_heads=4, max_seq_len=64).to(torch.bfloat16).eval()
    x = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(model.generate(x, 12, repetition_penalty=1.3), _greedy_with_hf_penalty(model, x, 12, 1.3))


def test_repetition_penalty_counts_the_row_not_its_padding() -> None:
    """On a table of logits: a token only in the padding keeps its logit; one in the row is penalised."""
    from attnzoo.models.generation import GenerationRules

    rules = GenerationRules(repetition_penalty=2.0)
    scores = torch.tensor([[1.0, -1.0, 4.0, 3.0]])
    tokens = torch.tensor([[3, 0, 1]])
    counted = torch.tensor([[False, True, True]])
    out = rules.apply(scores, 0, tokens, counted)
    assert torch.equal(out, torch.tensor([[0.5, -2.0, 4.0, 3.0]]))


# ------------------------------------------------------------------ decoder-only beam search
BEAMS = [(2, 1.0, False), (3, 0.6, True), (4, 2.0, "never")]


@pytest.mark.parametrize(("num_beams", "length_penalty", "early_stopping"), BEAMS)
def test_decoder_beam_search_equals_transformers(llama: Any, num_beams: int, length_penalty: float,
                                                 early_stopping: bool | str) -> None:
    hf, ours = llama
    x, mask = _prompts()
    eos = _ended_tokens(ours, x, mask)
    kw = {"num_beams": num_beams, "length_penalty": length_penalty, "early_stopping": early_stopping}
    want = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=eos[0],
                       num_return_sequences=2, **OFF, **kw)
    got = ours.generate(x, NEW, attention_mask=mask.bool(), eos_token_id=eos, num_return_sequences=2, **kw)
    assert torch.equal(got, want), (got, want)


def test_decoder_beam_search_with_rules_equals_transformers(llama: Any) -> None:
    hf, ours = llama
    x = _prompts()[0][1:]
    rules = {"repetition_penalty": 1.4, "no_repeat_ngram_size": 2}
    want = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, eos_token_id=None,
                       pad_token_id=0, num_beams=3, **{**OFF, **rules})
    got = ours.generate(x, NEW, num_beams=3, **rules)
    assert torch.equal(got, want), (got, want)


def test_hybrid_stack_beam_search_equals_transformers(qwen3_next: Any) -> None:
    """The gated DeltaNet layer's recurrent and convolution states are reordered with the beams."""
    hf, ours = qwen3_next
    x = _prompts()[0]
    want = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, eos_token_id=None,
                       pad_token_id=0, num_beams=3, num_return_sequences=3, **OFF)
    got = ours.generate(x, NEW, num_beams=3, num_return_sequences=3)
    assert torch.equal(got, want), (got, want)


# ------------------------------------------------------------------ sampling
SAMPLING = [{"temperature": 0.7, "top_k": 20, "top_p": 0.9}, {"temperature": 1.3, "top_p": 0.5, "min_p": 0.05},
            {"temperature": 1.0, "top_k": 5, "num_return_sequences": 3}, {"temperature": 0.9, "min_p": 0.2},
            {"temperature": 1.1, "repetition_penalty": 1.2, "top_k": 30}]


@pytest.mark.parametrize("settings", SAMPLING)
def test_sampling_draws_what_transformers_draws_from_the_same_seed(llama: Any, settings: dict[str, Any]) -> None:
    """Both sample with ``torch.multinomial`` from the global generator after the same warpers
    (temperature, top_k, top_p, min_p), so one seed gives the same tokens."""
    hf, ours = llama
    x, mask = _prompts()
    for seed in range(3):
        torch.manual_seed(seed)
        want = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[5, 9], pad_token_id=0,
                           **{**OFF, "do_sample": True, "top_k": 0, **settings})
        torch.manual_seed(seed)
        got = ours.generate(x, NEW, attention_mask=mask.bool(), eos_token_id=[5, 9], pad_token_id=0, **settings)
        assert torch.equal(got, want), (seed, got, want)


def test_min_p_keeps_the_tokens_near_the_top() -> None:
    """On a table: ``min_p=0.5`` keeps the tokens at least half as likely as the most likely one."""
    from attnzoo.models.generation import sample_next_token

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = {int(sample_next_token(logits, temperature=1.0, min_p=0.5, generator=torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert drawn == {0, 1}


# ------------------------------------------------------------------ num_return_sequences when sampling
def test_sampled_returns_are_the_rows_repeated() -> None:
    torch.manual_seed(0)
    model = az.DecoderLM(vocab_size=40, dim=32, depth=2, num_heads=4, max_seq_len=64).eval()
    x = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    got = model.generate(x, 6, temperature=1.0, num_return_sequences=3, generator=torch.Generator().manual_seed(2))
    want = model.generate(x.repeat_interleave(3, 0), 6, temperature=1.0, generator=torch.Generator().manual_seed(2))
    assert got.shape == (6, 11)
    assert torch.equal(got, want)


# ------------------------------------------------------------------ encoder-decoders
@pytest.fixture(scope="module")
def bart() -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    pytest.importorskip("transformers")
    from attnzoo.interop import from_hf
    from hf_family_checks import V
    from hf_seq2seq_checks import tiny_bart

    hf = tiny_bart(forced_eos_token_id=None)
    src = torch.randint(3, V, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(src)
    mask[0, -3:] = 0
    src[0, -3:] = 1
    return hf, from_hf(hf).eval(), src, mask


@pytest.mark.parametrize("num_beams", [1, 3])
def test_seq2seq_end_tokens_pad_and_penalty_equal_transformers(bart: Any, num_beams: int) -> None:
    hf, ours, src, mask = bart
    first = ours.generate(src, NEW, src_mask=mask.bool())[:, 1:]
    eos = list(dict.fromkeys([int(first[0, 2]), int(first[1, 4])]))
    returns = 2 if num_beams > 1 else 1
    word = first[1, 1:3].tolist()  # a two-token word row 1 writes
    for extra in ({}, {"repetition_penalty": 1.5}, {"min_length": 6}, {"bad_words_ids": [word]}):
        want = hf.generate(src, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=1,
                           num_beams=num_beams, num_return_sequences=returns, forced_bos_token_id=None,
                           **{**OFF, **extra})
        got = ours.generate(src, NEW, src_mask=mask.bool(), eos_token_id=eos, pad_token_id=1, num_beams=num_beams,
                            num_return_sequences=returns, **extra)
        assert torch.equal(got, want), (extra, got, want)


def test_a_forced_first_token_that_ends_the_rows(bart: Any) -> None:
    """Greedy: a forced first token that is an end token ends every row at once, as transformers."""
    hf, ours, src, mask = bart
    want = hf.generate(src, attention_mask=mask, max_new_tokens=NEW, eos_token_id=2, pad_token_id=1,
                       forced_bos_token_id=2, **OFF)
    got = ours.generate(src, NEW, src_mask=mask.bool(), eos_token_id=2, pad_token_id=1, forced_bos_token_id=2)
    assert torch.equal(got, want), (got, want)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("kw", "err", "words"), [
    ({"eos_token_id": []}, ValueError, "eos_token_id"),
    ({"eos_token_id": "2"}, TypeError, "eos_token_id"),
    ({"eos_token_id": [2, 1.5]}, TypeError, "eos_token_id"),
    ({"eos_token_id": [2, 40]}, ValueError, "vocab_size=40"),
    ({"eos_token_id": torch.tensor([2])}, TypeError, "eos_token_id"),
    ({"pad_token_id": -1}, ValueError, "pad_token_id"),
    ({"pad_token_id": 40, "eos_token_id": 2}, ValueError, "pad_token_id"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, ValueError, "repetition_penalty"),
    ({"repetition_penalty": True}, TypeError, "repetition_penalty"),
    ({"num_return_sequences": 0}, ValueError, "num_return_sequences"),
    ({"min_length": -1}, ValueError, "min_length"),
    ({"bad_words_ids": [[]]}, ValueError, "bad_words_ids"),
    ({"bad_words_ids": [1, 2]}, TypeError, "bad_words_ids"),
    ({"bad_words_ids": [[1, 40]]}, ValueError, "bad_words_ids"),
    ({"min_p": 1.5, "temperature": 1.0}, ValueError, "min_p"),
    ({"min_p": 0.1, "num_beams": 2}, ValueError, "min_p"),
    ({"num_return_sequences": 2}, ValueError, "greedy"),
    ({"num_return_sequences": 4, "num_beams": 3}, ValueError, "num_beams=3"),
    ({"num_beams": 2, "temperature": 0.5}, ValueError, "temperature"),
    ({"num_beams": 0}, ValueError, "num_beams"),
])
def test_bad_settings_are_refused_by_name(kw: dict[str, Any], err: type[Exception], words: str) -> None:
    model = az.DecoderLM(vocab_size=40, dim=16, depth=1, num_heads=2, max_seq_len=32)
    with pytest.raises(err, match=words):
        model.generate(torch.tensor([[1, 2, 3]]), 2, **kw)
    seq2seq = az.Transformer(40, 40, 16, 2, 1, 1)
    with pytest.raises(err, match=words):
        seq2seq.generate(torch.tensor([[1, 2, 3]]), 2, bos_token_id=0, **kw)


def test_a_forced_token_that_is_suppressed_is_refused() -> None:
    model = az.Transformer(40, 40, 16, 2, 1, 1)
    with pytest.raises(ValueError, match=r"forced_bos_token_id=5 .*suppress_tokens"):
        model.generate(torch.tensor([[1, 2, 3]]), 2, bos_token_id=0, forced_bos_token_id=5, suppress_tokens=[5])


def test_greedy_returns_are_refused_before_the_source_is_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    model = az.Transformer(40, 40, 16, 2, 1, 1)
    monkeypatch.setattr(model, "encode", lambda *a: pytest.fail("encoded before the arguments were checked"))
    with pytest.raises(ValueError, match=r"Transformer\.generate: greedy decoding"):
        model.generate(torch.tensor([[1, 2, 3]]), 2, bos_token_id=0, num_return_sequences=2)


@pytest.mark.parametrize(("kw", "err", "words"), [
    ({"pad_token_id": -7}, ValueError, "pad_token_id"),
    ({"pad_token_id": "a"}, TypeError, "pad_token_id"),
    ({"counted": torch.ones(2, 3, dtype=torch.bool)}, ValueError, "counted"),
    ({"forced": (None, 99)}, ValueError, "forced_eos_token_id"),
    ({"eos_token_id": 99}, ValueError, "eos_token_id"),
])
def test_beam_search_refuses_bad_tokens_and_rows(kw: dict[str, Any], err: type[Exception], words: str) -> None:
    from attnzoo.models.beam_search import beam_search

    logits = torch.randn(2 * 2, 40)
    with pytest.raises(err, match=words):
        beam_search(lambda t: logits, torch.ones(2, 1, dtype=torch.long), num_beams=2, max_new_tokens=3,
                    **{"eos_token_id": None, **kw})


def test_decoder_beam_search_checks_its_mask_and_pad() -> None:
    from attnzoo.models.beam_search import decoder_beam_search

    model = az.DecoderLM(vocab_size=40, dim=16, depth=1, num_heads=2, max_seq_len=32)
    x = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask"):
        decoder_beam_search(model, x, num_beams=2, max_new_tokens=2, eos_token_id=None,
                            attention_mask=torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="left padding"):
        decoder_beam_search(model, x, num_beams=2, max_new_tokens=2, eos_token_id=None,
                            attention_mask=torch.tensor([[True, True, False, False]] * 2))
    with pytest.raises(ValueError, match="pad_token_id"):
        decoder_beam_search(model, x, num_beams=2, max_new_tokens=2, eos_token_id=None, pad_token_id=99)
