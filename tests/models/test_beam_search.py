"""Beam search (``attnzoo.models.beam_search``, ``EncoderDecoder.generate(num_beams=...)``):
``num_beams=1`` is greedy bit for bit; the tokens (and scores) equal transformers' beam search on a
converted T5 model (padded source batch, end tokens produced at different steps, every
``early_stopping``, several ``length_penalty`` and ``num_beams``); the search finds the best
length-penalised hypothesis when it has beams enough to be exact (brute force over every hypothesis,
on a table of logits and on a native :class:`~attnzoo.Transformer`); bad arguments refused by name."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from attnzoo.models import Transformer
from attnzoo.models.beam_search import beam_search, decoder_beam_search
from attnzoo.models.config import Seq2SeqConfig
from attnzoo.models.seq2seq import EncoderDecoder

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12  # max_new_tokens of the transformers comparisons


# ----------------------------------------------------------------------------- native models
def _native(tgt_vocab: int = 13, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = Seq2SeqConfig(src_vocab_size=17, tgt_vocab_size=tgt_vocab, dim=32, num_heads=4, encoder_depth=2,
                        decoder_depth=2, dropout=0.0, max_seq_len=32)
    model = Transformer(config=cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # weights large enough that the distributions are not flat
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _source(rows: int = 3, m: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(0, 17, (rows, m), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(rows, m, dtype=torch.bool)
    mask[0, m - 2:] = False
    return src, mask


@pytest.mark.parametrize("eos", [None, 4])
def test_one_beam_is_greedy(eos: int | None) -> None:
    model = _native()
    src, mask = _source()
    want = model.generate(src, 10, src_mask=mask, bos_token_id=1, eos_token_id=eos)
    for kw in ({"num_beams": 1}, {"num_beams": 1, "length_penalty": 2.0, "early_stopping": True},
               {"num_beams": 1, "early_stopping": "never"}):
        assert torch.equal(model.generate(src, 10, src_mask=mask, bos_token_id=1, eos_token_id=eos, **kw), want)
    if eos is not None:  # with an end token one beam may keep a finished hypothesis greedy would not
        return
    # the search itself with one beam (generate takes the greedy path for num_beams=1)
    with torch.no_grad():
        memory = model.encode(src, mask)
    for lp, stop in ((1.0, False), (2.0, True), (0.5, "never")):
        got = decoder_beam_search(model.decoder, torch.ones(src.shape[0], 1, dtype=torch.long), memory, mask,
                                  num_beams=1, max_new_tokens=10, eos_token_id=eos, length_penalty=lp,
                                  early_stopping=stop).tokens
        assert torch.equal(got, want)


def test_no_new_tokens_returns_the_start() -> None:
    model = _native()
    src, mask = _source()
    out = model.generate(src, 0, src_mask=mask, bos_token_id=1, num_beams=3)
    assert torch.equal(out, torch.ones(3, 1, dtype=torch.long))


# ----------------------------------------------------------------------------- brute force
def _hypotheses(V: int, T: int, eos: int) -> list[tuple[int, ...]]:
    """Every hypothesis of at most ``T`` tokens: ended by ``eos`` (no earlier one), or ``T`` tokens."""
    out: list[tuple[int, ...]] = []
    for t in range(1, T + 1):
        for seq in itertools.product(range(V), repeat=t):
            if eos not in seq[:-1] and (seq[-1] == eos or t == T):
                out.append(seq)
    return out


def _best(scores: dict[tuple[int, ...], float]) -> tuple[tuple[int, ...], float, float]:
    """The best hypothesis, its score, and its margin over the second best."""
    ranked = sorted(scores.items(), key=lambda kv: -kv[1])
    return ranked[0][0], ranked[0][1], ranked[0][1] - ranked[1][1]


@pytest.mark.parametrize("length_penalty", [-1.0, 0.0, 0.5, 1.0, 2.0])
def test_exact_beams_find_the_best_hypothesis_of_a_logit_table(length_penalty: float) -> None:
    """Logits that depend on the step and the last token; with ``K >= V (V - 1) ** (T - 2)`` beams
    (every prefix kept, every candidate able to finish) and ``early_stopping="never"`` (an exact
    bound) beam search returns the best ``sum_logprobs / length ** length_penalty`` of all
    hypotheses; with 2 beams, a hypothesis whose score is its own, no better than the best."""
    V, T, eos, B = 4, 4, 0, 2
    table = torch.randn(B, T, V, V, generator=torch.Generator().manual_seed(5)) * 2  # [B, step, last, V]
    logp = torch.log_softmax(table.double(), dim=-1)

    def step(tokens: torch.Tensor, K: int) -> torch.Tensor:  # [B * K, 1 + t] -> [B * K, V]
        rows = torch.arange(tokens.shape[0]) // K
        return table[rows, tokens.shape[1] - 1, tokens[:, -1]]

    def score(b: int, seq: tuple[int, ...]) -> float:
        last, total = 1, 0.0  # the start token is 1
        for i, tok in enumerate(seq):
            total += float(logp[b, i, last, tok])
            last = tok
        return total / len(seq) ** length_penalty

    hyps = _hypotheses(V, T, eos)
    start = torch.ones(B, 1, dtype=torch.long)
    exact = beam_search(lambda t: step(t, 36), start, num_beams=36, max_new_tokens=T, eos_token_id=eos,
                        length_penalty=length_penalty, early_stopping="never")
    narrow = beam_search(lambda t: step(t, 2), start, num_beams=2, max_new_tokens=T, eos_token_id=eos,
                         length_penalty=length_penalty)
    for b in range(B):
        best, best_score, margin = _best({h: score(b, h) for h in hyps})
        assert margin > 1e-4
        n = int(exact.lengths[b])
        assert tuple(exact.tokens[b, 1:1 + n].tolist()) == best
        assert (exact.tokens[b, 1 + n:] == eos).all()  # filled with the end token
        assert float(exact.scores[b]) == pytest.approx(best_score, abs=1e-5)
        n = int(narrow.lengths[b])
        got = tuple(narrow.tokens[b, 1:1 + n].tolist())
        assert float(narrow.scores[b]) == pytest.approx(score(b, got), abs=1e-5)
        assert float(narrow.scores[b]) <= best_score + 1e-5


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_exact_beams_find_the_best_hypothesis_of_a_native_model(length_penalty: float) -> None:
    """The same on a native Transformer through ``generate`` (5 target tokens, 3 new ones, 20 beams:
    exact), its scores by teacher forcing every hypothesis."""
    V, T, eos = 5, 3, 4
    model = _native(tgt_vocab=V, seed=2)
    src, mask = _source(rows=2)
    hyps = _hypotheses(V, T, eos)
    full = [h + (0,) * (T - len(h)) for h in hyps]
    tgt = torch.cat((torch.ones(len(full), 1, dtype=torch.long), torch.tensor(full)), dim=1)  # [H, 1 + T]
    out = model.generate(src, T, src_mask=mask, bos_token_id=1, eos_token_id=eos, num_beams=20,
                         length_penalty=length_penalty, early_stopping="never")
    with torch.no_grad():
        memory = model.encode(src, mask)
        res = decoder_beam_search(model.decoder, torch.ones(2, 1, dtype=torch.long), memory, mask, num_beams=20,
                                  max_new_tokens=T, eos_token_id=eos, length_penalty=length_penalty,
                                  early_stopping="never")
        for b in range(2):
            logits = model.decode(tgt[:, :-1], memory[b:b + 1].expand(len(full), -1, -1),
                                  memory_mask=mask[b:b + 1].expand(len(full), -1))
            lp = torch.log_softmax(logits.float(), -1).gather(-1, tgt[:, 1:, None])[..., 0]  # [H, T]
            scores = {h: float(lp[i, :len(h)].sum()) / len(h) ** length_penalty for i, h in enumerate(hyps)}
            best, best_score, margin = _best(scores)
            assert margin > 1e-4
            assert tuple(out[b, 1:1 + len(best)].tolist()) == best
            assert float(res.scores[b]) == pytest.approx(best_score, abs=1e-4)
    assert torch.equal(res.tokens, out)


# ----------------------------------------------------------------------------- transformers
@pytest.fixture(scope="module")
def bart() -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A tiny transformers BART (eager, weights perturbed) and a source batch with one right-padded row."""
    pytest.importorskip("transformers")
    from hf_family_checks import V
    from hf_seq2seq_checks import tiny_bart

    hf = tiny_bart()
    src = torch.randint(3, V, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(src)
    mask[0, -3:] = 0
    src[0, -3:] = 1
    return hf, src, mask


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize(("num_beams", "length_penalty"), [(2, 0.6), (4, 0.6), (4, 2.0)])
def test_search_equals_transformers_on_its_own_logits(bart: Any, num_beams: int, length_penalty: float,
                                                      early_stopping: bool | str) -> None:
    """The search alone (no conversion): :func:`beam_search` stepping transformers' BART without a
    cache gives the tokens and ``sequences_scores`` of its ``generate`` (end tokens 49: produced
    mid-sequence; 28: often first, so rows end early)."""
    hf, src, mask = bart
    K = num_beams
    with torch.no_grad():
        memory = hf.get_encoder()(input_ids=src, attention_mask=mask).last_hidden_state.repeat_interleave(K, 0)
    rows_mask = mask.repeat_interleave(K, 0)

    def step(tokens: torch.Tensor) -> torch.Tensor:  # [B * K, 1 + t] -> [B * K, V]
        with torch.no_grad():
            return hf(encoder_outputs=(memory,), attention_mask=rows_mask, decoder_input_ids=tokens,
                      use_cache=False).logits[:, -1]

    for eos in (49, 28):
        want = hf.generate(src, attention_mask=mask, do_sample=False, max_new_tokens=NEW, no_repeat_ngram_size=0,
                           min_length=0, forced_bos_token_id=None, forced_eos_token_id=None, pad_token_id=eos,
                           eos_token_id=eos, num_beams=K, length_penalty=length_penalty,
                           early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True)
        got = beam_search(step, torch.full((3, 1), 2), num_beams=K, max_new_tokens=NEW, eos_token_id=eos,
                          length_penalty=length_penalty, early_stopping=early_stopping)
        assert torch.equal(got.tokens, want.sequences), (eos, got.tokens, want.sequences)
        torch.testing.assert_close(got.scores, want.sequences_scores, rtol=1e-5, atol=1e-5)


#: the converted T5's end tokens: ones the model produces at different steps (61: early, 50: later)
EOS_IDS = (61, 50)


@pytest.fixture(scope="module")
def t5() -> tuple[Any, EncoderDecoder, torch.Tensor, torch.Tensor]:
    """A tiny transformers T5 (eager, weights perturbed), its conversion, a source batch with one
    right-padded row."""
    transformers = pytest.importorskip("transformers")
    from attnzoo.interop import from_hf
    from hf_family_checks import V, perturbed

    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = perturbed(transformers.T5ForConditionalGeneration._from_config(cfg, attn_implementation="eager"), 0, 0.5)
        ours = from_hf(hf).eval()
    finally:
        torch.set_num_threads(before)
    if not isinstance(ours, EncoderDecoder):
        pytest.skip("from_hf does not convert T5ForConditionalGeneration to an EncoderDecoder yet")
    src = torch.randint(3, V, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(src)
    mask[0, -3:] = 0
    src[0, -3:] = 0
    tgt = torch.randint(3, V, (3, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # a precondition: a difference here is the conversion's, not the search's
        gap = (hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
               - ours(src, tgt, src_mask=mask.bool())).abs().max()
    assert gap < 1e-3, f"the T5 conversion's logits differ from transformers' by {float(gap)}"
    return hf, ours, src, mask


def _hf_beams(hf: Any, src: torch.Tensor, mask: torch.Tensor, eos: int, **kw: Any) -> Any:
    """transformers' beam search with every logits processor off but those in ``kw``, padded with
    ``eos`` (as attnzoo)."""
    settings = {"no_repeat_ngram_size": 0, "min_length": 0, "repetition_penalty": 1.0, **kw}
    return hf.generate(src, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=eos,
                       eos_token_id=eos, decoder_start_token_id=0, **settings)


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [0.6, 1.0, 2.0])
@pytest.mark.parametrize("num_beams", [2, 4])
def test_equal_to_transformers(t5: Any, num_beams: int, length_penalty: float, early_stopping: bool | str) -> None:
    hf, ours, src, mask = t5
    for eos in EOS_IDS:
        kw = {"num_beams": num_beams, "length_penalty": length_penalty, "early_stopping": early_stopping}
        want = _hf_beams(hf, src, mask, eos, **kw)
        got = ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=eos, **kw)
        assert torch.equal(got, want), (eos, got, want)


def test_scores_equal_transformers_and_ends_are_covered(t5: Any) -> None:
    """``sequences_scores`` equal; the comparison sees rows that end early (the output shorter than
    ``max_new_tokens``, rows filled after their end token) and rows that run to the end."""
    hf, ours, src, mask = t5
    with torch.no_grad():
        memory = ours.encode(src, mask.bool())
    for eos, K, lp in ((61, 4, 0.6), (50, 2, 0.6), (50, 4, 2.0)):
        want = _hf_beams(hf, src, mask, eos, num_beams=K, length_penalty=lp, output_scores=True,
                         return_dict_in_generate=True)
        got = decoder_beam_search(ours.decoder, torch.zeros(3, 1, dtype=torch.long), memory, mask.bool(),
                                  num_beams=K, max_new_tokens=NEW, eos_token_id=eos, length_penalty=lp)
        assert torch.equal(got.tokens, want.sequences)
        torch.testing.assert_close(got.scores, want.sequences_scores, rtol=1e-5, atol=1e-5)
    short = ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=61, num_beams=4,
                          length_penalty=0.6)
    assert short.shape[1] < 1 + NEW and (short[:, 1:] == 61).sum() > short.shape[0]  # ended early, filled
    late = ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=50, num_beams=2,
                         length_penalty=0.6)
    ends = [(row[1:] == 50).nonzero().flatten()[:1].tolist() for row in late]
    assert late.shape[1] == 1 + NEW and [] in ends and any(e and 0 < e[0] < NEW - 1 for e in ends)


def test_one_beam_is_greedy_on_the_converted_model(t5: Any) -> None:
    _, ours, src, mask = t5
    want = ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=61)
    assert torch.equal(ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=61,
                                     num_beams=1, length_penalty=0.5), want)


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"num_beams": 0}, ValueError, "num_beams"),
    ({"num_beams": 2.0}, TypeError, "num_beams"),
    ({"num_beams": True}, TypeError, "num_beams"),
    ({"length_penalty": "1"}, TypeError, "length_penalty"),
    ({"length_penalty": float("nan")}, ValueError, "length_penalty"),
    ({"length_penalty": float("inf"), "num_beams": 1}, ValueError, "length_penalty"),
    ({"early_stopping": "always"}, ValueError, "early_stopping"),
    ({"early_stopping": 1}, TypeError, "early_stopping"),
    ({"early_stopping": None}, TypeError, "early_stopping"),
    ({"temperature": 0.7}, ValueError, "temperature"),
    ({"top_k": 5}, ValueError, "top_k"),
    ({"top_p": 0.9}, ValueError, "top_p"),
    ({"generator": torch.Generator()}, ValueError, "generator"),
    ({"temperature": -1.0}, ValueError, "temperature"),
])
def test_bad_arguments_are_refused_by_name(kw: dict[str, Any], error: type, match: str) -> None:
    model = _native()
    src, mask = _source()
    with pytest.raises(error, match=match):
        model.generate(src, 4, src_mask=mask, bos_token_id=1, **{"num_beams": 2, **kw})


def test_beam_search_checks_its_own_arguments() -> None:
    def step(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape[0], 3)

    with pytest.raises(ValueError, match="start"):
        beam_search(step, torch.ones(2), num_beams=2, max_new_tokens=2, eos_token_id=None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        beam_search(step, torch.ones(2, 1, dtype=torch.long), num_beams=2, max_new_tokens=-1, eos_token_id=None)
    with pytest.raises(TypeError, match="eos_token_id"):
        beam_search(step, torch.ones(2, 1, dtype=torch.long), num_beams=2, max_new_tokens=2, eos_token_id=1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_beams", [1, 2, 4])
@pytest.mark.parametrize(("bos", "eos_forced"), [(17, None), (None, 23), (17, 23)])
def test_forced_tokens_equal_transformers(t5: Any, num_beams: int, bos: int | None, eos_forced: int | None) -> None:
    """``forced_bos_token_id`` / ``forced_eos_token_id`` as transformers' processors of those names:
    the forced token counts in the length beam search divides by (a ``decoder_prompt`` would not)."""
    hf, ours, src, mask = t5
    for eos, lp in ((EOS_IDS[0], 0.6), (EOS_IDS[-1], 2.0)):
        kw = {"num_beams": num_beams, "length_penalty": lp, "forced_bos_token_id": bos,
              "forced_eos_token_id": eos_forced}
        want = _hf_beams(hf, src, mask, eos, **kw)
        got = ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=eos, **kw)
        assert torch.equal(got, want), (eos, got, want)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_decoder_prompt_equals_transformers_decoder_input_ids(t5: Any, num_beams: int) -> None:
    """Several start tokens (``decoder_prompt``) and a left-padded source row, as transformers'
    ``decoder_input_ids``."""
    hf, ours, src, mask = t5
    src, mask = src.clone(), mask.clone()
    src[1, :2], mask[1, :2] = 0, 0  # row 1 left-padded
    prompt = torch.tensor([[0, 5, 9]] * 3)
    for eos in EOS_IDS:
        want = _hf_beams(hf, src, mask, eos, num_beams=num_beams, decoder_input_ids=prompt)
        got = ours.generate(src, NEW, src_mask=mask.bool(), eos_token_id=eos, decoder_prompt=prompt,
                            num_beams=num_beams)
        assert torch.equal(got, want), (eos, got, want)


def test_forced_tokens_are_checked() -> None:
    model = _native()
    src, mask = _source()
    with pytest.raises(ValueError, match="forced_bos_token_id must be < the decoder's vocab_size"):
        model.generate(src, 4, src_mask=mask, bos_token_id=1, forced_bos_token_id=10_000)
    with pytest.raises(TypeError, match="forced_eos_token_id"):
        model.generate(src, 4, src_mask=mask, bos_token_id=1, forced_eos_token_id=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_beams", [1, 3])
def test_suppressed_tokens_and_min_new_tokens_equal_transformers(t5: Any, num_beams: int) -> None:
    """``suppress_tokens`` and ``min_new_tokens`` as transformers' processors of those names, alone,
    together and with a forced first token; the suppressed token is one the model would write."""
    hf, ours, src, mask = t5
    eos = EOS_IDS[0]
    with torch.no_grad():
        first = ours.generate(src, 2, src_mask=mask.bool(), bos_token_id=0, eos_token_id=eos)[:, 1:].unique()
    banned = [int(t) for t in first if int(t) != eos][:2]
    assert banned
    for kw in ({"suppress_tokens": banned}, {"min_new_tokens": 5},
               {"suppress_tokens": banned, "min_new_tokens": 3, "forced_bos_token_id": 17}):
        want = _hf_beams(hf, src, mask, eos, num_beams=num_beams, **kw)
        got = ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=eos, num_beams=num_beams,
                            **kw)
        assert torch.equal(got, want), (kw, got, want)
        if "suppress_tokens" in kw:
            assert not torch.isin(got[:, 1:], torch.tensor(banned)).any()


def test_generation_rules_are_checked() -> None:
    model = _native()
    src, mask = _source()
    with pytest.raises(TypeError, match="suppress_tokens must be a sequence"):
        model.generate(src, 4, src_mask=mask, bos_token_id=1, suppress_tokens=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="suppress_tokens must be < vocab_size"):
        model.generate(src, 4, src_mask=mask, bos_token_id=1, suppress_tokens=[10_000])
    with pytest.raises(ValueError, match="min_new_tokens"):
        model.generate(src, 4, src_mask=mask, bos_token_id=1, min_new_tokens=-1)
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        model.generate(src, 4, src_mask=mask, bos_token_id=1, no_repeat_ngram_size=-1)
    with pytest.raises(TypeError, match="no_repeat_ngram_size"):
        model.decoder.generate(torch.zeros(1, 1, dtype=torch.long), 4, context=model.encode(src[:1], mask[:1]),
                               no_repeat_ngram_size=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_size_equals_transformers(t5: Any, num_beams: int, n: int) -> None:
    """``no_repeat_ngram_size`` as transformers' processor (the start token counted in the n-grams);
    without it the model repeats itself, so the bans are exercised."""
    hf, ours, src, mask = t5
    eos = EOS_IDS[-1]
    plain = ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=eos, num_beams=num_beams)
    got = ours.generate(src, NEW, src_mask=mask.bool(), bos_token_id=0, eos_token_id=eos, num_beams=num_beams,
                        no_repeat_ngram_size=n)
    want = _hf_beams(hf, src, mask, eos, num_beams=num_beams, no_repeat_ngram_size=n)
    assert torch.equal(got, want), (got, want)
    assert not torch.equal(got, plain)  # the rule changed something
