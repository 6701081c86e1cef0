"""attnzoo.check: the grid passes on correct backends and catches broken ones."""

from __future__ import annotations

import pytest
import torch

import attnzoo.functional.backends.sdpa as sdpa_mod
from attnzoo.check import backend_cases, check_backends, check_models, check_variants, run_checks

FAST = ["reference", "sdpa", "tiled"]


def _rows(rows):
    return {(r.target, r.setting): r for r in rows}


def test_quick_grid_passes_on_the_exact_backends() -> None:
    rows = check_backends(FAST, ("float32", "bfloat16"), quick=True)
    bad = [(r.target, r.setting, r.failures[:2]) for r in rows if not r.passed]
    assert not bad, bad
    by = _rows(rows)
    for b in FAST:
        assert by[(b, "float32")].cases > 0
        # the bf16 tolerance follows bf16's real error: errors are far above float32's, yet pass
        assert by[(b, "bfloat16")].max_err > 100 * by[(b, "float32")].max_err


def test_unsupported_features_are_skipped_not_passed() -> None:
    rows = _rows(check_backends(["sdpa"], ("float32",), grad=False))
    row = rows[("sdpa", "float32")]
    # softcap and return_lse cases: sdpa cannot serve them
    assert row.skipped >= 2
    assert row.cases + row.skipped == len(backend_cases())


def test_a_wrong_backend_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sdpa_mod.sdpa_attention

    def off_by_a_little(r):
        return real(r) * (1 + 1e-3)

    monkeypatch.setattr(sdpa_mod, "sdpa_attention", off_by_a_little)
    rows = _rows(check_backends(["sdpa", "reference"], ("float32",), quick=True, grad=False))
    assert not rows[("sdpa", "float32")].passed
    assert "error" in rows[("sdpa", "float32")].failures[0]
    assert rows[("reference", "float32")].passed


def test_nan_on_empty_rows_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sdpa_mod.sdpa_attention

    def nan_rows(r):
        out = real(r)
        allowed = r.allowed(0, r.nq, 0, r.nk)
        if allowed is None:
            return out
        empty = ~allowed.any(dim=-1, keepdim=True)
        return out.masked_fill(empty, float("nan"))

    monkeypatch.setattr(sdpa_mod, "sdpa_attention", nan_rows)
    rows = _rows(check_backends(["sdpa"], ("float32",), quick=True, grad=False))
    assert not rows[("sdpa", "float32")].passed


def test_wrong_gradients_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sdpa_mod.sdpa_attention

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.01

    monkeypatch.setattr(sdpa_mod, "sdpa_attention", lambda r: Scale.apply(real(r)))
    rows = _rows(check_backends(["sdpa"], ("float32",), quick=True, grad=True))
    row = rows[("sdpa", "float32")]
    assert not row.passed
    assert any(" dq" in f or " dk" in f or " dv" in f for f in row.failures)


def test_variants_decode_and_backends() -> None:
    rows = check_variants(["mha", "gqa", "sliding"], backends=FAST)
    bad = [(r.target, r.setting, r.failures[:2]) for r in rows if not r.passed]
    assert not bad, bad
    settings = {(r.target, r.setting) for r in rows}
    assert ("sliding", "decode == full") in settings and ("gqa", "backends == reference") in settings


def test_broken_decoding_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnzoo.nn.attention import MultiHeadAttention

    real = MultiHeadAttention.forward

    def noisy(self, x, *a, cache=None, **kw):
        y = real(self, x, *a, cache=cache, **kw)
        return y + 1e-3 if cache is not None else y

    monkeypatch.setattr(MultiHeadAttention, "forward", noisy)
    rows = check_variants(["mha"], backends=["reference"])
    decode = next(r for r in rows if r.setting == "decode == full")
    assert not decode.passed


def test_run_checks_report_is_json_ready() -> None:
    import json

    rep = run_checks(backends=["reference"], dtypes=("float32",), quick=True, include_variants=False,
                     include_models=False)
    d = json.loads(json.dumps(rep.as_dict()))
    assert d["ok"] is True and d["rows"][0]["target"] == "reference"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [({"backends": ["magic"]}, "backend"), ({"dtypes": ["int8"]}, "dtype"), ({"device": "banana"}, "device")],
)
def test_bad_input(kwargs, words) -> None:
    with pytest.raises(ValueError, match=words):
        check_backends(**{"backends": ["reference"], **kwargs})


def test_unknown_variant() -> None:
    with pytest.raises(ValueError, match="variant"):
        check_variants(["nope"])


def test_approximate_variants_within_their_stated_error() -> None:
    rows = check_variants(["local_global", "linear", "performer", "infini"], backends=["reference"])
    bad = [(r.target, r.setting, r.failures[:2]) for r in rows if not r.passed]
    assert not bad, bad
    settings = {(r.target, r.setting) for r in rows}
    assert ("linear", "forms == formula") in settings
    assert any(t == "performer" and s.startswith("error <=") for t, s in settings)
    assert ("infini", "decode == full") in settings


def test_a_biased_performer_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import attnzoo as az
    from attnzoo.check import _check_performer

    real = az.performer_attention
    monkeypatch.setattr(az, "performer_attention", lambda *a, **k: real(*a, **k) + 0.5)
    assert not _check_performer(0).passed


def test_decoder_models_decode_like_the_full_forward() -> None:
    rows = check_models(["gqa"])
    assert len(rows) == 1 and rows[0].passed and rows[0].cases == 2, rows[0].failures


def test_backends_are_checked_against_the_independent_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's truth is attnzoo.oracle (no code shared with the backends), not the reference backend:
    every case's float64 truth comes from it, and the reference backend is then checked like any other."""
    import attnzoo.check as check_mod

    real, calls = check_mod.oracle_attention, []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(check_mod, "oracle_attention", counted)
    rows = _rows(check_backends(["reference"], ("float32",), quick=True, grad=False))
    assert rows[("reference", "float32")].passed
    n_cases = sum(1 for c in check_mod.backend_cases() if c.quick)
    assert len(calls) >= n_cases


def test_the_grid_catches_a_wrong_lse_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose LSE has the right value but a negated gradient (a flipped d_lse term in a
    backward) passed the grid when only <out, dout> was differentiated."""
    import attnzoo.check as check_mod

    real = check_mod.attention

    def negated_lse_gradient(*args: object, **kwargs: object) -> object:
        res = real(*args, **kwargs)
        if kwargs.get("return_lse"):
            out, lse = res
            return out, 2 * lse.detach() - lse  # the same values, the gradient negated
        return res

    monkeypatch.setattr(check_mod, "attention", negated_lse_gradient)
    rows = check_backends(["reference"], ("float32",))
    assert not rows[0].passed
    assert any("return_lse causal" in f and " dq:" in f for f in rows[0].failures), rows[0].failures[:3]
