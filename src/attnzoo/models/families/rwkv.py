"""RWKV-4 (``rwkv``) -> :class:`~attnzoo.DecoderLM`: ``RwkvForCausalLM`` and ``RwkvModel``
(BlinkDL's RWKV-4 "Pile" / "Raven" models, ``RWKV/rwkv-4-*``).

Line numbers below are transformers 5.25's ``models/rwkv/modeling_rwkv.py`` /
``configuration_rwkv.py``. Every layer is pre-norm with LayerNorms (biases, epsilon
``layer_norm_epsilon``; modeling 325-353), the first one's input normalised once more
(``pre_ln``: here the embedding's norm, :class:`~attnzoo.models.families.minimax.NormedEmbedding`)::

    h = h + time_mix(ln1(h));   h = h + channel_mix(ln2(h))

and the final ``ln_out`` is a LayerNorm of epsilon ``1e-5`` whatever the config says (modeling 491).

* **Token shift** (modeling 249-256, 305-311): each mix reads its input ``x_t`` and the previous
  token's ``x_{t-1}`` (zeros before the first), mixed per channel ``x_t mu + x_{t-1} (1 - mu)``.
* **Time mixing** (:class:`RwkvTimeMix`, ``RwkvSelfAttention``, modeling 217-284): ``r, k, v``
  from three such mixes (``time_mix_receptance`` / ``_key`` / ``_value``) through
  ``receptance`` / ``key`` / ``value`` (``C -> A``, ``A = attention_hidden_size``), then
  ``output(sigmoid(r) * wkv)`` with the WKV recurrence per channel (modeling 162-203), ``w =
  exp(time_decay)``, ``u = time_first``::

      wkv_t = (a_{t-1} + e^{u + k_t} v_t) / (b_{t-1} + e^{u + k_t})
      a_t = e^{-w} a_{t-1} + e^{k_t} v_t,   b_t = e^{-w} b_{t-1} + e^{k_t}

  computed here in chunks (:func:`wkv`: within a chunk a softmax-like weighted sum over the
  chunk's tokens and the carried state, with the running maximum subtracted as transformers'
  loop does; :func:`wkv_recurrent` is the token loop it is tested against), in float32 (float64
  for float64 modules). The decode cache is the state ``(a, b, p)`` (scaled by ``e^p``) per
  channel and the last input of the shift.
* **Channel mixing** (:class:`RwkvChannelMix`, ``RwkvFeedForward``, modeling 287-322):
  ``sigmoid(receptance(x_r)) * value(relu(key(x_k))^2)`` (``key`` ``C -> intermediate_size``).

**Rescaling** (``rescale_every``, modeling 584-590, 613-632): transformers' ``RwkvModel`` in eval mode
divides, in place, ``output.weight`` and ``value.weight`` of layer ``i`` by ``2 ** (i //
rescale_every)`` and halves the hidden states after every ``rescale_every``-th layer (in
training mode it restores the weights and does neither). The converted model does the same at
run time (the checkpoint's weights are kept; the inputs of those two projections are scaled,
which is the same arithmetic exactly) in eval mode, and neither in training mode. In float32 the
two modes differ only through the LayerNorms' epsilon (``LN(x / s)`` is ``LN(x)`` with epsilon
``eps * s^2``). Caveat: transformers rescales the weights in place at the first eval forward,
so a model that has already run in eval mode holds (and ``save_pretrained`` writes) rescaled
weights; convert (or save) it before its first eval forward, or after a forward in training mode.

**Padding**: transformers ignores the attention mask (modeling 546; its padded row depends on the
padding). Here a padded token neither writes nor decays the state and feeds zeros to the token
shift, so a padded row equals the row alone (the tests compare padded rows with transformers on
each row alone). **transformers' cached decode** of a batch of more than one row is broken in
5.25 (the one-token shift broadcasts ``[B, 1, C]`` against ``[B, C]`` into ``[B, B, C]``, modeling
251 / 307): its ``generate`` of a batch of 2 differs from its own greedy full forward; a batch of
1 is right, and attnzoo's decode equals its full forward for any batch. With
``attention_hidden_size != hidden_size`` transformers runs only with ``use_cache=False`` (its
state is ``hidden_size`` wide, modeling 560); this conversion runs either way.

The model is an :class:`RwkvLM` (a ``LayerLoopLM`` running :class:`RwkvLayer` layers and the
halving); caches, packed sequences (``cu_seqlens``: the shift and the state restart in every
sequence) and ``generate`` are ``DecoderLM``'s. ``time_decay`` and ``time_first`` stay float32
under half-precision casts (transformers' ``_keep_in_fp32_modules``). Keys a ``config.json``
leaves out take ``RwkvConfig``'s defaults (:data:`DEFAULTS`; ``attention_hidden_size`` =
``hidden_size``, ``intermediate_size`` = ``4 * hidden_size``). Nothing is refused:
``context_length`` only bounds transformers' CUDA kernel (here the model's ``max_seq_len``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int
from attnzoo.functional.recurrent._chunked_scan import compute_dtype
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.minimax import NormedEmbedding
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.cache import CacheList, SnapshotCache
from attnzoo.nn.feature_attention import key_padding_from_mask
from attnzoo.nn.recurrent import RecurrentMixer

__all__ = ["DEFAULTS", "DISPATCH", "RwkvChannelMix", "RwkvLM", "RwkvLayer", "RwkvTimeMix", "ShiftCache",
           "build_rwkv", "convert_rwkv", "token_shift", "wkv", "wkv_recurrent"]

#: ``RwkvConfig``'s defaults of the keys read here (configuration_rwkv 54-66), for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {"vocab_size": 50277, "context_length": 1024, "hidden_size": 4096, "num_hidden_layers": 32,
                            "layer_norm_epsilon": 1e-5, "rescale_every": 6, "tie_word_embeddings": False}
#: the chunk length of :func:`wkv`
CHUNK_SIZE = 32


# --------------------------------------------------------------------------- the WKV recurrence
def wkv_recurrent(w: Tensor, u: Tensor, k: Tensor, v: Tensor, state: Tensor | None = None,
                  real: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The WKV recurrence token by token (the reference :func:`wkv` is tested against; transformers'
    ``rwkv_linear_attention_cpu`` with padding).

    Args:
        w: the decay rates ``exp(time_decay) [A]`` (> 0). u: the bonus ``time_first [A]``.
        k, v: ``[B, T, A]``.
        state: ``[B, A, 3]``, ``(a, b, p)`` (numerator and denominator scaled by ``e^p``; ``b = 0``:
            empty), or ``None`` (empty).
        real: bool ``[B, T]`` (False: a padded token, which neither writes nor decays) or ``None``.

    Returns ``(wkv [B, T, A], state [B, A, 3])`` in ``k``'s dtype."""
    B, T, A = k.shape
    s = k.new_zeros(B, A, 3) if state is None else state
    a, b, p = s.unbind(-1)
    p = torch.where(b > 0, p, torch.full_like(p, -torch.inf))
    out = []
    for t in range(T):
        g = k.new_ones(B, 1) if real is None else real[:, t, None].to(k.dtype)  # [B, 1]
        kt = torch.where(g > 0, k[:, t], torch.full_like(k[:, t], -torch.inf))
        m = torch.maximum(p, u + kt)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e1, e2 = torch.exp(p - m), torch.exp(u + kt - m)
        den = b * e1 + e2
        out.append((a * e1 + e2 * v[:, t]) / torch.where(den > 0, den, torch.ones_like(den)))
        m = torch.maximum(p - w * g, kt)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e1, e2 = torch.exp(p - w * g - m), torch.exp(kt - m)
        a, b, p = a * e1 + e2 * v[:, t], b * e1 + e2, torch.where(b * e1 + e2 > 0, m, torch.full_like(m, -torch.inf))
    last = torch.stack([a, b, torch.where(b > 0, p, torch.zeros_like(p))], dim=-1)
    return torch.stack(out, dim=1) if out else k.new_zeros(B, 0, A), last


def _weights(logits: Tensor, top: Tensor) -> Tensor:
    """``exp(logits - top)`` with ``top`` replaced by 0 where it is ``-inf`` (nothing seen: all 0)."""
    return torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))


def _wkv_chunk(w: Tensor, u: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of :func:`wkv`: ``k, v [B, L, A]``, ``g [B, L]`` (1: real, 0: padded), ``state
    [B, A, 3]``. Token ``t`` reads the incoming state decayed by the real steps ``0 .. t-1`` (logit
    ``p - w E_t``), token ``i < t`` decayed by the real steps ``i+1 .. t-1`` (``k_i - w (E_t - G_i)``,
    the counts exact), and itself with the bonus (``u + k_t``)."""
    L = k.shape[1]
    G = g.cumsum(1)  # [B, L] real tokens up to and with t
    E = G - g  # ... before t
    kk = k.masked_fill(g[..., None] == 0, -torch.inf).transpose(1, 2)  # [B, A, L]
    vt = v.transpose(1, 2)  # [B, A, L]
    a, b, p = state.unbind(-1)  # [B, A]
    p = torch.where(b > 0, p, torch.full_like(p, -torch.inf))
    inc = p[..., None] - w[:, None] * E[:, None, :]  # [B, A, L]
    gap = (E[:, :, None] - G[:, None, :])[:, None]  # [B, 1, L(t), L(i)]
    past = kk[:, :, None, :] - w[:, None, None] * gap  # [B, A, L, L]
    past = past.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1), -torch.inf)
    now = u[:, None] + kk  # [B, A, L]
    top = torch.maximum(torch.maximum(inc, now), past.amax(-1))  # [B, A, L]
    e_inc, e_past, e_now = _weights(inc, top), _weights(past, top[..., None]), _weights(now, top)
    num = a[..., None] * e_inc + (e_past * vt[:, :, None, :]).sum(-1) + e_now * vt
    den = b[..., None] * e_inc + e_past.sum(-1) + e_now
    y = num / torch.where(den > 0, den, torch.ones_like(den))  # [B, A, L]
    end_inc = p - w * G[:, -1:]  # [B, A]
    end_past = kk - w[:, None] * (G[:, -1:] - G)[:, None, :]  # [B, A, L]
    top = torch.maximum(end_inc, end_past.amax(-1))  # [B, A]
    e_inc, e_past = _weights(end_inc, top), _weights(end_past, top[..., None])
    b2 = b * e_inc + e_past.sum(-1)
    a2 = a * e_inc + (e_past * vt).sum(-1)
    p2 = torch.where(b2 > 0, top, torch.zeros_like(top))
    return y.transpose(1, 2), torch.stack([a2, b2, p2], dim=-1)


def wkv(w: Tensor, u: Tensor, k: Tensor, v: Tensor, state: Tensor | None = None, real: Tensor | None = None,
        chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """The WKV recurrence of :func:`wkv_recurrent` (same arguments and results) in chunks of
    ``chunk_size`` tokens: within a chunk one ``[B, A, L, L]`` weighted sum, the carried state
    between chunks; exact to rounding, differentiable."""
    B, T, A = k.shape
    s = k.new_zeros(B, A, 3) if state is None else state
    g = k.new_ones(B, T) if real is None else real.to(k.dtype)
    ys = []
    for start in range(0, T, chunk_size):
        y, s = _wkv_chunk(w, u, k[:, start:start + chunk_size], v[:, start:start + chunk_size],
                          g[:, start:start + chunk_size], s)
        ys.append(y)
    return (torch.cat(ys, dim=1) if ys else k.new_zeros(B, 0, A)), s


def token_shift(x: Tensor, prev: Tensor | None, cu: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``x [B, N, C]`` -> ``(x_{t-1} [B, N, C], last [B, C, 1])``: the previous token's input,
    ``prev [B, C, 1]`` before the first (``None``: zeros), zeros at every packed sequence's start
    (``cu`` int ``[S+1]``); ``last`` the input to keep for the next call."""
    first = x.new_zeros(x.shape[0], 1, x.shape[2]) if prev is None else prev.transpose(1, 2).to(x.dtype)
    shifted = torch.cat([first, x[:, :-1]], dim=1)
    if cu is not None:
        keep = torch.ones(x.shape[1], 1, dtype=x.dtype, device=x.device)
        starts = cu[:-1].long()
        keep[starts[starts < x.shape[1]]] = 0
        shifted = shifted * keep
    last = first.transpose(1, 2) if x.shape[1] == 0 else x[:, -1:].transpose(1, 2)
    return shifted, last


def _lerp(x: Tensor, shifted: Tensor, mu: Tensor) -> Tensor:
    """``x mu + x_{t-1} (1 - mu)`` (modeling 256-258)."""
    return x * mu + shifted * (1 - mu)


def _rescaled(t: Tensor, exponent: int, training: bool) -> Tensor:
    """``t / 2^exponent`` in eval mode (transformers' rescaled ``output`` / ``value`` weights)."""
    return t if training or exponent == 0 else t * 2.0 ** -exponent


# --------------------------------------------------------------------------- the parts
class ShiftCache(SnapshotCache):
    """The decode state of a token shift: ``last [B, C, 1]``, the last input (zeros at the start).
    Replaced, not written in place (a mark is a snapshot)."""

    _batch_tensors = ("last",)

    snapshot = ("length", "last")

    def __init__(self, batch_size: int, max_len: int, channels: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self._set_sizes(batch_size, max_len=max_len)
        self.last = torch.zeros(batch_size, check_int(channels, "channels"), 1, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.last.nbytes

    def reset(self) -> None:
        self.length = 0
        self.last = torch.zeros_like(self.last)

    def update(self, last: Tensor, n: int) -> None:
        """Keep the last input after ``n`` more tokens."""
        if self.length + n > self.max_len:
            raise ValueError(f"ShiftCache overflow: {self.length} tokens + {n} new > max_len={self.max_len}")
        self.last = last.to(self.last.dtype)
        self.length += n

    def __repr__(self) -> str:
        return f"ShiftCache(batch_size={self.batch_size}, channels={self.last.shape[1]}, length={self.length})"


class RwkvTimeMix(RecurrentMixer):
    """RWKV-4's time mixing (``RwkvSelfAttention``, see the module docstring) on the
    :class:`~attnzoo.nn.recurrent.RecurrentMixer` protocol.

    Args:
        dim: model width ``C``. inner: ``A`` (``attention_hidden_size``).
        rescale: the exponent ``e`` of transformers' eval-mode rescaling: in eval mode the input of
            ``out_proj`` is divided by ``2^e``.
        chunk_size: :func:`wkv`'s chunk length.

    Weights: ``q_proj`` (``receptance``), ``k_proj`` (``key``), ``v_proj`` (``value``), all
    ``[A, C]``, ``out_proj [C, A]`` (``output``), no biases; ``time_decay``, ``time_first [A]``
    (float32 under half-precision casts); ``mix_q``, ``mix_k``, ``mix_v [C]`` (``time_mix_*``).

    Shapes: ``forward(x [B, N, C]) -> [B, N, C]``; key padding, cache (the state ``[B, A, 1, 3]``
    and the shift's last input ``[B, C, 1]``) and ``cu_seqlens`` as :class:`RecurrentMixer`.
    """

    def __init__(self, dim: int, inner: int, *, rescale: int = 0, chunk_size: int = CHUNK_SIZE,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(dim, 1, head_dim=inner, bias=False, layout="q_k_v", factory=fk)
        self.inner = self.head_dim
        self.rescale = check_int(rescale, "rescale", minimum=0, owner="RwkvTimeMix")
        self.chunk_size = check_int(chunk_size, "chunk_size", owner="RwkvTimeMix")
        f32 = {"device": device, "dtype": torch.float64 if dtype == torch.float64 else torch.float32}
        self.time_decay = nn.Parameter(torch.linspace(-5.0, 3.0, self.inner, **f32))
        self.time_first = nn.Parameter(torch.full((self.inner,), -1.2, **f32))
        for name in ("mix_q", "mix_k", "mix_v"):
            setattr(self, name, nn.Parameter(torch.full((self.dim,), 0.5, **fk)))
        self.conv_channels, self.conv_size, self.state_shape = {"shift": self.dim}, 2, (self.inner, 1, 3)

    def _apply(self, fn: Any, recurse: bool = True) -> RwkvTimeMix:
        """As ``nn.Module._apply``; ``time_decay`` / ``time_first`` stay float32 under half casts."""
        before = {n: getattr(self, n).data for n in ("time_decay", "time_first")}
        super()._apply(fn, recurse)
        for name, old in before.items():
            p = getattr(self, name)
            if p.dtype in (torch.float16, torch.bfloat16) and old.device.type != "meta":
                p.data = old.to(device=p.device, dtype=torch.float32)
        return self

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        if pad is not None:  # a padded token feeds zeros to the shift
            x = x * pad[..., None].to(x.dtype)
        shifted, last = token_shift(x, conv.get("shift"), cu)
        r = torch.sigmoid(self.q_proj(_lerp(x, shifted, self.mix_q)))  # [B, N, A]
        k, v = self.k_proj(_lerp(x, shifted, self.mix_k)), self.v_proj(_lerp(x, shifted, self.mix_v))
        dt = compute_dtype(x.dtype)
        w, u = self.time_decay.to(dt).exp(), self.time_first.to(dt)
        s0 = None if state is None else state[:, :, 0]  # [B, A, 3]
        if cu is None:
            y, s = wkv(w, u, k.to(dt), v.to(dt), s0, pad, self.chunk_size)
        else:  # each packed sequence from the empty state
            y = torch.cat([wkv(w, u, k[:, a:b].to(dt), v[:, a:b].to(dt), None, None, self.chunk_size)[0]
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)], dim=1)
            s = y.new_zeros(1, self.inner, 3)
        z = _rescaled(r * y.to(x.dtype), self.rescale, self.training)
        return self.out_proj(z), s[:, :, None], {"shift": last}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, inner={self.inner}, rescale={self.rescale}, chunk_size={self.chunk_size}"


class RwkvChannelMix(nn.Module):
    """RWKV-4's channel mixing (``RwkvFeedForward``): ``sigmoid(r_proj(x_r)) *
    v_proj(relu(k_proj(x_k))^2)`` on token-shifted inputs.

    Args:
        dim: ``C``. hidden: ``intermediate_size``. rescale: as :class:`RwkvTimeMix` (the input of
            ``v_proj``).

    Weights: ``k_proj [F, C]`` (``key``), ``r_proj [C, C]`` (``receptance``), ``v_proj [C, F]``
    (``value``), ``mix_k``, ``mix_r [C]``. Shapes: ``[B, N, C] -> [B, N, C]``; decode cache a
    :class:`ShiftCache`."""

    def __init__(self, dim: int, hidden: int, *, rescale: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.dim, self.rescale = check_int(dim, "dim"), check_int(rescale, "rescale", minimum=0)
        self.k_proj = nn.Linear(dim, hidden, bias=False, **fk)
        self.r_proj = nn.Linear(dim, dim, bias=False, **fk)
        self.v_proj = nn.Linear(hidden, dim, bias=False, **fk)
        self.mix_k, self.mix_r = (nn.Parameter(torch.full((dim,), 0.5, **fk)) for _ in range(2))

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> ShiftCache:
        return ShiftCache(batch_size, max_len, self.dim, device=device, dtype=dtype or self.k_proj.weight.dtype)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, cache: ShiftCache | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """``x [B, N, C]``; ``mask`` key padding bool ``[B, N]`` or ``[B, past + N]`` (True = real)."""
        pad = key_padding_from_mask(type(self).__name__, mask, x.shape[0], x.shape[1],
                                    x.shape[1] + (0 if cache is None else cache.length), x.device)
        if pad is not None:
            x = x * pad[..., None].to(x.dtype)
        shifted, last = token_shift(x, None if cache is None else cache.last, cu_seqlens)
        key = torch.square(torch.relu(self.k_proj(_lerp(x, shifted, self.mix_k))))
        y = torch.sigmoid(self.r_proj(_lerp(x, shifted, self.mix_r))) * self.v_proj(
            _rescaled(key, self.rescale, self.training))
        if cache is not None:
            cache.update(last, x.shape[1])
        return y


class RwkvLayer(nn.Module):
    """One RWKV-4 layer on ``h [B, N, C]``: ``h + attn(attn_norm(h))``, then ``+ ffn(ffn_norm(.))``
    (``attn`` an :class:`RwkvTimeMix`, ``ffn`` an :class:`RwkvChannelMix`, LayerNorms). Decode
    cache: a :class:`~attnzoo.nn.cache.CacheList` ``[time mixing's, channel mixing's]``."""

    def __init__(self, attn_norm: nn.Module, attn: RwkvTimeMix, ffn_norm: nn.Module, ffn: RwkvChannelMix) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn
        self.dim = attn.dim

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> CacheList:
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        return CacheList([self.attn.init_cache(batch_size, max_len, **kw), self.ffn.init_cache(batch_size, max_len,
                                                                                               **kw)])

    def forward(self, h: Tensor, *, key_padding: Tensor | None = None, cache: CacheList | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """``h [B, N, C]`` (packed: ``[1, T, C]`` with ``cu_seqlens``); ``key_padding [B, past + N]``."""
        kw: dict[str, Any] = {}
        for name, value in (("mask", key_padding), ("cu_seqlens", cu_seqlens)):
            if value is not None:
                kw[name] = value
        attn_cache, ffn_cache = (None, None) if cache is None else (cache[0], cache[1])
        h = h + self.attn(self.attn_norm(h), cache=attn_cache, **kw)
        return h + self.ffn(self.ffn_norm(h), cache=ffn_cache, **kw)


class RwkvLM(LayerLoopLM):
    """The RWKV-4 decoder: :class:`RwkvLayer` layers; in eval mode the hidden states are halved
    after every ``rescale_every``-th layer (transformers' inference rescaling; ``0``: never)."""

    packs = True

    def __init__(self, *, rescale_every: int, config: DecoderConfig, parts: DecoderParts,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(config=config, parts=parts, device=device, dtype=dtype)
        self.rescale_every = max(int(rescale_every), 0)

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The layers on the normalised embeddings ``x [B, N, C]``."""
        h, every = x, self.rescale_every
        for i, layer in enumerate(self.blocks):
            h = layer(h, key_padding=key_padding, cache=None if cache is None else cache[i], cu_seqlens=cu_seqlens)
            if every and not self.training and (i + 1) % every == 0:
                h = h / 2
        return h

    def extra_repr(self) -> str:
        return f"rescale_every={self.rescale_every}"


# --------------------------------------------------------------------------- the config and weights
def build_rwkv(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of an ``RwkvConfig`` (random weights; see the module docstring)."""
    hf = hf.with_defaults(DEFAULTS)
    V, C, depth = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers")
    A = hf.get("attention_hidden_size", None) or C
    Fw = hf.get("intermediate_size", None) or 4 * C
    eps, every, kw = hf.req("layer_norm_epsilon", float), hf.req("rescale_every"), {"device": device, "dtype": dtype}

    def norm() -> nn.LayerNorm:
        return nn.LayerNorm(C, eps=eps, **kw)

    blocks = []
    for i in range(depth):
        e = i // every if every > 0 else 0
        blocks.append(RwkvLayer(norm(), RwkvTimeMix(C, A, rescale=e, **kw), norm(),
                                RwkvChannelMix(C, Fw, rescale=e, **kw)))
    cfg = DecoderConfig(V, C, depth, 1, pos="none", norm="layer", norm_eps=1e-5,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool),
                        max_seq_len=hf.first(("context_length", "max_position_embeddings"), 1024))
    return RwkvLM(rescale_every=every, config=cfg, parts=DecoderParts(
        blocks=blocks, embedding=NormedEmbedding(V, C, norm=norm(), **kw), norm=nn.LayerNorm(C, eps=1e-5, **kw),
        head=head_for(C, V, head_size, **kw)), **kw)


def rwkv_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's names as the shared helpers read them: no ``rwkv.`` prefix, ``embeddings``
    -> ``embed_tokens``, ``head`` -> ``lm_head``."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        key = key.removeprefix("rwkv.")
        if key.startswith("embeddings."):
            key = "embed_tokens." + key[len("embeddings."):]
        out["lm_head.weight" if key == "head.weight" else key] = t
    return out


def _vector(t: Tensor) -> Tensor:
    return t.reshape(-1)


def _put_layer(plan: Plan, i: int) -> None:
    o, h = f"blocks.{i}.", f"blocks.{i}."
    plan.put_pairs(o, h, [("attn_norm", "ln1"), ("ffn_norm", "ln2")])
    plan.put_pairs(f"{o}attn.", f"{h}attention.", [("q_proj", "receptance"), ("k_proj", "key"), ("v_proj", "value"),
                                                    ("out_proj", "output")], bias=False)
    for ours, theirs in (("mix_q", "receptance"), ("mix_k", "key"), ("mix_v", "value")):
        plan.put(f"{o}attn.{ours}", f"{h}attention.time_mix_{theirs}", _vector)
    for name in ("time_decay", "time_first"):
        plan.put(f"{o}attn.{name}", f"{h}attention.{name}")
    plan.put_pairs(f"{o}ffn.", f"{h}feed_forward.", [("k_proj", "key"), ("r_proj", "receptance"),
                                                      ("v_proj", "value")], bias=False)
    for ours, theirs in (("mix_k", "key"), ("mix_r", "receptance")):
        plan.put(f"{o}ffn.{ours}", f"{h}feed_forward.time_mix_{theirs}", _vector)


def convert_rwkv(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build an RWKV-4 decoder and copy the weights (the head follows them)."""
    hf = hf.with_defaults(DEFAULTS)
    model, plan, head_size = parts.start(hf, rwkv_names(sd), build_rwkv, device=device, dtype=dtype)
    plan.put_pairs("tok_emb.", "blocks.0.", [("norm", "pre_ln")])
    for i in range(model.depth):
        _put_layer(plan, i)
    plan.put("norm.bias", "ln_out.bias")
    return parts.finish(plan, cast(DecoderLM, model), head_size, final_norm="ln_out")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"rwkv": parts.Dispatch("RWKV", convert_rwkv, ("RwkvForCausalLM", "RwkvModel"))}
