"""`Vault`: the library object behind every command; its reads and its changes.

Where the rest lives:
  vault.engines.sqlite.schema     the file's tables, guard triggers and migrations
  vault.engines.sqlite.db         connections, SQLite error translation, meta/audit rows, scrub,
                   and `VaultFile.write_transaction`, the one way a change begins
  vault.engines.sqlite.lifecycle  the key: loading and checking it, rotation, revocation
  vault.engines.sqlite.shred      destroying a vault
  vault.results, vault.testhooks   what operations return; crash points for tests

This module never imports `agents`: only `vault.engines.sqlite.session` does, when an agent
session is opened.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from vault import backupmark, crypto, paths, testhooks
from vault.engines.sqlite import restorestate
from vault.engines.sqlite.counts import count_sessions, file_status
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
    FILE_FORMAT,
    FORMAT,
    LEGACY_FORMAT,
    MESSAGES_TABLE,
    PREVIOUS_FORMAT,
    SESSIONS_TABLE,
    migrate,
    needs_migration,
    session_exists_sql,
)
from vault.engines.sqlite.shred import shred, shred_target
from vault.errors import (
    NotAVault,
    OperationFailed,
    VaultBusy,
)
from vault.files import Progress
from vault.importing import ImportsFiles
from vault.keyload import refuse_revoked
from vault.keys import KeyStore
from vault.results import Accepted, Cleared, Popped, Report, SessionInfo
from vault.vaultops import (
    ReadsItems,
    check_limit,
    open_rows,
    popped_item,
    refuse_unreadable,
    ttl_value,
    unknown_session,
)

# The library's entry points; the others stay importable from here, as they were before.
__all__ = ["DEFAULT_TTL", "Cleared", "Popped", "Progress", "Report", "SessionInfo", "Vault"]
__all__ += ["lock_timeout", "shred", "shred_target"]

if TYPE_CHECKING:
    from vault.engines.sqlite.backup import BackupResult
    from vault.importer import Importer
    from vault.verify import VerifyReport

T = TypeVar("T")


class Vault(KeyLifecycle, ImportsFiles, ReadsItems):
    """The library object behind every command. Open with `Vault.open` or `Vault.init`.

    Its key (sealer, rotate, revoke) comes from `KeyLifecycle`; its connections,
    transactions, meta, audit and scrub from `VaultFile` (vault.engines.sqlite.db).
    """

    backup_note: str | None = None  # nothing to add: the copy is a file like this one
    stays = "file"  # what a revoke leaves

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

        return create(cls, cls.open, db, ttl, keystore)

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
            if meta.get("format") not in (FILE_FORMAT, FORMAT, PREVIOUS_FORMAT, LEGACY_FORMAT):
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

    @classmethod
    def verify(cls, db: str | os.PathLike[str] | None = None) -> VerifyReport:
        """`memvault verify`: every check, read-only (vault.verify; no migration, no scrub)."""
        from vault.verify import verify

        return verify(db)

    def history_verdict(self, session_id: str) -> str | None:
        """What is wrong with the session's chain (a `Tamper` kind's text), or None."""
        from vault.engines.sqlite import chainrows  # here: most commands never need it

        floor = self.anchor_floor()  # before the snapshot: never newer than what it reads

        def read(conn: sqlite3.Connection, sealer: crypto.Sealer, _ttl: int | None) -> str | None:
            self._require_session(conn, session_id)
            keys = chainrows.keys_for(sealer, self.vault_id)
            return chainrows.verdict(conn, keys, session_id, floor)

        return self._snapshot(read)

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
        authenticates every item. No key is needed, so the keyring is not reached:
        the ids and counts are in the file in clear. A revoked vault is still refused,
        by its own mark (docs/keys.md, "Which commands need the key").
        """
        with self.connection() as conn:
            conn.execute("BEGIN")  # deferred: one snapshot for the meta and the counts
            meta = read_meta(conn, self.path)
            refuse_revoked(meta)
            return count_sessions(conn, parse_ttl(meta, self.path), now)

    def _require_session(self, conn: sqlite3.Connection, session_id: str) -> None:
        found = conn.execute(
            session_exists_sql("?"),
            (session_id, session_id),
        ).fetchone()
        if not found:
            raise unknown_session(session_id, self.path)

    def opened_items(
        self,
        session_id: str,
        limit: int | None = None,
        now: int | None = None,
        include_expired: bool = False,
        include_tampered: bool = False,
    ) -> Iterator[crypto.Opened]:
        """Every stored row of the session, oldest first, as an `Opened` (state, item, timestamp).

        The rows are read in one snapshot before this returns (UnknownSession and key
        errors are raised here); each is decrypted only when the iterator reaches it,
        so a caller streaming a long session holds one plaintext item at a time. With
        `include_expired`, an expired item is decrypted too and keeps its EXPIRED state.
        A session whose chain does not verify raises HistoryTampered, unless `include_tampered`.
        """
        from vault.engines.sqlite import chainrows  # here: most commands never need it

        check_limit(limit)
        floor = None if include_tampered else self.anchor_floor()  # before the snapshot

        def read(
            conn: sqlite3.Connection, sealer: crypto.Sealer, ttl: int | None
        ) -> tuple[crypto.Sealer, int | None, list[str]]:
            self._require_session(conn, session_id)
            if not include_tampered:
                keys = chainrows.keys_for(sealer, self.vault_id)
                verdict = chainrows.judge(conn, keys, session_id, limit, floor=floor)
                chainrows.refuse(verdict, session_id, str(self.path))
            sql = f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = ? ORDER BY id DESC"
            args: tuple[Any, ...] = (session_id,)
            if limit is not None:
                sql += " LIMIT ?"
                args += (limit,)
            return sealer, ttl, [r[0] for r in conn.execute(sql, args)][::-1]

        sealer, ttl, rows = self._snapshot(read)
        return open_rows(lambda _data: sealer, session_id, rows, ttl, now, include_expired)

    def status(self, now: int | None = None) -> dict[str, Any]:
        """What `memvault status` shows; its counts are `sessions()`'s, unverified."""
        return file_status(self, now)

    # -- changing -------------------------------------------------------
    def pop(self, session_id: str, n: int = 1) -> Popped:
        """Remove the newest `n` items; refuses if one of them does not authenticate."""
        from vault.engines.sqlite import chainrows  # here: most commands never need it

        if n <= 0:
            raise OperationFailed("the number of items to pop must be positive")
        backupmark.refuse_writes(self, "`memvault pop`")
        sealer = self.sealer()
        with self.write_transaction() as conn:
            sealer = self.check_writable(conn, sealer, session_id)  # reloaded if rotated
            self._require_session(conn, session_id)
            gone = conn.execute(
                f"SELECT id, message_data, chain FROM {MESSAGES_TABLE} WHERE session_id = ? "
                "ORDER BY id DESC LIMIT ?",
                (session_id, n),
            ).fetchall()
            popped = [popped_item(sealer, session_id, _id, data) for _id, data, _lk in gone]
            conn.executemany(f"DELETE FROM {MESSAGES_TABLE} WHERE id = ?", [(r[0],) for r in gone])
            keys = chainrows.keys_for(sealer, self.vault_id)  # each row's link: its own kid's
            rows = [(str(r[1]), r[2]) for r in gone]
            at = chainrows.after_pop(conn, keys[sealer.kid], session_id, rows, str(self.path), keys)
            set_meta(conn, scrub_pending="1")
        self.wrote(at)
        return Popped(popped, self.scrub())

    def clear(self, session_id: str, include_unreadable: bool = False) -> Cleared:
        """Empty one session (rows zeroed by secure_delete, WAL checkpointed).

        Items that do not authenticate (tampered, corrupt, under another key) are
        evidence, not history: the session is left whole, with ItemsUnreadable, unless
        `include_unreadable`; the result tells how many of those went.
        """
        from vault.engines.sqlite import chainrows  # here: most commands never need it

        backupmark.refuse_writes(self, "`memvault clear`")
        sealer = self.sealer()
        with self.write_transaction() as conn:
            sealer = self.check_writable(conn, sealer, session_id)
            self._require_session(conn, session_id)
            unreadable = sum(
                sealer.state(session_id, data, None) is crypto.ItemState.UNREADABLE
                for (data,) in conn.execute(
                    f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = ?",
                    (session_id,),
                )
            )
            refuse_unreadable(session_id, unreadable, include_unreadable)
            n = conn.execute(
                f"DELETE FROM {MESSAGES_TABLE} WHERE session_id = ?", (session_id,)
            ).rowcount
            conn.execute(f"DELETE FROM {SESSIONS_TABLE} WHERE session_id = ?", (session_id,))
            key = chainrows.key_of(sealer, self.vault_id)
            at = chainrows.after_clear(conn, key, session_id, str(self.path), include_unreadable)
            set_meta(conn, scrub_pending="1")
            audit(conn, "clear", sealer.kid, items=n, unreadable=unreadable)
        self.wrote(at)
        return Cleared(n, unreadable, self.scrub())

    def accept_history(self) -> Accepted:
        """Take the sessions as they stand as the vault's state (engines.sqlite.accepting)."""
        from vault.engines.sqlite.accepting import accept_history

        return accept_history(self)

    def set_ttl(self, ttl: int | None) -> None:
        backupmark.refuse_writes(self, "`memvault ttl`")
        sealer = self.sealer()
        with self.write_transaction() as conn:
            old = read_meta(conn, self.path).get("ttl_seconds")
            new = ttl_value(ttl)
            set_meta(conn, ttl_seconds=new)
            audit(conn, "ttl", sealer.kid, old=old, new=new)

    def purge(self, now: int | None = None, progress: Progress | None = None) -> Report:
        """Delete items that authenticate under the key and are past the TTL.

        In batches, in one transaction: memory stays flat. Each item is authenticated,
        never decrypted. A session loses only its oldest items, up to its first one that
        stays (chainrows.PurgedPrefix: the chain records a purge as a new base)."""
        from vault.engines.sqlite import chainrows  # here: most commands never need it

        backupmark.refuse_writes(self, "`memvault purge`")
        sealer = self.sealer()
        deleted = kept = unreadable = 0
        with self.write_transaction() as conn:
            sealer = self.check_writable(conn, sealer)  # reloaded if another process rotated
            meta = read_meta(conn, self.path)
            ttl = parse_ttl(meta, self.path)  # the TTL of this transaction's snapshot
            current = int(time.time()) if now is None else now
            keys = chainrows.keys_for(sealer, self.vault_id)
            prefix = chainrows.PurgedPrefix(keys, keys[sealer.kid], str(self.path))
            for batch in row_batches(conn):
                expired, fresh, bad = crypto.triage(batch, lambda _data: sealer, ttl, current)
                doomed = prefix.take(conn, batch, expired)
                kept += fresh + len(expired) - len(doomed)
                unreadable += bad
                conn.executemany(f"DELETE FROM {MESSAGES_TABLE} WHERE id = ?", doomed)
                deleted += len(doomed)
                if progress:
                    progress(len(batch))
            at = prefix.move_heads(conn)
            testhooks.failpoint("purge-in-transaction")
            if deleted:
                set_meta(conn, scrub_pending="1")
            audit(conn, "purge", sealer.kid, deleted=deleted, kept=kept, unreadable=unreadable)
        self.wrote(at)
        scrubbed = self.scrub() if deleted else True
        notes = {"tampered": ", ".join(sorted(prefix.tampered))} if prefix.tampered else {}
        return Report({"deleted": deleted, "kept": kept, "unreadable": unreadable}, scrubbed, notes)

    def settle_keyring(self) -> dict[str, list[str]]:
        """Nothing after a kit import: opening the file settles its entries (`tidy`)."""
        return {}

    def shred(self, progress: Progress | None = None) -> dict[str, Any]:
        return shred(self.path, self._keystore, progress)

    def backup(self, dest: str | os.PathLike[str]) -> BackupResult:
        """A recorded copy of this file at `dest`, marked as a backup (engines.sqlite.backup)."""
        from vault.engines.sqlite.backup import backup

        return backup(self, dest)

    def importer_class(self) -> type[Importer]:
        from vault.importer import Importer

        return Importer

    # -- agent sessions -------------------------------------------------
    def session(self, session_id: str, *, session_settings: Any = None) -> Any:
        """An `EncryptedSession` over this vault (imports the Agents SDK); `session_settings`
        as `open_session` takes it."""
        from vault.engines.sqlite.session import VaultSession

        return VaultSession(self, session_id, session_settings=session_settings)
