"""Infini-attention: Munkhdalai et al. 2024, "Leave No Context Behind".

The sequence is cut into segments of ``L`` tokens. Inside a segment, queries use exact causal
softmax attention over the segment's own keys (through :func:`attnzoo.attention`, so backends and
windows apply). Across segments, each head keeps a compressive memory of every *earlier* segment::

    sigma(x)   = ELU(x) + 1                                   # positive features  [.., D]
    A_mem      = sigma(Q) M_{s-1} / (sigma(Q) z_{s-1})        # retrieval          [L, Dv]
    linear:  M_s = M_{s-1} + sigma(K)^T V
    delta:   M_s = M_{s-1} + sigma(K)^T (V - sigma(K) M_{s-1} / (sigma(K) z_{s-1}))
             z_s = z_{s-1} + sum_t sigma(K_t)
    out        = g * A_mem + (1 - g) * A_local,  g = sigmoid(gate[h])

Retrieval reads ``M_{s-1}``, the memory *before* segment ``s`` is written, so no token sees its
future. Memory ``M [B, H, D, Dv]`` and ``z [B, H, D]`` are per batch element and float32 (float64
for float64 inputs); an empty memory retrieves zeros. A final segment shorter than ``L`` is fine.

Streaming: :class:`InfiniState` carries the memory plus the keys/values of the current, not yet
complete segment, so feeding a sequence piece by piece (down to one token at a time) gives the same
outputs as one call on all of it. Its size never exceeds the memory plus one segment.

Padding: with a ``key_padding_mask`` each row's segments count its own real tokens, so rows padded
differently close their segments at different stream positions (``_run_padded``): a left-padded
row equals the row alone, in one call or streamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._validate import check_choice, check_int, normalize_window
from attnzoo.functional.core._request import check_qkv
from attnzoo.functional.core.rules import compute_dtype
from attnzoo.functional.softmax.attention import attention

__all__ = ["UPDATES", "InfiniState", "infini_attention"]

UPDATES = ("linear", "delta")


def _sigma(x: Tensor) -> Tensor:
    return F.elu(x) + 1.0


def _retrieve(fq: Tensor, mem: Tensor, norm: Tensor) -> Tensor:
    """``sigma(q) M / (sigma(q) z)``, zeros where the memory is empty: ``[B, H, n, Dv]``."""
    num = torch.matmul(fq, mem)  # [B, H, n, Dv]
    den = torch.matmul(fq, norm.unsqueeze(-1))  # [B, H, n, 1]
    return num / torch.where(den > 0, den, torch.ones_like(den))


@dataclass(frozen=True)
class InfiniState:
    """Streaming state of :func:`infini_attention`.

    Attributes:
        memory: ``M [B, H, D, Dv]`` over every completed segment (float32/float64).
        norm: ``z [B, H, D]``, the sum of ``sigma(k)`` over the same keys.
        seg_k: keys of the current partial segment ``[B, H, f, D]`` (``0 <= f < L``).
        seg_v: values of the current partial segment ``[B, H, f, Dv]``.
        seg_valid: bool ``[B, f]`` (True = real token) or ``None`` when no padding was given.
    """

    memory: Tensor
    norm: Tensor
    seg_k: Tensor
    seg_v: Tensor
    seg_valid: Tensor | None = None

    @property
    def fill(self) -> int:
        """Tokens in the current partial segment."""
        return self.seg_k.shape[2]

    def nbytes(self) -> int:
        """Bytes held (memory, normaliser and the partial segment)."""
        ts = [self.memory, self.norm, self.seg_k, self.seg_v]
        if self.seg_valid is not None:
            ts.append(self.seg_valid)
        return sum(t.numel() * t.element_size() for t in ts)

    @staticmethod
    def empty(batch: int, heads: int, head_dim: int, head_dim_v: int, *, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> InfiniState:
        """A state with an empty memory and no partial segment (``dtype`` of the K/V parts)."""
        mdt = compute_dtype(dtype)
        return InfiniState(
            memory=torch.zeros(batch, heads, head_dim, head_dim_v, device=device, dtype=mdt),
            norm=torch.zeros(batch, heads, head_dim, device=device, dtype=mdt),
            seg_k=torch.zeros(batch, heads, 0, head_dim, device=device, dtype=dtype),
            seg_v=torch.zeros(batch, heads, 0, head_dim_v, device=device, dtype=dtype),
        )


def _update(k: Tensor, v: Tensor, valid: Tensor | None, mem: Tensor, norm: Tensor,
            update: str) -> tuple[Tensor, Tensor]:
    """Write one complete segment ``k [B,H,L,D]``, ``v [B,H,L,Dv]`` into ``(M, z)``."""
    fk = _sigma(k.to(mem.dtype))  # [B, H, L, D]
    if valid is not None:
        fk = fk * valid[:, None, :, None].to(mem.dtype)  # padded keys write nothing
    vv = v.to(mem.dtype)
    if update == "delta":
        vv = vv - _retrieve(fk, mem, norm)  # only what the memory does not already return
    mem = mem + torch.matmul(fk.transpose(-1, -2), vv)  # [B, H, D, Dv]
    norm = norm + fk.sum(dim=-2)  # [B, H, D]
    return mem, norm


def _run_padded(q: Tensor, k: Tensor, v: Tensor, real: Tensor, g: Tensor, st: InfiniState, out: Tensor, *,
                segment_len: int, update: str, window: object, backend: str) -> InfiniState:
    """:func:`infini_attention` with key padding ``real [B, N]`` (True = real token), writing ``out``.

    A row's segment closes at its ``segment_len``-th *real* token (padding counts for nothing), so a
    left-padded row is segmented as the row alone. Rows close at different stream positions: the
    stream is cut into pieces at every position where some row closes; in a piece each row sees the
    buffered keys its ``seg_valid`` marks (its open segment) plus the piece's, and only the rows that
    close write their segment into the memory (the others' keys are weighted 0 there: an exact no-op).
    Buffer columns that no row holds any more are dropped, so with left padding the buffer stays
    under ``segment_len`` keys."""
    n = q.shape[2]
    mem, norm, pk, pv, pvalid = st.memory, st.norm, st.seg_k.to(q.dtype), st.seg_v.to(q.dtype), st.seg_valid
    assert pvalid is not None
    count = pvalid.sum(dim=-1)  # [B] real tokens in each row's open segment
    pos = 0
    while pos < n:
        seen = count[:, None] + real[:, pos:].cumsum(dim=-1)  # [B, n - pos]
        closes = (seen == segment_len) & real[:, pos:]  # the token that closes a row's segment
        first = closes.any(dim=0).nonzero()
        take = int(first[0, 0]) + 1 if first.numel() else n - pos  # host sync: one per piece
        qn = q[:, :, pos:pos + take]
        kk = torch.cat([pk, k[:, :, pos:pos + take]], dim=2)  # [B, H, f + take, D]
        vv = torch.cat([pv, v[:, :, pos:pos + take]], dim=2)
        valid = torch.cat([pvalid, real[:, pos:pos + take]], dim=1)  # [B, f + take]
        local = attention(qn, kk, vv, mask=valid[:, None, None, :], causal=True, window=window,  # type: ignore[arg-type]
                          backend=backend)  # [B, H, take, Dv]
        assert isinstance(local, Tensor)
        retrieved = _retrieve(_sigma(qn.to(mem.dtype)), mem, norm)  # from each row's earlier segments
        out[:, :, pos:pos + take] = (g * retrieved + (1.0 - g) * local.to(mem.dtype)).to(q.dtype)
        ends = closes[:, take - 1]  # [B] rows whose segment closes with this piece
        if first.numel():
            mem, norm = _update(kk, vv, valid & ends[:, None], mem, norm, update)
            valid = valid & ~ends[:, None]
        keep = valid.any(dim=0)  # [f + take] columns some row still holds
        pk, pv, pvalid = kk[:, :, keep], vv[:, :, keep], valid[:, keep]
        count = pvalid.sum(dim=-1)
        pos += take
    return InfiniState(memory=mem, norm=norm, seg_k=pk, seg_v=pv, seg_valid=pvalid)


def _check_state(state: object, b: int, h: int, d: int, dv: int, seg: int, device: torch.device) -> InfiniState:
    if not isinstance(state, InfiniState):
        raise TypeError(f"state must be an InfiniState, got {type(state).__name__}")
    want = {"memory": (b, h, d, dv), "norm": (b, h, d)}
    for name, shape in want.items():
        got = tuple(getattr(state, name).shape)
        if got != shape:
            raise ValueError(f"state.{name} must have shape {list(shape)} [B, H, ...], got {list(got)}")
    f = state.fill
    if tuple(state.seg_k.shape) != (b, h, f, d) or tuple(state.seg_v.shape) != (b, h, f, dv):
        raise ValueError(f"state segment K/V must be [B, H, f, D] = [{b}, {h}, f, {d}] and [{b}, {h}, f, {dv}], "
                         f"got {list(state.seg_k.shape)} and {list(state.seg_v.shape)}")
    if f >= seg:
        raise ValueError(f"state holds a partial segment of {f} tokens, expected fewer than segment_len={seg}")
    if state.seg_valid is not None and tuple(state.seg_valid.shape) != (b, f):
        raise ValueError(f"state.seg_valid must be [B, f] = [{b}, {f}], got {list(state.seg_valid.shape)}")
    if state.memory.device != device:
        raise ValueError(f"state is on {state.memory.device} but q is on {device}")
    return state


def _check_args(q: Tensor, k: Tensor, v: Tensor, gate: object, segment_len: object, update: object,
                window: object, key_padding_mask: object) -> None:
    """Validate the arguments of :func:`infini_attention` (shapes named in each error)."""
    check_qkv(q, k, v)
    b, h, n, _ = q.shape
    if k.shape[1] != h or k.shape[2] != n:
        raise ValueError(f"infini_attention needs k/v with the heads and tokens of q, got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    check_int(segment_len, "segment_len", minimum=1)
    check_choice(update, "update", choices=UPDATES)
    if not isinstance(gate, Tensor) or tuple(gate.shape) != (h,):
        got = tuple(gate.shape) if isinstance(gate, Tensor) else type(gate).__name__
        raise ValueError(f"gate must be a tensor of shape [H] = [{h}], got {got}")
    normalize_window(window)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor [B, N] (True = real token)")
        if tuple(key_padding_mask.shape) != (b, n):
            raise ValueError(f"key_padding_mask must have shape [B, N] = [{b}, {n}], got "
                             f"{tuple(key_padding_mask.shape)}")


def infini_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: Tensor,
    *,
    segment_len: int,
    update: str = "linear",
    state: InfiniState | None = None,
    return_state: bool = False,
    key_padding_mask: Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, InfiniState]:
    """Causal Infini-attention over ``[B, H, N, D]`` (see the module docstring for the math).

    Args:
        q, k: ``[B, H, N, D]``; v: ``[B, H, N, Dv]`` (the same N tokens: causal by construction).
        gate: ``[H]`` gate logits; ``sigmoid(gate[h])`` weighs memory vs local attention.
        segment_len: ``L >= 1`` tokens per segment.
        update: ``"linear"`` or ``"delta"`` memory update.
        state: :class:`InfiniState` from an earlier call (tokens continue its stream).
        return_state: also return the state after these tokens.
        key_padding_mask: bool ``[B, N]``, True = real token; padded keys are hidden from the local
            attention and write nothing into the memory, and a row's segments count its real tokens
            only (a segment closes at its ``segment_len``-th real token), so a left-padded row
            gives the row alone. ``window`` counts stream positions.
        window: local attention window inside a segment (``attention``'s ``window``, with causal).
        backend: ``attention`` backend for the local part.

    Returns:
        ``out [B, H, N, Dv]`` in q's dtype, or ``(out, new_state)``.
    """
    _check_args(q, k, v, gate, segment_len, update, window, key_padding_mask)
    b, h, n, d = q.shape
    dv = v.shape[-1]
    st = (InfiniState.empty(b, h, d, dv, device=q.device, dtype=q.dtype) if state is None
          else _check_state(state, b, h, d, dv, segment_len, q.device))
    mem, norm = st.memory, st.norm
    pk, pv, pvalid = st.seg_k.to(q.dtype), st.seg_v.to(q.dtype), st.seg_valid
    if key_padding_mask is not None and pvalid is None:
        pvalid = torch.ones(b, pk.shape[2], dtype=torch.bool, device=q.device)
    g = torch.sigmoid(gate.to(mem.dtype)).view(1, h, 1, 1)
    out = q.new_empty(b, h, n, dv)  # written segment by segment (no list + concatenation)
    if pvalid is not None:  # padding: each row's segments count its own real tokens
        real = (key_padding_mask if key_padding_mask is not None
                else torch.ones(b, n, dtype=torch.bool, device=q.device))
        st = _run_padded(q, k, v, real, g, InfiniState(mem, norm, pk, pv, pvalid), out,
                         segment_len=segment_len, update=update, window=window, backend=backend)
        return (out, st) if return_state else out
    pos = 0
    while pos < n:
        fill = pk.shape[2]
        take = min(n - pos, segment_len - fill)
        qn, kn, vn = q[:, :, pos:pos + take], k[:, :, pos:pos + take], v[:, :, pos:pos + take]
        kk = torch.cat([pk, kn], dim=2) if fill else kn  # [B, H, fill + take, D]
        vv = torch.cat([pv, vn], dim=2) if fill else vn
        valid = None
        if pvalid is not None:
            new_valid = (key_padding_mask[:, pos:pos + take] if key_padding_mask is not None
                         else torch.ones(b, take, dtype=torch.bool, device=q.device))
            valid = torch.cat([pvalid, new_valid], dim=1)  # [B, fill + take]
        local = attention(qn, kk, vv, mask=None if valid is None else valid[:, None, None, :],
                          causal=True, window=window, backend=backend)  # [B, H, take, Dv]
        assert isinstance(local, Tensor)
        retrieved = _retrieve(_sigma(qn.to(mem.dtype)), mem, norm)  # from segments before this one
        out[:, :, pos:pos + take] = (g * retrieved + (1.0 - g) * local.to(mem.dtype)).to(q.dtype)
        if kk.shape[2] == segment_len:
            mem, norm = _update(kk, vv, valid, mem, norm, update)
            pk, pv = kk[:, :, :0], vv[:, :, :0]
            pvalid = None if valid is None else valid[:, :0]
        else:
            pk, pv, pvalid = kk, vv, valid
        pos += take
    if not return_state:
        return out
    return out, InfiniState(memory=mem, norm=norm, seg_k=pk, seg_v=pv, seg_valid=pvalid)
