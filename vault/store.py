"""The vault file: SQLite schema, key checks and every operation the CLI offers.

The file keeps the SDK's own `agent_sessions` / `agent_messages` tables
unchanged (so `SQLiteSession` can still open it) and adds `memvault_meta`,
`memvault_audit`, `memvault_migrations` and guard triggers. This module never
imports `agents`: only `vault.session` does, when an agent session is opened.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import secrets
import sqlite3
import stat
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import crypto, files, paths
from .errors import (
    BadInput,
    Interrupted,
    ItemsUnreadable,
    KeyMismatch,
    KeyProblem,
    KeyRevoked,
    NotAVault,
    OperationFailed,
    UnknownSession,
    VaultBusy,
    VaultCorrupt,
    VaultError,
    VaultExists,
)
from .keys import KeyStore, require_key

FORMAT = "memvault/1"
DEFAULT_TTL = 30 * 86400
SESSIONS_TABLE = "agent_sessions"
MESSAGES_TABLE = "agent_messages"
SQLITE_MAGIC = b"SQLite format 3\x00"
# A shred in progress stamps the file so that a second run recognises and finishes it.
SHRED_MAGIC = b"memvault-shred\x00\x00"
ENV_LOCK_TIMEOUT = "MEMVAULT_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 120.0
# One day: SQLite takes the timeout in milliseconds as a C int; far larger values overflow.
MAX_LOCK_TIMEOUT = 86400.0
# Checkpoints wait this long for readers before the scrub reports itself incomplete.
SCRUB_WAIT = 2.0

Progress = Callable[[int], None]
T = TypeVar("T")


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


def utcnow() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------
# Schema: migrations are a list of functions, each recorded once by name.
# --------------------------------------------------------------------------
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = []


def migration(fn: Callable[[sqlite3.Connection], None]) -> Callable[[sqlite3.Connection], None]:
    MIGRATIONS.append(fn)
    return fn


@migration
def m001_sdk_tables(conn: sqlite3.Connection) -> None:
    # The exact DDL of the SDK's SQLiteSession, so the SDK recognises the file.
    conn.execute(
        f"""CREATE TABLE IF NOT EXISTS {SESSIONS_TABLE} (
                session_id TEXT PRIMARY KEY,
                created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
                updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
            )"""
    )
    conn.execute(
        f"""CREATE TABLE IF NOT EXISTS {MESSAGES_TABLE} (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                session_id TEXT NOT NULL,
                message_data TEXT NOT NULL,
                created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
                FOREIGN KEY (session_id) REFERENCES {SESSIONS_TABLE} (session_id)
                    ON DELETE CASCADE
            )"""
    )
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS idx_{MESSAGES_TABLE}_session_id "
        f"ON {MESSAGES_TABLE} (session_id, id)"
    )


@migration
def m002_meta(conn: sqlite3.Connection) -> None:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS memvault_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
    )


# A row may enter agent_messages only as a well-formed envelope under the current kid:
# this refuses plaintext from a bare SQLiteSession, items under another key, and a
# writer that opened the vault before a rotation.
_NOT_SEALED = """
    CASE WHEN json_valid(NEW.message_data) THEN
        json_type(NEW.message_data) IS NOT 'object'
        OR json_extract(NEW.message_data, '$.__enc__') IS NOT 1
        OR json_type(NEW.message_data, '$.payload') IS NOT 'text'
        OR json_extract(NEW.message_data, '$.payload') NOT GLOB 'gAAAAA*'
        OR json_extract(NEW.message_data, '$.kid') IS NOT
            (SELECT value FROM memvault_meta WHERE key = 'kid')
        OR (SELECT count(*) FROM json_each(NEW.message_data)) != 4
    ELSE 1 END
"""
GUARD_MESSAGE = "memvault: refused an item not sealed with the vault's current key"


@migration
def m003_guard_triggers(conn: sqlite3.Connection) -> None:
    conn.execute(
        f"""CREATE TRIGGER IF NOT EXISTS memvault_guard_insert
            BEFORE INSERT ON {MESSAGES_TABLE} WHEN {_NOT_SEALED}
            BEGIN SELECT RAISE(ABORT, '{GUARD_MESSAGE.replace("'", "''")}'); END"""
    )
    conn.execute(
        f"""CREATE TRIGGER IF NOT EXISTS memvault_guard_update
            BEFORE UPDATE OF message_data ON {MESSAGES_TABLE} WHEN {_NOT_SEALED}
            BEGIN SELECT RAISE(ABORT, '{GUARD_MESSAGE.replace("'", "''")}'); END"""
    )


@migration
def m004_audit(conn: sqlite3.Connection) -> None:
    # Events and counts only: never content, never a session's items.
    conn.execute(
        """CREATE TABLE IF NOT EXISTS memvault_audit (
               id INTEGER PRIMARY KEY AUTOINCREMENT,
               at TEXT NOT NULL,
               event TEXT NOT NULL,
               kid TEXT,
               details TEXT NOT NULL DEFAULT '{}'
           )"""
    )


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Apply the migrations not yet recorded; the caller holds a write transaction."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS memvault_migrations "
        "(name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)"
    )
    done = {r[0] for r in conn.execute("SELECT name FROM memvault_migrations")}
    applied = []
    for fn in MIGRATIONS:
        if fn.__name__ not in done:
            fn(conn)
            conn.execute(
                "INSERT INTO memvault_migrations (name, applied_at) VALUES (?, ?)",
                (fn.__name__, utcnow()),
            )
            applied.append(fn.__name__)
    return applied


# --------------------------------------------------------------------------
# SQLite connections and error translation
# --------------------------------------------------------------------------
def configure(conn: sqlite3.Connection, timeout: float) -> None:
    """Pragmas every vault connection uses (the SDK session's connections too)."""
    conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
    conn.execute("PRAGMA secure_delete = ON")  # deleted cells and pages are zeroed
    conn.execute("PRAGMA temp_store = MEMORY")  # VACUUM's copy never touches a temp file
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


def translate(exc: sqlite3.Error, path: Path) -> VaultError:
    """One user-facing error for each way SQLite can fail on a vault file."""
    text = str(exc)
    low = text.lower()
    if "file is not a database" in low:
        return NotAVault(
            f"{path} is not a SQLite database, so it is not a memvault vault; "
            "point --db or MEMVAULT_DB at your vault"
        )
    if "malformed" in low or "corrupt" in low:
        return VaultCorrupt(
            f"{path} is damaged ({text}); nothing was changed; restore the vault from a backup"
        )
    if "locked" in low or "busy" in low:
        return VaultBusy(
            f"{path} is busy: another process holds its lock ({text}); wait for "
            f"it to finish, or raise {ENV_LOCK_TIMEOUT} (seconds)"
        )
    if "readonly" in low or "read-only" in low or "unable to open" in low or "permission" in low:
        return OperationFailed(
            f"cannot write to {path} or its folder ({text}); check the "
            "permissions of the file and its folder; nothing was changed"
        )
    if "disk i/o" in low or "full" in low:
        return OperationFailed(
            f"I/O error on {path} ({text}); check the disk; the last committed state is intact"
        )
    if GUARD_MESSAGE in text:
        return OperationFailed(f"{text}; nothing was stored")
    return OperationFailed(f"SQLite error on {path}: {text}")


@contextlib.contextmanager
def sqlite_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as exc:
        raise translate(exc, path) from exc


def _file_header(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(100)


def _read_header(path: Path) -> bytes:
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


def _check_header(path: Path) -> None:
    """Reject what is plainly not a vault before SQLite touches (or creates) anything."""
    header = _read_header(path)
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


def _refuse_odd_side_files(path: Path) -> None:
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
    _refuse_odd_side_files(path)  # before SQLite opens (and may write) the side files
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
# The vault
# --------------------------------------------------------------------------
@dataclass
class SessionInfo:
    session_id: str
    items: int
    readable: int = 0
    expired: int = 0
    unreadable: int = 0
    updated_at: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Report:
    """What a long operation did, for the CLI to print or dump as JSON."""

    counts: dict[str, Any] = field(default_factory=dict)
    scrubbed: bool = True


class Vault:
    """The library object behind every command. Open with `Vault.open` or `Vault.init`."""

    def __init__(self, path: Path, keystore: KeyStore | None = None) -> None:
        self.path = path
        self._keystore = keystore
        self._sealer: crypto.Sealer | None = None
        self._rotation_committed = False  # read when Ctrl-C interrupts a rotation
        self.scrub_incomplete = False
        self.cleared_unreadable = 0

    # -- construction ---------------------------------------------------
    @classmethod
    def init(
        cls,
        db: str | os.PathLike[str] | None = None,
        ttl: int | None = DEFAULT_TTL,
        keystore: KeyStore | None = None,
    ) -> Vault:
        """Create the vault file and its random master key; refuse if anything is there."""
        path = paths.resolve_db_path(db)
        if path.exists():
            files.require_regular(path)  # a FIFO, device or folder: exit 3 without opening it
            try:
                cls.open(path, keystore)
            except NotAVault:
                raise VaultExists(
                    f"{path} already exists and is not a memvault vault; memvault will not "
                    "overwrite it (to encrypt a plaintext SQLiteSession file use `memvault "
                    "import`)"
                ) from None
            except VaultError:
                pass
            raise VaultExists(
                f"a vault already exists at {path}; nothing was changed "
                "(`memvault status` describes it)"
            )
        # lexists: a dangling link would make SQLite create its target.
        leftovers = [p for p in paths.sidecars(path)[1:] if os.path.lexists(p)]
        if leftovers:
            raise VaultExists(
                f"{leftovers[0]} exists without its database; move it away "
                "before creating a vault here"
            )
        ks = keystore or KeyStore()
        ks.check_usable()
        try:
            paths.ensure_private_folder(path.parent)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise VaultExists(
                f"a file appeared at {path} while creating the vault; nothing was changed"
            ) from None
        except OSError as exc:
            raise OperationFailed(
                f"cannot create {path} ({exc.strerror}); choose a writable "
                "folder with --db or MEMVAULT_DB"
            ) from None
        try:
            os.fchmod(fd, 0o600)  # the umask may have narrowed or widened it
        finally:
            os.close(fd)

        key = crypto.generate_key()
        kid = crypto.key_id(key)
        vault_id = "mv-" + secrets.token_hex(12)
        try:
            # The key goes in first: a crash between the two leaves an unused keyring
            # entry, never a vault without its key.
            ks.set(vault_id, key)
            with sqlite_errors(path):
                conn = connect(path)
                try:
                    conn.execute("PRAGMA journal_mode = WAL")
                    conn.execute("BEGIN IMMEDIATE")
                    migrate(conn)
                    now = utcnow()
                    meta = {
                        "format": FORMAT,
                        "vault_id": vault_id,
                        "kid": kid,
                        "ttl_seconds": "never" if ttl is None else str(ttl),
                        "created_at": now,
                        "rotated_at": now,
                    }
                    conn.executemany(
                        "INSERT INTO memvault_meta (key, value) VALUES (?, ?)", meta.items()
                    )
                    _audit(conn, "init", kid, ttl=crypto.format_duration(ttl))
                    conn.execute("COMMIT")
                finally:
                    conn.close()
        except BaseException:
            for p in paths.sidecars(path):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            with contextlib.suppress(VaultError):
                ks.delete(vault_id)
            raise
        vault = cls(path, ks)
        vault._sealer = crypto.Sealer(key)
        return vault

    @classmethod
    def open(
        cls, db: str | os.PathLike[str] | None = None, keystore: KeyStore | None = None
    ) -> Vault:
        """Check that the path is a vault; the key is loaded only when needed."""
        path = paths.resolve_db_path(db)
        _check_header(path)
        _refuse_odd_side_files(path)
        vault = cls(path, keystore)
        meta = vault.meta()
        if meta.get("format") != FORMAT:
            raise NotAVault(
                f"{path} has an unknown memvault format {meta.get('format')!r}; upgrade memvault"
            )
        with sqlite_errors(path), vault._connect() as conn:
            if _needs_migration(conn):
                conn.execute("BEGIN IMMEDIATE")
                migrate(conn)
                conn.execute("COMMIT")
        if meta.get("scrub_pending") == "1" and "revoked_at" not in meta:
            # A rotation, purge or clear was cut off before its scrub: finish it now.
            vault.scrub_incomplete = not vault.scrub()
        return vault

    # -- plumbing -------------------------------------------------------
    @contextlib.contextmanager
    def _connect(self, timeout: float | None = None) -> Iterator[sqlite3.Connection]:
        if not self.path.exists():
            _read_header(self.path)  # shredded or moved since this object opened it
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

    @property
    def keystore(self) -> KeyStore:
        if self._keystore is None:
            self._keystore = KeyStore()
        return self._keystore

    def meta(self) -> dict[str, str]:
        with self._connect() as conn:
            return _read_meta(conn, self.path)

    @property
    def vault_id(self) -> str:
        return self.meta()["vault_id"]

    @property
    def ttl(self) -> int | None:
        return parse_ttl(self.meta(), self.path)

    # -- the key --------------------------------------------------------
    def sealer(self, refresh: bool = False) -> crypto.Sealer:
        """The current key's sealer, after checking it against the file's kid.

        Finishes an interrupted rotation (the file already uses the pending key) and
        drops a pending key left by a rotation that died before its commit.
        """
        if self._sealer is not None and not refresh:
            return self._sealer
        ks = self.keystore
        ks.check_usable()
        for attempt in range(5):
            meta = self.meta()
            vault_id, file_kid = meta["vault_id"], meta["kid"]
            if "revoked_at" in meta:
                raise KeyRevoked(
                    f"the key of vault {vault_id} was revoked on {meta['revoked_at']}; its "
                    "history can never be read again; `memvault shred` removes the file"
                )
            current = ks.get(vault_id)
            pending = ks.get_pending(vault_id)
            if crypto.is_valid_key(pending) and crypto.key_id(pending or "") == file_kid:
                assert pending is not None
                # The rotation committed but died before promoting its key: promote it.
                candidate = crypto.Sealer(pending)
                try:
                    promoted = self._promote(vault_id, candidate, wait=False)
                except VaultBusy:
                    # A writer holds the lock (likely the rotation, promoting it itself):
                    # the pending key is the file's key; a later open promotes it.
                    promoted = True
                if promoted:
                    self._sealer = candidate
                    return self._sealer
                continue  # revoked or rotated again meanwhile: read the file afresh
            if crypto.is_valid_key(current) and crypto.key_id(current or "") == file_kid:
                assert current is not None
                if pending is not None:
                    self._drop_stale_pending(vault_id, file_kid)
                self._sealer = crypto.Sealer(current)
                return self._sealer
            if current is None and pending is None:
                break
            # A rotation may have committed between reading the file and the keyring.
            time.sleep(0.05 * (attempt + 1))
        key = require_key(current, vault_id, ks.name)
        raise KeyMismatch(
            f"the keyring's key for vault {vault_id} has id {crypto.key_id(key)} but the vault "
            f"was written with {file_kid}; nothing was read or written; restore the matching "
            "key with `memvault key import KIT`"
        )

    def _promote(self, vault_id: str, sealer: crypto.Sealer, wait: bool = True) -> bool:
        """Store a committed rotation's key as the vault's key and drop `.next`.

        Under the write lock, and only if the file still uses that key: a revoke, or a
        rotation started meanwhile (which stores its own `.next`), cannot interleave, so
        a promotion never brings a revoked key back nor deletes another rotation's
        pending key. Returns False, keeping no key, when the file moved on. With
        `wait=False`, raises VaultBusy at once when another connection holds the lock.
        """
        ks = self.keystore
        with self._connect(timeout=None if wait else 0) as conn:
            conn.execute("BEGIN IMMEDIATE")
            meta = _read_meta(conn, self.path)
            if meta["kid"] != sealer.kid:
                if "revoked_at" in meta:
                    ks.delete_pending(vault_id)
                return False
            ks.set(vault_id, sealer.master_key)
            ks.delete_pending(vault_id)
            conn.execute("ROLLBACK")
        return True

    def _drop_stale_pending(self, vault_id: str, file_kid: str) -> None:
        """Remove a `.next` key whose rotation died before committing.

        Only under the write lock: a live rotation holds it from before it stores
        `.next` until its commit, so holding it proves no rotation is in flight.
        """
        try:
            with self._connect(timeout=0) as conn:
                conn.execute("BEGIN IMMEDIATE")
                if _read_meta(conn, self.path)["kid"] == file_kid:
                    self.keystore.delete_pending(vault_id)
                conn.execute("ROLLBACK")
        except VaultBusy:
            pass  # a writer is busy; a later open will tidy up

    # -- reading --------------------------------------------------------
    def session_ids(self) -> list[str]:
        with self._connect() as conn:
            return [
                r[0]
                for r in conn.execute(
                    f"SELECT session_id FROM {SESSIONS_TABLE} UNION "
                    f"SELECT DISTINCT session_id FROM {MESSAGES_TABLE} ORDER BY 1"
                )
            ]

    def count_items(self) -> int:
        with self._connect() as conn:
            return int(conn.execute(f"SELECT count(*) FROM {MESSAGES_TABLE}").fetchone()[0])

    def _snapshot(
        self, read: Callable[[sqlite3.Connection, crypto.Sealer, int | None], T]
    ) -> T:
        """Run `read` in one read transaction that also saw the file's kid and TTL.

        A key fetched before the rows are read may be retired by a rotation committed
        in between, and healthy rows would then look unreadable: the kid is read in
        the rows' own snapshot, and on a mismatch the key is reloaded and the read
        starts again.
        """
        sealer = self.sealer()
        for _attempt in range(50):
            with self._connect() as conn:
                conn.execute("BEGIN")  # deferred: the first SELECT fixes the snapshot
                meta = _read_meta(conn, self.path)
                if meta["kid"] == sealer.kid:
                    result = read(conn, sealer, parse_ttl(meta, self.path))
                    conn.execute("COMMIT")
                    return result
                conn.execute("COMMIT")
            sealer = self.sealer(refresh=True)  # KeyRevoked if it was revoked meanwhile
        raise VaultBusy(
            f"{self.path} kept changing key while being read (rotations in a loop?); try again"
        )

    def sessions(self, now: int | None = None) -> list[SessionInfo]:
        """One row per session with readable, expired and unreadable counts."""
        return self._snapshot(lambda conn, sealer, ttl: self._count(conn, sealer, ttl, now))

    def _count(
        self, conn: sqlite3.Connection, sealer: crypto.Sealer, ttl: int | None, now: int | None
    ) -> list[SessionInfo]:
        infos: dict[str, SessionInfo] = {}
        for sid, updated in conn.execute(
            f"SELECT session_id, updated_at FROM {SESSIONS_TABLE} ORDER BY session_id"
        ):
            infos[sid] = SessionInfo(sid, 0, updated_at=updated)
        for sid, data in conn.execute(
            f"SELECT session_id, message_data FROM {MESSAGES_TABLE} ORDER BY id"
        ):
            info = infos.setdefault(sid, SessionInfo(sid, 0))
            info.items += 1
            state = sealer.state(sid, data, ttl, now)  # authenticate, no decryption
            if state is crypto.ItemState.READABLE:
                info.readable += 1
            elif state is crypto.ItemState.EXPIRED:
                info.expired += 1
            else:
                info.unreadable += 1
        return sorted(infos.values(), key=lambda i: i.session_id)

    def _require_session(self, conn: sqlite3.Connection, session_id: str) -> None:
        found = conn.execute(
            f"SELECT 1 FROM {SESSIONS_TABLE} WHERE session_id = ? UNION ALL "
            f"SELECT 1 FROM {MESSAGES_TABLE} WHERE session_id = ? LIMIT 1",
            (session_id, session_id),
        ).fetchone()
        if not found:
            raise UnknownSession(
                f"no session {session_id!r} in {self.path}; `memvault sessions` lists them"
            )

    def items(
        self, session_id: str, limit: int | None = None, now: int | None = None
    ) -> tuple[list[Any], int, int]:
        """(readable items oldest first, expired count, unreadable count).

        With `limit`, the newest `limit` stored rows are considered, as the SDK does.
        """
        if limit is not None and limit <= 0:
            raise OperationFailed("limit must be a positive number of items")

        def read(
            conn: sqlite3.Connection, sealer: crypto.Sealer, ttl: int | None
        ) -> tuple[crypto.Sealer, int | None, list[str]]:
            self._require_session(conn, session_id)
            sql = f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = ? ORDER BY id DESC"
            args: tuple[Any, ...] = (session_id,)
            if limit is not None:
                sql += " LIMIT ?"
                args += (limit,)
            return sealer, ttl, [r[0] for r in conn.execute(sql, args)][::-1]

        sealer, ttl, rows = self._snapshot(read)
        out: list[Any] = []
        expired = unreadable = 0
        for data in rows:
            opened = sealer.open(session_id, data, ttl, now)
            if opened.state is crypto.ItemState.READABLE:
                out.append(opened.item)
            elif opened.state is crypto.ItemState.EXPIRED:
                expired += 1
            else:
                unreadable += 1
        return out, expired, unreadable

    def status(self, now: int | None = None) -> dict[str, Any]:
        meta = self.meta()
        files = {}
        for p in paths.sidecars(self.path):
            if p.exists():
                files[p.name] = {"size": p.stat().st_size, "mode": paths.mode_of(p)}
        out: dict[str, Any] = {
            "path": str(self.path),
            "folder_mode": paths.mode_of(self.path.parent),
            "files": files,
            "size": sum(f["size"] for f in files.values()),
            "vault_id": meta["vault_id"],
            "kid": meta["kid"],
            "ttl": crypto.format_duration(self.ttl),
            "created_at": meta.get("created_at"),
            "rotated_at": meta.get("rotated_at"),
            "scrub_pending": meta.get("scrub_pending") == "1",
            "shred_interrupted": "shred_started" in meta,
            "keyring": None,
            "key": None,
        }
        with self._connect() as conn:
            out["sessions"] = len(self.session_ids())
            out["items"] = conn.execute(f"SELECT count(*) FROM {MESSAGES_TABLE}").fetchone()[0]
        try:
            out["keyring"] = self.keystore.name
            self.sealer()
            out["key"] = "present and matching"
        except KeyRevoked:
            out["key"] = "key revoked"
            try:
                complete = self.revocation_complete()
            except KeyProblem:
                complete = True  # no keyring to ask: the file's mark is all there is to say
            if not complete:
                out["key"] = "key revoked (incomplete: the key is still in the keyring)"
                out["key_problem"] = "run `memvault revoke` again to finish destroying it"
        except KeyProblem as exc:
            out["key"] = "unusable"
            out["key_problem"] = exc.message
            return out
        if out["key"] != "present and matching":
            return out
        infos = self.sessions(now)
        # The counts of one snapshot (the ones above may predate a concurrent write).
        out["sessions"] = len(infos)
        out["items"] = sum(i.items for i in infos)
        out["readable"] = sum(i.readable for i in infos)
        out["expired"] = sum(i.expired for i in infos)
        out["unreadable"] = sum(i.unreadable for i in infos)
        return out

    # -- changing -------------------------------------------------------
    def pop(self, session_id: str, n: int = 1) -> list[Any]:
        """Remove the newest `n` items; refuses if one of them does not authenticate."""
        if n <= 0:
            raise OperationFailed("the number of items to pop must be positive")
        sealer = self.sealer()
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            self._check_kid(conn, sealer)
            sealer = self._sealer or sealer  # reloaded if another process rotated
            self._require_session(conn, session_id)
            rows = conn.execute(
                f"SELECT id, message_data FROM {MESSAGES_TABLE} WHERE session_id = ? "
                "ORDER BY id DESC LIMIT ?",
                (session_id, n),
            ).fetchall()
            popped = []
            for _id, data in rows:
                opened = sealer.open(session_id, data, None)
                if opened.state is not crypto.ItemState.READABLE:
                    raise OperationFailed(
                        f"item {_id} of session {session_id!r} does not authenticate (tampered, "
                        "corrupt or under another key); nothing was removed"
                    )
                popped.append(opened.item)
            conn.executemany(f"DELETE FROM {MESSAGES_TABLE} WHERE id = ?", [(r[0],) for r in rows])
            _set_meta(conn, scrub_pending="1")
            conn.execute("COMMIT")
        self.scrub_incomplete = not self.scrub()
        return popped

    def clear(self, session_id: str, include_unreadable: bool = False) -> int:
        """Empty one session (rows zeroed by secure_delete, WAL checkpointed).

        Items that do not authenticate (tampered, corrupt, under another key) are
        evidence, not history: the session is left whole, with ItemsUnreadable, unless
        `include_unreadable`. `cleared_unreadable` tells how many of those went.
        """
        sealer = self.sealer()
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            self._check_kid(conn, sealer)
            sealer = self._sealer or sealer
            self._require_session(conn, session_id)
            unreadable = sum(
                sealer.state(session_id, data, None) is crypto.ItemState.UNREADABLE
                for (data,) in conn.execute(
                    f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = ?",
                    (session_id,),
                )
            )
            if unreadable and not include_unreadable:
                raise ItemsUnreadable(
                    f"{unreadable} item(s) of session {session_id!r} do not authenticate "
                    "(tampered, corrupt or under another key); nothing was deleted; to delete "
                    f"them too, on purpose: memvault clear {session_id} --include-unreadable",
                    unreadable,
                )
            n = conn.execute(
                f"DELETE FROM {MESSAGES_TABLE} WHERE session_id = ?", (session_id,)
            ).rowcount
            conn.execute(f"DELETE FROM {SESSIONS_TABLE} WHERE session_id = ?", (session_id,))
            _set_meta(conn, scrub_pending="1")
            _audit(conn, "clear", sealer.kid, items=n, unreadable=unreadable)
            conn.execute("COMMIT")
        self.cleared_unreadable = unreadable
        self.scrub_incomplete = not self.scrub()
        return n

    def scrub_after_delete(self) -> bool:
        """Scrub after rows were deleted elsewhere (the agent session's pop).

        Marked pending first, so that a scrub kept from finishing by a reader is
        finished by the next open.
        """
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            _set_meta(conn, scrub_pending="1")
            conn.execute("COMMIT")
        self.scrub_incomplete = not self.scrub()
        return not self.scrub_incomplete

    def set_ttl(self, ttl: int | None) -> None:
        sealer = self.sealer()
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            old = _read_meta(conn, self.path).get("ttl_seconds")
            new = "never" if ttl is None else str(ttl)
            _set_meta(conn, ttl_seconds=new)
            _audit(conn, "ttl", sealer.kid, old=old, new=new)
            conn.execute("COMMIT")

    def purge(self, now: int | None = None, progress: Progress | None = None) -> Report:
        """Delete items that authenticate under the key and are past the TTL."""
        sealer = self.sealer()
        deleted = kept = unreadable = 0
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            self._check_kid(conn, sealer)
            sealer = self._sealer or sealer  # reloaded if another process rotated
            meta = _read_meta(conn, self.path)
            ttl = parse_ttl(meta, self.path)  # the TTL of this transaction's snapshot
            doomed = []
            for row_id, sid, data in conn.execute(
                f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} ORDER BY id"
            ).fetchall():
                state = sealer.open(sid, data, ttl, now).state
                if state is crypto.ItemState.EXPIRED:
                    doomed.append((row_id,))
                elif state is crypto.ItemState.UNREADABLE:
                    unreadable += 1
                else:
                    kept += 1
                if progress:
                    progress(1)
            failpoint("purge-in-transaction")
            conn.executemany(f"DELETE FROM {MESSAGES_TABLE} WHERE id = ?", doomed)
            deleted = len(doomed)
            if deleted:
                _set_meta(conn, scrub_pending="1")
            _audit(conn, "purge", sealer.kid, deleted=deleted, kept=kept, unreadable=unreadable)
            conn.execute("COMMIT")
        scrubbed = self.scrub() if deleted else True
        self.scrub_incomplete = not scrubbed
        return Report({"deleted": deleted, "kept": kept, "unreadable": unreadable}, scrubbed)

    def _check_kid(self, conn: sqlite3.Connection, sealer: crypto.Sealer) -> None:
        """Inside a write transaction: the file still uses the key we hold."""
        if _read_meta(conn, self.path)["kid"] != sealer.kid:
            conn.execute("ROLLBACK")
            fresh = self.sealer(refresh=True)
            conn.execute("BEGIN IMMEDIATE")
            if _read_meta(conn, self.path)["kid"] != fresh.kid:
                raise VaultBusy(f"{self.path} changed key while this command ran; try again")

    # -- rotation and revocation ----------------------------------------
    def rotate(self, progress: Progress | None = None, scrub: bool = True) -> Report:
        """`_rotate`, with Ctrl-C turned into `Interrupted` saying whether it committed."""
        self._rotation_committed = False
        try:
            return self._rotate(progress, scrub)
        except KeyboardInterrupt:
            if not self._rotation_committed:
                raise Interrupted(
                    "interrupted; the rotation was not committed: the vault keeps its old key "
                    "and nothing was changed"
                ) from None
            raise Interrupted(
                "interrupted after the rotation committed: every item is under the new key; "
                "the next memvault command finishes the key swap and the scrub of old bytes"
            ) from None

    def _rotate(self, progress: Progress | None, scrub: bool) -> Report:
        """New key; every envelope re-encrypted in one transaction; old bytes scrubbed.

        Two-phase key swap: the new key is stored as `<vault_id>.next` while this
        process holds the write lock and before any row changes; it is promoted
        after the commit. `sealer()` finishes either half after a crash.
        """
        started = time.monotonic()
        old = self.sealer(refresh=True)
        ks = self.keystore
        new = crypto.Sealer(crypto.generate_key())
        ttl = self.ttl
        cutoff = None if ttl is None else int(time.time()) - ttl
        items = expired = unreadable = 0
        sessions: set[str] = set()
        with self._connect() as conn:
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("BEGIN IMMEDIATE")
            self._check_kid(conn, old)
            old = self._sealer or old
            vault_id = _read_meta(conn, self.path)["vault_id"]
            # Under the write lock no rotation is in flight, so `.next` is either the
            # file's key from a promotion that was deferred (busy lock) or a dead
            # rotation's leftover. Make the file's key the current entry before `.next`
            # is reused: otherwise overwriting `.next` could destroy its only copy.
            if ks.get(vault_id) != old.master_key:
                ks.set(vault_id, old.master_key)
            ks.delete_pending(vault_id)
            ks.set_pending(vault_id, new.master_key)
            attempted = False
            try:
                failpoint("after-pending")
                _set_meta(conn, kid=new.kid, rotated_at=utcnow(), scrub_pending="1")
                last = -1
                while True:
                    batch = conn.execute(
                        f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} "
                        "WHERE id > ? ORDER BY id LIMIT 1000",
                        (last,),
                    ).fetchall()
                    if not batch:
                        break
                    updates = []
                    for row_id, sid, data in batch:
                        sessions.add(sid)
                        stamped = crypto.rotate_row_stamped(old, new, sid, data)
                        if stamped is None:
                            unreadable += 1  # kept as it is: nothing is deleted by a rotation
                            continue
                        rotated, ts = stamped  # ts from the token: no second parse of the row
                        items += 1
                        if cutoff is not None and ts < cutoff:
                            expired += 1
                        updates.append((rotated, row_id))
                    conn.executemany(
                        f"UPDATE {MESSAGES_TABLE} SET message_data = ? WHERE id = ?", updates
                    )
                    last = batch[-1][0]
                    if progress:
                        progress(len(batch))
                    failpoint("in-transaction")
                _audit(
                    conn,
                    "rotate",
                    new.kid,
                    old_kid=old.kid,
                    items=items,
                    expired=expired,
                    unreadable=unreadable,
                    sessions=len(sessions),
                )
                attempted = True
                conn.execute("COMMIT")
                self._rotation_committed = True
            finally:
                if not attempted:
                    # Still holding the lock and nothing committed: no row uses the new
                    # key, so drop it. (After a failed COMMIT the outcome is unknown, and
                    # `.next` stays for the next open to judge against the file.)
                    with contextlib.suppress(Exception):
                        conn.execute("ROLLBACK")
                    with contextlib.suppress(Exception):
                        ks.delete_pending(vault_id)
        failpoint("after-commit")
        try:
            promoted = self._promote(vault_id, new)
        except VaultBusy:
            # Committed, and `.next` holds the key: the next open (or rotation) promotes it.
            promoted = True
        failpoint("after-promotion")
        self._sealer = new if promoted else None
        if not promoted:
            self.sealer(refresh=True)  # revoked meanwhile: KeyRevoked; else the newer key
        scrubbed = self.scrub() if scrub else False
        self.scrub_incomplete = not scrubbed
        return Report(
            {
                "sessions": len(sessions),
                "items": items,
                "expired": expired,
                "unreadable": unreadable,
                "old_kid": old.kid,
                "new_kid": new.kid,
                "seconds": round(time.monotonic() - started, 3),
                "scrubbed": scrubbed,
            },
            scrubbed,
        )

    def revoke(self) -> dict[str, Any]:
        """Destroy the key (current and pending). The file stays, unreadable for ever.

        The keyring is checked first, then the file is marked, so a revoke killed
        half-way is finished by the next one, and writers still holding the key in
        memory are refused by the triggers. Only this file's key is destroyed: a
        key under the same vault id that belongs to another copy is refused.
        """
        ks = self.keystore
        ks.check_usable()
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            meta = _read_meta(conn, self.path)
            vault_id = meta["vault_id"]
            kid = meta.get("revoked_kid", meta["kid"])
            current = ks.get(vault_id)
            pending = ks.get_pending(vault_id)
            kids = {crypto.key_id(k) for k in (current, pending) if k and crypto.is_valid_key(k)}
            if kids and kid not in kids:
                raise KeyMismatch(
                    f"the keyring's key for vault {vault_id} ({', '.join(sorted(kids))}) does "
                    f"not open this file ({kid}): it belongs to another copy of this vault, "
                    "and revoking would destroy that copy's key; nothing was changed"
                )
            already = "revoked_at" in meta
            if not already:
                _set_meta(conn, revoked_at=utcnow(), revoked_kid=kid, kid="revoked")
                _audit(conn, "revoke", kid)
            conn.execute("COMMIT")
            failpoint("revoke-after-mark")
            # Still under the write lock: no rotation can store or promote a key meanwhile.
            destroyed = False
            if pending is not None:
                destroyed = ks.delete_pending(vault_id)
            failpoint("revoke-after-pending")
            destroyed = ks.delete(vault_id) or destroyed
        self._sealer = None
        return {
            "vault_id": vault_id,
            "kid": kid,
            "already_revoked": already,
            "key_destroyed": destroyed,
        }

    def revocation_complete(self) -> bool:
        """False while a revoked vault's key is still in the keyring (revoke cut off)."""
        meta = self.meta()
        kid = meta.get("revoked_kid")
        ks = self.keystore
        vault_id = meta["vault_id"]
        for key in (ks.get(vault_id), ks.get_pending(vault_id)):
            if key and crypto.is_valid_key(key) and crypto.key_id(key) == kid:
                return False
        return True

    # -- scrubbing ------------------------------------------------------
    def scrub(self) -> bool:
        """Checkpoint the WAL (TRUNCATE) and VACUUM so no replaced bytes remain.

        Returns False, leaving `scrub_pending` set for the next open, when another
        process's read transaction keeps the checkpoint from finishing.
        """
        with self._connect(timeout=SCRUB_WAIT) as conn:
            try:
                if conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:
                    return False
                failpoint("during-scrub")
                conn.execute("VACUUM")
                conn.execute("BEGIN IMMEDIATE")
                _set_meta(conn, scrub_pending="0")
                conn.execute("COMMIT")
                # Old bytes are gone already; this one only empties the WAL of new pages.
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    return False
                raise
        return True

    def shred(self, progress: Progress | None = None) -> dict[str, Any]:
        return shred(self.path, self._keystore, progress)

    # -- agent sessions -------------------------------------------------
    def session(self, session_id: str) -> Any:
        """An `EncryptedSession` over this vault (imports the Agents SDK)."""
        from .session import make_session

        return make_session(self, session_id)

    # -- audit ----------------------------------------------------------
    def audit_log(self) -> list[dict[str, Any]]:
        with self._connect() as conn:
            return [
                {"at": at, "event": ev, "kid": kid, **json.loads(details)}
                for at, ev, kid, details in conn.execute(
                    "SELECT at, event, kid, details FROM memvault_audit ORDER BY id"
                )
            ]


def failpoint(name: str) -> None:
    """Test-only crash injection: SIGKILL this process at a named step.

    The crash tests set MEMVAULT_FAILPOINT to prove a kill at each step of a
    rotation loses nothing. Unset, this is one dictionary lookup.
    """
    if os.environ.get("MEMVAULT_FAILPOINT") == name:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("MEMVAULT_PAUSEPOINT") == name:
        # The interruption tests' variant: say so on stderr and wait for their SIGINT.
        sys.stderr.write(f"memvault: paused at {name}\n")
        sys.stderr.flush()
        time.sleep(600)


def _needs_migration(conn: sqlite3.Connection) -> bool:
    try:
        done = {r[0] for r in conn.execute("SELECT name FROM memvault_migrations")}
    except sqlite3.OperationalError:
        return True
    return any(fn.__name__ not in done for fn in MIGRATIONS)


def _read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, str]:
    try:
        meta = dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
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


def _set_meta(conn: sqlite3.Connection, **values: str) -> None:
    conn.executemany(
        "INSERT INTO memvault_meta (key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        values.items(),
    )


def _audit(conn: sqlite3.Connection, event: str, kid: str | None, **details: Any) -> None:
    conn.execute(
        "INSERT INTO memvault_audit (at, event, kid, details) VALUES (?, ?, ?, ?)",
        (utcnow(), event, kid, json.dumps(details, sort_keys=True)),
    )


# --------------------------------------------------------------------------
# Shred: key first, then rows, then the bytes of every file.
# --------------------------------------------------------------------------
def destroy_keys(ks: KeyStore, vault_id: str, file_kids: set[str]) -> dict[str, Any]:
    """Delete the keyring entries that belong to this file, and only those.

    Every copy of a vault shares its vault id, so the entry under that id may hold
    the key of another, newer copy (a backup being shredded while the live vault
    rotated on). An entry is this file's when its key id is the file's; the current
    entry is also this file's when `.next` is (a rotation of this file committed but
    was never promoted: the current entry is the key it retired). Malformed entries
    are deleted too. The caller holds the file's write lock, so no rotation is in
    flight. Returns what was destroyed and the key id of any entry left in place.
    """

    def kid(key: str | None) -> str | None:
        return crypto.key_id(key) if key and crypto.is_valid_key(key) else None

    current, pending = ks.get(vault_id), ks.get_pending(vault_id)
    cur_kid, pen_kid = kid(current), kid(pending)
    cur_ours = current is not None and (cur_kid is None or cur_kid in file_kids)
    pen_ours = pending is not None and (pen_kid is None or pen_kid in file_kids)
    if pen_ours and current is not None:
        cur_ours = True
    if cur_ours and pending is not None:
        pen_ours = True  # with the lock held, a `.next` beside this file's key is a dead rotation's
    destroyed = False
    if pen_ours:
        destroyed = ks.delete_pending(vault_id) or destroyed
    if cur_ours:
        destroyed = ks.delete(vault_id) or destroyed
    foreign = [k for k, ours in ((cur_kid, cur_ours), (pen_kid, pen_ours)) if k and not ours]
    return {"key_destroyed": destroyed, "foreign_kid": foreign[0] if foreign else None}


class _Damaged(Exception):
    """SQLite cannot read the vault (damaged or truncated): shred it without SQLite."""


# Words SQLite uses for a file it cannot parse (as opposed to busy or unwritable).
_DAMAGE_WORDS = ("malformed", "corrupt", "not a database", "disk image")
_RAW_VAULT_ID = re.compile(rb"vault_id(mv-[0-9a-f]{24})")
_RAW_KID = re.compile(rb"(mv1:[0-9a-f]{16})")


def _raw_ids(path: Path) -> tuple[set[str], set[str]]:
    """Vault ids and key ids found in the raw bytes of the file and its side files.

    A `memvault_meta` row keeps its key and value side by side in a page, so the
    vault id survives damage to other pages (page 1 included); every key id the
    file ever recorded or stamped on an envelope is this file's.
    """
    ids: set[str] = set()
    kids: set[str] = set()
    for p in paths.sidecars(path):
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            fd = os.open(p, os.O_RDONLY | files.NO_FOLLOW)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as fh:
            tail = b""
            while block := fh.read(1 << 22):
                data = tail + block
                ids.update(m.decode() for m in _RAW_VAULT_ID.findall(data))
                kids.update(m.decode() for m in _RAW_KID.findall(data))
                tail = data[-64:]
    return ids, kids


def _destroy_keys_of_damaged(
    path: Path, keystore: KeyStore | None, report: dict[str, Any]
) -> None:
    """Destroy the keys a damaged file can still name; say so plainly when it names none."""
    ids, kids = _raw_ids(path)
    if report.get("vault_id"):
        ids.add(report["vault_id"])
    if report.get("kid"):
        kids.add(report["kid"])
    report["damaged"] = True
    report.setdefault("sessions", None)
    report.setdefault("items", None)
    if len(ids) != 1:
        report.update(vault_id=None, kid=None, key_destroyed=False, foreign_kid=None)
        report["key_problem"] = (
            "the file is too damaged to name its vault id, so no keyring entry was destroyed; "
            "if you know the vault id, delete the keyring entry (service `memvault`) yourself"
        )
        return
    (vault_id,) = ids
    report["vault_id"] = vault_id
    if not report.get("kid") and len(kids) == 1:
        report["kid"] = next(iter(kids))
    report.setdefault("kid", None)
    ks = keystore or KeyStore()
    ks.check_usable()
    report.update(destroy_keys(ks, vault_id, kids))
    if report.get("foreign_kid"):
        report["key_problem"] = (
            f"the keyring entry of {vault_id} holds key {report['foreign_kid']}, which this file "
            "never used (another copy's key?); it was left in place"
        )


def _shred_rows(path: Path, keystore: KeyStore | None, report: dict[str, Any]) -> None:
    """Under the exclusive lock: counts, marker, key, then every row. Raises _Damaged."""
    fields = ("vault_id", "kid", "sessions", "items", "key_destroyed", "foreign_kid")

    def count(conn: sqlite3.Connection) -> None:
        report["sessions"] = conn.execute(
            f"SELECT count(*) FROM (SELECT session_id FROM {SESSIONS_TABLE} UNION "
            f"SELECT session_id FROM {MESSAGES_TABLE})"
        ).fetchone()[0]
        report["items"] = conn.execute(f"SELECT count(*) FROM {MESSAGES_TABLE}").fetchone()[0]

    try:
        conn = connect(path, timeout=SCRUB_WAIT)
    except sqlite3.Error as exc:
        if any(w in str(exc).lower() for w in _DAMAGE_WORDS):
            raise _Damaged() from exc
        raise translate(exc, path) from exc
    try:
        with sqlite_errors(path):
            try:
                # Exclusive locking mode: the lock is kept until close, and it cannot be
                # taken while any other connection has the file open.
                conn.execute("PRAGMA locking_mode = EXCLUSIVE")
                try:
                    conn.execute("BEGIN EXCLUSIVE")
                except sqlite3.OperationalError as exc:
                    if "locked" in str(exc) or "busy" in str(exc):
                        raise VaultBusy(
                            f"{path} is in use by another process; close the agents and "
                            "commands using it, then run shred again; nothing was destroyed"
                        ) from None
                    raise
                meta = _read_meta(conn, path)
                vault_id = meta["vault_id"]
                kid = meta.get("revoked_kid", meta["kid"])
                report["vault_id"], report["kid"] = vault_id, kid
                wrote_marker = False
                if "shred_started" in meta:
                    # A shred was cut off: finish it as it began.
                    report.update(json.loads(meta["shred_started"]))
                    report["resumed"] = True
                    if report.get("key_destroyed") is None:
                        # Cut off before its rows went (they go in the commit that records
                        # the key's fate): count what is there now.
                        count(conn)
                else:
                    count(conn)
                    report["key_destroyed"] = report["foreign_kid"] = None
                    # Recorded before the key goes, so a run cut off after destroying it
                    # says so. In exclusive locking mode the lock outlives this commit.
                    _set_meta(conn, shred_started=json.dumps({k: report[k] for k in fields}))
                    conn.execute("COMMIT")
                    conn.execute("BEGIN EXCLUSIVE")
                    wrote_marker = True
                if report.get("key_destroyed") is None:
                    # The key goes first: from here on a crash leaves only unreadable
                    # ciphertext. Only this file's key: another copy's stays (see above).
                    try:
                        ks = keystore or KeyStore()
                        ks.check_usable()
                        outcome = destroy_keys(ks, vault_id, {meta["kid"], kid})
                    except BaseException:
                        if wrote_marker:
                            # The key is still there: leave no sign of a shred that never
                            # destroyed anything.
                            with contextlib.suppress(sqlite3.Error):
                                conn.execute("DELETE FROM memvault_meta WHERE key = ?",
                                             ("shred_started",))
                                conn.execute("COMMIT")
                        raise
                    if report["resumed"]:
                        # The cut-off run may have destroyed it already: it is gone either way.
                        outcome["key_destroyed"] = True
                    report.update(outcome)
                    failpoint("shred-after-key")
                    _set_meta(conn, shred_started=json.dumps({k: report[k] for k in fields}))
                conn.execute(f"DELETE FROM {MESSAGES_TABLE}")
                conn.execute(f"DELETE FROM {SESSIONS_TABLE}")
                conn.execute("DELETE FROM memvault_audit")
                conn.execute("COMMIT")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.DatabaseError as exc:
                if any(w in str(exc).lower() for w in _DAMAGE_WORDS):
                    raise _Damaged() from exc
                raise
    finally:
        conn.close()


def _check_shreddable(path: Path) -> None:
    """Everything shred will need, checked before it destroys anything."""
    folder = path.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OperationFailed(
            f"cannot remove files from {folder}: the folder is not writable; make it writable "
            "(chmod u+w) and run shred again; nothing was destroyed"
        )
    for p in paths.sidecars(path):
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            raise OperationFailed(
                f"{p} is a folder where SQLite keeps a side file; move it away and run shred "
                "again; nothing was destroyed"
            )
        if stat.S_ISREG(mode) and not os.access(p, os.W_OK):
            raise OperationFailed(
                f"cannot overwrite {p}: it is read-only; make it writable (chmod u+w) and run "
                "shred again; nothing was destroyed"
            )


def _remove_planted(path: Path) -> list[dict[str, Any]]:
    """Unlink the names of side files that are links, FIFOs or devices; never follow them.

    SQLite would follow a link at `-wal` or `-journal` and overwrite its target, and
    so would a naive shred. Removing the name leaves the target untouched.
    """
    removed = []
    for p, what in files.odd_entries(paths.sidecars(path)[1:]):
        os.unlink(p)
        removed.append({"name": p.name, "size": 0, "kind": what})
    if removed:
        files.fsync_dir(path.parent)
    return removed


def _read_stamp(path: Path) -> dict[str, Any]:
    """The report an interrupted shred stamped at the start of the file."""
    try:
        with open(path, "rb") as fh:
            stamp = json.loads(fh.read(4096)[len(SHRED_MAGIC) :].split(b"\n")[0])
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def shred_target(db: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What `shred` would destroy: the path and, if it can be read, the vault id.

    Raises NotAVault when there is nothing to shred, before anyone is asked.
    """
    path = paths.resolve_db_path(db)
    header = _read_header(path)
    if not header.startswith((SHRED_MAGIC, SQLITE_MAGIC)):
        _check_header(path)
    vault_id = None
    if header.startswith(SHRED_MAGIC):
        vault_id = _read_stamp(path).get("vault_id")
    elif not files.odd_entries(paths.sidecars(path)[1:]):
        try:
            conn = connect(path, timeout=SCRUB_WAIT)  # as any command would: no trace left
            try:
                vault_id = _read_meta(conn, path).get("vault_id")
            finally:
                conn.close()
        except NotAVault:
            raise  # a readable SQLite file that is no vault: refused before anyone is asked
        except (sqlite3.Error, VaultError):
            pass  # damaged or busy: shred itself decides
    return {"path": path, "vault_id": vault_id}


def shred(
    db: str | os.PathLike[str] | None = None,
    keystore: KeyStore | None = None,
    progress: Progress | None = None,
    on_total: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Destroy a vault: lock, key, rows, then overwrite, fsync and unlink every file.

    `on_total` learns how many bytes will be overwritten once the checkpoint has
    settled the files' sizes; `progress` then counts them.

    Works without the key (revoked, or the keyring entry gone), and on a file SQLite
    cannot read (damaged, truncated): then the keys the raw bytes still name go, and
    the report says plainly when none could be named. What was destroyed is recorded
    in the file before the rows go, so a shred killed half-way is finished by the
    next run, with the same report. Only regular files are overwritten; a link, FIFO
    or device at a side file's name is unlinked without being followed or opened.
    """
    path = paths.resolve_db_path(db)
    header = _read_header(path)
    report: dict[str, Any] = {"path": str(path), "resumed": False}
    if not header.startswith((SHRED_MAGIC, SQLITE_MAGIC)):
        _check_header(path)  # not a vault at all: refused, nothing touched
    _check_shreddable(path)
    removed = _remove_planted(path)
    if header.startswith(SHRED_MAGIC):
        # Interrupted after the key and the rows were gone: finish the overwrite.
        report.update(_read_stamp(path))
        report["resumed"] = True
    else:
        try:
            try:
                _check_header(path)
            except VaultCorrupt:
                raise _Damaged() from None
            _shred_rows(path, keystore, report)
        except _Damaged:
            if report.get("key_destroyed") is None:
                _destroy_keys_of_damaged(path, keystore, report)
        failpoint("shred-after-rows")
    stamp_fields = ("vault_id", "kid", "sessions", "items", "key_destroyed", "foreign_kid")
    stamp_bytes = (
        SHRED_MAGIC
        + json.dumps({k: report.get(k) for k in stamp_fields}).encode()
        + b"\n"
    )
    done = []
    try:
        # Stamp the database first so that nothing opens it as SQLite again.
        if on_total:
            on_total(sum(os.lstat(p).st_size for p, _ in _regular_files(path)))
        size = files.overwrite(path, stamp_bytes, progress)
        failpoint("shred-during-overwrite")
        for p in paths.sidecars(path)[1:]:
            entry = files.destroy(p, b"", progress)
            if entry:
                done.append(entry)
        os.unlink(path)
        done.insert(0, {"name": path.name, "size": size or 0, "kind": "file"})
        files.fsync_dir(path.parent)
    except OSError as exc:
        raise OperationFailed(
            f"could not overwrite or remove {exc.filename or path} ({exc.strerror}); the key is "
            "already destroyed; fix the cause and run `memvault shred` again"
        ) from None
    report["files"] = done + removed
    report["at"] = utcnow()
    return report


def _regular_files(path: Path) -> list[tuple[Path, int]]:
    """The database and side files that are regular files, with their sizes."""
    out = []
    for p in paths.sidecars(path):
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out.append((p, st.st_size))
    return out
