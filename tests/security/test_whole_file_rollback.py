"""A whole vault file put back from an older copy (every session and the vault head
together, consistent with each other): told only by the anchor kept outside the file,
in the keyring. Every command that opened the key records the file's state there as it
ends, and an agent session when it closes and at least every `anchor_every` seconds
while it writes. A file behind it is reported by `verify`, refused by `show`, `export`
and an agent session in a new process, until restored or accepted on purpose; a backup
is judged against the state sealed into it, and `restore` moves the anchor to the
restored file. Real file, real keyring, real `memvault` subprocesses.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, add_items, run_cli, user
from tests.files.test_import import make_plain
from tests.security.test_history_chain_on_a_file import read_in_a_new_process
from vault import HistoryTampered, Vault, chainanchor
from vault.chaincheck import Tamper
from vault.chainvault import VaultHead
from vault.keys import KeyStore

ROLLED_BACK = Tamper.FILE_ROLLED_BACK.value

pytestmark = pytest.mark.secret_service


def file_seq(db: Path) -> int:
    """The `seq` of the vault head stored in the file (every chained write moves it)."""
    conn = sqlite3.connect(db)
    try:
        (text,) = conn.execute("SELECT head FROM memvault_vault_head WHERE id = 1").fetchone()
    finally:
        conn.close()
    vh = VaultHead.decode(text)
    assert vh is not None
    return vh.seq


def anchor_seq(vault: Vault) -> int:
    point = chainanchor.read(KeyStore(), vault.vault_id)
    assert point is not None
    return point.seq


def copy_of(db: Path, dest: Path) -> Path:
    """A consistent copy of the file as it is now, as `cp` of a quiet file gives."""
    src, out = sqlite3.connect(db), sqlite3.connect(dest)
    try:
        src.backup(out)
    finally:
        src.close()
        out.close()
    return dest


def put_back(copy: Path, db: Path) -> None:
    """The older copy over the live file, in place (same inode), as a file-level restore
    through SQLite would write it."""
    src, live = sqlite3.connect(copy), sqlite3.connect(db)
    try:
        src.backup(live)
    finally:
        src.close()
        live.close()


def test_a_file_put_back_whole_is_reported_and_refused_until_accepted(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(3)])
    add_items(vault_db, "t", [user("another session")])
    older = copy_of(vault_db, tmp_path / "older.db")
    add_items(vault_db, "s", [user("the turn a rollback takes away")])
    assert anchor_seq(vault) == file_seq(vault_db)  # the session recorded it as it closed
    assert run_cli("verify").code == 0

    put_back(older, vault_db)
    r = run_cli("--json", "verify")
    assert r.code == 1, r
    assert r.json()["details"]["history_chain"] == [
        f"the vault as a whole: {ROLLED_BACK} (the file is older than the state memvault "
        "recorded of it outside the file; put the newer file back, or `memvault accept` "
        "takes this one as it is)"
    ]
    r = run_cli("show", "s")
    assert r.code == 1 and r.out == "", r
    err = r.err.strip().splitlines()
    assert len(err) == 1 and "older than the state memvault recorded" in err[0], r
    assert "memvault accept" in err[0] and "Traceback" not in r.err
    assert run_cli("show", "s", "--include-tampered").code == 0
    out = tmp_path / "export.jsonl"
    r = run_cli("export", "s", "-o", str(out))
    assert r.code == 1 and not out.exists(), r
    assert read_in_a_new_process(vault_db) == {"tampered": ROLLED_BACK, "session": "s"}
    # Neither the refused commands nor the refused session moved the anchor back.
    assert run_cli("verify").code == 1

    r = run_cli("--json", "accept", "--yes")
    assert r.code == 0 and r.json()["matched"] is False, r
    assert r.json()["anchored"] is True and r.err == "", r
    assert run_cli("verify").code == 0
    assert read_in_a_new_process(vault_db) == {"items": 3}
    assert anchor_seq(vault) == file_seq(vault_db)
    add_items(vault_db, "s", [user("after the accept")])
    assert run_cli("verify").code == 0


def test_every_command_that_opens_the_key_records_the_files_state(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(4)])
    add_items(vault_db, "t", [user("another session")])
    src = tmp_path / "carnet.db"
    make_plain(src, {"u": [user("imported")]})
    steps = [
        ("import", str(src), "--session", "u"),
        ("pop", "s"),
        ("rotate", "--yes"),
        ("clear", "t", "--yes"),
        ("purge", "--yes"),  # nothing past the TTL: no write, the state recorded all the same
    ]
    for step in steps:
        before = file_seq(vault_db)
        r = run_cli(*step)
        assert r.code == 0, (step, r)
        if step[0] != "purge":
            assert file_seq(vault_db) > before, step  # each of these writes a chained change
        assert anchor_seq(vault) == file_seq(vault_db), step
        r = run_cli("--json", "verify")
        assert r.code == 0 and r.json()["problems"]["history_chain"] == 0, (step, r)
    # A key-reading command that writes nothing records too (the state a session left).
    asyncio.run(_write_without_closing(vault_db))
    assert anchor_seq(vault) < file_seq(vault_db)
    assert run_cli("show", "s").code == 0
    assert anchor_seq(vault) == file_seq(vault_db)


async def _write_without_closing(db: Path) -> None:
    import vault as vault_pkg

    s = vault_pkg.open_session("s", db)
    s.anchor_every = 3600
    await s.add_items([user("first: recorded")])
    await s.add_items([user("second: within the interval, not recorded")])
    # not closed: the anchor stays where the first write left it


def test_a_session_records_at_its_first_write_every_interval_and_on_close(
    vault: Vault, vault_db: Path
) -> None:
    import vault as vault_pkg

    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db)
        s.anchor_every = 3600
        await s.add_items([user("one")])
        assert anchor_seq(vault) == file_seq(vault_db)
        await s.add_items([user("two")])
        await s.pop_item()
        assert anchor_seq(vault) == file_seq(vault_db) - 2  # inside the interval
        s.close()
        assert anchor_seq(vault) == file_seq(vault_db)

        s = vault_pkg.open_session("s", vault_db)
        s.anchor_every = 0  # every write
        for text in ("three", "four"):
            await s.add_items([user(text)])
            assert anchor_seq(vault) == file_seq(vault_db)
        await s.clear_session()
        assert anchor_seq(vault) == file_seq(vault_db)
        s.close()

    asyncio.run(go())


def test_an_open_session_refuses_the_file_rolled_back_under_it(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    import vault as vault_pkg

    add_items(vault_db, "s", [user("first")])
    older = copy_of(vault_db, tmp_path / "older.db")

    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db)
        s.anchor_every = 3600  # the keyring's anchor stays behind: the session's own floor tells
        try:
            await s.add_items([user("second")])
            await s.add_items([user("third")])
            assert len(await s.get_items()) == 3
            put_back(older, vault_db)
            with pytest.raises(HistoryTampered) as caught:
                await s.get_items()
            assert caught.value.kind == ROLLED_BACK
        finally:
            s.close()

    asyncio.run(go())


WRITE_THEN_DIE = """
import asyncio, os, signal, sqlite3, sys
import vault

async def main():
    s = vault.open_session("s", sys.argv[1])
    s.anchor_every = float(sys.argv[2])
    await s.add_items([{"role": "user", "content": "turn 0"}])
    src, out = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[3])
    src.backup(out)  # the state after the first write, as someone copying the file sees it
    src.close(), out.close()
    for i in (1, 2):
        await s.add_items([{"role": "user", "content": f"turn {i}"}])
    print("written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # never closed

asyncio.run(main())
"""


@pytest.mark.sweep
@pytest.mark.parametrize("every", [0.0, 3600.0])
def test_the_window_a_killed_session_leaves_is_its_interval(
    vault: Vault, vault_db: Path, tmp_path: Path, every: float
) -> None:
    """What SECURITY.md states: the file put back to a state the anchor was not moved
    past (a killed writer's writes within its interval) is not detected; with an
    interval of 0 every write moves the anchor, and the same rollback is."""
    add_items(vault_db, "s", [user("before")])
    copy = tmp_path / "after-first-write.db"
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_THEN_DIE, str(vault_db), str(every), str(copy)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL and "written" in proc.stdout, proc.stderr[-2000:]
    # The first write records at once; the other two only with an interval of 0.
    assert file_seq(vault_db) - anchor_seq(vault) == (0 if every == 0 else 2)
    put_back(copy, vault_db)  # two writes back, the anchor's own state when it lagged
    r = run_cli("--json", "verify")
    if every == 0:
        assert r.code == 1 and ROLLED_BACK in r.json()["details"]["history_chain"][0], r
    else:
        assert r.code == 0, r  # the window: not detected
        assert read_in_a_new_process(vault_db) == {"items": 2}


def test_a_backup_is_judged_by_its_own_state_and_restore_moves_the_anchor(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(2)])
    backup = tmp_path / "b.db"
    r = run_cli("backup", str(backup))
    assert r.code == 0, r
    add_items(vault_db, "s", [user("after the backup")])
    before_restore = anchor_seq(vault)
    # Older than the live vault's anchor, and judged by its own sealed state: no alarm.
    r = run_cli("--db", str(backup), "--json", "verify")
    assert r.code == 0 and r.json()["problems"]["history_chain"] == 0, r
    assert run_cli("--db", str(backup), "show", "s").code == 0

    # A copy of the live file (newer, or put back from anywhere) given the backup's mark
    # and seal: the seal names the state the backup was made in, not this one.
    fake = copy_of(vault_db, tmp_path / "fake.db")
    with sqlite3.connect(backup) as b, sqlite3.connect(fake) as f:
        mark = b.execute(
            "SELECT key, value FROM memvault_meta WHERE key IN "
            "('backup_of', 'backup_id', 'backed_up_at', 'backup_from', 'backup_point')"
        ).fetchall()
        assert len(mark) == 5
        f.executemany("INSERT OR REPLACE INTO memvault_meta (key, value) VALUES (?, ?)", mark)
    r = run_cli("--db", str(fake), "--json", "verify")
    assert r.code == 1, r
    assert r.json()["details"]["history_chain"] == [
        f"the vault as a whole: {ROLLED_BACK} (it is not the state this backup was made in)"
    ], r

    r = run_cli("--json", "restore", str(backup), "--yes")
    assert r.code == 0 and r.json()["anchored"] is True and r.err == "", r
    assert anchor_seq(vault) > before_restore  # moved to the restored state, past the old one
    assert anchor_seq(vault) == file_seq(vault_db)
    assert run_cli("verify").code == 0
    assert read_in_a_new_process(vault_db) == {"items": 2}
    add_items(vault_db, "s", [user("after the restore")])
    assert run_cli("verify").code == 0


def test_a_write_to_a_file_put_back_is_refused_so_the_rollback_is_never_lost(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    import vault as vault_pkg

    add_items(vault_db, "s", [user("first")])
    older = copy_of(vault_db, tmp_path / "older.db")
    for i in range(3):
        add_items(vault_db, "s", [user(f"later {i}")])
    put_back(older, vault_db)

    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db)
        try:
            for i in range(5):  # more writes than the rollback took away
                with pytest.raises(HistoryTampered) as caught:
                    await s.add_items([user(f"on the older file {i}")])
                assert caught.value.kind == ROLLED_BACK
        finally:
            s.close()

    asyncio.run(go())
    r = run_cli("--json", "verify")
    assert r.code == 1 and ROLLED_BACK in r.json()["details"]["history_chain"][0], r
    assert read_in_a_new_process(vault_db) == {"tampered": ROLLED_BACK, "session": "s"}
