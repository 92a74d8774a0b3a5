"""Every bad input: one line on stderr, the documented exit code, nothing changed."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import keyring
import pytest

from tests.conftest import (
    ROOT,
    CLIResult,
    add_items,
    key_entries,
    key_entry,
    raw_bytes,
    rows,
    run_cli,
    user,
)
from vault.crypto import generate_key, key_id


def one_line(r: CLIResult, code: int, *needles: str) -> None:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("memvault: error: ")
    assert "Traceback" not in r.err
    for n in needles:
        assert n in r.err, (n, r.err)


def snapshot(db: Path) -> bytes:
    return raw_bytes(db)


def test_missing_vault(vault_db: Path) -> None:
    for args in (["status"], ["sessions"], ["show", "x"], ["purge", "--yes"], ["ttl"]):
        one_line(run_cli(*args), 3, "no vault at", "memvault init")
    assert not vault_db.exists() and not vault_db.parent.exists()


def test_not_sqlite(vault_db: Path) -> None:
    vault_db.parent.mkdir()
    vault_db.write_bytes(b"hello, I am a text file\n" * 10)
    one_line(run_cli("status"), 3, "not a SQLite database")
    one_line(run_cli("shred", "--yes"), 3)
    assert vault_db.read_bytes() == b"hello, I am a text file\n" * 10


def test_plain_sqlite_file_is_not_a_vault(vault_db: Path) -> None:
    vault_db.parent.mkdir()
    conn = sqlite3.connect(vault_db)
    conn.execute("CREATE TABLE agent_messages (id INTEGER PRIMARY KEY, message_data TEXT)")
    conn.commit()
    conn.close()
    before = vault_db.read_bytes()
    one_line(run_cli("sessions"), 3, "not a memvault vault", "memvault import")
    assert vault_db.read_bytes() == before


def test_truncated_database(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x" * 5000) for _ in range(20)])
    size = vault_db.stat().st_size
    with open(vault_db, "r+b") as fh:
        fh.truncate(size // 2)
    before = snapshot(vault_db)
    for args in (["status"], ["show", "s"], ["rotate"]):
        one_line(run_cli(*args), 1, "truncated", "backup")
    assert snapshot(vault_db) == before


def test_corrupt_row(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("good")])
    conn = sqlite3.connect(vault_db)
    with conn:
        conn.execute("DROP TRIGGER memvault_guard_update")  # an attacker or a bad disk
        conn.execute("UPDATE agent_messages SET message_data = '{not json'")
    conn.close()
    before = snapshot(vault_db)
    one_line(run_cli("show", "s"), 1, "does not verify (unauthenticated)", "nothing was read")
    r = run_cli("show", "s", "--include-tampered")
    one_line(r, 1, "failed authentication", "nothing was changed")
    one_line(run_cli("pop", "s", "--yes"), 1, "does not authenticate")
    assert run_cli("--json", "status").json()["items"] == 1  # counted, not authenticated
    assert snapshot(vault_db) == before


def test_tampered_token(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one"), user("two")])
    conn = sqlite3.connect(vault_db)
    with conn:
        row_id, data = conn.execute(
            "SELECT id, message_data FROM agent_messages LIMIT 1"
        ).fetchone()
        env = json.loads(data)
        p = env["payload"]
        env["payload"] = p[:60] + ("B" if p[60] != "B" else "C") + p[61:]  # flip ciphertext
        conn.execute(
            "UPDATE agent_messages SET message_data = ? WHERE id = ?", (json.dumps(env), row_id)
        )
    conn.close()
    before = snapshot(vault_db)
    one_line(run_cli("show", "s"), 1, "does not verify (unauthenticated)", "nothing was read")
    r = run_cli("show", "s", "--include-tampered")
    one_line(r, 1, "1 item of session", "failed authentication")
    first, shown = r.out.strip().splitlines()
    assert first.startswith("TAMPERED: ") and "unauthenticated" in first
    assert shown == "#2 user: two"  # numbered among the stored items, as export does
    assert snapshot(vault_db) == before


def test_unknown_session(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    before = snapshot(vault_db)
    for args in (["show", "nope"], ["pop", "nope"], ["clear", "nope", "--yes"]):
        one_line(run_cli(*args), 1, "no session 'nope'", "memvault sessions")
    assert snapshot(vault_db) == before


@pytest.mark.parametrize("bad", ["soon", "10y", "-5m", "0", "0s", "1.5h", ""])
@pytest.mark.sweep
def test_bad_duration(vault: Any, vault_db: Path, bad: str) -> None:
    before = snapshot(vault_db)
    one_line(run_cli("ttl", "--", bad), 2, "duration")
    assert snapshot(vault_db) == before


def test_bad_duration_on_init(vault_db: Path) -> None:
    one_line(run_cli("init", "--ttl", "forever"), 2, "not a duration")
    assert not vault_db.exists()


@pytest.mark.parametrize("limit", ["0", "-3", "many"])
def test_bad_limit(vault: Any, vault_db: Path, limit: str) -> None:
    add_items(vault_db, "s", [user("x")])
    one_line(run_cli("show", "s", "--limit", limit), 2, "--limit")
    one_line(run_cli("pop", "s", "-n", limit), 2, "-n")
    assert len(rows(vault_db)) == 1


DROP_ROOT_POWERS = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]


def as_ordinary_user(*args: str) -> CLIResult:
    """Run the CLI without root's power to ignore file permissions (CI runs as root)."""
    prefix = DROP_ROOT_POWERS if os.geteuid() == 0 else []
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "vault", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env=dict(os.environ),
    )
    return CLIResult(proc)


def test_read_only_folder_init(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        one_line(
            as_ordinary_user("--db", str(folder / "v.db"), "init"),
            1,
            "cannot create",
            "writable folder",
        )
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)


def test_read_only_folder_existing_vault(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    before = snapshot(vault_db)
    vault_db.chmod(0o444)
    vault_db.parent.chmod(0o555)
    try:
        one_line(as_ordinary_user("clear", "s", "--yes"), 1, "cannot write", "permissions")
        assert snapshot(vault_db) == before
    finally:
        vault_db.parent.chmod(0o700)
        vault_db.chmod(0o600)
    assert len(rows(vault_db)) == 1


@pytest.mark.parametrize(
    ("backend", "needle"),
    [
        ("keyring.backends.fail.Keyring", "no OS keyring backend"),
        ("keyring.backends.null.Keyring", "null backend"),
    ],
)
def test_no_usable_keyring(vault: Any, vault_db: Path, backend: str, needle: str) -> None:
    add_items(vault_db, "s", [user("x")])
    before = snapshot(vault_db)
    env = {"PYTHON_KEYRING_BACKEND": backend}
    for args in (["show", "s"], ["ttl"], ["rotate"], ["clear", "s", "--yes"]):
        one_line(run_cli(*args, env=env), 4, needle)
    one_line(run_cli("--db", str(vault_db.parent / "new.db"), "init", env=env), 4, needle)
    assert not (vault_db.parent / "new.db").exists()
    assert snapshot(vault_db) == before


def test_missing_key_is_never_replaced(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    keyring.delete_password("memvault", key_entry(vault))
    before = snapshot(vault_db)
    one_line(run_cli("show", "s"), 4, "has no key", "for vault", "key import")
    assert key_entries(vault.vault_id) == {}  # no key was invented
    assert snapshot(vault_db) == before


def test_empty_key_entry(vault: Any, vault_db: Path) -> None:
    keyring.set_password("memvault", key_entry(vault), "")
    one_line(run_cli("ttl"), 4, "empty or is not a memvault key")
    assert keyring.get_password("memvault", key_entry(vault)) == ""


def test_wrong_key(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    right = vault.sealer().kid
    other = generate_key()
    keyring.set_password("memvault", key_entry(vault), other)
    before = snapshot(vault_db)
    for args in (["show", "s"], ["ttl"], ["purge", "--yes"], ["rotate"]):
        one_line(run_cli(*args, env={}), 4, right, key_id(other))
    assert snapshot(vault_db) == before
    assert keyring.get_password("memvault", key_entry(vault)) == other


def test_wrong_key_through_the_library(vault: Any, vault_db: Path) -> None:
    import vault as vault_pkg
    from vault.errors import KeyMismatch

    keyring.set_password("memvault", key_entry(vault), generate_key())
    with pytest.raises(KeyMismatch):
        vault_pkg.open_session("s", vault_db)


LOCKED_SCRIPT = r"""
set -e
cd "$1"
python -m vault --db "$2" init >/dev/null
python - <<'P'
import secretstorage
from vault.secretservice import connect
secretstorage.get_default_collection(connect()).lock()
P
set +e
python -m vault --db "$2" sessions >/dev/null  # needs no key: works with the keyring locked
echo "sessions exit=$?"
python -m vault --db "$2" ttl
echo "exit=$?" >&2
"""


@pytest.mark.secret_service
def test_locked_collection(tmp_path: Path) -> None:
    # A private keyring of its own: a locked collection cannot be unlocked headless.
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_IN_PRIVATE_KEYRING"}
    db = tmp_path / "locked.db"
    proc = subprocess.run(
        [
            str(ROOT / "scripts" / "with-keyring"),
            "bash",
            "-c",
            LOCKED_SCRIPT,
            "x",
            str(ROOT),
            str(db),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert err[-1] == "exit=4", proc.stderr
    assert "sessions exit=0" in proc.stdout, (proc.stdout, proc.stderr)
    assert len([line for line in err if line.startswith("memvault: error:")]) == 1
    assert any("is locked" in line and "unlock" in line for line in err)
    assert "Traceback" not in proc.stderr


def test_internal_error_is_one_line_without_traceback(vault: Any, vault_db: Path) -> None:
    # A directory where the WAL file should be: SQLite fails in an unusual way.
    add_items(vault_db, "s", [user("x")])
    wal = vault_db.with_name(vault_db.name + "-wal")
    if wal.exists():
        wal.unlink()
    wal.mkdir()
    try:
        r = run_cli("show", "s")
        assert r.code == 1 and len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
    finally:
        shutil.rmtree(wal)


def test_sqlite_errors_are_classified_by_their_code_not_by_words_in_the_message(
    tmp_path: Path,
) -> None:
    """SQLITE_BUSY is busy and SQLITE_NOTADB is no vault; words in a message mean nothing."""
    from vault.engines.sqlite.db import translate
    from vault.errors import NotAVault, OperationFailed, VaultBusy

    db = tmp_path / "v.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA journal_mode = WAL")
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(db, isolation_level=None, timeout=0)
    try:
        with pytest.raises(sqlite3.OperationalError) as busy:
            other.execute("BEGIN IMMEDIATE")
        assert type(translate(busy.value, db)) is VaultBusy
        # SQLITE_ERROR, whose text happens to hold words other errors use.
        with pytest.raises(sqlite3.OperationalError) as plain:
            other.execute("SELECT * FROM locked_or_corrupt_disk_full")
        err = translate(plain.value, db)
        assert type(err) is OperationFailed and err.message.startswith("SQLite error on"), err
    finally:
        other.close()
        holder.close()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 200)
    with pytest.raises(sqlite3.DatabaseError) as notadb:
        sqlite3.connect(junk).execute("SELECT * FROM sqlite_master")
    assert type(translate(notadb.value, junk)) is NotAVault
