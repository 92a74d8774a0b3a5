"""A transit vault's key lifecycle on a real OpenBao server (and PostgreSQL for its
cases): a rotation stores the new version wrapped and a backup's version keeps
working; revoke deletes the transit key (or, without the right, marks the vault and
says the operator must); shred takes the wrapped keys with the rows."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests import baoserver, pgserver
from tests.baoserver import admin_transit
from tests.keys.test_transit_vault_failures import (
    ENGINES,
    key_exists,
    location,
    one_line_exit_4,
)
from tests.keys.test_transit_vaults import (
    ON_POSTGRES,
    cli_at,
    host_env,
    host_write,
    operator_env,
    transit_vault,
)
from vault.errors import KeyMissing

pytestmark = baoserver.MARKS


def meta_rows(db: str) -> dict[str, str]:
    """The meta rows; a file's read through a connection closed at once (an open one
    would make `shred` find the file in use)."""
    if db.startswith("postgresql"):
        return {
            r["key"]: r["value"] for r in pgserver.sql(db, "SELECT key, value FROM memvault_meta")
        }
    conn = sqlite3.connect(db)
    try:
        return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
    finally:
        conn.close()


def wrapped_kids(db: str) -> set[str]:
    """The key versions whose wrapped key the vault holds."""
    return {k.removeprefix("wrapped_key:") for k in meta_rows(db) if k.startswith("wrapped_key:")}


def ok(proc: Any) -> Any:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout) if proc.stdout.strip().startswith(("{", "[")) else proc.stdout


def a_host(key: str, tmp_path: Path) -> dict[str, str]:
    """Another host: no keyring, a token of its own with the host policy on `key`."""
    return host_env(tmp_path, baoserver.host_token(key))


def shown(db: str, env: dict[str, str], session: str = "s1") -> list[str]:
    doc = ok(cli_at(db, env, "--json", "show", session))
    return [i["content"] for i in doc["items"]]


def rotation_by_a_host(db: str, key: str, tmp_path: Path) -> tuple[str, str]:
    made, b = transit_vault(db, key, tmp_path, "before")
    rotated = ok(cli_at(db, b, "--json", "rotate"))
    assert rotated["old_kid"] == made["kid"] and rotated["new_kid"] != made["kid"]
    rows = meta_rows(db)
    assert rows["kid"] == rotated["new_kid"]
    assert rows["wrapped_key:" + rotated["new_kid"]].startswith("vault:v1:")
    c = a_host(key, tmp_path)
    assert host_write(db, c, "s1", "after") == ["before", "after"]
    return made["kid"], rotated["new_kid"]


def test_a_host_rotates_a_transit_file_vault_and_its_backup_still_reads(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    made, b = transit_vault(db, key, tmp_path, "before")
    backup = tmp_path / "backup.db"
    ok(cli_at(db, b, "backup", str(backup)))
    old = made["kid"]
    rotated = ok(cli_at(db, b, "--json", "rotate"))
    assert rotated["old_kid"] == old and rotated["old_key"] == "retained"
    assert wrapped_kids(db) == {old, rotated["new_kid"]}
    c = a_host(key, tmp_path)
    assert host_write(db, c, "s1", "after") == ["before", "after"]
    assert shown(str(backup), c) == ["before"]


def test_a_rotation_killed_before_its_switch_commits_leaves_no_wrapped_key(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    made, b = transit_vault(db, key, tmp_path, "before")
    killed = cli_at(db, {**b, "MEMVAULT_FAILPOINT": "after-pending"}, "rotate")
    assert killed.returncode != 0
    assert meta_rows(db)["kid"] == made["kid"]
    assert wrapped_kids(db) == {made["kid"]}
    assert shown(db, b) == ["before"]


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_POSTGRES)])
def test_a_host_rotates_a_transit_postgres_vault(
    _: None, key: str, tmp_path: Path, pg_url: str
) -> None:
    old, new = rotation_by_a_host(pg_url, key, tmp_path)
    assert wrapped_kids(pg_url) == {new}  # no backup needs the old one: destroyed


def revoke_with(db: str, env: dict[str, str]) -> Any:
    return ok(cli_at(db, env, "--json", "revoke", "--yes"))


@ENGINES
def test_revoke_by_the_operator_deletes_the_transit_key_and_every_host_stops(
    where: str, key: str, tmp_path: Path, vault_db: Path, request: pytest.FixtureRequest
) -> None:
    db = location(where, vault_db, request)
    made, b = transit_vault(db, key, tmp_path, "secret")
    wrapped = meta_rows(db)["wrapped_key:" + made["kid"]]
    r = revoke_with(db, operator_env(tmp_path))
    assert r["transit_key"] == "deleted" and "other_hosts" not in r
    assert not key_exists(key)
    with pytest.raises(KeyMissing):
        admin_transit(key).unwrap(wrapped)  # the service cannot unwrap any copy's key
    assert wrapped_kids(db) == set()
    one_line_exit_4(cli_at(db, b, "show", "s1"), "revoked")


def test_revoke_by_a_host_without_delete_rights_marks_the_vault_and_names_the_operator(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    _made, b = transit_vault(db, key, tmp_path, "secret")
    r = revoke_with(db, b)
    assert r["transit_key"] == "kept" and "operator must delete" in r["transit_key_fix"]
    assert key_exists(key)
    human = cli_at(db, b, "revoke", "--yes")
    assert human.returncode == 0 and "operator must delete" in human.stdout
    c = a_host(key, tmp_path)
    one_line_exit_4(cli_at(db, c, "show", "s1"), "revoked")
    st = ok(cli_at(db, c, "--json", "status"))
    assert st["key"].startswith("key revoked")


@ENGINES
def test_shred_of_a_transit_vault_takes_its_wrapped_keys_and_transit_key(
    where: str, key: str, tmp_path: Path, vault_db: Path, request: pytest.FixtureRequest
) -> None:
    db = location(where, vault_db, request)
    transit_vault(db, key, tmp_path, "secret")
    r = ok(cli_at(db, operator_env(tmp_path), "--json", "shred", "--yes"))
    assert r["transit_key"] == "deleted" and r["key_destroyed"] is True
    assert not key_exists(key)
    if where == "file":
        assert not vault_db.exists()
    else:
        assert pgserver.sql(db, "SELECT to_regclass('memvault_meta') IS NULL AS gone")[0]["gone"]


def test_key_list_says_each_version_is_wrapped_in_the_vault_by_its_transit_key(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    old, new = rotation_by_a_host(db, key, tmp_path)
    b = a_host(key, tmp_path)
    doc = ok(cli_at(db, b, "--json", "key", "list"))
    where = f"transit:{key} at {baoserver.ADDR} (mount transit)"
    assert doc["key_source"] == where
    by_kid = {v["kid"]: v for v in doc["keys"]}
    assert by_kid[new]["state"] == "current"
    assert by_kid[new]["where"] == where + ", wrapped in the vault"
    assert by_kid[old]["state"] == "destroyed" and by_kid[old]["where"] is None
    human = cli_at(db, b, "key", "list")
    assert human.returncode == 0 and f"keys wrapped in the vault by {where}" in human.stdout


def test_a_recovery_kit_restores_a_vault_whose_transit_key_was_lost(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """The documented way back: the operator makes the transit key again (same name),
    and `key import KIT` wraps the kit's versions with it, in the vault."""
    db = str(vault_db)
    _made, b = transit_vault(db, key, tmp_path, "precious")
    kit = tmp_path / "kit.json"
    op = operator_env(tmp_path)
    exported = cli_at(db, op, "key", "export", "--passphrase-stdin", str(kit), input="pw-1234567\n")
    assert exported.returncode == 0, exported.stderr
    admin_transit(key).delete_key()  # lost: every wrapped key is useless now
    one_line_exit_4(cli_at(db, b, "show", "s1"), "does not exist", "recovery kit")
    admin_transit(key).ensure_key()  # the operator makes the key again
    one_line_exit_4(cli_at(db, b, "show", "s1"))  # not by itself: another key
    imported = cli_at(
        db, op, "key", "import", "--yes", "--passphrase-stdin", str(kit), input="pw-1234567\n"
    )
    assert imported.returncode == 0, imported.stderr
    assert shown(db, b) == ["precious"]


def test_after_the_transit_key_rotates_a_rewrap_lets_its_minimum_rise(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    made, b = transit_vault(db, key, tmp_path, "one")
    backup = tmp_path / "backup.db"
    ok(cli_at(db, b, "backup", str(backup)))
    copy = tmp_path / "copy.db"
    copy.write_bytes(vault_db.read_bytes())  # a copy nobody rewraps
    assert admin_transit(key).rotate_key() == 2  # the operator rotates the transit key
    r = ok(cli_at(db, b, "--json", "key", "rewrap"))
    kid = made["kid"]
    assert r["rewrapped"] == [kid] and r["versions"] == {kid: 2}
    # The recorded backup holds its own copy, wrapped by version 1: not safe yet.
    assert r["safe_min_decryption_version"] == 1
    assert r["backups_holding_older_versions"] == [str(backup)]
    assert ok(cli_at(db, b, "--json", "key", "rewrap"))["rewrapped"] == []  # nothing left
    backup.unlink()  # that backup is gone: nothing needs version 1 any more
    op = operator_env(tmp_path)
    r = ok(cli_at(db, op, "--json", "key", "rewrap", "--raise-min"))
    assert r["safe_min_decryption_version"] == 2 and r["min_decryption_version"] == 2
    assert admin_transit(key).versions() == (2, 2)
    assert host_write(db, b, "s1", "two") == ["one", "two"]
    one_line_exit_4(cli_at(str(copy), b, "show", "s1"), "min_decryption_version", "rewrap")


def test_init_says_the_key_is_wrapped_in_the_vault_by_the_transit_key(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    made = cli_at(str(vault_db), operator_env(tmp_path), "init", "--key-source", f"transit:{key}")
    assert made.returncode == 0, made.stderr
    assert f"wrapped in the vault by transit:{key} at {baoserver.ADDR}" in made.stdout
    assert "losing the transit key loses the history" in made.stdout
    st = cli_at(str(vault_db), operator_env(tmp_path), "status")
    assert f"key source transit:{key} (mount transit)" in st.stdout


def test_init_killed_after_making_its_transit_key_leaves_it_to_the_next_init(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    env = {**operator_env(tmp_path), "MEMVAULT_FAILPOINT": "init-key-stored"}
    killed = cli_at(db, env, "init", "--key-source", f"transit:{key}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not vault_db.exists()
    # A killed process deletes nothing: the key it made stays, unused by any vault.
    assert key_exists(key)
    made, b = transit_vault(db, key, tmp_path, "after the kill")
    assert made["key_source"] == f"transit:{key} (mount transit)"
    assert admin_transit(key).versions() == (1, 1)  # the same key, not a second version
    # The killed init's temporary file is reclaimed by the second init.
    assert sorted(p.name for p in vault_db.parent.iterdir()) == [vault_db.name]
    assert shown(db, b) == ["after the kill"]
