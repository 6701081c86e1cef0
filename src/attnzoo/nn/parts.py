"""Parts, injected: the pieces a family adds to a softmax attention module, built outside it and passed in.

A :class:`~attnzoo.nn.attention.MultiHeadAttention` is projections, heads, RoPE and the attend seam;
what one family adds on top (Qwen3's per-head QK RMSNorm, OLMo2's over all heads, Qwen3-Next's
output gate, gpt-oss's sink logits, Gemma 2's soft cap, a learned ``score_mod``) is built by the
family (or by the registry builders from their keyword settings) and injected as one
:class:`AttentionParts`::

    q_norm, k_norm = qk_rmsnorm("head", num_heads=8, num_kv_heads=2, head_dim=64, eps=1e-6)
    parts = AttentionParts(q_norm=q_norm, k_norm=k_norm, output_gate=OutputGate(512, 8, 64, "head"),
                           sinks=sink_logits(8), scores=Scores(softcap=50.0))
    attn = MultiHeadAttention(512, 8, num_kv_heads=2, causal=True, rope=True, parts=parts)

* :class:`QKNorm`: RMSNorm of q or k heads, per head over ``D`` or over all heads of a token.
* :class:`OutputGate`: ``out * sigmoid(gate_proj(x))`` per head or per element, before ``out_proj``.
* :func:`sink_logits`: a learnable ``[H]`` sink logit per query head (zeros).
* :class:`Scores`: how scores are formed: ALiBi, scale, soft cap, ``score_mod``.

Checkpoint names: an :class:`AttentionParts` sits at ``<module>.frontier`` and holds its tensors under
the names every saved state dict and the Hugging Face converters use: ``frontier.q_norm_weight``,
``frontier.k_norm_weight``, ``frontier.gate_proj.weight``, ``frontier.sinks``. The norms' weights are
registered there (the :class:`QKNorm` modules themselves are kept as its settings, not as submodules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_bool, check_choice, check_int, check_positive_float
from attnzoo.nn.frontier import QK_NORM_EPS, rms_norm_heads

__all__ = ["AttentionParts", "OutputGate", "QKNorm", "Scores", "parts_from_settings", "qk_rmsnorm", "sink_logits"]

QK_NORMS = ("head", "all")
GATES = ("head", "element")


class QKNorm(nn.Module):
    """RMSNorm of query or key heads ``t [B, h, N, D]`` with a learnable weight (ones).

    Args:
        width: ``D`` (per head: Qwen3, Gemma3) or ``h * D`` (``over_heads``: OLMo2).
        eps: the RMSNorm epsilon (finite, > 0).
        over_heads: normalise over all heads of a token flattened instead of per head.

    Half-precision inputs are normalised in float32 and cast back before the weight (as Hugging
    Face's ``q_norm``/``k_norm``).
    """

    def __init__(self, width: int, *, eps: float = QK_NORM_EPS, over_heads: bool = False) -> None:
        super().__init__()
        self.width = check_int(width, "width", "QKNorm")
        self.eps = check_positive_float(eps, "eps", "QKNorm", optional=True)
        check_bool(over_heads, "over_heads", "QKNorm")
        self.over_heads = over_heads
        self.weight = nn.Parameter(torch.ones(self.width))

    def forward(self, t: Tensor) -> Tensor:
        """The norm of ``t [B, h, N, D]`` with this module's weight."""
        return self.normalize(t, self.weight)

    def normalize(self, t: Tensor, weight: Tensor) -> Tensor:
        """The norm of ``t [B, h, N, D]`` with ``weight`` (the one an :class:`AttentionParts` registered)."""
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.dim() != 4:
            got = f"dtype {t.dtype}, shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"QKNorm: t must be a floating-point tensor [B, h, N, D], got {got}")
        width = t.shape[1] * t.shape[3] if self.over_heads else t.shape[3]
        if width != weight.shape[0]:
            what = "h * D" if self.over_heads else "D"
            raise ValueError(f"QKNorm: t [B, h, N, D] must have {what} = {weight.shape[0]} (the norm's width), "
                             f"got shape {tuple(t.shape)}")
        return rms_norm_heads(t, weight, self.eps, self.over_heads)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return f"{self.width}, eps={self.eps}, over_heads={self.over_heads}"


def qk_rmsnorm(mode: str, num_heads: int, num_kv_heads: int, head_dim: int,
               eps: float = QK_NORM_EPS) -> tuple[QKNorm, QKNorm]:
    """``(q_norm, k_norm)``: ``mode="head"`` RMSNorm of every head over ``D`` (weights ``[D]``:
    Qwen3, Gemma3) or ``"all"`` over all heads of a token (weights ``[H*D]``, ``[Hkv*D]``: OLMo2)."""
    check_choice(mode, "mode", "qk_rmsnorm", choices=QK_NORMS)
    wide = mode == "all"
    return (QKNorm(num_heads * head_dim if wide else head_dim, eps=eps, over_heads=wide),
            QKNorm(num_kv_heads * head_dim if wide else head_dim, eps=eps, over_heads=wide))


class OutputGate(nn.Linear):
    """Gated attention (Qwen3-Next): ``out * sigmoid(gate_proj(x))`` before ``out_proj``.

    Args:
        dim: model width ``C`` (the gate reads ``x [B, N, C]``).
        num_heads, head_dim: ``H``, ``D`` of the attention output ``[B, H, N, D]``.
        mode: ``"head"`` (one gate per head, ``H`` outputs) or ``"element"`` (one per channel, ``H * D``).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, mode: str = "head") -> None:
        check_choice(mode, "mode", "OutputGate", choices=GATES)
        H, D = check_int(num_heads, "num_heads", "OutputGate"), check_int(head_dim, "head_dim", "OutputGate")
        super().__init__(check_int(dim, "dim", "OutputGate"), H if mode == "head" else H * D, bias=False)
        self.mode, self.num_heads, self.head_dim = mode, H, D

    def gate(self, out: Tensor, x: Tensor) -> Tensor:
        """``out [B, H, N, Dv]`` times ``sigmoid(gate_proj(x [B, N, C]))`` (``[B, H, N, 1]`` or ``[B, H, N, Dv]``)."""
        B, H, N, Dv = out.shape
        if self.num_heads != H or (self.mode != "head" and Dv != self.head_dim):
            raise ValueError(f"OutputGate: out must be [B, H, N, Dv] with H = {self.num_heads}"
                             f"{'' if self.mode == 'head' else f' and Dv = {self.head_dim}'}, got {tuple(out.shape)}")
        g = torch.sigmoid(self(x))  # [B, N, H] or [B, N, H*Dv]
        g = g.view(B, N, H, 1 if self.mode == "head" else Dv).transpose(1, 2)
        return out * g.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"


def sink_logits(num_heads: int) -> nn.Parameter:
    """A learnable ``[H]`` sink logit per query head (gpt-oss), initialised to 0."""
    return nn.Parameter(torch.zeros(check_int(num_heads, "num_heads", "sink_logits")))


@dataclass(frozen=True)
class Scores:
    """How a softmax module forms its scores (every field optional).

    Attributes:
        alibi: add ALiBi biases with :func:`~attnzoo.alibi_slopes` ``(H)``.
        scale: score scale, default ``1 / sqrt(D)``; a finite positive float.
        softcap: scores become ``softcap * tanh(scores / softcap)`` after the scale (Gemma 2).
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score`` of :func:`attnzoo.attention`, at the
            tokens' positions in the stream (with a cache ``cache.length + i``); an ``nn.Module``
            becomes a submodule of the attention module (its parameters train with it).
    """

    alibi: bool = False
    scale: float | None = None
    softcap: float | None = None
    score_mod: Callable[..., Tensor] | None = None

    def __post_init__(self) -> None:
        check_bool(self.alibi, "alibi", "Scores")
        object.__setattr__(self, "scale", check_positive_float(self.scale, "scale", "Scores", optional=True))
        object.__setattr__(self, "softcap", check_positive_float(self.softcap, "softcap", "Scores", optional=True))
        if self.score_mod is not None and not callable(self.score_mod):
            raise TypeError(f"Scores: score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, "
                            f"got {type(self.score_mod).__name__}")


class AttentionParts(nn.Module):
    """The parts injected into a softmax attention module (``MultiHeadAttention(..., parts=...)``).

    Args:
        q_norm, k_norm: :class:`QKNorm` of the query and key heads, both or neither (see
            :func:`qk_rmsnorm`); applied before RoPE.
        output_gate: an :class:`OutputGate`.
        sinks: ``[H]`` learnable sink logits (:func:`sink_logits`), passed to :func:`attnzoo.attention`.
        scores: :class:`Scores` (default: plain scaled scores).

    The module checks the sizes against its heads when the parts are injected. One ``AttentionParts``
    belongs to one module (inject a fresh one per layer).
    """

    def __init__(self, *, q_norm: QKNorm | None = None, k_norm: QKNorm | None = None,
                 output_gate: OutputGate | None = None, sinks: Tensor | None = None,
                 scores: Scores | None = None) -> None:
        super().__init__()
        for name, value, kind in (("q_norm", q_norm, QKNorm), ("k_norm", k_norm, QKNorm),
                                  ("output_gate", output_gate, OutputGate), ("scores", scores, Scores)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"AttentionParts: {name} must be a {kind.__name__} or None, got "
                                f"{type(value).__name__}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError(f"AttentionParts: q_norm and k_norm come together, got q_norm={q_norm}, k_norm={k_norm}")
        if sinks is not None and (not isinstance(sinks, Tensor) or not sinks.is_floating_point() or sinks.dim() != 1):
            raise TypeError(f"AttentionParts: sinks must be a 1-D floating tensor [H] (see sink_logits), got "
                            f"{type(sinks).__name__}{'' if not isinstance(sinks, Tensor) else tuple(sinks.shape)}")
        self.scores = Scores() if scores is None else scores
        self.sinks = None if sinks is None else sinks if isinstance(sinks, nn.Parameter) else nn.Parameter(sinks)
        self.gate_proj = output_gate
        self._norms = (q_norm, k_norm)  # their settings; the weights are registered below, by checkpoint name
        self.q_norm_weight = None if q_norm is None else q_norm.weight
        self.k_norm_weight = None if k_norm is None else k_norm.weight

    @property
    def q_norm(self) -> QKNorm | None:
        """The query heads' :class:`QKNorm` (its weight is ``q_norm_weight``)."""
        return self._norms[0]

    @property
    def k_norm(self) -> QKNorm | None:
        """The key heads' :class:`QKNorm` (its weight is ``k_norm_weight``)."""
        return self._norms[1]

    def check(self, owner: str, dim: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise ``ValueError`` naming the part when its sizes do not fit a module of these sizes."""
        H, Hkv, D = num_heads, num_kv_heads, head_dim
        for name, norm, heads in (("q_norm", self.q_norm, H), ("k_norm", self.k_norm, Hkv)):
            if norm is not None and norm.width != (heads * D if norm.over_heads else D):
                raise ValueError(f"{owner}: parts.{name} has width {norm.width} (over_heads={norm.over_heads}); "
                                 f"expected {heads * D if norm.over_heads else D} for {heads} heads of {D}")
        g = self.gate_proj
        if g is not None and (g.in_features, g.num_heads, g.head_dim) != (dim, H, D):
            raise ValueError(f"{owner}: parts.output_gate reads {g.in_features} channels for {g.num_heads} heads of "
                             f"{g.head_dim}; expected OutputGate({dim}, {H}, {D}, ...)")
        if self.sinks is not None and tuple(self.sinks.shape) != (H,):
            raise ValueError(f"{owner}: parts.sinks must have shape [num_heads] = [{H}], got {tuple(self.sinks.shape)}")

    def norm_q(self, q: Tensor) -> Tensor:
        """QK-norm of ``q [B, H, N, D]`` (identity without one)."""
        norm = self._norms[0]
        return q if norm is None else norm.normalize(q, self.q_norm_weight)  # type: ignore[arg-type]

    def norm_k(self, k: Tensor) -> Tensor:
        """QK-norm of ``k [B, Hkv, M, D]`` (identity without one)."""
        norm = self._norms[1]
        return k if norm is None else norm.normalize(k, self.k_norm_weight)  # type: ignore[arg-type]

    def gate(self, out: Tensor, x: Tensor) -> Tensor:
        """``out [B, H, N, Dv]`` gated by ``x`` (identity without an output gate)."""
        return out if self.gate_proj is None else self.gate_proj.gate(out, x)

    def extra_repr(self) -> str:
        norm = self.q_norm
        qk = "None" if norm is None else f"{'all' if norm.over_heads else 'head'!r}, qk_norm_eps={norm.eps}"
        return f"sinks={self.sinks is not None}, qk_norm={qk}, scores={self.scores}"


def parts_from_settings(dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None, *,
                        alibi: bool = False, scale: float | None = None, softcap: float | None = None,
                        score_mod: Callable[..., Tensor] | None = None, sinks: bool = False,
                        qk_norm: str | None = None, qk_norm_eps: float | None = None,
                        output_gate: str | None = None) -> AttentionParts:
    """The :class:`AttentionParts` of the registry builders' keyword settings (``qk_norm="head"``,
    ``sinks=True``, ``output_gate="head"``, ``softcap=...``: what ``attention_kwargs`` dicts carry).
    ``num_kv_heads``/``head_dim`` ``None``: ``num_heads`` / ``dim // num_heads``."""
    owner = "attention settings"
    check_bool(sinks, "sinks", owner)
    for name, value, choices in (("qk_norm", qk_norm, QK_NORMS), ("output_gate", output_gate, GATES)):
        if value is not None and value not in choices:
            raise ValueError(f"{owner}: {name} must be one of {[None, *choices]}, got {value!r}")
    if qk_norm_eps is not None and qk_norm is None:
        raise ValueError(f"{owner}: qk_norm_eps applies with qk_norm='head' or 'all' only, got qk_norm=None")
    H = check_int(num_heads, "num_heads", owner)
    Hkv = H if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", owner)
    D = check_int(dim // H if head_dim is None else head_dim, "head_dim", owner)
    eps = QK_NORM_EPS if qk_norm_eps is None else check_positive_float(qk_norm_eps, "qk_norm_eps", owner, optional=True)
    q_norm, k_norm = (None, None) if qk_norm is None else qk_rmsnorm(qk_norm, H, Hkv, D, eps)
    return AttentionParts(q_norm=q_norm, k_norm=k_norm, sinks=sink_logits(H) if sinks else None,
                          output_gate=None if output_gate is None else OutputGate(dim, H, D, output_gate),
                          scores=Scores(alibi=alibi, scale=scale, softcap=softcap, score_mod=score_mod))


def placed(module: nn.Module, dtype: torch.dtype | None, keep: tuple[Any, ...] = ()) -> nn.Module:
    """``module`` with its floating parameters and buffers cast to ``dtype`` (``None``: unchanged),
    except those of the modules in ``keep`` (a shared rotary embedding, a ``score_mod``: they keep theirs).
    Build under ``with torch.device(device):`` for the device."""
    if dtype is None:
        return module
    kept = {id(m) for k in keep if isinstance(k, nn.Module) for m in k.modules()}
    for m in module.modules():
        if id(m) in kept:
            continue
        for p in m.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in m.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(m, name, b.to(dtype))
    return module
