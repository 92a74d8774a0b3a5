"""SQLite connections to a vault file and their errors.

Every connection to a vault is made by `connect` (pragmas included), and every
SQLite error becomes one `VaultError` in `translate`. vault.engines.sqlite.db
builds the vault file's transactions, meta and audit rows on them.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vault.engines.sqlite.schema import GUARD_MESSAGE
from vault.errors import BadInput, NotAVault, OperationFailed, VaultBusy, VaultCorrupt, VaultError

ENV_LOCK_TIMEOUT = "MEMVAULT_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 120.0
# One day: SQLite takes the timeout in milliseconds as a C int; far larger values overflow.
MAX_LOCK_TIMEOUT = 86400.0


def lock_timeout() -> float:
    """How long writers wait for the write lock (rotations can take a while).

    A set but unusable `$MEMVAULT_LOCK_TIMEOUT` is refused (exit 2) instead of being
    ignored: a typo must not turn a short timeout into the two-minute default.
    """
    raw = os.environ.get(ENV_LOCK_TIMEOUT)
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 <= value <= MAX_LOCK_TIMEOUT):  # also refuses nan and inf
        raise BadInput(
            f"{ENV_LOCK_TIMEOUT}={raw!r} is not a number of seconds between 0 and "
            f"{MAX_LOCK_TIMEOUT:.0f}; fix or unset it; nothing was changed"
        )
    return value


# --------------------------------------------------------------------------
# Connections and error translation
# --------------------------------------------------------------------------
def keep_temp_in_memory(conn: sqlite3.Connection) -> None:
    """No temporary file (a sort, an index build) ever holds vault bytes or plaintext:
    for every connection memvault opens, to a vault, an import source or memory."""
    conn.execute("PRAGMA temp_store = MEMORY")


def peek(path: Path, timeout: float) -> sqlite3.Connection:
    """A read-only SQLite connection to a database file that never creates one.

    SQLite's mode=ro cannot create the database, but does create a WAL file's `-wal`
    and `-shm` for a reader when they are missing (a file closed cleanly has none);
    then the file is opened `immutable`: with no `-wal`, every committed row is in
    the file itself. A writer starting between the check and the read may make the
    read fail or, at worst, leave the two files a reader creates.
    """
    wal, shm = (Path(f"{path}{suffix}") for suffix in ("-wal", "-shm"))
    live = os.path.exists(wal) and os.path.exists(shm)
    uri = "file:" + urllib.parse.quote(str(path)) + ("?mode=ro" if live else "?mode=ro&immutable=1")
    conn = sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None)
    keep_temp_in_memory(conn)
    return conn


def lock_exclusively(conn: sqlite3.Connection, path: Path, then: str) -> None:
    """Begin a transaction holding the file's exclusive lock until `conn` closes.

    In exclusive locking mode the lock outlives every commit, and it cannot be taken
    while any other connection has the file open: VaultBusy (exit 5) then says what
    the user does `then` ("run shred again; nothing was destroyed").
    """
    conn.execute("PRAGMA locking_mode = EXCLUSIVE")
    try:
        conn.execute("BEGIN EXCLUSIVE")
    except sqlite3.OperationalError as exc:
        if is_busy(exc):
            raise VaultBusy(
                f"{path} is in use by another process; close the agents and commands using "
                f"it, then {then}"
            ) from None
        raise


def configure(conn: sqlite3.Connection, timeout: float) -> None:
    """Pragmas every vault connection uses (the SDK session's connections too)."""
    conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
    conn.execute("PRAGMA secure_delete = ON")  # deleted cells and pages are zeroed
    keep_temp_in_memory(conn)
    conn.execute("PRAGMA synchronous = FULL")
    if sys.platform == "darwin":
        conn.execute("PRAGMA fullfsync = ON")


class VaultConnection(sqlite3.Connection):
    """A connection that knows whether it holds the write lock: a wrapped key stored
    while a rotation holds it must go into that same transaction (any other connection
    would wait for the lock its own process holds)."""

    immediate = False

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        if sql[:5].upper() == "BEGIN":
            self.immediate = sql.upper().split()[1:2] in (["IMMEDIATE"], ["EXCLUSIVE"])
        return super().execute(sql, parameters)

    @property
    def holds_write_lock(self) -> bool:
        return self.in_transaction and self.immediate


_opened = threading.local()


def open_here() -> list[tuple[Path, sqlite3.Connection]]:
    """The connections this thread has open through `VaultFile.connection`, innermost last."""
    if not hasattr(_opened, "conns"):
        _opened.conns = []
    conns: list[tuple[Path, sqlite3.Connection]] = _opened.conns
    return conns


def write_locked_connection(path: Path) -> sqlite3.Connection | None:
    """The connection of this thread that holds `path`'s write lock, if one does: a
    write made meanwhile must go through it (another connection would wait for it)."""
    where = path.absolute()
    for p, conn in reversed(open_here()):
        if p == where and getattr(conn, "holds_write_lock", False):
            return conn
    return None


def connect(path: Path, timeout: float | None = None) -> sqlite3.Connection:
    """Open an existing file read-write; never creates one (mode=rw)."""
    uri = "file:" + urllib.parse.quote(str(path)) + "?mode=rw"
    t = lock_timeout() if timeout is None else timeout
    conn = sqlite3.connect(
        uri,
        uri=True,
        timeout=t,
        isolation_level=None,
        check_same_thread=False,
        factory=VaultConnection,
    )
    try:
        configure(conn, t)
    except BaseException:
        conn.close()
        raise
    return conn


def error_name(exc: sqlite3.Error) -> str:
    """SQLite's primary result code for `exc`: "SQLITE_BUSY" for SQLITE_BUSY_SNAPSHOT.

    Errors are classified by code, never by message text (which varies between
    SQLite builds). "" for an error the sqlite3 module raised itself (a closed
    connection, a bad parameter), which carries no code.
    """
    name = getattr(exc, "sqlite_errorname", None) or ""
    # Extended codes are the primary name plus a suffix (SQLITE_IOERR_SHORT_READ).
    return "_".join(name.split("_")[:2])


def is_busy(exc: sqlite3.Error) -> bool:
    """Another connection holds a lock this one needs."""
    return error_name(exc) in ("SQLITE_BUSY", "SQLITE_LOCKED")


def is_damage(exc: sqlite3.Error) -> bool:
    """SQLite cannot parse the file (damaged, truncated, or no database at all)."""
    return error_name(exc) in ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def translate(exc: sqlite3.Error, path: Path) -> VaultError:
    """One user-facing error for each way SQLite can fail on a vault file."""
    text = str(exc)
    name = error_name(exc)
    if name == "SQLITE_NOTADB":
        return NotAVault(
            f"{path} is not a SQLite database, so it is not a memvault vault; "
            "point --db or MEMVAULT_DB at your vault"
        )
    if name == "SQLITE_CORRUPT":
        return VaultCorrupt(
            f"{path} is damaged ({text}); nothing was changed; restore the vault from a backup"
        )
    if is_busy(exc):
        return VaultBusy(
            f"{path} is busy: another process holds its lock ({text}); wait for "
            f"it to finish, or raise {ENV_LOCK_TIMEOUT} (seconds)"
        )
    if name in ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_AUTH"):
        return OperationFailed(
            f"cannot write to {path} or its folder ({text}); check the "
            "permissions of the file and its folder; nothing was changed"
        )
    if name in ("SQLITE_IOERR", "SQLITE_FULL"):
        return OperationFailed(
            f"I/O error on {path} ({text}); check the disk; the last committed state is intact"
        )
    if GUARD_MESSAGE in text:  # our own trigger's refusal (SQLITE_CONSTRAINT_TRIGGER)
        return OperationFailed(f"{text}; nothing was stored")
    return OperationFailed(f"SQLite error on {path}: {text}")


@contextlib.contextmanager
def sqlite_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as exc:
        raise translate(exc, path) from exc
