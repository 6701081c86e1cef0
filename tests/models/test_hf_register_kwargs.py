"""attnzoo.hf: every keyword a model hands the attention function is served or refused by name.

T5-family models pass their relative ``position_bias`` as a keyword; before, the attnzoo function
ignored it and the logits were off by 58-100%. The families here are built offline from tiny
random configs (weights perturbed so greedy decoding is not degenerate) and compared with
transformers' own ``eager`` and ``sdpa`` on the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo.hf as azhf  # noqa: E402

azhf.register()
T5_SIZES = dict(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def _t5() -> Any:
    return transformers.T5ForConditionalGeneration, transformers.T5Config(**T5_SIZES)


def _mt5() -> Any:
    return transformers.MT5ForConditionalGeneration, transformers.MT5Config(**T5_SIZES)


def _umt5() -> Any:
    return transformers.UMT5ForConditionalGeneration, transformers.UMT5Config(**T5_SIZES)


def _switch() -> Any:
    cfg = transformers.SwitchTransformersConfig(num_experts=2, expert_capacity=64, num_sparse_encoder_layers=1,
                                                num_sparse_decoder_layers=1, **T5_SIZES)
    return transformers.SwitchTransformersForConditionalGeneration, cfg


FAMILIES: dict[str, Callable[[], Any]] = {"t5": _t5, "mt5": _mt5, "umt5": _umt5, "switch": _switch}


def _model(family: str) -> Any:
    try:
        cls, cfg = FAMILIES[family]()
        torch.manual_seed(0)
        model = cls._from_config(cfg, attn_implementation="eager").eval()
    except (ImportError, OSError, AttributeError) as e:  # pragma: no cover - depends on transformers
        pytest.skip(f"transformers cannot build {family} offline: {e}")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a random T5 decodes one token forever; perturbed weights do not
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 96, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding of the encoder input
    return ids, mask, torch.randint(2, 96, (2, 7), generator=g)


def _run(model: Any, impl: str) -> tuple[torch.Tensor, list[list[int]]]:
    ids, mask, dec = _batch()
    model.set_attn_implementation(impl)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    return logits, tokens.tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_position_bias_families_match_eager_and_sdpa(family: str) -> None:
    model = _model(family)
    eager, eager_tokens = _run(model, "eager")
    peers = {"eager": (eager, eager_tokens)}
    if family != "switch":  # transformers declares no SDPA support for Switch-Transformers
        peers["sdpa"] = _run(model, "sdpa")
    for impl in ("attnzoo", "attnzoo_tiled", "attnzoo_reference"):
        zoo, tokens = _run(model, impl)
        for peer, (logits, peer_tokens) in peers.items():
            assert _rel(zoo, logits) < 1e-5, (impl, peer)
            assert tokens == peer_tokens, (impl, peer)


def test_the_t5_check_fails_when_the_bias_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: without position_bias (the old behaviour) it is far off."""
    model = _model("t5")
    eager, _ = _run(model, "eager")
    monkeypatch.setattr(azhf, "_with_bias", lambda extra, bias: None)
    zoo, _ = _run(model, "attnzoo")
    assert _rel(zoo, eager) > 1e-2


def test_t5_training_gradients_match_eager() -> None:
    """position_bias carries a gradient to the relative-attention embedding (a float-mask gradient)."""
    model = _model("t5").train()
    for mod in model.modules():  # no dropout: nn.Dropout layers and the attention's own rate
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
        elif isinstance(getattr(mod, "dropout", None), float):
            mod.dropout = 0.0
    ids, mask, dec = _batch()
    grads = {}
    for impl in ("eager", "attnzoo"):
        model.zero_grad()
        model.set_attn_implementation(impl)
        model(input_ids=ids, attention_mask=mask, labels=dec).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads["attnzoo"].keys()
    for name, g in grads["eager"].items():
        assert _rel(grads["attnzoo"][name], g) < 1e-4, name
    assert any("relative_attention_bias" in n for n in grads["eager"])


class _Module(torch.nn.Module):
    is_causal = False


def _qkv(hq: int = 4, hkv: int = 2, nq: int = 5, nk: int = 7) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(2, h, n, 8, generator=g, dtype=torch.float64)
                 for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, add: torch.Tensor,
           sink: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over ``q k^T / sqrt(D) + add`` (and one sink logit per row): ``[B, Nq, Hq, Dv]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + add
    if sink is not None:
        s = torch.cat([s, sink.expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :k.shape[2]]
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("backend", ["auto", "tiled", "sdpa", "reference"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_position_bias_is_added_to_every_mask_kind(backend: str, mask_kind: str) -> None:
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(1, 4, 5, 7, generator=g, dtype=torch.float64)
    keep = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    keep[..., 0] = True
    mask = {"none": None, "bool": keep,
            "float": torch.zeros(2, 1, 5, 7, dtype=torch.float64).masked_fill(~keep, float("-inf"))}[mask_kind]
    add = bias if mask is None else bias.masked_fill(~keep, float("-inf"))
    dt, tol = (torch.float32, 1e-5) if backend == "sdpa" else (torch.float64, 1e-10)  # sdpa: no float64
    cast = [None if t is None else t.to(dt) if t.is_floating_point() else t for t in (q, k, v, mask, bias)]
    out, _ = azhf.attnzoo_attention_forward(_Module(), *cast[:4], backend=backend, position_bias=cast[4])
    torch.testing.assert_close(out.double(), _eager(q, k, v, add), rtol=tol, atol=tol)


def test_position_bias_with_a_structural_mask_and_padding() -> None:
    q, k, v = _qkv(nq=7)
    bias = torch.randn(1, 4, 7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, :2] = False
    hfmask = azhf.HFMask(causal=True, sliding_window=None, padding=pad, q_offset=0, q_length=7, kv_length=7)
    out, _ = azhf.attnzoo_attention_forward(_Module(), q, k, v, hfmask, position_bias=bias)
    add = bias.masked_fill(~hfmask.to_dense(), float("-inf"))
    real = pad[:, :, None, None].expand(2, 7, 4, 8)  # rows of real queries (out is [B, Nq, Hq, Dv])
    torch.testing.assert_close(out[real], _eager(q, k, v, add)[real], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", [(2, 4, 5, 1), (2, 4, 5)])
def test_per_query_sinks_match_the_softmax_with_one_more_logit(shape: tuple[int, ...]) -> None:
    q, k, v = _qkv()
    sink = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    for backend in ("auto", "tiled", "reference"):
        out, _ = azhf.attnzoo_attention_forward(_Module(), q, k, v, None, backend=backend, sinks=sink)
        want = _eager(q, k, v, torch.zeros(()), sink.reshape(2, 4, 5, 1))
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match="per-query sinks"):
        azhf.attnzoo_attention_forward(_Module(), q, k, v, None, backend="sdpa", sinks=sink)


def test_unknown_keyword_is_refused_by_name() -> None:
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=r"_Module passed 'indices'.*would be ignored"):
        azhf.attnzoo_attention_forward(_Module(), q, k, v, None, indices=torch.zeros(2, 5, 3))
    with pytest.raises(NotImplementedError, match="'block_indices', 'my_bias'"):
        azhf.attnzoo_attention_forward(_Module(), q, k, v, None, my_bias=1.0, block_indices=[0])
    with pytest.raises(TypeError, match="position_bias must be a float tensor"):
        azhf.attnzoo_attention_forward(_Module(), q, k, v, None, position_bias=torch.zeros(1, 4, 5, 7).long())


def test_neutral_keywords_and_none_values_change_nothing() -> None:
    q, k, v = _qkv()
    plain, _ = azhf.attnzoo_attention_forward(_Module(), q, k, v, None)
    same, _ = azhf.attnzoo_attention_forward(
        _Module(), q, k, v, None, position_ids=torch.arange(5)[None], use_cache=True,
        output_hidden_states=False, cu_seq_lens_q=None, indices=None, s_aux=None, position_bias=None)
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
