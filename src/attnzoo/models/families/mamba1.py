"""Mamba (``mamba``) -> :class:`~attnzoo.DecoderLM`: ``MambaForCausalLM`` and ``MambaModel``
(the original selective-scan Mamba, ``state-spaces/mamba-*-hf``); and FalconMamba
(``falcon_mamba``): ``FalconMambaForCausalLM`` and ``FalconMambaModel`` (FalconMamba-7B).

Line numbers below are transformers 5.25's ``models/mamba/modeling_mamba.py`` /
``configuration_mamba.py`` and ``models/falcon_mamba/modeling_falcon_mamba.py`` /
``configuration_falcon_mamba.py``. Every layer is mixer-only (``MambaBlock``, modeling 646-671):
``x + mixer(norm(x))`` (a block built with ``feed_forward=None``); the norms are ``weight * x``
RMSNorms (modeling 626-643) of epsilon ``layer_norm_epsilon``, the last one ``norm_f``. The mixer
(:class:`Mamba1Mixer`; ``MambaMixer``, modeling 487-623; its scan is ``mamba_scan_forward``
-> ``mamba_selective_scan``, modeling 337-474 and 229-334, the torch path without kernels):

* ``in_proj`` ``C -> 2I`` (``I = intermediate_size``: see below), rows ``[x | z]`` (modeling
  572, 596); biases on ``in_proj`` and ``out_proj`` with ``use_bias``;
* ``x`` through a causal depthwise ``conv1d`` of kernel ``conv_kernel`` (bias ``use_conv_bias``),
  then ``hidden_act`` (SiLU; modeling 599-606);
* ``x_proj`` ``I -> R + 2N`` without bias, split ``[dt | B | C]`` (modeling 610-614; ``R =
  time_step_rank``, ``"auto"``: ``ceil(hidden_size / 16)``, config 96-97);
* ``dt = softplus(dt_proj(dt))`` (``dt_proj`` ``R -> I`` with bias; modeling 616, 374, 259-261);
* the selective scan (modeling 268-270, 317-320) ``h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t``,
  ``y_t = h_t C_t + D x_t`` with ``A = -exp(A_log) [I, N]`` (modeling 373), ``D`` (modeling 325),
  then ``y * silu(z)`` (modeling 328) and ``out_proj`` (modeling 622).

The scan is :func:`attnzoo.selective_scan` (``functional/recurrent/selective_scan.py``:
:func:`~attnzoo.functional.gated_linear_attention` with ``I`` value heads of width 1 over one key
head of width ``N``, ``v = dt * x``, the log decay ``dt * A`` per key channel, scale 1); its state
``[B, I, N, 1]`` is the decode cache, its ``cu_seqlens`` the packed sequences.

FalconMamba (``FalconMambaMixer``, modeling_falcon_mamba 477-612) is the same mixer whose
``dt`` (before ``dt_proj``, over its ``R`` channels), ``B`` and ``C`` pass through weightless
RMSNorms of epsilon ``mixer_rms_eps`` (modeling_falcon_mamba 47-61, 531-533, 596-598; their
``weight`` buffers are dummies, not saved, never read); its final norm is the same RMSNorm.

Jamba's mixer (:mod:`attnzoo.models.families.jamba`) is the same mixer with RMSNorms *with*
weights at the same places: parts a family sets after building (``dt_layernorm``,
``b_layernorm``, ``c_layernorm``; ``None`` by default).

Padding. transformers zeroes a padded token's mixer input (before ``in_proj``) and the
convolution's output (modeling 571 and 609; modeling_falcon_mamba 572 and 588); both are
reproduced, so with ``use_bias`` a padded token feeds ``in_proj``'s bias to the convolution as
there. A padded token then writes nothing to the state (``x = 0``); transformers still decays the
state by ``exp(dt A)`` there (``dt = softplus(b_dt) > 0``), attnzoo does not (its recurrent
mixers' key padding: ``dt = 0``, no write, no decay). With left padding (what generation uses)
the state is zero before the first real token and the two agree; padding after a real token
differs.

Config keys are read as transformers reads them (:func:`canonical`): keys a ``config.json``
leaves out take ``MambaConfig``'s / ``FalconMambaConfig``'s defaults (:data:`DEFAULTS`, config
67-92 / configuration_falcon_mamba 73-100; tied embeddings by default). ``intermediate_size`` is
``int(expand * hidden_size)`` (config 95) unless the config stores one: that one wins, as in
transformers 5.25 (the base class's ``__post_init__`` sets the stored keys after the subclass
computed it). Options that only change the initialisation (``time_step_scale``, ``_min``,
``_max``, ``_init_scheme``, ``_floor``, ``rescale_prenorm_residual``) or pick another
implementation of the same scan (``use_mambapy``, ``use_associative_scan``) are accepted.
Refused: ``hidden_act`` other than SiLU (it is the convolution's activation; the gate is always
SiLU).

``residual_in_fp32`` (transformers keeps the residual stream in float32 under a half dtype,
modeling 665-666) is not reproduced: in float32 the two agree; in bfloat16 attnzoo's residual
stream is bfloat16 (the scan itself runs in float32 either way).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int
from attnzoo.functional.recurrent.selective_scan import SCAN_CHUNK, selective_scan
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.mamba2 import backbone_names
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.recurrent import RecurrentMixer, ShortConv, wide

__all__ = ["DEFAULTS", "DISPATCH", "Mamba1Mixer", "build_falcon_mamba", "build_mamba", "canonical",
           "convert_falcon_mamba", "convert_mamba", "put_mamba1"]

#: ``MambaConfig``'s defaults of the keys read here (configuration_mamba 67-92; FalconMamba's are the
#: same plus ``mixer_rms_eps``, configuration_falcon_mamba 73-100), for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50280, "hidden_size": 768, "state_size": 16, "num_hidden_layers": 32, "layer_norm_epsilon": 1e-5,
    "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
    "time_step_rank": "auto", "tie_word_embeddings": True,
}
FALCON_DEFAULTS: dict[str, Any] = {**DEFAULTS, "mixer_rms_eps": 1e-6}

#: the chunk length of the scan (see the ``chunk_size`` argument of :class:`Mamba1Mixer`)
CHUNK_SIZE = SCAN_CHUNK


def _inverse_softplus(t: Tensor) -> Tensor:
    return t + torch.log(-torch.expm1(-t))


class Mamba1Mixer(RecurrentMixer):
    """Mamba's selective-scan mixer (transformers' ``MambaMixer``; with ``mixer_rms_eps``,
    ``FalconMambaMixer``).

    Args:
        dim: model width ``C``.
        inner: the inner width ``I`` (``expand * C``).
        state_size: ``N``, the state per inner channel.
        dt_rank: ``R``, the width of the low-rank ``dt`` projection.
        conv_size: the causal depthwise convolution's kernel (>= 1).
        conv_bias: a bias on the convolution.
        bias: biases on ``in_proj`` and ``out_proj``.
        mixer_rms_eps: FalconMamba: weightless RMSNorms of this epsilon on ``dt`` (before
            ``dt_proj``), ``B`` and ``C``; ``None`` (Mamba): none.
        chunk_size: the scan's chunk length (default :data:`attnzoo.functional.recurrent.selective_scan.SCAN_CHUNK`,
            measured there).
        device, dtype: of the parameters.

    Weights (transformers' names and layouts): ``in_proj [2I, C]`` (rows ``[x; z]``),
    ``conv1d.weight [I, 1, K]`` (``nn.Conv1d``'s), ``x_proj [R + 2N, I]`` (rows ``[dt; B; C]``),
    ``dt_proj [I, R]`` with bias, ``A_log [I, N]``, ``D [I]``, ``out_proj [C, I]``.

    Parts a family may set after building (Jamba): ``dt_layernorm``, ``b_layernorm``,
    ``c_layernorm``, modules applied to ``dt`` (before ``dt_proj``), ``B`` and ``C`` in place of
    the weightless norms (``mixer_rms_eps`` must then be ``None``); ``None`` (the default): none.

    The attention protocol of :class:`~attnzoo.nn.recurrent.RecurrentMixer`: ``forward(x, *,
    mask=, cache=, positions=, cu_seqlens=)``. Key padding zeroes the padded tokens' input (before
    ``in_proj``) and the convolution's output there, and a padded token does not decay the state
    (see the module docstring). Decode cache: the scan's state ``[B, I, N, 1]`` and the
    convolution's last ``K - 1`` inputs ``"conv1d" [B, I, K - 1]``.
    """

    def __init__(self, dim: int, inner: int, state_size: int = 16, dt_rank: int | None = None, *, conv_size: int = 4,
                 conv_bias: bool = True, bias: bool = False, mixer_rms_eps: float | None = None,
                 chunk_size: int = CHUNK_SIZE, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        owner = "Mamba1Mixer"
        dim = check_int(dim, "dim", owner=owner)
        inner = check_int(inner, "inner", owner=owner)
        # one "head" of width inner, layout "q_kv": the base makes kv_proj [2I, C] (Mamba's in_proj,
        # renamed) and out_proj [C, I] (the base's checks read out_proj); q_proj is not used
        super().__init__(dim, 1, head_dim=inner, bias=bias, layout="q_kv", factory=fk)
        self.in_proj = self.kv_proj
        del self.kv_proj, self.q_proj
        self.inner, self.proj_bias = inner, bias
        self.state_size = check_int(state_size, "state_size", owner=owner)
        self.dt_rank = math.ceil(dim / 16) if dt_rank is None else check_int(dt_rank, "dt_rank", owner=owner)
        self.conv_size = check_int(conv_size, "conv_size", owner=owner)
        self.conv_bias = bool(conv_bias)
        self.mixer_rms_eps = None if mixer_rms_eps is None else float(mixer_rms_eps)
        self.chunk_size = check_int(chunk_size, "chunk_size", owner=owner)
        self.conv1d = ShortConv(inner, self.conv_size, self.conv_bias, fk)
        self.x_proj = nn.Linear(inner, self.dt_rank + 2 * self.state_size, bias=False, **fk)
        self.dt_proj = nn.Linear(self.dt_rank, inner, bias=True, **fk)
        # Mamba's initialisation (S4D-real A, D = 1, dt in [1e-3, 0.1]); a checkpoint overwrites it
        a = torch.arange(1, self.state_size + 1, dtype=torch.float32, device=device).expand(inner, -1)
        self.A_log = nn.Parameter(torch.log(a).to(dtype or torch.get_default_dtype()).contiguous())
        self.D = nn.Parameter(torch.ones(inner, **fk))
        with torch.no_grad():
            dt = torch.exp(torch.rand(inner, device=device) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_proj.bias.copy_(_inverse_softplus(dt.clamp_min(1e-4)))
        self.conv_channels = {"conv1d": inner}
        self.state_shape = (inner, self.state_size, 1)
        # norms with weights on dt, B, C (Jamba): parts a family sets after building
        self.dt_layernorm: nn.Module | None = None
        self.b_layernorm: nn.Module | None = None
        self.c_layernorm: nn.Module | None = None

    def _rms(self, t: Tensor) -> Tensor:
        """FalconMamba's weightless RMSNorm over the last dimension, in float32 (or wider), cast back
        (``Llama4TextWeightlessRMSNorm``)."""
        assert self.mixer_rms_eps is not None
        w = t if t.dtype == torch.float64 else t.float()
        return (w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + self.mixer_rms_eps)).to(t.dtype)

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        keep = None if pad is None else pad[..., None]  # [B, T, 1]
        if keep is not None:  # transformers zeroes a padded token's input (modeling 571); where: a NaN stays out
            x = torch.where(keep, x, x.new_zeros(()))
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # [B, T, I] each
        xs, last = self.conv1d(xs, conv.get("conv1d"), cu)
        xs = F.silu(xs)
        if keep is not None:  # ... and the convolution's output (modeling 609)
            xs = torch.where(keep, xs, xs.new_zeros(()))
        dt, b, c = self.x_proj(xs).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        if self.mixer_rms_eps is not None:  # FalconMamba (modeling_falcon_mamba 596-598)
            dt, b, c = self._rms(dt), self._rms(b), self._rms(c)
        if self.dt_layernorm is not None:  # Jamba (modeling_jamba 720-722)
            assert self.b_layernorm is not None and self.c_layernorm is not None
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        # dt_proj's bias is added in float32 before the softplus (modeling 616, 374, 259-261)
        dt = F.softplus(wide(F.linear(dt, self.dt_proj.weight)) + wide(self.dt_proj.bias)).transpose(1, 2)  # [B, I, T]
        if pad is not None:  # a padded token neither writes (x = 0) nor decays the state
            dt = dt * pad[:, None, :].to(dt.dtype)
        s0 = None if state is None else state[..., 0]  # the cache keeps [B, I, N, 1]
        y, last_state = selective_scan(wide(xs).transpose(1, 2), dt, -wide(self.A_log).exp(), wide(b).transpose(1, 2),
                                       wide(c).transpose(1, 2), wide(self.D), wide(z).transpose(1, 2),
                                       initial_state=s0, return_last_state=True, cu_seqlens=cu,
                                       chunk_size=self.chunk_size)  # modeling 317-328
        return self.out_proj(y.transpose(1, 2).to(x.dtype)), last_state[..., None], {"conv1d": last}

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, inner={self.inner}, state_size={self.state_size}, dt_rank={self.dt_rank}, "
                f"conv_size={self.conv_size}, conv_bias={self.conv_bias}, bias={self.proj_bias}, "
                f"mixer_rms_eps={self.mixer_rms_eps}, chunk_size={self.chunk_size}")


def canonical(hf: HFConfig, defaults: Mapping[str, Any] = DEFAULTS) -> HFConfig:
    """``hf`` as transformers reads it: ``defaults`` where a key is absent, ``time_step_rank``
    resolved (``"auto"``: ``ceil(hidden_size / 16)``, else ``int()`` of it: modeling 502),
    ``intermediate_size`` the stored one, else ``int(expand * hidden_size)`` (config 94-97)."""
    out = hf.with_defaults(defaults)
    C = out.req("hidden_size")
    rank = out.raw("time_step_rank")
    if rank == "auto":
        rank = math.ceil(C / 16)
    elif isinstance(rank, str) and rank.strip().isdigit():
        rank = int(rank)
    if isinstance(rank, bool) or not isinstance(rank, (int, float)) or int(rank) != rank or rank < 1:
        raise CheckpointFormatError(f"{hf.source}: key 'time_step_rank' must be 'auto' or an integer >= 1, "
                                    f"got {rank!r}")
    inner = out.get("intermediate_size", None) or int(out.req("expand", float) * C)
    if inner < 1:
        raise CheckpointFormatError(f"{hf.source}: the inner width (intermediate_size, or expand * hidden_size) "
                                    f"is {inner}")
    out.data.update(time_step_rank=int(rank), intermediate_size=inner)
    return out


def _mixer_factory(hf: HFConfig, *, falcon: bool, device: Any, dtype: Any) -> Any:
    act = hf.get("hidden_act", "silu", str)
    if act not in ("silu", "swish"):
        raise hf.unsupported(f"hidden_act={act!r} (the convolution's activation; supported: 'silu')")
    eps = hf.req("mixer_rms_eps", float) if falcon else None
    return functools.partial(Mamba1Mixer, hf.req("hidden_size"), hf.req("intermediate_size"), hf.req("state_size"),
                             hf.req("time_step_rank"), conv_size=hf.req("conv_kernel"),
                             conv_bias=hf.req("use_conv_bias", bool), bias=hf.req("use_bias", bool),
                             mixer_rms_eps=eps, device=device, dtype=dtype)


def _build(hf: HFConfig, *, falcon: bool, head_size: int | None, device: Any, dtype: Any) -> DecoderLM:
    C, kw = hf.req("hidden_size"), {"device": device, "dtype": dtype}
    eps = hf.req("layer_norm_epsilon", float)
    mixer, norm = _mixer_factory(hf, falcon=falcon, **kw), parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixer, None, norm) for _ in range(hf.req("num_hidden_layers"))]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, heads=1, **kw)


def build_mamba(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``MambaConfig`` (random weights; see the module docstring)."""
    return _build(canonical(hf), falcon=False, head_size=head_size, device=device, dtype=dtype)


def build_falcon_mamba(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                       dtype: Any = None) -> DecoderLM:
    """The decoder of a ``FalconMambaConfig`` (random weights; see the module docstring)."""
    return _build(canonical(hf, FALCON_DEFAULTS), falcon=True, head_size=head_size, device=device, dtype=dtype)


def put_mamba1(plan: Plan, ours: str, theirs: str, *, bias: bool, conv_bias: bool) -> None:
    """A :class:`Mamba1Mixer` at ``ours`` (``"blocks.0.attn."``) from transformers' ``MambaMixer`` /
    ``FalconMambaMixer`` at ``theirs`` (``"layers.0.mixer."``): the same names and layouts."""
    plan.put_pairs(ours, theirs, [("in_proj", "in_proj"), ("out_proj", "out_proj")], bias=bias)
    plan.put_pairs(ours, theirs, [("conv1d", "conv1d")], bias=conv_bias)
    plan.put_pairs(ours, theirs, [("x_proj", "x_proj")], bias=False)
    plan.put_pairs(ours, theirs, [("dt_proj", "dt_proj")], bias=True)
    for name in ("A_log", "D"):
        plan.put(f"{ours}{name}", f"{theirs}{name}")


def _convert(hf: HFConfig, sd: dict[str, Tensor], *, falcon: bool, device: Any, dtype: Any) -> DecoderLM:
    hf = canonical(hf, FALCON_DEFAULTS if falcon else DEFAULTS)
    build = functools.partial(_build, falcon=falcon)
    model, plan, head_size = parts.start(hf, backbone_names(sd), build, device=device, dtype=dtype)
    bias, conv_bias = hf.req("use_bias", bool), hf.req("use_conv_bias", bool)
    for i in range(model.depth):
        put_mamba1(plan, f"blocks.{i}.attn.", f"layers.{i}.mixer.", bias=bias, conv_bias=conv_bias)
        plan.put(f"blocks.{i}.attn_norm.weight", f"layers.{i}.norm.weight")
    # FalconMamba's weightless norms hold dummy weights (non-persistent buffers, never read): ignored if saved
    ignore = [r"layers\.\d+\.mixer\.(dt|b|c)_layernorm\.weight"] if falcon else []
    return parts.finish(plan, model, head_size, final_norm="norm", ignore=ignore)


def convert_mamba(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a Mamba decoder and copy the weights (the head follows them)."""
    return _convert(hf, sd, falcon=False, device=device, dtype=dtype)


def convert_falcon_mamba(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a FalconMamba decoder and copy the weights (the head follows them)."""
    return _convert(hf, sd, falcon=True, device=device, dtype=dtype)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "mamba": parts.Dispatch("Mamba", convert_mamba, ("MambaForCausalLM", "MambaModel")),
    "falcon_mamba": parts.Dispatch("FalconMamba", convert_falcon_mamba, ("FalconMambaForCausalLM", "FalconMambaModel")),
}
