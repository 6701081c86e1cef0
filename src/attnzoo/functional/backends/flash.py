"""The ``flash`` backend: the flash-attn package (CUDA, float16/bfloat16) when it is installed.

flash-attn takes ``[B, N, H, D]`` tensors, aligns ``causal`` and ``window_size`` bottom-right
(our default ``q_offset = Nk - Nq``), handles GQA natively and returns the LSE. Requests with
tensor or ``Mask`` masks, another ``q_offset``, float32/float64 or ``Dv != D`` are refused by the
dispatcher (``attention(..., backend="flash")`` names the missing feature). Never required:
``auto`` uses it only when the package imports on a CUDA device.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import Tensor

from attnzoo.functional.core._request import AttnRequest, Capabilities


def _available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def _more_missing(r: AttnRequest) -> set[str]:
    missing: set[str] = set()
    if r.q.dtype not in (torch.float16, torch.bfloat16):
        missing.add(f"dtype {r.q.dtype} (flash-attn needs float16/bfloat16)")
    aligned = r.q_offset == r.nk - r.nq
    if not aligned and (r.causal or r.window is not None or r.alibi_slopes is not None):
        missing.add(f"q_offset={r.q_offset} (flash-attn aligns bottom-right: q_offset = Nk - Nq)")
    return missing


#: What this backend cannot do (feature names of ``AttnRequest.features()``), where it runs.
CAPABILITIES = Capabilities("flash", frozenset({"return_weights", "float mask", "bool mask", "Mask object",
                                                "float64", "Dv != D", "alibi gradient", "score_mod"}),
                            _available, _more_missing)


def flash_attention_backend(r: AttnRequest) -> tuple[Tensor, Tensor]:
    """Attention through ``flash_attn.flash_attn_func``. Returns ``(out [B,Hq,Nq,D], lse [B,Hq,Nq])``."""
    from flash_attn import flash_attn_func  # optional dependency: pip install flash-attn

    left, right = (-1, -1) if r.window is None else (
        -1 if r.window[0] is None else r.window[0], -1 if r.window[1] is None else r.window[1])
    if r.causal:
        right = 0
    kwargs: dict[str, Any] = {
        "dropout_p": r.dropout_p,
        "softmax_scale": r.scale,
        "causal": r.causal,
        "window_size": (left, right),
        "alibi_slopes": r.alibi_slopes,
        "return_attn_probs": True,
    }
    if r.softcap is not None:
        kwargs["softcap"] = r.softcap
    q, k, v = (t.transpose(1, 2) for t in (r.q, r.k, r.v))  # [B, N, H, D]
    out, lse, _ = flash_attn_func(q, k, v, **kwargs)
    return out.transpose(1, 2), lse.float()
