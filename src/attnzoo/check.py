"""``attnzoo check``: every backend and every variant against an independent reference.

Two groups of checks, both callable from Python (:func:`run_checks`) and from the command line:

**Backends.** Every backend :func:`attnzoo.available_backends` lists runs a grid of cases (GQA
and MQA, ``Nq != Nk`` with bottom-right alignment, explicit ``q_offset``, windows, bool/float/
``Mask`` masks, key padding, documents, fully masked rows, softcap, ALiBi, ``Dv != D``, sizes
that cross tile boundaries) in float32, bfloat16 and float16. Outputs, the gradients of q, k and
v, and the LSE (where the backend returns it) are compared with the independent float64 oracle
(:mod:`attnzoo.oracle`: the conventions as plain torch ops, sharing no code with the backends).
The tolerance follows flash-attn's acceptance rule: a backend's error may be at most twice the
error of a *plain eager implementation in the same dtype* (matmuls in that dtype, torch's
softmax, no tricks) for outputs and LSE, three times for gradients, plus the rounding noise of
the dtype at the reference's magnitude (``2 max |fl(ref + 0.3) - 0.3 - ref|``, flash-attn's
``atol``). So a bf16 tolerance scales with bf16's real error. In float32 both errors are a few
ulps of accumulation noise whose ratio varies from seed to seed, so the factors double there.

A case a backend cannot serve (e.g. ``softcap`` on ``sdpa``) is counted as *skipped*, never as
passed. Fully masked rows must come out as zeros with finite gradients.

**Variants.** Every registered module (:mod:`attnzoo.variants`) whose code is present: decoding
token by token (and in chunks) through ``init_cache`` equals the full causal forward; exact
variants give the same output on every available backend as on the float64 reference; the
approximations stay within their stated error. Variants whose module is missing are reported
as ``missing``, which counts as a failure only with ``strict=True``.

**Models.** A 2-layer :class:`attnzoo.DecoderLM` per variant: decoding through its cache gives
the logits of the full forward pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import attnzoo as az
import attnzoo.masks as M
from attnzoo._devices import resolve_device
from attnzoo.functional.core._request import build_request
from attnzoo.functional.feature_maps.linear import linear_attention
from attnzoo.functional.softmax.attention import BACKENDS, attention, available_backends
from attnzoo.models import DecoderConfig, DecoderLM
from attnzoo.oracle import oracle_attention
from attnzoo.variants import VARIANTS, build_attention, variant_names

__all__ = [
    "BackendCase",
    "CheckReport",
    "CheckRow",
    "backend_cases",
    "check_backends",
    "check_models",
    "check_variants",
    "run_checks",
]

#: A backend's error may be this many times the plain eager implementation's: outputs and LSE
#: (flash-attn's rule), gradients (longer sums). In float32 both errors are accumulation noise of
#: a few ulps whose ratio varies from seed to seed, so the factors are doubled there.
OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
FP32_EXTRA = 2.0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# =========================================================================== results
@dataclass
class CheckRow:
    """One line of the report: a target (backend or variant) under one setting."""

    group: str  # "backend" | "variant"
    target: str  # backend name or variant name
    setting: str  # dtype for backends; what was checked for variants
    cases: int = 0
    skipped: int = 0
    max_err: float = 0.0  # largest absolute error seen
    max_ratio: float = 0.0  # largest error / tolerance (pass iff < 1 ... <= 1)
    failures: list[str] = field(default_factory=list)
    status: str = "ok"  # "ok" | "FAIL" | "missing" | "skipped"
    notes: set[str] = field(default_factory=set)  # e.g. "forward only: gradients on CPU"

    @property
    def passed(self) -> bool:
        return self.status in ("ok", "skipped", "missing") and not self.failures

    def add(self, label: str, err: float, tol: float) -> None:
        """Record one comparison (``err`` may be NaN/inf, which fails)."""
        self.max_err = max(self.max_err, err) if math.isfinite(err) else math.inf
        ratio = err / tol if tol > 0 else (0.0 if err == 0 else math.inf)
        if not math.isfinite(ratio):
            ratio = math.inf
        self.max_ratio = max(self.max_ratio, ratio)
        if not ratio <= 1.0:
            self.failures.append(f"{label}: error {err:.3g} > tolerance {tol:.3g}")
            self.status = "FAIL"

    def fail(self, label: str) -> None:
        self.failures.append(label)
        self.status = "FAIL"

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "target": self.target, "setting": self.setting, "cases": self.cases,
                "skipped": self.skipped, "max_err": self.max_err, "max_ratio": self.max_ratio,
                "status": self.status, "passed": self.passed, "failures": list(self.failures),
                "notes": sorted(self.notes)}


@dataclass
class CheckReport:
    """All rows of a check run; ``ok`` is False if any row failed."""

    rows: list[CheckRow]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.passed for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "seconds": self.seconds, "rows": [r.as_dict() for r in self.rows]}


# =========================================================================== backend grid
@dataclass(frozen=True)
class BackendCase:
    """One attention call of the grid: shapes and the keyword arguments of ``attention``."""

    name: str
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dv: int
    kwargs: Callable[[torch.Generator], dict[str, Any]] = lambda g: {}
    quick: bool = False  # part of the quick grid


def _bool_mask_with_empty_rows(b: int, hq: int, nq: int, nk: int) -> Callable[[torch.Generator], dict[str, Any]]:
    def make(g: torch.Generator) -> dict[str, Any]:
        m = torch.rand(b, 1, nq, nk, generator=g) < 0.6
        m[:, :, 1] = False  # a fully masked row: zeros out, finite grads
        return {"mask": m}

    return make


def backend_cases() -> list[BackendCase]:
    """The grid of :func:`check_backends` (shapes are small: the whole grid runs in seconds)."""
    C = BackendCase
    return [
        C("dense", 2, 4, 4, 37, 37, 16, 16, quick=True),
        C("causal", 2, 4, 4, 64, 64, 16, 16, lambda g: {"causal": True}, quick=True),
        C("causal Nq<Nk (bottom-right)", 2, 4, 4, 5, 40, 16, 16, lambda g: {"causal": True}, quick=True),
        C("causal q_offset=3", 1, 2, 2, 10, 30, 16, 16, lambda g: {"causal": True, "q_offset": 3}),
        C("gqa 8/2 causal", 2, 8, 2, 50, 50, 16, 16, lambda g: {"causal": True}, quick=True),
        C("mqa 4/1 cross Dv!=D", 2, 4, 1, 33, 47, 16, 24),
        C("window (8,0) causal", 2, 4, 4, 70, 70, 16, 16, lambda g: {"causal": True, "window": (8, 0)},
          quick=True),
        C("window (5,3)", 1, 4, 2, 40, 40, 16, 16, lambda g: {"window": (5, 3)}),
        C("bool mask + empty row", 2, 4, 4, 20, 31, 16, 16, _bool_mask_with_empty_rows(2, 4, 20, 31), quick=True),
        C("float mask", 2, 4, 4, 24, 24, 16, 16,
          lambda g: {"mask": torch.randn(2, 1, 24, 24, generator=g)}),
        C("padding (key_padding)", 2, 4, 2, 37, 37, 16, 16,
          lambda g: {"mask": M.key_padding([37, 20]), "causal": True}, quick=True),
        C("padding, one empty sequence", 2, 2, 2, 12, 12, 16, 16, lambda g: {"mask": M.key_padding([12, 0])}),
        C("document & causal", 1, 4, 4, 48, 48, 16, 16,
          lambda g: {"mask": M.document(torch.tensor([0] * 10 + [1] * 25 + [2] * 13)) & M.causal()}),
        C("prefix_lm | global", 1, 2, 2, 40, 40, 16, 16,
          lambda g: {"mask": M.prefix_lm(6) | M.global_tokens([0, 17])}),
        C("softcap causal", 2, 4, 4, 33, 33, 16, 16, lambda g: {"causal": True, "softcap": 2.0}),
        C("alibi causal", 2, 4, 4, 33, 33, 16, 16,
          lambda g: {"causal": True, "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}),
        C("return_lse causal", 2, 4, 2, 29, 45, 16, 16, lambda g: {"causal": True, "return_lse": True}),
        C("tile-crossing gqa window", 1, 4, 2, 300, 300, 16, 16,
          lambda g: {"causal": True, "window": (100, 0)}),
        C("tile-crossing dense", 1, 2, 2, 280, 290, 16, 16, lambda g: {"causal": True}),
        # large scores (random inputs alone keep them within a few units): scale 2 takes these
        # q.k (std 4) to about +-30, where float16 tiles overflowed; scale 20 to about +-300 under a softcap
        C("large scores ~+-30 causal gqa", 2, 4, 2, 40, 40, 16, 16, lambda g: {"causal": True, "scale": 2.0},
          quick=True),
        C("huge scores ~+-300 softcap 50", 1, 4, 4, 33, 45, 16, 16,
          lambda g: {"causal": True, "scale": 20.0, "softcap": 50.0, "return_lse": True}),
        # cases a mutation test found missing: several key chunks with scores past the bound that lets
        # the tiled kernel skip the running maximum (its rescale), a window edge on a key tile's last
        # key, ALiBi on the band path of a tile-crossing window, softcap before ALiBi
        C("700 keys, score bound past 60 (online rescale)", 1, 2, 2, 130, 700, 16, 16,
          lambda g: {"causal": True, "scale": 2.0, "return_lse": True}),
        C("window (129,0): an edge on a tile's last key", 1, 2, 2, 300, 300, 16, 16,
          lambda g: {"causal": True, "window": (129, 0)}),
        C("alibi + tile-crossing window", 1, 4, 2, 300, 300, 16, 16,
          lambda g: {"causal": True, "window": (100, 0), "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}),
        C("softcap + alibi", 2, 4, 4, 40, 40, 16, 16,
          lambda g: {"causal": True, "softcap": 2.0, "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}),
    ]


def _ref_bits(t: Tensor, dtype: torch.dtype) -> float:
    """Rounding noise of ``dtype`` at the magnitude of ``t``: ``max |fl(t + 0.3) - 0.3 - t|``."""
    lo = t.detach().to(dtype)
    return float(((lo + 0.3) - 0.3 - lo).abs().max()) if t.numel() else 0.0


def _eager(q: Tensor, k: Tensor, v: Tensor, kwargs: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """A plain eager implementation in the inputs' dtype (the tolerance baseline).

    Matmuls run in q's dtype, the softmax is torch's (float32 inside for half inputs), masks and
    biases come from the same validated request the backends see. Returns ``(out, lse)``.
    """
    kw = {k_: v_ for k_, v_ in kwargs.items() if k_ != "return_lse"}
    r = build_request(q, k, v, mask=kw.get("mask"), causal=kw.get("causal", False), window=kw.get("window"),
                      q_offset=kw.get("q_offset"), scale=kw.get("scale"), softcap=kw.get("softcap"),
                      alibi_slopes=kw.get("alibi_slopes"), dropout_p=0.0, return_lse=False, return_weights=False)
    kk = k.repeat_interleave(r.group, dim=1)
    vv = v.repeat_interleave(r.group, dim=1)
    s = torch.matmul(q, kk.transpose(-1, -2)) * r.scale  # [B, Hq, Nq, Nk] in q's dtype
    if r.softcap is not None:
        s = torch.tanh(s / r.softcap) * r.softcap
    bias = r.bias(0, r.nq, 0, r.nk)
    if bias is not None:
        s = s + bias.to(s.dtype)
    allowed = r.allowed(0, r.nq, 0, r.nk)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows -> zeros
    lse = torch.logsumexp(s.float(), dim=-1)
    return torch.matmul(p.to(v.dtype), vv), lse


def _max_err(a: Tensor, b: Tensor) -> float:
    d = (a.double() - b.double()).abs()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float(d.max()) if d.numel() else 0.0


def _lse_err(a: Tensor, ref: Tensor) -> float:
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(a)):
        return math.inf
    return _max_err(a[fin], ref[fin]) if bool(fin.any()) else 0.0


@dataclass
class _Oracle:
    """The float64 reference of one case: output, LSE, gradients of q, k, v, and its empty rows."""

    out: Tensor
    lse: Tensor
    grads: list[Tensor]
    empty_rows: Tensor


@dataclass
class _Inputs:
    """One case's inputs in one dtype."""

    q: Tensor
    k: Tensor
    v: Tensor
    dout: Tensor
    kwargs: dict[str, Any]
    dlse: Tensor  # the LSE's share of the loss where a case returns it


def _grads(out: Tensor, lse: Tensor | None, leaves: list[Tensor], x: _Inputs) -> list[Tensor]:
    """Gradients of q, k, v of ``<out, dout>`` plus, where the case returns a finite LSE, ``<lse, dlse>``
    (so a wrong LSE gradient fails too)."""
    loss = (out * x.dout).sum()
    if lse is not None and x.kwargs.get("return_lse") and bool(torch.isfinite(lse).all()):
        loss = loss + (lse * x.dlse.to(lse.dtype)).sum()
    return list(torch.autograd.grad(loss, leaves))


def _case_inputs(case: BackendCase, seed: int, dev: torch.device) -> _Inputs:
    """float64 inputs of ``case`` on ``dev`` (seeded by ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    q64 = torch.randn(case.b, case.hq, case.nq, case.d, generator=g, dtype=torch.float64)
    k64 = torch.randn(case.b, case.hkv, case.nk, case.d, generator=g, dtype=torch.float64)
    v64 = torch.randn(case.b, case.hkv, case.nk, case.dv, generator=g, dtype=torch.float64)
    dout64 = torch.randn(case.b, case.hq, case.nq, case.dv, generator=g, dtype=torch.float64)
    kwargs = {k_: (v_.to(dev) if isinstance(v_, Tensor) else v_) for k_, v_ in case.kwargs(g).items()}
    dlse64 = torch.randn(case.b, case.hq, case.nq, generator=g, dtype=torch.float64)
    return _Inputs(q64.to(dev), k64.to(dev), v64.to(dev), dout64.to(dev), kwargs, dlse64.to(dev))


def _oracle(x: _Inputs, grad: bool) -> _Oracle:
    """The case through :func:`attnzoo.oracle.oracle_attention`: the conventions written as plain torch
    ops, sharing no code with the backends (not the library's own ``reference`` backend)."""
    leaves = [t.clone().requires_grad_(grad) for t in (x.q, x.k, x.v)]
    out, lse = oracle_attention(*leaves, **{k: v for k, v in x.kwargs.items() if k != "return_lse"})
    grads = _grads(out, lse, leaves, x) if grad else []
    lse = lse.detach()
    return _Oracle(out.detach(), lse, grads, ~torch.isfinite(lse))


def _tolerances(x: _Inputs, ref: _Oracle, dtype: torch.dtype, grad: bool) -> tuple[float, float, list[float]]:
    """Tolerances of output, LSE and gradients in ``dtype`` (see the module docstring)."""
    el = [t.clone().requires_grad_(grad) for t in (x.q, x.k, x.v)]
    e_out, e_lse = _eager(*el, x.kwargs)
    e_grads = _grads(e_out, e_lse, el, x) if grad else []
    extra = FP32_EXTRA if dtype == torch.float32 else 1.0
    tol_out = extra * OUT_FACTOR * _max_err(e_out.detach(), ref.out) + 2 * _ref_bits(ref.out, dtype)
    tol_lse = (extra * OUT_FACTOR * _lse_err(e_lse.detach(), ref.lse)
               + 2 * _ref_bits(ref.lse[~ref.empty_rows], torch.float32))
    tol_grads = [extra * GRAD_FACTOR * _max_err(eg, rg) + 2 * _ref_bits(rg, dtype)
                 for eg, rg in zip(e_grads, ref.grads, strict=True)]
    return tol_out, tol_lse, tol_grads


def _call_backend(b: str, x: _Inputs, with_grad: bool) -> tuple[Tensor, Tensor | None, list[Tensor]]:
    """Backend ``b`` on ``x``: output, LSE (when the case asks for it), gradients of q, k, v."""
    bl = [t.clone().requires_grad_(with_grad) for t in (x.q, x.k, x.v)]
    res = attention(*bl, **x.kwargs, backend=b)
    out, lse = (res if x.kwargs.get("return_lse") else (res, None))  # type: ignore[misc]
    grads = _grads(out, lse, bl, x) if with_grad else []
    return out.detach(), None if lse is None else lse.detach(), grads


def _run_backend(b: str, x: _Inputs, grad: bool, row: CheckRow, label: str
                 ) -> tuple[Tensor, Tensor | None, list[Tensor]] | None:
    """Backend ``b`` on ``x``, falling back to its forward when it refuses gradients.

    Returns None (and counts it in ``row``) when the backend cannot serve the case or raised.
    """
    try:
        try:
            return _call_backend(b, x, grad)
        except ValueError as exc:
            if "does not support" not in str(exc):
                raise
            if not grad:
                row.skipped += 1
                return None
            try:  # the backend refuses gradients here: check its forward only
                res = _call_backend(b, x, False)
            except ValueError as exc2:
                if "does not support" not in str(exc2):
                    raise
                row.skipped += 1
                return None
            row.notes.add(f"forward only: {str(exc).split('support:')[-1].split('(use')[0].strip()}")
            return res
    except Exception as exc:  # a crash is a failure of this backend, reported, not raised
        row.cases += 1
        row.fail(f"{label}: raised {type(exc).__name__}: {exc}")
        return None


def _compare(row: CheckRow, label: str, got: tuple[Tensor, Tensor | None, list[Tensor]], ref: _Oracle,
             tols: tuple[float, float, list[float]]) -> None:
    out, lse, grads = got
    tol_out, tol_lse, tol_grads = tols
    row.cases += 1
    row.add(f"{label} out", _max_err(out, ref.out), tol_out)
    if bool(ref.empty_rows.any()) and bool(out[ref.empty_rows].abs().max() != 0):
        row.fail(f"{label}: fully masked rows are not zeros")
    if lse is not None:
        row.add(f"{label} lse", _lse_err(lse.detach(), ref.lse), tol_lse)
    for nm, gb, rg, tg in zip("qkv", grads, ref.grads, tol_grads, strict=False):
        row.add(f"{label} d{nm}", _max_err(gb, rg), tg)


def _check_case(case: BackendCase, x64: _Inputs, names: list[str], dtypes: Sequence[str],
                rows: dict[tuple[str, str], CheckRow], grad: bool, progress: Callable[[str], None] | None) -> None:
    """One case of the grid on every backend and dtype (rows are filled in place)."""
    ref = _oracle(x64, grad)
    label = f"{case.name} [B={case.b} Hq={case.hq} Hkv={case.hkv} Nq={case.nq} Nk={case.nk}]"
    for dt in dtypes:
        dtype = DTYPES[dt]
        x = _Inputs(*(t.to(dtype) for t in (x64.q, x64.k, x64.v, x64.dout)), x64.kwargs, x64.dlse)
        tols = _tolerances(x, ref, dtype, grad)  # the baseline: a plain eager implementation in this dtype
        for b in names:
            row = rows[(b, dt)]
            if progress is not None:
                progress(f"{b} {dt} {case.name}")
            got = _run_backend(b, x, grad, row, label)
            if got is not None:
                _compare(row, label, got, ref, tols)


def check_backends(
    backends: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("float32", "bfloat16", "float16"),
    *,
    device: str | torch.device = "cpu",
    grad: bool = True,
    quick: bool = False,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[CheckRow]:
    """Run every backend over the case grid against the float64 reference.

    Args:
        backends: names to check; default :func:`attnzoo.available_backends` on ``device``.
        dtypes: any of ``"float32"``, ``"bfloat16"``, ``"float16"``.
        device: where the inputs live (``"cpu"``, ``"cuda"``).
        grad: also compare the gradients of q, k and v.
        quick: the quick subset of the grid (about a third).
        seed: RNG seed of the inputs.
        progress: called with a short label before each (backend, dtype, case).

    Returns:
        One :class:`CheckRow` per (backend, dtype).
    """
    dev = resolve_device(device)
    names = list(available_backends(dev)) if backends is None else list(backends)
    for n in names:
        if n not in BACKENDS:
            raise ValueError(f"backends: unknown backend {n!r}; expected some of {BACKENDS}")
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"dtypes: unknown dtype {dt!r}; expected some of {sorted(DTYPES)}")
    cases = [c for c in backend_cases() if c.quick or not quick]
    rows = {(b, dt): CheckRow("backend", b, dt) for b in names for dt in dtypes}
    for ci, case in enumerate(cases):
        _check_case(case, _case_inputs(case, seed + 1000 * ci, dev), names, dtypes, rows, grad, progress)
    out_rows = list(rows.values())
    for r in out_rows:
        if r.cases == 0 and r.status == "ok":
            r.status = "skipped"
    return out_rows


# =========================================================================== variant checks
def _try_build(name: str, dim: int, heads: int, **kw: Any) -> torch.nn.Module | None:
    try:
        return build_attention(name, dim, heads, **kw)
    except (ImportError, AttributeError):
        return None


def _decode_error(mod: torch.nn.Module, x: Tensor, chunk: int) -> float:
    """Max |full causal forward - cached forward fed ``chunk`` tokens at a time|."""
    full = mod(x)
    full = full[0] if isinstance(full, tuple) else full
    cache = mod.init_cache(x.shape[0], x.shape[1])  # type: ignore[operator]
    outs = []
    for s in range(0, x.shape[1], chunk):
        y = mod(x[:, s:s + chunk], cache=cache)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return _max_err(torch.cat(outs, dim=1), full)


#: float32 decode-vs-full tolerance (outputs are O(1); observed errors ~1e-7)
DECODE_TOL = 2e-5

#: Small settings so that 24 tokens wrap the sliding ring buffer, cross Infini segments and chunks:
#: each variant declares its own (``VariantSpec.check``).
def _check_settings(name: str) -> dict[str, Any]:
    return dict(VARIANTS[name].check)


def _decode_row(name: str, mod: torch.nn.Module, x: Tensor, progress: Callable[[str], None] | None) -> CheckRow:
    """Cached decoding (one token at a time over 12 tokens, then chunks of five) == the full forward."""
    batch, n_tok, dim = x.shape
    row = CheckRow("variant", name, "decode == full")
    for chunk in (1, 5):
        if progress is not None:
            progress(f"{name} decode chunk={chunk}")
        try:
            with torch.no_grad():
                # token by token over 12 tokens (wraps every test window/segment/chunk once)
                err = _decode_error(mod, x if chunk > 1 else x[:, :12], chunk)
        except Exception as exc:
            row.cases += 1
            row.fail(f"chunk={chunk}: raised {type(exc).__name__}: {exc}")
            continue
        row.cases += 1
        row.add(f"chunk={chunk} [B={batch} N={n_tok} C={dim}]", err, DECODE_TOL)
    return row


def _backends_row(name: str, mod: torch.nn.Module, x: Tensor, heads: int, backends: list[str], dev: torch.device,
                  progress: Callable[[str], None] | None) -> CheckRow:
    """An exact variant gives the float64 reference's output on every backend (same weights)."""
    dim = x.shape[-1]
    kw = _check_settings(name)
    row = CheckRow("variant", name, "backends == reference")
    ref_mod = _try_build(name, dim, heads, backend="reference", **kw)
    if ref_mod is None:
        row.status = "skipped"
        return row
    ref_mod.load_state_dict(mod.state_dict())
    ref_mod = ref_mod.to(dev).double().eval()
    with torch.no_grad():
        ref = ref_mod(x.double())
    for b in backends:
        if progress is not None:
            progress(f"{name} backend={b}")
        m_b = _try_build(name, dim, heads, backend=b, **kw)
        if m_b is None:
            continue
        m_b.load_state_dict(mod.state_dict())
        m_b = m_b.to(dev).eval()
        try:
            with torch.no_grad():
                y = m_b(x)
        except ValueError as exc:
            if "does not support" in str(exc):
                row.skipped += 1
                continue
            row.cases += 1
            row.fail(f"backend={b}: raised {exc}")
            continue
        row.cases += 1
        row.add(f"backend={b}", _max_err(y, ref), 1e-5 * max(1.0, float(ref.abs().max())))
    return row


def check_variants(
    variants: Sequence[str] | None = None,
    *,
    backends: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    strict: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[CheckRow]:
    """Check every registered variant's module (see the module docstring for what is checked).

    Args:
        variants: names (default: all of :func:`attnzoo.variants.variant_names`).
        backends: backends for the exact variants (default: all available).
        device: where to run.
        seed: RNG seed.
        strict: a variant whose module cannot be built counts as a failure.
        progress: called with a short label before each check.
    """
    names = variant_names() if variants is None else list(variants)
    for n in names:
        if n not in VARIANTS:
            raise ValueError(f"variants: unknown variant {n!r}; expected some of {variant_names()}")
    dev = resolve_device(device)
    bk = list(available_backends(dev)) if backends is None else list(backends)
    dim, heads, n_tok, batch = 32, 4, 24, 2
    rows: list[CheckRow] = []
    for name in names:
        torch.manual_seed(seed)
        mod = _try_build(name, dim, heads, **_check_settings(name))
        if mod is None:
            row = CheckRow("variant", name, "module", status="missing")
            if strict:
                row.fail(f"{name}: module not available")
            rows.append(row)
            continue
        mod = mod.to(dev).eval()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, n_tok, dim, generator=g).to(dev)  # [B, N, C]
        rows.append(_decode_row(name, mod, x, progress))
        if name in _APPROX_CHECKS:
            if progress is not None:
                progress(f"{name} approximation")
            rows.append(_APPROX_CHECKS[name](seed))
        if VARIANTS[name].exact:
            rows.append(_backends_row(name, mod, x, heads, bk, dev, progress))
    return rows


def check_models(
    variants: Sequence[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[CheckRow]:
    """A 2-layer :class:`attnzoo.DecoderLM` per variant: cached decoding (one token, then chunks
    of five) gives the logits of the full forward pass."""
    names = variant_names() if variants is None else list(variants)
    for n in names:
        if n not in VARIANTS:
            raise ValueError(f"variants: unknown variant {n!r}; expected some of {variant_names()}")
    dev = resolve_device(device)
    rows: list[CheckRow] = []
    for name in names:
        row = CheckRow("model", f"DecoderLM[{name}]", "decode == full")
        try:
            torch.manual_seed(seed)
            model = DecoderLM(config=DecoderConfig(61, 32, 2, 4, attention=name,
                                                 attention_kwargs=_check_settings(name) or None))
        except (ImportError, AttributeError):
            row.status = "missing"
            rows.append(row)
            continue
        except Exception as exc:
            row.fail(f"building DecoderLM(attention={name!r}) raised {type(exc).__name__}: {exc}")
            rows.append(row)
            continue
        model = model.to(dev).eval()
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 61, (2, 16), generator=g).to(dev)
        for chunk in (1, 5):
            if progress is not None:
                progress(f"DecoderLM[{name}] decode chunk={chunk}")
            toks = tokens if chunk > 1 else tokens[:, :12]
            row.cases += 1
            try:
                with torch.no_grad():
                    err = _decode_error(model, toks, chunk)
            except Exception as exc:
                row.fail(f"chunk={chunk}: raised {type(exc).__name__}: {exc}")
                continue
            row.add(f"chunk={chunk} [B=2 N={toks.shape[1]} C=32 L=2]", err, DECODE_TOL)
        rows.append(row)
    return rows


# =========================================================================== approximations
#: Stated error of FAVOR+ (Performer): mean |performer - softmax| / mean |softmax| <= this / sqrt(F)
#: for F random orthogonal features, D = 16, q and k entries of standard deviation 0.5 (measured
#: here: 1.7 / sqrt(F) at F = 16 up to 2.9 / sqrt(F) at F = 1024).
PERFORMER_ERROR_CONST = 4.0


def _linear_oracle(q: Tensor, k: Tensor, v: Tensor, causal: bool, eps: float = 1e-6) -> Tensor:
    """``phi(Q) phi(K)^T V / (phi(Q) phi(K)^T 1 + eps)`` with ``phi = elu + 1``, written out in full."""
    fq = torch.nn.functional.elu(q) + 1
    fk = torch.nn.functional.elu(k) + 1
    a = fq @ fk.transpose(-1, -2)  # [B, H, N, N]
    if causal:
        a = a.tril()
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def _check_linear(seed: int) -> CheckRow:
    """Linear attention is exact for its own definition: every form == the float64 formula."""
    row = CheckRow("variant", "linear", "forms == formula")
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        want = _linear_oracle(q, k, v, causal)
        forms = ("quadratic", "chunked", "recurrent") if causal else ("quadratic", "chunked")
        for form in forms:
            for dt, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
                try:
                    got = linear_attention(q.to(dt), k.to(dt), v.to(dt), causal=causal, form=form, chunk_size=5)
                except Exception as exc:
                    row.cases += 1
                    row.fail(f"causal={causal} form={form}: raised {type(exc).__name__}: {exc}")
                    continue
                row.cases += 1
                row.add(f"causal={causal} form={form} {dt}", _max_err(got, want), tol * max(1.0, float(want.abs().max())))
    return row


def _check_performer(seed: int) -> CheckRow:
    """FAVOR+ approaches softmax attention: error within PERFORMER_ERROR_CONST / sqrt(F), and shrinking."""
    row = CheckRow("variant", "performer", f"error <= {PERFORMER_ERROR_CONST:g}/sqrt(F)")
    g = torch.Generator().manual_seed(seed)
    q, k = (0.5 * torch.randn(2, 4, 48, 16, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 4, 48, 16, generator=g, dtype=torch.float64)
    for causal in (False, True):
        exact = az.attention(q, k, v, causal=causal, backend="reference")
        errs = {}
        for f in (64, 1024):
            w = az.draw_performer_projection(f, 16, seed=seed + f).double()
            out = az.performer_attention(q, k, v, w, causal=causal)
            err = float((out - exact).abs().mean() / exact.abs().mean())
            errs[f] = err
            row.cases += 1
            row.add(f"causal={causal} F={f} relative error", err, PERFORMER_ERROR_CONST / f**0.5)
        if not errs[1024] < errs[64] / 2:
            row.fail(f"causal={causal}: error does not shrink with F ({errs[64]:.3g} at F=64, {errs[1024]:.3g} at F=1024)")
    return row


_APPROX_CHECKS: dict[str, Callable[[int], CheckRow]] = {"linear": _check_linear, "performer": _check_performer}


# =========================================================================== everything
def run_checks(
    *,
    backends: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("float32", "bfloat16", "float16"),
    variants: Iterable[str] | None = None,
    include_variants: bool = True,
    include_models: bool = True,
    device: str | torch.device = "cpu",
    quick: bool = False,
    grad: bool = True,
    strict: bool = False,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> CheckReport:
    """Backends over the case grid, then (optionally) every variant module and a small decoder
    per variant. See the module doc."""
    t0 = time.perf_counter()
    variants = None if variants is None else list(variants)
    rows = check_backends(backends, dtypes, device=device, grad=grad, quick=quick, seed=seed, progress=progress)
    if include_variants:
        rows += check_variants(None if variants is None else list(variants), backends=backends, device=device,
                               seed=seed, strict=strict, progress=progress)
    if include_models:
        rows += check_models(None if variants is None else list(variants), device=device, seed=seed,
                             progress=progress)
    return CheckReport(rows, time.perf_counter() - t0)
