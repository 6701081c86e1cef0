"""attnzoo's kernels behind transformers' linear-attention hooks (called by
:func:`attnzoo.hf.register`).

transformers 5.x reaches the linear-attention kernels of its hybrid models (Qwen3-Next, Qwen3.5,
Qwen3.5-MoE, OLMo-hybrid, Kimi Linear) and of its Mamba-2 models (Mamba-2, Bamba, Granite-MoE-hybrid,
Zamba2, Falcon-H1, Nemotron-H), of its Mamba-1 models (Mamba, FalconMamba, Jamba, Zamba), of the
2026 linear hybrids (Bailing-hybrid, GLM-5-Next and Kimi Linear: KDA; Qwen4-Exp and Lara-mini:
gated DeltaNet) and of LFM2 / LFM2-MoE / LFM3 / Inkling (their short convolutions) through
module-level functions decorated with ``use_kernel_func_from_hub_with_fallback``: a hub kernel,
else the ``fla`` / ``causal_conv1d`` package, else a slow PyTorch loop that refuses packed
sequences (LFM2's fallback convolution runs them, reading across the sequence boundaries). :func:`install` replaces
those module functions with attnzoo's exact kernels:

* ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (gated DeltaNet) and
  ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` (KDA, a decay per key
  channel) -> :func:`attnzoo.delta_rule` (chunked WY form; grouped value heads natively, q/k
  never expanded), ``cu_seqlens`` (or ``cu_seq_lens_q``) keeping packed sequences apart;
* ``causal_conv1d_fn`` / ``causal_conv1d_update`` -> a depthwise causal conv that, given
  ``cu_seq_lens_q`` or ``seq_idx``, never reads across a packed sequence boundary;
* ``mamba2_chunk_scan`` (Mamba-2's SSD scan, hub name ``mamba_chunk_scan_combined``) ->
  :func:`attnzoo.gated_linear_attention` with one decay per head and token (``q = C``, ``k = B``,
  ``v = x dt``, ``log_decay = dt A``, scale 1; B/C groups as grouped value heads), packed with
  ``cu_seq_lens_q`` or ``seq_idx`` (transformers' own fallback ignores both and lets the state
  flow from one packed sequence into the next); ``mamba2_selective_state_update`` (one decode
  step) -> the same recurrence, one token.

* ``mamba_selective_scan`` (Mamba-1's scan, hub name ``selective_scan_fn``; Mamba, FalconMamba,
  Jamba, Zamba) -> :func:`attnzoo.selective_scan`; ``mamba_selective_state_update`` (one decode
  step) -> the Mamba-2 step with one head; ``mamba_scan_forward`` (the layer's scan with its cache;
  Mamba, FalconMamba, Jamba) -> :func:`mamba_scan_forward`, which starts from the cached state
  (transformers' own ignores it when more than one token follows a filled cache) and keeps packed
  sequences apart (``cu_seq_lens_q`` / ``seq_idx``). ``mamba_inner_fn`` (the fused training path,
  ``None`` without the CUDA package) is left as it is: the unfused path it falls back to is served.

Layouts are transformers': ``q, k [B, N, Hk, Dk]``, ``v [B, N, Hv, Dv]``, ``g`` (log decay)
``[B, N, Hv]`` or ``[B, N, Hv, Dk]``, ``beta [B, N, Hv]``, states ``[B, Hv, Dk, Dv]`` (``[S, ...]``
packed); conv inputs ``[B, C, N]``, weights ``[C, K]``, states ``[B, C, S]``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.functional.recurrent.delta_rule import delta_rule
from attnzoo.functional.recurrent.gla import gated_linear_attention
from attnzoo.functional.recurrent.selective_scan import selective_scan
from attnzoo.models.families.qwen3_next import causal_conv, segment_ids

__all__ = ["HOOKS", "ORIGINALS", "causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule", "install",
           "mamba1_scan", "mamba1_state_update", "mamba_scan_forward", "ssd_chunk_scan", "ssd_state_update"]

#: transformers model modules with linear-attention hooks
MODULES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "glm5_next",
           "qwen4_exp", "lara_mini", "mamba2", "bamba", "granitemoehybrid", "zamba2", "falcon_h1", "nemotron_h",
           "mamba", "falcon_mamba", "jamba", "zamba", "lfm2", "lfm2_moe", "lfm3", "inkling", "inkling2",
           "inkling2_loop")
#: (module, function name) -> the transformers function it replaced
ORIGINALS: dict[tuple[str, str], Callable[..., Any]] = {}


def _l2(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _packed(kwargs: dict[str, Any]) -> Tensor | None:
    cu = kwargs.get("cu_seqlens")
    return kwargs.get("cu_seq_lens_q") if cu is None else cu


def _boundaries(kwargs: dict[str, Any], owner: str) -> Tensor | None:
    """int32 ``cu_seqlens [S+1]`` from ``cu_seqlens`` / ``cu_seq_lens_q`` or from ``seq_idx [1, N]``
    (the sequence index of each packed token), None when the input is not packed."""
    cu = _packed(kwargs)
    if cu is not None:
        return cu.to(torch.int32)
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is None:
        return None
    if not isinstance(seq_idx, Tensor) or seq_idx.dim() != 2 or seq_idx.shape[0] != 1:
        raise ValueError(f"{owner}: seq_idx must be a tensor [1, N] (packed), got "
                         f"{tuple(seq_idx.shape) if isinstance(seq_idx, Tensor) else type(seq_idx).__name__}")
    ids = seq_idx[0]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    end = torch.tensor([ids.numel()], device=ids.device)
    return torch.cat([starts.nonzero().reshape(-1), end]).to(torch.int32)


def _time_steps(dt: Tensor, dt_bias: Tensor | None, softplus: bool, limit: tuple[float, float], cdt: torch.dtype) -> Tensor:
    """Mamba-2's step sizes: ``dt + dt_bias``, softplus when asked, clamped to ``limit``."""
    dt = dt.to(cdt)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cdt)
    if softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=limit[0], max=limit[1])


def ssd_chunk_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                   D: Tensor | None = None, dt_bias: Tensor | None = None, initial_states: Tensor | None = None,
                   dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                   return_final_states: bool = False, **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-2's SSD scan in transformers' layout.

    ``hidden_states x [B, N, H, P]``, ``dt [B, N, H]``, ``A [H]`` (``< 0``), ``B``/``C``
    ``[B, N, G, Ns]`` (``H % G == 0``: head ``h`` reads group ``h // (H / G)``), ``D [H]``,
    ``initial_states [B, H, P, Ns]``. With ``dt`` the step sizes (:func:`_time_steps`), the state
    ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T`` and ``y_t = S_t C_t + D x_t``. Returns
    ``y [B, N, H, P]`` in float32 (float64 for float64 input), as transformers' fallback, and with
    ``return_final_states`` the last state ``[B, H, P, Ns]``. Packed input (``cu_seq_lens_q`` or
    ``seq_idx``, ``B == 1``) restarts the state at every sequence start."""
    owner = "mamba2_chunk_scan"
    if kwargs.get("z") is not None:
        raise NotImplementedError(f"{owner}: z (a gate inside the scan) is not served; the models gate after it")
    cdt = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    step = _time_steps(dt, dt_bias, dt_softplus, dt_limit, cdt).transpose(1, 2)  # [B, H, N]
    x = hidden_states.to(cdt).transpose(1, 2)  # [B, H, N, P]
    q, k = (t.to(cdt).transpose(1, 2) for t in (C, B))  # [B, G, N, Ns]
    cu = _boundaries(kwargs, owner)
    if cu is not None and return_final_states:
        raise ValueError(f"{owner}: packed input (cu_seq_lens_q / seq_idx) has one final state per sequence; "
                         f"return_final_states=True expects one per batch row")
    s0 = None if initial_states is None else initial_states.to(cdt).transpose(-1, -2)  # [B, H, Ns, P]
    y, state = gated_linear_attention(q, k, x * step[..., None], A.to(cdt)[:, None] * step, scale=1.0,
                                      initial_state=s0, return_state=True, chunk_size=chunk_size, cu_seqlens=cu)
    if D is not None:
        y = y + D.to(cdt)[:, None, None] * x
    out = y.transpose(1, 2).contiguous()  # [B, N, H, P]
    return (out, state.transpose(-1, -2)) if return_final_states else out


def ssd_state_update(state: Tensor, hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                     D: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
                     z: Tensor | None = None, **kwargs: Any) -> Tensor:
    """One Mamba-2 decode step (``selective_state_update``): ``state [B, H, P, Ns]`` (updated in
    place), ``hidden_states x [B, H, P]``, ``dt [B, H, P]``, ``A [H, P, Ns]``, ``B``/``C [B, G, Ns]``,
    ``D``/``dt_bias [H, P]``; ``S = exp(dt A) S + dt x B^T``, ``y = S C + D x`` (times
    ``silu(z)`` when given). Returns ``y [B, H, P]`` in ``hidden_states``' dtype."""
    cdt = torch.float64 if state.dtype == torch.float64 else torch.float32
    step = _time_steps(dt, dt_bias, dt_softplus, (0.0, float("inf")), cdt)  # [B, H, P]
    groups = state.shape[1] // B.shape[1]
    Bh, Ch = (t.to(cdt).repeat_interleave(groups, dim=1)[:, :, None, :] for t in (B, C))  # [B, H, 1, Ns]
    x = hidden_states.to(cdt)
    new = state.to(cdt) * torch.exp(step[..., None] * A.to(cdt)) + (step * x)[..., None] * Bh
    state.copy_(new.to(state.dtype))
    y = (new * Ch).sum(-1)  # [B, H, P]
    if D is not None:
        y = y + D.to(cdt) * x
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y.to(hidden_states.dtype)


def mamba1_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
                return_last_state: bool = False, use_mambapy: bool = False, use_associative_scan: bool = False,
                **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-1's selective scan (``mamba_selective_scan``) in transformers' layout: ``x``, ``dt``,
    ``z [B, I, T]``, ``A [I, N]``, ``B``/``C [B, N, T]``, ``D``/``delta_bias [I]``. Returns
    ``y [B, I, T]`` in float32 (float64 for float64 input), as transformers' fallback, and with
    ``return_last_state`` the state ``[B, I, N]``; ``cu_seq_lens_q`` / ``seq_idx`` pack sequences.
    ``use_mambapy`` / ``use_associative_scan`` pick other loops for the same scan: ignored."""
    cdt = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    return selective_scan(hidden_states.to(cdt), dt, A, B, C, D, z, delta_bias=delta_bias,
                          delta_softplus=delta_softplus, return_last_state=return_last_state,
                          cu_seqlens=_boundaries(kwargs, "mamba_selective_scan"))


def mamba1_state_update(state: Tensor, hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                        D: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
                        z: Tensor | None = None, **kwargs: Any) -> Tensor:
    """One Mamba-1 decode step (``mamba_selective_state_update``): ``state [B, I, N]`` (updated in
    place), ``hidden_states``/``dt``/``z [B, I]``, ``A [I, N]``, ``B``/``C [B, N]``,
    ``D``/``dt_bias [I]``: :func:`ssd_state_update` with one head of ``I`` channels."""
    return ssd_state_update(state[:, None], hidden_states[:, None], dt[:, None], A[None], B[:, None], C[:, None],
                            D=None if D is None else D[None], dt_bias=None if dt_bias is None else dt_bias[None],
                            dt_softplus=dt_softplus, z=None if z is None else z[:, None])[:, 0]


def _scan_rest(module: Any, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, gate: Tensor,
               state: Tensor, bias: Tensor | None) -> tuple[list[Tensor], list[Tensor]]:
    """The last tokens one at a time (a cache that records each step's state): outputs
    ``[B, I, 1]`` and the states after each token."""
    outs, states = [], []
    for t in range(x.shape[-1]):
        outs.append(mamba1_state_update(state, x[..., t], dt[..., t], A, B[:, t], C[:, t], module.D,
                                        dt_bias=bias, dt_softplus=True, z=gate[..., t])[..., None])
        states.append(state.clone())
    return outs, states


def mamba_scan_forward(module: Any, hidden_states: Tensor, time_step: Tensor, B: Tensor, C: Tensor, gate: Tensor,
                       cache: Any, **kwargs: Any) -> Tensor:
    """A Mamba-1 layer's scan with its cache (transformers' ``mamba_scan_forward``; ``x``, ``time_step``,
    ``gate [B, I, T]``, ``B``/``C [B, T, N]``; the parameters read from ``module``). One token after a
    filled cache: one step. Otherwise the scan starts from the cached state (zeros for an empty
    cache); packed input (``cu_seq_lens_q`` / ``seq_idx``, no cache) restarts it at every sequence;
    a cache that records the last tokens' states gets them one step at a time, as transformers does."""
    owner, layer = "mamba_scan_forward", module.layer_idx
    state = cache.get_recurrent_state(layer, state_idx=0) if cache is not None else None
    A = -torch.exp(module.A_log.float())
    bias = module.dt_proj.bias.float() if module.dt_proj.bias is not None else None
    T = hidden_states.shape[-1]
    if state is not None and T == 1:
        state = state.clone()
        out = mamba1_state_update(state, hidden_states[..., 0], time_step[..., 0], A, B[:, 0], C[:, 0], module.D,
                                  dt_bias=bias, dt_softplus=True, z=gate[..., 0])[..., None]
        cache.update_recurrent_state(state, layer)
        return out
    cu = _boundaries(kwargs, owner)
    if cu is not None and cache is not None:
        raise ValueError(f"{owner}: packed input (cu_seq_lens_q / seq_idx) with a cache: the cache holds one state "
                         f"per batch row, a packed row holds several sequences")
    rest = min(cache.get_recurrent_states_to_keep(layer), T) if cache is not None else 0
    split = T - rest
    cdt = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    outs: list[Tensor] = []
    if split > 0:
        y, state = selective_scan(hidden_states[..., :split].to(cdt), time_step[..., :split], A,
                                  B[:, :split].transpose(1, 2), C[:, :split].transpose(1, 2), module.D.float(),
                                  gate[..., :split], delta_bias=bias, delta_softplus=True, initial_state=state,
                                  return_last_state=True, cu_seqlens=cu)
        outs.append(y)
    if state is None:
        state = A.new_zeros(hidden_states.shape[0], *A.shape)
    more, states = _scan_rest(module, hidden_states[..., split:], time_step[..., split:], A, B[:, split:],
                              C[:, split:], gate[..., split:], state, bias)
    if cache is not None:
        cache.update_recurrent_state(states if states else state, layer)
    return torch.cat(outs + more, dim=-1)


def chunk_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule (per-head ``g [B, N, Hv]`` or per-channel ``[B, N, Hv, Dk]`` log
    decays) in transformers' layout: ``(out [B, N, Hv, Dv] in query's dtype, final state float32
    or None)``. q/k are L2-normalised (eps ``1e-6``, in float32) when asked; the scale is
    ``Dk ** -0.5``; ``cu_seqlens`` / ``cu_seq_lens_q`` (``B == 1``) packs sequences; ``beta`` in
    ``[0, 2]`` (OLMo-hybrid's negative eigenvalues) runs as ``sqrt(2) k``, ``sqrt(2) v``, ``beta / 2``."""
    dtype = query.dtype
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (t.to(cdt).transpose(1, 2) for t in (query, key, value))  # [B, H, N, D]
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    gt = g.to(cdt).transpose(1, 2)  # [B, Hv, N] or [B, Hv, N, Dk]
    bt = beta.to(cdt).transpose(1, 2)  # [B, Hv, N]
    if bool((bt > 1).any()):  # beta in [0, 2] (negative eigenvalues): the same update with sqrt(2) k, v
        k, v, bt = k * 2.0 ** 0.5, v * 2.0 ** 0.5, bt / 2
    cu = _packed(kwargs)
    s0 = None if initial_state is None else initial_state.to(cdt)
    out, state = delta_rule(q, k, v, bt, log_decay=gt.contiguous(), initial_state=s0, return_state=True,
                            chunk_size=chunk_size, cu_seqlens=None if cu is None else cu.to(torch.int32))
    return out.transpose(1, 2).to(dtype), (state if output_final_state else None)


def recurrent_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """The recurrent hook (decoding): the same rule, the same result as :func:`chunk_gated_delta_rule`."""
    kwargs.pop("chunk_size", None)
    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)


def _activate(x: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"causal_conv1d: activation must be None, 'silu' or 'swish', got {activation!r}")


def causal_conv1d_fn(hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None,
                     activation: str | None = None, **kwargs: Any) -> Tensor:
    """Depthwise causal conv of ``hidden_states [B, C, N]`` with ``weight [C, K]``; packed sequences
    stay apart with ``cu_seq_lens_q`` / ``cu_seqlens`` (``[S+1]``) or ``seq_idx`` (``[B, N]``)."""
    u = hidden_states.transpose(1, 2).to(weight.dtype)  # [B, N, C]
    cu, seq_idx = _packed(kwargs), kwargs.get("seq_idx")
    segments = None
    if cu is not None:
        segments = segment_ids(cu, u.shape[1])
    elif seq_idx is not None:
        if seq_idx.shape[0] != 1:
            raise ValueError(f"causal_conv1d_fn: seq_idx must be [1, N] (packed), got {tuple(seq_idx.shape)}")
        segments = seq_idx[0]
    out = _activate(causal_conv(u, weight, bias, segments=segments), activation)
    return out.transpose(1, 2).to(hidden_states.dtype)


def causal_conv1d_update(hidden_states: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None,
                         activation: str | None = None, **kwargs: Any) -> Tensor:
    """One decode step (or a few): ``hidden_states [B, C, n]`` after ``conv_state [B, C, S]``
    (updated in place with the last ``S`` inputs); returns ``[B, C, n]``."""
    K, S = weight.shape[-1], conv_state.shape[-1]
    full = torch.cat([conv_state, hidden_states.to(conv_state.dtype)], dim=-1)  # [B, C, S + n]
    prefix = full[..., S - (K - 1): S].transpose(1, 2).to(weight.dtype) if S >= K - 1 else None
    out = causal_conv(hidden_states.transpose(1, 2).to(weight.dtype), weight, bias, prefix=prefix)
    conv_state.copy_(full[..., -S:])
    return _activate(out, activation).transpose(1, 2).to(hidden_states.dtype)


#: transformers function name -> attnzoo's implementation
HOOKS: dict[str, Callable[..., Any]] = {
    "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
    "torch_recurrent_gated_delta_rule": recurrent_gated_delta_rule,
    "chunk_kimi_delta_attention": chunk_gated_delta_rule,
    "recurrent_kimi_delta_attention": recurrent_gated_delta_rule,
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "mamba2_chunk_scan": ssd_chunk_scan,
    "mamba2_selective_state_update": ssd_state_update,
    "mamba_selective_scan": mamba1_scan,
    "mamba_selective_state_update": mamba1_state_update,
    "mamba_scan_forward": mamba_scan_forward,
}


def install() -> list[str]:
    """Serve every hook of :data:`HOOKS` in the transformers model modules of :data:`MODULES`
    that exist (idempotent; the originals are kept in :data:`ORIGINALS`). Returns the
    ``"module.function"`` names served."""
    served = []
    for name in MODULES:
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:  # an older transformers without this model
            continue
        for fn, ours in HOOKS.items():
            if not hasattr(module, fn):
                continue
            ORIGINALS.setdefault((name, fn), getattr(module, fn))
            setattr(module, fn, ours)
            served.append(f"{name}.{fn}")
    return served
