"""Long-context cost of every variant: one attention layer's forward and decode step from 1k to 64k.

At the arena's training lengths (a few hundred tokens) the efficient variants show no benefit;
this is where they win. For each variant one layer at the arena's width and heads, batch 1, is
timed at ``N = 1k, 2k, ... 64k``: a forward over ``N`` tokens (no autograd) and one decode step
with ``N`` tokens in the cache. Measuring stops for a variant once the next length is predicted to
take longer than ``cap_s``; beyond it the numbers come from the cost model (the spec's cost
function): forward time scaled by its FLOPs, decode time by the bytes a step reads (weights +
cache). Every point says whether it was ``measured`` or ``model``. Memory: the forward's
activation bytes and the decode cache bytes from the cost function (exact formulas), with the
measured cache bytes where the cache was built.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from attnzoo.arena.measure import cache_bytes
from attnzoo.cost import estimate
from attnzoo.variants import VARIANTS, build_attention, layer_pattern

__all__ = ["LENGTHS", "QUICK_LENGTHS", "crossings", "layer_settings", "long_context"]

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_LENGTHS = (64, 128, 256)
_DECODE_STEPS = 8


def layer_settings(variant: str, width: int, heads: int, window: int | None) -> dict[str, Any]:
    """The variant's arena settings that its cost function understands (its spec's ``options``)."""
    spec = VARIANTS[variant]
    return {k: v for k, v in spec.arena_settings(width, heads, window).items() if k in spec.options}


def _model_point(variant: str, n: int, width: int, heads: int, settings: dict[str, Any]) -> dict[str, float]:
    e = estimate(variant, n, width, heads, dtype="float32", **settings)
    param_bytes = 4 * e.params
    return {"flops": float(e.flops), "activation_bytes": float(e.activation_bytes),
            "cache_bytes": float(e.kv_cache_bytes), "step_bytes": float(param_bytes + e.kv_cache_bytes)}


def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def _measure(layer: torch.nn.Module, n: int, width: int, device: torch.device) -> dict[str, float]:
    """Forward seconds over ``n`` tokens, seconds per decode step at ``n`` cached, cache bytes."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, n, width, generator=g).to(device)  # [1, N, C]
    fwd = _median_time(lambda: layer(x), 2)
    cache = layer.init_cache(1, n + _DECODE_STEPS)  # type: ignore[operator]
    layer(x, cache=cache)
    tok = x[:, -1:]  # [1, 1, C]
    dec = _median_time(lambda: layer(tok, cache=cache), _DECODE_STEPS)  # each step timed, median
    return {"forward_s": fwd, "decode_step_s": dec, "cache_bytes_measured": float(cache_bytes(cache))}


def _variant_curve(variant: str, lengths: Sequence[int], width: int, heads: int, window: int | None,
                   device: torch.device, cap_s: float) -> list[dict[str, Any]]:
    """One point per length: measured while the predicted time stays under ``cap_s``, model beyond."""
    settings = layer_settings(variant, width, heads, window)
    torch.manual_seed(0)
    layer = build_attention(variant, width, heads, causal=True,
                            **VARIANTS[variant].arena_settings(width, heads, window)).to(device).eval()
    points: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    for n in lengths:
        model = _model_point(variant, n, width, heads, settings)
        point: dict[str, Any] = {"n": n, **model}
        predicted = None
        if last is not None:
            predicted = (last["forward_s"] * model["flops"] / max(last["flops"], 1.0)
                         + last["decode_step_s"] * model["step_bytes"] / max(last["step_bytes"], 1.0))
        if last is None or (last["source"] == "measured" and predicted is not None and 2 * predicted <= cap_s):
            try:
                point.update(_measure(layer, n, width, device), source="measured")
            except Exception as e:  # out of memory, unsupported length: the model takes over
                point["error"] = f"{type(e).__name__}: {e}"
        if "source" not in point:
            base = last if last is not None else point
            point.update(source="model",
                         forward_s=base.get("forward_s", float("nan")) * model["flops"] / max(base["flops"], 1.0),
                         decode_step_s=base.get("decode_step_s", float("nan")) * model["step_bytes"]
                         / max(base["step_bytes"], 1.0))
        if point["source"] == "measured":
            last = point
        points.append(point)
    return points


_AVERAGED = ("forward_s", "decode_step_s", "flops", "activation_bytes", "cache_bytes", "step_bytes")


def _stack_curve(pattern: str, lengths: Sequence[int], width: int, heads: int, depth: int, window: int | None,
                 device: torch.device, cap_s: float) -> list[dict[str, Any]]:
    """A hybrid stack's curve as one *average* layer (the report multiplies by the depth): every
    quantity is the mean over the pattern's ``depth`` layers of that layer's variant curve, so
    ``depth x cache_bytes`` is the sum of the layers' caches. A point is ``measured`` only when
    every layer's is."""
    layers = layer_pattern(pattern, depth)
    # a hybrid's windowed layers keep the registry default window (DecoderLM: no per-layer window in a mixed stack)
    per = {n: _variant_curve(n, lengths, width, heads, None, device, cap_s) for n in sorted(set(layers))}
    points = []
    for i, n in enumerate(lengths):
        pts = [per[name][i] for name in layers]
        point: dict[str, Any] = {"n": n, "layers": list(layers),
                                 "source": "measured" if all(p["source"] == "measured" for p in pts) else "model"}
        point.update({k: sum(float(p.get(k, float("nan"))) for p in pts) / len(pts) for k in _AVERAGED})
        points.append(point)
    return points


def crossings(curves: dict[str, list[dict[str, Any]]], baseline: str = "mha") -> dict[str, dict[str, Any]]:
    """For each variant, the length from which on it beats ``baseline``, per quantity.

    Returns ``{variant: {quantity: {"n": N or None, "source": "measured" | "model" | None}}}`` for
    ``forward_s``, ``decode_step_s`` and ``cache_bytes`` (lower is better for each): ``n`` is the
    first length from which the variant stays cheaper up to the longest length (a single noisy
    point below the baseline does not count), None when it is not cheaper at the longest length.
    """
    if baseline not in curves:
        return {}
    base = {p["n"]: p for p in curves[baseline]}
    out: dict[str, dict[str, Any]] = {}
    for v, pts in curves.items():
        if v == baseline:
            continue
        out[v] = {}
        for q in ("forward_s", "decode_step_s", "cache_bytes"):
            hit = None
            for p in reversed([p for p in pts if p["n"] in base]):
                if not p[q] < base[p["n"]][q]:
                    break
                hit = p
            src = None if hit is None else ("measured" if hit["source"] == base[hit["n"]]["source"] == "measured"
                                            else "model")
            out[v][q] = {"n": None if hit is None else hit["n"], "source": src}
    return out


def long_context(variants: Sequence[str], width: int, heads: int, depth: int, window: int | None,
                 device: torch.device, *, quick: bool = False, cap_s: float | None = None) -> dict[str, Any]:
    """Per variant, one layer's forward and decode cost from 1k to 64k tokens (see the module docstring).

    Returns ``{"lengths", "width", "heads", "depth", "cap_s", "curves": {variant: [point...]},
    "errors": {variant: message}, "crossings": ...}``; a point holds ``n``, ``source``,
    ``forward_s``, ``decode_step_s``, ``flops``, ``activation_bytes``, ``cache_bytes`` (one layer,
    float32) and, where measured, ``cache_bytes_measured``.
    """
    lengths = QUICK_LENGTHS if quick else LENGTHS
    cap = cap_s if cap_s is not None else (0.05 if quick else 0.5)
    curves: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for v in variants:
        try:
            curves[v] = (_stack_curve(v, lengths, width, heads, depth, window, device, cap) if "/" in v else
                         _variant_curve(v, lengths, width, heads, window, device, cap))
        except Exception as e:  # a variant without a cost function or cache must not sink the report
            errors[v] = f"{type(e).__name__}: {e}"
    return {"lengths": list(lengths), "width": width, "heads": heads, "depth": depth, "cap_s": cap,
            "curves": curves, "errors": errors, "crossings": crossings(curves)}
