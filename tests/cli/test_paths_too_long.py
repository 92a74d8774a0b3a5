"""A path longer than the OS allows is one line and exit 2, on every command.

Whether it names the vault (--db), a file to write or a file to read, the path is
refused before anything is written, and the message cuts it short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import add_items, raw_bytes, run_cli, user

PASS = "correct horse battery staple"


@pytest.fixture
def filled(vault: Any, vault_db: Path) -> Path:
    add_items(vault_db, "S", [user("remember NORD-17")])
    return vault_db


def one_line(r: Any, code: int) -> None:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memvault: error: "), r.err
    assert "Traceback" not in r.err and "unexpected error" not in r.err, r.err


def still_readable(db: Path) -> None:
    r = run_cli("--db", str(db), "show", "S")
    assert r.code == 0 and "NORD-17" in r.out, r


LONG = "a" * 5000


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--db", LONG, "status"],
        ["--db", LONG, "init"],
        ["--db", LONG, "show", "S"],
        ["export", "S", "-o", LONG],
        ["key", "export", "--passphrase-stdin", LONG],
        ["key", "export", "--force", "--passphrase-stdin", LONG],
        ["key", "import", "--passphrase-stdin", LONG],
        ["key", "export", "--passphrase-file", LONG, "kit.json"],
        ["backup", LONG],
        ["import", LONG],
        ["shred", "--yes", "--receipt", LONG],
        ["export", "S", "-o", f"{'d' * 300}/x.jsonl"],  # one folder name past NAME_MAX
    ],
)
def test_a_path_too_long_for_the_os_is_one_line_and_exit_2(filled: Path, args: list[str]) -> None:
    before = raw_bytes(filled)
    r = run_cli(*args, input=PASS + "\n")
    one_line(r, 2)
    assert "characters)" in r.err and len(r.err) < 400, r.err  # the path is cut short
    assert raw_bytes(filled) == before
    still_readable(filled)
