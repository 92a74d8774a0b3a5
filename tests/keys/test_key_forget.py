"""`key forget KID` of a retained version, on a keyring vault and (on a real OpenBao
server) a transit vault: what it says becomes of the backups that used KID is true."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from tests import baoserver
from tests.keys.test_restore_after_key_move import a_vault
from tests.keys.test_transit_vault_lifecycle import a_host, ok, shown
from tests.keys.test_transit_vaults import cli_at

pytestmark = baoserver.MARKS


@pytest.mark.parametrize("source", ["keyring", "transit"])
def test_key_forget_says_which_backups_become_unreadable(
    source: str, key: str, tmp_path: Path, vault_db: Path
) -> None:
    """A keyring vault's backup dies with the forgotten version; a transit vault's keeps
    its own wrapped copy and opens in a new process after the forget, and it says so."""
    db = str(vault_db)
    op = a_vault(db, "keyring" if source == "keyring" else f"transit:{key}", tmp_path)
    backup = str(tmp_path / "backup.db")
    ok(cli_at(db, op, "backup", backup))
    old = ok(cli_at(db, op, "--json", "rotate"))["old_kid"]
    said = cli_at(db, op, "key", "forget", old, "--yes")
    assert said.returncode == 0, said.stderr
    forgot = ok(cli_at(db, op, "--json", "key", "list"))["keys"]
    assert {v["kid"]: v["state"] for v in forgot}[old] == "destroyed"
    read = cli_at(backup, op, "--json", "show", "s1")
    with closing(sqlite3.connect(db)) as conn:
        [(details,)] = conn.execute(
            "SELECT details FROM memvault_audit WHERE event = 'key-forget'"
        ).fetchall()
    # The audit trail says what the command said: unreadable, or only no longer recorded.
    fate = "unreadable" if source == "keyring" else "no_longer_recorded"
    assert json.loads(details) == {
        "unreadable": [],
        "no_longer_recorded": [],
        fate: [backup],
    }
    if source == "keyring":
        assert "makes these backups unreadable here" in said.stderr
        assert f"now unreadable here: {backup}" in said.stdout
        assert read.returncode == 4, read.stderr
    else:
        assert "unreadable" not in said.stdout + said.stderr
        assert "stays readable until the transit key is deleted" in said.stderr
        assert f"readable until the transit key is deleted: {backup}" in said.stdout
        assert shown(backup, a_host(key, tmp_path)) == ["before"]
