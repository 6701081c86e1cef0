"""``generation_settings``: a checkpoint's ``generation_config.json`` as ``generate``'s keywords.
A saved transformers model whose generation config asks for end tokens, beams, penalties and
returns generates, through ``load_pretrained`` + ``generation_settings``, the tokens transformers'
``generate`` does with no argument but the prompt (Llama; BART with the generation config
transformers derives from its model config); the folder, a ``GenerationConfig``, a model and a
dict give the same settings; ``config.json`` is the fallback; what cannot be reproduced is refused
by name (or dropped with a warning)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnzoo.interop import (
    CheckpointFormatError,
    UnsupportedConfigError,
    generation_settings,
    load_pretrained,
)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 8


def _llama(tmp_path: Path, **generation: Any) -> tuple[Any, Path]:
    from hf_family_checks import SMALL, hf_model

    hf = hf_model(transformers.LlamaConfig(num_hidden_layers=2, **SMALL))
    hf.generation_config = transformers.GenerationConfig(**generation)
    hf.save_pretrained(tmp_path)
    return hf, tmp_path


def test_saved_llama_generates_what_transformers_generates(tmp_path: Path) -> None:
    from hf_family_checks import padded

    x, mask = padded(7, pad=3)
    probe, _ = _llama(tmp_path / "probe")
    first = probe.generate(input_ids=x, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[:, x.shape[1]:]
    eos = list(dict.fromkeys([int(first[0, 2]), int(first[1, 4])]))  # tokens the rows write: they end apart
    hf, folder = _llama(tmp_path / "saved", num_beams=3, num_return_sequences=2, eos_token_id=eos, pad_token_id=0,
                        repetition_penalty=1.2, no_repeat_ngram_size=3, length_penalty=0.8, early_stopping=True,
                        max_new_tokens=NEW, bad_words_ids=[[5], [6]])
    settings = generation_settings(folder)
    assert settings == {"num_beams": 3, "num_return_sequences": 2, "eos_token_id": eos, "pad_token_id": 0,
                        "repetition_penalty": 1.2, "no_repeat_ngram_size": 3, "length_penalty": 0.8,
                        "early_stopping": True, "suppress_tokens": [5, 6]}  # max_new_tokens: generate's 2nd argument
    assert generation_settings(hf) == generation_settings(hf.generation_config) == settings
    want = hf.generate(input_ids=x, attention_mask=mask)
    got = load_pretrained(folder).generate(x, NEW, attention_mask=mask.bool(), **settings)
    assert torch.equal(got, want), (got, want)


def test_bart_generates_with_the_config_transformers_derives(tmp_path: Path) -> None:
    """BART's model config carries ``forced_eos_token_id``, from which transformers derives the
    generation config it saves and applies; beams given on top, to both."""
    from hf_family_checks import V
    from hf_seq2seq_checks import tiny_bart

    hf = tiny_bart(forced_eos_token_id=2)
    hf.save_pretrained(tmp_path)
    src = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(src)
    mask[0, -3:] = 0
    settings = generation_settings(tmp_path)
    assert settings == {"eos_token_id": 2, "pad_token_id": 1, "forced_eos_token_id": 2, "bos_token_id": 2}
    ours = load_pretrained(tmp_path)
    for beams in ({}, {"num_beams": 3, "no_repeat_ngram_size": 2}):
        want = hf.generate(src, attention_mask=mask, max_new_tokens=NEW, **beams)
        got = ours.generate(src, NEW, src_mask=mask.bool(), **settings, **beams)
        assert torch.equal(got, want), (beams, got, want)


def test_a_config_that_turns_on_prompt_lookup(tmp_path: Path) -> None:
    """A generation config may ask for prompt lookup decoding by itself: passed on (the tokens are
    greedy decoding's either way, as transformers' are); an assistant's drafting settings are not."""
    from hf_family_checks import padded

    x, _ = padded(7, pad=0)
    x = x[:1].repeat(1, 2)  # a row that repeats itself: drafts are found
    hf, folder = _llama(tmp_path, prompt_lookup_num_tokens=3, max_matching_ngram_size=2, pad_token_id=0,
                        num_assistant_tokens=7, assistant_confidence_threshold=0.2)
    settings = generation_settings(folder)
    assert settings == {"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 2, "pad_token_id": 0}
    want = hf.generate(x, max_new_tokens=NEW, min_new_tokens=NEW)
    assert torch.equal(load_pretrained(folder).generate(x, NEW, **settings), want)


def test_end_tokens_are_not_bad_words_and_lengths_are_not_settings() -> None:
    """transformers drops the end tokens from ``bad_words_ids``; the lengths are generate's argument."""
    got = generation_settings({"eos_token_id": [2, 3], "bad_words_ids": [[3], [7], [8, 9]], "max_new_tokens": 20,
                               "max_length": 50, "forced_eos_token_id": [2]})
    assert got == {"eos_token_id": [2, 3], "suppress_tokens": [7], "bad_words_ids": [[8, 9]], "forced_eos_token_id": 2}


@pytest.mark.parametrize(("settings", "named"), [
    ({"suppress_tokens": 5}, "suppress_tokens"),
    ({"bad_words_ids": 5}, "bad_words_ids"),
    ({"bad_words_ids": [[]]}, "bad_words_ids"),
    ({"do_sample": True, "top_p": "0.9"}, "top_p"),
    ({"num_beams": "4"}, "num_beams"),
    ({"eos_token_id": [2, True]}, "eos_token_id"),
])
def test_malformed_settings_are_refused_by_name(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(CheckpointFormatError, match=named):
        generation_settings(settings)


def test_sampling_settings_take_transformers_defaults() -> None:
    qwen = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
            "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
            "transformers_version": "4.37.0"}
    assert generation_settings(qwen) == {"pad_token_id": 151643, "eos_token_id": [151645, 151643],
                                         "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert generation_settings({"do_sample": True}) == {"temperature": 1.0, "top_k": 50}
    assert generation_settings({"do_sample": True, "top_k": 0, "top_p": 1.0}) == {"temperature": 1.0}
    assert generation_settings({"do_sample": True, "min_p": 0.05}) == {"temperature": 1.0, "top_k": 50, "min_p": 0.05}
    assert generation_settings({"do_sample": False, "temperature": 0.7, "top_k": 5}) == {}


def test_config_json_is_the_fallback(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "eos_token_id": [2, 3],
                                                      "no_repeat_ngram_size": 3}))
    assert generation_settings(tmp_path) == {"eos_token_id": [2, 3], "no_repeat_ngram_size": 3}
    # a wrapper's text model holds them: transformers' from_model_config reads its text_config then
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "pad_token_id": 0, "text_config": {
        "eos_token_id": 106, "pad_token_id": 5, "repetition_penalty": 1.1}}))
    assert generation_settings(tmp_path) == {"pad_token_id": 0, "eos_token_id": 106, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert generation_settings(str(tmp_path)) == {"eos_token_id": 7}


@pytest.mark.parametrize(("settings", "named"), [
    ({"stop_strings": ["###"]}, "stop_strings"),
    ({"typical_p": 0.9}, "typical_p"),
    ({"do_sample": True, "num_beams": 2}, "beam sampling"),
    ({"do_sample": True, "temperature": 0.0}, "temperature=0.0"),
    ({"diversity_penalty": 0.5, "num_beam_groups": 2}, "num_beam_groups=2"),
    ({"no_timestamps_token_id": 50363}, "no_timestamps_token_id"),  # Whisper's timestamp logic
    ({"forced_eos_token_id": [2, 3]}, "forced_eos_token_id"),
])
def test_what_cannot_be_reproduced_is_refused_by_name(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=named):
        generation_settings({"eos_token_id": 2, **settings})
    with pytest.warns(UserWarning, match=named):
        kept = generation_settings({"eos_token_id": 2, **settings}, strict=False)
    assert kept["eos_token_id"] == 2


def test_bad_sources_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        generation_settings(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"no generation_config\.json"):
        generation_settings(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match=r"generation_config\.json"):
        generation_settings(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointFormatError, match="JSON object"):
        generation_settings(tmp_path)
    with pytest.raises(TypeError, match="source must be"):
        generation_settings(3)
    with pytest.raises(TypeError, match="strict"):
        generation_settings({}, strict="yes")  # type: ignore[arg-type]


def test_summarisation_settings_of_bart_large_cnn_shape(tmp_path: Path) -> None:
    """bart-large-cnn's generation config (beams, length penalty, min_length counting the start
    token, n-gram rule, forced first and last tokens) on a tiny BART: transformers' generate with
    the prompt alone (its ``max_length=20`` counts the start token: 19 new tokens)."""
    from hf_seq2seq_checks import tiny_bart

    hf = tiny_bart()
    hf.generation_config = transformers.GenerationConfig(
        num_beams=4, length_penalty=2.0, min_length=8, max_length=20, no_repeat_ngram_size=3, early_stopping=True,
        forced_bos_token_id=0, forced_eos_token_id=2, decoder_start_token_id=2, eos_token_id=[2, 28, 15],
        pad_token_id=1, bos_token_id=0)  # 28 and 15: what the rows write third, so min_length decides
    hf.save_pretrained(tmp_path)
    src = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    settings = generation_settings(tmp_path)
    assert settings["min_length"] == 8 and settings["forced_bos_token_id"] == 0
    want = hf.generate(src, attention_mask=torch.ones_like(src))
    ours = load_pretrained(tmp_path)
    got = ours.generate(src, 19, **settings)
    assert torch.equal(got, want), (got, want)
    assert got.shape[1] > ours.generate(src, 19, **{**settings, "min_length": 0}).shape[1], "min_length changed nothing"
