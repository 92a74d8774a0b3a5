"""Online rotation of a vault file: the key-journal steps around vault.rotation's loop.

1. Record the new version `pending` (committed), as before.
2. The switch, one short transaction under the write lock: store the new version's
   keyring entry, meta `kid` = new, `rotating_from` = old, `rotation_progress` = 0,
   `rotation_owner` = this host and process; old `retired`, new `current`. From here
   the guard refuses the old kid, so every writer moves to the new key, and readers
   open both (`KeyLifecycle.sealer` loads a `RotatingSealer`).
3. The batches (vault.rotation), each its own short transaction.
4. The finish, one short transaction: the rotation marks leave the meta, `rotate`
   is audited, `scrub_pending` is set. Then the old version is retained or destroyed
   (`KeyLifecycle.retire`) and the old bytes are scrubbed, as before.

Cut off after the switch, a rotation is finished by the next `memvault rotate`, and by
the next command of any kind on this host once its process is gone (`cut_off`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from vault import crypto, keyjournal, rotation, testhooks
from vault.engines.sqlite.db import audit, read_meta, set_meta
from vault.engines.sqlite.schema import MESSAGES_TABLE, utcnow
from vault.errors import VaultBusy
from vault.files import Progress
from vault.keyjournal import CURRENT, PENDING, RETIRED, ROTATING_FROM, entry_name
from vault.keyload import refuse_revoked
from vault.keysource.store import prewrap, refuse_moved

if TYPE_CHECKING:
    from vault.chain import ChainKey
    from vault.chainvault import Point
    from vault.keys import KeyStore


class KeyLifecycle(Protocol):
    """What a rotation asks of the file vault (`lifecycle.KeyLifecycle`, which imports this
    module: a Protocol here, so that the two do not import each other)."""

    @property
    def path(self) -> Path: ...

    @property
    def keystore(self) -> KeyStore: ...

    @property
    def ttl(self) -> int | None: ...

    @property
    def vault_id(self) -> str: ...

    def sealer(self, refresh: bool = False) -> crypto.Sealer: ...

    def connection(
        self, timeout: float | None = None
    ) -> AbstractContextManager[sqlite3.Connection]: ...

    def write_transaction(
        self, timeout: float | None = None
    ) -> AbstractContextManager[sqlite3.Connection]: ...

    def refuse_behind(
        self, conn: sqlite3.Connection, sealer: crypto.Sealer, session_id: str = ""
    ) -> None: ...

    def wrote(self, point: Point | None) -> None: ...


FROM, PROGRESS, OWNER = ROTATING_FROM, "rotation_progress", "rotation_owner"
_running = 0  # rotations moving rows in this process now (threads)


def owner() -> str:
    return f"{socket.gethostname()} {os.getpid()}"


def cut_off(meta: dict[str, str]) -> bool:
    """Whether the rotation the meta names has no process moving its rows any more.

    Told only on the host that ran it, by its process id: a rotation of another host
    (a shared folder) looks alive, and `memvault rotate` finishes it. A reused process
    id makes a dead rotation look alive: the same way out.
    """
    host, _, pid = meta.get(OWNER, "").rpartition(" ")
    if host != socket.gethostname() or not pid.isdigit() or sys.platform == "win32":
        return False  # (on Windows os.kill ends the process it names)
    if int(pid) == os.getpid():
        return _running == 0
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # there, and someone else's
    return False


class FileRows:
    """vault.rotation's `RotationRows` over one connection to a vault file."""

    def __init__(
        self, conn: sqlite3.Connection, path: Path, chain_keys: tuple[ChainKey, ChainKey]
    ) -> None:
        self.conn = conn
        self.path = path
        self.chain_keys = chain_keys  # (old, new): each row's link is re-MACed as it moves
        # Each row's link as read with its text (no lock held): written re-MACed only
        # where the row still holds both (a batch reads nothing under the lock).
        self.links: dict[int, str | None] = {}

    def read_rows(self, after: int, limit: int, naming: str | None = None) -> list[rotation.Row]:
        sql = f"SELECT id, session_id, message_data, chain FROM {MESSAGES_TABLE} WHERE id > ? "
        args: tuple[object, ...] = (after, limit)
        if naming is not None:
            sql += "AND instr(message_data, ?) > 0 "
            args = (after, naming, limit)
        self.conn.execute("BEGIN")  # a read transaction: no lock a writer waits for
        try:
            found = self.conn.execute(sql + "ORDER BY id LIMIT ?", args).fetchall()
        finally:
            self.conn.execute("COMMIT")
        self.links.update((row_id, link) for row_id, _sid, _data, link in found)
        return [(row_id, sid, data) for row_id, sid, data, _link in found]

    def last_id(self) -> int:
        """The highest row id (0 for none): how far the batches go, at most."""
        (last,) = self.conn.execute(f"SELECT coalesce(max(id), 0) FROM {MESSAGES_TABLE}").fetchone()
        return int(last)

    def write_rows(
        self, old_kid: str, new_kid: str, updates: list[rotation.Update], progress: int | None
    ) -> int | None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            meta = read_meta(conn, self.path)
            if meta["kid"] != new_kid or meta.get(FROM) != old_kid:
                conn.execute("ROLLBACK")
                return None
            before = conn.total_changes
            # Whichever process re-encrypted the rows (this one or the workers), the link
            # is re-MACed here, under the lock, in the UPDATE that stores the new text.
            from vault.engines.sqlite import chainrows  # here: every command imports this module

            old, new = self.chain_keys
            conn.executemany(
                f"UPDATE {MESSAGES_TABLE} SET message_data = ?, chain = ? "
                "WHERE id = ? AND message_data = ? AND chain IS ?",
                chainrows.remac_updates(old, new, updates, self.links),
            )
            written = conn.total_changes - before
            if progress is not None:
                set_meta(conn, **{PROGRESS: str(progress)})
                # The batch's rows not moved (unreadable, or new already) need no link now.
                for row_id in [k for k in self.links if k <= progress]:
                    del self.links[row_id]
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise
        return written


def start(lc: KeyLifecycle) -> tuple[crypto.Sealer, crypto.Sealer, bool]:
    """(old, new, resumed): joins a rotation under way, else records and switches a new one."""
    new = crypto.Sealer(crypto.generate_key())
    for _attempt in range(5):
        current = lc.sealer(refresh=True)
        if isinstance(current, rotation.RotatingSealer):
            return current.old, crypto.Sealer(current.master_key), True
        # A transit key wraps it first: a token that may not do so fails with nothing written.
        prewrap(lc.keystore, entry_name(lc.vault_id, new.kid), new.master_key)
        with lc.write_transaction() as conn:
            refuse_revoked(read_meta(conn, lc.path))
            lc.refuse_behind(conn, current)  # before anything is recorded; again at the switch
            keyjournal.record(conn, new.kid, PENDING)
        testhooks.failpoint("after-record-pending")
        if _switch(lc, current, new):
            return current, new, False
    raise VaultBusy(f"{lc.path} kept changing key during the rotation; try again")


def _switch(lc: KeyLifecycle, old: crypto.Sealer, new: crypto.Sealer) -> bool:
    """Store the new entry and switch the file to it, under the write lock. False,
    changing nothing, when the file moved on since `old` was loaded or our pending
    record was tidied away (another process's `tidy` cannot tell it from a dead one)."""
    ks = lc.keystore
    stored = committed = False
    with lc.connection() as conn:
        conn.execute("BEGIN IMMEDIATE")
        meta = read_meta(conn, lc.path)
        refuse_revoked(meta)
        refuse_moved(ks, meta, lc.path)
        lc.refuse_behind(conn, old)  # its vault head is re-MACed below: never from an older copy
        states = {v.kid: v.state for v in keyjournal.versions(conn)}
        if meta["kid"] != old.kid or FROM in meta or states.get(new.kid) != PENDING:
            return False
        vault_id = meta["vault_id"]
        try:
            ks.set(entry_name(vault_id, new.kid), new.master_key)
            stored = True
            testhooks.failpoint("after-pending")
            set_meta(
                conn,
                kid=new.kid,
                rotated_at=utcnow(),
                **{FROM: old.kid, PROGRESS: "0", OWNER: owner()},
            )
            keyjournal.record(conn, old.kid, RETIRED)
            keyjournal.record(conn, new.kid, CURRENT)
            # The heads move to the new key with the switch: a writer from here on holds
            # only the new key, and the old one is retired once the rows have moved.
            from vault import chainops
            from vault.engines.sqlite import chainrows

            at = chainrows.remac_heads(
                conn, chainops.key_of(old, vault_id), chainops.key_of(new, vault_id)
            )
            committed = True  # from here the outcome of a failure is unknown
            conn.execute("COMMIT")
            lc.wrote(at)  # a state this object knows, as one it read
        finally:
            if stored and not committed:
                # Still holding the lock and nothing committed: no row uses the new key,
                # so its entry goes (the pending record is tidied by the next open).
                with contextlib.suppress(Exception):
                    conn.execute("ROLLBACK")
                with contextlib.suppress(Exception):
                    ks.delete(entry_name(vault_id, new.kid))
    testhooks.failpoint("after-switch")
    return True


def finish(
    lc: KeyLifecycle,
    old: crypto.Sealer,
    new: crypto.Sealer,
    progress: Progress | None = None,
) -> dict[str, int]:
    """Move the rows left under `old` and end the rotation: the meta's marks go, the
    rotation is audited (by whichever process ends it) and the scrub is due."""
    global _running
    _running += 1
    try:
        with lc.connection() as conn:
            meta = read_meta(conn, lc.path)
            if meta.get(FROM) == old.kid and meta.get(OWNER) != owner():
                with lc.write_transaction() as w:  # this process carries it on now
                    set_meta(w, **{OWNER: owner()})
            begin = int(meta.get(PROGRESS, "0") or 0)
            from vault import chainops

            keys = (chainops.key_of(old, lc.vault_id), chainops.key_of(new, lc.vault_id))
            rows = FileRows(conn, lc.path, keys)
            moved = rotation.move_rows(
                rows,
                old,
                new,
                begin,
                lc.ttl,
                progress,
                rotation.DEFAULT_BATCH,  # read here: a test may set smaller batches
                rotation.DEFAULT_PAUSE,
                rows_left=rows.last_id() - begin,
            )
    finally:
        _running -= 1
    counts = moved.counts()
    with lc.write_transaction() as conn:
        meta = read_meta(conn, lc.path)
        if meta.get(FROM) == old.kid and meta["kid"] == new.kid:
            conn.execute(
                "DELETE FROM memvault_meta WHERE key IN (?, ?, ?)", (FROM, PROGRESS, OWNER)
            )
            set_meta(conn, scrub_pending="1")
            audit(conn, "rotate", new.kid, old_kid=old.kid, online=True, **counts)
    testhooks.failpoint("after-commit")
    return counts
