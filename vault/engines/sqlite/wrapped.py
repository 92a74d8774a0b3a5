"""A transit vault's wrapped keys in a vault file: the meta rows `wrapped_key:<kid>`.

A save or drop made while this thread holds the file's write lock (a rotation's
switch, `tidy`, revoke) goes into that transaction: committed with it, or not at all.
"""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from vault.engines.sqlite.conn import write_locked_connection
from vault.keysource.store import wrapped_row


class _File(Protocol):
    """What of `VaultFile` this uses (typed here: db imports this module)."""

    path: Path

    def connection(self) -> AbstractContextManager[sqlite3.Connection]: ...

    def write_transaction(self) -> AbstractContextManager[sqlite3.Connection]: ...


class FileWrappedKeys:
    """`WrappedKeys` over one vault file (the vault id is the file's own)."""

    def __init__(self, vault: _File) -> None:
        self.vault = vault

    def load(self, vault_id: str, kid: str) -> str | None:
        held = write_locked_connection(self.vault.path)
        if held is not None:
            return _load(held, kid)
        with self.vault.connection() as conn:
            return _load(conn, kid)

    def save(self, vault_id: str, kid: str, wrapped: str) -> None:
        sql = "INSERT OR REPLACE INTO memvault_meta (key, value) VALUES (?, ?)"
        held = write_locked_connection(self.vault.path)
        if held is not None:
            held.execute(sql, (wrapped_row(kid), wrapped))
            return
        with self.vault.write_transaction() as conn:
            conn.execute(sql, (wrapped_row(kid), wrapped))

    def drop(self, vault_id: str, kid: str) -> bool:
        sql = "DELETE FROM memvault_meta WHERE key = ?"
        held = write_locked_connection(self.vault.path)
        if held is not None:
            return held.execute(sql, (wrapped_row(kid),)).rowcount > 0
        with self.vault.write_transaction() as conn:
            return conn.execute(sql, (wrapped_row(kid),)).rowcount > 0

    def replace(self, vault_id: str, kid: str, old: str, new: str) -> bool:
        with self.vault.write_transaction() as conn:
            return (
                conn.execute(
                    "UPDATE memvault_meta SET value = ? WHERE key = ? AND value = ?",
                    (new, wrapped_row(kid), old),
                ).rowcount
                > 0
            )


def _load(conn: sqlite3.Connection, kid: str) -> str | None:
    row = conn.execute(
        "SELECT value FROM memvault_meta WHERE key = ?", (wrapped_row(kid),)
    ).fetchone()
    return None if row is None else str(row[0])
