"""Backups never die silently: a rotation keeps the old key version, decrypt-only, while a
backup recorded in the vault uses it; `key list` explains it, `key forget` ends it, and
revoke and shred destroy it with the rest.

Real subprocesses, the real keyring (scripts/test's private Secret Service), real files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import add_items, key_entries, keyring_entries, run_cli, user
from vault import Vault
from vault.keyjournal import entry_name


def journal(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT kid, state FROM memvault_keys").fetchall())


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def backed_up(vault: Any, vault_db: Path, tmp_path: Path) -> tuple[Path, list[Any]]:
    """A vault with items, a backup of it, and the items the backup holds."""
    items = [user("code name NORD-17"), user("meet at the north gate")]
    add_items(vault_db, "S", items)
    b = tmp_path / "b.db"
    r = run_cli("--db", str(vault_db), "backup", str(b))
    assert r.code == 0, r
    return b, items


def test_a_backup_still_reads_after_the_vault_rotates(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    b, items = backed_up(vault, vault_db, tmp_path)
    old_kid = vault.meta()["kid"]
    r = run_cli("--db", str(vault_db), "rotate", "--yes")  # non-interactive: nothing asked
    assert r.code == 0, r
    assert journal(vault_db)[old_kid] == "retained"
    # The backup opens in new processes with the retained entry; the live vault too.
    r = run_cli("--db", str(b), "--json", "verify")
    assert r.code == 0, r
    r = run_cli("--db", str(b), "--json", "show", "S")
    assert r.code == 0, r
    assert r.json()["items"] == items
    r = run_cli("--db", str(vault_db), "--json", "show", "S")
    assert r.code == 0 and r.json()["items"] == items, r
    # Its entry is still there after the next opens: no tidy-up destroys it.
    assert entry_name(vault.vault_id, old_kid) in keyring_entries(vault.vault_id)


def test_a_rotation_destroys_the_old_key_when_no_backup_uses_it(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "S", [user("x")])
    old_kid = vault.meta()["kid"]
    r = run_cli("--db", str(vault_db), "--json", "rotate")
    assert r.code == 0, r
    assert r.json()["old_key"] == "destroyed" and r.json()["backups"] == []
    assert journal(vault_db)[old_kid] == "destroyed"
    assert list(key_entries(vault.vault_id)) == [entry_name(vault.vault_id, vault.meta()["kid"])]


def test_rotate_says_which_backups_stay_readable_and_why(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    b, _ = backed_up(vault, vault_db, tmp_path)
    old_kid = vault.meta()["kid"]
    r = run_cli("--db", str(vault_db), "rotate")
    assert r.code == 0, r
    assert f"old key {old_kid} retained" in r.out, r.out
    assert f"{b}: readable, its key {old_kid} is retained for it" in r.out, r.out
    r = run_cli("--db", str(vault_db), "--json", "rotate")
    assert r.code == 0, r
    doc = r.json()
    assert doc["old_key"] == "destroyed"  # the second rotation's old key: no backup uses it
    [backup] = doc["backups"]
    assert backup["path"] == str(b) and backup["readable"] is True
    assert backup["key_state"] == "retained" and backup["kid"] == old_kid


def test_key_list_shows_retained_versions_with_their_backups_missing_or_replaced(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    b, _ = backed_up(vault, vault_db, tmp_path)
    gone = tmp_path / "gone.db"
    swapped = tmp_path / "swapped.db"
    for extra in (gone, swapped):
        assert run_cli("--db", str(vault_db), "backup", str(extra)).code == 0
    old_kid = vault.meta()["kid"]
    assert run_cli("--db", str(vault_db), "rotate").code == 0
    gone.unlink()
    swapped.unlink()
    shutil.copyfile(b, swapped)  # a vault file, but not the backup recorded there
    r = run_cli("--db", str(vault_db), "--json", "key", "list")
    assert r.code == 0, r
    [kept] = [k for k in r.json()["keys"] if k["state"] == "retained"]
    assert kept["kid"] == old_kid and kept["in_keyring"] is True
    files = {x["path"]: x["file"] for x in kept["backups"]}
    assert files == {str(b): "present", str(gone): "missing", str(swapped): "replaced"}
    r = run_cli("--db", str(vault_db), "key", "list")
    assert r.code == 0, r
    assert f"{gone} (missing): readable" in r.out and f"{swapped} (replaced)" in r.out, r.out


def test_key_forget_says_what_becomes_unreadable_asks_then_destroys_the_version(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    b, _ = backed_up(vault, vault_db, tmp_path)
    old_kid = vault.meta()["kid"]
    assert run_cli("--db", str(vault_db), "rotate").code == 0
    r = run_cli("--db", str(vault_db), "key", "forget", old_kid, input="n\n")
    assert r.code == 1, r
    assert str(b) in r.err and journal(vault_db)[old_kid] == "retained", r
    r = run_cli("--db", str(vault_db), "--json", "key", "forget", old_kid, "--yes")
    assert r.code == 0, r
    assert [x["path"] for x in r.json()["unreadable"]] == [str(b)]
    assert journal(vault_db)[old_kid] == "destroyed"
    assert entry_name(vault.vault_id, old_kid) not in keyring_entries(vault.vault_id)
    r = run_cli("--db", str(b), "verify")
    assert r.code == 4, r  # the backup needs a kit now, as it was told
    r = run_cli("--db", str(vault_db), "--json", "show", "S")
    assert r.code == 0 and len(r.json()["items"]) == 2, r


def test_key_forget_refuses_a_version_that_is_not_retained(vault: Any, vault_db: Path) -> None:
    kid = vault.meta()["kid"]
    r = run_cli("--db", str(vault_db), "key", "forget", kid, "--yes")
    assert r.code == 2, r
    assert "is not a retained version" in one_line(r.err)
    assert journal(vault_db)[kid] == "current"
    assert entry_name(vault.vault_id, kid) in keyring_entries(vault.vault_id)


@pytest.mark.slow
def test_revoke_and_shred_destroy_retained_versions_too(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    b, _ = backed_up(vault, vault_db, tmp_path)
    assert run_cli("--db", str(vault_db), "rotate").code == 0
    assert len(key_entries(vault.vault_id)) == 2
    r = run_cli("--db", str(vault_db), "revoke", "--yes")
    assert r.code == 0, r
    assert keyring_entries(vault.vault_id) == {}
    assert set(journal(vault_db).values()) == {"destroyed"}
    assert run_cli("--db", str(b), "verify").code == 4

    other = tmp_path / "other" / "v.db"
    v2_id = Vault.init(other, ttl=None).vault_id
    add_items(other, "S", [user("y")])
    assert run_cli("--db", str(other), "backup", str(tmp_path / "b2.db")).code == 0
    assert run_cli("--db", str(other), "rotate").code == 0
    assert len(key_entries(v2_id)) == 2
    r = run_cli("--db", str(other), "shred", "--yes")
    assert r.code == 0, r
    assert keyring_entries(v2_id) == {}


def test_every_backup_is_recorded_with_its_absolute_path_in_the_log(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "S", [user("x")])
    here = tmp_path / "cwd"
    here.mkdir()
    cwd = os.getcwd()
    os.chdir(here)
    try:
        r = run_cli("--db", str(vault_db), "--json", "backup", "rel.db")
    finally:
        os.chdir(cwd)
    # run_cli runs from the repository root: the relative name is resolved there.
    from tests.conftest import ROOT

    made = ROOT / "rel.db"
    try:
        assert r.code == 0, r
        assert r.json()["path"] == str(made)
        r = run_cli("--db", str(vault_db), "--json", "log")
        [event] = [e for e in r.json() if e["event"] == "backup"]
        assert event["to"] == str(made)
        with contextlib.closing(sqlite3.connect(vault_db)) as conn:
            [(path, bid)] = conn.execute("SELECT path, backup_id FROM memvault_backups").fetchall()
        assert path == str(made)
        with contextlib.closing(sqlite3.connect(made)) as conn:
            [(mine,)] = conn.execute(
                "SELECT value FROM memvault_meta WHERE key = 'backup_id'"
            ).fetchall()
        assert mine == bid
    finally:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{made}{suffix}")


def test_a_backup_whose_record_cannot_be_written_is_not_made(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "S", [user("x")])
    dest = tmp_path / "b.db"
    holder = sqlite3.connect(vault_db, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock past the timeout
        r = run_cli(
            "--db", str(vault_db), "backup", str(dest), env={"MEMVAULT_LOCK_TIMEOUT": "0.2"}
        )
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert r.code == 5, r
    one_line(r.err)
    assert not os.path.lexists(dest)
    with contextlib.closing(sqlite3.connect(vault_db)) as conn:
        assert conn.execute("SELECT count(*) FROM memvault_backups").fetchone() == (0,)


def test_a_copy_whose_key_was_destroyed_during_the_backup_is_removed_with_its_record(
    vault: Any, vault_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotation between the record and the snapshot, and one between the snapshot and
    the record's update: the copy's key had no record, so the second destroyed it."""
    from vault.engines.sqlite import backup as backup_mod
    from vault.engines.sqlite import filecopy
    from vault.engines.sqlite.vault import Vault as StoreVault
    from vault.errors import OperationFailed

    add_items(vault_db, "S", [user("x")])
    dest = tmp_path / "b.db"
    real_record, real_settle = StoreVault.record_backup, filecopy._settle

    def record_then_rotate(self: Any, target: Path) -> Any:
        rec = real_record(self, target)
        Vault.open(vault_db).rotate()
        return rec

    def settle_then_rotate(target: Path, backup_id: str) -> Any:
        out = real_settle(target, backup_id)
        Vault.open(vault_db).rotate()
        return out

    monkeypatch.setattr(StoreVault, "record_backup", record_then_rotate)
    monkeypatch.setattr(filecopy, "_settle", settle_then_rotate)
    with pytest.raises(OperationFailed, match="destroyed meanwhile"):
        backup_mod.backup(Vault.open(vault_db), dest)
    assert not os.path.lexists(dest)
    with contextlib.closing(sqlite3.connect(vault_db)) as conn:
        assert conn.execute("SELECT count(*) FROM memvault_backups").fetchone() == (0,)
    # The first key, kept for the record that is gone now, goes at the next open.
    Vault.open(vault_db).sealer(refresh=True)
    assert sorted(journal(vault_db).values()) == ["current", "destroyed", "destroyed"]
    assert len(key_entries(vault.vault_id)) == 1


def test_init_tells_the_user_to_make_a_recovery_kit(vault_db: Path) -> None:
    r = run_cli("--db", str(vault_db), "init")
    assert r.code == 0, r
    assert "memvault key export FILE" in r.out, r.out
    r2 = run_cli("--db", str(vault_db.with_name("j.db")), "--json", "init")
    assert r2.code == 0 and r2.json()["next"] == "memvault key export FILE", r2
    for db in (vault_db, vault_db.with_name("j.db")):
        assert run_cli("--db", str(db), "shred", "--yes").code == 0


def test_a_backup_never_carries_the_live_vaults_pending_key_version(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    """Opening the copy would tidy that version away: its entry, which the live vault's
    rotation stores and then uses."""
    add_items(vault_db, "S", [user("x")])
    r = run_cli("--db", str(vault_db), "rotate", env={"MEMVAULT_FAILPOINT": "after-record-pending"})
    assert r.code < 0, r  # killed with a pending version recorded
    assert "pending" in journal(vault_db).values()
    b = tmp_path / "b.db"
    r = run_cli("--db", str(vault_db), "backup", str(b))
    assert r.code == 0, r
    assert "pending" not in journal(b).values()
    assert run_cli("--db", str(b), "verify").code == 0
