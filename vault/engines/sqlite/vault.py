"""`Vault`: the library object behind every command; its reads and its changes.

Where the rest lives:
  vault.engines.sqlite.schema     the file's tables, guard triggers and migrations
  vault.engines.sqlite.db         connections, SQLite error translation, meta/audit rows, scrub,
                   and `VaultFile.write_transaction`, the one way a change begins
  vault.engines.sqlite.lifecycle  the key: loading and checking it, rotation, revocation
  vault.engines.sqlite.shred      destroying a vault
  vault.results    what the operations return
  vault.testhooks  the crash/pause points and the chat test model, for tests only

This module never imports `agents`: only `vault.engines.sqlite.session` does, when an agent
session is opened.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from vault import backupmark, crypto, durations, paths, testhooks
from vault.engines.sqlite import restorestate
from vault.engines.sqlite.db import (
    audit,
    check_header,
    lock_timeout,
    parse_ttl,
    read_meta,
    refuse_odd_side_files,
    row_batches,
    set_meta,
)
from vault.engines.sqlite.lifecycle import KeyLifecycle
from vault.engines.sqlite.schema import (
    DEFAULT_TTL,
    FORMAT,
    ITEM_TIME,
    ITEM_WINDOW,
    ITEM_WINDOW_INDEX,
    LEGACY_FORMAT,
    MESSAGES_TABLE,
    PREVIOUS_FORMAT,
    ROTATION_LOGGED,
    SESSIONS_TABLE,
    WINDOW_SECONDS,
    last_rotation,
    migrate,
    needs_migration,
    window_start,
)
from vault.engines.sqlite.shred import shred, shred_target
from vault.errors import (
    ItemsUnreadable,
    KeyProblem,
    KeyRevoked,
    NotAVault,
    OperationFailed,
    UnknownSession,
    VaultBusy,
)
from vault.files import Progress
from vault.keys import KeyStore
from vault.results import Cleared, Popped, Report, SessionInfo

# The library's entry points. DEFAULT_TTL, Progress, lock_timeout and the shred functions
# also stay importable from here, as they were before they got modules of their own.
__all__ = [
    "DEFAULT_TTL",
    "Cleared",
    "Popped",
    "Progress",
    "Report",
    "SessionInfo",
    "Vault",
    "lock_timeout",
    "shred",
    "shred_target",
]

T = TypeVar("T")

# What `status` says of its counts (and `sessions` of its columns): they come from SQL.
COUNTS_NOTE = (
    "unverified: items counted and judged expired by their timestamps, without "
    "authenticating them; `memvault verify` authenticates every item"
)


# --------------------------------------------------------------------------
# The vault
# --------------------------------------------------------------------------
class Vault(KeyLifecycle):
    """The library object behind every command. Open with `Vault.open` or `Vault.init`.

    Its key (sealer, rotate, revoke) comes from `KeyLifecycle`; its connections,
    transactions, meta, audit and scrub from `VaultFile` (vault.engines.sqlite.db).
    """

    # -- construction ---------------------------------------------------
    @classmethod
    def init(
        cls,
        db: str | os.PathLike[str] | None = None,
        ttl: int | None = DEFAULT_TTL,
        keystore: KeyStore | None = None,
    ) -> Vault:
        """Create the vault file and its random master key; refuse if anything is there.

        Atomic: a kill at any instant leaves no vault file or a whole one (engines.sqlite.create).
        """
        from vault.engines.sqlite.create import create

        return create(cls, db, ttl, keystore)

    @classmethod
    def open(
        cls, db: str | os.PathLike[str] | None = None, keystore: KeyStore | None = None
    ) -> Vault:
        """Check that the path is a vault; the key is loaded only when needed."""
        path = paths.resolve_db_path(db)
        restorestate.finish(path)  # a restore cut off: rolled back, or finished
        check_header(path)
        refuse_odd_side_files(path)
        vault = cls(path, keystore)
        with vault.connection() as conn:  # one connection for both questions
            meta = read_meta(conn, path)
            if meta.get("format") not in (FORMAT, PREVIOUS_FORMAT, LEGACY_FORMAT):
                raise NotAVault(
                    f"{path} has an unknown memvault format {meta.get('format')!r}; "
                    "upgrade memvault"
                )
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

    def _snapshot(self, read: Callable[[sqlite3.Connection, crypto.Sealer, int | None], T]) -> T:
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
        """One row per session: its items and how many of them look expired.

        Counted in SQL from indexes, without reading or authenticating the rows, so
        the cost does not grow with the items' size and barely with their number.
        "Expired" judges each item by its Fernet timestamp, unauthenticated: a
        tampered or foreign item is counted by what it claims. `memvault verify`
        authenticates every item. The key is still required (the vault's other
        commands refuse a vault whose key is missing or revoked alike).
        """
        self.sealer()
        with self.connection() as conn:
            conn.execute("BEGIN")  # deferred: one snapshot for the meta and the counts
            meta = read_meta(conn, self.path)
            return self._count(conn, parse_ttl(meta, self.path), now)

    def _count(
        self, conn: sqlite3.Connection, ttl: int | None, now: int | None
    ) -> list[SessionInfo]:
        infos: dict[str, SessionInfo] = {}
        for sid, updated in conn.execute(f"SELECT session_id, updated_at FROM {SESSIONS_TABLE}"):
            infos[sid] = SessionInfo(sid, 0, updated_at=updated)
        # Both read the SDK's (session_id, id) index and ours: never the rows themselves.
        for sid, n in conn.execute(
            f"SELECT session_id, count(*) FROM {MESSAGES_TABLE} GROUP BY session_id"
        ):
            infos.setdefault(sid, SessionInfo(sid, 0)).items = n
        if ttl is not None:
            cutoff = (int(time.time()) if now is None else now) - ttl
            for info in infos.values():
                if info.items:
                    info.expired_unverified = self._count_expired(conn, info.session_id, cutoff)
        return sorted(infos.values(), key=lambda i: i.session_id)

    @staticmethod
    def _count_expired(conn: sqlite3.Connection, session_id: str, cutoff: int) -> int:
        """Items whose token claims a time before `cutoff`: whole windows of the index,
        and the rows themselves only in the window that holds the cut-off."""
        expired = 0
        for chars, n in conn.execute(
            f"SELECT {ITEM_WINDOW}, count(*) FROM {MESSAGES_TABLE} INDEXED BY {ITEM_WINDOW_INDEX} "
            "WHERE session_id = ? GROUP BY 1",
            (session_id,),
        ).fetchall():
            start = window_start(chars)
            if start is None or start >= cutoff:
                continue
            if start + WINDOW_SECONDS <= cutoff:
                expired += n
            else:
                expired += conn.execute(
                    f"SELECT count(*) FROM {MESSAGES_TABLE} INDEXED BY {ITEM_WINDOW_INDEX} "
                    f"WHERE session_id = ? AND {ITEM_WINDOW} = ? AND {ITEM_TIME} < ?",
                    (session_id, chars, cutoff),
                ).fetchone()[0]
        return expired

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
        out: list[Any] = []
        expired = unreadable = 0
        for opened in self.opened_items(session_id, limit, now):
            if opened.state is crypto.ItemState.READABLE:
                out.append(opened.item)
            elif opened.state is crypto.ItemState.EXPIRED:
                expired += 1
            else:
                unreadable += 1
        return out, expired, unreadable

    def opened_items(
        self,
        session_id: str,
        limit: int | None = None,
        now: int | None = None,
        include_expired: bool = False,
    ) -> Iterator[crypto.Opened]:
        """Every stored row of the session, oldest first, as an `Opened` (state, item, timestamp).

        The rows are read in one snapshot before this returns (UnknownSession and key
        errors are raised here); each is decrypted only when the iterator reaches it,
        so a caller streaming a long session holds one plaintext item at a time. With
        `include_expired`, an expired item is decrypted too and keeps its EXPIRED state.
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

        def opened() -> Iterator[crypto.Opened]:
            for data in rows:
                item = sealer.open(session_id, data, ttl, now)
                if include_expired and item.state is crypto.ItemState.EXPIRED:
                    item = sealer.open(session_id, data, None)  # authenticated, TTL not applied
                    if item.state is crypto.ItemState.READABLE:
                        item = crypto.Opened(crypto.ItemState.EXPIRED, item.item, item.timestamp)
                yield item

        return opened()

    def status(self, now: int | None = None) -> dict[str, Any]:
        """What `memvault status` shows; its counts are `sessions()`'s, unverified."""
        with self.connection() as conn:
            conn.execute("BEGIN")  # one snapshot for the meta and every count
            meta = read_meta(conn, self.path)
            ttl = parse_ttl(meta, self.path)
            infos = self._count(conn, ttl, now)
            rotated = last_rotation(meta, conn.execute(ROTATION_LOGGED).fetchone() is not None)
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
            "ttl": durations.format_duration(ttl),
            "created_at": meta.get("created_at"),
            "rotated_at": rotated,
            "scrub_pending": meta.get("scrub_pending") == "1",
            "shred_interrupted": "shred_started" in meta,
            "backup_of": meta.get(backupmark.BACKUP_OF),  # None: the live vault, not a backup
            "backed_up_at": meta.get(backupmark.BACKED_UP_AT),
            "keyring": None,
            "key": None,
        }
        out["sessions"] = len(infos)
        out["items"] = sum(i.items for i in infos)
        out["expired_unverified"] = sum(i.expired_unverified for i in infos)
        out["counts"] = COUNTS_NOTE
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

    # -- changing -------------------------------------------------------
    def pop(self, session_id: str, n: int = 1) -> Popped:
        """Remove the newest `n` items; refuses if one of them does not authenticate."""
        if n <= 0:
            raise OperationFailed("the number of items to pop must be positive")
        backupmark.refuse_writes(self, "`memvault pop`")
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
        backupmark.refuse_writes(self, "`memvault clear`")
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
        backupmark.refuse_writes(self, "`memvault ttl`")
        sealer = self.sealer()
        with self.write_transaction() as conn:
            old = read_meta(conn, self.path).get("ttl_seconds")
            new = "never" if ttl is None else str(ttl)
            set_meta(conn, ttl_seconds=new)
            audit(conn, "ttl", sealer.kid, old=old, new=new)

    def purge(self, now: int | None = None, progress: Progress | None = None) -> Report:
        """Delete items that authenticate under the key and are past the TTL.

        Reads and deletes in batches of rows, in one transaction: memory stays flat
        whatever the size of the vault. Each item is authenticated (HMAC), never
        decrypted: an expired item is deleted without its plaintext being needed.
        """
        backupmark.refuse_writes(self, "`memvault purge`")
        sealer = self.sealer()
        deleted = kept = unreadable = 0
        with self.write_transaction() as conn:
            sealer = self.check_kid(conn, sealer)  # reloaded if another process rotated
            meta = read_meta(conn, self.path)
            ttl = parse_ttl(meta, self.path)  # the TTL of this transaction's snapshot
            current = int(time.time()) if now is None else now
            for batch in row_batches(conn):
                doomed, fresh, bad = crypto.triage(batch, lambda _data: sealer, ttl, current)
                kept, unreadable = kept + fresh, unreadable + bad
                conn.executemany(f"DELETE FROM {MESSAGES_TABLE} WHERE id = ?", doomed)
                deleted += len(doomed)
                if progress:
                    progress(len(batch))
            testhooks.failpoint("purge-in-transaction")
            if deleted:
                set_meta(conn, scrub_pending="1")
            audit(conn, "purge", sealer.kid, deleted=deleted, kept=kept, unreadable=unreadable)
        scrubbed = self.scrub() if deleted else True
        return Report({"deleted": deleted, "kept": kept, "unreadable": unreadable}, scrubbed)

    def shred(self, progress: Progress | None = None) -> dict[str, Any]:
        return shred(self.path, self._keystore, progress)

    # -- agent sessions -------------------------------------------------
    def session(self, session_id: str, *, session_settings: Any = None) -> Any:
        """An `EncryptedSession` over this vault (imports the Agents SDK); `session_settings`
        as `open_session` takes it."""
        from vault.engines.sqlite.session import VaultSession

        return VaultSession(self, session_id, session_settings=session_settings)
