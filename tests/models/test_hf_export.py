"""attnzoo -> Hugging Face (``to_hf``, ``save_pretrained``): the inverse of ``from_hf`` /
``load_pretrained`` for every converted ``model_type``.

The sweep: two transformers models A and B of one tiny config with different (perturbed) weights;
``to_hf(from_hf(B), A)`` makes A's conversion equal B's parameters and A's logits equal B's. Then
the workflows a user runs (fine-tune with attnzoo, write back, reload with transformers; a folder
without transformers; half precision), the tied and scaled cases, and the refusals: a parameter no
checkpoint converts to, a model of another config, bad arguments."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_deepseek as deepseek  # noqa: E402
import test_hf_families as lineage  # noqa: E402
import test_hf_half_precision as half  # noqa: E402
import test_hf_inkling2 as inkling2  # noqa: E402
import test_hf_inkling2_loop as inkling2_loop  # noqa: E402
import test_hf_multimodal as multimodal  # noqa: E402

import hf_encoder_checks as encoders  # noqa: E402
import hf_family_checks as checks  # noqa: E402
import hf_seq2seq_checks as seq2seq  # noqa: E402
import hf_vision_checks as vision  # noqa: E402
from attnzoo import DecoderLM, TransformerEncoder  # noqa: E402
from attnzoo.interop import (  # noqa: E402
    MODEL_TYPES,
    ExportError,
    from_hf,
    load_pretrained,
    save_pretrained,
    to_hf,
)
from attnzoo.models import EncoderParts  # noqa: E402
from attnzoo.models.config import DecoderConfig, EncoderConfig, Rope  # noqa: E402
from attnzoo.models.hf.save import hf_config  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt2(seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=24, initializer_range=0.3)
    return T.GPT2LMHeadModel(cfg).eval()


def _bert(seed: int, head: Any = None) -> Any:
    torch.manual_seed(seed)
    cfg = T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                       max_position_embeddings=24, initializer_range=0.3)
    return (head or T.BertModel)(cfg).eval()


def _vit(seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=16,
                      patch_size=4, num_labels=5, initializer_range=0.3)
    return T.ViTForImageClassification(cfg).eval()


def _maker(module: Any, family: str) -> Any:
    if module is half:
        return lambda seed: half._hf(family, seed)
    return lambda seed: lineage._hf(family, seed=seed)


def _mistral4(seed: int) -> Any:
    """transformers maps no ``AutoModelForCausalLM`` to ``Mistral4Config``: the class itself."""
    torch.manual_seed(seed)
    return checks.perturbed(T.Mistral4ForCausalLM._from_config(deepseek._m4(), attn_implementation="eager"), seed)


#: ``model_type`` (or a name for the non-decoder cases) -> a maker of transformers model ``seed``
MAKERS: dict[str, Any] = {
    **{f: _maker(half, f) for f in half.FAMILIES}, **{f: _maker(lineage, f) for f in lineage.FAMILIES},
    "gpt2": _gpt2, "bert": _bert, "vit": _vit, "mistral4": _mistral4,
    "inkling2_text": lambda seed: checks.hf_model(inkling2._config(), seed=seed),
    "inkling2_loop_text": lambda seed: checks.hf_model(inkling2_loop._config(), seed=seed),
    **multimodal.SWEEP,  # the multimodal wrappers (their text decoder; the towers keep their values)
    **encoders.sweep(),  # the encoder families (RoBERTa, ModernBERT, DeBERTa, T5, ...)
    **vision.sweep(),  # the vision families (DINOv2, SigLIP, CLIP)
    **seq2seq.sweep(),  # the encoder-decoder families (T5, BART, Marian, Whisper, ...)
}


def decoder_types(leave_out: Any = ()) -> list[str]:
    """The swept model types but the encoders, vision towers and encoder-decoders (and ``leave_out``)."""
    others = {"bert", "vit", *encoders.sweep(), *vision.sweep(), *seq2seq.sweep(), *leave_out}
    return sorted(set(MAKERS) - others)


def language_model(kind: str) -> Any:
    """``from_hf`` of the swept model type ``kind``, in eval mode; the test is skipped when it
    converts to a model without an LM head (nothing to generate)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dropped vision tower or MTP layer, with a warning
        model: Any = from_hf(MAKERS[kind](0)).eval()
    if not isinstance(model, DecoderLM) or model.lm_head is None or isinstance(model.lm_head, torch.nn.Identity):
        pytest.skip(f"{kind} converts to {type(model).__name__} without an LM head: nothing to generate")
    return model


def test_every_converted_model_type_is_swept() -> None:
    assert set(MODEL_TYPES) <= set(MAKERS)


def _out(model: Any, kind: str) -> torch.Tensor:
    with torch.no_grad():
        if kind == "vit":
            return model(pixel_values=torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))).logits
        if seq2seq.is_seq2seq(model):  # teacher-forced logits of an encoder-decoder
            return seq2seq.sweep_output(model)
        if getattr(model, "main_input_name", None) == "pixel_values":  # a vision family: its main output
            channels = getattr(model.config, "vision_config", model.config).num_channels  # a dual model's tower
            return vision.hf_outputs(model, vision.pixels(channels=channels))[1]
        x, mask = checks.padded(12, pad=0)
        r = model(input_ids=x % 64 if kind in ("gpt2", "bert") else x, attention_mask=mask)
        return (r.logits if hasattr(r, "logits") else r.last_hidden_state).float()


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_to_hf_inverts_from_hf(kind: str) -> None:
    target, source = MAKERS[kind](0), MAKERS[kind](1)
    ours = from_hf(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dropped vision tower / MTP layer is kept, with a warning
        assert to_hf(ours, target) is target
    again = dict(from_hf(target).state_dict())
    for name, want in ours.state_dict().items():
        assert again[name].dtype == want.dtype, name
        scale = float(want.abs().max()) if want.is_floating_point() and want.numel() else 1.0
        assert torch.allclose(again[name], want, rtol=0, atol=4e-7 * max(scale, 1.0)), f"{kind}: {name}"
    got, ref = _out(target, kind), _out(source, kind)
    assert checks.rel(got, ref) <= 1e-5, kind


def _train(model: torch.nn.Module, steps: int = 3, seed: int = 0) -> torch.nn.Module:
    """A few SGD steps on random tokens (every parameter moves)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for _ in range(steps):
        x = torch.randint(3, lineage.V, (2, 16), generator=g)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_fine_tune_write_back_and_reload_with_transformers(family: str, tmp_path: Path) -> None:
    hf = lineage._hf(family)
    ours = _train(from_hf(hf))
    x = lineage._tokens()
    to_hf(ours, hf)
    hf.save_pretrained(tmp_path)
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        want = ours(x)
        assert checks.rel(reloaded(input_ids=x).logits, want) <= 1e-5
        assert checks.rel(load_pretrained(tmp_path)(x), want) <= 1e-6


def test_save_pretrained_without_transformers_keeps_the_folder_layout(tmp_path: Path) -> None:
    hf = lineage._hf("llama").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "tokenizer.json").write_text('{"version": "1.0"}')
    ours = _train(load_pretrained(tmp_path / "base", dtype=torch.float32))
    out = save_pretrained(ours, tmp_path / "tuned", like=tmp_path / "base")
    assert out == tmp_path / "tuned"
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "base" / "config.json").read_text())
    back = load_pretrained(out)
    assert next(back.parameters()).dtype == torch.bfloat16  # the checkpoint's dtype, as like's
    x = lineage._tokens()
    with torch.no_grad():
        want = ours.to(torch.bfloat16)(x).float()
        assert checks.rel(back(x).float(), want) <= 1e-6  # bf16 weights on both sides: the same numbers
        theirs = T.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert checks.rel(theirs(input_ids=x).logits.float(), want) <= 0.05  # bf16 arithmetic apart


def test_a_float32_model_written_into_bfloat16_weights_rounds_once() -> None:
    hf = lineage._hf("gemma").to(torch.bfloat16)
    ours = _train(from_hf(hf, dtype=torch.float32))
    to_hf(ours, hf)
    again = from_hf(hf, dtype=torch.float32)
    for name, want in ours.state_dict().items():
        # Gemma's norms are 1 + w: w rounds to bfloat16, not 1 + w
        assert torch.allclose(again.state_dict()[name], want, rtol=2 ** -7, atol=2 ** -7), name


def test_a_moved_zero_padding_is_refused_by_name() -> None:
    hf = half._hf("mimo_v2_flash", 0)
    ours = from_hf(hf)
    padded = [(n, p) for n, p in ours.named_parameters() if p.numel() and bool((p == 0).any())]
    assert padded, "MiMo's narrower value heads are zero-padded in attnzoo"
    name, param = padded[0]
    with torch.no_grad():
        param.add_(1e-3)
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    with pytest.raises(ExportError, match=rf"parameter '{name}'.*no checkpoint converts to it"):
        to_hf(ours, hf)
    assert all(torch.equal(v, before[k]) for k, v in hf.state_dict().items())  # nothing written


def test_a_model_of_another_config_is_refused_listing_the_shapes() -> None:
    ours = from_hf(lineage._hf("llama"))
    other = lineage._hf("llama", intermediate_size=96)
    with pytest.raises(ExportError, match=r"not a conversion of this LLaMA architecture.*shapes that differ"):
        to_hf(ours, other)
    with pytest.raises(ExportError, match="parameters it lacks"):
        to_hf(torch.nn.Linear(2, 2), other)


def test_kept_tensors_are_named_in_a_warning() -> None:
    hf = MAKERS["glm5_next"](0)
    with pytest.warns(UserWarning, match=r"to_hf\(Glm5NextForConditionalGeneration\): \d+ checkpoint tensors have "
                                         r"no counterpart .*visual"):
        to_hf(from_hf(MAKERS["glm5_next"](1)), hf)


def test_bad_arguments() -> None:
    hf = lineage._hf("llama")
    ours = from_hf(hf)
    with pytest.raises(TypeError, match=r"to_hf: model must be an nn\.Module, got dict"):
        to_hf({}, hf)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"to_hf: hf_model must be an nn\.Module or None, got str"):
        to_hf(ours, "llama")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"to_hf: hf_model \(Linear\) has no Hugging Face config"):
        to_hf(ours, torch.nn.Linear(2, 2))
    other = T.ConvBertModel(T.ConvBertConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4,
                                             num_hidden_layers=1, vocab_size=64, embedding_size=32))
    with pytest.raises(ValueError, match="to_hf: hf_model has model_type 'convbert'"):
        to_hf(ours, other)
    with pytest.raises(TypeError, match=r"save_pretrained: model must be an nn\.Module, got int"):
        save_pretrained(3, "out", like="in")  # type: ignore[arg-type]


def test_save_pretrained_like_a_multimodal_folder_writes_its_text_decoder(tmp_path: Path) -> None:
    """A wrapper's folder (Gemma 3: vision tower, projector, tied head): the fine-tuned text decoder
    written in its layout without transformers, the towers kept, transformers' wrapper reloading it."""
    hf = multimodal._hf("gemma3")
    hf.save_pretrained(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped towers, then kept
        ours = _train(load_pretrained(tmp_path / "base"))
        save_pretrained(ours, tmp_path / "tuned", like=tmp_path / "base")
        back = load_pretrained(tmp_path / "tuned")
    theirs = T.AutoModelForImageTextToText.from_pretrained(tmp_path / "tuned", attn_implementation="eager").eval()
    x = lineage._tokens()
    with torch.no_grad():
        want = ours(x)
        assert checks.rel(back(x), want) <= 1e-6
        assert checks.rel(theirs(input_ids=x).logits, want) <= 1e-5
    towers = {k: v for k, v in hf.state_dict().items() if "vision_tower" in k or "multi_modal_projector" in k}
    assert towers and all(torch.equal(theirs.state_dict()[k], v) for k, v in towers.items())


def test_save_pretrained_refuses_its_own_source(tmp_path: Path) -> None:
    hf = lineage._hf("llama")
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="save_pretrained: folder must differ from like"):
        save_pretrained(from_hf(hf), tmp_path, like=tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        save_pretrained(from_hf(hf), tmp_path / "out", like=tmp_path / "missing")


# --------------------------------------------------------------------------- native models
NATIVE = {
    "llama_gqa": dict(attention="gqa", pos="rope", norm="rms", ffn="swiglu", bias=False, tie_embeddings=False),
    "llama_mqa_bias": dict(attention="mqa", pos="rope", norm="rms", ffn="swiglu", bias=True, rope=Rope(base=500.0)),
    "llama_linear_rope": dict(attention="mha", pos="rope", norm="rms", ffn="swiglu", bias=False,
                              rope=Rope(base=1e4, scaling="linear", factor=2.0)),
    "mistral": dict(attention="sliding", attention_kwargs={"window": 5}, pos="rope", norm="rms", ffn="swiglu",
                    bias=False),
    "gpt2": dict(attention="mha", pos="learned", norm="layer", ffn="gelu_tanh", bias=True, max_seq_len=64),
    "gpt_neox": dict(attention="mha", pos="rope", norm="layer", ffn="gelu", bias=True, rope=Rope(base=500.0)),
    "gpt_neox_untied": dict(attention="mha", pos="rope", norm="layer", ffn="gelu", bias=True, tie_embeddings=False),
}
EXPECTED = {"llama_gqa": "LlamaForCausalLM", "llama_mqa_bias": "LlamaForCausalLM",
            "llama_linear_rope": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel",
            "gpt_neox": "GPTNeoXForCausalLM", "gpt_neox_untied": "GPTNeoXForCausalLM"}


def test_the_arena_language_model_exports_as_gpt_neox() -> None:
    ours = DecoderLM(config=DecoderConfig.preset("arena_lm", attention="mha")).eval()
    hf = to_hf(ours)
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    x = torch.randint(0, 76, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert checks.rel(hf.eval()(input_ids=x).logits, ours(x)) <= 1e-5


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_a_native_decoder_exports_as_its_family(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    ours = _train(DecoderLM(config=DecoderConfig(lineage.V, 64, 2, 8, **NATIVE[name])))
    hf = to_hf(ours)
    assert type(hf).__name__ == EXPECTED[name]
    x = lineage._tokens(n=24)
    with torch.no_grad():
        want = ours(x)
        assert checks.rel(hf(input_ids=x).logits, want) <= 1e-5
        save_pretrained(ours, tmp_path)
        reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert checks.rel(reloaded(input_ids=x).logits, want) <= 1e-5
        assert checks.rel(load_pretrained(tmp_path)(x), want) <= 1e-6


@pytest.mark.parametrize(("settings", "why"), [
    (dict(attention="linear"), "a layer's attention is LinearAttention"),
    (dict(attention=("gqa", "gated_deltanet")), "a layer's attention is"),
    (dict(attention="mha", pos="rope", norm="layer", ffn="gelu_tanh"), "pos='rope', norm='layer', ffn='gelu_tanh'"),
    (dict(attention="gqa", pos="rope", norm="layer", ffn="gelu"), "pos='rope', norm='layer', ffn='gelu'"),
    (dict(attention="mha", pos="learned", norm="layer", ffn="gelu_tanh", bias=False), "bias=False"),
])
def test_a_native_decoder_no_family_has_is_refused(settings: dict[str, Any], why: str) -> None:
    ours = DecoderLM(config=DecoderConfig(lineage.V, 64, 2, 8, **settings))
    with pytest.raises(ExportError, match=re.escape(why)):
        hf_config(ours)
    with pytest.raises(TypeError, match="hf_config: model must be a DecoderLM or a TransformerEncoder, got Linear"):
        hf_config(torch.nn.Linear(2, 2))


ENCODERS = {  # native BERT-shaped encoders (the heads pick the class) -> the transformers class
    "BertModel": dict(pooler=True), "BertModel_no_pooler": dict(pooler=False, ffn="gelu_tanh"),
    "BertForMaskedLM": dict(pooler=False, mlm_head=True), "BertForSequenceClassification": dict(num_labels=3)}


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_a_native_bert_shaped_encoder_exports_as_bert(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = EncoderConfig.preset("bert", vocab_size=lineage.V, dim=32, depth=2, num_heads=4, ffn_hidden=48,
                               max_seq_len=32, **ENCODERS[name])
    ours = TransformerEncoder(config=cfg)
    with torch.no_grad():
        for p in ours.parameters():  # no parameter left at its initial 0 / 1
            p.add_(torch.randn_like(p) * 0.1)
    ours.eval()
    hf = to_hf(ours)
    assert type(hf).__name__ == name.removesuffix("_no_pooler")
    x, mask = checks.padded(12)
    save_pretrained(ours, tmp_path)
    reloaded = getattr(T, type(hf).__name__).from_pretrained(tmp_path).eval()
    again = load_pretrained(tmp_path)
    with torch.no_grad():
        hidden = ours(x, attention_mask=mask)
        if cfg.num_labels:
            want, got = ours.classify(hidden), reloaded(input_ids=x, attention_mask=mask).logits
        elif cfg.mlm_head:
            want, got = ours.mlm_logits(hidden), reloaded(input_ids=x, attention_mask=mask).logits
        else:
            want, got = hidden, reloaded(input_ids=x, attention_mask=mask).last_hidden_state
        keep = mask.bool() if want.dim() == 3 else slice(None)
        assert checks.rel(got[keep], want[keep]) <= 1e-5
        assert checks.rel(again(x, attention_mask=mask)[mask.bool()], hidden[mask.bool()]) <= 1e-6


@pytest.mark.parametrize(("settings", "why"), [
    (dict(norm_first=True), "norm_first=True"), (dict(pos="sinusoidal"), "pos='sinusoidal'"),
    (dict(type_vocab_size=0), "type_vocab_size=0"), (dict(ffn="swiglu"), "ffn='swiglu'"),
    (dict(mlm_head=True), "a pooler and a masked-LM head together")])
def test_a_native_encoder_bert_cannot_hold_is_refused(settings: dict[str, Any], why: str) -> None:
    cfg = EncoderConfig.preset("bert", vocab_size=lineage.V, dim=32, depth=2, num_heads=4, ffn_hidden=48,
                               max_seq_len=32, **settings)
    with pytest.raises(ExportError, match=re.escape(why)):
        hf_config(TransformerEncoder(config=cfg))
    enc = TransformerEncoder(config=EncoderConfig(lineage.V, 32, 2, 4), parts=EncoderParts(norm=torch.nn.Identity(),
                                                                                         embedding=torch.nn.Identity()))
    with pytest.raises(ExportError, match="built from given parts"):
        hf_config(enc)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_to_hf_works_under_no_grad_and_inference_mode(mode: Any) -> None:
    target, source = MAKERS["qwen3"](0), MAKERS["qwen3"](1)
    ours = from_hf(source)
    with mode():
        to_hf(ours, target)
    assert checks.rel(_out(target, "qwen3"), _out(source, "qwen3")) <= 1e-5
