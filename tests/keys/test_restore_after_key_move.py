"""`restore` of a backup made before a `key move` (keyring to transit, or back), on a real
OpenBao server, a file vault and (scripts/with-postgres) a PostgreSQL vault: the backup,
the move, writes and a rotation, then the restore. Either the restored vault opens in a
new process through a source that holds its key and `verify` passes, or the restore is
refused with one line and the vault is as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import baoserver
from tests.keys.test_key_move import WHERE, keyring_write
from tests.keys.test_transit_vault_failures import closed_port_addr, one_line_exit_4, snapshot
from tests.keys.test_transit_vault_lifecycle import a_host, meta_rows, ok, shown, wrapped_kids
from tests.keys.test_transit_vault_restore import PW
from tests.keys.test_transit_vaults import ON_POSTGRES, cli_at, operator_env

pytestmark = baoserver.MARKS


@pytest.fixture
def db(request: pytest.FixtureRequest, vault_db: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return str(vault_db)


def a_vault(db: str, source: str, tmp_path: Path) -> dict[str, str]:
    """A vault holding "before" in session s1, its key in `source`: the operator's env."""
    op = operator_env(tmp_path)
    ok(cli_at(db, op, "--json", "init", "--key-source", source))
    assert keyring_write(db, op, "s1", "before") == ["before"]
    return op


@pytest.mark.parametrize("db", WHERE, indirect=True)
@pytest.mark.parametrize("direction", ["to-transit", "to-keyring"])
def test_a_backup_from_before_a_key_move_restores_and_opens_in_a_new_process(
    db: str, direction: str, key: str, tmp_path: Path
) -> None:
    first, then = ("keyring", f"transit:{key}")
    if direction == "to-keyring":
        first, then = then, first
    op = a_vault(db, first, tmp_path)
    backup = str(tmp_path / "backup.db")
    ok(cli_at(db, op, "backup", backup))
    ok(cli_at(db, op, "--json", "key", "move", then))
    assert keyring_write(db, op, "s1", "after") == ["before", "after"]
    ok(cli_at(db, op, "--json", "rotate"))
    restored = ok(cli_at(db, op, "--json", "restore", "--yes", backup))
    assert restored["restored"] is True
    # A file takes the backup's source with its meta; a PostgreSQL vault keeps its own.
    now = then if db.startswith("postgresql") else first
    assert meta_rows(db).get("key_source", "keyring") == now
    # A new process that can reach only that source reads the restored vault, and
    # `verify` authenticates every item.
    only = a_host(key, tmp_path) if now != "keyring" else {**op, "VAULT_ADDR": closed_port_addr()}
    assert shown(db, only) == ["before"]
    checked = ok(cli_at(db, only, "--json", "verify"))
    assert checked["ok"] is True and checked["kid"] == restored["kid"], checked
    assert keyring_write(db, op, "s1", "again") == ["before", "again"]


@pytest.mark.parametrize("db", [pytest.param("postgres", marks=ON_POSTGRES)], indirect=True)
def test_a_postgres_restore_whose_key_the_moved_vault_lacks_is_refused(
    db: str, key: str, tmp_path: Path
) -> None:
    """The backup's version forgotten, then the vault moved to the keyring: the backup
    still verifies through its own wrapped copy, but the vault's new source has no key
    for it, so the restore is refused before anything changes, naming the way back."""
    op = a_vault(db, f"transit:{key}", tmp_path)
    backup = str(tmp_path / "backup.db")
    ok(cli_at(db, op, "backup", backup))
    old = ok(cli_at(db, op, "--json", "rotate"))["old_kid"]
    ok(cli_at(db, op, "key", "forget", old, "--yes"))
    ok(cli_at(db, op, "--json", "key", "move", "keyring"))
    assert keyring_write(db, op, "s1", "after") == ["before", "after"]
    before = snapshot(db)
    refused = cli_at(db, op, "restore", "--yes", backup)
    one_line_exit_4(refused, old, "keyring", f"key move transit:{key}")
    assert snapshot(db) == before
    assert shown(db, op) == ["before", "after"]
    # The way back the line names works: move to the backup's source, restore.
    ok(cli_at(db, op, "--json", "key", "move", f"transit:{key}"))
    assert ok(cli_at(db, op, "--json", "restore", "--yes", backup))["kid"] == old
    assert shown(db, op) == ["before"]
    assert ok(cli_at(db, op, "--json", "verify"))["ok"] is True


def test_a_keyring_era_backup_restored_after_a_move_names_the_versions_only_the_service_held(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """A file vault moved to transit and rotated there, a backup taken under the new
    version, then a backup from its keyring days restored: the file is the backup's,
    under the keyring again. The later backup keeps the transit-era version retained,
    but only the replaced file and that backup held it (wrapped): `key list` says that
    no place of this vault holds it, and `key export` names it as missing rather than
    failing or writing a kit that pretends to be whole. The later backup still opens
    through the service."""
    db = str(vault_db)
    op = a_vault(db, "keyring", tmp_path)
    backup = str(tmp_path / "backup.db")
    ok(cli_at(db, op, "backup", backup))
    ok(cli_at(db, op, "--json", "key", "move", f"transit:{key}"))
    rotated = ok(cli_at(db, op, "--json", "rotate"))
    transit_only = rotated["new_kid"]
    assert keyring_write(db, op, "s1", "after") == ["before", "after"]
    later = str(tmp_path / "later.db")
    ok(cli_at(db, op, "backup", later))
    restored = ok(cli_at(db, op, "--json", "restore", "--yes", backup))
    assert restored["kid"] == rotated["old_kid"]
    assert meta_rows(db).get("key_source", "keyring") == "keyring"
    assert transit_only not in wrapped_kids(db)

    versions = {v["kid"]: v for v in ok(cli_at(db, op, "--json", "key", "list"))["keys"]}
    assert versions[restored["kid"]]["state"] == "current"
    assert versions[restored["kid"]]["where"] == "keyring"
    assert versions[transit_only]["state"] == "retained", versions
    assert not versions[transit_only]["where"], versions[transit_only]
    kit = str(tmp_path / "kit.json")
    exported = ok(cli_at(db, op, "--json", "key", "export", "--passphrase-stdin", kit, input=PW))
    assert exported["kids"] == [restored["kid"]]
    assert exported["kids_missing"] == [transit_only], exported
    assert shown(db, op) == ["before"]
    assert ok(cli_at(db, op, "--json", "verify"))["ok"] is True
    assert shown(later, a_host(key, tmp_path)) == ["before", "after"]
