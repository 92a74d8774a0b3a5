"""Copies of a vault, revocations cut short, and shreds resumed or aimed at odd paths."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import add_items, key_entries, keyring_entries, raw_bytes, run_cli, user
from vault import crypto
from vault.keyjournal import entry_name
from vault.keys import KeyStore

KILLED = -9


def keyring_kids(vault_id: str) -> set[str]:
    """The key ids of the vault's entries, checked against the names they are stored under."""
    kids = set()
    for name, key in key_entries(vault_id).items():
        assert name == entry_name(vault_id, crypto.key_id(key)), name
        kids.add(crypto.key_id(key))
    return kids


def file_kid(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return str(conn.execute("SELECT value FROM memvault_meta WHERE key='kid'").fetchone()[0])
    finally:
        conn.close()


@pytest.mark.slow
def test_a_rotation_after_a_deferred_clean_up_never_loses_the_files_key(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user(f"secret {i}") for i in range(5)])
    k1 = file_kid(vault_db)
    # Rotation A commits, then dies before deleting the key it retired.
    assert run_cli("rotate", env={"MEMVAULT_FAILPOINT": "after-commit"}).code == KILLED
    k2 = file_kid(vault_db)
    assert keyring_kids(vault.vault_id) == {k1, k2}
    # A writer holds the lock, so rotation B's open cannot tidy; B then dies at once.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, time\n"
            f"c = sqlite3.connect({str(vault_db)!r}, isolation_level=None)\n"
            "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True)\n"
            "time.sleep(3); c.execute('COMMIT')\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout and holder.stdout.readline().strip() == "locked"
    r = run_cli("rotate", env={"MEMVAULT_FAILPOINT": "after-pending"})
    holder.wait()
    assert r.code == KILLED, r
    # Nothing lost: the file still uses K2 and K2 is the keyring's key.
    assert file_kid(vault_db) == k2
    shown = run_cli("--json", "show", "s")
    assert shown.code == 0, shown
    assert len(shown.json()["items"]) == 5
    # That open tidied: the retired key and B's dead pending one are gone.
    assert keyring_kids(vault.vault_id) == {k2}


def test_shredding_or_revoking_an_old_copy_keeps_the_live_vaults_key(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("live history")])
    backup = tmp_path / "backup.db"
    shutil.copy(vault_db, backup)
    assert run_cli("rotate").code == 0  # the live vault moves on to a new key
    live = key_entries(vault.vault_id)
    assert len(live) == 1

    # The copy knows only the old key, whose entry the rotation deleted.
    r = run_cli("--db", str(backup), "--json", "revoke", "--yes")
    assert r.code == 0, r
    assert r.json()["destroyed_kids"] == [], r
    r = run_cli("--db", str(backup), "--json", "shred", "--yes")
    assert r.code == 0, r
    assert r.json()["key_destroyed"] is False
    assert not backup.exists()
    assert key_entries(vault.vault_id) == live
    assert f"{vault.vault_id}/anchor" in keyring_entries(vault.vault_id)  # and its anchor
    assert run_cli("show", "s").code == 0


def test_a_revoke_that_cannot_reach_the_keyring_marks_nothing(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    before = raw_bytes(vault_db)
    r = run_cli("revoke", "--yes", env={"PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"})
    assert r.code == 4, r
    assert raw_bytes(vault_db) == before
    assert run_cli("--json", "status").json()["key"] == "present and matching"


def test_status_says_when_a_revocation_is_unfinished(vault: Any, vault_db: Path) -> None:
    assert (
        run_cli("revoke", "--yes", env={"MEMVAULT_FAILPOINT": "revoke-after-mark"}).code == KILLED
    )
    st = run_cli("--json", "status").json()
    assert st["key"].startswith("key revoked (incomplete")
    assert run_cli("revoke", "--yes").code == 0
    assert run_cli("--json", "status").json()["key"] == "key revoked"


def test_a_resumed_shred_destroys_a_key_version_put_back_after_the_first_run(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("x")])
    sealer = vault.sealer()
    vid, kid = vault.vault_id, sealer.kid
    assert run_cli("shred", "--yes", env={"MEMVAULT_FAILPOINT": "shred-after-rows"}).code == KILLED
    assert keyring_entries(vid) == {}
    # A recovery kit imported before the shred was finished: the key is back.
    KeyStore().set(entry_name(vid, kid), sealer.master_key)
    r = run_cli("--json", "shred", "--yes")
    assert r.code == 0, r
    assert keyring_entries(vid) == {}
    rep = r.json()
    assert (rep["resumed"], rep["key_destroyed"], rep["destroyed_kids"]) == (True, True, [kid])


@pytest.mark.parametrize("point", ["shred-after-key", "shred-after-rows", "shred-during-overwrite"])
def test_a_resumed_shred_reports_what_the_first_run_destroyed(
    vault: Any, vault_db: Path, tmp_path: Path, point: str
) -> None:
    add_items(vault_db, "s", [user("x"), user("y"), user("z")])
    assert run_cli("shred", "--yes", env={"MEMVAULT_FAILPOINT": point}).code == KILLED
    receipt = tmp_path / "receipt.json"
    # Once the first run recorded the key's destruction, the rest needs no keyring at all.
    env = (
        {}
        if point == "shred-after-key"
        else {"PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"}
    )
    r = run_cli("--json", "shred", "--yes", "--receipt", str(receipt), env=env)
    assert r.code == 0, r
    rep = r.json()
    assert (rep["items"], rep["sessions"], rep["key_destroyed"], rep["resumed"]) == (
        3,
        1,
        True,
        True,
    )
    assert not vault_db.exists()


def test_shred_of_a_folder_is_not_a_vault(tmp_path: Path) -> None:
    r = run_cli("--db", str(tmp_path), "shred", "--yes")
    assert r.code == 3 and "folder" in r.err, r


def test_a_symlinked_source_is_shredded_where_it_really_is(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    import asyncio

    from agents import SQLiteSession

    real = tmp_path / "real" / "carnet.db"
    real.parent.mkdir()

    async def go() -> None:
        s = SQLiteSession("carnet-local", real)
        await s.add_items([user("PLAIN-CANARY")])
        s.close()

    asyncio.run(go())
    link = tmp_path / "link.db"
    os.symlink(real, link)
    r = run_cli("import", str(link), "--shred-source", "--yes")
    assert r.code == 0, r
    assert not any(real.with_name(real.name + s).exists() for s in ("", "-wal", "-shm", "-journal"))
    assert run_cli("--json", "show", "carnet-local").json()["items"] == [user("PLAIN-CANARY")]
