"""One keyring entry per key version: copies of a vault coexist in one keyring.

Every test here uses the real private Secret Service and the `memvault`
command in subprocesses, as a person would; `keyring_entries` lists what the
keyring really holds (the `keyring` API itself cannot list).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    add_items,
    assistant,
    authenticated_counts,
    key_entries,
    keyring_entries,
    run_cli,
    user,
)
from tests.keys.test_kit import copy_vault, export, import_
from vault import crypto


def status(db: Path) -> Any:
    r = run_cli("--db", str(db), "--json", "status")
    assert r.code == 0, r
    return r.json()


def live_and_backup(vault: Any, vault_db: Path, tmp_path: Path) -> tuple[Path, str, str]:
    """A live vault rotated once after a backup copy and a kit were taken.

    Returns (backup path, the backup's kid, the live vault's kid).
    """
    add_items(vault_db, "s", [user("NORD-42"), assistant("noted")])
    kit = tmp_path / "old-kit.json"
    assert export(kit).code == 0
    backup = tmp_path / "backup" / "history.db"
    copy_vault(vault_db, backup)
    old_kid = status(vault_db)["kid"]
    r = run_cli("rotate")
    assert r.code == 0, r
    new_kid = status(vault_db)["kid"]
    assert new_kid != old_kid
    # The backup needs its own (old) key back: the rotation destroyed it.
    r = run_cli("--db", str(backup), "show", "s")
    assert r.code == 4, r
    r = import_(kit, "--db", str(backup), extra="y\n")
    assert r.code == 0, r
    return backup, old_kid, new_kid


@pytest.mark.slow
def test_an_old_kit_restored_into_a_backup_leaves_the_live_vault_working(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    backup, old_kid, new_kid = live_and_backup(vault, vault_db, tmp_path)
    live, copy = status(vault_db), status(backup)
    assert (live["kid"], live["key"], live["items"]) == (new_kid, "present and matching", 2)
    assert (copy["kid"], copy["key"], copy["items"]) == (old_kid, "present and matching", 2)
    assert authenticated_counts(vault_db) == authenticated_counts(backup) == (2, 0, 0)
    r = run_cli("--json", "show", "s")
    assert r.code == 0 and [i["content"] for i in r.json()["items"]] == ["NORD-42", "noted"], r
    # One entry per key version, each holding the key its name says.
    entries = key_entries(vault.vault_id)
    assert sorted(entries) == sorted(f"{vault.vault_id}/{k}" for k in (old_kid, new_kid))
    for name, key in entries.items():
        assert crypto.key_id(key) == name.rsplit("/", 1)[1]


@pytest.mark.slow
def test_shred_destroys_the_keys_of_every_copy_it_knows(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    vault_id = vault.vault_id
    backup, old_kid, new_kid = live_and_backup(vault, vault_db, tmp_path)
    r = run_cli("--json", "shred", "--yes")
    assert r.code == 0, r
    report = r.json()
    assert sorted(report["destroyed_kids"]) == sorted([old_kid, new_kid]), report
    assert report["other_copies_kids"] == [old_kid], report
    assert keyring_entries(vault_id) == {}
    # Cryptographic erase: the backup, whose key was the live vault's before, is dead too.
    r = run_cli("--db", str(backup), "show", "s")
    assert r.code == 4, r
    assert "NORD-42" not in r.out + r.err


@pytest.mark.slow
def test_revoke_destroys_every_recorded_key_version(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    backup, old_kid, new_kid = live_and_backup(vault, vault_db, tmp_path)
    r = run_cli("--json", "revoke", "--yes")
    assert r.code == 0, r
    assert sorted(r.json()["destroyed_kids"]) == sorted([old_kid, new_kid]), r
    assert keyring_entries(vault.vault_id) == {}
    for db in (vault_db, backup):
        r = run_cli("--db", str(db), "show", "s")
        assert r.code == 4 and "NORD-42" not in r.out, r


@pytest.mark.slow
def test_any_number_of_rotations_leave_one_entry(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one")])
    for _ in range(3):
        r = run_cli("rotate")
        assert r.code == 0, r
    kid = status(vault_db)["kid"]
    assert list(key_entries(vault.vault_id)) == [f"{vault.vault_id}/{kid}"]


@pytest.mark.slow
def test_key_list_shows_each_version_its_state_and_entry_never_a_key(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    first_key = vault.sealer().master_key
    backup, old_kid, new_kid = live_and_backup(vault, vault_db, tmp_path)

    r = run_cli("--json", "key", "list")
    assert r.code == 0, r
    doc = r.json()
    assert doc["vault_id"] == vault.vault_id
    got = [(k["kid"], k["state"], k["in_keyring"]) for k in doc["keys"]]
    # The old version is destroyed for this file, yet its entry is back: the backup's.
    assert got == [(old_kid, "destroyed", True), (new_kid, "current", True)], got
    assert all(k["created_at"] for k in doc["keys"])

    human = run_cli("key", "list")
    assert human.code == 0, human
    lines = human.out.splitlines()
    assert lines[0].split() == ["key", "id", "state", "in", "keyring", "created"]
    assert lines[1].split()[:3] == [old_kid, "destroyed", "yes"], human
    assert lines[2].split()[:3] == [new_kid, "current", "yes"], human
    live_key = keyring_entries(vault.vault_id)[f"{vault.vault_id}/{new_kid}"]
    for key in (first_key, live_key):
        assert key not in r.out + human.out + r.err + human.err

    # The backup knows only its own key.
    r = run_cli("--db", str(backup), "--json", "key", "list")
    assert [(k["kid"], k["state"]) for k in r.json()["keys"]] == [(old_kid, "current")], r


def test_key_list_on_a_revoked_vault_shows_every_version_destroyed(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("x")])
    assert run_cli("rotate").code == 0
    assert run_cli("revoke", "--yes").code == 0
    r = run_cli("--json", "key", "list")
    assert r.code == 0, r
    keys = r.json()["keys"]
    assert len(keys) == 2, keys
    assert all(k["state"] == "destroyed" and not k["in_keyring"] for k in keys), keys


def test_a_rotation_killed_before_its_commit_leaves_its_key_for_the_next_open_to_drop(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("x")])
    kid = status(vault_db)["kid"]
    r = run_cli("rotate", env={"MEMVAULT_FAILPOINT": "after-pending"})
    assert r.code == -9, r
    assert len(key_entries(vault.vault_id)) == 2  # the staged key's entry is there
    r = run_cli("--json", "key", "list")
    assert r.code == 0, r
    states = {k["kid"]: (k["state"], k["in_keyring"]) for k in r.json()["keys"]}
    assert states.pop(kid) == ("current", True)
    assert list(states.values()) == [("destroyed", False)], states
    assert list(key_entries(vault.vault_id)) == [f"{vault.vault_id}/{kid}"]
