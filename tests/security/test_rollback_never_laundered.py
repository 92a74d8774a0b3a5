"""A file put back whole stays reported until it is accepted on purpose: no memvault
command carries it forward. A write would move its vault head on from the older state
past the anchor, and a backup would seal the older state as a backup's own; both would
erase the evidence. A backup itself, copied back over the live file, is the live vault
put back, and an older copy cannot be passed off as a sealed backup without the key. Real
file, real keyring, real `memvault` subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chainkit import insert_chained
from tests.conftest import ROOT, add_items, run_cli, user
from tests.files.test_import import make_plain
from tests.security.test_history_chain_on_a_file import read_in_a_new_process
from tests.security.test_whole_file_rollback import (
    WRITE_THEN_DIE,
    anchor_seq,
    copy_of,
    file_seq,
    put_back,
)
from vault import HistoryTampered, Vault
from vault.chaincheck import Tamper

ROLLED_BACK = Tamper.FILE_ROLLED_BACK.value
OLDER = "older than the state memvault recorded"

# Each a regression found by review: the fast tier keeps the mechanisms' own tests
# (test_whole_file_rollback.py, test_forked_history.py); --all runs these too.
pytestmark = [pytest.mark.secret_service, pytest.mark.deep]


def _refused(r: object, db: Path, seq: int) -> None:
    code, out, err = r.code, r.out, r.err  # type: ignore[attr-defined]
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and OLDER in lines[0], r
    assert "no history was changed" in lines[0] or "was not read or changed" in lines[0], r
    assert "Traceback" not in err and out == "", r
    assert file_seq(db) == seq, r  # not one chained write went through


def test_no_command_writes_to_or_backs_up_a_file_put_back(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    import vault as vault_pkg

    add_items(vault_db, "s", [user(f"item {i}") for i in range(3)])
    add_items(vault_db, "t", [user("another session")])
    older = copy_of(vault_db, tmp_path / "older.db")
    for i in range(2):
        add_items(vault_db, "s", [user(f"later {i}")])
    put_back(older, vault_db)
    seq = file_seq(vault_db)
    src = tmp_path / "carnet.db"
    make_plain(src, {"u": [user("imported")]})
    dest = tmp_path / "b.db"
    for step in [
        ("import", str(src), "--session", "u"),
        ("pop", "s"),
        ("clear", "t", "--yes"),
        ("purge", "--yes"),
        ("rotate", "--yes"),
        ("backup", str(dest)),
    ]:
        _refused(run_cli(*step), vault_db, seq)
    assert not dest.exists()  # no backup sealing the older state as its own

    async def pop() -> None:
        s = vault_pkg.open_session("s", vault_db)
        try:
            with pytest.raises(HistoryTampered) as caught:
                await s.pop_item()
            assert caught.value.kind == ROLLED_BACK
        finally:
            s.close()

    asyncio.run(pop())
    assert file_seq(vault_db) == seq
    r = run_cli("--json", "verify")
    assert r.code == 1 and ROLLED_BACK in r.json()["details"]["history_chain"][0], r

    # Taken on purpose, the file is the vault's again, and every command works on it.
    assert run_cli("accept", "--yes").code == 0
    assert run_cli("pop", "s").code == 0
    assert run_cli("backup", str(dest)).code == 0
    r = run_cli("--json", "verify")
    assert r.code == 0 and r.json()["problems"]["history_chain"] == 0, r
    assert read_in_a_new_process(vault_db) == {"items": 2}


def test_a_backup_copied_over_the_live_file_is_the_vault_put_back(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(2)])
    backup = tmp_path / "b.db"
    assert run_cli("backup", str(backup)).code == 0
    add_items(vault_db, "s", [user("the turn the old backup lacks")])
    # Read where it was made, it is a sound backup of its own state.
    assert run_cli("--db", str(backup), "verify").code == 0

    shutil.copyfile(backup, vault_db)  # `cp b.db vault.db`, WAL checkpointed before
    for side in ("-wal", "-shm"):
        Path(f"{vault_db}{side}").unlink(missing_ok=True)
    r = run_cli("--json", "verify")
    assert r.code == 1, r
    assert ROLLED_BACK in r.json()["details"]["history_chain"][0], r
    assert "a backup copied over the live vault" in r.json()["details"]["history_chain"][0]
    r = run_cli("show", "s")
    assert r.code == 1 and OLDER in r.err and "move it elsewhere" in r.err, r
    assert read_in_a_new_process(vault_db) == {"tampered": ROLLED_BACK, "session": "s"}
    # What the messages say works: moved elsewhere, it restores as the live vault.
    moved = tmp_path / "moved.db"
    vault_db.rename(moved)
    assert run_cli("restore", str(moved), "--yes").code == 0
    assert run_cli("verify").code == 0
    assert read_in_a_new_process(vault_db) == {"items": 2}


def test_a_backup_of_a_backup_names_the_live_vault_and_is_sealed_afresh(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("first")])
    first, second = tmp_path / "b1.db", tmp_path / "b2.db"
    assert run_cli("backup", str(first)).code == 0
    add_items(vault_db, "s", [user("second")])
    assert run_cli("--db", str(first), "backup", str(second)).code == 0
    mark1, mark2 = _mark_of(first), _mark_of(second)
    assert mark2["backup_from"] == mark1["backup_from"] == str(vault_db.absolute())
    assert mark2["backup_point"] != mark1["backup_point"]  # its own id, sealed afresh
    # The second copied back over the first is still a sound backup (not "the live
    # vault put back": the first was never the live vault).
    shutil.copyfile(second, first)
    r = run_cli("--db", str(first), "--json", "verify")
    assert r.code == 0 and r.json()["problems"]["history_chain"] == 0, r


def _mark(db: Path, rows: dict[str, str]) -> None:
    with sqlite3.connect(db) as conn:
        conn.executemany(
            "INSERT OR REPLACE INTO memvault_meta (key, value) VALUES (?, ?)", rows.items()
        )
    conn.close()


def _mark_of(db: Path) -> dict[str, str]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT key, value FROM memvault_meta WHERE key IN "
            "('backup_of', 'backup_id', 'backed_up_at', 'backup_from', 'backup_point')"
        ).fetchall()
    conn.close()
    return dict(rows)


def test_an_older_copy_cannot_be_passed_off_as_a_backup_without_the_key(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("first")])
    older = copy_of(vault_db, tmp_path / "older.db")
    backup = tmp_path / "b.db"
    assert run_cli("backup", str(backup)).code == 0
    add_items(vault_db, "s", [user("second")])
    real = _mark_of(backup)
    assert len(real) == 5

    # The real seal, the live vault's place renamed so the copy is not judged as the
    # live vault put back: the seal covers the place, and no longer authenticates.
    elsewhere = copy_of(older, tmp_path / "elsewhere.db")
    _mark(elsewhere, {**real, "backup_from": str(tmp_path / "not-the-vault.db")})
    # A seal made for another backup (its id) of the very same state.
    renamed = copy_of(older, tmp_path / "renamed.db")
    _mark(renamed, {**real, "backup_id": "0" * len(real["backup_id"])})
    for fake in (elsewhere, renamed):
        r = run_cli("--db", str(fake), "--json", "verify")
        assert r.code == 1, (fake, r)
        assert ROLLED_BACK in r.json()["details"]["history_chain"][0], (fake, r)
        r = run_cli("--db", str(fake), "show", "s")
        assert r.code == 1 and r.out == "", (fake, r)
    # The same copy with the mark untouched is the very backup it is: served.
    twin = copy_of(older, tmp_path / "twin.db")
    _mark(twin, real)
    assert run_cli("--db", str(twin), "verify").code == 0


def test_a_restore_is_no_rollback_to_a_process_that_read_unrecorded_writes(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """`restore` goes past the replaced file's own vault head, not only past the anchor:
    a writer killed within its interval left writes the anchor never saw, and a `Vault`
    object that read them must not take the restored file for an older copy."""
    add_items(vault_db, "s", [user("before")])
    backup = tmp_path / "b.db"
    assert run_cli("backup", str(backup)).code == 0
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_THEN_DIE, str(vault_db), "3600", str(tmp_path / "c.db")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert file_seq(vault_db) - anchor_seq(vault) == 2  # two writes the anchor never saw
    reader = Vault.open(vault_db)
    assert reader.history_verdict("s") is None  # its floor is now past the anchor

    r = run_cli("restore", str(backup), "--yes")
    assert r.code == 0, r
    assert reader.history_verdict("s") is None
    assert len(list(reader.opened_items("s"))) == 1
    assert run_cli("verify").code == 0


def test_a_session_open_across_an_accept_tells_a_rollback_of_its_later_writes(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """What a session read after another process's `accept` is of the accepted history:
    a copy from between two of its later writes, put back after it read the second,
    is told, not passed because the anchor was lifted since the session read it."""
    import vault as vault_pkg

    add_items(vault_db, "s", [user("first")])
    older = copy_of(vault_db, tmp_path / "older.db")

    async def go() -> int:
        s = vault_pkg.open_session("s", vault_db, anchor_every=3600)
        try:
            await s.add_items([user("recorded")])  # the first write is recorded
            put_back(older, vault_db)
            assert run_cli("accept", "--yes").code == 0  # another process, on purpose
            accepted = anchor_seq(vault)
            assert len(await s.get_items()) == 1
            await s.add_items([user("kept")])
            between = copy_of(vault_db, tmp_path / "between.db")
            await s.add_items([user("taken away")])
            assert file_seq(vault_db) - anchor_seq(vault) == 2  # within the interval
            assert len(await s.get_items()) == 3  # read: a state it has seen
            put_back(between, vault_db)
            with pytest.raises(HistoryTampered) as caught:
                await s.get_items()
            assert caught.value.kind == ROLLED_BACK
            return accepted
        finally:
            s.close()

    accepted = asyncio.run(go())
    # Within the interval only the session knew; closing, it records nothing newer.
    assert anchor_seq(vault) == accepted


# How each row no MAC covers is changed under the open session, and put back as it was
# in the copy: a mark added (then taken out), the vault id replaced, a required row deleted.
_CHANGES = {
    "revoked_at": "INSERT OR REPLACE INTO memvault_meta VALUES ('revoked_at', '2026-01-01')",
    "shred_started": "INSERT OR REPLACE INTO memvault_meta VALUES ('shred_started', 'x')",
    "backup_of": "INSERT OR REPLACE INTO memvault_meta VALUES ('backup_of', 'elsewhere')",
    "vault_id": "UPDATE memvault_meta SET value = 'another-vault' WHERE key = 'vault_id'",
    "format": "DELETE FROM memvault_meta WHERE key = 'format'",
}


def _rows(db: Path) -> dict[str, str]:
    with sqlite3.connect(db) as conn:
        rows = dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
    conn.close()
    return rows


@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_meta_rows_changed_under_an_open_session_do_not_stop_its_records(
    vault: Vault, vault_db: Path, tmp_path: Path, change: str
) -> None:
    """Meta rows no MAC covers: a record goes by the vault id and backup state the
    session judged the file by, and a mark that no revoke or shred acted on (the anchor
    is still there) stops none, so a copy from past the change, put back without it,
    is behind."""
    import vault as vault_pkg
    from vault import chainanchor
    from vault.keys import KeyStore

    add_items(vault_db, "s", [user("first")])
    rows = _rows(vault_db)
    vid = rows["vault_id"]  # read before the change: the vault's, whatever the rows say

    async def go() -> Path:
        s = vault_pkg.open_session("s", vault_db, anchor_every=0)
        try:
            await s.add_items([user("judged as it was")])
            with sqlite3.connect(vault_db) as conn:
                conn.execute(_CHANGES[change])
            conn.close()
            await s.add_items([user("second")])
            older = copy_of(vault_db, tmp_path / "between.db")
            await s.add_items([user("third, taken away")])
            recorded = chainanchor.read(KeyStore(), vid)
            assert recorded is not None and recorded.seq == file_seq(vault_db)
            return older
        finally:
            s.close()

    older = asyncio.run(go())
    with sqlite3.connect(older) as conn:
        conn.execute("DELETE FROM memvault_meta")
        conn.executemany("INSERT INTO memvault_meta VALUES (?, ?)", rows.items())
    conn.close()
    put_back(older, vault_db)
    r = run_cli("--json", "verify")
    assert r.code == 1 and ROLLED_BACK in str(r.json()["details"]["history_chain"]), r


def test_an_object_that_judged_a_backup_copied_over_the_vault_records_after_a_restore(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """A `Vault` object that first judged the live path while a backup was copied over
    it records again once `restore` made the file the live vault, so a copy from
    between its later writes, put back, is behind."""
    add_items(vault_db, "s", [user("one")])
    backup = tmp_path / "b.db"
    assert run_cli("backup", str(backup)).code == 0
    add_items(vault_db, "s", [user("two")])
    put_back(backup, vault_db)
    v = Vault.open(vault_db)
    v.session("s").close()  # its floor read: a backup at the live path
    for side in ("-wal", "-shm"):  # moved elsewhere, as the refusal says
        Path(f"{vault_db}{side}").unlink(missing_ok=True)
    vault_db.rename(tmp_path / "moved.db")
    assert run_cli("restore", str(backup), "--yes").code == 0

    async def go() -> Path:
        s = v.session("t")
        s.anchor_every = 0
        try:
            await s.add_items([user("after the restore")])
            between = copy_of(vault_db, tmp_path / "between.db")
            await s.add_items([user("taken away")])
            assert anchor_seq(vault) == file_seq(vault_db)
            return between
        finally:
            s.close()

    put_back(asyncio.run(go()), vault_db)
    r = run_cli("--json", "verify")
    assert r.code == 1 and ROLLED_BACK in str(r.json()["details"]["history_chain"]), r


_OPEN_WRITE_CLOSE = """
import sqlite3, sys, time
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:  # each close the last connection: a checkpoint, exclusive
    c = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
    c.execute("BEGIN IMMEDIATE")
    c.execute("INSERT INTO scratch VALUES (randomblob(2000))")
    c.execute("COMMIT")
    c.close()
"""


def test_a_missing_anchor_is_created_beside_a_busy_writer(vault: Vault, vault_db: Path) -> None:
    """A record asks the file for revoke marks again in the anchor's turn: a file busy
    for a moment (another process's commit, a last connection's checkpoint) is waited
    for, not taken for a marked one, which would create no missing anchor."""
    from vault import chainanchor
    from vault.keys import KeyStore

    add_items(vault_db, "s", [user("one")])
    with sqlite3.connect(vault_db) as conn:
        conn.execute("CREATE TABLE scratch (b BLOB)")
    conn.close()
    writer = subprocess.Popen([sys.executable, "-c", _OPEN_WRITE_CLOSE, str(vault_db), "120"])
    try:
        created = 0
        for _ in range(30):
            chainanchor.forget(KeyStore(), vault.vault_id)
            recorder = Vault.open(vault_db)
            recorder.sealer()
            created += recorder.record_anchor() is not None
        assert writer.poll() is None  # the writer wrote throughout
    finally:
        writer.kill()
        writer.wait()
    assert created == 30


def test_a_record_that_read_the_file_before_a_revoke_does_not_write_its_anchor_back(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record has judged the file and holds its keys, then a whole revoke runs (its
    mark, the anchor forgotten, the keys destroyed), then the record takes its turn at
    the anchor: it asks the file again there, and leaves no anchor that a later revoke
    would not remove."""
    from vault import chainanchor
    from vault.keys import KeyStore

    add_items(vault_db, "s", [user("before the revoke")])
    recorder = Vault.open(vault_db)
    recorder.sealer()
    assert recorder.record_anchor() is not None
    real = chainanchor.this_hosts_turn

    @contextlib.contextmanager
    def after_a_revoke() -> Iterator[None]:
        assert run_cli("revoke", "--yes").code == 0  # before the record's turn
        with real():
            yield

    monkeypatch.setattr(chainanchor, "this_hosts_turn", after_a_revoke)
    assert recorder.record_anchor() is None
    assert chainanchor.read(KeyStore(), vault.vault_id) is None


def test_a_session_open_across_a_revoke_writes_no_anchor_again(
    vault: Vault, vault_db: Path
) -> None:
    """Revoke forgets the vault's anchor before its keys: a session that still holds the
    key in memory finds none to move as it closes, and leaves none behind."""
    import vault as vault_pkg
    from vault import chainanchor
    from vault.keys import KeyStore

    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db, anchor_every=0)
        try:
            await s.add_items([user("before the revoke")])
            assert chainanchor.read(KeyStore(), vault.vault_id) is not None
            assert run_cli("revoke", "--yes").code == 0
            assert chainanchor.read(KeyStore(), vault.vault_id) is None
        finally:
            s.close()

    asyncio.run(go())
    assert chainanchor.read(KeyStore(), vault.vault_id) is None


_HOLD_EXCLUSIVELY = """
import sqlite3, sys
from pathlib import Path
from vault.engines.sqlite.conn import lock_exclusively
c = sqlite3.connect(sys.argv[1], isolation_level=None)
lock_exclusively(c, Path(sys.argv[1]), "try again")  # as a restore or a shred holds it
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_a_record_that_cannot_read_the_file_in_its_turn_records_nothing(
    vault: Vault, vault_db: Path
) -> None:
    """A record reads the file inside this host's turn at the anchor, and waits for it
    there only briefly: a file another process holds exclusively (a restore, a shred)
    is not waited for, and nothing is recorded. The anchor stays behind, a wider
    window, never ahead of the file; the next record once the file is free moves it."""
    from vault import chainanchor
    from vault.keys import KeyStore

    add_items(vault_db, "s", [user("one")])
    vault_id = vault.vault_id  # read now: the file is held below
    recorder = Vault.open(vault_db)
    recorder.sealer()
    first = recorder.record_anchor()
    assert first is not None and anchor_seq(vault) == first.seq
    sealer = vault.sealer()
    with contextlib.closing(sqlite3.connect(vault_db)) as conn, conn:
        # A write memvault's way with no record after it: a state the anchor has not seen.
        insert_chained(conn, sealer, [("s", sealer.seal("s", user("two")))])
    later = file_seq(vault_db)
    assert later > first.seq
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_EXCLUSIVELY, str(vault_db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        started = time.monotonic()
        assert recorder.record_anchor() is None
        # Not the file's two-minute lock wait: the turn is this host's, not this file's.
        assert time.monotonic() - started < 30
        assert chainanchor.read(KeyStore(), vault_id) == first
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    held = recorder.record_anchor()
    assert held is not None and held.seq == later == anchor_seq(vault)
