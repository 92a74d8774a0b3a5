"""The source of `memvault import`: a plaintext `SQLiteSession` file.

Opening it (read-only, or locked exclusively for --shred-source), recognising
its tables by their shape (the SDK's exact columns, the messages table's
foreign key to the sessions table), and what an import plans from it. Reads
only; `vault.importer` does the sealing, the checks against the vault and the
shredding.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vault import crypto
from vault.engines.sqlite.db import error_name, is_busy, keep_temp_in_memory
from vault.engines.sqlite.schema import MESSAGES_TABLE
from vault.errors import OperationFailed, VaultBusy

SESSION_COLUMNS = ("session_id", "created_at", "updated_at")
MESSAGE_COLUMNS = ("id", "session_id", "message_data", "created_at")
# Tables SQLite itself keeps; they are not the user's data.
INTERNAL_TABLES = (
    "sqlite_sequence",
    "sqlite_stat1",
    "sqlite_stat2",
    "sqlite_stat3",
    "sqlite_stat4",
)
# How long the exclusive lock on the source may be waited for (--shred-source).
SOURCE_LOCK_WAIT = 2.0


class NotUTF8(ValueError):
    """A TEXT value of the source that is not valid UTF-8 (raised by the text factory)."""


def _strict_text(raw: bytes) -> str:
    # SQLiteSession writes UTF-8 only; anything else was altered or written by another
    # tool, and would fail later, half-way, as an encoding error.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise NotUTF8() from None


def is_text(value: str) -> bool:
    """False for a string holding a lone surrogate (not encodable as UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode_row(row: str, data: Any) -> Any:
    """The item a source row holds, or OperationFailed naming `row` (its place in the
    source) when no SQLiteSession item can be made of it."""
    try:
        try:
            item = json.loads(data)
        except json.JSONDecodeError:
            raise
        except ValueError:  # more digits than Python converts to an int
            raise OperationFailed(
                f"{row} holds a number of more digits than Python reads, so no session "
                "could read it back; repair or delete that row; nothing was imported"
            ) from None
        # Python reads NaN, Infinity and 1e999 (as inf); RFC 8259 JSON has none of them,
        # so an export could not write the item as standard JSON: refused here.
        text = json.dumps(item, ensure_ascii=False, allow_nan=False)
    except (json.JSONDecodeError, TypeError):
        raise OperationFailed(
            f"{row} is not JSON, so it is not a SQLiteSession item; "
            "repair or delete that row; nothing was imported"
        ) from None
    except RecursionError:
        raise OperationFailed(
            f"{row} is nested deeper than the JSON parser can take, so no session could "
            "read it back; repair or delete that row; nothing was imported"
        ) from None
    except ValueError:
        raise OperationFailed(
            f"{row} holds NaN or an infinite number, which standard JSON (RFC 8259) "
            "cannot hold; repair or delete that row; nothing was imported"
        ) from None
    # JSON may escape a lone surrogate ("\\ud800"): valid JSON, but not text that can
    # be sealed (UTF-8) or given back to the SDK.
    if not is_text(text):
        raise OperationFailed(
            f"{row} holds a lone surrogate, which is not valid Unicode "
            "text; repair or delete that row; nothing was imported"
        )
    return item


def quote_name(name: str) -> str:
    """Quote an SQL identifier (custom table names come from the source file)."""
    return '"' + name.replace('"', '""') + '"'


@dataclass
class SourceSession:
    session_id: str
    items: int
    created_at: str | None = None
    updated_at: str | None = None


@dataclass
class Plan:
    """What an import will do; built and checked before anything is written."""

    source: Path
    sessions_table: str
    messages_table: str
    sessions: list[SourceSession]
    other_tables: list[str] = field(default_factory=list)
    shred_source: bool = False

    @property
    def total_items(self) -> int:
        return sum(s.items for s in self.sessions)


def digest_update(h: Any, item: Any) -> None:
    """One item into a digest that the source's and the vault's copies are compared by."""
    h.update(
        json.dumps(
            item, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str
        ).encode("utf-8")
    )
    h.update(b"\n")


def open_source(src: Path, shred_source: bool) -> sqlite3.Connection:
    """The source, read-only; with shred_source, writable and locked exclusively."""
    uri = "file:" + urllib.parse.quote(str(src)) + ("?mode=rw" if shred_source else "?mode=ro")
    try:
        conn = sqlite3.connect(
            uri, uri=True, isolation_level=None, timeout=SOURCE_LOCK_WAIT, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise OperationFailed(f"cannot open {src} ({exc}); nothing was imported") from None
    conn.text_factory = _strict_text
    try:
        keep_temp_in_memory(conn)
        if shred_source:
            conn.execute("PRAGMA secure_delete = ON")
            # Held until close, and refused while any other connection has the file
            # open: nothing can be added between the read and the destruction.
            conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            conn.execute("BEGIN EXCLUSIVE")
        else:
            conn.execute("BEGIN")  # one snapshot for the inspection and the copy
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        conn.close()
        if is_busy(exc):
            raise VaultBusy(
                f"{src} is in use by another process (an agent still writing to it?); close "
                "it and run the import again; nothing was imported"
            ) from None
        if error_name(exc) == "SQLITE_NOTADB":
            raise OperationFailed(
                f"{src} is not a SQLite database, so it is not a SQLiteSession file; "
                "nothing was imported"
            ) from None
        raise OperationFailed(f"cannot read {src} ({exc}); nothing was imported") from None
    return conn


def _columns(conn: sqlite3.Connection, table: str) -> list[tuple[str, int]]:
    return [(r[1], r[5]) for r in conn.execute(f"PRAGMA table_info({quote_name(table)})")]


def is_sessions_table(conn: sqlite3.Connection, table: str) -> bool:
    cols = _columns(conn, table)
    return sorted(c for c, _ in cols) == sorted(SESSION_COLUMNS) and ("session_id", 1) in cols


def is_messages_table(conn: sqlite3.Connection, table: str) -> bool:
    cols = _columns(conn, table)
    return sorted(c for c, _ in cols) == sorted(MESSAGE_COLUMNS) and ("id", 1) in cols


def references(conn: sqlite3.Connection, messages: str) -> list[str]:
    return [
        r[2]
        for r in conn.execute(f"PRAGMA foreign_key_list({quote_name(messages)})")
        if r[3] == "session_id"
    ]


def list_tables(conn: sqlite3.Connection) -> list[str]:
    return [
        r[0]
        for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
    ]


def find_pair(
    conn: sqlite3.Connection,
    src: Path,
    tables: list[str],
    sessions_table: str | None,
    messages_table: str | None,
) -> tuple[str, str]:
    """The (sessions, messages) tables to import: the ones named, else the one pair
    whose shape and foreign key are the SDK's."""
    for given, kind, check in (
        (sessions_table, "sessions", is_sessions_table),
        (messages_table, "messages", is_messages_table),
    ):
        if given is None:
            continue
        if given not in tables:
            raise OperationFailed(
                f"{src} has no table {given!r} (its tables: {', '.join(tables) or 'none'}); "
                "nothing was imported"
            )
        if not check(conn, given):
            raise OperationFailed(
                f"table {given!r} of {src} does not have the columns of a SQLiteSession "
                f"{kind} table; nothing was imported"
            )
    session_tables = {t for t in tables if is_sessions_table(conn, t)}
    pairs = [
        (ref, m)
        for m in tables
        if is_messages_table(conn, m)
        for ref in references(conn, m)
        if ref in session_tables
    ]
    if sessions_table and messages_table:
        return sessions_table, messages_table
    if sessions_table:
        pairs = [p for p in pairs if p[0] == sessions_table]
    if messages_table:
        pairs = [p for p in pairs if p[1] == messages_table]
        if not pairs:
            raise OperationFailed(
                f"table {messages_table!r} of {src} does not reference a sessions table; "
                "name it with --sessions-table; nothing was imported"
            )
    if not pairs:
        if sessions_table:
            raise OperationFailed(
                f"no messages table of {src} references {sessions_table!r}; name it with "
                "--messages-table; nothing was imported"
            )
        if {"memvault_meta", MESSAGES_TABLE} <= set(tables):
            raise OperationFailed(
                f"{src} is a memvault vault, not a plaintext SQLiteSession file; "
                "nothing was imported"
            )
        raise OperationFailed(
            f"{src} is a SQLite database but not a SQLiteSession file: no pair of tables "
            "has the SDK's sessions/messages columns (name custom tables with "
            "--sessions-table and --messages-table); nothing was imported"
        )
    if len(pairs) > 1:
        names = ", ".join(f"{s}/{m}" for s, m in pairs)
        raise OperationFailed(
            f"{src} holds several SQLiteSession table pairs ({names}); choose one with "
            "--sessions-table and --messages-table; nothing was imported"
        )
    return pairs[0]


class ReadBack:
    """A session's rows read back inside its transaction, one at a time: `done` raises
    OperationFailed (the transaction is rolled back) unless the vault holds the same
    count, items and order as the source."""

    def __init__(self, sid: str, sealer: crypto.Sealer) -> None:
        self.sid, self.sealer = sid, sealer
        self.digest = hashlib.sha256()
        self.stored = 0

    def add(self, data: str) -> bool:
        """False at the first row that does not open: the check fails."""
        opened = self.sealer.open(self.sid, data, None)
        if opened.state is not crypto.ItemState.READABLE:
            return False
        digest_update(self.digest, opened.item)
        self.stored += 1
        return True

    def done(self, s: SourceSession, count: int, source_digest: Any, part: int) -> None:
        if (
            self.stored != count
            or count != s.items
            or self.digest.digest() != source_digest.digest()
        ):
            raise OperationFailed(
                f"verification of session {self.sid!r} failed ({count} item(s) read from the "
                f"source, {s.items} expected, {self.stored} readable in the vault); it was "
                f"rolled back and not imported ({part - 1} session(s) before it were)"
            )
