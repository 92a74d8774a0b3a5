"""`memvault key move`: a vault's keys from the keyring to a transit key and back, on a
real OpenBao server, a file vault and (scripts/with-postgres) a PostgreSQL vault. Each
read after a move is a new process: `show`, and `vault.open_session` writing and reading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import baoserver
from tests.conftest import MEMORY_BACKEND, ROOT, key_entries, keyring_entries
from tests.keys.test_transit_vault_failures import closed_port_addr, key_exists
from tests.keys.test_transit_vault_lifecycle import meta_rows, ok, shown
from tests.keys.test_transit_vaults import (
    HOST_WRITES,
    ON_POSTGRES,
    cli_at,
    host_env,
    host_write,
    operator_env,
)
from vault.errors import VaultBusy

pytestmark = baoserver.MARKS
WHERE = ["file", pytest.param("postgres", marks=ON_POSTGRES)]
SOURCE_ROWS = ("key_source", "transit_mount", "wrapped_key:")


@pytest.fixture
def db(request: pytest.FixtureRequest, vault_db: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return str(vault_db)


def keyring_write(db: str, env: dict[str, str], session: str, text: str) -> list[str]:
    """One write and a read of the session through `vault.open_session`, in a new process
    that may load the keyring."""
    proc = subprocess.run(
        [sys.executable, "-c", HOST_WRITES, db, session, text, "any"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def source_rows(db: str) -> dict[str, str]:
    return {k: v for k, v in meta_rows(db).items() if k.startswith(SOURCE_ROWS)}


def init_keyring(db: str, tmp_path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    op = operator_env(tmp_path)
    made = ok(cli_at(db, op, "--json", "init"))
    assert keyring_write(db, op, "s1", "one") == ["one"]
    return op, made


@pytest.mark.parametrize("db", WHERE, indirect=True)
def test_a_vault_moves_from_the_keyring_to_transit_and_back(
    db: str, key: str, tmp_path: Path
) -> None:
    op, made = init_keyring(db, tmp_path)
    vault_id, kid = made["vault_id"], made["kid"]
    assert set(key_entries(vault_id)) == {f"{vault_id}/{kid}"}

    there = ok(cli_at(db, op, "--json", "key", "move", f"transit:{key}"))
    assert there["moved"] == [kid] and there["removed_from_keyring"] == [kid], there
    assert keyring_entries(vault_id) == {}
    rows = source_rows(db)
    assert rows["key_source"] == f"transit:{key}" and rows["transit_mount"] == "transit"
    assert rows["wrapped_key:" + kid].startswith("vault:v1:")
    # A host with no keyring at all, holding only a token, reads and writes.
    b = host_env(tmp_path, baoserver.host_token(key))
    assert host_write(db, b, "s1", "two") == ["one", "two"]
    assert shown(db, b) == ["one", "two"]

    back = ok(cli_at(db, op, "--json", "key", "move", "keyring"))
    assert back["moved"] == [kid] and back["from"] == f"transit:{key}", back
    assert source_rows(db) == {}
    assert set(key_entries(vault_id)) == {f"{vault_id}/{kid}"}
    if not db.startswith("postgresql"):  # a chained vault file's anchor is back too
        assert f"{vault_id}/anchor" in keyring_entries(vault_id)
    # The key service down no longer matters.
    down = {**op, "VAULT_ADDR": closed_port_addr()}
    assert keyring_write(db, down, "s1", "three") == ["one", "two", "three"]
    assert shown(db, down) == ["one", "two", "three"]
    st = ok(cli_at(db, down, "--json", "status"))
    assert st["key_source"] == "keyring" and st["key"] == "present and matching"
    events = [e["event"] for e in ok(cli_at(db, down, "--json", "log"))]
    assert events.count("key-move") == 2
    ok(cli_at(db, op, "shred", "--yes"))


def test_a_move_takes_the_retained_version_a_backup_needs(key: str, tmp_path: Path) -> None:
    db = str(tmp_path / "vault" / "history.db")
    op, made = init_keyring(db, tmp_path)
    backup = str(tmp_path / "backup.db")
    ok(cli_at(db, op, "backup", backup))
    new = ok(cli_at(db, op, "--json", "rotate"))["new_kid"]
    old = made["kid"]

    there = ok(cli_at(db, op, "--json", "key", "move", f"transit:{key}"))
    assert there["moved"] == sorted([old, new]), there
    # The backup is a keyring copy: its version stays in this keyring, and it reads.
    assert there["kept_in_keyring"] == [old] and there["removed_from_keyring"] == [new]
    assert set(source_rows(db)) >= {"wrapped_key:" + old, "wrapped_key:" + new}
    assert shown(backup, op) == ["one"]
    b = host_env(tmp_path, baoserver.host_token(key))
    assert host_write(db, b, "s1", "two") == ["one", "two"]
    versions = {v["kid"]: v["state"] for v in ok(cli_at(db, b, "--json", "key", "list"))["keys"]}
    assert versions == {old: "retained", new: "current"}

    back = ok(cli_at(db, op, "--json", "key", "move", "keyring"))
    assert back["moved"] == sorted([old, new])
    down = {**op, "VAULT_ADDR": closed_port_addr()}
    assert shown(db, down) == ["one", "two"] and shown(backup, down) == ["one"]
    ok(cli_at(db, op, "shred", "--yes"))


@pytest.mark.parametrize("command", ["revoke", "shred"])
def test_revoke_and_shred_after_a_move_destroy_the_keyring_entry_kept_for_a_backup(
    command: str, key: str, tmp_path: Path
) -> None:
    db = str(tmp_path / "vault" / "history.db")
    op, made = init_keyring(db, tmp_path)
    backup = str(tmp_path / "backup.db")
    ok(cli_at(db, op, "backup", backup))
    ok(cli_at(db, op, "--json", "rotate"))
    there = ok(cli_at(db, op, "--json", "key", "move", f"transit:{key}"))
    assert there["kept_in_keyring"] == [made["kid"]], there
    assert shown(backup, op) == ["one"]  # the backup reads through this keyring

    done = ok(cli_at(db, op, "--json", command, "--yes"))
    assert made["kid"] in done["destroyed_kids"], done
    # Nothing of the vault is left in this keyring, and the backup no longer opens.
    assert keyring_entries(made["vault_id"]) == {}
    refused = cli_at(backup, op, "show", "s1")
    assert refused.returncode == 4, refused.stderr
    assert not key_exists(key)


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_POSTGRES)])
def test_a_move_takes_the_key_an_unfinished_rotation_moves_rows_from(
    _: None, key: str, tmp_path: Path, pg_url: str
) -> None:
    op, made = init_keyring(pg_url, tmp_path)
    cut = cli_at(pg_url, {**op, "MEMVAULT_FAILPOINT": "pg-rotate-after-switch"}, "rotate")
    assert cut.returncode == -9, cut.stderr
    meta = meta_rows(pg_url)
    assert meta["rotating_from"] == made["kid"] != meta["kid"]

    there = ok(cli_at(pg_url, op, "--json", "key", "move", f"transit:{key}"))
    assert there["moved"] == sorted([made["kid"], meta["kid"]]), there
    b = host_env(tmp_path, baoserver.host_token(key))
    assert shown(pg_url, b) == ["one"]
    ok(cli_at(pg_url, b, "rotate"))  # the host with no keyring finishes the rotation
    assert host_write(pg_url, b, "s1", "two") == ["one", "two"]


@pytest.mark.parametrize("db", WHERE, indirect=True)
def test_key_move_refuses_a_revoked_vault_or_a_service_down_and_changes_nothing(
    db: str, key: str, tmp_path: Path
) -> None:
    op, made = init_keyring(db, tmp_path)
    before = meta_rows(db), keyring_entries(made["vault_id"])
    down = {**op, "VAULT_ADDR": closed_port_addr()}
    one_line(cli_at(db, down, "key", "move", f"transit:{key}"), 4, "cannot reach")
    assert (meta_rows(db), keyring_entries(made["vault_id"])) == before
    ok(cli_at(db, op, "revoke", "--yes"))
    revoked = meta_rows(db)
    one_line(cli_at(db, op, "key", "move", f"transit:{key}"), 4, "revoked")
    assert meta_rows(db) == revoked
    assert not key_exists(key)  # no transit key made for a revoked vault


def test_key_move_refuses_a_backup_file(key: str, tmp_path: Path) -> None:
    db = str(tmp_path / "vault" / "history.db")
    op, _made = init_keyring(db, tmp_path)
    backup = str(tmp_path / "backup.db")
    ok(cli_at(db, op, "backup", backup))
    before = meta_rows(backup)
    one_line(cli_at(backup, op, "key", "move", f"transit:{key}"), 1, "is a backup")
    assert meta_rows(backup) == before
    ok(cli_at(db, op, "shred", "--yes"))


def one_line(proc: Any, code: int, says: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert says in lines[0], lines[0]


def test_a_rotation_that_began_before_a_move_does_not_switch_into_the_old_source(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vault import testhooks
    from vault.engines.sqlite.vault import Vault

    db = str(tmp_path / "vault" / "history.db")
    op, _made = init_keyring(db, tmp_path)
    moved = []

    def move_now(name: str) -> None:
        if name == "after-record-pending" and not moved:
            moved.append(ok(cli_at(db, op, "--json", "key", "move", f"transit:{key}")))

    monkeypatch.setattr(testhooks, "failpoint", move_now)
    with pytest.raises(VaultBusy, match="moved to another key source"):
        Vault.open(db).rotate()
    assert moved and meta_rows(db)["key_source"] == f"transit:{key}"
    b = host_env(tmp_path, baoserver.host_token(key))
    assert shown(db, b) == ["one"]
    ok(cli_at(db, b, "rotate"))  # a host with no keyring rotates the moved vault
    assert host_write(db, b, "s1", "two") == ["one", "two"]
    ok(cli_at(db, op, "shred", "--yes"))


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_POSTGRES)])
def test_a_move_while_a_rotation_has_a_new_version_staged_waits_for_it(
    _: None, key: str, tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vault import testhooks
    from vault.engines.postgres.vault import PgVault

    op, _made = init_keyring(pg_url, tmp_path)
    tried = []

    def move_now(name: str) -> None:
        if name == "pg-rotate-after-record-pending" and not tried:  # inside the event loop
            tried.append(cli_at(pg_url, op, "key", "move", f"transit:{key}"))

    monkeypatch.setattr(testhooks, "failpoint", move_now)
    PgVault.open(pg_url).rotate()
    one_line(tried[0], 5, "rotation")
    assert "key_source" not in meta_rows(pg_url)  # the refused move switched nothing
    ok(cli_at(pg_url, op, "key", "move", f"transit:{key}"))
    b = host_env(tmp_path, baoserver.host_token(key))
    assert host_write(pg_url, b, "s1", "two") == ["one", "two"]


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_POSTGRES)])
def test_after_a_move_to_the_keyring_another_host_is_told_to_import_a_kit(
    _: None, key: str, tmp_path: Path, pg_url: str
) -> None:
    """Host B used the transit key with a token; the operator moves the vault to its own
    keyring. B, with a keyring of its own and only its token, is told why it has no key
    and to import a kit; once it has, it reads and writes."""
    op = operator_env(tmp_path)
    ok(cli_at(pg_url, op, "init", "--key-source", f"transit:{key}"))
    b = host_env(
        tmp_path,
        baoserver.host_token(key),
        PYTHON_KEYRING_BACKEND=MEMORY_BACKEND,
        MEMVAULT_TEST_KEYRING_FILE=str(tmp_path / "host-b-keyring.json"),
    )
    assert keyring_write(pg_url, b, "s1", "from B") == ["from B"]
    ok(cli_at(pg_url, op, "key", "move", "keyring"))

    says = ("moved from transit:", "`memvault key move keyring`", "`memvault key import KIT`")
    for args in (("show", "s1"), ("rotate",)):
        proc = cli_at(pg_url, b, *args)
        for words in says:
            one_line(proc, 4, words)
    writer = subprocess.run(
        [sys.executable, "-c", HOST_WRITES, pg_url, "s1", "refused", "any"],
        capture_output=True, text=True, env=b, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert writer.returncode != 0 and all(w in writer.stderr for w in says), writer.stderr

    kit = tmp_path / "kit.json"
    exported = cli_at(
        pg_url, op, "key", "export", "--passphrase-stdin", str(kit), input="pw-1234567\n"
    )
    assert exported.returncode == 0, exported.stderr
    imported = cli_at(
        pg_url, b, "key", "import", "--passphrase-stdin", str(kit), input="pw-1234567\n"
    )
    assert imported.returncode == 0, imported.stderr
    assert keyring_write(pg_url, b, "s1", "again") == ["from B", "again"]
    assert shown(pg_url, {**b, "VAULT_ADDR": closed_port_addr()}) == ["from B", "again"]
