"""The key lifecycle: which key opens the file, rotation, revocation, key destruction.

A vault's key lives in the OS keyring under its vault id; a rotation stores the
new key as the pending entry (`.next`) while it holds the write lock, rewrites
every envelope in one transaction, then promotes the pending key. Every open
(`sealer`) finishes a rotation cut off after its commit and drops the pending
key of one that died before it. Revocation marks the file, then destroys the
keys; shred uses `destroy_keys`, which destroys only this file's keys.

The transactions here open and commit by hand, not with `write_transaction`:
where each commit falls, relative to the keyring writes and the failpoints, is
the crash protocol that the crash tests check.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path
from typing import Any

from . import crypto, testhooks
from .db import VaultFile, audit, read_meta, set_meta
from .errors import Interrupted, KeyMismatch, KeyRevoked, VaultBusy
from .files import Progress
from .keys import KeyStore, require_key
from .results import Report
from .schema import MESSAGES_TABLE, utcnow


class KeyLifecycle(VaultFile):
    """A vault file with its key: loaded, checked, rotated, revoked."""

    def __init__(self, path: Path, keystore: KeyStore | None = None) -> None:
        super().__init__(path)
        self._keystore = keystore
        self._sealer: crypto.Sealer | None = None
        self._rotation_committed = False  # read when Ctrl-C interrupts a rotation

    @property
    def keystore(self) -> KeyStore:
        if self._keystore is None:
            self._keystore = KeyStore()
        return self._keystore

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
        with self.connection(timeout=None if wait else 0) as conn:
            conn.execute("BEGIN IMMEDIATE")
            meta = read_meta(conn, self.path)
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
            with self.connection(timeout=0) as conn:
                conn.execute("BEGIN IMMEDIATE")
                if read_meta(conn, self.path)["kid"] == file_kid:
                    self.keystore.delete_pending(vault_id)
                conn.execute("ROLLBACK")
        except VaultBusy:
            pass  # a writer is busy; a later open will tidy up

    def check_kid(self, conn: sqlite3.Connection, sealer: crypto.Sealer) -> crypto.Sealer:
        """Inside a write transaction: the file still uses the key we hold.

        Returns the sealer to write with: `sealer`, or the key reloaded when another
        process rotated since `sealer` was loaded.
        """
        if read_meta(conn, self.path)["kid"] != sealer.kid:
            conn.execute("ROLLBACK")
            fresh = self.sealer(refresh=True)
            conn.execute("BEGIN IMMEDIATE")
            if read_meta(conn, self.path)["kid"] != fresh.kid:
                raise VaultBusy(f"{self.path} changed key while this command ran; try again")
        return self._sealer or sealer

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
        with self.connection() as conn:
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("BEGIN IMMEDIATE")
            old = self.check_kid(conn, old)
            vault_id = read_meta(conn, self.path)["vault_id"]
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
                testhooks.failpoint("after-pending")
                set_meta(conn, kid=new.kid, rotated_at=utcnow(), scrub_pending="1")
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
                    testhooks.failpoint("in-transaction")
                audit(
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
        testhooks.failpoint("after-commit")
        try:
            promoted = self._promote(vault_id, new)
        except VaultBusy:
            # Committed, and `.next` holds the key: the next open (or rotation) promotes it.
            promoted = True
        testhooks.failpoint("after-promotion")
        self._sealer = new if promoted else None
        if not promoted:
            self.sealer(refresh=True)  # revoked meanwhile: KeyRevoked; else the newer key
        scrubbed = self.scrub() if scrub else False
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
        with self.connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            meta = read_meta(conn, self.path)
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
                set_meta(conn, revoked_at=utcnow(), revoked_kid=kid, kid="revoked")
                audit(conn, "revoke", kid)
            conn.execute("COMMIT")
            testhooks.failpoint("revoke-after-mark")
            # Still under the write lock: no rotation can store or promote a key meanwhile.
            destroyed = False
            if pending is not None:
                destroyed = ks.delete_pending(vault_id)
            testhooks.failpoint("revoke-after-pending")
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
