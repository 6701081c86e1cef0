r"""The compiled kernels: an opt-in C++ twin of the tiled forward and backward for windows, causal
and full attention (with softcap) in float32, of the packed varlen forward, and of NSA's selected
branch.

``native_window.cpp`` (beside this file) runs on the CPU as OpenMP over (head, block of 64
queries); per block one BLAS ``sgemm`` for the scores of the keys the block can see (``log2 e``
folded into the scale), one pass per row for the softcap, the maximum, ``exp2`` and the sum with the
invisible columns zeroed, one ``sgemm`` for ``P V``, rows scaled by ``1 / sum``. One parallel region
per call instead of ~1,000 torch operations: on the 2-core Xeon of docs/performance.md it ran the
(256, 0) window at N = 65,536 at 42-43% of the fp32 matmul peak against 31-33% for the flat band
(56% against 21% beside two busy processes), and dense causal N = 4096 in 0.94x SDPA's time against
1.31-1.36x for the PyTorch tiled forward. Its backward (``window_bwd``: per block of queries the
scores recomputed from the saved LSE, ``dP = dO V^T``, ``dS``, then ``dQ``, and ``dK`` / ``dV`` into
private buffers per (KV head, segment of query blocks) added up at the end) trains dense causal
N = 4096 in 0.85x SDPA's forward + backward time (the PyTorch tiled backward: 1.33x).

It is **built at install time or on request, never at import or call time**: the README's ``pip
install --no-build-isolation`` runs ``setup.py``, which compiles it beside this file (with a tag
file); ``attnzoo native --build`` (or :func:`build`) compiles it with ``torch.utils.cpp_extension``
(g++ and ninja; about 25 s) into ``$ATTNZOO_NATIVE_DIR`` (default ``~/.cache/attnzoo/native``), under
a tag of the Python, torch and CPU it was built for (:mod:`.native_build`). Where both exist,
:func:`module_path` picks the ``attnzoo native --build`` one; a build whose tag is not this Python's,
torch's, CPU's and sources' is never loaded. Once built, ``auto`` and ``backend="tiled"`` use it for what it serves
(:func:`native_forward`, differentiable; :func:`native_backward` inside compiled graphs), and so do
``attention_varlen`` (:func:`native_varlen`, and :func:`native_varlen_bwd` in training), split-KV decoding (:func:`native_decode`) and the ``nsa``
variant (:func:`native_nsa_selected`; :func:`native_nsa_selected_train` in training); ``ATTNZOO_NATIVE=0`` turns it off. It needs the ``sgemm_``
symbol that torch's x86 CPU wheels export (MKL); where that, a compiler or ninja is missing,
:func:`build` raises :class:`NativeUnavailable` with the reason (``setup.py`` prints it and installs
without the kernels) and the PyTorch path stays in use. The PyTorch
flat band / per-block bands remain the reference it is tested against.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import platform
import sys
import time
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.functional.backends.tiled.native_build import (
    NAME,
    SOURCES,
    TAG_FILE,
    compile_flags,
    cpu_tag,
    is_x86,
    link_flags,
)
from attnzoo.functional.core._edge import vouch_finite
from attnzoo.functional.core._request import AttnRequest
from attnzoo.functional.core.rules import key_bounds

__all__ = [
    "AUTO_MAX_RATIO",
    "AUTO_MAX_SPAN",
    "AUTO_MIN_KEYS",
    "BLOCK",
    "DECODE_SPLIT",
    "MAX_SCORE_BYTES",
    "WIDE_BLOCK",
    "WIDE_ROWS",
    "NativeUnavailable",
    "auto_mode",
    "build",
    "build_dir",
    "calibration",
    "enabled",
    "installed_path",
    "module_path",
    "native_backward",
    "native_decode",
    "native_forward",
    "native_module",
    "native_nsa_selected",
    "native_nsa_selected_train",
    "native_varlen",
    "native_varlen_bwd",
    "prefer_over_sdpa",
    "sides",
    "stale_install",
]

#: Query rows per block (measured, docs/performance.md: window (256, 0) at N=65536 191 / 193 ms at 32 / 64
#: rows; dense causal N=4096 1.00x / 0.90x / 0.94x SDPA's time at 32 / 64 / 128).
BLOCK = 64
#: Query rows per block where rows see at least :data:`WIDE_ROWS` keys (measured, docs/performance.md:
#: dense causal N = 4096 / 16384 at 0.92x / 1.00x SDPA's time with 64 rows, 0.87x / 0.94x with 128;
#: 16 packed causal sequences 0.99x / 0.96x the per-sequence SDPA loop's time); narrower windows
#: keep :data:`BLOCK` (a block's masked triangles grow with it).
WIDE_BLOCK = 128
WIDE_ROWS = 1024
#: The largest score buffer of one thread (a block x the keys it sees, float32): what the backward's
#: three row buffers need (the forward takes keys in chunks of 1,024 and would not, so the limit is
#: conservative for inference); longer rows (dense attention beyond N = 262,144 at 64-row blocks)
#: keep the PyTorch path, whose memory is O(N x block) by chunks.
MAX_SCORE_BYTES = 64 << 20
_cache: dict[Path, ModuleType | None] = {}


class NativeUnavailable(RuntimeError):
    """The compiled kernel cannot be built or loaded here (the message says why)."""


def build_dir() -> Path:
    """Where the kernel is built and looked for: ``$ATTNZOO_NATIVE_DIR/<tag>`` (default root
    ``~/.cache/attnzoo/native``); the tag changes with Python, torch, the CPU flags and the source."""
    return _dir_for(os.environ.get("ATTNZOO_NATIVE_DIR") or "")


@functools.lru_cache(maxsize=16)
def _dir_for(root: str) -> Path:
    return (Path(root) if root else Path.home() / ".cache" / "attnzoo" / "native") / cpu_tag()


def enabled() -> bool:
    """False when ``ATTNZOO_NATIVE=0`` (the PyTorch path always)."""
    return os.environ.get("ATTNZOO_NATIVE", "1") != "0"


def build(verbose: bool = False) -> Path:
    """Compile the kernel into :func:`build_dir` and return the path of the built module.

    Raises :class:`NativeUnavailable` (with the compiler's or loader's message) where it cannot be
    built or loaded: no compiler or ninja, no ``sgemm_`` in torch's libraries, not x86."""
    if not is_x86():
        raise NativeUnavailable(f"the compiled forward is for x86-64 CPUs; this is {platform.machine()}")
    from torch.utils import cpp_extension  # imported only to build

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(NAME, [str(s) for s in SOURCES], extra_cflags=compile_flags(), extra_ldflags=link_flags(),
                           build_directory=str(out), verbose=verbose)
    except Exception as e:  # a compiler, linker or loader error: the reason is in its message
        raise NativeUnavailable(f"building {', '.join(s.name for s in SOURCES)} failed: {type(e).__name__}: {e}") from e
    _cache.pop(out, None)
    return _built(out)


def _built(out: Path) -> Path:
    return out / f"{NAME}{'.pyd' if sys.platform == 'win32' else '.so'}"


def installed_path() -> Path | None:
    """The module ``pip install --no-build-isolation`` built beside this file (``setup.py``), when the
    tag written beside it is this Python's, torch's, CPU's and sources' (:func:`native_build.cpu_tag`),
    else ``None``: a build for another torch or CPU, or for sources edited since, is never loaded."""
    return _installed_in(Path(__file__).parent)


def _install_files(here: Path) -> tuple[Path, str | None]:
    """The module ``setup.py`` would have built in ``here`` and the tag written beside it (``None``:
    no tag file)."""
    try:
        tag: str | None = (here / TAG_FILE).read_text().strip()
    except OSError:
        tag = None
    return here / f"{NAME}{importlib.machinery.EXTENSION_SUFFIXES[0]}", tag


def _installed_in(here: Path) -> Path | None:
    path, tag = _install_files(here)
    return path if tag == cpu_tag() and path.exists() else None


def stale_install() -> str | None:
    """Why the module ``pip install`` built beside this file is not used, when there is one that is
    not (``None`` otherwise): built for another Python, torch, CPU or source (say, torch upgraded
    since the install)."""
    path, tag = _install_files(Path(__file__).parent)
    if not path.exists() or tag == cpu_tag():
        return None
    if tag is None:
        return f"{path.name} has no {TAG_FILE} beside it"
    return f"{path.name} was built for tag {tag}, this Python/torch/CPU/source is {cpu_tag()}"


def module_path() -> Path | None:
    """The file :func:`native_module` loads: the build of ``attnzoo native --build`` in
    :func:`build_dir` when there is one, else the one ``pip install`` built (:func:`installed_path`)."""
    built = _built(build_dir())
    return built if built.exists() else installed_path()


def native_module() -> ModuleType | None:
    """The built kernel's module, or ``None`` (not built for this Python/torch/CPU, turned off with
    ``ATTNZOO_NATIVE=0``, or it does not load). Never compiles."""
    if not enabled():
        return None
    out = build_dir()
    if out not in _cache:
        path, mod = module_path(), None
        if path is not None:
            try:
                spec = importlib.util.spec_from_file_location(NAME, path)
                if spec is not None and spec.loader is not None:
                    mod = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(mod)
            except (ImportError, OSError):
                mod = None
        _cache[out] = mod
    return _cache[out]


def sides(window: tuple[int | None, int | None] | None, causal: bool, n: int) -> tuple[int, int] | None:
    """``(left, right)`` of a normalised ``window`` over ``n`` keys: an unbounded side is ``n``;
    causality clips ``right`` to 0; ``None`` when a side is negative (a row could see nothing: the
    PyTorch path handles empty rows)."""
    left, right = window if window is not None else (None, None)
    left = n if left is None else left
    right = n if right is None else right
    if causal:
        right = min(right, 0)
    if left < 0 or right < 0:
        return None
    return min(left, n), min(right, n)


def _kernel_for(q: Tensor, k: Tensor, v: Tensor, lr: tuple[int, int] | None, n: int,
                block: int = BLOCK, strided: bool = False) -> ModuleType | None:
    """The built module when it serves float32 CPU ``q, k, v`` (contiguous; with ``strided``, rows
    contiguous and any other strides) whose rows of up to ``n`` keys see ``lr = (left, right)``
    within a score buffer of :data:`MAX_SCORE_BYTES`, else ``None`` (the module is asked last:
    without the build only these cheap checks run)."""
    if lr is None or block * min(n, block + lr[0] + lr[1]) * 4 > MAX_SCORE_BYTES:
        return None
    for t in (q, k, v):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return None
        if not (t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1] if strided else t.is_contiguous()):
            return None
    return native_module()


def native_forward(r: AttnRequest, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(out [B, Hq, N, Dv], lse [B, Hq, N])`` from the compiled kernel when it is built and serves
    ``r``, else ``None``.

    Served: a forward of full, causal or sliding-window attention (:func:`sides`) with an optional
    softcap and ALiBi (slopes without gradient) — differentiable (the compiled ``window_bwd``) when q,
    k or v needs a gradient —; no other mask or ``score_mod``; ``Nq == Nk`` with ``q_offset == 0``; float32 CPU q/k/v with contiguous rows (any
    other strides: a module's ``[B, N, H, D]`` projection viewed as ``[B, H, N, D]`` needs no whole copy, each thread copies the key/value rows it reads;
    GQA allowed); a score buffer of at most :data:`MAX_SCORE_BYTES` a thread."""
    kern = _served(r, q, k, v)
    if kern is None:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):  # training: the compiled backward
        out, lse = _NativeWindow.apply(q, k, v, kern)
    else:
        finite = torch.zeros((), dtype=torch.bool)
        out, lse = kern.mod.window_fwd(q, k, v, *kern.lr, kern.scale, kern.softcap, _block(kern.lr), True,
                                       kern.slopes, finite)
        if bool(finite):  # the kernel saw every value it wrote: the non-finite guard need not read them
            vouch_finite(out)
    return out, lse


def _block(lr: tuple[int, int] | None) -> int:
    """Query rows per block of the forward for rows seeing ``lr = (left, right)``."""
    return WIDE_BLOCK if lr is not None and lr[0] + lr[1] >= WIDE_ROWS else BLOCK


class _Kernel(NamedTuple):
    """A request as the window kernels take it: the built module, ``(left, right)``, the scale, the
    softcap (0: none) and the ALiBi slopes (``[Hq]`` float32, or ``None``)."""

    mod: ModuleType
    lr: tuple[int, int]
    scale: float
    softcap: float
    slopes: Tensor | None


def _served(r: AttnRequest, q: Tensor, k: Tensor, v: Tensor) -> _Kernel | None:
    """The kernel call serving ``r`` on these tensors, or ``None``: full, causal or windowed attention,
    ``Nq == Nk`` from position 0, an optional softcap and ALiBi (no gradient to its slopes); no other
    mask, ``score_mod`` or dropout."""
    slopes = r.alibi_slopes
    if (r.nq != r.nk or r.q_offset != 0 or r.mask_tensor is not None or r.mask_obj is not None
            or r.score_mod is not None or r.dropout_p or (slopes is not None and slopes.requires_grad)):
        return None
    lr = sides(r.window, r.causal, r.nk)
    mod = _kernel_for(q, k, v, lr, r.nk, strided=True)
    if mod is None or lr is None:
        return None
    return _Kernel(mod, lr, float(r.scale), float(r.softcap or 0.0),
                   None if slopes is None else slopes.detach().float().contiguous())


def native_backward(r: AttnRequest, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
                    d_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(dq, dk, dv)`` of :func:`native_forward`'s request from the compiled ``window_bwd`` when it is
    built and serves ``r`` (``out`` / ``lse`` of the forward, float32 ``lse``), else ``None``: what the
    compiled graph's backward operator (:mod:`attnzoo.functional.backends.tiled_ops`) runs."""
    kern = _served(r, q, k, v)
    if kern is None or lse.dtype != torch.float32 or lse.numel() != r.nq * q.shape[0] * q.shape[1]:
        return None
    return _window_bwd(kern, q, k, v, out, lse, d_out, d_lse)


def _window_bwd(kern: _Kernel, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor | None,
                d_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``window_bwd`` on ``[B, H, N, *]`` tensors (copied to the contiguous float32 ``[B H, N, *]`` rows
    it reads where they are not), gradients in the shapes of q, k, v."""
    def rows(t: Tensor) -> Tensor:
        return t.float().contiguous().flatten(0, 1)

    d_out = torch.zeros_like(out) if d_out is None else d_out
    d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
    slopes = None if kern.slopes is None else kern.slopes.repeat(q.shape[0])  # per [B H] row
    dq, dk, dv = kern.mod.window_bwd(*(rows(t) for t in (q, k, v, out, lse, d_out, d_lse)), *kern.lr, kern.scale,
                                     kern.softcap, BLOCK, slopes)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


class _NativeWindow(torch.autograd.Function):
    """``window_fwd`` and its backward ``window_bwd`` (the compiled kernels) as one differentiable op
    over ``[B, H, N, D]`` tensors; gradients to q, k, v from both outputs (out and the LSE)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, kern: _Kernel) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        # the sgemm form: window_bwd recomputes the scores as it does, against this LSE
        out, lse = kern.mod.window_fwd(q, k, v, *kern.lr, kern.scale, kern.softcap, _block(kern.lr), True,
                                       kern.slopes, None, False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kern = kern
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor | None, d_lse: Tensor | None):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        return (*_window_bwd(ctx.kern, q, k, v, out, lse, d_out, d_lse), None)


def native_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, *, causal: bool,
                  window: tuple[int | None, int | None] | None, scale: float | None,
                  softcap: float | None, training: bool = False) -> tuple[Tensor, Tensor] | None:
    """``(out [T, Hq, Dv], lse [Hq, T])`` of packed sequences (``attention_varlen``'s validated
    arguments) from the compiled kernel when it is built and serves them, else ``None``.
    ``training``: the LSE is for :func:`native_varlen_bwd`, so the scores are computed as it
    recomputes them (the sgemm form, not the register-blocked one).

    Served: inference (the caller checks that no gradient is needed) with ``cu_q == cu_k`` (each
    sequence's queries are its keys), no ALiBi, sinks or ``score_mod`` (the caller checks), contiguous
    float32 CPU q/k/v, a score buffer of at most :data:`MAX_SCORE_BYTES` a thread."""
    if native_module() is None or q.shape[0] == 0 or not torch.equal(cu_q, cu_k):  # unbuilt: no other work
        return None
    bounds = cu_q.to(torch.int64).contiguous()
    longest = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
    lr = sides(window, causal, longest)
    block = _block(lr)
    mod = _kernel_for(q, k, v, lr, longest, block)
    if mod is None or lr is None:
        return None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return mod.varlen_fwd(q, k, v, bounds, lr[0], lr[1], float(scale), float(softcap or 0.0), block, not training)


def native_varlen_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
                      d_lse: Tensor | None, cu: Tensor, *, causal: bool,
                      window: tuple[int | None, int | None] | None, scale: float | None,
                      softcap: float | None) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(dq [T, Hq, D], dk [T, Hkv, D], dv [T, Hkv, Dv])`` of packed sequences whose queries are their
    keys (``cu`` their boundaries) from the compiled ``window_bwd``, one call per sequence on its
    ``[H, n, *]`` rows, else ``None`` (not built, not float32 CPU, a row that sees no key, a score
    buffer over :data:`MAX_SCORE_BYTES`). ``out`` / ``lse [Hq, T]`` are the forward's (either path's:
    both are the natural-log LSE); no ALiBi, sinks or ``score_mod`` (the caller checks)."""
    mod = native_module()
    tensors = (q, k, v, out, d_out, lse, *(() if d_lse is None else (d_lse,)))
    if mod is None or q.shape[0] == 0 or not all(t.dtype == torch.float32 and t.device.type == "cpu"
                                                 for t in tensors):
        return None
    bounds = cu.tolist()
    longest = max(b - a for a, b in pairwise(bounds))
    lr = sides(window, causal, longest)
    if lr is None or BLOCK * min(longest, BLOCK + lr[0] + lr[1]) * 4 > MAX_SCORE_BYTES:
        return None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in pairwise(bounds):
        if b == a:
            continue
        rows = [t[a:b].transpose(0, 1).contiguous() for t in (q, k, v, out)]  # the sequence's [H, n, *]
        grads = mod.window_bwd(*rows, lse[:, a:b].contiguous(), d_out[a:b].transpose(0, 1).contiguous(),
                               d_lse[:, a:b].contiguous(), *lr, float(scale), float(softcap or 0.0), BLOCK, None)
        for whole, part in zip((dq, dk, dv), grads, strict=True):
            whole[a:b] = part.transpose(0, 1)
    return dq, dk, dv


#: Queries per task of the compiled NSA selected branch (one (batch, KV group) each; measured,
#: docs/performance.md).
NSA_CHUNK = 512


def native_nsa_selected(q: Tensor, kb: Tensor, vb: Tensor, idx: Tensor, ok: Tensor, q_offset: int,
                        scale: float) -> Tensor | None:
    """NSA's selected branch ``[B, H, Nq, Dv]`` from the compiled kernel when it is built and serves
    the call, else ``None``: queries ``q [B, H, Nq, D]`` at positions ``q_offset ..`` over their
    picked blocks ``idx, ok [B, G, Nq, n]`` (``ok`` false: a padding slot) of the key / value blocks
    ``kb [B, G, Ns, l', D]``, ``vb [B, G, Ns, l', Dv]``, each query seeing the picked keys at or
    before its position. Served: inference (the caller checks), float32 CPU tensors."""
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, kb, vb)):
        return None
    mod = native_module()
    if mod is None:
        return None
    return mod.nsa_selected_fwd(q.contiguous(), kb.contiguous(), vb.contiguous(), idx.contiguous(),
                                ok.contiguous(), int(q_offset), float(scale), NSA_CHUNK)


def native_nsa_selected_train(q: Tensor, kb: Tensor, vb: Tensor, idx: Tensor, ok: Tensor, q_offset: int,
                              scale: float) -> Tensor | None:
    """:func:`native_nsa_selected` for training: the same ``[B, H, Nq, Dv]``, differentiable in ``q``,
    ``kb`` and ``vb`` through the compiled ``nsa_selected_bwd`` (the forward keeps each row's
    log-sum-exp for it), or ``None`` where the kernels are not built or the tensors are not float32
    CPU."""
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, kb, vb)):
        return None
    mod = native_module()
    if mod is None:
        return None
    return _NativeNSASelected.apply(q, kb, vb, idx.contiguous(), ok.contiguous(), int(q_offset), float(scale), mod)


class _NativeNSASelected(torch.autograd.Function):
    """``nsa_selected_train_fwd`` and ``nsa_selected_bwd`` as one differentiable op in q, kb, vb."""

    @staticmethod
    def forward(ctx, q: Tensor, kb: Tensor, vb: Tensor, idx: Tensor, ok: Tensor, q_offset: int,  # type: ignore[override]
                scale: float, mod: ModuleType) -> Tensor:
        q, kb, vb = q.contiguous(), kb.contiguous(), vb.contiguous()
        out, lse = mod.nsa_selected_train_fwd(q, kb, vb, idx, ok, q_offset, scale, NSA_CHUNK)
        ctx.save_for_backward(q, kb, vb, idx, ok, out, lse)
        ctx.args = (q_offset, scale, mod)
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):  # type: ignore[override]
        q, kb, vb, idx, ok, out, lse = ctx.saved_tensors
        q_offset, scale, mod = ctx.args
        dq, dkb, dvb = mod.nsa_selected_bwd(q, kb, vb, idx, ok, out, lse, d_out.float().contiguous(), q_offset,
                                            scale, NSA_CHUNK)
        return dq, dkb, dvb, None, None, None, None, None


#: Keys per task of the compiled split-KV decode (one (batch, KV head, split) each; measured, one
#: token against a 32k GQA cache 32/8, D=128, 2 threads: 15.3 / 15.8 / 17.0 / 18.2 / 20.0 ms at
#: 1,024 / 2,048 / 4,096 / 8,192 / 32,768 keys a split, SDPA ``enable_gqa`` 37.9 ms).
DECODE_SPLIT = 1024


def native_decode(r: AttnRequest) -> tuple[Tensor, Tensor] | None:
    """``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq])`` of a split-KV decoding request (what
    :func:`attnzoo.functional.backends.decode.split_kv_attention` serves) from the compiled kernel when
    it is built and serves it, else ``None``. Served: no gradient needed (the caller checks), float32
    CPU tensors, ``q`` contiguous and K/V rows contiguous (a slice of a longer cache is read in place),
    no mask tensor / ``Mask`` / ALiBi / ``score_mod`` / dropout."""
    q, k, v = r.q, r.k, r.v
    if (r.mask_tensor is not None or r.mask_obj is not None or r.score_mod is not None
            or r.alibi_slopes is not None or r.dropout_p or r.nk == 0 or r.nq == 0):
        return None
    if not (all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1
                and t.stride(-2) == t.shape[-1] for t in (q, k, v)) and q.is_contiguous()):
        return None
    mod = native_module()
    if mod is None:
        return None
    far = r.nk + r.q_offset + r.nq  # an unbounded side
    left, right = key_bounds(r.causal, r.window)
    left, right = far if left is None else left, far if right is None else right
    if left < 0 or right < 0:
        return None  # rows that see nothing by construction: the PyTorch path
    return mod.decode_fwd(q, k, v, min(left, far), min(right, far), r.q_offset, float(r.scale),
                          float(r.softcap or 0.0), DECODE_SPLIT)


#: Fewest keys from which ``auto`` may run float32 full / causal / windowed CPU attention that it would
#: give SDPA through the compiled kernel instead (measured on the Xeon of docs/performance.md, kernel /
#: SDPA time, training and inference: 0.76x / 0.86x at 32 x 4 heads x 128 keys, 0.65x / 0.68x at 512;
#: but 1.8x / 2.1x at 64 keys and 1.3x / 1.4x at 32, where fixed costs dominate).
AUTO_MIN_KEYS = 128
#: Most keys a block of queries may see for ``auto`` to prefer the kernel: beyond, SDPA's flash kernel
#: catches up (dense causal, kernel / SDPA time, inference / training: 0.96x / 0.89x at 2,048 keys,
#: 0.94x / 0.94x at 4,096, 0.96x / 0.99x at 8,192, 0.97x / 1.05x at 16,384).
AUTO_MAX_SPAN = 4096
#: ``auto`` prefers the kernel when its calibration call takes at most this fraction of SDPA's time.
AUTO_MAX_RATIO = 0.9
_AUTO_MODES = ("measure", "native", "sdpa")
_calibrated: dict[bool, float] = {}


def auto_mode() -> str:
    """``ATTNZOO_NATIVE_AUTO``: ``measure`` (default: time the kernel against SDPA once a process),
    ``native`` (always prefer the kernel where it serves) or ``sdpa`` (never)."""
    mode = os.environ.get("ATTNZOO_NATIVE_AUTO", "measure").strip().lower() or "measure"
    if mode not in _AUTO_MODES:
        raise ValueError(f"ATTNZOO_NATIVE_AUTO must be one of {_AUTO_MODES}, got {mode!r}")
    return mode


def prefer_over_sdpa(r: AttnRequest, training: bool) -> bool:
    """Whether ``auto``, having chosen SDPA for ``r``, runs the compiled kernel instead: it is built and
    serves ``r`` (float32 CPU, ``Nq == Nk`` of at least :data:`AUTO_MIN_KEYS`, blocks that see at most
    :data:`AUTO_MAX_SPAN` keys, no mask tensor / ``Mask`` / dropout) and, per :func:`auto_mode`, it was measured on this CPU at most
    :data:`AUTO_MAX_RATIO` of SDPA's time for this mode (``training``: forward + backward) — timed
    once a process, as the half-precision policy is (:func:`calibration`)."""
    if r.nk < AUTO_MIN_KEYS or r.q.device.type != "cpu" or r.q.dtype != torch.float32:
        return False
    kern = _served(r, r.q, r.k, r.v)
    if kern is None or min(r.nk, BLOCK + kern.lr[0] + kern.lr[1]) > AUTO_MAX_SPAN:
        return False
    mode = auto_mode()
    if mode != "measure":
        return mode == "native"
    return calibration(training) <= AUTO_MAX_RATIO


def calibration(training: bool) -> float:
    """The kernel's time over SDPA's for causal attention, ``[2, 8, 512, 64]`` float32, on this CPU with
    the process's threads (``training``: forward + backward); measured on the first call (best of
    three, interleaved, after a warm-up: about 0.1 s), then cached. ``inf`` without the build."""
    if training not in _calibrated:
        mod = native_module()
        _calibrated[training] = float("inf") if mod is None else _time_against_sdpa(mod, training)
    return _calibrated[training]


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _time_against_sdpa(mod: ModuleType, training: bool) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(2, 8, 512, 64, generator=g) for _ in range(4))
    if training:
        q, k, v = (t.requires_grad_() for t in (q, k, v))

    def ours() -> None:
        if training:
            _NativeWindow.apply(q, k, v, _Kernel(mod, (512, 0), 0.125, 0.0, None))[0].backward(d_out)
        else:
            mod.window_fwd(q, k, v, 512, 0, 0.125, 0.0, _block((512, 0)), True)

    def sdpa() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if training:
            out.backward(d_out)

    best = {ours: float("inf"), sdpa: float("inf")}
    # identity hooks on top of the stack: the timing's saved tensors never reach a caller's hooks
    # (cost.measure_activation_bytes counted them when its call was the first to calibrate)
    with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is), \
            torch.enable_grad() if training else torch.no_grad():
        for i in range(4):  # the first round warms up
            for fn in (ours, sdpa):
                t0 = time.perf_counter()
                fn()
                if i:
                    best[fn] = min(best[fn], time.perf_counter() - t0)
    return best[ours] / best[sdpa]
