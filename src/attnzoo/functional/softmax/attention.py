"""``attention()``: one exact softmax attention with several backends, and ``merge_attention()``.

Semantics (shapes, alignment, windows, empty rows, GQA head mapping, dtypes) are written once in
``docs/conventions.md``; this module follows them exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import attnzoo.functional.backends.decode as decode
import attnzoo.functional.backends.flash as flash
import attnzoo.functional.backends.flex as flex
import attnzoo.functional.backends.reference as reference
import attnzoo.functional.backends.sdpa as sdpa
import attnzoo.functional.backends.tiled as tiled
from attnzoo._devices import tracing
from attnzoo.functional.backends.reference_ops import reference_op_attention
from attnzoo.functional.backends.tiled.native import prefer_over_sdpa
from attnzoo.functional.backends.tiled_ops import tiled_op_attention, traceable_visible_fraction
from attnzoo.functional.core._edge import empty_result, guard_nonfinite, is_empty
from attnzoo.functional.core._request import AttnRequest, Capabilities, build_request
from attnzoo.functional.core.rules import compute_dtype
from attnzoo.functional.softmax.sinks import sink_attention
from attnzoo.masks import Mask

__all__ = ["BACKENDS", "attention", "available_backends", "choose_backend", "merge_attention"]

#: Every backend's own declaration of what it can do, in the order ``BACKENDS`` lists them.
CAPABILITIES: dict[str, Capabilities] = {c.name: c for c in (
    reference.CAPABILITIES, sdpa.CAPABILITIES, tiled.CAPABILITIES, flex.CAPABILITIES, flash.CAPABILITIES)}

BACKENDS = tuple(CAPABILITIES)

# Window/mask sparsity from which the tiled backend beats a dense fused kernel, and the score-matrix
# size below which a dense kernel wins anyway (Python overhead per tile); see docs/backends.md.
_SPARSE_FRACTION = 0.5
_SPARSE_MIN_SCORES = 1 << 20


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on ``device`` in this environment (none on a device this machine lacks)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"available_backends: device must be a torch.device or a device string such as 'cpu' "
                         f"or 'cuda:0', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        return []
    return [name for name, caps in CAPABILITIES.items() if caps.available(dev)]


def _missing(r: AttnRequest, backend: str) -> set[str]:
    return CAPABILITIES[backend].missing(r)


def _visible_fraction(r: AttnRequest, block: int = 128) -> float:
    """Fraction of tiles the tiled backend must visit (1.0 = dense)."""
    if tracing():  # plans read tensor data; a compiled graph decides from sizes
        return traceable_visible_fraction(r, block)
    plan = tiled.tile_plan(r, block, block)
    total = plan.n_q_blocks * plan.n_k_blocks
    return plan.n_tiles / max(1, total)


def choose_backend(r: AttnRequest) -> str:
    """The ``auto`` policy (documented in ``docs/backends.md``; tested in ``tests/test_auto.py``).

    1. ``return_weights`` or float64 -> ``reference`` (only it returns weights; it is the float64 oracle).
    2. CUDA, half precision, flash-attn installed, and nothing flash lacks -> ``flash``.
    3. Dropout -> ``sdpa`` (``reference`` if sdpa lacks a feature, e.g. softcap).
    4. ``return_lse``, ``softcap`` or a ``score_mod`` -> ``tiled`` (``reference`` if tiled lacks a
       feature, e.g. a float-mask or ALiBi gradient).
    5. A window or mask that hides at least half of the 128 x 128 tiles of a score matrix of at
       least 2^20 entries -> ``tiled`` (it skips them; a dense kernel computes every score).
    6. Otherwise -> ``sdpa``; for float16/bfloat16 on CPU it runs natively or through float32
       math where half matmuls were measured >= 1.25x slower (``attnzoo.functional.backends.halfmath``).
       With the optional compiled kernels built, float32 CPU requests they serve from 128 keys go to
       ``tiled`` (which runs them) where the kernel was measured on this CPU at <= 0.9x SDPA's time
       (``attnzoo.functional.backends.tiled.native.prefer_over_sdpa``; ``ATTNZOO_NATIVE_AUTO``).

    Whatever rule picks a backend that lacks a feature of the request (e.g. ``softcap`` with a
    float-mask gradient), ``tiled`` serves it if it can, else ``reference``: ``auto`` never
    refuses a valid request.
    """
    name = _first_choice(r)
    if name != "reference" and _missing(r, name):
        return "tiled" if not _missing(r, "tiled") else "reference"
    if name == "sdpa" and not tracing():
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v))
        if prefer_over_sdpa(r, training):  # the compiled kernel, where built and measured faster here
            return "tiled"
    return name


def _first_choice(r: AttnRequest) -> str:
    feats = r.features()
    if "return_weights" in feats or "float64" in feats:
        return "reference"
    dev = r.q.device
    if flash.CAPABILITIES.available(dev) and not _missing(r, "flash"):
        return "flash"
    if "dropout" in feats:
        return "sdpa" if not _missing(r, "sdpa") else "reference"
    if "return_lse" in feats or "softcap" in feats or "score_mod" in feats:
        return "tiled" if not _missing(r, "tiled") else "reference"
    if (r.structure is not None and r.nq * r.nk >= _SPARSE_MIN_SCORES
            and _visible_fraction(r) <= 1.0 - _SPARSE_FRACTION):
        return "tiled"
    return "sdpa"


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | Mask | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    q_offset: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    return_weights: bool = False,
    backend: str = "auto",
    sinks: Tensor | None = None,
    score_mod: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """Exact scaled dot-product attention.

    Args:
        q: queries ``[B, Hq, Nq, D]``.
        k: keys ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0``; query head ``h`` reads KV head
            ``h // (Hq // Hkv)`` (GQA/MQA without copying K/V on the fast paths).
        v: values ``[B, Hkv, Nk, Dv]``.
        mask: bool (True = may attend) or float (additive bias) tensor broadcastable to
            ``[B, Hq, Nq, Nk]``, or an :class:`attnzoo.masks.Mask`.
        causal: key ``j`` visible to the query at position ``p`` iff ``j <= p``.
        window: ``w`` or ``(left, right)``: key ``j`` visible iff ``p - left <= j <= p + right``;
            ``None`` on a side = unbounded.
        q_offset: position of the first query; default ``Nk - Nq`` (bottom-right alignment).
        scale: score scale, default ``1 / sqrt(D)``.
        softcap: ``s -> softcap * tanh(s / softcap)`` applied to scaled scores before biases/masks.
        alibi_slopes: ``[Hq]``; adds ``-slope * |q_pos - k_pos|`` to the scores.
        dropout_p: dropout on the attention weights (training only; you pass 0 at eval).
        return_lse: also return the log-sum-exp of the visible scores ``[B, Hq, Nq]`` (float32,
            ``-inf`` for rows with no visible key).
        return_weights: also return the weights ``[B, Hq, Nq, Nk]`` (``reference`` backend only).
        backend: ``"auto" | "reference" | "sdpa" | "tiled" | "flex" | "flash"``.
        sinks: ``[Hq]`` sink logits (gpt-oss): each row's softmax also counts ``exp(sinks[h])``,
            whose column is dropped; the LSE includes it. See ``attnzoo.functional.softmax.sinks``.
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's signature) applied
            to the scaled (and soft-capped) scores before ALiBi, float masks and hidden keys;
            ``score [B, Hq, bq, bk]`` float32 (float64 for float64 inputs) for one tile and int64
            index tensors broadcastable to it, at absolute positions (queries ``q_offset ..``,
            keys ``0 ..``). Gradients reach the tensors it captures; served by ``reference``,
            ``tiled`` (memory linear in N, forward and backward) and ``flex``. See
            ``docs/score-mod.md``.

    Returns:
        ``out [B, Hq, Nq, Dv]`` in q's dtype; with ``return_lse``/``return_weights`` a tuple
        ``(out, lse)``, ``(out, weights)`` or ``(out, lse, weights)``. A query with no visible
        key returns zeros. Full semantics: ``docs/conventions.md``.

    Raises:
        ValueError / TypeError naming the offending argument; ``ValueError`` when a named backend
        cannot serve a feature of the request.
    """
    r = build_request(q, k, v, mask=mask, causal=causal, window=window, q_offset=q_offset, scale=scale,
                      softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                      return_lse=return_lse, return_weights=return_weights, score_mod=score_mod)
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(f"backend must be one of {('auto', *BACKENDS)}, got {backend!r}")
    if sinks is not None:
        return sink_attention(r, sinks, backend, choose_backend, _guarded_run)
    name = choose_backend(r) if backend == "auto" else backend
    if backend == "auto" and decode.use_split_kv(r, name):  # decoding: decode.py
        return guard_nonfinite(r, decode.run_split_kv)
    return _guarded_run(r, name)


def _guarded_run(r: AttnRequest, name: str) -> Tensor | tuple[Tensor, ...]:
    """``run_backend`` such that hidden non-finite keys/values never reach a row (``_edge``)."""
    return guard_nonfinite(r, lambda clean: run_backend(clean, name), fused=name not in ("reference", "tiled"))


_UNAVAILABLE = {
    "flex": "backend 'flex' is not available on {device} with torch {torch}",
    "flash": "backend 'flash' needs CUDA and the flash-attn package (pip install flash-attn)",
}


def run_backend(r: AttnRequest, name: str) -> Tensor | tuple[Tensor, ...]:
    """Run a validated request on a named backend (raises if the backend lacks a feature)."""
    missing = _missing(r, name)
    if missing:
        raise ValueError(f"backend {name!r} does not support: {', '.join(sorted(missing))} "
                         f"(use backend='auto' or 'reference')")
    if not CAPABILITIES[name].available(r.q.device):
        raise ValueError(_UNAVAILABLE[name].format(device=r.q.device, torch=torch.__version__))
    lse: Tensor | None = None
    weights: Tensor | None = None
    if is_empty(r):  # no keys, queries or batch: zeros and LSE -inf, no kernel runs
        out, lse, weights = empty_result(r)
    elif name == "reference" and tracing() and r.score_mod is None:
        out, lse, weights = reference_op_attention(r)  # one custom operator per direction
    elif name == "reference":
        out, lse, weights = reference.reference_attention(r)
    elif name == "sdpa":
        out = sdpa.sdpa_attention(r)
    elif name == "tiled" and tracing() and r.score_mod is None:
        out, lse = tiled_op_attention(r)  # one custom operator per direction (no unrolled loops)
    elif name == "tiled" and tracing():
        # A score_mod cannot cross a custom operator, and its captured tensors are found by an eager
        # probe: compiled, it is traced densely (exact, gradients by autograd; O(Nq x Nk) memory).
        out, lse, _ = reference.reference_attention(r)
    elif name == "tiled":
        out, lse = tiled.tiled_attention(r)
    elif name == "flex":
        out, lse = flex.flex_attention_backend(r)
    else:
        out, lse = flash.flash_attention_backend(r)
    extras: list[Tensor] = []
    if r.return_lse:
        assert lse is not None
        extras.append(lse)
    if r.return_weights:
        assert weights is not None
        extras.append(weights)
    return (out, *extras) if extras else out


def merge_attention(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Combine attention over disjoint key sets into attention over their union.

    Args:
        outs: partial outputs ``[B, H, Nq, Dv]``, each normalised over its own keys.
        lses: their log-sum-exps ``[B, H, Nq]`` (``-inf`` where a part saw no key).

    Returns:
        ``(out [B, H, Nq, Dv], lse [B, H, Nq])``: ``out = sum_i exp(lse_i - lse) * out_i`` with
        ``lse = logsumexp_i lse_i``. Rows no part could see stay zeros with LSE ``-inf``.
        Differentiable (what split-K decoding and ring attention need).
    """
    if not isinstance(outs, Sequence) or not isinstance(lses, Sequence) or len(outs) == 0:
        raise TypeError("merge_attention: outs and lses must be non-empty sequences of tensors")
    if len(outs) != len(lses):
        raise ValueError(f"merge_attention: got {len(outs)} outputs but {len(lses)} LSEs")
    ref_o = outs[0]
    for i, (o, s) in enumerate(zip(outs, lses, strict=True)):
        if not isinstance(o, Tensor) or not isinstance(s, Tensor):
            raise TypeError(f"merge_attention: item {i} is not a pair of tensors")
        if not o.is_floating_point() or not s.is_floating_point():
            raise TypeError(f"merge_attention: outs[{i}] and lses[{i}] must be floating-point tensors, got "
                            f"{o.dtype} and {s.dtype}")
        if o.dim() != 4 or o.shape != ref_o.shape:
            raise ValueError(f"merge_attention: outs[{i}] has shape {tuple(o.shape)}, expected "
                             f"{tuple(ref_o.shape)} [B, H, Nq, Dv]")
        if tuple(s.shape) != tuple(o.shape[:3]):
            raise ValueError(f"merge_attention: lses[{i}] has shape {tuple(s.shape)}, expected "
                             f"{tuple(o.shape[:3])} [B, H, Nq]")
    cdt = compute_dtype(ref_o.dtype)
    stacked_lse = torch.stack([s.to(cdt) for s in lses])  # [P, B, H, Nq]
    m = stacked_lse.amax(dim=0).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(stacked_lse - m)  # [P, B, H, Nq]; 0 for parts that saw nothing
    denom = w.sum(dim=0)
    lse = torch.log(denom) + m
    w = w / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = sum(wi.unsqueeze(-1) * o.to(cdt) for wi, o in zip(w, outs, strict=True))
    assert isinstance(out, Tensor)
    return out.to(ref_o.dtype), lse
