"""The vault file: SQLite schema, key checks and every operation the CLI offers.

The file keeps the SDK's own `agent_sessions` / `agent_messages` tables
unchanged (so `SQLiteSession` can still open it) and adds `memvault_meta`,
`memvault_audit`, `memvault_migrations` and guard triggers. This module never
imports `agents`: only `vault.session` does, when an agent session is opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from . import crypto, files, paths, testhooks
from .db import (
    SCRUB_WAIT,
    audit,
    check_header,
    connect,
    is_busy,
    is_damage,
    lock_timeout,
    parse_ttl,
    read_header,
    read_meta,
    refuse_odd_side_files,
    set_meta,
    sqlite_errors,
    translate,
)
from .errors import (
    ItemsUnreadable,
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
from .files import Progress
from .keys import KeyStore
from .lifecycle import KeyLifecycle, destroy_keys
from .results import Cleared, Popped, Report, SessionInfo
from .schema import (
    DEFAULT_TTL,
    FORMAT,
    MESSAGES_TABLE,
    SESSIONS_TABLE,
    SHRED_MAGIC,
    SQLITE_MAGIC,
    migrate,
    needs_migration,
    utcnow,
)

# The library's entry points; DEFAULT_TTL and the shred functions also stay importable
# from here, as they were before the file format and shred got modules of their own.
__all__ = [
    "DEFAULT_TTL",
    "Progress",
    "Report",
    "SessionInfo",
    "Vault",
    "lock_timeout",
    "shred",
    "shred_target",
]

T = TypeVar("T")


# --------------------------------------------------------------------------
# The vault
# --------------------------------------------------------------------------
class Vault(KeyLifecycle):
    """The library object behind every command. Open with `Vault.open` or `Vault.init`.

    Its key (sealer, rotate, revoke) comes from `KeyLifecycle`; its connections,
    transactions, meta, audit and scrub from `VaultFile` (vault.db).
    """

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
            vault = cls(path, ks)
            with vault.connection() as conn:
                conn.execute("PRAGMA journal_mode = WAL")  # persistent: set once, outside
            with vault.write_transaction() as conn:
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
                audit(conn, "init", kid, ttl=crypto.format_duration(ttl))
        except BaseException:
            for p in paths.sidecars(path):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            with contextlib.suppress(VaultError):
                ks.delete(vault_id)
            raise
        vault._sealer = crypto.Sealer(key)
        return vault

    @classmethod
    def open(
        cls, db: str | os.PathLike[str] | None = None, keystore: KeyStore | None = None
    ) -> Vault:
        """Check that the path is a vault; the key is loaded only when needed."""
        path = paths.resolve_db_path(db)
        check_header(path)
        refuse_odd_side_files(path)
        vault = cls(path, keystore)
        meta = vault.meta()
        if meta.get("format") != FORMAT:
            raise NotAVault(
                f"{path} has an unknown memvault format {meta.get('format')!r}; upgrade memvault"
            )
        with vault.connection() as conn:
            stale = needs_migration(conn)  # asked without taking the write lock
        if stale:
            with vault.write_transaction() as conn:
                migrate(conn)  # applies only what another process has not applied meanwhile
        if meta.get("scrub_pending") == "1" and "revoked_at" not in meta:
            # A rotation, purge or clear was cut off before its scrub: finish it now. If a
            # reader keeps it from finishing, `scrub_pending` stays set for the next open.
            vault.scrub()
        return vault

    # -- reading --------------------------------------------------------
    def session_ids(self) -> list[str]:
        with self.connection() as conn:
            return [
                r[0]
                for r in conn.execute(
                    f"SELECT session_id FROM {SESSIONS_TABLE} UNION "
                    f"SELECT DISTINCT session_id FROM {MESSAGES_TABLE} ORDER BY 1"
                )
            ]

    def count_items(self) -> int:
        with self.connection() as conn:
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
            with self.connection() as conn:
                conn.execute("BEGIN")  # deferred: the first SELECT fixes the snapshot
                meta = read_meta(conn, self.path)
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
        with self.connection() as conn:
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
    def pop(self, session_id: str, n: int = 1) -> Popped:
        """Remove the newest `n` items; refuses if one of them does not authenticate."""
        if n <= 0:
            raise OperationFailed("the number of items to pop must be positive")
        sealer = self.sealer()
        with self.write_transaction() as conn:
            sealer = self.check_kid(conn, sealer)  # reloaded if another process rotated
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
            set_meta(conn, scrub_pending="1")
        return Popped(popped, self.scrub())

    def clear(self, session_id: str, include_unreadable: bool = False) -> Cleared:
        """Empty one session (rows zeroed by secure_delete, WAL checkpointed).

        Items that do not authenticate (tampered, corrupt, under another key) are
        evidence, not history: the session is left whole, with ItemsUnreadable, unless
        `include_unreadable`; the result tells how many of those went.
        """
        sealer = self.sealer()
        with self.write_transaction() as conn:
            sealer = self.check_kid(conn, sealer)
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
            set_meta(conn, scrub_pending="1")
            audit(conn, "clear", sealer.kid, items=n, unreadable=unreadable)
        return Cleared(n, unreadable, self.scrub())

    def scrub_after_delete(self) -> bool:
        """Scrub after rows were deleted elsewhere (the agent session's pop).

        Marked pending first, so that a scrub kept from finishing by a reader is
        finished by the next open.
        """
        with self.write_transaction() as conn:
            set_meta(conn, scrub_pending="1")
        return self.scrub()

    def set_ttl(self, ttl: int | None) -> None:
        sealer = self.sealer()
        with self.write_transaction() as conn:
            old = read_meta(conn, self.path).get("ttl_seconds")
            new = "never" if ttl is None else str(ttl)
            set_meta(conn, ttl_seconds=new)
            audit(conn, "ttl", sealer.kid, old=old, new=new)

    def purge(self, now: int | None = None, progress: Progress | None = None) -> Report:
        """Delete items that authenticate under the key and are past the TTL."""
        sealer = self.sealer()
        deleted = kept = unreadable = 0
        with self.write_transaction() as conn:
            sealer = self.check_kid(conn, sealer)  # reloaded if another process rotated
            meta = read_meta(conn, self.path)
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
            testhooks.failpoint("purge-in-transaction")
            conn.executemany(f"DELETE FROM {MESSAGES_TABLE} WHERE id = ?", doomed)
            deleted = len(doomed)
            if deleted:
                set_meta(conn, scrub_pending="1")
            audit(conn, "purge", sealer.kid, deleted=deleted, kept=kept, unreadable=unreadable)
        scrubbed = self.scrub() if deleted else True
        return Report({"deleted": deleted, "kept": kept, "unreadable": unreadable}, scrubbed)

    def shred(self, progress: Progress | None = None) -> dict[str, Any]:
        return shred(self.path, self._keystore, progress)

    # -- agent sessions -------------------------------------------------
    def session(self, session_id: str) -> Any:
        """An `EncryptedSession` over this vault (imports the Agents SDK)."""
        from .session import make_session

        return make_session(self, session_id)


# --------------------------------------------------------------------------
# Shred: key first, then rows, then the bytes of every file.
# --------------------------------------------------------------------------
class _Damaged(Exception):
    """SQLite cannot read the vault (damaged or truncated): shred it without SQLite."""


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
        if is_damage(exc):
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
                    if is_busy(exc):
                        raise VaultBusy(
                            f"{path} is in use by another process; close the agents and "
                            "commands using it, then run shred again; nothing was destroyed"
                        ) from None
                    raise
                meta = read_meta(conn, path)
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
                    set_meta(conn, shred_started=json.dumps({k: report[k] for k in fields}))
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
                    testhooks.failpoint("shred-after-key")
                    set_meta(conn, shred_started=json.dumps({k: report[k] for k in fields}))
                conn.execute(f"DELETE FROM {MESSAGES_TABLE}")
                conn.execute(f"DELETE FROM {SESSIONS_TABLE}")
                conn.execute("DELETE FROM memvault_audit")
                conn.execute("COMMIT")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.DatabaseError as exc:
                if is_damage(exc):
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
    header = read_header(path)
    if not header.startswith((SHRED_MAGIC, SQLITE_MAGIC)):
        check_header(path)
    vault_id = None
    if header.startswith(SHRED_MAGIC):
        vault_id = _read_stamp(path).get("vault_id")
    elif not files.odd_entries(paths.sidecars(path)[1:]):
        try:
            conn = connect(path, timeout=SCRUB_WAIT)  # as any command would: no trace left
            try:
                vault_id = read_meta(conn, path).get("vault_id")
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
    header = read_header(path)
    report: dict[str, Any] = {"path": str(path), "resumed": False}
    if not header.startswith((SHRED_MAGIC, SQLITE_MAGIC)):
        check_header(path)  # not a vault at all: refused, nothing touched
    _check_shreddable(path)
    removed = _remove_planted(path)
    if header.startswith(SHRED_MAGIC):
        # Interrupted after the key and the rows were gone: finish the overwrite.
        report.update(_read_stamp(path))
        report["resumed"] = True
    else:
        try:
            try:
                check_header(path)
            except VaultCorrupt:
                raise _Damaged() from None
            _shred_rows(path, keystore, report)
        except _Damaged:
            if report.get("key_destroyed") is None:
                _destroy_keys_of_damaged(path, keystore, report)
        testhooks.failpoint("shred-after-rows")
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
        testhooks.failpoint("shred-during-overwrite")
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
