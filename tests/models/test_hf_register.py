"""attnzoo.hf.register(): attn_implementation="attnzoo" equals eager on random-initialised tiny models.

Every family is built offline from a config (2 layers, hidden 64, vocab 128); logits are compared
with eager on the same weights, with and without a padding mask, and greedy generation must give
the same tokens (decoders, including a left-padded batch through the DynamicCache).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo.hf as azhf  # noqa: E402

NAMES = azhf.register()
VOCAB = 128
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB,
             max_position_embeddings=128)


def _llama() -> Any:
    return transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **SMALL)


def _mistral() -> Any:
    return transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=8, **SMALL)


def _qwen2() -> Any:
    return transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                    sliding_window=8, max_window_layers=1, **SMALL)


def _qwen3() -> Any:
    return transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=1, head_dim=16, **SMALL)


def _gemma2() -> Any:
    return transformers.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                     attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                                     query_pre_attn_scalar=16, **SMALL)


def _phi3() -> Any:
    return transformers.Phi3Config(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                   sliding_window=12, **SMALL)


def _gpt2() -> Any:
    return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128)


def _bert() -> Any:
    return transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128)


DECODERS: dict[str, Callable[[], Any]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
    "gemma2": _gemma2, "phi3": _phi3, "gpt2": _gpt2,
}


def _build(make: Callable[[], Any], auto: Any, impl: str) -> Any:
    try:
        cfg = make()
        torch.manual_seed(0)
        model = auto.from_config(cfg, attn_implementation=impl)
    except (ImportError, OSError) as e:  # pragma: no cover - transformers cannot build it offline
        pytest.skip(f"transformers cannot build this family offline: {e}")
    return model.eval()


def _inputs(n: int = 24, left_pad: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, n), generator=g)
    am = torch.ones_like(ids)
    am[1, :left_pad] = 0
    ids[1, :left_pad] = 0
    return ids, am


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _logits(model: Any, ids: torch.Tensor, am: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=am)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_logits_and_generate_match_eager(family: str) -> None:
    eager = _build(DECODERS[family], transformers.AutoModelForCausalLM, "eager")
    zoo = _build(DECODERS[family], transformers.AutoModelForCausalLM, "attnzoo")
    zoo.load_state_dict(eager.state_dict())
    ids, am = _inputs()
    real = am.bool()
    for mask in (None, am):
        ref = _logits(eager, ids, mask)
        got = _logits(zoo, ids, mask)
        keep = real if mask is not None else torch.ones_like(real)  # padded rows: zeros vs eager's average
        assert _rel(got[keep], ref[keep]) <= 1e-4, (family, mask is not None)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref_tokens = eager.generate(ids, attention_mask=am, **kw)
    got_tokens = zoo.generate(ids, attention_mask=am, **kw)
    assert torch.equal(got_tokens, ref_tokens), family


@pytest.mark.parametrize(("family", "name"), [("mistral", "attnzoo_tiled"), ("gemma2", "attnzoo_reference")])
def test_set_attn_implementation_switches_backend(family: str, name: str) -> None:
    model = _build(DECODERS[family], transformers.AutoModelForCausalLM, "eager")
    ids, am = _inputs(n=20, left_pad=3)
    ref = _logits(model, ids, am)
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name
    got = _logits(model, ids, am)
    real = am.bool()
    assert _rel(got[real], ref[real]) <= 1e-4


def test_sdpa_backend_name_on_llama() -> None:
    model = _build(_llama, transformers.AutoModelForCausalLM, "eager")
    ids, am = _inputs()
    ref = _logits(model, ids, am)
    model.set_attn_implementation("attnzoo_sdpa")
    got = _logits(model, ids, am)
    assert _rel(got[am.bool()], ref[am.bool()]) <= 1e-4


@pytest.mark.parametrize("head", ["AutoModel", "AutoModelForMaskedLM"])
def test_bert_matches_eager_with_right_padding(head: str) -> None:
    auto = getattr(transformers, head)
    eager = _build(_bert, auto, "eager")
    zoo = _build(_bert, auto, "attnzoo")
    zoo.load_state_dict(eager.state_dict())
    ids, _ = _inputs()
    am = torch.ones_like(ids)
    am[1, -7:] = 0
    for mask in (None, am):
        assert _rel(_logits(zoo, ids, mask), _logits(eager, ids, mask)) <= 1e-4


class _Spy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        real = azhf.attention

        def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
            self.calls.append(dict(kw, q_shape=tuple(q.shape), k_shape=tuple(k.shape)))
            return real(q, k, v, **kw)

        monkeypatch.setattr(azhf, "attention", spy)


def test_masks_arrive_as_structure_and_gqa_unexpanded(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _build(_gemma2, transformers.AutoModelForCausalLM, "attnzoo")
    spy = _Spy(monkeypatch)
    ids, am = _inputs()
    _logits(model, ids, am)
    windows = [c["window"] for c in spy.calls]
    assert windows == [(7, 0), None]  # Gemma2 alternates sliding (W=8) and global layers
    for c in spy.calls:
        assert c["causal"] is True and c["softcap"] == 2.0
        assert c["k_shape"][1] == 2 and c["q_shape"][1] == 4  # Hkv heads, no repeat_kv
        assert c["mask"] is None or tuple(c["mask"].shape) == (2, 1, 1, ids.shape[1])  # key padding only


def test_decode_step_uses_cache_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _build(_mistral, transformers.AutoModelForCausalLM, "attnzoo")
    ids, _ = _inputs(n=20)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        spy = _Spy(monkeypatch)
        model(input_ids=ids[:, :1], cache=out.past_key_values, use_cache=True)
    for c in spy.calls:  # sliding layer keeps W - 1 = 7 keys + the new one; query is the last
        assert c["k_shape"][2] == 8 and c["q_offset"] == 7 and c["window"] == (7, 0)


def test_register_is_idempotent_and_lists_names() -> None:
    assert azhf.register() == NAMES == ("attnzoo", "attnzoo_tiled", "attnzoo_sdpa", "attnzoo_reference")
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for name in NAMES:
        assert name in AttentionInterface._global_mapping
        assert name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def test_unrecognised_mask_function_falls_back_to_dense() -> None:
    from transformers import masking_utils as mu

    odd = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: k == 0)
    dense = azhf.attnzoo_mask(1, 4, 6, q_offset=2, kv_offset=0, mask_function=odd)
    want = mu.sdpa_mask(1, 4, 6, q_offset=2, mask_function=odd, allow_is_causal_skip=False)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, want)
    hf_mask = azhf.attnzoo_mask(1, 4, 6, q_offset=2, mask_function=mu.sliding_window_causal_mask_function(3))
    assert isinstance(hf_mask, azhf.HFMask)
    ref = mu.sdpa_mask(1, 4, 6, q_offset=2, mask_function=mu.sliding_window_causal_mask_function(3),
                       allow_is_causal_skip=False)
    assert torch.equal(hf_mask.to_dense(), ref)


def test_training_backward_and_dropout() -> None:
    model = _build(_llama, transformers.AutoModelForCausalLM, "attnzoo").train()
    ids, am = _inputs()
    loss = model(input_ids=ids, attention_mask=am, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    q = torch.randn(1, 2, 8, 16)
    mod = torch.nn.Module()
    a, _ = azhf.attnzoo_attention_forward(mod, q, q, q, None, dropout=0.5)
    b, _ = azhf.attnzoo_attention_forward(mod, q, q, q, None, dropout=0.0)
    assert torch.isfinite(a).all() and not torch.allclose(a, b)


def test_sinks_reach_attention() -> None:
    q = torch.randn(1, 4, 6, 8)
    k = torch.randn(1, 2, 6, 8)
    mod = torch.nn.Module()
    mod.is_causal = True
    sinks = torch.randn(4)
    got, _ = azhf.attnzoo_attention_forward(mod, q, k, k, None, s_aux=sinks)
    kr = k.repeat_interleave(2, dim=1)
    s = (q @ kr.transpose(-1, -2)) / 8 ** 0.5
    s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    s = torch.cat([s, sinks.view(1, 4, 1, 1).expand(1, 4, 6, 1)], dim=-1)
    want = (s.softmax(-1)[..., :-1] @ kr).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_mask_is_a_clear_error() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attention_mask must be 4D"):
        azhf.attnzoo_attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="unsupported attention_mask"):
        azhf.attnzoo_attention_forward(torch.nn.Module(), q, q, q, "causal")


def test_attnzoo_sdpa_name_follows_transformers_sdpa_check() -> None:
    """The name contains "sdpa": transformers refuses it for models without SDPA support (Gemma2)."""
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        transformers.AutoModelForCausalLM.from_config(_gemma2(), attn_implementation="attnzoo_sdpa")


def test_docs_examples_run() -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "huggingface.md").read_text()
    found = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(found) == 13
    for i, code in enumerate(found):
        exec(compile(code, f"docs/huggingface.md[block {i}]", "exec"), {"__name__": "__doc_example__"})


def _gpt_oss() -> Any:
    return transformers.GptOssConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                     num_local_experts=4, num_experts_per_tok=2, **SMALL)


def test_gpt_oss_sinks_match_eager_or_are_refused() -> None:
    eager = _build(_gpt_oss, transformers.AutoModelForCausalLM, "eager")
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if name.endswith("sinks"):
                p.normal_()  # zero-initialised: make the sinks matter
    ids, am = _inputs()
    ref = _logits(eager, ids, am)
    eager.set_attn_implementation("attnzoo")
    got = _logits(eager, ids, am)
    assert _rel(got[am.bool()], ref[am.bool()]) <= 1e-4
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    zoo_tokens = eager.generate(ids, attention_mask=am, **kw)
    eager.set_attn_implementation("eager")
    assert torch.equal(zoo_tokens, eager.generate(ids, attention_mask=am, **kw))


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_static_cache_generate_matches_eager(family: str) -> None:
    """Static caches: generate hands the prepared masks back to the model (HFMask passes through)."""
    model = _build(DECODERS[family], transformers.AutoModelForCausalLM, "eager")
    ids, am = _inputs()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    ref = model.generate(ids, attention_mask=am, **kw)
    model.set_attn_implementation("attnzoo")
    assert torch.equal(model.generate(ids, attention_mask=am, **kw), ref)


def test_chunked_prefill_through_sliding_cache_matches_full_forward() -> None:
    """Second chunk of 8 after 12 cached tokens: the sliding layer's keys start at kv_offset 5."""
    model = _build(_mistral, transformers.AutoModelForCausalLM, "attnzoo")
    ids, _ = _inputs(n=20)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :12], use_cache=True)
        second = model(input_ids=ids[:, 12:], cache=first.past_key_values, use_cache=True).logits
    assert _rel(second, full[:, 12:]) <= 1e-5


def test_encoder_decoder_cross_attention_with_padding() -> None:
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                  decoder_ffn_dim=128, max_position_embeddings=64)
    model = _build(lambda: cfg, transformers.AutoModelForSeq2SeqLM, "eager")
    ids, _ = _inputs(n=20)
    am = torch.ones_like(ids)
    am[1, -6:] = 0
    dec = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
        model.set_attn_implementation("attnzoo")
        got = model(input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
    assert _rel(got, ref) <= 1e-4


def test_output_attentions_returns_eager_weights() -> None:
    model = _build(_llama, transformers.AutoModelForCausalLM, "eager")
    ids, am = _inputs()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am, output_attentions=True).attentions
        model.set_attn_implementation("attnzoo")
        got = model(input_ids=ids, attention_mask=am, output_attentions=True).attentions
    for g, r in zip(got, ref, strict=True):
        real_rows = am.bool()[:, None, :, None]  # padded query rows: zeros here, eager's average there
        torch.testing.assert_close(g * real_rows, r * real_rows, atol=1e-6, rtol=1e-5)


def test_decoder_run_bidirectionally_stays_bidirectional() -> None:
    """config.is_causal=False: the explicit bidirectional HFMask wins over the modules' is_causal."""
    def make() -> Any:
        cfg = _llama()
        cfg.is_causal = False
        return cfg

    model = _build(make, transformers.AutoModel, "eager")
    ids, _ = _inputs()
    ref = _logits(model, ids, None)
    model.set_attn_implementation("attnzoo")
    assert _rel(_logits(model, ids, None), ref) <= 1e-4
