"""`memvault restore BACKUP`: a checked backup becomes the live vault, crash-safe.

Real subprocesses, the real keyring, real SQLite files; the kills are real
SIGKILLs, at the named steps and at random instants.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from tests.conftest import add_items, run_cli, user
from tests.crashkit import killed_cli
from tests.keys.test_rotation import one_line_error
from vault import Vault

LEFTOVERS = (".restore-new", ".restore-old", "-wal", "-shm", "-journal")


def meta_of(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())


def contents(db: Path) -> list[str]:
    r = run_cli("--db", str(db), "--json", "show", "s")
    assert r.code == 0, r
    return [i["content"] for i in r.json()["items"]]


def leftovers(db: Path) -> list[str]:
    return [db.name + s for s in LEFTOVERS if os.path.lexists(db.with_name(db.name + s))]


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def live_and_backup(vault_db: Path, tmp_path: Path) -> Path:
    """The backup holds ["one"]; the live vault ["one", "two"]."""
    add_items(vault_db, "s", [user("one")])
    dest = tmp_path / "backup.db"
    r = run_cli("backup", str(dest))
    assert r.code == 0, r
    add_items(vault_db, "s", [user("two")])
    return dest


def test_restore_puts_the_backup_back_as_a_live_vault(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    dest = live_and_backup(vault_db, tmp_path)
    before = digest(dest)
    r = run_cli("--json", "restore", str(dest), "--yes")
    assert r.code == 0, r
    doc = r.json()
    assert doc["restored"] and doc["replaces"] and doc["replaced_items"] == 2, doc
    assert contents(vault_db) == ["one"]
    assert leftovers(vault_db) == []
    assert "backup_of" not in meta_of(vault_db)
    assert oct(vault_db.stat().st_mode & 0o777) == "0o600"
    # The live vault takes writes again; the backup is as it was, still a backup.
    assert run_cli("ttl", "7d").code == 0
    add_items(vault_db, "s", [user("three")])
    assert contents(vault_db) == ["one", "three"]
    assert digest(dest) == before and meta_of(dest)["backup_of"] == vault.vault_id
    events = [e["event"] for e in run_cli("--json", "log").json()]
    assert events[-2:] == ["restore", "ttl"], events
    assert run_cli("verify").code == 0


def test_restore_asks_first_and_no_changes_nothing(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    dest = live_and_backup(vault_db, tmp_path)
    r = run_cli("restore", str(dest), input="n\n")
    assert r.code == 1, r
    assert "Replace the vault" in r.err and "Items written since are lost" in r.err
    assert contents(vault_db) == ["one", "two"]
    assert leftovers(vault_db) == []


def test_restore_into_an_empty_path_makes_the_vault_there(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    dest = live_and_backup(vault_db, tmp_path)
    vault_db.rename(tmp_path / "disk-that-died.db")  # the original is gone
    elsewhere = tmp_path / "new-home" / "history.db"
    r = run_cli("--db", str(elsewhere), "restore", str(dest))  # nothing replaced: no question
    assert r.code == 0, r
    assert contents(elsewhere) == ["one"]
    assert "backup_of" not in meta_of(elsewhere)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["-journal", "-wal", "-shm", ".restore-old"])
def test_restore_never_makes_a_vault_where_the_live_vaults_next_open_deletes_it(
    vault: Vault, vault_db: Path, tmp_path: Path, name: str
) -> None:
    # SQLite takes `X-journal` for X's journal (and a restore's names are tidied by X's
    # next open): a vault restored there would be reported restored, then vanish.
    dest = live_and_backup(vault_db, tmp_path)
    there = vault_db.with_name(vault_db.name + name)
    r = run_cli("--db", str(there), "restore", str(dest), "--yes")
    assert r.code == 2 and "nothing was written" in one_line_error(r), r
    assert not os.path.lexists(there)
    assert contents(vault_db) == ["one", "two"]


def test_restore_into_an_empty_path_refuses_while_the_backups_vault_is_still_there(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    # Two live vaults with one vault id share their keyring entries: the twin's first
    # rotation destroyed the key the original still used, and the original was lost.
    dest = live_and_backup(vault_db, tmp_path)
    elsewhere = tmp_path / "new-home" / "history.db"
    r = run_cli("--db", str(elsewhere), "restore", str(dest), "--yes")
    assert r.code == 1, r
    err = one_line_error(r)
    assert f"still at {vault_db}" in err and "nothing was changed" in err, err
    assert not os.path.lexists(elsewhere)
    assert run_cli("rotate", "--yes").code == 0
    assert contents(vault_db) == ["one", "two"]


def test_restore_refuses_a_backup_of_another_vault(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("mine")])
    other = tmp_path / "other" / "history.db"
    assert run_cli("--db", str(other), "init").code == 0
    add_items(other, "s", [user("theirs")])
    dest = tmp_path / "other-backup.db"
    assert run_cli("--db", str(other), "backup", str(dest)).code == 0
    r = run_cli("restore", str(dest), "--yes")
    assert r.code == 1, r
    assert "is a copy of vault" in one_line_error(r)
    assert contents(vault_db) == ["mine"]


def test_restore_refuses_the_vault_itself_and_a_file_that_is_not_a_vault(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    dest = live_and_backup(vault_db, tmp_path)
    r = run_cli("restore", str(vault_db), "--yes")
    assert r.code == 2 and "live vault itself" in one_line_error(r), r
    not_a_vault = tmp_path / "notes.txt"
    not_a_vault.write_text("hello")
    r = run_cli("--db", str(not_a_vault), "restore", str(dest), "--yes")
    assert r.code == 3, r
    assert not_a_vault.read_text() == "hello"


def test_restore_refuses_a_backup_that_does_not_verify(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    dest = live_and_backup(vault_db, tmp_path)
    with contextlib.closing(sqlite3.connect(dest)) as conn:
        row_id, data = conn.execute("SELECT id, message_data FROM agent_messages").fetchone()
        env = json.loads(data)
        payload = env["payload"]
        env["payload"] = payload[:-12] + ("A" if payload[-12] != "A" else "B") + payload[-11:]
        conn.execute(
            "UPDATE agent_messages SET message_data = ? WHERE id = ?", (json.dumps(env), row_id)
        )
        conn.commit()
    r = run_cli("restore", str(dest), "--yes")
    assert r.code == 1, r
    assert "does not verify" in one_line_error(r)
    assert contents(vault_db) == ["one", "two"]
    assert leftovers(vault_db) == []


def test_restore_refuses_while_another_process_has_the_vault_open(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    dest = live_and_backup(vault_db, tmp_path)
    with contextlib.closing(sqlite3.connect(vault_db)) as conn:
        conn.execute("BEGIN")
        conn.execute("SELECT count(*) FROM agent_messages").fetchone()
        r = run_cli("restore", str(dest), "--yes", env={"MEMVAULT_LOCK_TIMEOUT": "1"})
        conn.execute("COMMIT")
    assert r.code == 5, r
    assert "in use by another process" in one_line_error(r)
    assert contents(vault_db) == ["one", "two"]
    assert leftovers(vault_db) == []


def killed_restore(vault_db: Path, dest: Path, failpoint: str | None, delay: float | None) -> int:
    args = ("--db", str(vault_db), "restore", str(dest), "--yes")
    return killed_cli(*args, failpoint=failpoint, delay=delay)


STEPS = {  # the named step, and whose contents the vault holds after a kill there
    "restore-vacuumed": ["one", "two"],
    "restore-copied": ["one", "two"],
    "restore-linked": ["one", "two"],
    "restore-renamed": ["one"],
}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.slow
def test_a_restore_killed_at_each_step_leaves_one_whole_vault(
    vault: Vault, vault_db: Path, tmp_path: Path, step: str
) -> None:
    dest = live_and_backup(vault_db, tmp_path)
    assert killed_restore(vault_db, dest, step, None) == -signal.SIGKILL
    # The next command that opens the vault rolls the restore back, or finishes it.
    assert contents(vault_db) == STEPS[step]
    assert leftovers(vault_db) == []
    assert run_cli("verify").code == 0
    # And a restore run again completes.
    assert run_cli("restore", str(dest), "--yes").code == 0
    assert contents(vault_db) == ["one"]


@pytest.mark.slow
@pytest.mark.crash
def test_a_restore_killed_at_random_instants_leaves_one_whole_vault(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    seed = int(os.environ.get("MEMVAULT_TEST_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    add_items(vault_db, "s", [user("one")])
    dest = tmp_path / "backup.db"
    assert run_cli("backup", str(dest)).code == 0
    # How long a whole restore takes here, to spread the kills over it.
    add_items(vault_db, "s", [user("two")])
    started = time.monotonic()
    assert killed_restore(vault_db, dest, None, None) == 0
    took = time.monotonic() - started
    outcomes: dict[str, int] = {}
    for _ in range(8):
        if contents(vault_db) == ["one"]:
            add_items(vault_db, "s", [user("two")])  # so a restore shows
        delay = rng.uniform(0.0, took)
        killed_restore(vault_db, dest, None, delay)
        got = contents(vault_db)
        assert got in (["one"], ["one", "two"]), (seed, delay, got)
        assert leftovers(vault_db) == [], (seed, delay)
        outcomes["restored" if got == ["one"] else "kept"] = (
            outcomes.get("restored" if got == ["one"] else "kept", 0) + 1
        )
    assert run_cli("verify").code == 0, seed
    print(f"seed {seed}: {outcomes}")


@pytest.mark.slow
def test_after_a_restore_shred_still_destroys_the_replaced_vaults_keys(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """The live vault rotated after the backup: its new key is named in the restored
    vault's journal, so no keyring entry is orphaned."""
    from tests.conftest import keyring_entries
    from tests.keys.test_kit import export, import_

    vault_id = vault.vault_id
    dest = live_and_backup(vault_db, tmp_path)
    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    assert run_cli("rotate").code == 0
    rotated_kid = meta_of(vault_db)["kid"]
    assert import_(kit, "--db", str(dest)).code == 0  # the backup's key, back in the keyring
    r = run_cli("restore", str(dest), "--yes")
    assert r.code == 0, r
    assert contents(vault_db) == ["one"]
    listed = {k["kid"] for k in run_cli("--json", "key", "list").json()["keys"]}
    assert rotated_kid in listed
    assert run_cli("shred", "--yes").code == 0
    assert keyring_entries(vault_id) == {}


@pytest.mark.slow
@pytest.mark.parametrize("step", ["restore-copied", "restore-renamed"])
def test_a_restore_into_an_empty_path_killed_leaves_no_vault_or_a_whole_one(
    vault: Vault, vault_db: Path, tmp_path: Path, step: str
) -> None:
    dest = live_and_backup(vault_db, tmp_path)
    vault_db.rename(tmp_path / "disk-that-died.db")  # the original is gone
    elsewhere = tmp_path / "new-home" / "history.db"
    assert killed_restore(elsewhere, dest, step, None) == -signal.SIGKILL
    if step == "restore-renamed":  # linked into place: the restore is done
        assert contents(elsewhere) == ["one"]
    else:
        r = run_cli("--db", str(elsewhere), "status")
        assert r.code == 3, r
    assert leftovers(elsewhere) == []
