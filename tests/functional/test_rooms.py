"""The rooms of ``attnzoo.functional`` kept every old path (move_functional_rooms: keep old paths).

Code written before the split imports ``attnzoo.functional.<module>`` (and
``attnzoo.functional.tiled.<part>``): each still imports, as the very module in its room, so a
monkeypatch through either path reaches the same globals. The paths are built from parts on
purpose: ``tools/move_functional_rooms.py`` rewrites full dotted paths, and this file (marked
above) is the one that must keep them.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import attnzoo
import attnzoo.functional as F

PKG = "attnzoo.functional"
OLD = {  # old name -> its room, written out independently of attnzoo.functional.OLD_PATHS
    "_edge": "core", "_request": "core", "rules": "core", "score_mod": "core",
    "reference": "backends", "reference_ops": "backends", "sdpa": "backends", "flash": "backends",
    "flex": "backends", "tiled": "backends", "tiled_ops": "backends", "decode": "backends",
    "halfmath": "backends",
    "attention": "softmax", "sinks": "softmax", "sigmoid": "softmax", "varlen": "softmax",
    "varlen_split": "softmax", "nsa": "softmax",
    "linear": "feature_maps", "performer": "feature_maps", "infini": "feature_maps",
    "_chunked_scan": "recurrent", "retention": "recurrent", "gla": "recurrent",
    "delta_rule": "recurrent", "delta_product": "recurrent",
    "tiled.plan": "backends", "tiled.scores": "backends", "tiled.forward": "backends",
    "tiled.backward": "backends",
}


@pytest.mark.parametrize("old", sorted(OLD))
def test_every_old_path_is_the_module_in_its_room(old: str) -> None:
    moved = importlib.import_module(f"{PKG}.{OLD[old]}.{old}")
    assert importlib.import_module(f"{PKG}.{old}") is moved
    assert sys.modules[f"{PKG}.{old}"] is moved
    assert F.OLD_PATHS[old] is moved
    assert set(F.OLD_PATHS) == set(OLD)


def test_old_import_statements_still_run() -> None:
    code = "\n".join([
        f"import {PKG}.gla as gla",
        f"from {PKG}.tiled import use_tiles, TileConfig",
        f"from {PKG}.tiled.plan import tile_plan",
        f"from {PKG} import halfmath, decode",
        f"from {PKG}.attention import attention, BACKENDS",
        f"import {PKG}.recurrent.gla as new_gla",
        "import attnzoo",
        "assert gla is new_gla and attnzoo.functional.gla is new_gla",
        f"assert halfmath.__name__ == '{PKG}.backends.halfmath' and callable(attention)",
    ])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_attention_keeps_meaning_the_function() -> None:
    # As before the rooms: importing the function shadowed the submodule of the same name.
    assert F.attention is F.softmax.attention.attention
    assert attnzoo.attention is F.attention


def test_monkeypatch_through_an_old_path_reaches_the_room(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnzoo.functional.recurrent import gla

    monkeypatch.setattr(f"{PKG}.gla.MATMUL_DIAGONAL_SPAN", {"marker": 1})
    assert gla.MATMUL_DIAGONAL_SPAN == {"marker": 1}


def test_public_names_and_custom_operators_stay() -> None:
    for name in F.__all__:
        assert hasattr(F, name), name
    for name in ("attention", "merge_attention", "attention_varlen", "sigmoid_attention",
                 "available_backends", "linear_attention", "performer_attention", "retention",
                 "gated_linear_attention", "delta_rule"):
        assert callable(getattr(attnzoo, name)), name
    for op in ("gla_vector_scores", "gla_vector_scores_bwd", "tiled_attention_fwd", "tiled_attention_bwd",
               "matrix_scan", "nsa_sparse", "varlen_fwd", "sigmoid_attention_fwd", "band_mask"):
        assert hasattr(torch.ops.attnzoo, op), op


def test_rooms_import_only_the_rooms_below_them() -> None:
    """The "imports" column of docs/architecture.md's rooms table: the rooms form no cycle."""
    import ast
    from pathlib import Path

    allowed = {"core": set(), "backends": {"core"}, "softmax": {"core", "backends"},
               "feature_maps": {"core", "softmax", "recurrent"}, "recurrent": set()}
    root = Path(F.__file__).parent
    for room, below in allowed.items():
        for path in (root / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                for name in names:
                    parts = name.split(".")
                    if parts[:2] == ["attnzoo", "functional"]:
                        assert len(parts) > 2 and parts[2] in allowed, f"{path}: {name} (not in a room)"
                        assert parts[2] == room or parts[2] in below, f"{path}: {name}"
