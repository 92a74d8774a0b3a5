"""Rows put into a vault file with SQL, as memvault's own writers put them: each with its
history-chain link, each session's head moved (vault.engines.sqlite.chainrows). The
file's guard refuses a row without a link, so a test that fills a vault with SQL
(faster than the SDK) goes through here; tampering tests then edit what it wrote."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from vault import chainops, crypto
from vault.engines.sqlite import chainrows


def insert_chained(
    conn: sqlite3.Connection, sealer: crypto.Sealer, rows: Sequence[tuple[str, str]]
) -> None:
    """Insert (session_id, message_data) rows in this order, in the caller's transaction
    (or statement by statement on an autocommit connection), linked with the chain key
    of `sealer`, the key they are sealed with."""
    (vault_id,) = conn.execute("SELECT value FROM memvault_meta WHERE key = 'vault_id'").fetchone()
    chainrows.insert_rows(conn, chainops.key_of(sealer, vault_id), rows)
