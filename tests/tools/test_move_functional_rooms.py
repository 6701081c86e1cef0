"""tools/move_functional_rooms.py's rewrite rules (move_functional_rooms: keep old paths)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "move_functional_rooms.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("move_functional_rooms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = [
    ("from attnzoo.functional.gla import run_gla", "from attnzoo.functional.recurrent.gla import run_gla"),
    ("import attnzoo.functional.tiled.backward as tb", "import attnzoo.functional.backends.tiled.backward as tb"),
    ("from attnzoo.functional.tiled_ops import dense_mask",
     "from attnzoo.functional.backends.tiled_ops import dense_mask"),
    ('monkeypatch.setattr("attnzoo.functional.gla.SUB_CHUNK", 8)',
     'monkeypatch.setattr("attnzoo.functional.recurrent.gla.SUB_CHUNK", 8)'),
    ('    "linear_attention": "attnzoo.functional.linear",',
     '    "linear_attention": "attnzoo.functional.feature_maps.linear",'),
    ("from attnzoo.functional import halfmath", "from attnzoo.functional.backends import halfmath"),
    ("    from attnzoo.functional import choose_backend, gla as g, decode  # why",
     "    from attnzoo.functional import choose_backend  # why\n"
     "    from attnzoo.functional.backends import decode\n"
     "    from attnzoo.functional.recurrent import gla as g"),
    ("from attnzoo.functional import (\n    attention,\n    sinks,\n)",
     "from attnzoo.functional import attention\nfrom attnzoo.functional.softmax import sinks"),
    ("from attnzoo.functional import attention as fn", "from attnzoo.functional import attention as fn"),
    ("from attnzoo.functional import BACKENDS", "from attnzoo.functional import BACKENDS"),
    ("attnzoo.functional.attention(q, k, v)", "attnzoo.functional.attention(q, k, v)"),
    ("import attnzoo.functional.backends.sdpa", "import attnzoo.functional.backends.sdpa"),
]


@pytest.mark.parametrize(("before", "after"), CASES)
def test_python_lines(tool, before: str, after: str) -> None:
    assert tool.rewrite_text(before, python=True) == after
    assert tool.rewrite_text(after, python=True) == after  # idempotent


@pytest.mark.parametrize(("before", "after"), [
    ("Kernel: `attnzoo/functional/nsa.py`", "Kernel: `attnzoo/functional/softmax/nsa.py`"),
    ("`src/attnzoo/functional/tiled/plan.py`", "`src/attnzoo/functional/backends/tiled/plan.py`"),
    ("in `functional/_edge.py`", "in `functional/core/_edge.py`"),
    ("`tests/functional/test_linear.py`", "`tests/functional/test_linear.py`"),
    (":mod:`attnzoo.functional.halfmath`", ":mod:`attnzoo.functional.backends.halfmath`"),
    ("from attnzoo.functional import halfmath", "from attnzoo.functional import halfmath"),  # prose: as is
])
def test_markdown(tool, before: str, after: str) -> None:
    assert tool.rewrite_text(before, python=False) == after
    assert tool.rewrite_text(after, python=False) == after


def test_no_room_is_named_like_a_module(tool) -> None:
    # A room called like a module (e.g. linear/) would shadow that module's old path and make the
    # dotted rewrite apply twice.
    assert not set(tool.ROOMS) & set(tool.MOVES)
