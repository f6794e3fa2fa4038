"""Shared by the bench scripts: replace one named section of bench/RESULTS.md.

Each benchmark owns the text between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->``; re-running one benchmark rewrites only its section.
"""

from __future__ import annotations

import platform
import re
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = (
    "# Benchmark results\n\nWritten by the scripts in bench/; each section names the script that owns it.\n"
)


def machine_line() -> str:
    """One line describing where the numbers were taken."""
    import os

    return (
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}."
    )


def update_section(name: str, markdown: str) -> None:
    """Write ``markdown`` as the section ``name`` of bench/RESULTS.md, keeping the others."""
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    block = f"<!-- bench:{name} -->\n{markdown.rstrip()}\n<!-- /bench:{name} -->"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.DOTALL)
    text = (
        pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    )
    RESULTS.write_text(text)
