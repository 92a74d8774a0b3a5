"""`memvault backup DEST`: a consistent, private, compact copy that opens as the same vault.

Real subprocesses, the real keyring, real SQLite files; a real writer process
keeps appending while a backup is taken.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, add_items, raw_bytes, run_cli, user
from tests.keys.test_keyring_edges import in_another_private_keyring
from tests.keys.test_rotation import (
    bystander,
    end_reader,
    one_line_error,
    reader_holding_snapshot,
    residue,
    tokens,
)
from vault import Vault

SIDE = ("-wal", "-shm", "-journal")


def side_files(p: Path) -> list[Path]:
    return [p.with_name(p.name + s) for s in SIDE if os.path.lexists(p.with_name(p.name + s))]


def count(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT count(*) FROM agent_messages").fetchone()[0])


def integrity(db: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [r[0] for r in conn.execute("PRAGMA integrity_check")]


def filled(vault_db: Path) -> dict[str, list[Any]]:
    expected = {
        "carnet-local": [user("code name NORD-17"), user("repeat it")],
        "work": [user("standup at nine")],
    }
    for sid, items in expected.items():
        add_items(vault_db, sid, items)
    return expected


def test_a_backup_opens_as_the_same_vault_with_every_item(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    expected = filled(vault_db)
    dest = tmp_path / "backup.db"
    r = run_cli("backup", str(dest))
    assert r.code == 0, r
    assert r.err == ""
    # How to restore it elsewhere: the copy plus a recovery kit.
    assert "memvault key export" in r.out and "key import" in r.out, r
    assert "3 items in 2 sessions" in r.out
    # Settled: no side file, WAL as Vault.init makes files (header bytes 18-19 are 2).
    assert side_files(dest) == []
    assert dest.read_bytes()[18:20] == b"\x02\x02"
    copy = Vault.open(dest)
    assert copy.meta()["vault_id"] == vault.meta()["vault_id"]
    assert copy.meta()["kid"] == vault.meta()["kid"]
    # Every item, through the real keyring's key for this vault.
    for sid, items in expected.items():
        assert copy.items(sid) == (items, 0, 0)
    assert integrity(dest) == ["ok"]
    assert run_cli("--db", str(dest), "verify").code == 0
    # The live vault's audit trail says a copy exists, and where.
    log = run_cli("log")
    assert "backup" in log.out and str(dest) in log.out, log


def test_backup_json_is_one_document(vault: Vault, vault_db: Path, tmp_path: Path) -> None:
    filled(vault_db)
    dest = tmp_path / "b.db"
    r = run_cli("--json", "backup", str(dest))
    assert r.code == 0, r
    doc = r.json()
    meta = vault.meta()
    assert doc["path"] == str(dest)
    assert doc["source"] == str(vault_db)
    assert (doc["vault_id"], doc["kid"]) == (meta["vault_id"], meta["kid"])
    assert (doc["items"], doc["sessions"]) == (3, 2)
    assert doc["mode"] == "0o600" and doc["size"] == dest.stat().st_size
    assert doc["key"] == "present and matching" and doc["key_problem"] is None
    assert any("key export" in s for s in doc["restore"])
    assert any("key import" in s for s in doc["restore"])


def test_the_backup_is_0600_whatever_the_umask(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    filled(vault_db)
    dest = tmp_path / "open-umask.db"
    old = os.umask(0)  # inherited by the child: SQLite would make 0644 files
    try:
        r = run_cli("backup", str(dest))
    finally:
        os.umask(old)
    assert r.code == 0, r
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert side_files(dest) == []


WRITER = textwrap.dedent(
    """
    import asyncio, os, sys
    import vault

    db, stop = sys.argv[1], sys.argv[2]

    async def go():
        s = vault.open_session("busy", db)
        i = 0
        while not os.path.exists(stop):
            await s.add_items([{"role": "user", "content": f"item {i}"}])
            i += 1
        s.close()

    asyncio.run(go())
    """
)


def wait_for(condition: Any, what: str, deadline: float = 180) -> None:
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_backup_taken_while_another_process_writes_is_consistent(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(vault_db), str(stop)], cwd=ROOT)
    try:
        wait_for(lambda: count(vault_db) >= 20, "the writer's first items")
        # The writer must have written during the backup; on a busy machine it may be
        # starved for a whole run, so a run where it was is looked for, a few times.
        for attempt in range(5):
            dest = tmp_path / f"backup-{attempt}.db"
            before = count(vault_db)
            r = run_cli("backup", str(dest))
            after = count(vault_db)
            assert r.code == 0, r
            if after > before:
                break
        assert after > before, "the writer made no progress during any backup"
        assert writer.poll() is None  # still writing: nothing made it stop
    finally:
        stop.touch()
        writer.wait(timeout=120)
    assert writer.returncode == 0
    copied = count(dest)
    assert before <= copied <= after
    assert integrity(dest) == ["ok"]
    copy = Vault.open(dest)
    [info] = copy.sessions()
    assert (info.items, info.expired_unverified) == (copied, 0)
    # A snapshot: the first `copied` items the writer wrote, in order, none missing.
    items, expired, unreadable = copy.items("busy")
    assert [i["content"] for i in items] == [f"item {n}" for n in range(copied)]
    assert (expired, unreadable) == (0, 0)


@pytest.mark.slow
def test_a_backup_holds_no_residue_of_items_cleared_before_it(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "secret", [user(f"secret {i} " + "x" * 200) for i in range(30)])
    add_items(vault_db, "keep", [user("kept")])
    cleared = tokens(vault_db, "secret")
    # A reader holding a snapshot keeps clear's scrub from finishing: the old
    # ciphertext stays in the vault's files for now.
    with bystander(vault_db), reader_holding_snapshot(vault_db) as reader:
        r = run_cli("clear", "secret", "--yes")
        assert r.code == 5, r  # committed, scrub incomplete
        # Control: a plain copy of the files, taken before the scrub, finds the tokens.
        plain = tmp_path / "plain-copy.db"
        plain.write_bytes(raw_bytes(vault_db))
        assert residue(plain, cleared) == cleared
        dest = tmp_path / "backup.db"
        b = run_cli("backup", str(dest))
        assert b.code == 0, b
        end_reader(reader)
    assert residue(dest, cleared) == []
    assert Vault.open(dest).items("keep") == ([user("kept")], 0, 0)
    with contextlib.closing(sqlite3.connect(dest)) as conn:
        meta = dict(conn.execute("SELECT key, value FROM memvault_meta"))
    assert meta["scrub_pending"] == "0"  # nothing to scrub in a compact copy


def test_a_backup_leaves_free_page_residue_behind(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """Rows deleted without secure_delete (plain sqlite3, the bare SDK) leave their
    ciphertext in free pages; SQLite's backup API would copy them, VACUUM INTO does not."""
    add_items(vault_db, "secret", [user(f"secret {i} " + "x" * 300) for i in range(60)])
    add_items(vault_db, "keep", [user("kept")])
    deleted = tokens(vault_db, "secret")
    with contextlib.closing(sqlite3.connect(vault_db, isolation_level=None)) as conn:
        conn.execute("PRAGMA secure_delete = OFF")
        conn.execute("DELETE FROM agent_messages WHERE session_id = 'secret'")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    # The residue is there to carry (a freelist trunk page overwrites a few cells).
    left = residue(vault_db, deleted)
    assert len(left) >= len(deleted) // 2, (len(left), len(deleted))
    # Control: the backup API copies pages as they are, free ones included.
    api_copy = tmp_path / "api-copy.db"
    with (
        contextlib.closing(sqlite3.connect(vault_db)) as src,
        contextlib.closing(sqlite3.connect(api_copy)) as dst,
    ):
        src.backup(dst)
    assert residue(api_copy, left) == left
    dest = tmp_path / "backup.db"
    r = run_cli("backup", str(dest))
    assert r.code == 0, r
    assert residue(dest, deleted) == []
    assert Vault.open(dest).items("keep") == ([user("kept")], 0, 0)


def make_entry(kind: str, dest: Path, target: Path) -> None:
    if kind == "file":
        dest.write_bytes(b"precious")
    elif kind == "symlink":
        dest.symlink_to(target)
    elif kind == "dangling symlink":
        dest.symlink_to(dest.with_name("nowhere.db"))
    elif kind == "fifo":
        os.mkfifo(dest)
    elif kind == "folder":
        dest.mkdir()


@pytest.mark.parametrize("kind", ["file", "symlink", "dangling symlink", "fifo", "folder"])
@pytest.mark.sweep
def test_an_existing_destination_is_refused_and_left_untouched(
    vault: Vault, vault_db: Path, tmp_path: Path, kind: str
) -> None:
    filled(vault_db)
    target = tmp_path / "precious.db"
    target.write_bytes(b"precious")
    before = target.stat()
    dest = tmp_path / "backup.db"
    make_entry(kind, dest, target)
    listing = sorted(p.name for p in tmp_path.iterdir())
    r = run_cli("backup", str(dest), timeout=60)  # a FIFO opened for reading would hang
    assert r.code == 2, r
    err = one_line_error(r)
    assert str(dest) in err, err
    assert r.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == listing
    assert target.read_bytes() == b"precious"
    assert target.stat().st_mtime_ns == before.st_mtime_ns
    assert not dest.with_name("nowhere.db").exists()
    assert "backup" not in run_cli("log").out


def test_a_side_file_beside_the_destination_is_refused(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    filled(vault_db)
    target = tmp_path / "precious"
    target.write_bytes(b"precious")
    dest = tmp_path / "backup.db"
    dest.with_name("backup.db-wal").symlink_to(target)
    r = run_cli("backup", str(dest))
    assert r.code == 2, r
    assert "backup.db-wal" in one_line_error(r)
    assert not os.path.lexists(dest)
    assert target.read_bytes() == b"precious"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("", "is empty"),
        ("missing-folder/backup.db", "does not exist"),
        ("bad\udcff.db", "not valid UTF-8"),
    ],
)
def test_an_unusable_destination_name_is_a_usage_error(
    vault: Vault, vault_db: Path, tmp_path: Path, name: str, says: str
) -> None:
    filled(vault_db)
    dest = str(tmp_path / name) if name else ""
    listing = sorted(os.listdir(tmp_path))
    r = run_cli("backup", dest)
    assert r.code == 2, r
    assert says in one_line_error(r)
    assert sorted(os.listdir(tmp_path)) == listing


def test_backup_without_a_vault_is_exit_3_and_writes_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "backup.db"
    r = run_cli("backup", str(dest))
    assert r.code == 3, r
    assert "no vault" in one_line_error(r)
    assert not os.path.lexists(dest)


def test_a_revoked_vault_is_not_backed_up(vault: Vault, vault_db: Path, tmp_path: Path) -> None:
    filled(vault_db)
    assert run_cli("revoke", "--yes").code == 0
    dest = tmp_path / "backup.db"
    r = run_cli("--json", "backup", str(dest))
    assert r.code == 4, r
    assert "revoked" in one_line_error(r)
    assert r.json()["exit_code"] == 4
    assert not os.path.lexists(dest)


@pytest.mark.slow
def test_a_vault_whose_key_is_missing_is_still_backed_up_with_a_warning(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """On a machine whose keyring lacks the key (a second private keyring), the
    backup is made and says it opens only with a recovery kit; back here, where the
    key is, the copy opens."""
    expected = filled(vault_db)
    dest = tmp_path / "elsewhere.db"
    script = 'cd "$1" && python -m vault --db "$2" --json backup "$3"; echo "exit=$?" >&2'
    proc = in_another_private_keyring(script.replace('"$3"', f"'{dest}'"), vault_db)
    assert "exit=0" in proc.stderr, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "recovery kit" in warnings[0], proc.stderr
    doc = __import__("json").loads(proc.stdout)
    assert doc["key"] == "unusable" and doc["key_problem"], doc
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    copy = Vault.open(dest)
    for sid, items in expected.items():
        assert copy.items(sid) == (items, 0, 0)


def test_a_backup_that_cannot_be_written_leaves_nothing_behind(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """The disk fills up half-way (a file-size limit on the child): one line, exit 1,
    and no partial copy, while the vault itself is untouched."""
    import resource

    add_items(vault_db, "big", [user(f"item {i} " + "z" * 500) for i in range(200)])
    with contextlib.closing(sqlite3.connect(vault_db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = vault_db.stat().st_size
    assert size > 4 * 32768  # room for the -shm (32 KiB) under the limit, not for the copy
    limit = size // 2

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    dest = tmp_path / "backup.db"
    proc = subprocess.run(
        [sys.executable, "-m", "vault", "backup", str(dest)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        preexec_fn=small_files,
    )
    assert proc.returncode == 1, proc
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("memvault: error: cannot write the backup"), err
    assert not os.path.lexists(dest) and side_files(dest) == []
    assert integrity(vault_db) == ["ok"]
    assert run_cli("verify").code == 0


def test_a_rotation_committed_during_the_backup_keeps_the_copy_readable(
    vault: Vault, vault_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy keeps the old key id; the rotation retains that key for the recorded copy."""
    from vault import testhooks
    from vault.engines.sqlite.backup import backup

    filled(vault_db)
    old_kid = vault.meta()["kid"]

    def rotate_meanwhile(name: str) -> None:
        if name == "backup-copied":
            Vault.open(vault_db).rotate()

    monkeypatch.setattr(testhooks, "failpoint", rotate_meanwhile)
    r = backup(Vault.open(vault_db), tmp_path / "backup.db")
    assert r.kid == old_kid != vault.meta()["kid"]
    assert r.key == "present and matching" and r.key_problem is None, r
    monkeypatch.undo()
    assert run_cli("--db", r.path, "verify").code == 0


def test_ctrl_c_while_the_copy_is_settled_leaves_no_partial_backup(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    from tests.conftest import default_sigint

    filled(vault_db)
    dest = tmp_path / "backup.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vault", "backup", str(dest)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, MEMVAULT_PAUSEPOINT="backup-vacuumed"),
        cwd=ROOT,
        preexec_fn=default_sigint,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # blocks until the pause point is reached (or the exit)
    assert "paused at backup-vacuumed" in line, line
    # Written beside its name, not yet settled: the name appears only with a whole copy.
    assert not os.path.lexists(dest)
    assert [p.name[:16] for p in tmp_path.glob(".memvault-*")] == [".memvault-backup"]
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().startswith("memvault: error: interrupted"), err
    assert not os.path.lexists(dest) and side_files(dest) == []
    assert list(tmp_path.glob(".memvault-*")) == []
    assert run_cli("verify").code == 0


def test_a_killed_backups_copy_whose_first_page_is_not_written_yet_is_removed_next_time(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    # SQLite may extend the new file before it writes page 1: a backup killed then
    # leaves zeros where the header goes, and a hot journal beside it.
    add_items(vault_db, "s", [user("NORD-17")])
    half = tmp_path / ".memvault-backup-0123456789abcdef"
    half.write_bytes(b"\0" * 8192)
    Path(f"{half}-journal").write_bytes(b"\0" * 512 + b"NORD-17 journal bytes")
    r = run_cli("backup", str(tmp_path / "b.db"))
    assert r.code == 0, r
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".memvault-")) == []
