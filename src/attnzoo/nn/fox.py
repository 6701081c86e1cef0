r"""Forgetting attention (FoX, Lin et al., 2025): softmax attention with a learned forget gate.

Every token ``t`` and head ``h`` get a forget gate :math:`f_{t,h} = \sigma(w_h \cdot x_t + b_h)`,
and the score of query ``i`` for key ``j <= i`` is biased by the log of the product of the gates
between them:

.. math::

    s_{ij} = \text{scale}\; q_i \cdot k_j + \sum_{l=j+1}^{i} \log f_l = \text{scale}\; q_i \cdot k_j + c_i - c_j,
    \qquad c_t = \sum_{l \le t} \log f_l,

then a causal softmax. The bias is a ``score_mod`` of :func:`attnzoo.attention` reading the
cumulative log-gates ``c [B, H, N]``, so the ``tiled`` backend evaluates it per tile: memory stays
linear in ``N`` forward and backward, and the gradient reaches the gate projection through ``c``
(the tiled backward's vector-Jacobian product of the score_mod). No positional encoding: the gate
carries position (the paper's FoX uses none).

Decoding: :class:`FoxCache` is a :class:`~attnzoo.nn.cache.KVCache` that also holds ``c`` of every
cached token; a new token's ``c`` continues the sum, so decode == full forward. Packed sequences
(``cu_seqlens``) sum each sequence's gates from zero at its start, as that sequence alone does (one
sum over the packed tokens would make ``c_i - c_j`` round differently when another sequence changes),
and pairs across sequences are hidden.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.functional.core.rules import compute_dtype
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.masks import Mask
from attnzoo.nn.base import AttentionBase, check_backend
from attnzoo.nn.cache import KVCache
from attnzoo.nn.costs import softmax_cost
from attnzoo.nn.frontier import packed_cu_seqlens
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register

__all__ = ["FoxAttention", "FoxCache", "forget_sums", "forgetting_bias"]


class FoxCache(KVCache):
    """A :class:`KVCache` that also holds the cumulative log forget gates ``c [B, H, max_len]``
    (float32; float64 for a float64 cache) of the cached tokens (slots past ``length`` are unused, so rollback stays a length)."""

    _batch_tensors = ("k", "v", "log_gates")

    def __init__(self, batch_size: int, max_len: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(batch_size, max_len, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.log_gates = torch.zeros(batch_size, num_heads, max_len, dtype=compute_dtype(self.dtype), device=device)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.log_gates.numel() * self.log_gates.element_size()

    def gates_after(self, log_f: Tensor) -> Tensor:
        """Write the cumulative gates of ``log_f [B, H, n]`` (the new tokens' ``log f``) after the
        cached ones and return ``c`` of all ``length + n`` tokens (call before :meth:`update`)."""
        start, n = self.length, log_f.shape[-1]
        if tuple(log_f.shape[:2]) != tuple(self.log_gates.shape[:2]):
            raise ValueError(f"FoxCache: the cache holds batch {self.log_gates.shape[0]} x {self.log_gates.shape[1]} "
                             f"heads, the module gives {tuple(log_f.shape[:2])}; use module.init_cache() (a cache "
                             f"of another module does not fit)")
        if start + n > self.max_len:
            raise ValueError(f"FoxCache: {start} cached + {n} new tokens exceed max_len={self.max_len}")
        prev = self.log_gates[:, :, start - 1:start] if start else log_f.new_zeros((*log_f.shape[:2], 1))
        c_new = prev + torch.cumsum(log_f, dim=-1)
        self.log_gates[:, :, start:start + n] = c_new.detach()
        return torch.cat([self.log_gates[:, :, :start], c_new], dim=-1)  # gradients reach the new gates


def forget_sums(log_f: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """``c``: the cumulative sum of ``log_f [..., N]`` along its last dimension, restarting from zero at
    every sequence of ``cu_seqlens`` (int ``[S+1]`` over ``N``; ``None``: one sequence). Each sequence's
    ``c_i - c_j`` then depends on its own gates only, bitwise as that sequence alone gives it."""
    if cu_seqlens is None:
        return torch.cumsum(log_f, dim=-1)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return torch.cat([part.cumsum(-1) for part in log_f.split(lengths, dim=-1)], dim=-1)


def forgetting_bias(c: Tensor) -> Any:
    """The FoX ``score_mod`` for cumulative log-gates ``c [B, H, N]`` at absolute positions:
    ``score + c[b, h, q_idx] - c[b, h, kv_idx]`` (``c`` captured: gradients reach it)."""
    n = c.shape[-1]

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        qi, ki = q_idx.clamp(0, n - 1), kv_idx.clamp(0, n - 1)
        return score + (c[b, h, qi] - c[b, h, ki]).to(score.dtype)

    return score_mod


#: Backends without ``score_mod``: FoX passes its bias to them as a dense ``[B, H, Nq, Nk]`` float
#: mask (``O(N^2)`` memory, as their masked path has anyway).
DENSE_BIAS_BACKENDS = ("sdpa", "flash")


def _dense_bias(c: Tensor, start: int, n: int, mask: Tensor | Mask | None) -> Tensor:
    """``c_i - c_j`` for the queries at ``start .. start + n - 1`` and every key ``[B, H, n, Nk]``,
    with a user mask folded in (hidden keys ``-inf``, a float mask added)."""
    bias = c[:, :, start:start + n, None] - c[:, :, None, :]
    if mask is None:
        return bias
    if isinstance(mask, Mask):
        mask = mask.materialize(c.shape[0], c.shape[1], n, c.shape[-1], q_offset=start, device=c.device)
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask.to(bias.dtype)


class FoxAttention(AttentionBase):
    """Forgetting attention ``[B, N, C] -> [B, N, C]`` (see the module docstring); always causal.

    Args:
        dim: model width ``C``.
        num_heads: query heads ``H`` (one forget gate each).
        num_kv_heads: KV heads ``Hkv`` (GQA; default ``H``).
        head_dim: ``D`` (default ``C // H``).
        bias: biases in the q/k/v/out projections.
        backend: backend of :func:`attnzoo.attention` (``auto`` picks ``tiled`` for the score_mod).
        device, dtype: of the parameters.

    Parameters: ``fgate`` (``Linear(C, H)``, bias initialised so that ``f`` starts near 1).
    Shapes: ``forward(x [B, N, C], *, mask, cache, positions, return_weights, cu_seqlens) -> [B, N, C]``.
    """

    no_weights_reason = None

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, backend: str = "auto", *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        cls = type(self).__name__
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias, layout="qkv",
                         factory=factory)
        self.causal = True
        self.backend = check_backend(backend, cls)
        self.fgate = nn.Linear(self.dim, self.num_heads, bias=True, **factory)
        with torch.no_grad():  # f = sigmoid(~3 + w x) ~ 0.95: long memory at the start of training
            self.fgate.bias.fill_(3.0)

    def log_forget(self, x: Tensor) -> Tensor:
        """``log f [B, H, N]`` in float32 (float64 for float64 ``x``) from ``x [B, N, C]``."""
        return F.logsigmoid(self.fgate(x).to(compute_dtype(x.dtype))).transpose(1, 2)

    # ------------------------------------------------------------------ caches
    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> FoxCache:
        """A :class:`FoxCache`: K/V of ``Hkv`` heads and the cumulative log-gates of ``H`` heads."""
        return super().init_cache(batch_size, max_len, device=device, dtype=dtype)  # type: ignore[no-any-return]

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> FoxCache:
        return FoxCache(batch_size, max_len, self.num_heads, self.num_kv_heads, self.head_dim, device=device,
                        dtype=dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, *, mask: Tensor | Mask | None = None, cache: FoxCache | None = None,
                positions: Tensor | None = None, return_weights: bool = False,
                cu_seqlens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            x: ``[B, N, C]`` (with a cache: the new tokens at ``cache.length ..``; packed: ``[1, T, C]``).
            mask: as :func:`attnzoo.attention`, on top of causality (absolute key axis).
            cache: from :meth:`init_cache`; a call that raises leaves it unchanged.
            positions: accepted for the common module interface and validated; FoX uses no
                positional encoding (the forget gates carry position).
            return_weights: also return the weights ``[B, H, N, Nk]`` (reference backend).
            cu_seqlens: packed sequences (int32 ``[S+1]``), each attending only inside itself.

        Returns: ``[B, N, C]``, or ``(out, weights)``.
        """
        cls = type(self).__name__
        x = self.check_call(x, cache, positions, return_weights, FoxCache)
        if cu_seqlens is not None:
            if cache is not None or mask is not None or return_weights:
                raise ValueError(f"{cls}: packed input (cu_seqlens) takes no cache, mask or return_weights")
            return self.merge_heads(self._packed(x, packed_cu_seqlens(cu_seqlens, x, cls)))
        out, weights = self.guarded(cache, lambda: self._attend(x, mask, cache, return_weights))
        y = self.merge_heads(out)
        return (y, weights) if return_weights else y

    def _attend(self, x: Tensor, mask: Tensor | Mask | None, cache: FoxCache | None,
                return_weights: bool) -> tuple[Tensor, Tensor | None]:
        start = 0 if cache is None else cache.length
        q, k, v = self.project_qkv(x)  # [B, H, N, D], [B, Hkv, N, D]
        log_f = self.log_forget(x)  # [B, H, N]
        if cache is None:
            c = torch.cumsum(log_f, dim=-1)
        else:
            c = cache.gates_after(log_f)
            k, v, _ = cache.update(k, v)
        if self.backend in DENSE_BIAS_BACKENDS:  # no score_mod there: the same bias as a dense float mask
            bias = _dense_bias(c, start, x.shape[1], mask)
            res = self.attend(q, k, v, mask=bias, causal=True, q_offset=start, return_weights=return_weights,
                              backend=self.backend)
        else:
            res = self.attend(q, k, v, mask=mask, causal=True, q_offset=start, score_mod=forgetting_bias(c),
                              return_weights=return_weights, backend=self.backend)
        return (res[0], res[1]) if return_weights else (res, None)

    def _packed(self, x: Tensor, cu: Tensor) -> Tensor:
        """``[1, H, T, D]`` of packed sequences (a cumulative sum per sequence, from zero at its start)."""
        q, k, v = self.project_qkv(x)
        c = forget_sums(self.log_forget(x)[0], cu)  # [H, T]
        starts, last = cu[:-1].long(), c.shape[-1] - 1

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            base = starts[b]  # sequence b's first packed token; positions are within the sequence
            qi, ki = (base + q_idx).clamp(0, last), (base + kv_idx).clamp(0, last)  # (hidden pairs may fall out)
            return score + (c[h, qi] - c[h, ki]).to(score.dtype)

        out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                               causal=True, score_mod=score_mod, backend=self.backend)  # [T, H, D]
        return out.transpose(0, 1).unsqueeze(0)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, backend={self.backend!r}")


# --------------------------------------------------------------------------- variant spec
def _build(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    return FoxAttention(dim, num_heads, **kw)


def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Causal softmax attention on the ``tiled`` backend (``auto`` serves the score_mod there),
    plus the gate projection (``2 C H`` FLOPs per token) and ``H`` float32 log-gates per cached
    token; the bias is elementwise work (uncounted, like the softmax's exponentials). On ``sdpa``
    (a dense bias mask) the ``[B, H, N, N]`` bias adds to the activations."""
    used = shape if shape.backend != "auto" else dataclasses.replace(shape, backend="tiled" if shape.elem_bytes != 8
                                                                     else "reference")
    base = softmax_cost(cfg, used)
    B, N, H = shape.batch, shape.seq_len, cfg.num_heads
    gate = 2 * B * N * cfg.dim * H
    per_token = base.kv_cache_bytes_per_token + 4 * H
    dense_bias = used.backend in DENSE_BIAS_BACKENDS
    bias_bytes = B * H * N * N * shape.acc_bytes if dense_bias else 0  # the materialised bias / modified scores
    return dataclasses.replace(
        base, flops_projections=base.flops_projections + gate, flops_backward=base.flops_backward + 2 * gate,
        params=base.params + cfg.dim * H + H, activation_bytes=base.activation_bytes + 8 * B * N * H + bias_bytes,
        kv_cache_bytes_per_token=per_token, kv_cache_bytes=B * N * per_token)


register(VariantSpec("fox", "softmax", True, "O(N C^2 + N^2 C)", "O(N) (tiled score_mod)",
                     "K, V and the cumulative log forget gates", _build, _cost, options=("num_kv_heads",),
                     causal_modes=(True,), masks="causal", positions="own"))
