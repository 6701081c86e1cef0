"""xLSTM (``xlstm``) -> :class:`~attnzoo.DecoderLM`: ``xLSTMForCausalLM`` and ``xLSTMModel``
(NX-AI's xLSTM-7b: mLSTM blocks).

Line numbers below are transformers 5.25's ``models/xlstm/modeling_xlstm.py`` /
``configuration_xlstm.py``, its native path (the one without the ``xlstm`` package). Every block
is pre-norm (modeling 1173-1203)::

    h = h + mlstm(norm_mlstm(h));   h = h + ffn(norm_ffn(h))

with RMSNorms of epsilon ``norm_eps`` (weight, and a bias with ``use_bias``; modeling 851-906), a
final ``out_norm`` (weight only, modeling 1399; there whatever ``add_out_norm`` says), and the
LM head's logits soft-capped at ``output_logit_soft_cap`` (``c tanh(x / c)``, modeling 1574). The
head is its own ``lm_head`` even with ``tie_word_embeddings=True``: transformers'
``xLSTMForCausalLM`` declares no tied weights, so it never ties them, and neither does the
converted model.

* **The mLSTM layer** (:class:`MLSTMLayer`, ``xLSTMLayer``, modeling 1037-1170): ``q, k`` of
  ``int(C * qk_dim_factor)`` and ``v`` of ``int(C * v_dim_factor)`` channels in ``num_heads``
  heads, the output gate's pre-activation ``o`` (``v``'s width), per head an input and a forget
  gate pre-activation ``i, f`` (biases always), both soft-capped at ``gate_soft_cap``; then the
  mLSTM cell, a per-head LayerNorm (weight, a bias with ``use_bias``), ``sigmoid(o) * .`` and
  ``out_proj``. ``weight_mode="fused"`` stores ``[q; k; v; o]`` and ``[i; f]`` as one projection
  each (split at load).
* **The mLSTM cell** (modeling 388-449 per token; 74-240 in chunks), with ``s = d_qk ** -0.5``
  and the stabiliser ``m`` (``m_0 = 0``)::

      m_t = max(logsigmoid(f_t) + m_{t-1}, i_t)
      C_t = e^{logsigmoid(f_t) + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t v_t^T     (n_t alike with k_t)
      h_t = (s q_t . C_t) / (max(|s q_t . n_t|, e^{-m_t}) + eps)

  Since ``m_t`` is the running maximum of the log weights whatever the chunking, transformers'
  chunked kernel, its token loop and the split it makes for lengths off the chunk size compute one
  function; here :func:`mlstm_chunked` (chunks of ``chunk_size``; tested against the token loop
  :func:`mlstm_recurrent`), in float32 (float64 for float64 modules). The decode cache holds
  ``(C, n, m)`` per head (packed into one ``[H, d_qk + 1, d_v + 1]`` state).
* **The feed-forward** (modeling 990-1034): SwiGLU of width ``ffn_proj_factor * C`` rounded up to
  a multiple of ``ffn_round_up_to_multiple_of`` (``proj_up_gate``, ``proj_up``, ``proj_down``;
  fused: ``proj_up_gate_z`` rows ``[gate; up]``).

**Padding**: transformers takes no attention mask (its padded row depends on the padding). Here a
padded token neither writes nor decays the state (``i = -inf``, ``logsigmoid(f) = 0``), so a
padded row equals the row alone (the tests compare padded rows with transformers on each row
alone). Packed sequences (``cu_seqlens``) restart the state in every sequence.

Config keys a ``config.json`` leaves out take ``xLSTMConfig``'s defaults (:data:`DEFAULTS`;
``num_blocks`` / ``num_hidden_layers`` and ``embedding_dim`` / ``hidden_size`` stand for each
other, config 153-158). Accepted without effect on the outputs: ``mode``, ``chunk_size``,
``chunkwise_kernel``, ``sequence_kernel``, ``step_kernel``, ``autocast_kernel_dtype``,
``return_last_states``, ``max_inference_chunksize`` (how transformers schedules the same
computation; its ``mode="train"`` raises for lengths off the chunk size, attnzoo computes them),
``add_out_norm`` (transformers' model always has the final norm). ``norm_reduction_force_float32=False``
(the block norms reduce in the input's dtype) is not reproduced: in float32 the two agree, in
half precision attnzoo's norms reduce in float32. transformers' cache is sized by the config's
64-rounded ``qk_head_dim`` / ``v_head_dim``, which differ from the layers' when ``C *
qk_dim_factor`` is not a multiple of 64: its cached decode then fails, the full forward and
this conversion work. transformers' forward with ``use_cache=False`` over more than
``max_inference_chunksize`` tokens carries the states between its inference chunks in an
``xLSTMCache`` of its default dtype, bfloat16 (modeling 1454, 1343): rounded states (measured
5.7e-3 relative on the logits of a float32 model); with ``use_cache=True`` (its ``generate``) the
cache has the model's dtype and agrees with the float32 computation here. Its random
initialisation of ``weight_mode="fused"`` models fails (``_init_weights`` subtracts a ``[2H]``
tensor from the ``[H]`` half of the gate bias, modeling 1274-1281); loading a fused checkpoint
does not run it.
Refused by name: ``inference_state_dtype`` other than ``float32`` (the
states of transformers' token loop rounded), ``weight_mode`` other than ``single`` / ``fused``,
``embedding_dim != hidden_size``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int
from attnzoo.blocks import RMSNorm
from attnzoo.functional.recurrent._chunked_scan import compute_dtype
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.mamba2 import backbone_names
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.recurrent import HeadNorm, RecurrentMixer

__all__ = ["DEFAULTS", "DISPATCH", "BiasedRMSNorm", "MLSTMLayer", "build_xlstm", "canonical", "convert_xlstm",
           "mlstm_chunked", "mlstm_recurrent"]

#: ``xLSTMConfig``'s defaults of the keys read here (configuration_xlstm 120-151), for a ``config.json``
#: that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50304, "hidden_size": 4096, "num_hidden_layers": 32, "num_heads": 8, "use_bias": False,
    "tie_word_embeddings": False, "norm_eps": 1e-6, "qk_dim_factor": 0.5, "v_dim_factor": 1.0, "chunk_size": 64,
    "eps": 1e-6, "inference_state_dtype": "float32", "ffn_proj_factor": 2.667, "ffn_round_up_to_multiple_of": 64,
    "gate_soft_cap": 15.0, "output_logit_soft_cap": 30.0, "weight_mode": "single",
}

#: an mLSTM state: ``C [B, H, d_qk, d_v]``, ``n [B, H, d_qk]``, ``m [B, H]``
State = tuple[Tensor, Tensor, Tensor]


# --------------------------------------------------------------------------- the mLSTM cell
def _gates(i: Tensor, f: Tensor, real: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(log forget, input)`` gates ``[B, H, T]``: a padded token (``real`` False) gets
    ``logsigmoid(f) = 0`` and ``i = -inf`` (no decay, no write)."""
    logf = F.logsigmoid(f)
    if real is None:
        return logf, i
    keep = real[:, None, :]  # [B, 1, T]
    return logf * keep.to(logf.dtype), i.masked_fill(~keep, -torch.inf)


def _zeros(q: Tensor, v: Tensor) -> State:
    B, H, _, dk = q.shape
    return q.new_zeros(B, H, dk, v.shape[-1]), q.new_zeros(B, H, dk), q.new_zeros(B, H)


def mlstm_recurrent(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, state: State | None = None,
                    real: Tensor | None = None, eps: float = 1e-6) -> tuple[Tensor, State]:
    """The mLSTM cell token by token (transformers' ``mlstm_recurrent_step_native``; the reference
    :func:`mlstm_chunked` is tested against).

    Args:
        q, k: ``[B, H, T, d_qk]``. v: ``[B, H, T, d_v]``. i, f: the gates' pre-activations ``[B, H, T]``.
        state: ``(C, n, m)`` (see :data:`State`) or ``None`` (zeros).
        real: bool ``[B, T]`` (False: a padded token, which neither writes nor decays) or ``None``.
        eps: added to the denominator.

    Returns ``(h [B, H, T, d_v], state)``."""
    C, n, m = _zeros(q, v) if state is None else state
    logf, i = _gates(i, f, real)
    qs = q * q.shape[-1] ** -0.5
    out = []
    for t in range(q.shape[2]):
        m_new = torch.maximum(logf[..., t] + m, i[..., t])  # [B, H]
        decay, write = torch.exp(logf[..., t] + m - m_new), torch.exp(i[..., t] - m_new)
        C = decay[..., None, None] * C + write[..., None, None] * (k[:, :, t, :, None] * v[:, :, t, None, :])
        n = decay[..., None] * n + write[..., None] * k[:, :, t]
        m = m_new
        num = (qs[:, :, t, None, :] @ C)[:, :, 0]  # [B, H, d_v]
        den = torch.maximum((qs[:, :, t] * n).sum(-1).abs(), torch.exp(-m)) + eps
        out.append(num / den[..., None])
    h = torch.stack(out, dim=2) if out else v.new_zeros(v.shape)
    return h, (C, n, m)


def _chunk(q: Tensor, k: Tensor, v: Tensor, logf: Tensor, i: Tensor, state: State, eps: float) -> tuple[Tensor, State]:
    """One chunk of :func:`mlstm_chunked` (``L`` tokens): token ``t`` reads the carried state with the
    log weight ``b_t + m_0`` and token ``j <= t`` with ``b_t - b_j + i_j`` (``b`` the chunk's cumulative
    log forget gates), ``m_t`` their maximum."""
    C0, n0, m0 = state
    L = q.shape[2]
    b = logf.cumsum(-1)  # [B, H, L]
    logd = b[..., :, None] - b[..., None, :] + i[..., None, :]  # [B, H, L(t), L(j)]
    logd = logd.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), -torch.inf)
    inc = b + m0[..., None]  # [B, H, L]
    m = torch.maximum(inc, logd.amax(-1))  # [B, H, L]
    carried = torch.exp(inc - m)  # [B, H, L]
    qs = q * q.shape[-1] ** -0.5
    scores = (qs @ k.transpose(-1, -2)) * torch.exp(logd - m[..., None])  # [B, H, L, L]
    num = carried[..., None] * (qs @ C0) + scores @ v  # [B, H, L, d_v]
    qn = carried * (qs @ n0[..., None])[..., 0] + scores.sum(-1)  # [B, H, L]
    h = num / (torch.maximum(qn.abs(), torch.exp(-m)) + eps)[..., None]
    m_end = m[..., -1]  # [B, H]
    weights = torch.exp(b[..., -1:] - b + i - m_end[..., None])[..., None]  # [B, H, L, 1]
    kept = torch.exp(b[..., -1] + m0 - m_end)  # [B, H]
    C = kept[..., None, None] * C0 + (k * weights).transpose(-1, -2) @ v
    n = kept[..., None] * n0 + (k * weights).sum(-2)
    return h, (C, n, m_end)


def mlstm_chunked(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, state: State | None = None,
                  real: Tensor | None = None, eps: float = 1e-6, chunk_size: int = 64) -> tuple[Tensor, State]:
    """The mLSTM cell of :func:`mlstm_recurrent` (same arguments and results) in chunks of
    ``chunk_size`` tokens: within a chunk a masked ``[L, L]`` product, the state carried between
    chunks; exact to rounding, differentiable."""
    s = _zeros(q, v) if state is None else state
    logf, i = _gates(i, f, real)
    hs = []
    for a in range(0, q.shape[2], chunk_size):
        z = slice(a, a + chunk_size)
        h, s = _chunk(q[:, :, z], k[:, :, z], v[:, :, z], logf[..., z], i[..., z], s, eps)
        hs.append(h)
    return (torch.cat(hs, dim=2) if hs else v.new_zeros(v.shape)), s


def _soft_cap(t: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(t / cap)`` (modeling 55-72); ``None``: ``t``."""
    return t if cap is None else cap * torch.tanh(t / cap)


# --------------------------------------------------------------------------- the parts
class BiasedRMSNorm(RMSNorm):
    """:class:`~attnzoo.blocks.RMSNorm` plus a bias: ``weight * x / rms(x) + bias`` (xLSTM's block
    norms with ``use_bias``). Shapes: ``[..., C] -> [..., C]``."""

    def __init__(self, dim: int, eps: float = 1e-6, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, eps, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.bias.to(x.dtype)


class MLSTMLayer(RecurrentMixer):
    """xLSTM's mLSTM layer (``xLSTMLayer``, see the module docstring) on the
    :class:`~attnzoo.nn.recurrent.RecurrentMixer` protocol.

    Args:
        dim: ``C``. num_heads: ``H``. qk_dim, v_dim: the widths of ``q, k`` and of ``v`` (each a
            multiple of ``H``).
        bias: biases on ``q/k/v/o/out_proj`` and the head norm (``use_bias``; the gates always have them).
        gate_soft_cap: the gates' soft cap (``None``: none). eps: the cell's. norm_eps: the head norm's.
        chunk_size: :func:`mlstm_chunked`'s chunk length.

    Weights: ``q_proj``, ``k_proj [qk_dim, C]``, ``v_proj``, ``o_proj [v_dim, C]``, ``i_proj``,
    ``f_proj [H, C]`` with biases, ``norm`` (a per-head LayerNorm, ``weight [H, d_v]``), ``out_proj [C, v_dim]``.

    Shapes: ``forward(x [B, N, C]) -> [B, N, C]``; key padding, the cache (the state ``[B, H, d_qk + 1,
    d_v + 1]``) and ``cu_seqlens`` as :class:`RecurrentMixer`.
    """

    def __init__(self, dim: int, num_heads: int, qk_dim: int, v_dim: int, *, bias: bool = False,
                 gate_soft_cap: float | None = 15.0, eps: float = 1e-6, norm_eps: float = 1e-6, chunk_size: int = 64,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        H = check_int(num_heads, "num_heads", owner="MLSTMLayer")
        for name, width in (("qk_dim", qk_dim), ("v_dim", v_dim)):
            if check_int(width, name, owner="MLSTMLayer") % H:
                raise ValueError(f"MLSTMLayer: {name} ({width}) must be a multiple of num_heads ({H})")
        super().__init__(dim, H, head_dim=qk_dim // H, bias=bias, layout="q_k_v", factory=fk)
        self.v_head_dim = v_dim // H
        self.set_value_heads(None, self.v_head_dim, bias, fk)
        self.o_proj = nn.Linear(dim, v_dim, bias=bias, **fk)
        self.i_proj, self.f_proj = nn.Linear(dim, H, **fk), nn.Linear(dim, H, **fk)
        self.norm = HeadNorm(H, self.v_head_dim, "layer", norm_eps, fk)
        if not bias:
            self.norm.bias = None
        self.gate_soft_cap = None if gate_soft_cap is None else float(gate_soft_cap)
        self.eps, self.chunk_size = float(eps), check_int(chunk_size, "chunk_size", owner="MLSTMLayer")
        self.conv_channels, self.conv_size = {}, 0
        self.state_shape = (H, self.head_dim + 1, self.v_head_dim + 1)

    def _unpack(self, state: Tensor) -> State:
        """The cache's ``[B, H, d_qk + 1, d_v + 1]`` -> ``(C, n, m)``."""
        dk, dv = self.head_dim, self.v_head_dim
        return state[:, :, :dk, :dv], state[:, :, :dk, dv], state[:, :, dk, 0]

    @staticmethod
    def _pack(state: State) -> Tensor:
        C, n, m = state
        top = torch.cat([C, n[..., None]], dim=-1)  # [B, H, d_qk, d_v + 1]
        bottom = torch.cat([m[..., None], m.new_zeros(*m.shape, C.shape[-1])], dim=-1)[:, :, None]
        return torch.cat([top, bottom], dim=2)

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        dt = compute_dtype(x.dtype)
        q, k = self.heads(self.q_proj(x)).to(dt), self.heads(self.k_proj(x)).to(dt)  # [B, H, N, d_qk]
        v = self.heads(self.v_proj(x), self.v_head_dim).to(dt)  # [B, H, N, d_v]
        i = _soft_cap(self.i_proj(x), self.gate_soft_cap).transpose(1, 2).to(dt)  # [B, H, N]
        f = _soft_cap(self.f_proj(x), self.gate_soft_cap).transpose(1, 2).to(dt)
        if cu is None:
            s0 = None if state is None else self._unpack(state.to(dt))
            h, s = mlstm_chunked(q, k, v, i, f, s0, pad, self.eps, self.chunk_size)
        else:  # each packed sequence from zeros
            h = torch.cat([mlstm_chunked(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], i[..., a:b], f[..., a:b],
                                         eps=self.eps, chunk_size=self.chunk_size)[0]
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)], dim=2)
            s = _zeros(q[:1], v[:1])
        y = self.norm(h).to(x.dtype).transpose(1, 2).flatten(2)  # [B, N, v_dim]
        return self.out_proj(torch.sigmoid(self.o_proj(x)) * y), self._pack(s), {}

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, qk_head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, gate_soft_cap={self.gate_soft_cap}, eps={self.eps}, "
                f"chunk_size={self.chunk_size}")


# --------------------------------------------------------------------------- the config
def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: :data:`DEFAULTS` where a key is absent, ``num_blocks`` /
    ``num_hidden_layers`` and ``embedding_dim`` / ``hidden_size`` standing for each other (config
    153-158), the head never tied (``xLSTMForCausalLM`` declares no tied weights)."""
    out = hf.with_defaults(DEFAULTS)
    data = out.data
    for key, alias in (("hidden_size", "embedding_dim"), ("num_hidden_layers", "num_blocks")):
        if hf.raw(key) is None and hf.raw(alias) is not None:
            data[key] = hf.raw(alias)
    if data.get("num_blocks") is not None:  # transformers builds num_blocks blocks
        data["num_hidden_layers"] = data["num_blocks"]
    data["tie_word_embeddings"] = False  # xLSTMForCausalLM ties nothing, whatever the flag says
    emb = data.get("embedding_dim")
    if emb is not None and emb != data["hidden_size"]:
        raise out.unsupported(f"embedding_dim={emb} != hidden_size={data['hidden_size']} (the blocks read "
                              f"hidden_size channels)")
    return out


def _widths(hf: HFConfig) -> tuple[int, int, int]:
    """``(qk_dim, v_dim, ffn width)`` as the layers build them (modeling 993-996, 1042-1043)."""
    C = hf.req("hidden_size")
    qk, v = int(C * hf.req("qk_dim_factor", float)), int(C * hf.req("v_dim_factor", float))
    multiple = hf.req("ffn_round_up_to_multiple_of")
    up = int(((C * hf.req("ffn_proj_factor", float) + multiple - 1) // multiple) * multiple)
    H = hf.req("num_heads")
    if qk % H or v % H or min(qk, v, up) < 1:
        raise CheckpointFormatError(f"{hf.source}: q/k width {qk} and v width {v} must be multiples of num_heads "
                                    f"({H}), the feed-forward width ({up}) >= 1")
    return qk, v, up


def build_xlstm(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of an ``xLSTMConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    parts.unsupported_keys(hf, {"inference_state_dtype": lambda v: v == "float32",
                                "weight_mode": lambda v: v in ("single", "fused")})
    C, H, depth = hf.req("hidden_size"), hf.req("num_heads"), hf.req("num_hidden_layers")
    qk, v, up = _widths(hf)
    bias, eps, kw = hf.req("use_bias", bool), hf.req("norm_eps", float), {"device": device, "dtype": dtype}
    caps = {k: hf.req(k, float) for k in ("gate_soft_cap", "output_logit_soft_cap")}

    def mixer() -> MLSTMLayer:
        return MLSTMLayer(C, H, qk, v, bias=bias, gate_soft_cap=caps["gate_soft_cap"], eps=hf.req("eps", float),
                          norm_eps=eps, chunk_size=hf.req("chunk_size"), **kw)

    def norm() -> nn.Module:
        return BiasedRMSNorm(C, eps, **kw) if bias else RMSNorm(C, eps, **kw)

    ffn = parts.gated_mlp(C, up, "swiglu", bias=bias, **kw)
    blocks = [parts.block(C, mixer, ffn, norm) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, logit_softcap=caps["output_logit_soft_cap"],
                         heads=H, **kw)


# --------------------------------------------------------------------------- the weights
def _put_split(plan: Plan, key: str, targets: Sequence[tuple[str, int]], bias: bool) -> None:
    """Rows of the fused projection ``key`` (``.weight``, and ``.bias`` with ``bias``) cut into
    ``targets`` (``(attnzoo name, rows)``, in order)."""
    for suffix in ("weight", "bias") if bias else ("weight",):
        t = plan.src.take(f"{key}.{suffix}")
        if t is None:
            continue
        start = 0
        for name, rows in targets:
            plan.put_tensor(f"{name}.{suffix}", t[start:start + rows], f"{plan.src.prefix}{key}.{suffix}"
                                                                       f"[{start}:{start + rows}]")
            start += rows


def _put_block(plan: Plan, i: int, hf: HFConfig, widths: tuple[int, int, int]) -> None:
    """Block ``i``: its norms, mLSTM layer and feed-forward (single or fused weights)."""
    o, h, bias = f"blocks.{i}.", f"blocks.{i}.", hf.req("use_bias", bool)
    (qk, v, up), H, a, m = widths, hf.req("num_heads"), f"blocks.{i}.attn.", f"blocks.{i}.mlstm_layer."
    plan.put_pairs(o, h, [("attn_norm", "norm_mlstm"), ("ffn_norm", "norm_ffn")], bias=bias)
    plan.put_pairs(a, m, [("out_proj", "out_proj")], bias=bias)
    plan.put(f"{a}norm.weight", f"{m}multihead_norm.weight", lambda t: t.reshape(H, -1))
    if bias:
        plan.put(f"{a}norm.bias", f"{m}multihead_norm.bias", lambda t: t.reshape(H, -1))
    if hf.req("weight_mode", str) == "fused":
        _put_split(plan, f"{m}qkv_opreact", [(f"{a}{n}_proj", w) for n, w in zip("qkvo", (qk, qk, v, v), strict=True)],
                   bias)
        _put_split(plan, f"{m}ifgate_preact", [(f"{a}i_proj", H), (f"{a}f_proj", H)], True)
        _put_split(plan, f"{h}ffn.proj_up_gate_z", [(f"{o}ffn.gate_proj", up), (f"{o}ffn.up_proj", up)], bias)
    else:
        plan.put_pairs(a, m, [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "ogate_preact")], bias=bias)
        plan.put_pairs(a, m, [("i_proj", "igate_preact"), ("f_proj", "fgate_preact")])
        plan.put_pairs(f"{o}ffn.", f"{h}ffn.", [("gate_proj", "proj_up_gate"), ("up_proj", "proj_up")], bias=bias)
    plan.put_pairs(f"{o}ffn.", f"{h}ffn.", [("down_proj", "proj_down")], bias=bias)


def convert_xlstm(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build an xLSTM decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, backbone_names(sd), build_xlstm, device=device, dtype=dtype)
    widths = _widths(hf)
    for i in range(model.depth):
        _put_block(plan, i, hf, widths)
    return parts.finish(plan, model, head_size, final_norm="out_norm")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"xlstm": parts.Dispatch("xLSTM", convert_xlstm, ("xLSTMForCausalLM", "xLSTMModel"))}
