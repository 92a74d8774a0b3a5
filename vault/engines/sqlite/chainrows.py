"""The history chain stored in a vault file: each row's link in `agent_messages.chain`,
each session's head in `memvault_chain_heads`. The SQL only: what a link and a head
mean is vault.chain's, how a write moves them vault.chainops'. Every function runs
inside the caller's transaction (the write's own), never one of its own, except
`build`, the upgrade, which takes one per session.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from vault import chain, chainops, crypto
from vault.chain import ChainKey, Head
from vault.chaincheck import Verdict, check, check_tail
from vault.chainops import BUILDING, CHAIN_META, ON
from vault.chainops import key_of as key_of  # for the engine's callers: one import
from vault.chainops import keys_for as keys_for
from vault.chainops import refuse as refuse
from vault.engines.sqlite.schema import GUARD_MESSAGE, MESSAGES_TABLE, SESSIONS_TABLE
from vault.errors import HistoryTampered, VaultBusy

HEADS_TABLE = "memvault_chain_heads"


def chain_state(conn: sqlite3.Connection) -> str | None:
    """ON, BUILDING, or None for a file m010 has not migrated yet."""
    row = conn.execute("SELECT value FROM memvault_meta WHERE key = ?", (CHAIN_META,)).fetchone()
    return None if row is None else str(row[0])


def chained(conn: sqlite3.Connection) -> bool:
    """Whether every session of the file is chained (the upgrade has finished)."""
    return chain_state(conn) == ON


def read_head(conn: sqlite3.Connection, session_id: str) -> str | None:
    row = conn.execute(
        f"SELECT head FROM {HEADS_TABLE} WHERE session_id = ?", (session_id,)
    ).fetchone()
    return None if row is None else str(row[0])


def write_head(conn: sqlite3.Connection, session_id: str, head: Head) -> None:
    conn.execute(
        f"INSERT INTO {HEADS_TABLE} (session_id, head) VALUES (?, ?) "
        "ON CONFLICT(session_id) DO UPDATE SET head = excluded.head",
        (session_id, head.encode()),
    )


def append(
    conn: sqlite3.Connection, key: ChainKey, session_id: str, texts: Sequence[str], where: str
) -> list[str]:
    """The links of `texts`, appended to the session in this transaction; the head is
    written here, the caller inserts each text with its link."""
    head = chainops.head_to_move(key, session_id, read_head(conn, session_id), where)
    links, moved = chain.extend(key, session_id, head, texts)
    write_head(conn, session_id, moved)
    return [lk.encode() for lk in links]


def insert_rows(
    conn: sqlite3.Connection,
    key: ChainKey,
    rows: Sequence[tuple[str, str]],
    created_at: str | None = None,
) -> None:
    """Insert (session_id, message_data) rows in this order, each with its link, each
    session's head moved: a bulk insert with SQL as memvault's writers do it (the
    benches and the tests fill vaults so)."""
    by_session: dict[str, list[str]] = {}
    for sid, text in rows:
        by_session.setdefault(sid, []).append(text)
    links = {sid: iter(append(conn, key, sid, texts, "")) for sid, texts in by_session.items()}
    conn.executemany(
        f"INSERT INTO {MESSAGES_TABLE} (session_id, message_data, chain, created_at) "
        "VALUES (?, ?, ?, coalesce(?, CURRENT_TIMESTAMP))",
        [(sid, text, next(links[sid]), created_at) for sid, text in rows],
    )


def after_pop(
    conn: sqlite3.Connection,
    key: ChainKey,
    session_id: str,
    newest: list[str | None],
    n: int,
    where: str,
) -> None:
    """Move the head back past the `n` items just popped: `newest` are the links the
    session's newest rows had before the pop, newest first (at least n + 1 of them
    where the session had that many)."""
    pops = min(n, len(newest))
    befores = [newest[i + 1] if i + 1 < len(newest) else None for i in range(pops)]
    stored = read_head(conn, session_id)
    if stored is None and not chained(conn):
        return  # the upgrade has not linked this file yet
    head = chainops.head_to_move(key, session_id, stored, where)
    write_head(conn, session_id, chainops.pop_head(key, session_id, head, befores, where))


def last_link(conn: sqlite3.Connection, session_id: str) -> str | None:
    """The link of the session's newest row (None: no row, or no link)."""
    row = conn.execute(
        f"SELECT chain FROM {MESSAGES_TABLE} WHERE session_id = ? ORDER BY id DESC LIMIT 1",
        (session_id,),
    ).fetchone()
    return None if row is None else row[0]


def after_clear(
    conn: sqlite3.Connection, key: ChainKey, session_id: str, where: str, forced: bool = False
) -> None:
    """A new epoch: the head is kept (so an item put back after the clear is told apart).
    `forced` (clear --include-unreadable, the way to delete tampered history on purpose)
    starts the epoch after the stored head's even when that head does not authenticate."""
    stored = read_head(conn, session_id)
    if stored is None:
        return  # never chained: nothing to remember
    try:
        head = chainops.head_to_move(key, session_id, stored, where)
    except HistoryTampered:
        if not forced:
            raise
        head = chain.new_head(key, session_id)
        old = Head.decode(stored)
        if old is not None:
            head = dataclasses.replace(head, epoch=old.epoch, base=old.end, end=old.end)
    write_head(conn, session_id, chain.clear(key, session_id, head))


def after_purge(
    conn: sqlite3.Connection, key: ChainKey, session_id: str, last_purged: str | None, where: str
) -> None:
    """The head's base past the newest purged item (a purge removes a prefix only)."""
    stored = read_head(conn, session_id)
    if stored is None:
        return
    head = chainops.head_to_move(key, session_id, stored, where)
    link = chainops.link_of(last_purged, session_id, where)
    try:
        moved = chain.purge(key, session_id, head, link)
    except ValueError:
        raise chainops.tampered(session_id, "unauthenticated", where) from None
    write_head(conn, session_id, moved)


def session_rows(
    conn: sqlite3.Connection, session_id: str, limit: int | None = None
) -> list[tuple[str, str | None]]:
    """(message_data, chain) of the session's rows, oldest first; the newest `limit`."""
    sql = f"SELECT message_data, chain FROM {MESSAGES_TABLE} WHERE session_id = ? ORDER BY id DESC"
    args: tuple[object, ...] = (session_id,)
    if limit is not None:
        sql += " LIMIT ?"
        args += (limit,)
    return [(str(d), c) for d, c in conn.execute(sql, args)][::-1]


def judge(
    conn: sqlite3.Connection,
    keys: Mapping[str, ChainKey],
    session_id: str,
    limit: int | None = None,
) -> Verdict:
    """The session's verdict in the caller's snapshot: every row, or the newest `limit`."""
    if not chained(conn):
        return Verdict()
    head = Head.decode(read_head(conn, session_id))
    rows = session_rows(conn, session_id, limit)
    if limit is None:
        return check(keys, session_id, rows, head)
    return check_tail(keys, session_id, rows, head, limit)


def verdict(conn: sqlite3.Connection, keys: Mapping[str, ChainKey], session_id: str) -> str | None:
    """`judge`'s kind as text, or None: the session verifies."""
    kind = judge(conn, keys, session_id).kind
    return None if kind is None else kind.value


def judged_sessions(conn: sqlite3.Connection) -> Iterator[str]:
    """Every session a chain check covers: with rows, or with a head (cut to nothing)."""
    for (sid,) in conn.execute(
        f"SELECT session_id FROM {MESSAGES_TABLE} UNION SELECT session_id FROM {HEADS_TABLE} "
        "ORDER BY 1"
    ):
        yield str(sid)


def remac_updates(
    old: ChainKey,
    new: ChainKey,
    updates: Sequence[tuple[str, int, str]],
    links: dict[int, str | None],
) -> list[tuple[str, str | None, int, str, str | None]]:
    """The rotation's (new text, id, old text) updates with each row's link (`links`, as
    read with the old text, taken out) re-MACed from `old` to `new` over the new text:
    (new text, new link, id, old text, old link) for one `UPDATE ... SET message_data,
    chain ... WHERE` both are still as read. A row whose link does not verify moves to
    the new key all the same, its link kept as it was: the item stays readable and its
    session is still reported as tampered, where leaving it under the old key would
    lose an authentic item to one edited link once that key is retired."""
    out = []
    for new_text, row_id, old_text in updates:
        text = links.pop(row_id, None)
        link = chain.Link.decode(text)
        moved = None if link is None else chain.remac(old, new, link, old_text, new_text)
        out.append((new_text, text if moved is None else moved.encode(), row_id, old_text, text))
    return out


def remac_heads(conn: sqlite3.Connection, old: ChainKey, new: ChainKey) -> None:
    """Every head under `old` re-MACed under `new` (the rotation's switch)."""
    heads = dict(conn.execute(f"SELECT session_id, head FROM {HEADS_TABLE}").fetchall())
    conn.executemany(
        f"UPDATE {HEADS_TABLE} SET head = ? WHERE session_id = ?",
        chainops.remac_all(old, new, heads),
    )


class _File(Protocol):
    def connection(self) -> AbstractContextManager[sqlite3.Connection]: ...

    def write_transaction(self) -> AbstractContextManager[sqlite3.Connection]: ...


def build(vault: _File, key: ChainKey, keys: Mapping[str, ChainKey]) -> None:
    """The upgrade: link each session's rows in id order and write its head, one session
    per transaction (a kill resumes with the sessions that have no head yet); then the
    meta says the file is chained. Rows that already carry a link are left alone. Each
    row is linked under the key its envelope names (`keys`, by kid: a rotation cut off
    leaves rows under the old one, which it re-MACs as it moves them), else `key`."""
    with vault.connection() as conn:
        if chain_state(conn) != BUILDING:
            return  # asked without the write lock: done, or m010 not applied yet
    while True:
        with vault.write_transaction() as conn:
            if chain_state(conn) != BUILDING:
                return
            todo = conn.execute(
                f"SELECT DISTINCT session_id FROM {MESSAGES_TABLE} WHERE session_id NOT IN "
                f"(SELECT session_id FROM {HEADS_TABLE}) LIMIT 1"
            ).fetchone()
            if todo is None:
                conn.execute(
                    "UPDATE memvault_meta SET value = ? WHERE key = ? AND value = ?",
                    (ON, CHAIN_META, BUILDING),
                )
                return
            sid = str(todo[0])
            rows = conn.execute(
                f"SELECT id, message_data FROM {MESSAGES_TABLE} "
                "WHERE session_id = ? AND chain IS NULL ORDER BY id",
                (sid,),
            ).fetchall()
            texts = [str(r[1]) for r in rows]
            item_keys = [keys.get(crypto.kid_of(t) or "", key) for t in texts]
            links, head = chain.extend(key, sid, chain.new_head(key, sid), texts, item_keys)
            conn.executemany(
                f"UPDATE {MESSAGES_TABLE} SET chain = ? WHERE id = ?",
                [(lk.encode(), r[0]) for lk, r in zip(links, rows, strict=True)],
            )
            write_head(conn, sid, head)


# -- the agent session's writes and reads (vault.engines.sqlite.session) ----------------
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
        raise sqlite3.IntegrityError(GUARD_MESSAGE)  # every head moves with a rotation
    links = append(conn, key, session_id, texts, where)
    conn.executemany(
        f"INSERT INTO {MESSAGES_TABLE} (session_id, message_data, chain) VALUES (?, ?, ?)",
        [(session_id, t, lk) for t, lk in zip(texts, links, strict=True)],
    )
    conn.execute(
        f"UPDATE {SESSIONS_TABLE} SET updated_at = CURRENT_TIMESTAMP WHERE session_id = ?",
        (session_id,),
    )


def popped_one(conn: sqlite3.Connection, session_id: str, keys_of: KeysOf, where: str) -> bool:
    """After the SDK's pop deleted the newest row, in its transaction: the head moved
    back. False, changing nothing, when the session's key is stale (the caller rolls
    back and retries with the key reloaded)."""
    kid = file_kid(conn)
    keys = keys_of(kid)
    if keys is None or kid not in keys:
        return False
    after_pop(conn, keys[kid], session_id, [None, last_link(conn, session_id)], 1, where)
    return True


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


class PurgedPrefix:
    """Which expired rows a purge deletes: each session's oldest, up to its first row
    that stays (fresh or unreadable), so the chain records the purge as a new base."""

    def __init__(self) -> None:
        self.stopped: set[str] = set()
        self.last: dict[str, str | None] = {}  # session -> link of its newest purged row

    def take(
        self,
        conn: sqlite3.Connection,
        batch: Sequence[tuple[int, str, str]],
        expired: list[tuple[int]],
    ) -> list[tuple[int]]:
        """The (id,) of `batch`'s rows to delete, of those `expired` names; read before
        they are deleted (their links are needed for the heads)."""
        doomed_ids = {e[0] for e in expired}
        out: list[tuple[int]] = []
        newest: dict[str, int] = {}
        for row_id, sid, _data in batch:
            if sid in self.stopped:
                continue
            if row_id in doomed_ids:
                out.append((row_id,))
                newest[sid] = row_id
            else:
                self.stopped.add(sid)
        for sid, row_id in newest.items():
            row = conn.execute(
                f"SELECT chain FROM {MESSAGES_TABLE} WHERE id = ?", (row_id,)
            ).fetchone()
            self.last[sid] = None if row is None else row[0]
        return out

    def move_heads(self, conn: sqlite3.Connection, key: ChainKey, where: str) -> None:
        for sid, link in self.last.items():
            after_purge(conn, key, sid, link, where)
