"""The history chain stored in a vault file: each row's link in `agent_messages.chain`,
each session's head in `memvault_chain_heads`. The SQL only: what a link and a head
mean is vault.chain's, how a write moves them vault.chainops'. Every function runs
inside the caller's transaction (the write's own), never one of its own, except
`build`, the upgrade, which takes one per session.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from vault import chain, chainops, crypto
from vault.chain import ChainKey, Head
from vault.chaincheck import Verdict, check, check_tail
from vault.chainfloor import Floor
from vault.chainops import BUILDING, ON
from vault.chainops import key_of as key_of  # for the engine's callers: one import
from vault.chainops import keys_for as keys_for
from vault.chainops import refuse as refuse
from vault.chainvault import Point
from vault.engines.sqlite import vaulthead
from vault.engines.sqlite.schema import MESSAGES_TABLE
from vault.engines.sqlite.vaulthead import HEADS_TABLE, chain_state, chained
from vault.errors import HistoryTampered

UNLINKED = "unlinked"  # the link of a row that had none when a rotation moved it


def read_head(conn: sqlite3.Connection, session_id: str) -> str | None:
    row = conn.execute(
        f"SELECT head FROM {HEADS_TABLE} WHERE session_id = ?", (session_id,)
    ).fetchone()
    return None if row is None else str(row[0])


def write_head(
    conn: sqlite3.Connection,
    key: ChainKey,
    session_id: str,
    before: Head | None,
    after: Head,
    where: str,
    floor: Floor | None = None,
) -> Point | None:
    """The session's head moved from `before` (None: it had none) to `after`, and the
    vault head with it (vault.engines.sqlite.vaulthead), whose point this returns;
    refused if the file is behind `floor`."""
    conn.execute(
        f"INSERT INTO {HEADS_TABLE} (session_id, head) VALUES (?, ?) "
        "ON CONFLICT(session_id) DO UPDATE SET head = excluded.head",
        (session_id, after.encode()),
    )
    return vaulthead.move(conn, key, session_id, before, after, where, floor)


def append(
    conn: sqlite3.Connection,
    key: ChainKey,
    session_id: str,
    texts: Sequence[str],
    where: str,
    stored: str | None,
    floor: Floor | None = None,
) -> tuple[list[str], Point | None]:
    """The links of `texts`, appended to the session whose head is `stored` (as read in
    this transaction), and the vault head's point after them; the head is written
    here, the caller inserts each text with its link. Refused if the file is behind
    `floor`."""
    head = chainops.head_to_move(key, session_id, stored, where)
    links, moved = chain.extend(key, session_id, head, texts)
    before = None if stored is None else head
    point = write_head(conn, key, session_id, before, moved, where, floor)
    return [lk.encode() for lk in links], point


def insert_rows(
    conn: sqlite3.Connection,
    key: ChainKey,
    rows: Sequence[tuple[str, str]],
    created_at: str | Sequence[str] | None = None,
) -> None:
    """Insert (session_id, message_data) rows in this order, each with its link, each
    session's head moved: a bulk insert with SQL as memvault's writers do it (the
    benches and the tests fill vaults so, and a PostgreSQL vault's backup file).
    `created_at`: one stamp for every row, or one per row."""
    by_session: dict[str, list[str]] = {}
    for sid, text in rows:
        by_session.setdefault(sid, []).append(text)
    links = {
        sid: iter(append(conn, key, sid, texts, "", read_head(conn, sid))[0])
        for sid, texts in by_session.items()
    }
    stamps = (
        [created_at] * len(rows)
        if created_at is None or isinstance(created_at, str)
        else created_at
    )
    conn.executemany(
        f"INSERT INTO {MESSAGES_TABLE} (session_id, message_data, chain, created_at) "
        "VALUES (?, ?, ?, coalesce(?, CURRENT_TIMESTAMP))",
        [(sid, text, next(links[sid]), at) for (sid, text), at in zip(rows, stamps, strict=True)],
    )


def after_pop(
    conn: sqlite3.Connection,
    key: ChainKey,
    session_id: str,
    popped: Sequence[tuple[str, str | None]],
    where: str,
    link_keys: Mapping[str, ChainKey] | None = None,
) -> Point | None:
    """Move the head back past the rows just popped: their (text, link), newest first.
    The vault head's point after it (None: the file is not chained yet)."""
    stored = read_head(conn, session_id)
    if stored is None and not chained(conn):
        return None  # the upgrade has not linked this file yet
    head = chainops.head_to_move(key, session_id, stored, where)
    moved = chainops.pop_head(key, session_id, head, popped, where, link_keys)
    return write_head(conn, key, session_id, head, moved, where)


def after_clear(
    conn: sqlite3.Connection, key: ChainKey, session_id: str, where: str, forced: bool = False
) -> Point | None:
    """A new epoch: the head is kept (so an item put back after the clear is told apart).
    `forced` (clear --include-unreadable, the way to delete tampered history on purpose)
    starts the epoch after the stored head's even when that head does not authenticate.
    The vault head's point after it (None: not moved)."""
    stored = read_head(conn, session_id)
    if stored is None:
        return None  # never chained: nothing to remember
    old = Head.decode(stored)
    try:
        head = chainops.head_to_move(key, session_id, stored, where)
    except HistoryTampered:
        if not forced:
            raise
        head = chain.new_head(key, session_id)
        if old is not None:
            head = dataclasses.replace(head, epoch=old.epoch, base=old.end, end=old.end)
    try:
        return write_head(conn, key, session_id, old, chain.clear(key, session_id, head), where)
    except HistoryTampered:
        if not forced:
            raise
        # The vault head does not authenticate (a rotation keeps one that did not match):
        # it stays as it is, the session's new head written, for `memvault accept`.
        return None


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
    whole_vault: bool = True,
    floor: Floor | None = None,
) -> Verdict:
    """The session's verdict in the caller's snapshot: every row, or the newest `limit`;
    then, unless `whole_vault` is False (verify judges it once), whether the vault head
    still sums this session's head with the others' and is not behind `floor`."""
    if not chained(conn):
        return Verdict()
    head = Head.decode(read_head(conn, session_id))
    rows = session_rows(conn, session_id, limit)
    if limit is None:
        verdict = check(keys, session_id, rows, head)
    else:
        verdict = check_tail(keys, session_id, rows, head, limit)
    if verdict.ok and whole_vault:
        return Verdict(vaulthead.verdict(conn, keys, floor))
    return verdict


def verdict(
    conn: sqlite3.Connection,
    keys: Mapping[str, ChainKey],
    session_id: str,
    floor: Floor | None = None,
) -> str | None:
    """`judge`'s kind as text, or None: the session verifies."""
    kind = judge(conn, keys, session_id, floor=floor).kind
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
    out: list[tuple[str, str | None, int, str, str | None]] = []
    for new_text, row_id, old_text in updates:
        text = links.pop(row_id, None)
        link = chain.Link.decode(text)
        moved = None if link is None else chain.remac(old, new, link, old_text, new_text)
        # A row with no link gets one that never verifies: the guard refuses NULL.
        kept = text if text is not None else UNLINKED
        out.append((new_text, kept if moved is None else moved.encode(), row_id, old_text, text))
    return out


def remac_heads(conn: sqlite3.Connection, old: ChainKey, new: ChainKey) -> Point | None:
    """Every head under `old` re-MACed under `new`, and the vault head summed afresh
    under it (the rotation's switch); its point (None: one that did not match, kept)."""
    heads = vaulthead.stored_heads(conn)
    at = vaulthead.rekey(conn, old, new, heads)
    conn.executemany(
        f"UPDATE {HEADS_TABLE} SET head = ? WHERE session_id = ?",
        chainops.remac_all(old, new, heads),
    )
    return at


class _File(Protocol):
    @property
    def path(self) -> Path: ...

    def connection(self) -> AbstractContextManager[sqlite3.Connection]: ...

    def write_transaction(self) -> AbstractContextManager[sqlite3.Connection]: ...


def build(vault: _File, key: ChainKey, keys: Mapping[str, ChainKey]) -> None:
    """The upgrade: link each session's rows in id order and write its head, one session
    per transaction (a kill resumes with the sessions that have no head yet); then the
    meta says the file is chained. Rows that already carry a link are left alone. Each
    row is linked under the key its envelope names (`keys`, by kid: a rotation cut off
    leaves rows under the old one, which it re-MACs as it moves them), else `key`."""
    while True:
        with vault.write_transaction() as conn:
            if chain_state(conn) != ON and vaulthead.exists(conn):
                # Written only as a build ends: this file was made to look unchained, and
                # a build would sum whatever heads it now holds (a vault with no anchor).
                raise chainops.rewritten_unchained(str(vault.path))
            if chain_state(conn) != BUILDING:
                return  # done, or m010 not applied yet
            todo = conn.execute(
                # Text ids only: a row whose id is not text (no memvault writer puts one)
                # is left unlinked, so verify reports it, instead of looping here.
                f"SELECT DISTINCT session_id FROM {MESSAGES_TABLE} WHERE typeof(session_id) = "
                f"'text' AND session_id NOT IN (SELECT session_id FROM {HEADS_TABLE}) LIMIT 1"
            ).fetchone()
            if todo is None:
                vaulthead.start(conn, key)
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
            write_head(conn, key, sid, None, head, "")


class PurgedPrefix:
    """Which expired rows a purge deletes: each session's oldest, up to its first row
    that stays (fresh, unreadable, or one whose link does not carry the head's base
    past it), so the chain records the purge as a new base. A session whose head or
    next link does not authenticate keeps its rows and is named in `tampered`: one
    edited row never stops the purge of the others."""

    def __init__(self, keys: Mapping[str, ChainKey], key: ChainKey, where: str) -> None:
        self.keys, self.key, self.where = keys, key, where
        self.stopped: set[str] = set()
        self.tampered: set[str] = set()
        self.heads: dict[str, Head | None] = {}  # as moved so far; None: no head (unchained)
        self.before: dict[str, Head] = {}  # as stored

    def _start(self, conn: sqlite3.Connection, sid: str) -> None:
        stored = read_head(conn, sid)
        try:
            head = None if stored is None else chainops.head_to_move(self.key, sid, stored, "")
            self.heads[sid] = head
            if head is not None:
                self.before[sid] = head
        except HistoryTampered:
            self.stopped.add(sid)
            self.tampered.add(sid)

    def take(
        self,
        conn: sqlite3.Connection,
        batch: Sequence[tuple[int, str, str]],
        expired: list[tuple[int]],
    ) -> list[tuple[int]]:
        """The (id,) of `batch`'s rows to delete, of those `expired` names; read before
        they are deleted (their links move the heads)."""
        doomed_ids = {e[0] for e in expired}
        links: dict[int, str | None] = {}
        if doomed_ids:
            links = dict(
                conn.execute(
                    f"SELECT id, chain FROM {MESSAGES_TABLE} WHERE id BETWEEN ? AND ?",
                    (min(doomed_ids), max(doomed_ids)),
                ).fetchall()
            )
        out: list[tuple[int]] = []
        for row_id, sid, data in batch:
            if sid in self.stopped:
                continue
            if row_id not in doomed_ids:
                self.stopped.add(sid)
                continue
            if sid not in self.heads:
                self._start(conn, sid)
                if sid in self.stopped:
                    continue
            head = self.heads[sid]
            if head is not None:
                link = chain.Link.decode(links.get(row_id))
                link_key = self.keys.get(crypto.kid_of(data) or "", self.key)
                try:
                    if link is None:
                        raise ValueError("no link")
                    self.heads[sid] = chain.purge(self.key, sid, head, link, data, link_key)
                except ValueError:
                    self.stopped.add(sid)
                    self.tampered.add(sid)
                    continue
            out.append((row_id,))
        return out

    def move_heads(self, conn: sqlite3.Connection) -> Point | None:
        """Each purged session's head moved; the vault head's point after them."""
        at = None
        for sid, head in self.heads.items():
            if head is not None and head != self.before[sid]:
                at = write_head(conn, self.key, sid, self.before[sid], head, self.where) or at
        return at
