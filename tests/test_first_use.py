"""What a new user meets first: units on durations, a question before a pop empties a
session, an honest "never rotated", one numbering of items, help that says what it means.

Each test runs the real `memvault` CLI in a subprocess against the real keyring.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, add_items, assistant, insert_sealed, rows, run_cli, user


def one_line(r: Any, code: int, needle: str) -> None:
    assert r.code == code, r
    assert r.err.startswith("memvault: error: ") and r.err.count("\n") == 1, r
    assert "Traceback" not in r.err and needle in r.err, r


# -- durations ------------------------------------------------------------------


@pytest.mark.parametrize("bare", ["1", "3600", " 30 "])
def test_a_number_without_a_unit_is_not_a_ttl(vault: Any, bare: str) -> None:
    r = run_cli("ttl", bare)
    one_line(r, 2, "has no unit")
    n = bare.strip()
    assert f"{n}s" in r.err and f"{n}d" in r.err and "never" in r.err, r
    assert run_cli("--json", "ttl").json()["ttl"] == "1h"  # unchanged


def test_init_refuses_a_ttl_without_a_unit_and_creates_nothing(vault_db: Path) -> None:
    one_line(run_cli("init", "--ttl", "60"), 2, "has no unit")
    assert not vault_db.exists() and not vault_db.parent.exists()
    assert run_cli("init", "--ttl", "60s").code == 0
    assert run_cli("--json", "ttl").json()["ttl_seconds"] == 60


# -- status -----------------------------------------------------------------------

STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def test_status_says_never_until_the_first_rotation(vault_db: Path) -> None:
    assert run_cli("init").code == 0
    assert run_cli("--json", "status").json()["rotated_at"] is None
    assert "rotated    never" in run_cli("status").out.splitlines()
    # Often within init's second: the audit trail, not the time, tells the two apart.
    assert run_cli("rotate").code == 0
    rotated = run_cli("--json", "status").json()["rotated_at"]
    assert rotated is not None and STAMP.match(rotated), rotated
    assert f"rotated    {rotated}" in run_cli("status").out.splitlines()
