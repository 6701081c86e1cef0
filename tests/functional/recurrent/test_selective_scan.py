"""``attnzoo.selective_scan`` (Mamba-1's scan) against a float64 token loop written from the
recurrence, independent of the library: outputs, last states, gradients, groups of ``B``/``C``,
packed sequences, chunk lengths, half inputs and the errors of bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnzoo as az

D64 = torch.float64


def _loop(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, z: Tensor | None,
          bias: Tensor | None, softplus: bool, h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """``h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t``, ``y_t = h_t . C_t + D u_t`` (times silu(z)), per channel."""
    b, inner, T = u.shape
    if B.dim() == 3:
        B, C = B[:, None], C[:, None]
    group = torch.arange(inner) // (inner // B.shape[1])
    dt = delta + (0 if bias is None else bias[:, None])
    dt = F.softplus(dt) if softplus else dt
    h = torch.zeros(b, inner, A.shape[1], dtype=u.dtype) if h0 is None else h0
    ys = []
    for t in range(T):
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * B[:, group, :, t]
        y = (h * C[:, group, :, t]).sum(-1)
        ys.append(y if D is None else y + D * u[:, :, t])
    y = torch.stack(ys, dim=-1)
    return (y if z is None else y * F.silu(z)), h


def _inputs(b: int = 2, inner: int = 6, T: int = 37, N: int = 5, groups: int | None = None, seed: int = 0,
            dtype: torch.dtype = D64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    bc = (b, N, T) if groups is None else (b, groups, N, T)
    return {"u": r(b, inner, T), "delta": r(b, inner, T), "A": -torch.rand(inner, N, generator=g, dtype=dtype) * 3,
            "B": r(*bc), "C": r(*bc), "D": r(inner), "z": r(b, inner, T), "delta_bias": r(inner)}


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
@pytest.mark.parametrize("groups", [None, 1, 3])
@pytest.mark.parametrize("options", ["all", "bare"])
def test_equals_the_token_loop(groups: int | None, options: str, form: str) -> None:
    x = _inputs(groups=groups)
    if options == "bare":  # no D, no gate, no bias, no softplus (delta made positive), no initial state
        x.update(D=None, z=None, delta_bias=None, delta=x["delta"].abs())
        h0, softplus = None, False
    else:
        h0, softplus = torch.randn(2, 6, 5, dtype=D64), True
    y, h = az.selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], delta_bias=x["delta_bias"],
                             delta_softplus=softplus, initial_state=h0, return_last_state=True, form=form)
    ry, rh = _loop(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], softplus, h0)
    torch.testing.assert_close(y, ry, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, rh, rtol=1e-12, atol=1e-12)


def test_gradients_equal_the_token_loop() -> None:
    x = _inputs(T=21, groups=2, inner=4)
    leaves = {k: v.requires_grad_() for k, v in x.items()}
    h0 = torch.randn(2, 4, 5, dtype=D64, requires_grad=True)
    y, h = az.selective_scan(**leaves, delta_softplus=True, initial_state=h0, return_last_state=True)
    w1, w2 = torch.randn_like(y), torch.randn_like(h)
    ours = torch.autograd.grad((y * w1).sum() + (h * w2).sum(), [*leaves.values(), h0])
    ry, rh = _loop(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"], leaves["D"], leaves["z"],
                   leaves["delta_bias"], True, h0)
    ref = torch.autograd.grad((ry * w1).sum() + (rh * w2).sum(), [*leaves.values(), h0])
    for name, a, b in zip([*leaves, "initial_state"], ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("chunk", [1, 5, 16, 32, 64])  # the chunked scan against the loop
def test_every_chunk_length_gives_the_same_scan(chunk: int) -> None:
    x = _inputs(T=70)
    ref = az.selective_scan(**x, delta_softplus=True, form="recurrent")
    torch.testing.assert_close(az.selective_scan(**x, delta_softplus=True, chunk_size=chunk, form="chunked"), ref,
                               rtol=1e-12, atol=1e-12)


def test_auto_loops_without_gradients_and_chunks_with_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import attnzoo.functional.recurrent.selective_scan as module

    forms: list[str] = []
    real = module._scan

    def spy(*args: Any, **kw: Any) -> Any:
        forms.append(kw["form"])
        return real(*args, **kw)

    monkeypatch.setattr(module, "_scan", spy)
    x = _inputs(T=9)
    az.selective_scan(**x, delta_softplus=True)
    x["u"].requires_grad_()
    az.selective_scan(**x, delta_softplus=True)
    with torch.no_grad():
        az.selective_scan(**x, delta_softplus=True)
    assert forms == ["recurrent", "chunked", "recurrent"]


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_packed_sequences_equal_each_alone(form: str) -> None:
    lengths = [7, 1, 0, 12]
    x = _inputs(b=1, T=sum(lengths), groups=2)
    h0 = torch.randn(len(lengths), 6, 5, dtype=D64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    y, h = az.selective_scan(**x, delta_softplus=True, initial_state=h0, return_last_state=True, cu_seqlens=cu,
                             form=form)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if s == e:  # an empty sequence keeps its initial state
            torch.testing.assert_close(h[i], h0[i], rtol=0, atol=0)
            continue
        part = {k: (v[..., s:e] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
        ay, ah = az.selective_scan(**part, delta_softplus=True, initial_state=h0[i:i + 1], return_last_state=True)
        torch.testing.assert_close(y[..., s:e], ay, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h[i:i + 1], ah, rtol=1e-12, atol=1e-12)


def test_half_input_computes_in_float32() -> None:
    x = _inputs(dtype=torch.float32)
    ref = az.selective_scan(**x, delta_softplus=True)
    half = az.selective_scan(**{k: v.bfloat16() for k, v in x.items()}, delta_softplus=True)
    assert half.dtype == torch.bfloat16
    err = ((half.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err


@pytest.mark.parametrize(("change", "match"), [
    ({"A": torch.zeros(5, 5)}, "A must be"),
    ({"A": torch.zeros(6, 4)}, "B must be"),
    ({"B": torch.zeros(2, 5, 36)}, "B must be"),
    ({"C": torch.zeros(2, 4, 5, 37)}, "C must be"),
    ({"D": torch.zeros(5)}, "D must be"),
    ({"delta_bias": torch.zeros(7)}, "delta_bias must be"),
    ({"delta": torch.zeros(2, 6, 36)}, "delta must be"),
    ({"delta": None}, "delta must be"),
    ({"z": torch.zeros(1, 6, 37)}, "z must be"),
    ({"initial_state": torch.zeros(2, 6, 4)}, "initial_state must be"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"form": "loop"}, "form"),
    ({"u": torch.zeros(2, 6)}, "u must have shape"),
    ({"u": torch.zeros(2, 6, 0)}, "u must have shape"),
    ({"cu_seqlens": torch.tensor([0, 5, 30], dtype=torch.int32)}, "cu_seqlens"),
])
def test_bad_input_names_the_argument(change: dict[str, Any], match: str) -> None:
    x = {**_inputs(dtype=torch.float32), **change}
    with pytest.raises(ValueError, match=match):
        az.selective_scan(**x)


def test_wrong_types_name_the_argument() -> None:
    x = _inputs(dtype=torch.float32)
    with pytest.raises(TypeError, match="B must be a tensor"):
        az.selective_scan(**{**x, "B": [1.0]})
    with pytest.raises(TypeError, match="u must be a floating-point tensor"):
        az.selective_scan(**{**x, "u": x["u"].long()})
    with pytest.raises(TypeError, match="delta_softplus"):
        az.selective_scan(**x, delta_softplus="yes")


def test_a_growing_state_is_refused_by_name() -> None:
    x = _inputs(dtype=torch.float32)  # delta ~ N(0, 1) without the softplus: some steps are negative
    with pytest.raises(ValueError, match=r"dt \* A must be <= 0"):
        az.selective_scan(**x)
    with pytest.raises(ValueError, match=r"dt \* A must be <= 0"):  # positive steps, a positive A entry
        az.selective_scan(**{**x, "A": x["A"].abs()}, delta_softplus=True)
    with pytest.raises(ValueError, match="must be finite"):
        az.selective_scan(**{**x, "delta": x["delta"].clone().fill_(float("nan"))}, delta_softplus=True)
