"""SECURITY.md claims only what a test shows: every test it names must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.update(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
    return names


def test_every_test_security_md_names_exists() -> None:
    cited = set(re.findall(r"\b(test_\w+)\b", (ROOT / "SECURITY.md").read_text()))
    # A name ending in a test file's name (tests/x/test_y.py::test_z) cites the file too.
    files = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(cited - _defined_tests() - files)
    assert missing == [], f"SECURITY.md cites tests that do not exist: {missing}"
