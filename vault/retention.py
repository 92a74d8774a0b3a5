"""Key versions kept for backups: the one decision both engines make, and the records.

A rotation retires the old key version for new writes (the guard refuses its kid).
As key services keep old versions decryptable, its keyring entry is kept, state
`retained`, decrypt-only, while a backup recorded in the vault needs it; a version no
recorded backup needs is destroyed as before. `memvault key forget KID` destroys a
retained version on purpose; revoke and shred destroy every version.

Every backup is recorded in the live vault (`memvault_backups`): the absolute path
it was written to, the key it uses, when, and a random `backup_id` that is also
written into the backup's own meta, so that `key list` tells a backup that is still
there from one that is missing or was replaced by another file.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vault import files
from vault.backupmark import BACKUP_ID  # the backup's own name; its record holds the same
from vault.engines.sqlite import db
from vault.engines.sqlite.schema import SQLITE_MAGIC, utcnow
from vault.keyjournal import CURRENT, DESTROYED, RETAINED

PRESENT, MISSING, REPLACED = "present", "missing", "replaced"
# Looking at a recorded backup never waits long: another process may be writing it.
PEEK_TIMEOUT = 1.0


@dataclass(frozen=True)
class BackupRecord:
    backup_id: str
    path: str  # absolute, as written
    kid: str  # the key version the backup's rows use
    created_at: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def new_record(target: Path, kid: str) -> BackupRecord:
    """The record of a backup about to be written to `target` under key `kid`."""
    return BackupRecord("mb-" + secrets.token_hex(12), os.path.abspath(target), kid, utcnow())


def fate(kid: str, records: Iterable[BackupRecord]) -> str:
    """What happens to a key version no row of the vault uses any more.

    RETAINED while a recorded backup uses it, else DESTROYED: the one rule, for a
    rotation's end and for the tidy-up after a crash, on both engines.
    """
    return RETAINED if any(r.kid == kid for r in records) else DESTROYED


def readable(state: str | None) -> bool:
    """Whether a backup under a version in this journal state still opens here."""
    return state in (CURRENT, RETAINED)


def backup_state(record: BackupRecord) -> str:
    """PRESENT, MISSING, or REPLACED (another file, or a vault without this backup's id)."""
    path = Path(record.path)
    if not os.path.lexists(path):
        return MISSING
    if files.special(path) is not None:
        return REPLACED  # a link, FIFO or device now stands there: never opened
    try:
        with open(path, "rb") as fh:
            if fh.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
                return REPLACED
        conn = db.peek(path, PEEK_TIMEOUT)
        try:
            row = conn.execute(
                "SELECT value FROM memvault_meta WHERE key = ?", (BACKUP_ID,)
            ).fetchone()
        finally:
            conn.close()
    except (OSError, sqlite3.Error):
        return REPLACED
    return PRESENT if row is not None and row[0] == record.backup_id else REPLACED


def described(records: Iterable[BackupRecord], states: dict[str, str]) -> list[dict[str, Any]]:
    """Each recorded backup: where, its key, whether it is there, and whether it opens
    here (its version's entry is kept: current or retained)."""
    out = []
    for r in records:
        state = states.get(r.kid)
        out.append(
            {
                **r.as_dict(),
                "file": backup_state(r),
                "key_state": state or "unknown",
                "readable": readable(state),
            }
        )
    return out


def why(backup: dict[str, Any]) -> str:
    """One line for `rotate` and `key list`: a backup, and why it opens or not."""
    where = backup["path"]
    if backup["file"] != PRESENT:
        where += f" ({backup['file']})"
    if backup["key_state"] == CURRENT:
        return f"{where}: readable, it uses the current key {backup['kid']}"
    if backup["key_state"] == RETAINED:
        return f"{where}: readable, its key {backup['kid']} is retained for it"
    return f"{where}: unreadable here, its key {backup['kid']} is {backup['key_state']}"


# -- the records in a vault file (PostgreSQL's twins are in engines.postgres.admin) --------------
def records(conn: sqlite3.Connection) -> list[BackupRecord]:
    try:
        rows = conn.execute(
            "SELECT backup_id, path, kid, created_at FROM memvault_backups ORDER BY rowid"
        ).fetchall()
    except sqlite3.OperationalError:
        return []  # not migrated yet: a file opened read-only before its first write
    return [BackupRecord(*row) for row in rows]


def add(conn: sqlite3.Connection, record: BackupRecord) -> None:
    conn.execute(
        "INSERT INTO memvault_backups (backup_id, path, kid, created_at) VALUES (?, ?, ?, ?)",
        (record.backup_id, record.path, record.kid, record.created_at),
    )


def set_kid(conn: sqlite3.Connection, backup_id: str, kid: str) -> None:
    conn.execute("UPDATE memvault_backups SET kid = ? WHERE backup_id = ?", (kid, backup_id))


def drop(conn: sqlite3.Connection, backup_id: str) -> None:
    conn.execute("DELETE FROM memvault_backups WHERE backup_id = ?", (backup_id,))


def drop_kid(conn: sqlite3.Connection, kid: str) -> None:
    conn.execute("DELETE FROM memvault_backups WHERE kid = ?", (kid,))
