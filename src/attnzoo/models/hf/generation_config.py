"""A checkpoint's generation settings (``generation_config.json``) as the keywords of attnzoo's
``generate``: :func:`generation_settings`.

transformers' ``model.generate(input_ids)`` applies the settings its model was saved with (Qwen's
``eos_token_id=[151645, 151643]``, ``repetition_penalty=1.05`` and sampling, opus-mt's beams and
``bad_words_ids``, bart-large-cnn's ``no_repeat_ngram_size=3``); ``model.generate(prompt, n,
**generation_settings(folder))`` does the same with an attnzoo model. A setting attnzoo cannot
reproduce is refused by name (``strict=True``) or dropped with a warning naming it, never silently
ignored. Settings that do not change the tokens (caching, outputs, an assistant model's drafting)
are skipped, but prompt lookup decoding (``prompt_lookup_num_tokens``, ``max_matching_ngram_size``),
which a config can turn on by itself, is passed on; so are the lengths ``max_new_tokens`` and ``max_length``: ``generate`` takes the number of
new tokens as its second argument.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attnzoo.models.hf.errors import CheckpointFormatError, UnsupportedConfigError
from attnzoo.models.hf.safetensors import read_json

__all__ = ["generation_settings"]

#: settings that map one to one onto a ``generate`` keyword, with transformers' default (left out)
_DIRECT: dict[str, Any] = {
    "eos_token_id": None, "pad_token_id": None, "num_beams": 1, "length_penalty": 1.0, "early_stopping": False,
    "num_return_sequences": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0,
    "min_length": 0, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "prompt_lookup_num_tokens": None, "max_matching_ngram_size": None,
}
#: what each setting read must be (a checkpoint with another value is malformed)
_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "eos_token_id": ((int, list), "a token id or a list of them"), "pad_token_id": ((int,), "a token id"),
    "num_beams": ((int,), "an int"), "length_penalty": ((int, float), "a number"),
    "early_stopping": ((bool, str), "true, false or \"never\""), "num_return_sequences": ((int,), "an int"),
    "repetition_penalty": ((int, float), "a number"), "no_repeat_ngram_size": ((int,), "an int"),
    "min_new_tokens": ((int,), "an int"), "min_length": ((int,), "an int"),
    "forced_bos_token_id": ((int,), "a token id"),
    "forced_eos_token_id": ((int, list), "a token id or a list of them"), "decoder_start_token_id": ((int,), "a token id"),
    "do_sample": ((bool,), "true or false"), "temperature": ((int, float), "a number"), "top_k": ((int,), "an int"),
    "top_p": ((int, float), "a number"), "min_p": ((int, float), "a number"),
    "suppress_tokens": ((list,), "a list of token ids"), "bad_words_ids": ((list,), "a list of token id lists"),
    "prompt_lookup_num_tokens": ((int,), "an int"), "max_matching_ngram_size": ((int,), "an int"),
}
#: settings that do not change which tokens are generated, or that ``generate`` takes otherwise
_SKIPPED = frozenset({
    "bos_token_id", "max_new_tokens", "max_length", "use_cache", "cache_implementation", "cache_config",
    "max_cache_len", "compile_config", "disable_compile", "low_memory", "remove_invalid_values", "max_time",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
    "transformers_version", "_from_model_config", "is_assistant", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_early_exit", "assistant_lookbehind", "target_lookbehind",
    "assistant_ensemble_weight", "speculation_type", "prefill_chunk_size", "continuous_batching_config",
    "use_mtp",  # drafting never changes the tokens; generate(use_mtp=True) needs MTP layers a conversion may lack
})
#: settings attnzoo does not reproduce, with the value(s) at which they do nothing
_INERT: dict[str, tuple[Any, ...]] = {
    "stop_strings": (None,), "top_h": (None,), "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "encoder_repetition_penalty": (None, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0), "renormalize_logits": (None, False),
    "exponential_decay_length_penalty": (None,), "begin_suppress_tokens": (None, []), "sequence_bias": (None,),
    "token_healing": (None, False), "guidance_scale": (None, 1.0), "watermarking_config": (None,),
    "penalty_alpha": (None,), "dola_layers": (None,), "diversity_penalty": (None, 0.0), "num_beam_groups": (None, 1),
    "constraints": (None,), "force_words_ids": (None,), "forced_decoder_ids": (None,),
}
#: the sampling settings, read only with ``do_sample``
_SAMPLING = frozenset({"do_sample", "temperature", "top_k", "top_p", "min_p"})
#: the generation keys a ``config.json`` may carry (transformers' ``GenerationConfig.from_model_config``)
_MODEL_CONFIG_KEYS = (frozenset(_DIRECT) | frozenset(_INERT) | _SAMPLING
                      | {"bad_words_ids", "suppress_tokens", "decoder_start_token_id", "max_new_tokens", "max_length"})


def generation_settings(source: str | os.PathLike[str] | Mapping[str, Any] | Any, *,
                        strict: bool = True) -> dict[str, Any]:
    """The keywords of :meth:`DecoderLM.generate <attnzoo.DecoderLM.generate>` /
    :meth:`EncoderDecoder.generate <attnzoo.EncoderDecoder.generate>` that reproduce a checkpoint's
    generation settings, transformers' defaults left out.

    Args:
        source: a checkpoint folder (its ``generation_config.json``, else the generation keys of its
            ``config.json``, as transformers falls back), a dict of those settings, a transformers
            ``GenerationConfig``, or a transformers model (its ``generation_config``).
        strict: ``True``: a setting attnzoo does not reproduce (``stop_strings``, ``typical_p``,
            epsilon sampling, diverse beams, Whisper's timestamp keys, ...) raises
            :class:`~attnzoo.interop.UnsupportedConfigError` naming it; ``False``: it is dropped
            with a warning naming it.

    Returns: a dict for ``generate(prompt, max_new_tokens, **settings)``: ``eos_token_id`` (an id or
    a list), ``pad_token_id``, ``num_beams``, ``length_penalty``, ``early_stopping``,
    ``num_return_sequences``, ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``,
    ``min_length``, ``suppress_tokens`` (with the one-token ``bad_words_ids`` but the end tokens, which
    transformers drops from them), ``bad_words_ids`` (the longer ones), and with ``do_sample`` ``temperature`` / ``top_k`` / ``top_p`` / ``min_p``
    (transformers' defaults 1.0 / 50 / 1.0 / none where unset), ``prompt_lookup_num_tokens`` /
    ``max_matching_ngram_size`` (speculative decoding; ``use_mtp`` is not passed on: it needs the
    checkpoint's MTP layers, which a conversion from a transformers model lacks); for encoder-decoders ``forced_bos_token_id`` /
    ``forced_eos_token_id`` and ``bos_token_id`` (the ``decoder_start_token_id`` the target starts
    from). A value of the wrong type is a :class:`~attnzoo.interop.CheckpointFormatError` naming it.
    """
    owner = "generation_settings"
    if not isinstance(strict, bool):
        raise TypeError(f"{owner}: strict must be a bool, got {type(strict).__name__}")
    raw, where = _read(source, owner)
    _check_kinds(raw, where, owner)
    settings: dict[str, Any] = {}
    if raw.get("decoder_start_token_id") is not None:
        settings["bos_token_id"] = raw["decoder_start_token_id"]
    refused: list[str] = []
    for key, value in raw.items():
        if key == "forced_eos_token_id" and isinstance(value, list):
            if len(value) == 1:
                settings[key] = value[0]
            elif value:
                refused.append(f"forced_eos_token_id={value!r} (several forced end tokens; one is taken)")
        elif key in _DIRECT:
            if value is not None and value != _DIRECT[key]:
                settings[key] = list(value) if isinstance(value, (list, tuple)) else value
        elif key in _INERT:
            if not any(value == inert for inert in _INERT[key]):
                refused.append(f"{key}={value!r}")
        elif key not in _SKIPPED and key not in _KINDS:
            refused.append(f"{key}={value!r}")
    _suppressed(raw, settings)
    refused += _sampling(raw, settings)
    if refused:
        message = (f"{owner}: {where} asks for settings attnzoo's generate does not reproduce: "
                   f"{', '.join(refused)}")
        if strict:
            raise UnsupportedConfigError(message + " (strict=False drops them with a warning)")
        warnings.warn(message + "; dropped", stacklevel=2)
    return settings


def _read(source: object, owner: str) -> tuple[dict[str, Any], str]:
    """The settings dict of ``source`` and words naming where it came from."""
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        if not folder.is_dir():
            raise FileNotFoundError(f"{owner}: not a directory: {str(folder)!r}")
        path = folder / "generation_config.json"
        if path.is_file():
            data = read_json(path, "the generation config")
        elif (folder / "config.json").is_file():
            path = folder / "config.json"
            config = read_json(path, "the model config")
            data = _from_model_config(config) if isinstance(config, dict) else config
        else:
            raise FileNotFoundError(f"{owner}: no generation_config.json or config.json in {str(folder)!r}")
        if not isinstance(data, dict):
            raise CheckpointFormatError(f"{owner}: {str(path)!r} must hold a JSON object, got {type(data).__name__}")
        return data, repr(str(path))
    if isinstance(source, Mapping):
        return dict(source), "the settings given"
    config = getattr(source, "generation_config", source)
    to_dict = getattr(config, "to_diff_dict", None) or getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(f"{owner}: source must be a checkpoint folder, a dict, a transformers GenerationConfig or "
                        f"a transformers model, got {type(source).__name__}")
    return dict(to_dict()), f"{type(source).__name__}'s generation config"


def _from_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The generation keys of a model's ``config.json`` as transformers' ``from_model_config`` reads
    them: the top level's that are not ``None``, then for those still unset the first of its
    ``decoder`` / ``generator`` / ``text_config`` sub-configs' (a multimodal wrapper's text model)."""
    data = {k: v for k, v in config.items() if k in _MODEL_CONFIG_KEYS and v is not None}
    inner = next((config[n] for n in ("decoder", "generator", "text_config") if config.get(n)), None)
    if isinstance(inner, dict):
        data.update({k: v for k, v in inner.items() if k in _MODEL_CONFIG_KEYS and v is not None and k not in data})
    return data


def _check_kinds(raw: Mapping[str, Any], where: str, owner: str) -> None:
    """Every setting of :data:`_KINDS` given (not ``None``) of its type, lists of ints where lists."""
    for key, (kinds, expected) in _KINDS.items():
        value = raw.get(key)
        if value is None:
            continue
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if ok and key == "bad_words_ids":
            ok = all(isinstance(words, list) and words and all(map(_is_id, words)) for words in value)
        elif ok and isinstance(value, list):
            ok = all(map(_is_id, value))
        if not ok:
            raise CheckpointFormatError(f"{owner}: {where}: {key} must be {expected}, got {value!r}")


def _is_id(token: object) -> bool:
    return isinstance(token, int) and not isinstance(token, bool)


def _suppressed(raw: Mapping[str, Any], settings: dict[str, Any]) -> None:
    """``suppress_tokens`` and the one-token ``bad_words_ids`` (the same rule) into ``settings``'
    ``suppress_tokens``, the end tokens dropped from ``bad_words_ids`` as transformers'
    ``NoBadWordsLogitsProcessor`` drops them; the longer ones into ``settings``' ``bad_words_ids``."""
    tokens = list(raw.get("suppress_tokens") or [])
    eos = raw.get("eos_token_id")
    ends = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    longer = []
    for words in raw.get("bad_words_ids") or []:
        if len(words) == 1 and words[0] in ends:
            continue  # transformers never bans an end token through bad_words_ids
        if len(words) == 1:
            tokens.append(words[0])
        else:
            longer.append(list(words))
    if longer:
        settings["bad_words_ids"] = longer
    if tokens:
        settings["suppress_tokens"] = list(dict.fromkeys(tokens))


def _sampling(raw: Mapping[str, Any], settings: dict[str, Any]) -> list[str]:
    """With ``do_sample``: ``temperature`` / ``top_k`` / ``top_p`` at transformers' values (its
    defaults where unset; ``top_k=0`` and ``top_p=1`` are off); sampling with beams refused."""
    if not raw.get("do_sample"):
        return []
    if settings.get("num_beams", 1) > 1:
        return [f"do_sample=True with num_beams={settings['num_beams']} (beam sampling)"]
    temperature = 1.0 if raw.get("temperature") is None else raw["temperature"]
    if temperature <= 0:  # its type: _check_kinds
        return [f"temperature={temperature!r} with do_sample=True (a number > 0)"]
    top_k = 50 if raw.get("top_k") is None else raw["top_k"]
    top_p = raw.get("top_p")
    settings["temperature"] = float(temperature)
    if top_k:
        settings["top_k"] = top_k
    if top_p is not None and top_p < 1.0:
        settings["top_p"] = top_p
    if raw.get("min_p"):
        settings["min_p"] = raw["min_p"]
    return []
