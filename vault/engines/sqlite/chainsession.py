"""The history chain in the agent session's own calls (vault.engines.sqlite.session):
its inserts, its pop and its reads, each in the SDK's transaction or snapshot. The
SQL of links and heads is vault.engines.sqlite.chainrows'."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.fernet import InvalidToken

from vault import chainops
from vault.chain import ChainKey, Head, Link
from vault.chaincheck import Tamper, check, check_tail
from vault.chainfloor import Floor
from vault.chainvault import Point
from vault.engines.sqlite import vaulthead
from vault.engines.sqlite.chainrows import after_pop, append, read_head, session_rows
from vault.engines.sqlite.schema import GUARD_MESSAGE, MESSAGES_TABLE, SESSIONS_TABLE
from vault.engines.sqlite.vaulthead import chained, file_kid
from vault.errors import VaultBusy

# `keys_of(file_kid)` is the session's: its chain keys when it holds the file's key
# (after reloading it, where a read may), else None.
KeysOf = Callable[[str], "dict[str, ChainKey] | None"]


def insert_items(
    conn: sqlite3.Connection,
    session_id: str,
    texts: Sequence[str],
    key: ChainKey,
    where: str,
    floor: Floor | None = None,
) -> Point | None:
    """The SDK's insert of a session's new items, each with its link, the head moved in
    the same transaction. `key` is the session's, unchecked (a write reads no meta): a
    head under another key id raises what the guard raises for an item under a stale
    one (sqlite3.IntegrityError), so the session reloads its key and retries; the guard
    refuses the items themselves when the session has no head yet."""
    # The first write takes the write lock: the head read next is the one this commits over.
    conn.execute(f"INSERT OR IGNORE INTO {SESSIONS_TABLE} (session_id) VALUES (?)", (session_id,))
    stored = read_head(conn, session_id)
    head = Head.decode(stored)
    if head is not None and head.kid != key.kid:
        if file_kid(conn) == key.kid:  # the session's key is the file's: the head was edited
            raise chainops.tampered(session_id, "unauthenticated", where)
        if floor is not None:  # keys moved to another source first: open the vault again
            vaulthead.refuse_behind(conn, key, floor, session_id, where)
        raise sqlite3.IntegrityError(GUARD_MESSAGE)  # every head moves with a rotation
    if head is None and chained(conn) and _has_rows(conn, session_id):
        # Rows with no head: the head was deleted. A new chain here would hide that.
        raise chainops.tampered(session_id, "unauthenticated", where)
    # A file behind `floor` is refused there (vaulthead.move): this transaction rolls back.
    links, point = append(conn, key, session_id, texts, where, stored, floor)
    conn.executemany(
        f"INSERT INTO {MESSAGES_TABLE} (session_id, message_data, chain) VALUES (?, ?, ?)",
        [(session_id, t, lk) for t, lk in zip(texts, links, strict=True)],
    )
    conn.execute(
        f"UPDATE {SESSIONS_TABLE} SET updated_at = CURRENT_TIMESTAMP WHERE session_id = ?",
        (session_id,),
    )
    return point  # for `SessionChain.wrote`, once the SDK has committed


def _has_rows(conn: sqlite3.Connection, session_id: str) -> bool:
    sql = f"SELECT 1 FROM {MESSAGES_TABLE} WHERE session_id = ? LIMIT 1"
    return conn.execute(sql, (session_id,)).fetchone() is not None


def pop_newest(
    conn: sqlite3.Connection,
    session_id: str,
    validate: Callable[[Any], None] | None,
    chain: SessionChain,
    where: str,
) -> tuple[Any, Point | None]:
    """The SDK's pop_item, in the caller's transaction: the newest row taken with its
    link, checked by `validate` (the SDK's: authenticates the envelope) and by the
    chain (the head's authentic last item), the head moved back; refused from a file
    behind the chain's floor, as a write is (`insert_items`). Returns the item (None:
    no row) and the vault head's point after it (for `SessionChain.wrote`, once committed).
    InvalidToken when the session's key is stale (the caller rolls back, reloads the
    key and retries)."""
    row = conn.execute(
        f"DELETE FROM {MESSAGES_TABLE} WHERE id = (SELECT id FROM {MESSAGES_TABLE} "
        "WHERE session_id = ? ORDER BY id DESC LIMIT 1) RETURNING message_data, chain",
        (session_id,),
    ).fetchone()
    if row is None:
        return None, None
    text, link = str(row[0]), row[1]
    try:
        item = json.loads(text)
    except json.JSONDecodeError:  # the guard refuses such a row: someone else put it there
        raise chainops.tampered(session_id, "unauthenticated", where) from None
    if validate is not None:
        validate(item)
    kid = file_kid(conn)
    keys = chain.keys_of(kid)
    if keys is None or kid not in keys:
        raise InvalidToken
    if chain.floor is not None:
        vaulthead.refuse_behind(conn, keys[kid], chain.floor, session_id, where)
    return item, after_pop(conn, keys[kid], session_id, [(text, link)], where, keys)


@dataclass(frozen=True)
class Memo:
    """What an open session last read in full and judged (its read cache's part in the
    file): the head as stored, and the envelopes of every item it vouches for, oldest
    first. Never handed out: a read returns copies."""

    stored: str
    head: Head
    envelopes: list[Any]


@dataclass
class SessionChain:
    """What an open session's chain calls need of it. `keys_of(file_kid)`: its chain
    keys when it holds the file's key (after reloading it, where a read may), else None;
    `key()`: its own (a write's); `memo`: its read cache's part (vault.readcache), at
    most `keep()` items (0: none); `was_chained`: the file was chained at open, and
    stays so; `floor`: the vault's anchor as this process knows it (None: no anchor);
    `wrote(point)`: after its own insert or pop committed, the vault head it wrote is a
    state it knows as well as one it read (its vault's `Anchored.wrote`, which raises
    the floor they share)."""

    keys_of: KeysOf = lambda _kid: None
    key: Callable[[], ChainKey | None] = lambda: None
    memo: Memo | None = None
    keep: Callable[[], int] = lambda: 0
    was_chained: bool = False
    floor: Floor | None = None
    wrote: Callable[[Point | None], None] = lambda _point: None


def read_items(
    conn: sqlite3.Connection, session_id: str, limit: int | None, chain: SessionChain, where: str
) -> list[Any]:
    """`read` with the session's chain state, whose memo it moves on."""
    items, chain.memo = read(
        conn, session_id, limit, chain.keys_of, where,
        chain.memo, chain.keep(), chain.was_chained, chain.floor,
    )  # fmt: skip
    return items


def read(
    conn: sqlite3.Connection,
    session_id: str,
    limit: int | None,
    keys_of: KeysOf,
    where: str,
    memo: Memo | None = None,
    keep: int = 0,
    was_chained: bool = False,
    floor: Floor | None = None,
) -> tuple[list[Any], Memo | None]:
    """The SDK's `get_items`: the session's rows (all, or the newest `limit`, as the SDK
    takes it), oldest first, decoded, read in one snapshot with the head and judged
    first (HistoryTampered). A chained session has no undecodable rows to skip past
    (the guard refuses them; one there is tampering), so the window is `limit`.

    With `keep` > 0 (the session's read cache), a full read of at most `keep` items is
    kept as a Memo, and a later read whose authenticated head shows the same history, or
    that history with items appended, reads and judges only the appended rows.

    `was_chained`: the file was chained when the session opened it. Nothing unchains a
    file, so one that says it is unchained now was rewritten or put back under the
    session (`cp` keeps the inode), and its rows are not served unverified. `floor`:
    the vault's anchor as the session knows it (vault.engines.sqlite.anchoring)."""
    if limit is not None and limit <= 0:
        limit = None if limit < 0 else 0  # the SDK's: a negative limit is no limit
    if limit == 0:
        return [], memo
    conn.execute("BEGIN")
    try:
        keys = keys_of(file_kid(conn))
        if keys is None:
            raise VaultBusy(f"{where} kept changing key while being read; try again")
        if not chained(conn):
            if was_chained:
                raise chainops.tampered(session_id, Tamper.ROLLED_BACK, where)
            return _decoded(session_rows(conn, session_id, limit)), None
        stored = read_head(conn, session_id)
        chainops.refuse_kind(vaulthead.verdict(conn, keys, floor), session_id, where)
        head = Head.decode(stored)
        if memo is not None and keep and stored is not None and head is not None:
            memo = _caught_up(conn, keys, session_id, stored, head, memo, keep)
        else:
            memo = None
        if memo is not None:
            kept = memo.envelopes if limit is None else memo.envelopes[-limit:]
            return [dict(e) for e in kept], memo
        rows = session_rows(conn, session_id, limit)
        verdict = (
            check(keys, session_id, rows, head)
            if limit is None
            else check_tail(keys, session_id, rows, head, limit)
        )
        chainops.refuse(verdict, session_id, where)
        items = _decoded(rows)
        if limit is None and stored is not None and head is not None and len(items) <= keep:
            return [dict(e) for e in items], Memo(stored, head, items)
        return items, None
    finally:
        conn.execute("COMMIT")


def _decoded(rows: Sequence[tuple[str, str | None]]) -> list[Any]:
    return [json.loads(text) for text, _link in rows]


def _caught_up(
    conn: sqlite3.Connection,
    keys: dict[str, ChainKey],
    session_id: str,
    stored: str,
    head: Head,
    memo: Memo,
    keep: int,
) -> Memo | None:
    """The memo for `head`, or None when only a full read can tell (then judged whole).

    The same stored head is the same history. A head of the same key, epoch and base
    that ends further on appended items, if the rows from the memo's last item to the
    head's last are the head's last ones (`check_tail`), and that first row is the
    memo's last item (its ident: each ident MACs the one before it, so the same ident
    is the same history up to it)."""
    if stored == memo.stored:
        return memo
    old = memo.head
    grown = head.end - old.end
    if (head.kid, head.epoch, head.base) != (old.kid, old.epoch, old.base) or grown <= 0:
        return None
    if len(memo.envelopes) + grown > keep:
        return None
    want = grown + (1 if old.count else 0)
    rows = session_rows(conn, session_id, want)
    if len(rows) != want or not check_tail(keys, session_id, rows, head, want).ok:
        return None
    if old.count:
        first = Link.decode(rows[0][1])
        if first is None or first.ident != old.last:
            return None
    return Memo(stored, head, memo.envelopes + _decoded(rows[len(rows) - grown :]))
