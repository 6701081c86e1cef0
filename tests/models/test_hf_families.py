"""Hugging Face families converted to attnzoo: logits and greedy generation equal transformers'.

Every model is random-initialised offline from a tiny config (2 layers, hidden 64, vocab 128);
the weights are perturbed so that norms (Gemma's ``1 + weight``, QK-norms) are not identities.
Covered: LLaMA, Mistral, Qwen2 (QKV bias, sliding layers), Qwen3 (per-head QK-norm), Gemma,
Gemma2 (sandwich norms, softcaps, alternating windows), Phi3 (fused projections), OLMo2
(QK-norm over all heads, output norms); the ``*Model`` and ``*ForSequenceClassification``
classes and a user subclass; every RoPE scaling type past ``original_max_position_embeddings``;
``BertFor*`` folders; the configuration errors; the same models through ``attnzoo.hf.register()``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo as az  # noqa: E402
import attnzoo.hf as azhf  # noqa: E402
from attnzoo.blocks import BlockConfig  # noqa: E402
from attnzoo.interop import (  # noqa: E402
    CheckpointFormatError,
    UnsupportedConfigError,
    from_hf,
    load_pretrained,
)
from attnzoo.models.parts import DecoderParts  # noqa: E402

T = transformers
V = 128
TOL = 1e-4
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=V, max_position_embeddings=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)

CONFIGS: dict[str, Any] = {
    "llama": lambda: T.LlamaConfig(**HEADS, **SMALL),
    "mistral": lambda: T.MistralConfig(**HEADS, sliding_window=8, **SMALL),
    "qwen2": lambda: T.Qwen2Config(**HEADS, use_sliding_window=True, sliding_window=8, max_window_layers=1, **SMALL),
    "qwen3": lambda: T.Qwen3Config(**HEADS, head_dim=16, **SMALL),
    "gemma": lambda: T.GemmaConfig(**HEADS, head_dim=16, **SMALL),
    "gemma2": lambda: T.Gemma2Config(**HEADS, head_dim=16, sliding_window=8, attn_logit_softcapping=2.0,
                                     final_logit_softcapping=3.0, query_pre_attn_scalar=12, **SMALL),
    "phi3": lambda: T.Phi3Config(**HEADS, **SMALL),
    "olmo2": lambda: T.Olmo2Config(**HEADS, **SMALL),
}
FAMILIES = list(CONFIGS)


def _perturbed(model: Any, seed: int = 0) -> Any:
    """Random weights of a visible size everywhere (norm weights too), eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _hf(family: str, auto: Any = None, seed: int = 0, **overrides: Any) -> Any:
    cfg = CONFIGS[family]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    return _perturbed((auto or T.AutoModelForCausalLM).from_config(cfg, attn_implementation="eager"), seed)


def _tokens(n: int = 20, batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, n), generator=g)  # no pad/bos/eos ids


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_logits_equal_transformers(family: str) -> None:
    hf = _hf(family)
    ours = from_hf(hf)
    x = _tokens()
    with torch.no_grad():
        err = _rel(ours(x), hf(input_ids=x).logits)
    assert err <= TOL, f"{family}: relative error {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_base_model_and_sequence_classification(family: str) -> None:
    x = _tokens(12)
    base = _hf(family, T.AutoModel)
    ours = from_hf(base)
    assert isinstance(ours.lm_head, torch.nn.Identity)
    with torch.no_grad():
        err = _rel(ours(x), base(input_ids=x).last_hidden_state)
    assert err <= TOL, f"{family}Model: relative error {err:.2e}"
    cls = _hf(family, T.AutoModelForSequenceClassification, num_labels=3)
    ours = from_hf(cls)
    assert ours.lm_head.out_features == 3 and not ours.tie_embeddings
    with torch.no_grad():
        err = _rel(ours(x)[:, -1], cls(input_ids=x).logits)  # transformers reads the last non-pad token
    assert err <= TOL, f"{family}ForSequenceClassification: relative error {err:.2e}"


def test_user_subclass_is_matched_on_model_type() -> None:
    class MyQwen(T.Qwen3ForCausalLM):
        pass

    cfg = CONFIGS["qwen3"]()
    torch.manual_seed(0)
    hf = _perturbed(MyQwen(cfg))
    x = _tokens()
    with torch.no_grad():
        assert _rel(from_hf(hf)(x), hf(input_ids=x).logits) <= TOL


def _hf_greedy(hf: Any, x: torch.Tensor, new: int) -> torch.Tensor:
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_generation_token_identical(family: str) -> None:
    hf = _hf(family)
    ours = from_hf(hf)
    x = _tokens(6, batch=1)
    assert torch.equal(ours.generate(x, 10), _hf_greedy(hf, x, 10))


# --------------------------------------------------------------------------- RoPE scaling
ORIG = 16
HEAD_DIM = 16
ROPES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "beta_fast": 16.0,
             "beta_slow": 2.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
                    "mscale": 1.0, "mscale_all_dim": 0.5},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": ORIG,
                              "attention_factor": 1.3},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIG,
                 "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.5 + 0.5 * i for i in range(HEAD_DIM // 2)]},
}


def _rope_model(case: str) -> Any:
    params = {"rope_theta": 1000.0, **ROPES[case]}
    family = "phi3" if case == "longrope" else "llama"
    cfg = CONFIGS[family]()
    cfg.max_position_embeddings = 2 * ORIG if case == "dynamic" else 4 * ORIG
    cfg.rope_parameters = params
    if family == "phi3":
        cfg.original_max_position_embeddings = ORIG
    torch.manual_seed(3)
    return _perturbed(T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"), 3)


@pytest.mark.parametrize("case", list(ROPES))
def test_rope_scaling_logits_equal_past_original_length(case: str) -> None:
    hf = _rope_model(case)
    ours = from_hf(hf)
    for n in (ORIG - 4, 3 * ORIG):  # within and past original_max_position_embeddings (and max for dynamic)
        x = _tokens(n, batch=1)
        with torch.no_grad():
            err = _rel(ours(x), hf(input_ids=x).logits)
        assert err <= TOL, f"{case}, {n} tokens: relative error {err:.2e}"


@pytest.mark.parametrize("case", ["dynamic", "longrope", "yarn"])
def test_rope_scaling_generation_crosses_the_original_length(case: str) -> None:
    """Greedy decoding from inside to past ``original_max_position_embeddings`` (and for
    ``dynamic`` past ``max_position_embeddings``, which needs ``extend_context=True``)."""
    hf = _rope_model(case)
    ours = from_hf(hf)
    x = _tokens(ORIG - 3, batch=1)
    new = 2 * ORIG + 4 - x.shape[1] if case == "dynamic" else 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _hf_greedy(hf, x, new)
    if case == "dynamic":
        with pytest.raises(ValueError, match="extend_context"):
            ours.generate(x, new)
        with pytest.warns(UserWarning, match="past the model's 32 positions"):
            got = ours.generate(x, new, extend_context=True)
    else:
        got = ours.generate(x, new)
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------- BERT heads, folders, errors
def _bert_cfg(**kw: Any) -> Any:
    return T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        vocab_size=V, max_position_embeddings=64, **kw)


@pytest.mark.parametrize("cls", ["BertForSequenceClassification", "BertForMaskedLM", "BertForTokenClassification",
                                 "BertForQuestionAnswering", "BertForPreTraining"])
def test_bert_task_heads(cls: str, tmp_path: Path) -> None:
    """Sequence classification and masked LM load with their heads; the other heads are ignored
    and listed in a warning; the encoder always equals transformers'."""
    torch.manual_seed(0)
    hf = _perturbed(getattr(T, cls)(_bert_cfg(num_labels=2 if cls == "BertForQuestionAnswering" else 3)))
    x = _tokens(9)
    with torch.no_grad():
        ref = hf.bert(input_ids=x).last_hidden_state
        logits = hf(input_ids=x)
    hf.save_pretrained(tmp_path)
    ignored = {"BertForTokenClassification": "classifier", "BertForQuestionAnswering": "qa_outputs",
               "BertForPreTraining": "seq_relationship"}.get(cls)
    for load in (lambda: from_hf(hf), lambda: load_pretrained(tmp_path)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = load()
        assert any(ignored in str(w.message) and "ignored" in str(w.message) for w in caught) == bool(ignored)
        with torch.no_grad():
            hidden = ours(x)
            assert _rel(hidden, ref) <= TOL
            if cls == "BertForSequenceClassification":
                assert _rel(ours.classify(hidden), logits.logits) <= TOL
            if cls in ("BertForMaskedLM", "BertForPreTraining"):
                mlm = logits.logits if cls == "BertForMaskedLM" else logits.prediction_logits
                assert _rel(ours.mlm_logits(hidden), mlm) <= TOL


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "olmo2"])
def test_load_pretrained_folder_equals_transformers(family: str, tmp_path: Path) -> None:
    hf = _hf(family)
    hf.save_pretrained(tmp_path)
    x = _tokens()
    with torch.no_grad():
        assert _rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= TOL


def test_unsupported_options_raise_their_own_error() -> None:
    cfg = CONFIGS["qwen3"]()
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedConfigError, match=r"partial_rotary_factor=0\.5"):
        from_hf(T.Qwen3ForCausalLM(cfg))
    hf = T.LlamaForCausalLM(CONFIGS["llama"]())
    hf.config.rope_parameters = {"rope_type": "mrope", "rope_theta": 1e4}
    with pytest.raises(UnsupportedConfigError, match="rope_type='mrope'"):
        from_hf(hf)


def test_missing_config_key_names_file_and_key(tmp_path: Path) -> None:
    _hf("qwen2").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    hidden = data.pop("hidden_size")
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointFormatError, match=r"config\.json.*missing key 'hidden_size'"):
        load_pretrained(tmp_path)
    data["hidden_size"] = hidden
    data["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4}
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointFormatError, match=r"config\.json.*original_max_position_embeddings"):
        load_pretrained(tmp_path)


# --------------------------------------------------------------------------- register()
NAMES = azhf.register()


@pytest.mark.parametrize("family", FAMILIES)
def test_register_path_equals_eager(family: str) -> None:
    """The same tiny models run inside transformers with ``attn_implementation="attnzoo"``."""
    assert "attnzoo" in NAMES
    hf = _hf(family)
    x = _tokens()
    with torch.no_grad():
        eager = hf(input_ids=x).logits
        gen_eager = _hf_greedy(hf, x[:1, :6], 8)
        hf.set_attn_implementation("attnzoo")
        err = _rel(hf(input_ids=x).logits, eager)
        gen = _hf_greedy(hf, x[:1, :6], 8)
    assert err <= TOL, f"{family} via register(): relative error {err:.2e}"
    assert torch.equal(gen, gen_eager)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_left_padded_batch_generation(family: str) -> None:
    """Full and sliding layers with a left-padded batch: positions count real tokens only."""
    hf = _hf(family)
    ours = from_hf(hf)
    x = _tokens(10)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    x = x.masked_fill(mask == 0, 0)
    expected = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert torch.equal(ours.generate(x, 8, attention_mask=mask.bool()), expected)


def test_decoder_family_options_are_validated() -> None:
    """The family options live on the parts now (attention options, block configs, heads), and
    each still fails where it is written, naming itself."""
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        az.TransformerBlock(config=BlockConfig(64, 4, attention_kwargs={"qk_norm": "per-head"}))
    with pytest.raises(ValueError, match=r"blocks must hold depth=2"):
        az.DecoderLM(V, 64, 2, 4, parts=DecoderParts(blocks=[az.TransformerBlock(64, 4)]))
    with pytest.raises(ValueError, match="sublayer_norm='both' needs norm_first=True"):
        BlockConfig(64, 4, sublayer_norm="both", norm_first=False)
    with pytest.raises(TypeError, match="softcap"):
        az.TransformerBlock(config=BlockConfig(64, 4, attention="linear", attention_kwargs={"softcap": 5.0}))
    model = az.DecoderLM(V, 64, 2, 4, parts=DecoderParts(head=torch.nn.Identity()))
    with pytest.raises(ValueError, match="no LM head"):
        model.generate(_tokens(4), 2)
