"""SQLite connections to a vault file, their errors, and the meta and audit rows.

Every connection to a vault is made by `connect` (pragmas included), every
SQLite error becomes one `VaultError` in `translate`, and every change opens
its transaction with `VaultFile.write_transaction`. A file is checked with
`check_header` before SQLite opens (and possibly writes) anything.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vault import files, paths, testhooks
from vault.engines.sqlite.schema import (
    GUARD_MESSAGE,
    MESSAGES_TABLE,
    SHRED_MAGIC,
    SQLITE_MAGIC,
    utcnow,
)
from vault.errors import BadInput, NotAVault, OperationFailed, VaultBusy, VaultCorrupt, VaultError

ENV_LOCK_TIMEOUT = "MEMVAULT_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 120.0
# One day: SQLite takes the timeout in milliseconds as a C int; far larger values overflow.
MAX_LOCK_TIMEOUT = 86400.0
# Checkpoints wait this long for readers before the scrub reports itself incomplete.
SCRUB_WAIT = 2.0
# ... and try again, for this long at most, as long as each attempt gets further
# (writers and other checkpoints delay it; a reader's snapshot pins it).
SCRUB_PATIENCE = 30.0


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


def connect(path: Path, timeout: float | None = None) -> sqlite3.Connection:
    """Open an existing file read-write; never creates one (mode=rw)."""
    uri = "file:" + urllib.parse.quote(str(path)) + "?mode=rw"
    t = lock_timeout() if timeout is None else timeout
    conn = sqlite3.connect(uri, uri=True, timeout=t, isolation_level=None, check_same_thread=False)
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


# --------------------------------------------------------------------------
# Is it a vault file? Checked before SQLite opens anything.
# --------------------------------------------------------------------------
def _file_header(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(100)


def read_header(path: Path) -> bytes:
    """The file's first bytes, or the error that says why there is no vault file."""
    if not path.exists():
        raise NotAVault(
            f"no vault at {path}; create one with `memvault init`, or point --db / "
            "MEMVAULT_DB at an existing vault"
        )
    files.require_regular(path)  # a FIFO or device would block or lie; never opened
    try:
        return _file_header(path)
    except OSError as exc:
        raise OperationFailed(
            f"cannot read {path} ({exc.strerror}); check its permissions; nothing was changed"
        ) from None


def check_header(path: Path) -> None:
    """Reject what is plainly not a vault before SQLite touches (or creates) anything."""
    header = read_header(path)
    if header.startswith(SHRED_MAGIC):
        raise NotAVault(
            f"{path} is a vault whose shred was interrupted; run `memvault shred` "
            "again to finish it"
        )
    if not header:
        raise NotAVault(f"{path} is empty, not a memvault vault")
    if not header.startswith(SQLITE_MAGIC):
        raise NotAVault(
            f"{path} is not a SQLite database, so it is not a memvault vault; "
            "point --db or MEMVAULT_DB at your vault"
        )
    if len(header) >= 32:
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(header[28:32], "big")
        size = path.stat().st_size
        if pages and page_size and size < pages * page_size and not _sqlite_finds_it_whole(path):
            raise VaultCorrupt(
                f"{path} is truncated ({size} bytes where its header says "
                f"{pages * page_size}); nothing was changed; restore the vault from a backup"
            )


def refuse_odd_side_files(path: Path) -> None:
    """SQLite follows a link at `-wal`/`-shm`/`-journal` and writes through it: refuse."""
    odd = files.odd_entries(paths.sidecars(path)[1:])
    if odd:
        p, what = odd[0]
        raise OperationFailed(
            f"{p} is a {what}, not a file SQLite made; SQLite would write through it; move "
            f"it away (for a link, `rm` removes only the name) and retry; nothing was changed"
        )


def _sqlite_finds_it_whole(path: Path) -> bool:
    """Whether SQLite reads every page of a file shorter than its header says.

    A shorter file is not proof of damage: a checkpoint copies the WAL's page 1 (with
    the new page count) before the pages that extend the file, so a process killed
    mid-checkpoint leaves the missing pages in the WAL, and SQLite reads them from
    there. Only a file whose pages SQLite cannot find is truncated.
    """
    refuse_odd_side_files(path)  # before SQLite opens (and may write) the side files
    with sqlite_errors(path):
        conn = connect(path)
    try:
        try:
            return conn.execute("PRAGMA quick_check(1)").fetchall() == [("ok",)]
        except sqlite3.DatabaseError as exc:
            if isinstance(translate(exc, path), VaultCorrupt):
                return False
            raise translate(exc, path) from None
    finally:
        conn.close()


# --------------------------------------------------------------------------
# The meta and audit rows
# --------------------------------------------------------------------------
def read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, str]:
    try:
        meta = dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
    except sqlite3.OperationalError as exc:
        # SQLite has no code of its own for a missing table (SQLITE_ERROR): look.
        if (
            error_name(exc) == "SQLITE_ERROR"
            and not conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'memvault_meta'"
            ).fetchone()
        ):
            raise NotAVault(
                f"{path} is a SQLite database but not a memvault vault; to encrypt a plaintext "
                "SQLiteSession file into a vault use `memvault import`"
            ) from None
        raise
    for required in ("format", "vault_id", "kid"):
        if required not in meta:
            raise NotAVault(f"{path} lacks the vault's {required}; it is not a usable vault")
    return meta


def parse_ttl(meta: dict[str, str], path: Path) -> int | None:
    """The vault's TTL in seconds (None: never), or VaultCorrupt for a value no command wrote."""
    raw = meta.get("ttl_seconds", "never")
    if raw == "never":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise VaultCorrupt(
            f"{path} has an invalid TTL {raw[:40]!r} in memvault_meta; nothing was read; "
            "set it again with `memvault ttl 30d` (or `never`)"
        )
    return value


def set_meta(conn: sqlite3.Connection, **values: str) -> None:
    conn.executemany(
        "INSERT INTO memvault_meta (key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        values.items(),
    )


def audit(conn: sqlite3.Connection, event: str, kid: str | None, **details: Any) -> None:
    """Append an audit event inside the caller's transaction: counts only, never content."""
    conn.execute(
        "INSERT INTO memvault_audit (at, event, kid, details) VALUES (?, ?, ?, ?)",
        (utcnow(), event, kid, json.dumps(details, sort_keys=True)),
    )


# --------------------------------------------------------------------------
# One vault file
# --------------------------------------------------------------------------
class VaultFile:
    """A vault file: its connections, its one transaction opener, meta, audit and scrub.

    The key lifecycle (`sqlite.lifecycle`) and the vault's operations (`sqlite.vault`)
    build on it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[sqlite3.Connection]:
        """A configured connection; SQLite errors inside become VaultErrors; rolled back
        and closed at the end."""
        if not self.path.exists():
            read_header(self.path)  # shredded or moved since this object opened it
        with sqlite_errors(self.path):
            conn = connect(self.path, timeout)
        try:
            with sqlite_errors(self.path):
                yield conn
        finally:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            conn.close()

    @contextlib.contextmanager
    def write_transaction(self, timeout: float | None = None) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE (the write lock, waited for) ... COMMIT when the block ends.

        If the block raises, nothing is committed. The block never commits itself.
        """
        with self.connection(timeout) as conn:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")

    def meta(self) -> dict[str, str]:
        with self.connection() as conn:
            return read_meta(conn, self.path)

    @property
    def vault_id(self) -> str:
        return self.meta()["vault_id"]

    @property
    def ttl(self) -> int | None:
        return parse_ttl(self.meta(), self.path)

    def record(self, event: str, kid: str | None, **details: Any) -> None:
        """Append one audit event in a transaction of its own."""
        with self.write_transaction() as conn:
            audit(conn, event, kid, **details)

    def audit_log(self) -> list[dict[str, Any]]:
        with self.connection() as conn:
            return [
                {"at": at, "event": ev, "kid": kid, **json.loads(details)}
                for at, ev, kid, details in conn.execute(
                    "SELECT at, event, kid, details FROM memvault_audit ORDER BY id"
                )
            ]

    def scrub(self) -> bool:
        """Checkpoint the WAL (TRUNCATE) so no replaced or deleted bytes remain.

        No VACUUM: every connection has `secure_delete` on, so SQLite zeroes a cell
        when it is deleted or rewritten and a page when it is freed; the checkpoint
        copies those pages over the old ones in the file, and TRUNCATE empties the
        WAL that held them. A VACUUM rewrote the whole file (and, with
        `temp_store = MEMORY`, held a copy of it in memory) to remove nothing more:
        the residue tests are the proof (SECURITY.md, "Scrub").

        Returns False, leaving `scrub_pending` set for the next open, when another
        process's read transaction keeps the checkpoint from finishing. An agent writing
        all along, or checkpointing itself after a commit, only delays it: the attempts go
        on while they make progress (a reader holding one snapshot stops them at once:
        the frames after its snapshot cannot be copied while it reads).
        """
        with self.connection(timeout=SCRUB_WAIT) as conn:
            try:
                deadline = time.monotonic() + SCRUB_PATIENCE
                seen: tuple[int, int] | None = None
                while True:
                    busy, wal_frames, copied = conn.execute(
                        "PRAGMA wal_checkpoint(TRUNCATE)"
                    ).fetchone()
                    if not busy:
                        break
                    if time.monotonic() >= deadline:
                        return False
                    if wal_frames < 0:
                        # Another connection is checkpointing (an agent's automatic one
                        # after its first commit on a large WAL): it copies for us.
                        time.sleep(0.05)
                        continue
                    if (wal_frames, copied) == seen:
                        return False  # no progress: a reader holds its snapshot
                    seen = (wal_frames, copied)
                testhooks.failpoint("during-scrub")
                conn.execute("BEGIN IMMEDIATE")
                set_meta(conn, scrub_pending="0")
                conn.execute("COMMIT")
                # Old bytes are gone already; this one only empties the WAL of the meta page.
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.OperationalError as exc:
                if is_busy(exc):
                    return False
                raise
        return True


BATCH_ROWS = 1000


def row_batches(conn: sqlite3.Connection) -> Iterator[list[tuple[int, str, str]]]:
    """Every item row as (id, session_id, message_data), in id order, BATCH_ROWS at a time.

    Memory stays flat whatever the size of the vault. Each batch is read after the caller
    is done with the previous one, so the caller may update or delete its rows in between
    (in the same transaction: the scan resumes after the last id it returned).
    """
    last = -1
    while True:
        batch = conn.execute(
            f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} "
            "WHERE id > ? ORDER BY id LIMIT ?",
            (last, BATCH_ROWS),
        ).fetchall()
        if not batch:
            return
        yield batch
        last = batch[-1][0]
