"""Linear (kernelised) attention: Katharopoulos et al. 2020, "Transformers are RNNs".

Softmax similarity ``exp(q . k)`` is replaced by a feature-map inner product
``phi(q) . phi(k)``, so attention factorises::

    out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps)
    S_i   = S_0 + sum_{j visible to i} phi(k_j) v_j^T      # [F, Dv]
    z_i   = z_0 + sum_{j visible to i} phi(k_j)            # [F]

``(S_0, z_0)`` is an optional carried state (the keys of earlier calls). Three forms compute the
same thing and are tested against each other:

* ``"quadratic"`` (the reference): materialise ``A = phi(Q) phi(K)^T`` ``[Nq, Nk]`` (lower
  triangle when causal), ``out = (A V + phi(Q) S_0) / (A 1 + phi(Q) z_0 + eps)``. O(N^2) memory.
* ``"chunked"``: split the sequence in chunks of ``C`` tokens; inside a chunk use the quadratic
  form (``C x C``), between chunks carry ``(S, z)``. Time O(N C F + N F Dv), memory O(N C + F Dv)
  beyond the inputs (chunks are processed in groups so the per-chunk states stay bounded).
* ``"recurrent"``: one token at a time, ``S += phi(k_t) v_t^T; out_t = phi(q_t) S / phi(q_t) z``
  (what decoding does; slow in Python, kept as an independent check).

Bidirectional (``causal=False``) attention is just ``phi(Q) (S_0 + phi(K)^T V)``; its
``"chunked"`` and ``"recurrent"`` forms are that factorised product.

The math runs in float32 (float64 for float64 inputs); the returned state is in that dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import check_bool, check_choice, check_optional_int
from attnzoo.functional.core._request import check_qkv
from attnzoo.functional.core.rules import compute_dtype  # also imported from here by nn/
from attnzoo.functional.recurrent._chunked_scan import token_loop

__all__ = ["FEATURE_MAPS", "FORMS", "linear_attention", "resolve_feature_map"]

FeatureMap = str | Callable[[Tensor], Tensor]
State = tuple[Tensor, Tensor]

#: Named feature maps ``[..., D] -> [..., D]``.
FEATURE_MAPS: dict[str, Callable[[Tensor], Tensor]] = {
    "elu": lambda x: F.elu(x).add_(1.0),
    "relu": F.relu,
    "identity": lambda x: x,
}

#: Computation forms of :func:`linear_attention`.
FORMS = ("auto", "quadratic", "chunked", "recurrent")

DEFAULT_CHUNK = 64
# Bytes of per-chunk states (phi(K)^T V and its prefix sum) held at once by the chunked form.
_GROUP_BUDGET_BYTES = 32 * 2**20


def resolve_feature_map(feature_map: FeatureMap) -> Callable[[Tensor], Tensor]:
    """Name (``"elu"`` = ELU+1, ``"relu"``, ``"identity"``) or callable -> callable."""
    if isinstance(feature_map, str):
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable, "
                             f"got {feature_map!r}")
        return FEATURE_MAPS[feature_map]
    if callable(feature_map):
        return feature_map
    raise TypeError(f"feature_map must be a str or a callable [..., D] -> [..., F], "
                    f"got {type(feature_map).__name__}")


# --------------------------------------------------------------------------- validation
def check_form(form: object) -> str:
    return check_choice(form, "form", choices=FORMS)


def check_key_padding(mask: object, batch: int, n_k: int, device: torch.device) -> Tensor | None:
    """Validate a key padding mask: bool ``[B, Nk]``, True = real token."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor [B, Nk] (True = real token), got "
                        f"{type(mask).__name__}{' ' + str(mask.dtype) if isinstance(mask, Tensor) else ''}")
    if tuple(mask.shape) != (batch, n_k):
        raise ValueError(f"key_padding_mask must have shape [B, Nk] = [{batch}, {n_k}], got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask is on {mask.device} but k is on {device}")
    return mask


def check_state(state: object, batch: int, heads: int, n_feat: int, dv: int, dtype: torch.dtype,
                device: torch.device) -> State | None:
    """Validate ``(S [B, H, F, Dv], z [B, H, F])`` and cast it to the compute dtype."""
    if state is None:
        return None
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(f"state must be a pair (S [B, H, F, Dv], z [B, H, F]), got {type(state).__name__}")
    s, z = state
    if not isinstance(s, Tensor) or not isinstance(z, Tensor):
        raise TypeError(f"state must hold two tensors, got ({type(s).__name__}, {type(z).__name__})")
    if tuple(s.shape) != (batch, heads, n_feat, dv):
        raise ValueError(f"state S must have shape [B, H, F, Dv] = {[batch, heads, n_feat, dv]}, "
                         f"got {tuple(s.shape)}")
    if tuple(z.shape) != (batch, heads, n_feat):
        raise ValueError(f"state z must have shape [B, H, F] = {[batch, heads, n_feat]}, got {tuple(z.shape)}")
    if not s.is_floating_point() or not z.is_floating_point():
        raise TypeError(f"state tensors must be floating point, got S {s.dtype} and z {z.dtype}")
    if s.device != device or z.device != device:
        raise ValueError(f"state is on {s.device}/{z.device} but q is on {device}")
    return s.to(dtype), z.to(dtype)


def check_inputs(q: object, k: object, v: object, causal: object) -> None:
    """q, k, v agreement (shared rules of ``attention``) plus the feature-attention restrictions."""
    check_qkv(q, k, v)
    assert isinstance(q, Tensor) and isinstance(k, Tensor)  # for type checkers; check_qkv raised otherwise
    check_bool(causal, "causal")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"feature-map attention needs as many key/value heads as query heads, got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)} (expand K/V for GQA)")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal feature-map attention needs Nq == Nk (queries and keys are the same "
                         f"tokens), got q {tuple(q.shape)} and k {tuple(k.shape)}")


def apply_feature_map(fn: Callable[[Tensor], Tensor], x: Tensor, name: str) -> Tensor:
    out = fn(x)
    if not isinstance(out, Tensor) or out.dim() != 4 or tuple(out.shape[:3]) != tuple(x.shape[:3]):
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"feature_map applied to {name} {tuple(x.shape)} must return [B, H, N, F], got {shape}")
    if out.shape[-1] < 1:
        raise ValueError(f"feature_map returned {out.shape[-1]} features for {name}; expected >= 1")
    return out.to(x.dtype)


# --------------------------------------------------------------------------- kernels
def _divide(num: Tensor, den: Tensor, eps: float) -> Tensor:
    """``num / (den + eps)`` with a zero denominator giving 0 (rows that see no key)."""
    d = (den + eps).unsqueeze(-1)
    return num / torch.where(d == 0, torch.ones_like(d), d)


def _quadratic(fq: Tensor, fk: Tensor, v: Tensor, causal: bool, state: State | None,
               eps: float) -> tuple[Tensor, Tensor]:
    """Reference form; returns ``(num [B,H,Nq,Dv], den [B,H,Nq])``."""
    a = torch.matmul(fq, fk.transpose(-1, -2))  # [B, H, Nq, Nk]
    if causal:
        a = a.tril()  # a masked write, not a product: a non-finite future key's column never reaches a row
    num = torch.matmul(a, v)  # [B, H, Nq, Dv]
    den = a.sum(dim=-1)  # [B, H, Nq]
    if state is not None:
        num = num + torch.matmul(fq, state[0])
        den = den + torch.matmul(fq, state[1].unsqueeze(-1)).squeeze(-1)
    return num, den


def _recurrent(fq: Tensor, fk: Tensor, v: Tensor, s: Tensor, z: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Causal, one token at a time. Returns ``(num, den, S, z)``."""
    nums, dens = [], []
    for t in range(fq.shape[2]):
        kt = fk[:, :, t]  # [B, H, F]
        s = s + kt.unsqueeze(-1) * v[:, :, t].unsqueeze(-2)  # [B, H, F, Dv]
        z = z + kt
        qt = fq[:, :, t]  # [B, H, F]
        nums.append(torch.matmul(qt.unsqueeze(-2), s).squeeze(-2))  # [B, H, Dv]
        dens.append((qt * z).sum(-1))  # [B, H]
    return torch.stack(nums, dim=2), torch.stack(dens, dim=2), s, z


def _recurrent_shapes(fq: Tensor, fk: Tensor, v: Tensor, s: Tensor, z: Tensor) -> tuple[Tensor, ...]:
    return s.new_empty(*fq.shape[:3], v.shape[-1]), z.new_empty(fq.shape[:3]), s.new_empty(s.shape), z.new_empty(z.shape)


_recurrent_op = token_loop("linear_recurrent", _recurrent, _recurrent_shapes)


#: ``sizes -> features [B, H, n_i, F]`` of consecutive runs of ``n_i`` tokens (``sum(sizes)`` = all of them),
#: one run at a time: the input is split once (a slice per run would make autograd build a full-length
#: gradient per run, quadratic in N).
Featurizer = Callable[[list[int]], Iterator[Tensor]]


def runs(t: Tensor, sizes: list[int], dim: int) -> tuple[Tensor, ...]:
    """``t`` split into runs of ``sizes`` along ``dim``; one run is ``t`` itself (no size enters a
    compiled graph, so one graph serves every length)."""
    return (t,) if len(sizes) == 1 else t.split(sizes, dim=dim)


def _chunked_causal(fq_fn: Featurizer, fk_fn: Featurizer, v: Tensor, s: Tensor, z: Tensor, chunk: int,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Causal chunked form. Returns ``(out [B,H,N,Dv], S, z)``.

    Chunks are handled ``g`` at a time: the group's features are computed, then its intra-chunk
    scores ``[g, C, C]``, per-chunk states ``phi(K_c)^T V_c`` ``[g, F, Dv]`` and their exclusive
    prefix sum with batched matmuls; the running state then moves to the end of the group. Peak
    memory beyond inputs and output is one group's temporaries (about 32 MiB), whatever N.
    The normaliser rides along as an extra value column of ones (``[V | 1]``, state ``[S | z]``), so
    one matmul gives numerator and denominator.
    """
    b, h, n, dv = v.shape
    f = s.shape[2]
    chunk = min(chunk, n)  # a sequence shorter than one chunk is one chunk, not a padded one
    out: Tensor | None = None  # inference writes in place; with autograd recording, the runs are concatenated
    se = torch.cat([s, z.unsqueeze(-1)], dim=-1)  # [B, H, F, Dv + 1]
    per_chunk = b * h * (3 * f * (dv + 1) + chunk * chunk + 3 * chunk * (f + dv + 1)) * v.element_size()
    g = max(1, min(-(-n // chunk), _GROUP_BUDGET_BYTES // max(1, per_chunk)))
    # Compiled: one group (a loop over groups would specialise the graph on the length N).
    compiling = tracing()
    step = n if compiling else g * chunk
    sizes = [n] if compiling else [min(step, n - lo) for lo in range(0, n, step)]
    outs: list[Tensor] = []
    n_done = 0
    for qs, ks, vs in zip(fq_fn(sizes), fk_fn(sizes), runs(v, sizes, 2), strict=True):  # [B, H, n, F]
        m = -(-vs.shape[2] // chunk)
        pad = m * chunk - vs.shape[2]
        ve = torch.cat([vs, vs.new_ones(b, h, vs.shape[2], 1)], dim=-1)  # [B, H, n, Dv + 1]
        if pad:  # zero keys add nothing; zero queries are dropped below
            qs, ks, ve = (F.pad(t, (0, 0, 0, pad)) for t in (qs, ks, ve))
        qc = qs.reshape(b, h, m, chunk, f)  # [B, H, m, C, F]
        kc = ks.reshape(b, h, m, chunk, f)
        vc = ve.reshape(b, h, m, chunk, dv + 1)  # [B, H, m, C, Dv + 1]
        a = torch.matmul(qc, kc.transpose(-1, -2)).tril_()  # [B, H, m, C, C]
        nd = torch.matmul(a, vc)  # [B, H, m, C, Dv + 1]: numerator | denominator
        del a
        kv = torch.matmul(kc.transpose(-1, -2), vc)  # [B, H, m, F, Dv + 1]
        # state before each chunk: S + the earlier chunks of the group (exclusive prefix sum)
        s_pre = torch.cat([se.unsqueeze(2), kv[:, :, :-1]], dim=2).cumsum_(dim=2)  # [B, H, m, F, Dv + 1]
        nd = nd + torch.matmul(qc, s_pre)
        res = _divide(nd[..., :dv], nd[..., dv], eps).reshape(b, h, m * chunk, dv)
        if res.requires_grad:
            outs.append(res[:, :, : vs.shape[2]])
        else:
            if out is None:
                out = v.new_empty(b, h, n, dv)
            out.narrow(2, n_done, vs.shape[2]).copy_(res[:, :, : vs.shape[2]])
        n_done += vs.shape[2]
        se = s_pre[:, :, -1] + kv[:, :, -1]
    if out is None:
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out, se[..., :dv], se[..., dv]


def feature_attention(
    fq_fn: Featurizer,
    fk_fn: Featurizer,
    v: Tensor,
    n_q: int,
    n_feat: int,
    *,
    causal: bool,
    form: str,
    chunk_size: int | None,
    state: State | None,
    eps: float,
) -> tuple[Tensor, State]:
    """Attention from feature functions (shared by linear attention and Performer).

    Args:
        fq_fn: ``sizes -> iterator of [B, H, n_i, F]``: query features of consecutive runs of tokens,
            compute dtype (see :data:`Featurizer`).
        fk_fn: the same for keys (padded keys already zeroed). The chunked causal form asks for one
            group of chunks at a time, so the full ``[N, F]`` features never exist at once.
        v: values ``[B, H, Nk, Dv]`` in the compute dtype.
        n_q: number of queries ``Nq``; n_feat: ``F``.
        causal: prefix attention (``Nq == Nk``).
        form: ``"auto" | "quadratic" | "chunked" | "recurrent"`` (validated).
        chunk_size: chunk length of the chunked form, ``None`` = :data:`DEFAULT_CHUNK`.
        state: validated ``(S [B, H, F, Dv], z [B, H, F])`` or ``None``.
        eps: added to the normaliser.

    Returns:
        ``(out [B, H, Nq, Dv], (S, z))``; the state includes every key of this call.
    """
    b, h, n_k, dv = v.shape
    if state is None:
        s0 = v.new_zeros(b, h, n_feat, dv)
        z0 = v.new_zeros(b, h, n_feat)
    else:
        s0, z0 = state
    chunk = chunk_size or DEFAULT_CHUNK
    if causal and (n_k == 0 or (form == "auto" and n_k <= chunk)):
        # one chunk: the chunked form would only add the (empty) carried-state terms; no token: every
        # form gives the empty output and the state unchanged, and only the quadratic one needs no loop
        form = "quadratic"
    if causal and form in ("auto", "chunked"):
        out, s_end, z_end = _chunked_causal(fq_fn, fk_fn, v, s0, z0, chunk, eps)
        return out, (s_end, z_end)
    (fq,), (fk,) = fq_fn([n_q]), fk_fn([n_k])
    if form == "quadratic":
        num, den = _quadratic(fq, fk, v, causal, state, eps)
        kv = torch.matmul(fk.transpose(-1, -2), v)  # [B, H, F, Dv]
        return _divide(num, den, eps), (s0 + kv, z0 + fk.sum(dim=-2))
    if not causal:
        s_end, z_end = s0 + torch.matmul(fk.transpose(-1, -2), v), z0 + fk.sum(dim=-2)
        num = torch.matmul(fq, s_end)  # [B, H, Nq, Dv]
        den = torch.matmul(fq, z_end.unsqueeze(-1)).squeeze(-1)  # [B, H, Nq]
        return _divide(num, den, eps), (s_end, z_end)
    num, den, s_end, z_end = _recurrent_op(fq, fk, v, s0, z0)
    return _divide(num, den, eps), (s_end, z_end)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMap = "elu",
    causal: bool = False,
    chunk_size: int | None = None,
    state: State | None = None,
    return_state: bool = False,
    key_padding_mask: Tensor | None = None,
    form: str = "auto",
    eps: float = 1e-6,
) -> Tensor | tuple[Tensor, State]:
    """Linear attention ``phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1 + eps)``.

    Args:
        q: queries ``[B, H, Nq, D]``.
        k: keys ``[B, H, Nk, D]`` (as many heads as ``q``; ``Nk == Nq`` when causal).
        v: values ``[B, H, Nk, Dv]``.
        feature_map: ``"elu"`` (ELU+1, the paper's choice), ``"relu"``, ``"identity"``, or a callable
            ``[B, H, N, D] -> [B, H, N, F]`` (applied to q and k; should be non-negative).
        causal: token ``i`` sees keys ``j <= i`` (plus everything in ``state``).
        chunk_size: chunk length ``C`` of the chunked causal form (default 64). Any ``C >= 1``;
            it need not divide ``N``.
        state: ``(S [B, H, F, Dv], z [B, H, F])`` carried from an earlier call: the sums of
            ``phi(k) v^T`` and ``phi(k)`` over the keys seen before. Cast to the compute dtype.
        return_state: also return the state after this call's keys.
        key_padding_mask: bool ``[B, Nk]``, True = real token; padded keys' features are zeroed,
            so they contribute nothing (a query with no real key returns zeros).
        form: ``"auto"`` (causal: chunked, or quadratic when ``Nk <= chunk_size`` (one chunk);
            bidirectional: the state form), ``"quadratic"`` (reference, O(N^2) memory), ``"chunked"``,
            ``"recurrent"`` (token loop). See the module docstring.
        eps: added to the normaliser ``phi(q) . z``.

    Returns:
        ``out [B, H, Nq, Dv]`` in q's dtype, or ``(out, (S, z))`` with ``return_state=True``; the
        state is float32 (float64 for float64 inputs).

    Raises:
        ValueError / TypeError naming the argument: unknown feature map or form, ``chunk_size < 1``,
        state or padding mask of the wrong shape, mismatched q/k/v.
    """
    check_inputs(q, k, v, causal)
    fn = resolve_feature_map(feature_map)
    chunk = check_optional_int(chunk_size, "chunk_size")
    form = check_form(form)
    check_bool(return_state, "return_state")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:  # no math.isfinite: traceable
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    cdt = compute_dtype(q.dtype)
    pad = check_key_padding(key_padding_mask, b, n_k, k.device)
    # the feature count, from one token (the map is per token)
    n_feat = apply_feature_map(fn, q[:, :, :1].to(cdt), "q").shape[-1]

    def fq_fn(sizes: list[int]) -> Iterator[Tensor]:
        return (apply_feature_map(fn, part.to(cdt), "q") for part in runs(q, sizes, 2))  # [B, H, n, F]

    def fk_fn(sizes: list[int]) -> Iterator[Tensor]:
        pads = [None] * len(sizes) if pad is None else runs(pad, sizes, 1)
        for part, part_pad in zip(runs(k, sizes, 2), pads, strict=True):
            fk = apply_feature_map(fn, part.to(cdt), "k")  # [B, H, n, F]
            if fk.shape[-1] != n_feat:
                raise ValueError(f"feature_map gave {n_feat} features for q but {fk.shape[-1]} for k")
            yield fk if part_pad is None else fk * part_pad[:, None, :, None].to(cdt)  # padded keys: nothing

    st = check_state(state, b, h, n_feat, v.shape[-1], cdt, q.device)
    out, new_state = feature_attention(fq_fn, fk_fn, v.to(cdt), n_q, n_feat, causal=causal, form=form,
                                       chunk_size=chunk, state=st, eps=float(eps))
    out = out.to(q.dtype)
    return (out, new_state) if return_state else out
