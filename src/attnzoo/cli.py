"""The ``attnzoo`` command: ``list``, ``check``, ``bench``, ``cost``, ``viz`` and ``arena``.

The CLI is thin: it parses (one parser function per command), checks every output path before
any work starts, calls the public API and prints. Bad arguments, unwritable outputs and sizes
that would not fit in memory give a one-line error and exit code 2; ``check`` exits 1 when
anything fails. Optional extras (rich, tqdm, matplotlib, transformers) are imported only by the
command that uses them. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from attnzoo import viz
from attnzoo._interrupt import interrupted_exit_code
from attnzoo._memory import format_bytes as _human_bytes
from attnzoo._outputs import ensure_output_dir, ensure_output_file
from attnzoo._validate import nonempty_name_arg as _file_name
from attnzoo._validate import nonnegative_int_arg as _nonnegative_int
from attnzoo._validate import positive_float_arg as _positive_float
from attnzoo._validate import positive_int_arg as _positive_int
from attnzoo.arena import add_arena_arguments, load_arena_model, run_arena
from attnzoo.bench import format_value, run_bench
from attnzoo.check import backend_cases, run_checks
from attnzoo.cost import StackEstimate, dtype_from_name, estimate, estimate_stack
from attnzoo.functional.backends.tiled import native as _native
from attnzoo.functional.softmax.attention import available_backends
from attnzoo.variants import VARIANTS, layer_pattern, variant_names

__all__ = ["build_parser", "main"]

BACKEND_NAMES = ("reference", "sdpa", "tiled", "flex", "flash")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_BENCH_BACKENDS = ("torch", "sdpa", "tiled")


class CLIError(Exception):
    """A bad argument found after parsing: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# =========================================================================== argument types
def _int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        out.append(_positive_int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return out


def _name_list(choices: Sequence[str] | None = None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        if choices is not None:
            bad = [n for n in names if n not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; expected some of {', '.join(choices)}")
        return names

    return parse


def _window(text: str) -> int | tuple[int | None, int | None]:
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) == 1:
            return int(parts[0])
        if len(parts) == 2:
            left, right = (None if p in ("", "none", "None") else int(p) for p in parts)
            return (left, right)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected W or LEFT,RIGHT (integers, 'none' = unbounded), got {text!r}")


def _device_arg(text: str) -> str:
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu or cuda, got {text!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda was asked for but torch.cuda.is_available() is False")
    return text


def _variant_list(text: str) -> list[str]:
    return _name_list(variant_names())(text)


def _stack_list(text: str) -> list[str]:
    """Comma-separated variants, each a registry name or a per-layer stack ``a/b/c``."""
    items = [t.strip() for t in text.split(",")]
    for item in items:
        try:
            layer_pattern(item, 1)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"{item!r}: {e}") from None
    return items


# =========================================================================== output helpers
def _rich_console() -> Any:
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console()


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, plain: bool = False) -> None:
    """A table through rich when installed (and ``plain`` is False), else aligned plain text."""
    cells = [[str(c) for c in r] for r in rows]
    console = None if plain or not sys.stdout.isatty() else _rich_console()
    if console is not None:
        from rich.table import Table  # rich is installed: _rich_console found it

        t = Table(title=title)
        for c in columns:
            t.add_column(c)
        for r in cells:
            t.add_row(*r)
        console.print(t)
        return
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print(title)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


class _Progress:
    """A progress bar (tqdm, else rich, else nothing) that takes labels."""

    def __init__(self, total: int | None, desc: str, enabled: bool) -> None:
        self.bar: Any = None
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def __call__(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label[:40], refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _human_flops(n: float) -> str:
    for unit, f in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n:.0f} FLOP"


# =========================================================================== list
def cmd_list(args: argparse.Namespace) -> int:
    """``attnzoo list``: the registry as a table or JSON."""
    dt = dtype_from_name(args.dtype)
    rows, data = [], []
    for name, spec in VARIANTS.items():
        try:
            kv = args.kv_heads if "num_kv_heads" in spec.options else None  # variants with KV groups
            est = estimate(name, args.seq_len, args.dim, args.heads, num_kv_heads=kv, dtype=dt, backend="ideal")
        except (ValueError, TypeError) as exc:
            raise CLIError(f"{name}: {exc}") from None
        rows.append([name, spec.family, "exact" if spec.exact else "approx", spec.time, *_cache_cells(est),
                     *([spec.memory, spec.decoding, spec.masks, spec.positions] if args.wide else [])])
        data.append({"name": name, "family": spec.family, "exact": spec.exact, "time": spec.time,
                     "memory": spec.memory, "kv_cache_bytes_per_token": est.kv_cache_bytes_per_token,
                     "kv_cache_bytes": est.kv_cache_bytes, "kv_cache_max_tokens": est.kv_cache_max_tokens,
                     "decoding": spec.decoding, "masks": spec.masks, "positions": spec.positions})
    if args.json:
        print(json.dumps({"config": {"dim": args.dim, "heads": args.heads, "kv_heads": args.kv_heads,
                                     "dtype": str(dt).replace("torch.", ""), "seq_len": args.seq_len},
                          "variants": data}, indent=2))
        return 0
    print_table(f"attention variants (one layer, C={args.dim}, H={args.heads}, {args.dtype}, cache at N={args.seq_len})",
                ["variant", "family", "exact", "time", "KV bytes/token", "cache at N",
                 *(["attention memory", "decoding cache", "masks", "positions"] if args.wide else [])], rows,
                plain=args.plain)
    if not args.wide:
        print("(--wide adds attention memory, decoding cache, masks and positions: rope / own / none)")
    return 0


def _cache_cells(est: Any) -> list[str]:
    """``KV bytes/token`` and ``cache at N`` of ``attnzoo list``: a cache that grows with N, one
    capped at a window, or a fixed-size state."""
    if not est.kv_cache_bytes_per_token:
        return ["0 (fixed state)", f"{_human_bytes(est.kv_cache_bytes)} (fixed size)"]
    cap = "grows with N" if est.kv_cache_max_tokens is None else f"<= {est.kv_cache_max_tokens} tokens"
    return [_human_bytes(est.kv_cache_bytes_per_token), f"{_human_bytes(est.kv_cache_bytes)} ({cap})"]


# =========================================================================== check
def _check_outputs(args: argparse.Namespace) -> None:
    """Prove ``--json`` writable before the checks run."""
    if args.json:
        try:
            ensure_output_file(args.json, "--json")
        except ValueError as exc:
            raise CLIError(str(exc)) from None


def _print_check_report(report: Any, args: argparse.Namespace) -> None:
    rows = []
    for r in report.rows:
        rows.append([r.group, r.target, r.setting, r.cases, r.skipped, f"{r.max_err:.2e}" if r.cases else "-",
                     f"{r.max_ratio:.2f}" if r.cases else "-", "PASS" if r.passed and r.status == "ok"
                     else r.status.upper() if r.passed else "FAIL"])
    print_table("attnzoo check: every backend and variant against the independent float64 oracle",
                ["group", "target", "setting", "cases", "skipped", "max error", "error/tol", "result"], rows,
                plain=args.plain)
    fails = [(r, f) for r in report.rows for f in r.failures]
    for r, f in fails[: args.show_failures]:
        print(f"FAIL {r.target} ({r.setting}): {f}")
    if len(fails) > args.show_failures:
        print(f"... and {len(fails) - args.show_failures} more failures (--show-failures N)")
    for r in report.rows:
        for note in sorted(r.notes):
            print(f"note: {r.target} ({r.setting}): {note}")
    missing = [r.target for r in report.rows if r.status == "missing"]
    if missing:
        print(f"note: modules not available yet (not checked): {', '.join(missing)}")
    print(f"{'OK' if report.ok else 'FAILED'}: {sum(r.cases for r in report.rows)} cases in {report.seconds:.1f} s "
          f"(tolerance rule: docs/cli.md#check)")


def cmd_check(args: argparse.Namespace) -> int:
    """``attnzoo check``: exit 0 when everything passes, 1 otherwise."""
    _check_outputs(args)
    backends = args.backends if args.backends is not None else available_backends(args.device)
    n_cases = len([c for c in backend_cases() if c.quick or not args.quick])
    total = n_cases * len(backends) * len(args.dtypes)
    bar = _Progress(total, "check", enabled=not args.no_progress and sys.stderr.isatty())
    try:
        report = run_checks(backends=backends, dtypes=args.dtypes, include_variants=not args.no_variants,
                            include_models=not (args.no_variants or args.no_models),
                            variants=args.variants, device=args.device, quick=args.quick, grad=not args.no_grad,
                            strict=args.strict, seed=args.seed, progress=bar)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    finally:
        bar.close()
    _print_check_report(report, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0 if report.ok else 1


# =========================================================================== bench
def cmd_bench(args: argparse.Namespace) -> int:
    """``attnzoo bench``: measure, write CSV/JSON/PNG into ``--out``, print the table."""
    try:
        ensure_output_dir(args.out, "--out")
        for ext in ("csv", "json") if args.no_plot else ("csv", "json", "png"):  # before the work, not after
            ensure_output_file(Path(args.out) / f"{args.name}.{ext}", "--out/--name")
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.backends is None and args.variants is None:
        args.backends = list(DEFAULT_BENCH_BACKENDS)
    targets = list(args.backends or []) + list(args.variants or [])
    n_total = len(targets) * len(args.seq_lens)
    bar = _Progress(n_total, "bench", enabled=not args.no_progress and sys.stderr.isatty())
    try:
        report = run_bench(targets, args.seq_lens, mode=args.mode, dtype=args.dtype, device=args.device,
                           batch=args.batch, heads=args.heads, head_dim=args.head_dim, causal=not args.no_causal,
                           window=args.window, repeats=args.repeats, warmup=args.warmup, memory=not args.no_memory,
                           max_case_seconds=args.max_case_seconds, peak_max_n=args.peak_size, seed=args.seed,
                           compile=args.compile, progress=bar)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    finally:
        bar.close()
    paths = report.write(args.out, stem=args.name, plot=not args.no_plot)
    peak = report.meta["matmul_peak_gflops"]
    head = ["target", "N", "median ms", "peak MiB", "GFLOP/s", "% of mm peak", "status"]
    rows = [[r.target, r.seq_len, format_value(r.time_ms, ".2f"), format_value(r.peak_mem_mb, ".1f"),
             format_value(r.gflops, ".1f"),
             format_value(None if r.frac_of_peak is None else 100 * r.frac_of_peak, ".0f"), r.status]
            for r in report.results]
    if args.compile:  # compiled median, then compile time, eager median and the ratio
        head[2:2] = ["compile s", "eager ms", "compiled/eager"]
        for row, r in zip(rows, report.results, strict=True):
            row[2:2] = [format_value(r.compile_s, ".2f"), format_value(r.eager_ms, ".2f"),
                        format_value(r.compiled_over_eager, ".2f")]
    print_table(f"attnzoo bench ({args.mode}, {args.dtype}, {args.device}, B={args.batch} H={args.heads} "
                f"D={args.head_dim}{', torch.compile' if args.compile else ''}; torch.mm peak {peak:.0f} GFLOP/s)",
                head, rows, plain=args.plain)
    for kind, p in paths.items():
        print(f"wrote {kind}: {p}")
    return 0


# =========================================================================== cost
def cmd_cost(args: argparse.Namespace) -> int:
    """``attnzoo cost``: the analytic cost of one layer (or of a ``a/b/c`` stack) as a table or JSON."""
    settings = {"batch": args.batch, "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "window": args.window,
                "num_features": args.features, "segment_len": args.segment_len, "chunk_size": args.chunk_size,
                "causal": not args.no_causal, "dtype": args.dtype, "backend": args.backend}
    try:
        if "/" in args.variant:
            return _print_stack_cost(estimate_stack(args.variant, args.seq_len, args.dim, args.heads, **settings), args)
        est = estimate(args.variant, args.seq_len, args.dim, args.heads, **settings)
    except (ValueError, TypeError) as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        print(json.dumps(est.as_dict(), indent=2))
        return 0
    rows = [
        ["forward FLOPs", _human_flops(est.flops), f"projections {_human_flops(est.flops_projections)} + "
                                                   f"attention {_human_flops(est.flops_attention)}"],
        ["useful attention FLOPs", _human_flops(est.flops_useful),
         f"visible pairs only ({100 * est.visible_fraction:.1f}% of N x N)"],
        ["backward FLOPs", _human_flops(est.flops_backward), ""],
        ["bytes moved (fwd)", _human_bytes(est.bytes_moved), f"arithmetic intensity {est.arithmetic_intensity:.1f} FLOP/B"],
        ["activation memory", _human_bytes(est.activation_bytes), "kept for backward by one training forward"],
        ["KV cache / token", _human_bytes(est.kv_cache_bytes_per_token), "0 = fixed-size state"],
        ["KV cache at N", _human_bytes(est.kv_cache_bytes),
         "unbounded" if est.kv_cache_max_tokens is None else f"holds at most {est.kv_cache_max_tokens} tokens"],
        ["parameters", f"{est.params:,}", "weights of Q, K, V, O"],
    ]
    print_table(f"cost of one {est.variant} layer: B={est.batch} N={est.seq_len} C={est.dim} H={est.num_heads} "
                f"Hkv={est.num_kv_heads} D={est.head_dim} {est.dtype}, backend {est.backend}",
                ["quantity", "value", "note"], rows, plain=args.plain)
    return 0


def _print_stack_cost(stack: StackEstimate, args: argparse.Namespace) -> int:
    """The table (or JSON) of a stack of layers: one row per layer, then the totals."""
    if args.json:
        print(json.dumps(stack.as_dict(), indent=2))
        return 0
    rows = [[f"{i}: {layer.variant}", _human_flops(layer.flops), _human_flops(layer.flops_backward),
             _human_bytes(layer.kv_cache_bytes), f"{layer.params:,}"] for i, layer in enumerate(stack.layers)]
    rows.append(["total", _human_flops(stack.flops), _human_flops(stack.flops_backward),
                 _human_bytes(stack.kv_cache_bytes), f"{stack.params:,}"])
    print_table(f"cost of the {len(stack.layers)}-layer stack {args.variant}: B={args.batch} N={args.seq_len} "
                f"C={args.dim} H={args.heads} {args.dtype}", ["layer", "forward FLOPs", "backward FLOPs",
                                                               "decode state at N", "parameters"],
                rows, plain=args.plain)
    return 0


# =========================================================================== viz
def _viz_paths(args: argparse.Namespace) -> dict[str, str | None]:
    """The PNG path of each picture asked for (the first takes ``--png``, the others a suffix of it),
    each proven writable before anything is drawn."""
    paths: dict[str, str | None] = {}
    if args.mask is not None:
        paths["mask"] = args.png
    if args.positional is not None:
        paths["positional"] = args.png if args.mask is None else _suffix(args.png, "positional")
        if paths["positional"] is None:
            raise CLIError("--positional draws a picture: give --png PATH")
    if args.model is not None:
        if not args.text:
            raise CLIError("--model needs --text")
        paths["model"] = args.png if args.mask is None and args.positional is None else _suffix(args.png, "attention")
        if paths["model"] is None:
            raise CLIError("--model draws attention maps: give --png PATH")
    if not paths:
        raise CLIError("nothing to draw: give --mask EXPR, --positional KIND or --model PATH --text TEXT")
    for p in paths.values():
        if p is not None:
            try:
                ensure_output_file(p, "--png")
            except ValueError as exc:
                raise CLIError(str(exc)) from None
    for p in paths.values():  # every path is writable: make the folders they go into
        if p is not None:
            Path(p).parent.mkdir(parents=True, exist_ok=True)
    return paths


def _viz_mask(args: argparse.Namespace, path: str | None) -> None:
    try:
        text = viz.mask_to_text(args.mask, args.n or 16, args.nk, q_offset=args.q_offset)
    except (ValueError, TypeError) as exc:
        raise CLIError(str(exc)) from None
    print(text)
    if path:
        _close(viz.plot_mask(args.mask, args.n or 16, args.nk, q_offset=args.q_offset, path=path))
        print(f"wrote {path}")


def _viz_positional(args: argparse.Namespace, path: str) -> None:
    try:
        fig = viz.plot_positional(args.positional, n=args.n or 128, dim=args.dim, heads=args.heads, path=path)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    _close(fig)
    print(f"wrote {path}")


def _load_for_viz(path: str) -> tuple[Any, viz.Tokenize]:
    """A Hugging Face model folder (:func:`attnzoo.viz.load_model`) or an arena checkpoint file."""
    try:
        return viz.load_model(path) if Path(path).is_dir() else load_arena_model(path)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise CLIError(str(exc)) from None


def _viz_model(args: argparse.Namespace, path: str) -> None:
    model, tokenize = _load_for_viz(args.model)
    try:
        ids, labels = tokenize(args.text)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    with torch.no_grad(), viz.capture_attention(model) as cap:
        model(ids)
    if not cap.layers or not any(cap.maps.values()):
        raise CLIError(f"no attention weights captured from {args.model} ({cap.skipped or 'no attention modules'})")
    layer = args.layer if args.layer is not None else len(cap.layers) - 1
    if not -len(cap.layers) <= layer < len(cap.layers):
        raise CLIError(f"--layer {layer} out of range: the model has {len(cap.layers)} attention layers")
    name = cap.layers[layer]
    _close(viz.plot_attention(cap[name], labels, title=f"{Path(args.model).name}: {name}", path=path))
    print(f"layers: {', '.join(cap.layers)}")
    print(f"wrote {path} ({name}, {cap[name].shape[1]} heads, {len(labels)} tokens)")


def cmd_viz(args: argparse.Namespace) -> int:
    """``attnzoo viz``: a mask, positional encodings and/or a model's attention maps."""
    paths = _viz_paths(args)
    if "mask" in paths:
        _viz_mask(args, paths["mask"])
    if "positional" in paths:
        _viz_positional(args, str(paths["positional"]))
    if "model" in paths:
        _viz_model(args, str(paths["model"]))
    return 0


def _suffix(path: str | None, tag: str) -> str | None:
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{tag}{p.suffix or '.png'}"))


def _close(fig: Any) -> None:
    import matplotlib.pyplot as plt  # a figure exists, so matplotlib is installed

    plt.close(fig)


# =========================================================================== arena
def cmd_arena(args: argparse.Namespace) -> int:
    """``attnzoo arena``: train and report (see :func:`attnzoo.arena.run_arena`)."""
    try:
        return run_arena(args)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


# =========================================================================== native
def cmd_native(args: argparse.Namespace) -> int:
    """``attnzoo native [--build]``: whether the compiled forward is built for this Python/torch/CPU
    (and used), or build it (:mod:`attnzoo.functional.backends.tiled.native`)."""
    if args.build:
        t0 = time.perf_counter()
        try:
            path = _native.build(verbose=args.verbose)
        except _native.NativeUnavailable as exc:
            raise CLIError(f"{exc}\nattnzoo keeps its PyTorch path; nothing else changes.") from None
        print(f"built {path} in {time.perf_counter() - t0:.1f} s")
    mod = _native.native_module()
    state = ("off (ATTNZOO_NATIVE=0)" if not _native.enabled() else
             f"built and used from {_native.module_path()} (tiled backend, attention_varlen and NSA's "
             "selected branch forward and backward; split-KV decoding)"
             if mod is not None else
             "not built for this Python/torch/CPU (attnzoo native --build; or reinstall as the README says)")
    print(f"compiled kernels: {state}; build directory {_native.build_dir()}")
    if mod is not None and _native.enabled():
        print("forward form: " + ("register-blocked AVX-512 micro-kernels (float32 inference; sgemm for training and "
                                  "value widths not a multiple of 16 up to 128)" if mod.has_fused() else "sgemm (no AVX-512 on the CPU that built it)"))
    if mod is None and (stale := _native.stale_install()) is not None:
        print(f"the install's build is not used: {stale} (attnzoo native --build, or reinstall)")
    if mod is not None and _native.enabled():
        mode = _native.auto_mode()
        if mode == "measure":
            inf, train = _native.calibration(False), _native.calibration(True)
            say = " and ".join(f"{what} ({ratio:.2f}x SDPA's time)" for what, ratio in
                               (("inference", inf), ("training", train)) if ratio <= _native.AUTO_MAX_RATIO)
            print(f"auto on this CPU: the kernel takes {inf:.2f}x SDPA's time in inference and {train:.2f}x in "
                  f"training (causal [2, 8, 512, 64] float32, {torch.get_num_threads()} threads); auto runs "
                  f"float32 attention of >= {_native.AUTO_MIN_KEYS} keys through it for "
                  f"{say or 'neither (both above ' + format(_native.AUTO_MAX_RATIO) + 'x)'}; "
                  f"ATTNZOO_NATIVE_AUTO=native|sdpa decides instead")
        else:
            print(f"auto: ATTNZOO_NATIVE_AUTO={mode}")
    return 0


_NATIVE_ABOUT = ("The optional C++ kernels on x86 CPUs: the float32 forward and backward of full, causal and "
                 "sliding-window attention (softcap included), of packed varlen sequences and of NSA's selected "
                 "branch, and split-KV decoding (needs g++ and ninja; about 25 s "
                 "to build). The README's install (pip install --no-build-isolation) builds them already; "
                 "--build builds them into the cache folder (after an install that could not). Without "
                 "--build: says whether they are built for this Python, torch and CPU, and where. Once "
                 "built, the tiled backend (and 'auto' where it picks tiled), attention_varlen and the nsa "
                 "variant use it; ATTNZOO_NATIVE=0 turns it off.")


def _add_native_parser(sub: Any) -> None:
    p = _command(sub, "native", cmd_native, help="build or inspect the optional compiled attention forward",
                 description=_NATIVE_ABOUT)
    p.add_argument("--build", action="store_true", help="compile it now (into $ATTNZOO_NATIVE_DIR, default "
                                                        "~/.cache/attnzoo/native)")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output while building")


# =========================================================================== parsers
def _command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], *, help: str,
             description: str, table: str | None = None) -> argparse.ArgumentParser:
    """The parser of one command, whose parsed arguments run ``func``.

    ``table``: for a command that prints a table, ``"plain"`` adds ``--plain`` and ``"progress"``
    also ``--no-progress`` (a command that shows a bar), in their own "output" section of ``--help``.
    """
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=func)
    if table is not None:
        out = p.add_argument_group("output")
        if table == "progress":
            out.add_argument("--no-progress", action="store_true", help="no progress bar")
        out.add_argument("--plain", action="store_true", help="plain-text table")
    return p


#: the layer-shape options of list, bench and cost: flags and what each one sets (DESIGN.md letters)
_LAYER_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "batch": (("--batch",), "batch B"), "seq_len": (("--seq-len", "-n"), "sequence length N"),
    "dim": (("--dim",), "model width C"), "heads": (("--heads",), "query heads H"),
    "kv_heads": (("--kv-heads",), "KV heads Hkv of every variant that has KV groups (mha, gqa, sliding, ...)"), "head_dim": (("--head-dim",), "head width D"),
}


def _add_layer_options(p: argparse.ArgumentParser, **defaults: int | tuple[int | None, str]) -> None:
    """Add the named :data:`_LAYER_OPTIONS` (positive ints) with this command's defaults: a number,
    or ``(value, what the default means)`` where the value alone says too little (``None``)."""
    for key, default in defaults.items():
        flags, what = _LAYER_OPTIONS[key]
        value, shown = default if isinstance(default, tuple) else (default, str(default))
        p.add_argument(*flags, type=_positive_int, default=value, help=f"{what} (default: {shown})")


def _add_list_parser(sub: Any) -> None:
    p = _command(sub, "list", cmd_list,
                 help="table of every registered variant: family, costs, decoding, masks",
                 description="Every registered attention variant with its family, exactness, complexity, "
                             "KV-cache bytes per token for a config, decoding cache and masks.")
    _add_layer_options(p, dim=512, heads=8, kv_heads=(None, "each variant's own: H, or H/4 for gqa and nsa"), seq_len=(4096, "4096, the 'cache at N' column"))
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="cache dtype (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plain", action="store_true", help="plain-text table even when rich is installed")
    p.add_argument("--wide", action="store_true", help="add the attention-memory, decoding-cache and masks columns")


def _add_check_parser(sub: Any) -> None:
    p = _command(sub, "check", cmd_check,
                 help="every backend and variant against the independent float64 oracle; exit 1 on failure",
                 description="Run every available backend over a grid of cases (GQA, Nq != Nk, windows, masks, "
                             "padding, empty rows, softcap, ALiBi; float32/bfloat16/float16; outputs, LSE and "
                             "gradients) against the independent float64 oracle (attnzoo.oracle), then check every variant module "
                             "(decode == full forward, backends == reference, approximations within their "
                             "stated error) and a small DecoderLM per variant. Exit code 1 on any failure.", table="progress")
    p.add_argument("--backends", type=_name_list(BACKEND_NAMES), default=None,
                   help="comma-separated backends (default: all available)")
    p.add_argument("--dtypes", type=_name_list(DTYPE_NAMES), default=list(DTYPE_NAMES),
                   help="comma-separated dtypes (default: float32,bfloat16,float16)")
    p.add_argument("--variants", type=_variant_list, default=None,
                   help="comma-separated variants to check (default: all)")
    p.add_argument("--no-variants", action="store_true", help="backends only")
    p.add_argument("--no-models", action="store_true", help="skip the DecoderLM decode == full checks")
    p.add_argument("--quick", action="store_true", help="the quick third of the case grid")
    p.add_argument("--no-grad", action="store_true", help="outputs only, no gradients")
    p.add_argument("--strict", action="store_true", help="a variant whose module is missing is a failure")
    p.add_argument("--device", type=_device_arg, default="cpu", help="torch device (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed of the inputs (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON (checked writable before the run)")
    p.add_argument("--show-failures", type=_nonnegative_int, default=20,
                   help="failure lines to print, >= 0 (default: 20)")


def _add_bench_parser(sub: Any) -> None:
    p = _command(sub, "bench", cmd_bench,
                 help="time and peak memory against sequence length; CSV, JSON and a log-log PNG",
                 description="Time and peak memory of backends and variants against sequence length, forward "
                             "or forward+backward. Writes NAME.csv, NAME.json and NAME.png into --out and "
                             "reports achieved GFLOP/s against a measured torch.mm peak. Sizes whose estimated "
                             "memory exceeds the available memory are refused. The defaults finish in about "
                             "a minute on 2 cores.", table="progress")
    p.add_argument("--backends", type=_name_list(("torch", "auto", *BACKEND_NAMES)), default=None,
                   help="comma-separated: torch (bare SDPA), auto, reference, sdpa, tiled, flex, flash "
                        "(default: torch,sdpa,tiled unless --variants is given)")
    p.add_argument("--variants", type=_stack_list, default=None,
                   help="comma-separated registry variants, run as modules on [B, N, C]; an entry 'a/b/c' runs "
                        "that stack of layers (residual chain)")
    p.add_argument("--seq-lens", type=_int_list, default=[256, 512, 1024, 2048],
                   help="comma-separated sequence lengths (default: 256,512,1024,2048)")
    p.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd", help="(default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="(default: %(default)s)")
    p.add_argument("--device", type=_device_arg, default="cpu", help="cpu or cuda (default: cpu)")
    _add_layer_options(p, batch=1, heads=8, head_dim=64)
    p.add_argument("--window", type=_positive_int, default=None, help="causal sliding window (left size)")
    p.add_argument("--no-causal", action="store_true", help="non-causal attention for backend targets")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed calls per case (median; default 5)")
    p.add_argument("--warmup", type=_nonnegative_int, default=1, help="untimed calls per case, >= 0 (default: 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--max-case-seconds", type=_positive_float, default=5.0,
                   help="skip longer sequences of a target once a call takes longer (positive; default: 5)")
    p.add_argument("--peak-size", type=_positive_int, default=2048,
                   help="largest n x n torch.mm of the peak measurement (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="time torch.compile of each call (and its backward in fwd+bwd): reports the compile "
                        "time (first compiled call), the compiled median and the compiled/eager ratio, eager "
                        "and compiled calls interleaved; peak memory stays that of the eager call")
    p.add_argument("--out", default="bench-results", help="output directory (default: %(default)s)")
    p.add_argument("--name", type=_file_name, default="bench",
                   help="file stem of the outputs, no '/' (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")


def _add_cost_parser(sub: Any) -> None:
    p = _command(sub, "cost", cmd_cost,
                 help="analytic FLOPs, bytes moved, activation memory and KV cache of one layer",
                 description="Analytic cost of one attention layer of a registered variant (attnzoo.cost."
                             "estimate): FLOPs, bytes moved, activation memory, KV-cache size.", table="plain")
    p.add_argument("variant", help="a registered variant (attnzoo list), or a per-layer stack 'a/b/c' "
                                    "(e.g. gated_deltanet/gated_deltanet/gated_deltanet/mha)")
    _add_layer_options(p, seq_len=4096, dim=512, heads=8, batch=1, kv_heads=(None, "the variant's own: H, or H/4 for gqa and nsa"), head_dim=(None, "C / H"))
    p.add_argument("--window", type=_window, default=None, help="W or LEFT,RIGHT (sliding, local_global)")
    p.add_argument("--features", type=_positive_int, default=None, help="F of linear / performer")
    p.add_argument("--segment-len", type=_positive_int, default=None, help="S of infini")
    p.add_argument("--chunk-size", type=_positive_int, default=None, help="chunk of the chunked causal feature-map form")
    p.add_argument("--no-causal", action="store_true", help="bidirectional attention")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="(default: %(default)s)")
    p.add_argument("--backend", choices=("auto", "ideal", *BACKEND_NAMES), default="auto",
                   help="whose computed score pairs to count (default: auto)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _add_viz_parser(sub: Any) -> None:
    p = _command(sub, "viz", cmd_viz,
                 help="mask pictures (text and PNG), positional encodings, attention maps of a model",
                 description="Draw a mask expression in the terminal (and as PNG), positional-encoding "
                             "pictures, or the attention maps of a saved model on a text. A mask too large "
                             "for the available memory is refused.")
    p.add_argument("--mask", help='mask expression, e.g. "causal & window(4,0)" (names: causal, window(l,r), '
                                  "prefix_lm(n), global(p,...), padding(n,...), document(len,...); & | ~)")
    p.add_argument("--n", type=_positive_int, default=None,
                   help="queries of --mask (default: 16) or positions of --positional (default: 128)")
    p.add_argument("--nk", type=_positive_int, default=None, help="keys (default: --n)")
    p.add_argument("--q-offset", type=int, default=None, help="position of the first query (default: Nk - Nq)")
    p.add_argument("--positional", choices=("sinusoidal", "rope", "alibi", "all"), default=None,
                   help="draw positional encodings (PNG)")
    p.add_argument("--dim", type=_positive_int, default=128, help="width / head dim for --positional (default: 128)")
    p.add_argument("--heads", type=_positive_int, default=8, help="ALiBi heads for --positional (default: 8)")
    p.add_argument("--model", help="a saved model: an arena checkpoint (.pt) or a Hugging Face model folder")
    p.add_argument("--text", help="text to run through --model")
    p.add_argument("--layer", type=int, default=None, help="attention layer to draw (default: the last)")
    p.add_argument("--png", help="write the picture(s) to this PNG path")


def _add_arena_parser(sub: Any, full: bool) -> None:
    p = _command(sub, "arena", cmd_arena,
                 help="train one small model per variant and compare (see docs/arena.md)",
                 description="Train one small decoder per attention variant on real data and compare them.")
    if full:
        add_arena_arguments(p)


def build_parser(with_arena: bool = True) -> argparse.ArgumentParser:
    """The ``attnzoo`` argument parser (``with_arena=False`` leaves out the arena's options)."""
    parser = _Parser(prog="attnzoo", description="attention mechanisms: list, check, bench, cost, "
                                     "viz, native, arena. Each command has --help.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_list_parser(sub)
    _add_check_parser(sub)
    _add_bench_parser(sub)
    _add_cost_parser(sub)
    _add_viz_parser(sub)
    _add_native_parser(sub)
    _add_arena_parser(sub, with_arena)
    return parser


def _version() -> str:
    try:
        return f"attnzoo {version('attnzoo')}"
    except PackageNotFoundError:  # pragma: no cover - not installed
        return "attnzoo (not installed)"


def _silence_stdout() -> None:
    """After a broken pipe (``attnzoo cost mha | head -1``): send what is left of stdout nowhere, so
    that the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnzoo`` command; returns the exit code (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad argument (2)
        return int(exc.code or 0)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except CLIError as exc:
        print(f"attnzoo {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (| head): stop quietly, with the shell's SIGPIPE status
        _silence_stdout()
        return 128 + 13
    except KeyboardInterrupt:  # pragma: no cover
        print("interrupted", file=sys.stderr)
        return interrupted_exit_code()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
