"""docs/ARCHITECTURE.md must describe the code as it is: every module and every event is listed."""

from __future__ import annotations

import re
from pathlib import Path

from hpcelastic.events import EventName

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def _table_rows(heading: str) -> list[str]:
    section = DOC.split(heading, 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]


def test_every_event_is_documented_and_every_documented_event_exists() -> None:
    documented: set[str] = set()
    for row in _table_rows("## Events"):
        documented |= set(re.findall(r"`([a-z_]+)`", row.split("|")[1]))
    assert documented == {e.value for e in EventName}


def test_every_module_is_in_the_module_table() -> None:
    table = "\n".join(_table_rows("## Modules"))
    missing = []
    for path in sorted((ROOT / "hpcelastic").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        package = rel.rsplit("/", 1)[0] + "/"
        if f"`{rel}`" in table or f"`{package}`" in table:
            continue
        short = rel.removeprefix("hpcelastic/")
        if path.name == "__init__.py" and rel.count("/") > 1:
            continue  # a sub-package's __init__ is covered by its modules' rows
        if f"`{short}`" not in table and f"`{path.name}`" not in table:
            missing.append(rel)
    assert not missing, f"modules missing from docs/ARCHITECTURE.md: {missing}"
