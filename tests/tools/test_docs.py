"""The front page never lies: every python block of the README and of the core docs runs as written."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/backends.md", "docs/models.md", "docs/adding-a-family.md", "docs/encoders.md",
         "docs/seq2seq.md"]


def blocks(page: str) -> list[str]:
    """The python blocks of ``page`` (a path from the repository root)."""
    text = (ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_blocks(page: str, *, minimum: int = 1, before_each: Callable[[], None] | None = None) -> str:
    """Run every python block of ``page`` as written, each in a fresh namespace (after
    ``before_each()``), failing unless there are at least ``minimum``; return the page's text."""
    found = blocks(page)
    assert len(found) >= minimum, f"{page}: {len(found)} python blocks, expected at least {minimum}"
    for i, code in enumerate(found):
        if before_each is not None:
            before_each()
        exec(compile(code, f"{page}[block {i}]", "exec"), {"__name__": "__doc_example__"})
    return (ROOT / page).read_text()


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page: str) -> None:
    run_blocks(page)


def test_readme_has_exactly_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    assert len(commands) == 2, commands
    assert "attnzoo arena" in commands[0]
    assert "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1].strip() in ci, "CI must run the README's test command"
