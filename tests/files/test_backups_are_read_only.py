"""A backup file is marked as one: commands that write refuse it, reading works.

Real subprocesses, the real keyring, real SQLite files. The live vault and the
backup share their vault id and key versions, so a write to the backup would
fork the history (and a rotation or revoke of it would destroy keys the live
vault still uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import add_items, keyring_entries, run_cli, user
from tests.keys.test_rotation import one_line_error
from tests.pgserver import MARKS as PG_MARKS
from vault import Vault


def meta_of(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())


def digest(db: Path) -> str:
    return hashlib.sha256(db.read_bytes()).hexdigest()


def backed_up(vault_db: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    add_items(vault_db, "s", [user("NORD-17"), user("repeat it")])
    dest = tmp_path / "backup.db"
    r = run_cli("--json", "backup", str(dest))
    assert r.code == 0, r
    return dest, r.json()


def test_a_backup_is_marked_with_the_live_vault_id_and_its_own_backup_id(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    dest, doc = backed_up(vault_db, tmp_path)
    meta = meta_of(dest)
    assert meta["backup_of"] == vault.vault_id
    assert meta["backup_id"] == doc["backup_id"] and meta["backup_id"].startswith("mb-")
    assert meta["backed_up_at"].endswith("Z")
    # The live vault is not marked, and a second backup gets an id of its own.
    assert "backup_of" not in meta_of(vault_db)
    second = tmp_path / "second.db"
    assert run_cli("backup", str(second)).code == 0
    assert meta_of(second)["backup_id"] != meta["backup_id"]


PLAIN = "plain.db"

WRITING = {
    "rotate": ["rotate"],
    "purge": ["purge", "--yes"],
    "clear": ["clear", "s", "--yes"],
    "pop": ["pop", "s"],
    "ttl": ["ttl", "7d"],
    "import": ["import", PLAIN],
    "revoke": ["revoke", "--yes"],
    # Refused before the first prompt, not after the model has answered it.
    "chat": ["chat", "s"],
}


def plaintext_source(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executescript(
            "CREATE TABLE agent_sessions (session_id TEXT PRIMARY KEY, created_at TEXT, "
            "updated_at TEXT);"
            "CREATE TABLE agent_messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id "
            "TEXT, message_data TEXT, created_at TEXT);"
            "INSERT INTO agent_sessions VALUES ('other', '2026-01-01', '2026-01-01');"
            "INSERT INTO agent_messages (session_id, message_data, created_at) VALUES "
            '(\'other\', \'{"role": "user", "content": "hi"}\', \'2026-01-01\');'
        )


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(WRITING))
def test_every_writing_command_refuses_a_backup_and_changes_nothing(
    vault: Vault, vault_db: Path, tmp_path: Path, command: str
) -> None:
    dest, _ = backed_up(vault_db, tmp_path)
    plaintext_source(tmp_path / PLAIN)
    before = digest(dest)
    entries = keyring_entries(vault.vault_id)
    args = [str(tmp_path / PLAIN) if a == PLAIN else a for a in WRITING[command]]
    r = run_cli("--db", str(dest), *args, input="hello\n", env={"OPENAI_API_KEY": "sk-unused"})
    assert r.code == 1, r
    err = one_line_error(r)
    assert "is a backup of vault" in err and f"memvault restore {dest}" in err, err
    assert "nothing was changed" in err
    assert "assistant>" not in r.out, r  # no conversation began
    assert digest(dest) == before
    assert keyring_entries(vault.vault_id) == entries  # a revoke destroyed nothing
    # The live vault is as it was.
    r = run_cli("--json", "show", "s")
    assert r.code == 0 and len(r.json()["items"]) == 2, r


READING = {
    "show": ["show", "s"],
    "export": ["export", "s", "-o", "-"],
    "search": ["search", "NORD"],
    "verify": ["verify"],
    "status": ["status"],
    "sessions": ["sessions"],
    "log": ["log"],
    "key list": ["key", "list"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(READING))
def test_reading_commands_work_on_a_backup(
    vault: Vault, vault_db: Path, tmp_path: Path, command: str
) -> None:
    dest, _ = backed_up(vault_db, tmp_path)
    r = run_cli("--db", str(dest), *READING[command])
    assert r.code == 0, r
    if command in ("show", "export", "search"):
        assert "NORD-17" in r.out
    if command == "status":  # it says what the file is, and the way back
        assert f"backup     of vault {vault.vault_id}" in r.out and "memvault restore" in r.out


def test_an_agent_session_reads_a_backup_but_never_writes_to_it(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    import vault as vault_pkg
    from vault.errors import OperationFailed

    dest, _ = backed_up(vault_db, tmp_path)
    before = digest(dest)

    async def go() -> list[Any]:
        s = vault_pkg.open_session("s", dest)
        try:
            items = await s.get_items()
            with pytest.raises(OperationFailed, match="memvault restore"):
                await s.add_items([user("forked")])
            with pytest.raises(OperationFailed):
                await s.pop_item()
            with pytest.raises(OperationFailed):
                await s.clear_session()
            return list(items)
        finally:
            s.close()

    assert [i["content"] for i in asyncio.run(go())] == ["NORD-17", "repeat it"]
    assert digest(dest) == before


def test_shredding_a_backup_keeps_the_keys_the_live_vault_uses(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    dest, _ = backed_up(vault_db, tmp_path)
    entries = keyring_entries(vault.vault_id)
    r = run_cli("--json", "--db", str(dest), "shred", "--yes")
    assert r.code == 0, r
    doc = r.json()
    assert doc["key_destroyed"] is False and doc["destroyed_kids"] == []
    assert doc["backup_of"] == vault.vault_id and "kept" in doc["keys_kept"]
    assert not dest.exists()
    assert keyring_entries(vault.vault_id) == entries
    r = run_cli("--json", "show", "s")
    assert r.code == 0 and len(r.json()["items"]) == 2, r
    # Said in words too.
    second = tmp_path / "second.db"
    assert run_cli("backup", str(second)).code == 0
    r = run_cli("--db", str(second), "shred", "--yes")
    assert r.code == 0 and f"key kept: this file was a backup of vault {vault.vault_id}" in r.out, r


@PG_MARKS[0]
@PG_MARKS[1]
def test_a_postgresql_backup_is_marked_and_refuses_writes(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    dest = tmp_path / "pg-copy.db"
    r = run_cli("--db", pg_url, "--json", "backup", str(dest))
    assert r.code == 0, r
    meta = meta_of(dest)
    assert meta["backup_of"] == pg_vault.vault_id and meta["backup_id"] == r.json()["backup_id"]
    before = digest(dest)
    r = run_cli("--db", str(dest), "ttl", "7d")
    assert r.code == 1 and "is a backup of vault" in one_line_error(r), r
    r = run_cli("--db", str(dest), "rotate")
    assert r.code == 1 and "memvault restore" in one_line_error(r), r
    assert digest(dest) == before
    assert run_cli("--db", str(dest), "verify").code == 0


@PG_MARKS[0]
@PG_MARKS[1]
def test_a_postgresql_backup_is_never_restored_into_a_file(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    # The file would share the PostgreSQL vault's keyring entries: its first rotation
    # destroyed the key the PostgreSQL vault uses on this host.
    dest = tmp_path / "pg-copy.db"
    assert run_cli("--db", pg_url, "backup", str(dest)).code == 0
    password = pg_url.split("@")[0].rsplit(":", 1)[1]
    assert password not in meta_of(dest)["backup_from"]  # the URL, as `status` shows it
    twin = tmp_path / "twin.db"
    r = run_cli("--db", str(twin), "restore", str(dest), "--yes")
    assert r.code == 1, r
    assert "PostgreSQL" in one_line_error(r), r
    assert not twin.exists()
    assert run_cli("--db", pg_url, "verify").code == 0


def test_opening_a_backup_never_deletes_a_key_the_live_vault_may_use(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """A backup taken while a rotation was staged lists its new key as pending. The live
    vault may use that key by now: opening the backup must not tidy its entry away."""
    from vault import crypto
    from vault.keyjournal import entry_name

    dest, _ = backed_up(vault_db, tmp_path)
    staged = crypto.generate_key()
    kid = crypto.key_id(staged)
    vault.keystore.set(entry_name(vault.vault_id, kid), staged)
    with contextlib.closing(sqlite3.connect(dest)) as conn:
        conn.execute(
            "INSERT INTO memvault_keys (kid, state, created_at, changed_at) "
            "VALUES (?, 'pending', '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z')",
            (kid,),
        )
        conn.commit()
    for args in (["status"], ["show", "s"], ["key", "list"]):
        assert run_cli("--db", str(dest), *args).code == 0
    assert vault.keystore.get(entry_name(vault.vault_id, kid)) == staged
