"""A vault made by memvault 0.1.0 (its file and its keyring entries) still reads.

The fixtures in tests/fixtures/v0_1_0 were written once by the 0.1.0 code (see its
README.md): a settled vault, and one whose rotation was killed after its commit.
Each test puts that vault's keyring entries into the private keyring, copies the
file, and reads every item back through the CLI. The first open that has the key
moves the vault to one entry per key version (docs/keys.md): those tests kill
it at each step of the move and check that the vault still opens, and that
afterwards exactly the new entry exists.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.conftest import authenticated_counts, key_entries, keyring_entries, run_cli
from vault import crypto
from vault.engines.sqlite.schema import FILE_FORMAT
from vault.keyjournal import entry_name
from vault.keys import KeyStore
from vault.verify import expected_triggers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "v0_1_0"


def vault_id_of(entries: dict[str, str]) -> str:
    return min(entries, key=len)  # `<vault_id>`, beside `<vault_id>.next`


class OldVault(NamedTuple):
    db: Path  # a copy of the fixture's history.db
    expected: Any  # {session_id: [items]}
    vault_id: str
    key: str  # the key of the kid the file names


@pytest.fixture
def old_vault(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OldVault]:
    """A copy of one 0.1.0 fixture, its keyring entries loaded (and removed afterwards)."""
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
    key = next(k for k in entries.values() if crypto.key_id(k) == meta_of(copy)["kid"])
    try:
        yield OldVault(copy, expected, vault_id_of(entries), key)
    finally:
        for name in keyring_entries(vault_id_of(entries)):
            ks.delete(name)


LAYOUTS = ["", "mid_rotation"]


@pytest.mark.parametrize("old_vault", LAYOUTS, indirect=True, ids=["settled", "mid_rotation"])
@pytest.mark.slow
def test_a_0_1_0_vault_reads_every_item(old_vault: OldVault) -> None:
    db, expected = old_vault.db, old_vault.expected
    total = sum(len(items) for items in expected.values())
    assert total > 0

    r = run_cli("--db", str(db), "--json", "status")
    assert r.code == 0, r
    st = r.json()
    assert st["key"] == "present and matching", st
    assert (st["sessions"], st["items"], st["expired_unverified"]) == (len(expected), total, 0)

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
            assert line.startswith(f"#{i} "), r


def meta_of(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())


def assert_moved(db: Path, vault_id: str, key: str) -> None:
    """The 0.1.0 names are gone; the file's key is under its own version's name."""
    meta = meta_of(db)
    assert meta["format"] == FILE_FORMAT and "legacy_entries" not in meta, meta
    assert crypto.key_id(key) == meta["kid"]
    assert key_entries(vault_id) == {entry_name(vault_id, meta["kid"]): key}


@pytest.mark.parametrize("old_vault", LAYOUTS, indirect=True, ids=["settled", "mid_rotation"])
def test_the_first_open_moves_the_key_to_its_version_entry(old_vault: OldVault) -> None:
    db, expected, vault_id, key = old_vault
    assert meta_of(db)["format"] == "memvault/1"

    r = run_cli("--db", str(db), "--json", "key", "list")
    assert r.code == 0, r
    assert_moved(db, vault_id, key)
    listed = {k["kid"]: k for k in r.json()["keys"]}
    assert listed[meta_of(db)["kid"]]["state"] == "current"
    assert listed[meta_of(db)["kid"]]["in_keyring"] is True
    others = [k for kid, k in listed.items() if kid != meta_of(db)["kid"]]
    assert all(k["state"] == "destroyed" and not k["in_keyring"] for k in others), listed
    # The whole history still reads after the move.
    for session_id, items in expected.items():
        r = run_cli("--db", str(db), "--json", "show", session_id)
        assert r.code == 0 and r.json()["items"] == items, r


MOVE_STEPS = ["upgrade-after-store", "upgrade-after-commit", "tidy-after-delete"]


@pytest.mark.slow
@pytest.mark.parametrize("point", MOVE_STEPS)
@pytest.mark.parametrize("old_vault", LAYOUTS, indirect=True, ids=["settled", "mid_rotation"])
def test_a_move_killed_at_any_step_leaves_a_vault_that_opens(
    old_vault: OldVault, point: str
) -> None:
    db, expected, vault_id, key = old_vault

    r = run_cli("--db", str(db), "status", env={"MEMVAULT_FAILPOINT": point})
    assert r.code == -signal.SIGKILL, r

    total = sum(len(items) for items in expected.values())
    r = run_cli("--db", str(db), "--json", "status")
    assert r.code == 0, r
    st = r.json()
    assert (st["key"], st["items"]) == ("present and matching", total), st
    assert authenticated_counts(db) == (total, 0, 0)
    assert_moved(db, vault_id, key)


@pytest.mark.parametrize("old_vault", [""], indirect=True, ids=["settled"])
def test_a_dead_rotations_pending_key_goes_with_the_move(old_vault: OldVault) -> None:
    """0.1.0 left `.next` behind when a rotation died before its commit: no row uses it."""
    db, _, vault_id, key = old_vault
    KeyStore().set(vault_id + ".next", crypto.generate_key())
    assert len(key_entries(vault_id)) == 2

    r = run_cli("--db", str(db), "--json", "status")
    assert r.code == 0 and r.json()["key"] == "present and matching", r
    assert_moved(db, vault_id, key)


def triggers_of(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"))


@pytest.mark.parametrize("old_vault", [""], indirect=True, ids=["settled"])
def test_an_upgraded_vault_gets_m008s_guard_and_verifies(old_vault: OldVault) -> None:
    db = old_vault.db
    old_guard = triggers_of(db)
    assert sorted(old_guard) == ["memvault_guard_insert", "memvault_guard_update"]
    # Verify, the first command, finds the key under its 0.1.0 name: moving it
    # migrates the file, and the vault then verifies with m008's guard.
    r = run_cli("--db", str(db), "--json", "verify")
    assert r.code == 0 and r.json()["ok"] is True, r
    new_guard = triggers_of(db)
    assert new_guard.keys() == old_guard.keys()
    assert all(new_guard[name] != old_guard[name] for name in new_guard), new_guard
    assert new_guard == expected_triggers()  # as a new vault has them
    r = run_cli("--db", str(db), "--json", "verify")
    assert r.code == 0 and r.json()["ok"] is True, r
    # The new guard holds: a bare envelope under another key is refused.
    with contextlib.closing(sqlite3.connect(db)) as conn, pytest.raises(sqlite3.IntegrityError):
        conn.execute(
            "UPDATE agent_messages SET message_data = json_set(message_data, '$.kid', 'x')"
        )
