"""Checks every per-layer Hugging Face family passes against transformers (used by the
``test_hf_<family>.py`` modules): logits of ``*ForCausalLM`` and hidden states of the base
``*Model`` on a left-padded batch of 2, greedy generation (batch 1 and a left-padded batch 2),
cached decode equal to the full forward, and a saved folder through ``load_pretrained``.

A family's model is random-initialised offline from a tiny config, then every weight is
perturbed so that norms and sinks are not identities."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnzoo as az
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained

V = 128
TOL = 1e-4
SMALL = dict(hidden_size=64, intermediate_size=96, vocab_size=V, max_position_embeddings=256, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, num_attention_heads=4, num_key_value_heads=2)


def perturbed(model: Any, seed: int = 0, scale: float = 0.1) -> Any:
    """Every parameter, and the expert-choice biases (DeepSeek's ``e_score_correction_bias``
    buffers, zeros at init), plus seeded noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=g) * scale)
    return model.eval()


def hf_model(config: Any, auto: Any = None, seed: int = 0) -> Any:
    import transformers as T

    if auto is None:  # a multimodal wrapper without a causal-LM class: its *ForConditionalGeneration
        causal = type(config) in T.AutoModelForCausalLM._model_mapping
        auto = T.AutoModelForCausalLM if causal else T.AutoModelForImageTextToText
    torch.manual_seed(seed)
    return perturbed(auto.from_config(config, attn_implementation="eager"), seed)


def tokens(n: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def padded(n: int, pad: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [2, n], mask [2, n])``: row 0 left-padded by ``pad``."""
    x = tokens(n)
    mask = torch.ones_like(x)
    mask[0, :pad] = 0
    return x.masked_fill(mask == 0, 0), mask


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def check_logits(make: Callable[[], Any], n: int = 24) -> float:
    """``*ForCausalLM`` on a left-padded batch: logits at the real tokens within ``TOL``."""
    hf = hf_model(make())
    ours = from_hf(hf)
    x, mask = padded(n)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask).logits
        got = ours(x, attention_mask=mask.bool())
        full = ours(x[1:])
    real = mask.bool()
    err = max(rel(got[real], ref[real]), rel(full, ref[1:]))
    assert err <= TOL, f"relative error {err:.2e}"
    return err


def check_base_model(make: Callable[[], Any], n: int = 16) -> float:
    import transformers as T

    hf = hf_model(make(), T.AutoModel)
    ours = from_hf(hf)
    assert isinstance(ours.lm_head, torch.nn.Identity)
    x, mask = padded(n, pad=3)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask).last_hidden_state
        got = ours(x, attention_mask=mask.bool())
    real = mask.bool()
    err = rel(got[real], ref[real])
    assert err <= TOL, f"base model: relative error {err:.2e}"
    return err


def check_generation(make: Callable[[], Any], prompt: int = 7, new: int = 8) -> None:
    """Greedy generation token-identical to transformers' (batch 1, and left-padded batch 2)."""
    hf = hf_model(make())
    ours = from_hf(hf)
    x = tokens(prompt, batch=1)
    expected = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(x, new), expected)
    x, mask = padded(prompt + 3, pad=3)
    expected = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert torch.equal(ours.generate(x, new, attention_mask=mask.bool()), expected)


def check_cached_decode(make: Callable[[], Any], n: int = 20, prefill: int = 7) -> None:
    """Prefill then one token at a time through the cache == the full forward."""
    ours = from_hf(hf_model(make()))
    x = tokens(n)
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2, n)
        steps = [ours(x[:, :prefill], cache=cache)]
        steps += [ours(x[:, t:t + 1], cache=cache) for t in range(prefill, n)]
    err = rel(torch.cat(steps, dim=1), full)
    assert err <= TOL, f"cached decode vs full forward: relative error {err:.2e}"


def check_packed_equals_each_alone(make: Callable[[], Any], lengths: tuple[int, ...] = (5, 11, 1, 8)) -> None:
    """Packed sequences (``cu_seqlens``) through the converted model == each sequence alone."""
    ours = from_hf(hf_model(make()))
    seqs = [tokens(n, batch=1, seed=10 + i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(torch.cat(seqs, dim=1), cu_seqlens=cu)
        alone = torch.cat([ours(s) for s in seqs], dim=1)
    assert rel(packed, alone) <= 1e-5


def check_register_equals_eager(hf: Any, n: int = 30) -> None:
    """transformers' own model with ``attn_implementation="attnzoo"`` (``attnzoo.hf.register()``)
    gives its ``eager`` logits at the real tokens of a left-padded batch (the model is left set to
    ``attnzoo``)."""
    import transformers as T

    import attnzoo.hf as azhf

    if "attnzoo" not in T.AttentionInterface._global_mapping:  # registered once (a test may spy on it)
        azhf.register()
    x, mask = padded(n)
    with torch.no_grad():
        hf.set_attn_implementation("eager")
        ref = hf(input_ids=x, attention_mask=mask).logits
        hf.set_attn_implementation("attnzoo")
        got = hf(input_ids=x, attention_mask=mask).logits
    real = mask.bool()
    err = rel(got[real], ref[real])
    assert err <= TOL, f"{type(hf).__name__}: attn_implementation='attnzoo' vs eager, max rel error {err:.2e}"


def check_transformers_packed(hf: Any, lengths: tuple[int, ...] = (6, 1, 13, 9)) -> None:
    """A transformers model (served by ``register()``) on padding-free input as
    ``DataCollatorWithFlattening`` makes it (``position_ids`` restarting, ``cu_seq_lens_q/k``, no
    cache) gives each sequence's logits alone."""
    seqs = [tokens(n, batch=1, seed=20 + i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = hf(input_ids=torch.cat(seqs, dim=1), position_ids=pos, use_cache=False, cu_seq_lens_q=cu,
                    cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)).logits
        alone = torch.cat([hf(input_ids=s, use_cache=False).logits for s in seqs], dim=1)
    err = rel(packed, alone)
    assert err <= TOL, f"{type(hf).__name__}: packed vs each alone, lengths {lengths}: max rel error {err:.2e}"


def check_packed_gradients_equal_each_alone(make: Callable[[], Any], lengths: tuple[int, ...] = (6, 9, 3),
                                            no_gradient: str | None = None) -> None:
    """Packed training: the gradients of a packed batch's summed next-token loss equal those of
    the sequences run one at a time (the converted model, float64). ``no_gradient``: a name part
    of the parameters that get no gradient by design (an indexer's discrete top-k selection, as in
    transformers); they must get none either way, and only they."""
    ours = from_hf(hf_model(make())).double().train()
    seqs = [tokens(n, batch=1, seed=20 + i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def loss(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[0, :-1], seq[0, 1:], reduction="sum")

    names, params = zip(*ours.named_parameters(), strict=True)
    logits = ours(torch.cat(seqs, dim=1), cu_seqlens=cu)
    packed = sum(loss(logits[:, int(a):int(b)], s) for a, b, s in zip(cu[:-1], cu[1:], seqs, strict=True))
    got = torch.autograd.grad(packed, params, allow_unused=no_gradient is not None)
    alone = sum(loss(ours(s), s) for s in seqs)
    want = torch.autograd.grad(alone, params, allow_unused=no_gradient is not None)
    unused = {n for n, w in zip(names, want, strict=True) if w is None}
    assert no_gradient is None or (unused and all(no_gradient in n for n in unused)), sorted(unused)
    assert {n for n, g in zip(names, got, strict=True) if g is None} == unused
    assert max(rel(g, w) for g, w in zip(got, want, strict=True) if w is not None and w.abs().max() > 0) <= 1e-9


def check_text_model_alone(hf: Any, tmp_path: Path, model_type: str, prefix: str = "model.") -> None:
    """A multimodal wrapper ``hf``'s text model converts as the base decoder, and, saved alone (the
    tensors under ``prefix`` renamed to ``model.``, the ``lm_head``, the ``text_config`` of
    ``model_type``: ``tmp_path / "text"``), loads with the wrapper's logits."""
    import json

    from safetensors.torch import load_file, save_file

    hf.save_pretrained(tmp_path / "wrapper")
    tensors = load_file(str(tmp_path / "wrapper" / "model.safetensors"))
    text = {("model." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in tensors.items()
            if k.startswith((prefix, "lm_head."))}
    (tmp_path / "text").mkdir()
    save_file(text, str(tmp_path / "text" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "wrapper" / "config.json").read_text())["text_config"]
    (tmp_path / "text" / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    x = tokens(12)
    with torch.no_grad():
        text = hf.model.language_model
        assert rel(from_hf(text)(x), text(input_ids=x).last_hidden_state) <= TOL
        assert rel(load_pretrained(tmp_path / "text")(x), hf(input_ids=x).logits) <= TOL


def check_folder_without_keys(hf: Any, tmp_path: Path, keys: tuple[str, ...]) -> None:
    """``hf`` saved with ``keys`` left out of its ``config.json`` (a hand-written or older file):
    ``load_pretrained`` reads it as transformers' ``from_pretrained`` does (same logits)."""
    import json

    import transformers as T

    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in keys:
        data.pop(key, None)
    path.write_text(json.dumps(data))
    model = load_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = tokens(10)
    with torch.no_grad():
        assert rel(model(x), again(input_ids=x).logits) <= TOL


def check_refused(model_class: Any, make: Callable[[], Any], key: str, value: Any, named: str) -> None:
    """Setting ``key=value`` on the config makes ``from_hf`` refuse, naming ``named``."""
    hf = model_class(make())
    setattr(hf.config, key, value)
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)


def check_folder(make: Callable[[], Any], tmp_path: Path) -> None:
    hf = hf_model(make())
    hf.save_pretrained(tmp_path)
    x = tokens(12)
    model = load_pretrained(tmp_path)
    assert isinstance(model, az.DecoderLM)
    with torch.no_grad():
        assert rel(model(x), hf(input_ids=x).logits) <= TOL


def check_multimodal_rope_on_text(hf: Any, n: int = 12, streams: int = 3) -> None:
    """A multimodal wrapper ``hf`` whose text model rotates by ``streams`` position streams (time,
    height, width; HunYuan-VL's may add an image index): with the streams equal (text), transformers'
    hidden states equal the converted model's (the 1-D RoPE); with the streams of a 2 x 3 patch grid,
    transformers' differ (so the check above compared a rotation that depends on the sections)."""
    ours = from_hf(hf)
    x = tokens(n)
    pos = torch.arange(n).expand(2, n)
    text_model = hf.model.language_model
    grid = torch.stack([pos, pos // 2, pos % 3, pos // 6][:streams])
    with torch.no_grad():
        same = text_model(input_ids=x, position_ids=pos[None].expand(streams, 2, n)).last_hidden_state
        other = text_model(input_ids=x, position_ids=grid).last_hidden_state
        assert rel(ours.hidden_states(x), same) <= TOL
    assert rel(other, same) > 1e-3


class FamilyChecks:
    """The five checks of a family as test methods: a test module declares
    ``class TestFamily(FamilyChecks): config = staticmethod(make_config)`` (and ``cases``: more
    configs whose logits and base model are checked too; the last one also decodes)."""

    config: Callable[[], Any]
    cases: tuple[Callable[[], Any], ...] = ()
    tokens = 30

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            check_logits(make, n=self.tokens)

    def test_base_model_equals_transformers(self) -> None:
        for make in (self.config, *self.cases):
            check_base_model(make)

    def test_greedy_generation_identical(self) -> None:
        check_generation(self.config)

    def test_cached_decode_equals_full_forward(self) -> None:
        check_cached_decode(self.cases[-1] if self.cases else self.config)

    def test_saved_folder_loads(self, tmp_path: Path) -> None:
        check_folder(self.config, tmp_path)
