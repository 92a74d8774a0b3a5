"""A PostgreSQL vault keeps the old key version for its recorded backups as a file vault
does: `backup` of a URL, then `rotate`, and the backup file still reads; `key list`
explains the retained version, `key forget` ends it, revoke destroys it.

Run with `scripts/with-postgres scripts/test -m postgres`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import keyring_entries, run_cli
from tests.pgserver import MARKS, sql
from tests.postgres.test_postgres_read import write_history
from vault.keyjournal import entry_name

pytestmark = MARKS


def journal(url: str) -> dict[str, str]:
    return {r["kid"]: r["state"] for r in sql(url, "SELECT kid, state FROM memvault_keys")}


def test_a_backup_of_a_url_still_reads_after_the_vault_rotates(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    write_history(pg_vault, pg_url)
    b = tmp_path / "copy.db"
    r = run_cli("--db", pg_url, "--json", "backup", str(b))
    assert r.code == 0, r
    old_kid = r.json()["kid"]
    [rec] = sql(pg_url, "SELECT path, kid, backup_id FROM memvault_backups")
    assert rec["path"] == str(b) and rec["kid"] == old_kid
    [event] = sql(pg_url, "SELECT details FROM memvault_audit WHERE event = 'backup'")
    assert json.loads(event["details"])["to"] == str(b)

    r = run_cli("--db", pg_url, "--json", "rotate")
    assert r.code == 0, r
    doc = r.json()
    assert doc["old_key"] == "retained"
    assert [(x["path"], x["readable"], x["file"]) for x in doc["backups"]] == [
        (str(b), True, "present")
    ]
    assert journal(pg_url)[old_kid] == "retained"
    r = run_cli("--db", str(b), "verify")
    assert r.code == 0, r
    r = run_cli("--db", str(b), "--json", "show", "carnet")
    assert r.code == 0 and r.json()["items"], r
    assert run_cli("--db", pg_url, "show", "carnet").code == 0

    r = run_cli("--db", pg_url, "--json", "key", "list")
    assert r.code == 0, r
    [kept] = [k for k in r.json()["keys"] if k["state"] == "retained"]
    assert kept["kid"] == old_kid and [x["path"] for x in kept["backups"]] == [str(b)]

    # A second rotation: its old key has no backup, so it goes; the first stays.
    r = run_cli("--db", pg_url, "--json", "rotate")
    assert r.code == 0 and r.json()["old_key"] == "destroyed", r
    assert journal(pg_url)[old_kid] == "retained"
    assert run_cli("--db", str(b), "verify").code == 0

    r = run_cli("--db", pg_url, "--json", "key", "forget", old_kid, "--yes")
    assert r.code == 0, r
    assert [x["path"] for x in r.json()["unreadable"]] == [str(b)]
    assert journal(pg_url)[old_kid] == "destroyed"
    assert entry_name(pg_vault.vault_id, old_kid) not in keyring_entries(pg_vault.vault_id)
    assert run_cli("--db", str(b), "verify").code == 4


def test_revoke_of_a_url_destroys_retained_versions_too(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    write_history(pg_vault, pg_url)
    assert run_cli("--db", pg_url, "backup", str(tmp_path / "b.db")).code == 0
    assert run_cli("--db", pg_url, "rotate").code == 0
    assert len(keyring_entries(pg_vault.vault_id)) == 2
    r = run_cli("--db", pg_url, "revoke", "--yes")
    assert r.code == 0, r
    assert keyring_entries(pg_vault.vault_id) == {}
    assert set(journal(pg_url).values()) == {"destroyed"}


def test_a_url_rotation_killed_after_its_end_keeps_the_backups_key_and_the_next_finishes(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    """Killed between the rotation's end and its key decision: the old version is still
    retired, its entry there; the next rotation judges it as the end would: retained."""
    write_history(pg_vault, pg_url)
    b = tmp_path / "copy.db"
    assert run_cli("--db", pg_url, "backup", str(b)).code == 0
    old_kid = journal_current(pg_url)
    r = run_cli("--db", pg_url, "rotate", env={"MEMVAULT_FAILPOINT": "pg-rotate-after-finish"})
    assert r.code < 0, r  # killed at the failpoint
    assert journal(pg_url)[old_kid] == "retired"
    assert run_cli("--db", str(b), "verify").code == 0
    r = run_cli("--db", pg_url, "--json", "rotate")
    assert r.code == 0, r
    assert journal(pg_url)[old_kid] == "retained"
    assert entry_name(pg_vault.vault_id, old_kid) in keyring_entries(pg_vault.vault_id)
    assert run_cli("--db", str(b), "verify").code == 0
    assert run_cli("--db", pg_url, "show", "carnet").code == 0


def journal_current(url: str) -> str:
    return str(sql(url, "SELECT value FROM memvault_meta WHERE key = 'kid'")[0]["value"])
