"""`restore` of a transit vault's backup, on a real OpenBao server, a file vault and
(scripts/with-postgres) a PostgreSQL vault: backup, writes, rotate, restore; the
restored vault then opens through the service in a new process that holds no keyring
entry of it (no keyring at all), and `verify` passes. After a revoke deleted the
transit key, a restore exits 4 with one line naming the way back, if any."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import baoserver
from tests.baoserver import admin_transit
from tests.conftest import keyring_entries
from tests.keys.test_transit_vault_failures import ENGINES, location, one_line_exit_4
from tests.keys.test_transit_vault_lifecycle import a_host, meta_rows, ok, shown, wrapped_kids
from tests.keys.test_transit_vaults import (
    ON_POSTGRES,
    cli_at,
    host_write,
    operator_env,
    transit_vault,
)

pytestmark = baoserver.MARKS
PW = "pw-1234567\n"


def backup_then_rotate(db: str, key: str, tmp_path: Path) -> tuple[str, str, dict[str, str]]:
    """A transit vault with a backup holding "before", then a write and a rotation by a
    host: (the backup's path, the backup's key id, that host's environment)."""
    made, b = transit_vault(db, key, tmp_path, "before")
    backup = str(tmp_path / "backup.db")
    ok(cli_at(db, b, "backup", backup))
    assert host_write(db, b, "s1", "after") == ["before", "after"]
    rotated = ok(cli_at(db, b, "--json", "rotate"))
    assert rotated["old_kid"] == made["kid"] and rotated["old_key"] == "retained"
    return backup, made["kid"], b


@ENGINES
def test_a_restored_transit_vault_opens_through_the_service_in_a_new_process(
    where: str, key: str, tmp_path: Path, vault_db: Path, request: pytest.FixtureRequest
) -> None:
    db = location(where, vault_db, request)
    backup, kid, b = backup_then_rotate(db, key, tmp_path)
    later = str(tmp_path / "later.db")  # a backup under the rotated key, which stays kept
    ok(cli_at(db, b, "backup", later))
    restored = ok(cli_at(db, b, "--json", "restore", "--yes", backup))
    assert restored["restored"] is True and restored["kid"] == kid

    rows = meta_rows(db)
    assert rows["kid"] == kid and rows["key_source"] == f"transit:{key}"
    assert kid in wrapped_kids(db)
    assert keyring_entries(rows["vault_id"]) == {}  # the operator's keyring holds none
    # New processes of another host: no keyring at all, only a token.
    c = a_host(key, tmp_path)
    assert shown(db, c) == ["before"]
    assert host_write(db, c, "s1", "again") == ["before", "again"]
    checked = ok(cli_at(db, c, "--json", "verify"))
    assert checked["ok"] is True and checked["kid"] == kid, checked
    # Every version the restored vault keeps (the later backup's too) is wrapped in it,
    # so `key list` says where each is and a kit carries them all.
    versions = ok(cli_at(db, c, "--json", "key", "list"))["keys"]
    kept = {v["kid"] for v in versions if v["state"] in ("current", "retained")}
    assert len(kept) == 2 and kept <= wrapped_kids(db), versions
    assert [v for v in versions if v["state"] != "destroyed" and not v["where"]] == []
    assert shown(later, c) == ["before", "after"]
    kit = str(tmp_path / "kit.json")
    exported = ok(cli_at(db, c, "--json", "key", "export", "--passphrase-stdin", kit, input=PW))
    assert exported["kid"] == kid and exported["kids_missing"] == [], exported
    # And the restored vault rotates on such a host, as any transit vault.
    assert ok(cli_at(db, c, "--json", "rotate"))["old_kid"] == kid
    assert shown(db, a_host(key, tmp_path)) == ["before", "again"]


@ENGINES
def test_a_revoked_transit_vault_takes_no_backup_back(
    where: str, key: str, tmp_path: Path, vault_db: Path, request: pytest.FixtureRequest
) -> None:
    db = location(where, vault_db, request)
    backup, _kid, b = backup_then_rotate(db, key, tmp_path)
    revoked = ok(cli_at(db, operator_env(tmp_path), "--json", "revoke", "--yes"))
    assert revoked["transit_key"] == "deleted"
    before = meta_rows(db)
    for env in (b, operator_env(tmp_path)):
        refused = cli_at(db, env, "restore", "--yes", backup)
        one_line_exit_4(refused, "was revoked", "takes no backup back", "`memvault shred`")
    assert meta_rows(db) == before


def test_a_backup_whose_transit_key_was_deleted_restores_only_through_a_kit(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """The vault shredded (its transit key deleted with it): restoring its backup exits 4
    and names the way back, which then works: the operator makes the key again, the
    kit's keys are imported into the backup, and the restore goes through."""
    db = str(vault_db)
    backup, kid, b = backup_then_rotate(db, key, tmp_path)
    op = operator_env(tmp_path)
    kit = str(tmp_path / "kit.json")
    ok(cli_at(db, op, "key", "export", "--passphrase-stdin", kit, input=PW))
    assert ok(cli_at(db, op, "--json", "shred", "--yes"))["transit_key"] == "deleted"
    refused = cli_at(db, b, "restore", "--yes", backup)
    one_line_exit_4(refused, "does not exist", "creates the key again", "key import KIT")
    assert not vault_db.exists()

    admin_transit(key).ensure_key()
    ok(cli_at(backup, op, "key", "import", "--yes", "--passphrase-stdin", kit, input=PW))
    assert ok(cli_at(db, b, "--json", "restore", "--yes", backup))["kid"] == kid
    assert shown(db, a_host(key, tmp_path)) == ["before"]


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_POSTGRES)])
def test_a_backup_whose_version_the_postgres_vault_forgot_restores_with_its_wrapped_key(
    _: None, key: str, tmp_path: Path, pg_url: str
) -> None:
    """`key forget` dropped the backup's version from the vault; the backup holds its own
    wrapped copy, so it verifies, and the restored vault takes that copy along."""
    backup, kid, b = backup_then_rotate(pg_url, key, tmp_path)
    ok(cli_at(pg_url, b, "key", "forget", kid, "--yes"))
    assert kid not in wrapped_kids(pg_url)
    ok(cli_at(pg_url, b, "--json", "restore", "--yes", backup))
    assert kid in wrapped_kids(pg_url)
    c = a_host(key, tmp_path)
    assert shown(pg_url, c) == ["before"]
    assert ok(cli_at(pg_url, c, "--json", "verify"))["ok"] is True
