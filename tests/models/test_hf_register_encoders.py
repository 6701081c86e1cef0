"""transformers' encoders and vision towers with attnzoo's kernels (``attn_implementation="attnzoo"``, through
:func:`attnzoo.hf.register`) equal their eager model: every encoder family of the ``to_hf`` sweep
whose attention goes through transformers' attention interface, on a batch with right-padded,
left-padded and full rows. Families with their own attention code (DeBERTa's disentangled
attention, T5's and MPNet's relative bias) do not take an ``attn_implementation``: transformers
refuses it, and the test says so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo.hf as azhf  # noqa: E402
import hf_encoder_checks as ec  # noqa: E402
import hf_vision_checks as vc  # noqa: E402

azhf.register()
SWEEP = {"bert": lambda seed: ec.hf_encoder(transformers.BertConfig(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
    pad_token_id=ec.PAD), transformers.BertModel, seed), **ec.sweep()}
VISION = {k: v for k, v in vc.sweep().items() if k not in SWEEP}  # the vision towers (CLIP's text ones are above)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The query shapes of every call transformers makes to attnzoo's attention kernel."""
    seen: list[tuple[int, ...]] = []
    real = azhf.attention

    def counted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        seen.append(tuple(q.shape))
        return real(q, k, v, **kw)

    monkeypatch.setattr(azhf, "attention", counted)
    return seen


def _out(model: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The hidden states of a base model, the logits of a model with a head ``[B, N, *]`` / ``[B, L]``."""
    with torch.no_grad():
        r = model(input_ids=x, attention_mask=mask)
    return r.last_hidden_state if hasattr(r, "last_hidden_state") else r.logits


@pytest.mark.parametrize("model_type", sorted(SWEEP))
def test_attnzoo_kernels_equal_eager(model_type: str, calls: list[tuple[int, ...]]) -> None:
    eager = SWEEP[model_type](0)
    x, mask = ec.batch()
    want = _out(eager, x, mask)
    try:
        eager.set_attn_implementation("attnzoo")
    except (ValueError, NotImplementedError) as e:
        pytest.skip(f"{model_type}: transformers takes no attn_implementation here ({str(e)[:80]})")
    got = _out(eager, x, mask)
    if not calls:
        pytest.skip(f"{model_type}: its attention does not go through transformers' attention interface")
    err = ec.real_rel(got, want, mask) if got.dim() == 3 else ec.rel(got, want)
    assert err <= 1e-5, err


@pytest.mark.parametrize("model_type", sorted(VISION))
def test_attnzoo_kernels_equal_eager_in_vision_towers(model_type: str, calls: list[tuple[int, ...]]) -> None:
    model = VISION[model_type](0)
    images = vc.pixels(channels=getattr(model.config, "vision_config", model.config).num_channels)
    want = vc.hf_outputs(model, images)[1]
    model.set_attn_implementation("attnzoo")
    got = vc.hf_outputs(model, images)[1]
    assert calls, f"{model_type}: transformers did not call attnzoo's kernel"
    assert ec.rel(got, want) <= 1e-5
