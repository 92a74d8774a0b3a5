"""A vault made by memvault 0.1.0 (its file and its keyring entries) still reads.

The fixtures in tests/fixtures/v0_1_0 were written once by the 0.1.0 code (see its
README.md): a settled vault, and one whose rotation was killed after its commit.
Each test puts that vault's keyring entries into the private keyring, copies the
file, and reads every item back through the CLI.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from vault.keys import KeyStore

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v0_1_0"


@pytest.fixture
def old_vault(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    """(copy of the fixture's history.db, its expected items), keyring entries loaded."""
    folder = FIXTURES / request.param
    entries: dict[str, str] = json.loads((folder / "keyring.json").read_text())
    expected = json.loads((folder / "expected.json").read_text(encoding="utf-8"))
    assert not (folder / "history.db-wal").exists()  # the fixture itself stays untouched
    copy_dir = tmp_path / "old"
    copy_dir.mkdir(mode=0o700)
    copy = copy_dir / "history.db"
    shutil.copyfile(folder / "history.db", copy)
    copy.chmod(0o600)  # as 0.1.0 left it; a checkout makes it 0644
    ks = KeyStore()
    for username, secret in entries.items():
        ks.set(username, secret)
    try:
        yield copy, expected
    finally:
        for username in entries:
            ks.delete(username)
            ks.delete_pending(username)


LAYOUTS = ["", "mid_rotation"]


@pytest.mark.parametrize("old_vault", LAYOUTS, indirect=True, ids=["settled", "mid_rotation"])
def test_a_0_1_0_vault_reads_every_item(old_vault: tuple[Path, Any]) -> None:
    db, expected = old_vault
    total = sum(len(items) for items in expected.values())
    assert total > 0

    r = run_cli("--db", str(db), "--json", "status")
    assert r.code == 0, r
    st = r.json()
    assert st["key"] == "present and matching", st
    assert (st["sessions"], st["items"], st["readable"]) == (len(expected), total, total), st
    assert (st["expired"], st["unreadable"]) == (0, 0), st

    for session_id, items in expected.items():
        r = run_cli("--db", str(db), "--json", "show", session_id)
        assert r.code == 0, r
        shown = r.json()
        assert shown["items"] == items, (session_id, shown)
        assert (shown["expired"], shown["unreadable"]) == (0, 0), shown

        r = run_cli("--db", str(db), "show", session_id)
        assert r.code == 0, r
        lines = r.out.splitlines()
        assert len(lines) == len(items), r
        for i, line in enumerate(lines, 1):
            assert line.startswith(f"[{i}] "), r
