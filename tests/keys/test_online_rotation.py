"""The online rotation of a vault file: rows under two keys are an ordinary state.

A rotation switches keys in one short transaction, then moves the rows in batches
(vault.rotation). These tests stop one amid its batches, in this process, and name
another host as its owner, which no command takes over (only `rotate` joins it):
the state a rotation still running elsewhere, or cut off there, leaves. Everything
is read with both keys, writers use the new key, a kit carries both, a backup
finishes the rotation first, and `rotate` ends it. Real keyring, real files, the
CLI as a real subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import vault as vault_pkg
from tests.cli.test_ctrl_c import interrupt, rotate_until_paused
from tests.conftest import add_items, key_entries, keyring_entries, rows, run_cli, user
from tests.crashkit import start_writer, writer_items
from tests.keys.test_kit import PASS
from vault import rotation, testhooks
from vault.keyjournal import entry_name

SESSIONS = {"s1": [user(f"one {i}") for i in range(12)], "s2": [user(f"two {i}") for i in range(9)]}


class Stop(BaseException):
    """Raised by the failpoint: the rotation stops there, as if its process died."""


def kids(db: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for data in rows(db):
        kid = json.loads(data)["kid"]
        out[kid] = out.get(kid, 0) + 1
    return out


def meta(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())


def stop_amid_batches(v: Any, db: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Fill the vault, rotate in batches of 5 and stop after the first; the rotation's
    owner is then another host. Returns (old kid, new kid)."""
    for sid, items in SESSIONS.items():
        add_items(db, sid, items)
    old = v.meta()["kid"]
    monkeypatch.setattr(rotation, "DEFAULT_BATCH", 5)

    def stop(name: str) -> None:
        if name == "after-batch":
            raise Stop(name)

    real = testhooks.failpoint
    monkeypatch.setattr(testhooks, "failpoint", stop)
    with pytest.raises(Stop):
        v.rotate()
    monkeypatch.setattr(testhooks, "failpoint", real)
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute(
            "UPDATE memvault_meta SET value = 'another-host 1' WHERE key = 'rotation_owner'"
        )
    m = meta(db)
    assert m["rotating_from"] == old and m["kid"] != old
    assert kids(db) == {m["kid"]: 5, old: 16}  # rows under both keys
    return old, m["kid"]


def test_rows_under_both_keys_read_whole_and_new_writes_use_the_new_key(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = stop_amid_batches(vault, vault_db, monkeypatch)

    for sid, items in SESSIONS.items():
        r = run_cli("--json", "show", sid)
        assert r.code == 0, r
        assert [i for i in r.json()["items"]] == items, r
        session = vault_pkg.open_session(sid, vault_db)
        try:
            assert asyncio.run(session.get_items()) == items
        finally:
            session.close()
    st = run_cli("--json", "status")
    assert st.code == 0 and st.json()["key"] == "present and matching", st
    assert st.json()["kid"] == new
    assert run_cli("verify").code == 0

    add_items(vault_db, "s1", [user("written meanwhile")])
    assert kids(vault_db) == {new: 6, old: 16}
    assert meta(vault_db)["rotating_from"] == old  # another host's: left to `rotate`

    r = run_cli("--json", "rotate")
    assert r.code == 0, r
    assert r.json()["resumed"] is True and r.json()["new_kid"] == new, r
    assert kids(vault_db) == {new: 22}
    assert "rotating_from" not in meta(vault_db)
    assert list(key_entries(vault.vault_id)) == [entry_name(vault.vault_id, new)]
    shown = run_cli("--json", "show", "s1").json()["items"]
    assert [i for i in shown] == [*SESSIONS["s1"], user("written meanwhile")]


def test_a_kit_exported_amid_the_batches_holds_both_keys_and_opens_a_copy_elsewhere(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    old, new = stop_amid_batches(vault, vault_db, monkeypatch)
    kit = tmp_path / "kit.json"
    r = run_cli("--json", "key", "export", "--passphrase-stdin", str(kit), input=PASS + "\n")
    assert r.code == 0, r
    assert sorted(r.json()["kids"]) == sorted([old, new]), r

    # Another machine: the same file, an empty keyring, the kit imported.
    for name in keyring_entries(vault.vault_id):
        vault.keystore.delete(name)
    assert run_cli("show", "s1").code == 4
    r = run_cli("--json", "key", "import", "--passphrase-stdin", str(kit), input=PASS + "\n")
    assert r.code == 0, r
    assert [i for i in run_cli("--json", "show", "s2").json()["items"]] == SESSIONS["s2"]
    r = run_cli("rotate")
    assert r.code == 0 and "finished a rotation already under way" in r.out, r
    assert set(kids(vault_db)) == {new} == {meta(vault_db)["kid"]}


def test_a_backup_amid_the_batches_finishes_the_rotation_and_copies_one_key(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    old, new = stop_amid_batches(vault, vault_db, monkeypatch)
    dest = tmp_path / "copies" / "backup.db"
    dest.parent.mkdir()
    r = run_cli("--json", "backup", str(dest))
    assert r.code == 0, r
    assert r.json()["kid"] == new, r
    assert "rotating_from" not in meta(vault_db)
    assert kids(vault_db) == {new: 21}
    assert kids(dest) == {new: 21} and "rotating_from" not in meta(dest)
    assert list(key_entries(vault.vault_id)) == [entry_name(vault.vault_id, new)]
    shown = run_cli("--db", str(dest), "--json", "show", "s1")
    assert [i for i in shown.json()["items"]] == SESSIONS["s1"], shown


@pytest.mark.slow
def test_a_writer_in_another_process_gets_the_lock_between_batches(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rotator stands still between two batches; a writer that waits at most 1 s
    for the lock still writes: the rotation does not hold the lock there."""
    for sid, items in SESSIONS.items():
        add_items(vault_db, sid, items)
    old = vault.meta()["kid"]
    proc = rotate_until_paused("after-batch")
    try:
        monkeypatch.setenv("MEMVAULT_LOCK_TIMEOUT", "1")
        writer = start_writer(vault_db, "agent", 0, 3, 20)
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err[-2000:]
        assert out.count("ack ") == 3
    finally:
        code, err = interrupt(proc)
    assert code == 130, err
    new = meta(vault_db)["kid"]
    assert new != old
    monkeypatch.delenv("MEMVAULT_LOCK_TIMEOUT")
    # The rotator is gone: the next command finishes its rotation.
    r = run_cli("--json", "show", "agent")
    assert [i for i in r.json()["items"]] == writer_items("agent", 0, 3, 20), r
    assert kids(vault_db) == {new: 24}
    assert "rotating_from" not in meta(vault_db)
