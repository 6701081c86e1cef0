"""The front page never lies: every python block of the README and of the core docs runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/backends.md", "docs/models.md"]


def blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page: str) -> None:
    found = blocks(page)
    assert found, f"{page} has no python example"
    for i, code in enumerate(found):
        exec(compile(code, f"{page}[block {i}]", "exec"), {"__name__": "__doc_example__"})


def test_readme_has_exactly_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    assert len(commands) == 2, commands
    assert "attnzoo arena" in commands[0]
    assert "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1].strip() in ci, "CI must run the README's test command"
