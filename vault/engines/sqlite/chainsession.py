"""The history chain in the agent session's own calls (vault.engines.sqlite.session):
its inserts, its pop and its reads, each in the SDK's transaction or snapshot. The
SQL of links and heads is vault.engines.sqlite.chainrows'."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from cryptography.fernet import InvalidToken

from vault import chainops
from vault.chain import ChainKey, Head
from vault.chaincheck import check, check_tail
from vault.engines.sqlite.chainrows import (
    after_pop,
    append,
    chained,
    read_head,
    session_rows,
)
from vault.engines.sqlite.schema import GUARD_MESSAGE, MESSAGES_TABLE, SESSIONS_TABLE
from vault.errors import VaultBusy

# `keys_of(file_kid)` is the session's: its chain keys when it holds the file's key
# (after reloading it, where a read may), else None.
KeysOf = Callable[[str], "dict[str, ChainKey] | None"]


def file_kid(conn: sqlite3.Connection) -> str:
    row = conn.execute("SELECT value FROM memvault_meta WHERE key = 'kid'").fetchone()
    return "" if row is None else str(row[0])


def insert_items(
    conn: sqlite3.Connection, session_id: str, texts: Sequence[str], key: ChainKey, where: str
) -> None:
    """The SDK's insert of a session's new items, each with its link, the head moved in
    the same transaction. `key` is the session's, unchecked (a write reads no meta): a
    head under another key id raises what the guard raises for an item under a stale
    one (sqlite3.IntegrityError), so the session reloads its key and retries; the guard
    refuses the items themselves when the session has no head yet."""
    # The first write takes the write lock: the head read next is the one this commits over.
    conn.execute(f"INSERT OR IGNORE INTO {SESSIONS_TABLE} (session_id) VALUES (?)", (session_id,))
    head = Head.decode(read_head(conn, session_id))
    if head is not None and head.kid != key.kid:
        if file_kid(conn) == key.kid:  # the session's key is the file's: the head was edited
            raise chainops.tampered(session_id, "unauthenticated", where)
        raise sqlite3.IntegrityError(GUARD_MESSAGE)  # every head moves with a rotation
    if head is None and chained(conn) and _has_rows(conn, session_id):
        # Rows with no head: the head was deleted. A new chain here would hide that.
        raise chainops.tampered(session_id, "unauthenticated", where)
    links = append(conn, key, session_id, texts, where)
    conn.executemany(
        f"INSERT INTO {MESSAGES_TABLE} (session_id, message_data, chain) VALUES (?, ?, ?)",
        [(session_id, t, lk) for t, lk in zip(texts, links, strict=True)],
    )
    conn.execute(
        f"UPDATE {SESSIONS_TABLE} SET updated_at = CURRENT_TIMESTAMP WHERE session_id = ?",
        (session_id,),
    )


def _has_rows(conn: sqlite3.Connection, session_id: str) -> bool:
    sql = f"SELECT 1 FROM {MESSAGES_TABLE} WHERE session_id = ? LIMIT 1"
    return conn.execute(sql, (session_id,)).fetchone() is not None


def pop_newest(
    conn: sqlite3.Connection,
    session_id: str,
    validate: Callable[[Any], None] | None,
    keys_of: KeysOf,
    where: str,
) -> Any:
    """The SDK's pop_item, in the caller's transaction: the newest row taken with its
    link, checked by `validate` (the SDK's: authenticates the envelope) and by the
    chain (the head's authentic last item), the head moved back. None: no row.
    InvalidToken when the session's key is stale (the caller rolls back, reloads the
    key and retries)."""
    row = conn.execute(
        f"DELETE FROM {MESSAGES_TABLE} WHERE id = (SELECT id FROM {MESSAGES_TABLE} "
        "WHERE session_id = ? ORDER BY id DESC LIMIT 1) RETURNING message_data, chain",
        (session_id,),
    ).fetchone()
    if row is None:
        return None
    text, link = str(row[0]), row[1]
    try:
        item = json.loads(text)
    except json.JSONDecodeError:  # the guard refuses such a row: someone else put it there
        raise chainops.tampered(session_id, "unauthenticated", where) from None
    if validate is not None:
        validate(item)
    kid = file_kid(conn)
    keys = keys_of(kid)
    if keys is None or kid not in keys:
        raise InvalidToken
    after_pop(conn, keys[kid], session_id, [(text, link)], where, keys)
    return item


def read_items(
    conn: sqlite3.Connection, session_id: str, limit: int | None, keys_of: KeysOf, where: str
) -> list[Any]:
    """The SDK's `get_items`: the session's rows (all, or the newest `limit`, as the SDK
    takes it), oldest first, decoded, read in one snapshot with the head and judged
    first (HistoryTampered). A chained session has no undecodable rows to skip past
    (the guard refuses them; one there is tampering), so the window is `limit`."""
    if limit is not None and limit <= 0:
        limit = None if limit < 0 else 0  # the SDK's: a negative limit is no limit
    if limit == 0:
        return []
    return [json.loads(text) for text in _read_checked(conn, session_id, limit, keys_of, where)]


def _read_checked(
    conn: sqlite3.Connection, session_id: str, limit: int | None, keys_of: KeysOf, where: str
) -> list[str]:
    conn.execute("BEGIN")
    try:
        keys = keys_of(file_kid(conn))
        if keys is None:
            raise VaultBusy(f"{where} kept changing key while being read; try again")
        rows = session_rows(conn, session_id, limit)
        if chained(conn):
            head = Head.decode(read_head(conn, session_id))
            verdict = (
                check(keys, session_id, rows, head)
                if limit is None
                else check_tail(keys, session_id, rows, head, limit)
            )
            chainops.refuse(verdict, session_id, where)
        return [text for text, _link in rows]
    finally:
        conn.execute("COMMIT")
