"""A vault file: its header check, its meta and audit rows, and `VaultFile`.

Connections and SQLite's errors are vault.engines.sqlite.conn's; every change opens
its transaction with `VaultFile.write_transaction`. A file is checked with
`check_header` before SQLite opens (and possibly writes) anything.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault import files, paths, testhooks
from vault.engines.sqlite.conn import (
    DEFAULT_LOCK_TIMEOUT,
    ENV_LOCK_TIMEOUT,
    MAX_LOCK_TIMEOUT,
    configure,
    connect,
    error_name,
    is_busy,
    is_damage,
    keep_temp_in_memory,
    lock_exclusively,
    lock_timeout,
    open_here,
    peek,
    sqlite_errors,
    translate,
)
from vault.engines.sqlite.schema import (
    GUARD_MESSAGE,
    MESSAGES_TABLE,
    SHRED_MAGIC,
    SQLITE_MAGIC,
    utcnow,
)
from vault.errors import NotAVault, OperationFailed, VaultCorrupt
from vault.vaultops import MetaKeys, parse_ttl

if TYPE_CHECKING:
    from vault.engines.sqlite.wrapped import FileWrappedKeys

# Connections and their errors are sqlite.conn's, importable from here as they always were.
__all__ = [
    "BATCH_ROWS",
    "DEFAULT_LOCK_TIMEOUT",
    "ENV_LOCK_TIMEOUT",
    "MAX_LOCK_TIMEOUT",
    "SCRUB_PATIENCE",
    "SCRUB_WAIT",
    "VaultFile",
    "audit",
    "check_header",
    "configure",
    "connect",
    "error_name",
    "is_busy",
    "is_damage",
    "keep_temp_in_memory",
    "lock_exclusively",
    "lock_timeout",
    "parse_ttl",
    "peek",
    "read_header",
    "read_meta",
    "refuse_odd_side_files",
    "row_batches",
    "set_meta",
    "sqlite_errors",
    "translate",
]

# Checkpoints wait this long for readers before the scrub reports itself incomplete.
SCRUB_WAIT = 2.0
# ... and try again, for this long at most, as long as each attempt gets further
# (writers and other checkpoints delay it; a reader's snapshot pins it).
SCRUB_PATIENCE = 30.0


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
def meta_rows(conn: sqlite3.Connection) -> dict[str, str]:
    """The meta table's rows as they are, none required (`read_meta` checks them)."""
    return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())


def read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, str]:
    try:
        meta = meta_rows(conn)
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
class VaultFile(MetaKeys):
    """A vault file: its connections, its one transaction opener, meta, audit and scrub.

    The key lifecycle (`sqlite.lifecycle`) and the vault's operations (`sqlite.vault`)
    build on it.
    """

    path: Path
    backend = "sqlite"
    guard_message = GUARD_MESSAGE  # what the file's triggers say when they refuse a row

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
        opened = open_here()
        opened.append((self.path.absolute(), conn))
        try:
            with sqlite_errors(self.path):
                yield conn
        finally:
            opened.remove((self.path.absolute(), conn))
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

    def wrapped_keys(self) -> FileWrappedKeys:
        from vault.engines.sqlite.wrapped import FileWrappedKeys

        return FileWrappedKeys(self)

    def record(self, event: str, kid: str | None, **details: Any) -> None:
        """Append one audit event in a transaction of its own."""
        with self.write_transaction() as conn:
            audit(conn, event, kid, **details)

    def switch_meta(
        self,
        expect: dict[str, str | None],
        put: dict[str, str],
        drop: list[str],
        event: str,
        details: dict[str, Any],
    ) -> bool:
        """Delete the meta rows `drop` and set `put`, audited as `event`, in one transaction,
        only if the meta still holds `expect` (None: absent) and no rotation has a key
        version staged (pending); False, nothing written, if not."""
        with self.write_transaction() as conn:
            meta = read_meta(conn, self.path)
            staged = conn.execute("SELECT 1 FROM memvault_keys WHERE state = 'pending'")
            if any(meta.get(k) != v for k, v in expect.items()) or staged.fetchone():
                return False
            self.before_switch(conn, {k: v for k, v in meta.items() if k not in drop} | put)
            conn.executemany("DELETE FROM memvault_meta WHERE key = ?", [(k,) for k in drop])
            set_meta(conn, **put)
            audit(conn, event, meta["kid"], **details)
        return True

    def before_switch(self, conn: sqlite3.Connection, after: dict[str, str]) -> None:
        """What `switch_meta` checks in its transaction besides `expect`, the meta being
        switched to `after`: nothing here (the key-holding vault's refuses a file put back
        from an older copy, and seals its vault head for the source `after` names)."""

    def audit_log(self) -> list[dict[str, Any]]:
        with self.connection() as conn:
            return [
                {"at": at, "event": ev, "kid": kid, **json.loads(details)}
                for at, ev, kid, details in conn.execute(
                    "SELECT at, event, kid, details FROM memvault_audit ORDER BY id"
                )
            ]

    def row_batches(self) -> Iterator[list[tuple[int, str, str]]]:
        """Every item row, BATCH_ROWS at a time, from one snapshot (`row_batches` below)."""
        with self.connection() as conn:
            conn.execute("BEGIN")  # deferred: the first SELECT fixes the snapshot
            yield from row_batches(conn)

    def scrub_after_delete(self) -> bool:
        """Scrub after rows were deleted elsewhere (the agent session's pop).

        Marked pending first, so that a scrub kept from finishing by a reader is
        finished by the next open.
        """
        with self.write_transaction() as conn:
            set_meta(conn, scrub_pending="1")
        return self.scrub()

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
