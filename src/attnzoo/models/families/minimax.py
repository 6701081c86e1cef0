"""MiniMax (``minimax``) -> :class:`~attnzoo.DecoderLM`: ``MiniMaxForCausalLM`` and ``MiniMaxModel``
(MiniMax-Text-01's lightning-attention hybrid).

Line numbers below are transformers 5.25's ``models/minimax/modeling_minimax.py`` /
``configuration_minimax.py``. Every layer (``MiniMaxDecoderLayer``, modeling 530-581) is::

    n   = input_layernorm(x)
    h   = alpha_attn * n + beta_attn * mixer(n)                 # the residual is the NORMED input
    m   = post_attention_layernorm(h)
    out = alpha_mlp * m + beta_mlp * moe(m)

with ``(alpha_attn, beta_attn)`` = ``linear_attn_alpha_factor`` / ``linear_attn_beta_factor`` on the
lightning layers and ``full_attn_*`` on the softmax ones, ``(alpha_mlp, beta_mlp)`` =
``mlp_alpha_factor`` / ``mlp_beta_factor``; then the final ``norm``.

* ``"linear_attention"`` layers (``MiniMaxLightningAttention``, modeling 126-273): ``q, k, v =
  silu(qkv_proj(n))`` (rows per head ``[q_h; k_h; v_h]``), lightning attention ``o_t = sum_{s <= t}
  exp(-lambda_h (t - s)) (q_t . k_s) v_s`` (no score scale, no normalisation), an RMSNorm over all
  ``H * D`` channels (epsilon 1e-6, not ``rms_norm_eps``: modeling 136), the gate
  ``sigmoid(output_gate(n))`` and ``out_proj``. The decay rate of head ``h`` of layer ``l`` (of
  ``L``) is :func:`lightning_slopes` (modeling 151-160)::

      lambda_h = (2 ** (-8 / H)) ** (h + 1) * (1 - l / (L - 1 + 1e-5) + 1e-5)

  transformers runs it in blocks of ``block_size`` tokens (intra-block ``(Q K^T * decay) V``, an
  inter-block state ``K^T V``, modeling 203-242) and one token at a time from its cache
  (modeling 244-255): both are the recurrence ``S_t = exp(-lambda) S_{t-1} + k_t v_t^T``,
  ``o_t = q_t S_t``. Here it is :func:`attnzoo.gated_linear_attention` with the constant log decay
  ``-lambda_h`` per token and scale 1 (:class:`LightningAttention`, a
  :class:`~attnzoo.nn.recurrent.RecurrentMixer`: its state ``[B, H, D, D]`` is the decode cache,
  ``cu_seqlens`` packs sequences), in chunks of ``block_size`` tokens (the output is linear in q
  and the norm over the heads removes a common scale, so a score scale would show only through
  the norm's epsilon; none is applied, as in transformers). The checkpoint's decay
  buffers (``slope_rate``, ``query_decay``, ``key_decay``, ``diagonal_decay``) are recomputed from
  the config, not read.
* ``"full_attention"`` layers: causal GQA with RoPE on the whole head (``rope_parameters``, theta
  1e6 by default), no biases, a window of ``sliding_window - 1`` keys on every such layer when
  ``sliding_window`` is set (modeling 668-670).
* Every layer's feed-forward: a :class:`~attnzoo.nn.moe.MixtureOfExperts` (router ``gate.weight``,
  softmax in float32 then the top-k renormalised to sum 1; SwiGLU experts ``gate_up_proj [E, 2F, C]``
  rows ``[gate; up]``, ``down_proj [E, C, F]``; modeling 453-527). Saved folders' Mixtral names
  (``block_sparse_moe``, ``experts.{e}.w1/w3/w2``) load too.

**The residual weights, folded.** The residual of each sub-layer is its *normed* input, so a
pre-norm :class:`~attnzoo.TransformerBlock` cannot hold the layer. A post-norm one can
(``norm_first=False``: ``x = attn_norm(x + attn(x)); x = ffn_norm(x + ffn(x))``) once the norms
are shifted by one and the factors folded into weights, exactly (each factor multiplies a linear
map's input or output, and an RMSNorm's weight multiplies its output):

* the stream entering block ``i`` is ``alpha_attn(i) * n_i``: layer 0's ``input_layernorm`` runs
  in the embedding (:class:`NormedEmbedding`), layer ``i + 1``'s as block ``i``'s ``ffn_norm``,
  each weight times ``alpha_attn`` of its layer;
* the mixer's input projections (``qkv_proj``, ``output_gate``; q/k/v) are divided by
  ``alpha_attn(i)`` (so the mixer sees ``n_i``), its ``out_proj`` / ``o_proj`` multiplied by
  ``beta_attn(i)``: ``x + attn(x) = alpha n + beta mixer(n) = h``;
* block ``i``'s ``attn_norm`` is ``post_attention_layernorm`` times ``alpha_mlp``; the router and
  the experts' ``gate_proj`` / ``up_proj`` divided by ``alpha_mlp``, ``down_proj`` multiplied by
  ``beta_mlp``: ``x + moe(x) = alpha m + beta moe(m) = out``;
* the last block's ``ffn_norm`` is the identity and the model's ``norm`` transformers' final norm.

So the logits (and a base model's last hidden state) are transformers'; the per-block hidden
states are the next layer's normed inputs (times its alpha). Each folded weight is rounded once,
in float32 or wider before the copy (in a bfloat16 model: one bfloat16 rounding, as for Granite's
multipliers). A zero alpha cannot be divided out: refused. Training the converted model trains
the folded weights (the same function, another parameterisation).

Padding: transformers zeroes a padded token's q, k, v (modeling 188-189, after the activation) and
still decays the state there; attnzoo's recurrent key padding skips the token (no write, no
decay). With left padding (what generation uses) the state is zero before the first real token
and the two agree; padding after a real token differs.

Config keys a ``config.json`` leaves out take ``MiniMaxConfig``'s defaults (:data:`DEFAULTS`;
``layer_types`` alternating full / linear from layer 0, configuration_minimax 119-123). Refused (by name):
``hidden_act`` other than SiLU (the q/k/v activation and the experts'), a zero ``*_alpha_factor``,
a non-finite factor, ``router_jitter_noise`` > 0 (transformers multiplies the MoE input by noise
in training), a ``partial_rotary_factor`` below 1 with a scaled ``rope_type`` (transformers'
default rope rotates the whole head whatever the factor, as here; its scaled ones would rotate
part of it and fail), an unknown layer type or ``rope_type``. ``output_router_logits`` and
``router_aux_loss_coef`` are training losses only: accepted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._devices import restore_float32
from attnzoo._validate import check_finite_float, check_int
from attnzoo.blocks import BlockLayers, RMSNorm, TransformerBlock
from attnzoo.functional.recurrent.gla import gated_linear_attention
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_moe
from attnzoo.models.families.kimi_linear import saved_names
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.recurrent import RecurrentMixer, wide

__all__ = ["DEFAULTS", "DISPATCH", "LightningAttention", "NormedEmbedding", "build_minimax", "canonical",
           "convert_minimax", "lightning_slopes", "put_lightning"]

#: ``MiniMaxConfig``'s defaults of the keys read here (configuration_minimax 82-113), for a
#: ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_experts_per_tok": 2, "num_local_experts": 8,
    "router_jitter_noise": 0.0, "rope_theta": 1_000_000.0, "block_size": 256,
    "full_attn_alpha_factor": 1.0, "full_attn_beta_factor": 1.0, "linear_attn_alpha_factor": 1.0,
    "linear_attn_beta_factor": 1.0, "mlp_alpha_factor": 1.0, "mlp_beta_factor": 1.0,
}

#: the layer kinds of ``layer_types``
TYPES = ("full_attention", "linear_attention")

#: the lightning layers' output RMSNorm epsilon (transformers' ``MiniMaxRMSNorm`` default: modeling 136)
LIGHTNING_NORM_EPS = 1e-6

#: the checkpoint's decay buffers of a lightning layer (persistent in transformers; recomputed here)
_DECAY_BUFFERS = r"(model\.)?layers\.\d+\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)"


def lightning_slopes(num_heads: int, layer: int, depth: int) -> Tensor:
    """The decay rates ``lambda_h`` (float64 ``[H]``) of the lightning layer ``layer`` of ``depth``:
    ``(2 ** (-8 / H)) ** (h + 1) * (1 - layer / (depth - 1 + 1e-5) + 1e-5)`` (modeling 151-160);
    head ``h``'s state decays by ``exp(-lambda_h)`` per token."""
    H = check_int(num_heads, "num_heads", owner="lightning_slopes")
    depth = check_int(depth, "depth", owner="lightning_slopes")
    layer = check_int(layer, "layer", minimum=0, owner="lightning_slopes")
    base = 1 / (2 ** (8 / H))
    factor = 1 - layer / (depth - 1 + 1e-5) + 1e-5
    return base ** torch.arange(1, H + 1, dtype=torch.float64) * factor


class LightningAttention(RecurrentMixer):
    """MiniMax's lightning attention: linear attention with a fixed decay per head, an RMSNorm over
    all heads, a sigmoid output gate (transformers' ``MiniMaxLightningAttention``).

    ``q, k, v = silu(qkv_proj(x))``; per head ``S_t = exp(-lambda_h) S_{t-1} + k_t v_t^T``,
    ``o_t = q_t S_t`` (:func:`attnzoo.gated_linear_attention`, log decay ``-lambda_h``, scale 1);
    ``out_proj(sigmoid(output_gate(x)) * norm(o))`` with ``norm`` an RMSNorm over the ``H * D``
    channels together.

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        head_dim: ``D`` (default ``C // H``).
        slopes: the ``H`` decay rates ``lambda_h > 0`` (:func:`lightning_slopes`).
        norm_eps: the output RMSNorm's epsilon.
        chunk_size: the kernel's chunk length (MiniMax: ``block_size``).
        device, dtype: of the parameters.

    Weights: ``qkv_proj [3 H D, C]`` (rows ``[q; k; v]``, each head-major), ``output_gate [H D, C]``,
    ``norm.weight [H D]``, ``out_proj [C, H D]``; no biases. The rates are a float32 buffer (not in
    the state dict; kept float32 through half casts). Attention protocol and decode cache
    (``[B, H, D, D]``): :class:`~attnzoo.nn.recurrent.RecurrentMixer`; a padded key is skipped.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, *, slopes: Sequence[float] | Tensor,
                 norm_eps: float = LIGHTNING_NORM_EPS, chunk_size: int = 64, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(dim, num_heads, head_dim=head_dim, bias=False, layout="qkv", factory=fk)
        rates = torch.as_tensor(slopes, dtype=torch.float64).flatten()
        if rates.numel() != self.num_heads or not bool(torch.isfinite(rates).all()) or not bool((rates > 0).all()):
            raise ValueError(f"LightningAttention: slopes must be {self.num_heads} finite rates > 0 (one per head), "
                             f"got {rates.tolist()}")
        self.register_buffer("slopes", rates.to(device=device, dtype=torch.float32), persistent=False)
        inner = self.num_heads * self.head_dim
        self.output_gate = nn.Linear(dim, inner, bias=False, **fk)
        self.norm = RMSNorm(inner, norm_eps, **fk)
        self.chunk_size = check_int(chunk_size, "chunk_size", owner="LightningAttention")
        self.state_shape = (self.num_heads, self.head_dim, self.head_dim)
        self.conv_channels, self.conv_size = {}, 0

    def _apply(self, fn: Any, recurse: bool = True) -> LightningAttention:
        """Half casts leave the decay rates in float32 (a rate rounded to 16 bits decays the state
        at another speed over long inputs)."""
        before = self.slopes
        super()._apply(fn, recurse)
        restore_float32(self, "slopes", before)
        return self

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        q, k, v = (wide(F.silu(t)) for t in self.project_qkv(x))  # [B, H, N, D]
        b, h, n, _ = q.shape
        g = (-self.slopes.to(q.dtype))[None, :, None].expand(b, h, n)  # [B, H, N] log decay
        if pad is not None:  # a padded token neither writes (k = 0) nor decays the state
            keep = pad[:, None, :].to(q.dtype)  # [B, 1, N]
            g, k = g * keep, k * keep[..., None]
        o, state = gated_linear_attention(q, k, v, g, scale=1.0, initial_state=state, return_state=True,
                                          chunk_size=self.chunk_size, cu_seqlens=cu)
        y = self.norm(o.transpose(1, 2).flatten(2)).to(x.dtype)  # [B, N, H D]
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * y), state, {}

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"norm_eps={self.norm.eps}, chunk_size={self.chunk_size}")


class NormedEmbedding(nn.Embedding):
    """A token embedding followed by a norm part: ``norm(weight[tokens])`` (MiniMax: the first
    layer's input norm, see the module docstring). Weights: ``weight [V, C]`` (tied to an LM head
    like ``nn.Embedding``'s) and the norm's.

    Shapes: ``tokens [B, N]`` -> ``[B, N, C]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, norm: nn.Module,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        if not isinstance(norm, nn.Module):
            raise TypeError(f"NormedEmbedding: norm must be an nn.Module, got {type(norm).__name__}")
        self.norm = norm

    def forward(self, tokens: Tensor) -> Tensor:
        return self.norm(super().forward(tokens))  # [B, N, C]


def _factor_ok(value: Any, *, nonzero: bool = False) -> bool:
    """A residual factor attnzoo can fold: a finite number (not zero when it is divided out)."""
    try:
        factor = check_finite_float(value, "factor")
    except (TypeError, ValueError):
        return False
    return factor != 0 or not nonzero


def _partial_rotary_ok(hf: HFConfig) -> bool:
    params = parts.rope_params(hf)
    partial = params.get("partial_rotary_factor", hf.raw("partial_rotary_factor", 1.0))
    return params.get("rope_type", "default") in (None, "default") or partial in (None, 1, 1.0)


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS` where a key is absent; ``layer_types`` full
    on even layers, linear on odd ones when absent), its unsupported options refused by name."""
    out = hf.with_defaults(DEFAULTS)
    if not out.has("layer_types"):
        depth = out.req("num_hidden_layers")
        out.data["layer_types"] = [TYPES[i % 2] for i in range(depth)]
    act = out.req("hidden_act", str)
    if act not in ("silu", "swish"):
        raise out.unsupported(f"hidden_act={act!r} (the q/k/v activation and the experts'; supported: 'silu')")
    for key in ("full_attn", "linear_attn", "mlp"):
        parts.unsupported_keys(out, {f"{key}_alpha_factor": lambda v: _factor_ok(v, nonzero=True),
                                     f"{key}_beta_factor": _factor_ok})
    parts.unsupported_keys(out, {"router_jitter_noise": lambda v: v in (None, 0, 0.0)})
    if not _partial_rotary_ok(out):
        raise out.unsupported("partial_rotary_factor < 1 with a scaled rope_type (transformers' MiniMax rotates "
                              "the whole head)")
    return out


def _factors(hf: HFConfig, kind: str) -> tuple[float, float]:
    """``(alpha, beta)`` of a layer's mixer sub-layer."""
    key = "linear_attn" if kind == "linear_attention" else "full_attn"
    return hf.req(f"{key}_alpha_factor", float), hf.req(f"{key}_beta_factor", float)


def _mixer_factory(hf: HFConfig, kind: str, layer: int, rope: nn.Module, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    if kind == "full_attention":
        window = hf.get("sliding_window", None)
        return parts.attention_factory(hf, window=None if window is None else window - 1, rope=rope, **kw)
    return functools.partial(LightningAttention, C, H, hf.get("head_dim", C // H),
                             slopes=lightning_slopes(H, layer, depth), chunk_size=hf.req("block_size"), **kw)


def build_minimax(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``MiniMaxConfig`` (random weights, nothing folded: see the module docstring)."""
    hf = canonical(hf)
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    rope = parts.rotary(hf, parts.rope_params(hf), hf.get("head_dim", C // H))
    norm = parts.rms_norm(C, eps, **kw)
    moe = functools.partial(MixtureOfExperts, C, hf.req("intermediate_size"), hf.req("num_local_experts"),
                            hf.req("num_experts_per_tok"), routing=Routing("softmax_topk", norm_topk_prob=True), **kw)
    blocks = [TransformerBlock(C, layers=BlockLayers(attention=_mixer_factory(hf, kind, i, rope, kw), feed_forward=moe,
                                                     norm=norm, norm_first=False))
              for i, kind in enumerate(kinds)]
    blocks[-1].ffn_norm = nn.Identity()  # the final norm is the model's
    embedding = NormedEmbedding(hf.req("vocab_size"), C, norm=norm(), **kw)
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embedding=embedding, **kw)


def put_lightning(plan: Plan, ours: str, theirs: str, num_heads: int) -> None:
    """A :class:`LightningAttention` at ``ours`` (``"blocks.1.attn."``) from transformers'
    ``MiniMaxLightningAttention`` at ``theirs`` (``"layers.1.self_attn."``): ``qkv_proj``'s rows
    regrouped from ``[q_h; k_h; v_h]`` per head to ``[q; k; v]``, the rest as named there."""
    def regroup(w: Tensor) -> Tensor:
        return w.reshape(num_heads, 3, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape)

    plan.put(f"{ours}qkv_proj.weight", f"{theirs}qkv_proj.weight", regroup)
    plan.put_pairs(ours, theirs, [(n, n) for n in ("output_gate", "norm", "out_proj")], bias=False)


def _fold(plan: Plan, factors: Mapping[str, float]) -> None:
    """Multiply each planned tensor of ``factors`` by its factor, in float32 or wider (the copy into
    the model then rounds once)."""
    for name, factor in factors.items():
        if factor != 1.0 and name in plan.values:
            t, key = plan.values[name]
            plan.values[name] = (t.to(torch.promote_types(t.dtype, torch.float32)) * factor, f"{key} x {factor:g}")


def _plan_layer(plan: Plan, hf: HFConfig, i: int, kind: str) -> dict[str, float]:
    """Plan layer ``i`` into block ``i`` (its mixer, MoE and ``post_attention_layernorm``); return the
    factors of its folded weights."""
    o, h = f"blocks.{i}.", f"layers.{i}."
    alpha, beta = _factors(hf, kind)
    if kind == "linear_attention":
        put_lightning(plan, f"{o}attn.", f"{h}self_attn.", hf.req("num_attention_heads"))
        inputs = ["qkv_proj.weight", "output_gate.weight"]
    else:
        parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=False)
        inputs = ["qkv_proj.weight"]
    put_moe(plan, f"{o}ffn.", f"{h}mlp.", "stacked")
    plan.put(f"{o}attn_norm.weight", f"{h}post_attention_layernorm.weight")
    a_mlp, b_mlp = hf.req("mlp_alpha_factor", float), hf.req("mlp_beta_factor", float)
    return {**{f"{o}attn.{n}": 1 / alpha for n in inputs}, f"{o}attn.out_proj.weight": beta,
            f"{o}attn_norm.weight": a_mlp, **{f"{o}ffn.{n}": 1 / a_mlp for n in ("router.weight", "gate_proj", "up_proj")},
            f"{o}ffn.down_proj": b_mlp}


def convert_minimax(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a MiniMax decoder and copy the weights, the residual factors folded in (the head
    follows them; saved folders' Mixtral expert names too)."""
    hf, sd = canonical(hf), saved_names(sd)
    model, plan, head_size = parts.start(hf, sd, build_minimax, device=device, dtype=dtype)
    kinds = parts.layer_types(hf, model.depth, TYPES)
    factors: dict[str, float] = {"tok_emb.norm.weight": _factors(hf, kinds[0])[0]}
    plan.put("tok_emb.norm.weight", "layers.0.input_layernorm.weight")
    for i, kind in enumerate(kinds):
        factors.update(_plan_layer(plan, hf, i, kind))
        if i + 1 < len(kinds):  # the next layer's input norm closes this block
            plan.put(f"blocks.{i}.ffn_norm.weight", f"layers.{i + 1}.input_layernorm.weight")
            factors[f"blocks.{i}.ffn_norm.weight"] = _factors(hf, kinds[i + 1])[0]
    _fold(plan, factors)
    return parts.finish(plan, model, head_size, ignore=[_DECAY_BUFFERS])


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"minimax": parts.Dispatch("MiniMax", convert_minimax, ("MiniMaxForCausalLM", "MiniMaxModel"))}
