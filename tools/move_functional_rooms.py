#!/usr/bin/env python3
"""Split ``src/attnzoo/functional/`` into rooms by kind (issue 32, item 5), re-runnably.

    python tools/move_functional_rooms.py                 # git mv the modules, then rewrite paths
    python tools/move_functional_rooms.py --rewrite-only  # rewrite paths only (e.g. after a merge)
    python tools/move_functional_rooms.py --check         # list what would change; exit 1 if anything
    python tools/move_functional_rooms.py --skip src/attnzoo/models  # leave a folder as it is

Run from the repository root (or anywhere: it finds the root from its own path). Both steps are
idempotent: a second run changes nothing.

The move step creates each room's ``__init__.py`` (a docstring, no imports: a room package that
imported its children would give the layer checker import cycles) and ``git mv``s every module
still at its old place.

The rewrite step visits every ``.py`` and ``.md`` file under src/, tests/, docs/, benchmarks/,
examples/ and README.md and rewrites

* dotted module paths, ``attnzoo.functional.<old>`` -> ``attnzoo.functional.<room>.<old>``, in
  import lines, strings (``monkeypatch.setattr("attnzoo.functional.gla.X", ...)``, the lazy export
  table of ``attnzoo/__init__.py``) and prose alike;
* ``from attnzoo.functional import <old module>[, ...]`` -> ``from attnzoo.functional.<room> import
  ...`` (names that ``attnzoo.functional`` itself exports, such as ``attention``, stay);
* file paths in prose, ``[src/][attnzoo/]functional/<old>`` -> ``.../functional/<room>/<old>``;

then sorts the imports of the Python files it changed with ``ruff check --select I --fix`` when
ruff is installed (``--no-ruff`` skips that). A file that holds the marker
``move_functional_rooms: keep old paths`` is left alone (the test of the old paths).

The old paths keep working for code outside the repository: ``attnzoo/functional/__init__.py``
registers them as aliases of the moved modules. No room is named like a module it could shadow
(hence ``feature_maps/``, not ``linear/``: ``attnzoo.functional.linear`` stays the old module).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = Path("src/attnzoo/functional")

#: room -> the modules (and the ``tiled`` package) it holds, and its docstring.
ROOMS: dict[str, tuple[tuple[str, ...], str]] = {
    "core": (("_request", "rules", "score_mod", "_edge"),
             "What every room shares: the validated request (``AttnRequest``, ``check_qkv``), the "
             "visibility / ALiBi / dtype rules, the ``score_mod`` contract and the empty and "
             "non-finite edge cases. Imports no other room."),
    "backends": (("reference", "reference_ops", "sdpa", "flash", "flex", "tiled", "tiled_ops",
                  "decode", "halfmath"),
                 "The softmax backends ``az.attention`` dispatches to, each with its "
                 "``CAPABILITIES``, and the compiled operators beside their eager kernels "
                 "(``tiled_ops`` beside ``tiled/``, ``reference_ops`` beside ``reference``); "
                 "``decode`` (split-KV one-token decode) and ``halfmath`` (half-precision matmul "
                 "policy). Imports ``core`` only."),
    "softmax": (("attention", "sinks", "sigmoid", "varlen", "varlen_split", "nsa"),
                "Score-matrix attention built on the backends: the dispatcher ``attention`` "
                "(``az.attention``), sinks, sigmoid attention, packed variable-length sequences and "
                "native sparse attention. Imports ``core`` and ``backends``."),
    "feature_maps": (("linear", "performer", "infini"),
                     "Feature-map (kernelised) attention: linear attention, Performer's random "
                     "features, Infini-attention's compressive memory (its local part calls "
                     "``softmax.attention``; ``linear`` runs on ``recurrent``'s token loop)."),
    "recurrent": (("_chunked_scan", "retention", "gla", "delta_rule", "delta_product"),
                  "Recurrent kernels with a chunked parallel form: the shared scan engine "
                  "(``_chunked_scan``, its operators ``attnzoo::matrix_scan``...), retention, GLA "
                  "(with its ``attnzoo::gla_vector_scores`` operator), the delta rule and "
                  "DeltaProduct. Imports no other room."),
}
MOVES: dict[str, str] = {old: room for room, (olds, _) in ROOMS.items() for old in olds}
#: Names ``attnzoo.functional`` exports that are also module names: ``from attnzoo.functional
#: import attention`` is the function and stays as written.
EXPORTED = {"attention"}
KEEP_MARKER = "move_functional_rooms: keep old paths"
TREES = ("src", "tests", "docs", "benchmarks", "examples")
FILES = ("README.md",)

_NAMES = "|".join(sorted(MOVES, key=len, reverse=True))
_DOTTED = re.compile(rf"(?<![\w.])attnzoo\.functional\.({_NAMES})(?![\w(])")
_SLASHED = re.compile(rf"(?<![\w/])((?:src/)?(?:attnzoo/)?functional/)({_NAMES})(?!\w)")
_FROM = re.compile(r"^([ \t]*)from attnzoo\.functional import (\([^)]*\)|[^\n]*?)([ \t]*#[^\n]*)?$", re.M)


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def move() -> list[str]:
    """Create the rooms and ``git mv`` every module still at its old place."""
    done = []
    for room, (olds, doc) in ROOMS.items():
        init = ROOT / PKG / room / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text('"""' + textwrap.fill(doc, 96, break_on_hyphens=False) + '"""\n')
            git("add", str(init.relative_to(ROOT)))
            done.append(f"created {init.relative_to(ROOT)}")
        for old in olds:
            for src in (ROOT / PKG / f"{old}.py", ROOT / PKG / old):
                if src.exists() and not src.is_file() and not (src / "__init__.py").exists():
                    continue  # a stray folder (e.g. only __pycache__ left), not a package
                if src.exists():
                    dst = ROOT / PKG / room / src.name
                    if dst.exists():
                        raise SystemExit(f"both {src.relative_to(ROOT)} and {dst.relative_to(ROOT)} exist")
                    git("mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT)))
                    done.append(f"moved {src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
    return done


def _split_from(m: re.Match[str]) -> str:
    indent, body, comment = m.group(1), m.group(2), m.group(3) or ""
    body = re.sub(r"#[^\n]*", "", body).strip().strip("()")
    names = [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]
    groups: dict[str, list[str]] = {}
    for name in names:
        base = name.split(" as ")[0].strip()
        room = "" if base in EXPORTED or base not in MOVES else f".{MOVES[base]}"
        groups.setdefault(room, []).append(name)
    if list(groups) == [""]:
        return m.group(0)
    lines = [f"{indent}from attnzoo.functional{room} import {', '.join(group)}"
             for room, group in sorted(groups.items())]
    lines[0] += comment
    return "\n".join(lines)


def rewrite_text(text: str, python: bool) -> str:
    if python:
        text = _FROM.sub(_split_from, text)
    text = _DOTTED.sub(lambda m: f"attnzoo.functional.{MOVES[m.group(1)]}.{m.group(1)}", text)
    return _SLASHED.sub(lambda m: f"{m.group(1)}{MOVES[m.group(2)]}/{m.group(2)}", text)


def candidates(skip: tuple[str, ...] = ()) -> list[Path]:
    out = [ROOT / f for f in FILES if (ROOT / f).is_file()]
    for tree in TREES:
        out += sorted(p for p in (ROOT / tree).rglob("*") if p.suffix in (".py", ".md") and p.is_file()
                      and "__pycache__" not in p.parts)
    skipped = tuple(str(ROOT / s.rstrip("/")) for s in skip)
    return [p for p in out if not any(str(p) == s or str(p).startswith(s + "/") for s in skipped)]


def rewrite(write: bool, ruff: bool, skip: tuple[str, ...] = ()) -> list[str]:
    changed = []
    for path in candidates(skip):
        text = path.read_text()
        if KEEP_MARKER in text:
            continue
        new = rewrite_text(text, path.suffix == ".py")
        if new != text:
            changed.append(str(path.relative_to(ROOT)))
            if write:
                path.write_text(new)
    py = [p for p in changed if p.endswith(".py")]
    if write and ruff and py and shutil.which("ruff"):
        subprocess.run(["ruff", "check", "--select", "I", "--fix", "--quiet", *py], cwd=ROOT, check=False)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rewrite-only", action="store_true", help="skip the git mv step")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a run would")
    ap.add_argument("--no-ruff", action="store_true", help="do not sort the changed files' imports")
    ap.add_argument("--skip", action="append", default=[], metavar="PATH",
                    help="leave files under PATH as they are (repeatable; the old paths still import)")
    a = ap.parse_args(argv)
    if a.check:
        pending = [f"move {old}" for old in MOVES
                   if (ROOT / PKG / f"{old}.py").exists() or (ROOT / PKG / old / "__init__.py").exists()]
        pending += rewrite(write=False, ruff=False, skip=tuple(a.skip))
        print("\n".join(pending) or "nothing to do")
        return 1 if pending else 0
    done = [] if a.rewrite_only else move()
    done += [f"rewrote {p}" for p in rewrite(write=True, ruff=not a.no_ruff, skip=tuple(a.skip))]
    print("\n".join(done) or "nothing to do")
    return 0


if __name__ == "__main__":
    sys.exit(main())
