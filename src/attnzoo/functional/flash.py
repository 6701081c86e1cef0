"""The ``flash`` backend: the flash-attn package (CUDA, float16/bfloat16) when it is installed.

flash-attn takes ``[B, N, H, D]`` tensors, aligns ``causal`` and ``window_size`` bottom-right
(our default ``q_offset = Nk - Nq``), handles GQA natively and returns the LSE. Requests with
tensor or ``Mask`` masks, another ``q_offset``, float32/float64 or ``Dv != D`` are refused by the
dispatcher (``attention(..., backend="flash")`` names the missing feature). Never required:
``auto`` uses it only when the package imports on a CUDA device.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.functional._request import AttnRequest


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
