"""The key lifecycle: which key opens the file, rotation, revocation, key destruction.

It reads like the state table in docs/keys.md. The file is the journal: every
key version is recorded in `memvault_keys` (vault.keyjournal) before its
keyring entry `<vault_id>/<kid>` is stored, so every state a crash can leave is
finished from the file and keyring look-ups alone, by `tidy` on the next open.

* open (`sealer`): the entry of the file's `kid`; then `tidy` if the journal
  holds a pending or retired version or 0.1.0 entry names to delete.
* rotate (online, vault.engines.sqlite.filerotation): record N pending -> under the write lock,
  store N's entry, `kid` = N, `rotating_from` = old, old -> retired, N -> current,
  commit -> rows move in short batches (both keys read meanwhile) -> the marks go ->
  old -> retained while a recorded backup uses it (vault.retention), else delete the
  old entry -> old -> destroyed.
* revoke: mark the file -> delete every recorded version's entry -> all destroyed.

The transactions of a rotation open and commit by hand, not with
`write_transaction`: where each commit falls, relative to the keyring writes
and the failpoints, is the crash protocol that the crash tests check.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from vault import backupmark, crypto, keyjournal, keyload, retention, rotation, testhooks
from vault.engines.sqlite import filerotation, legacy
from vault.engines.sqlite.anchoring import Anchored
from vault.engines.sqlite.db import audit, read_meta, set_meta
from vault.engines.sqlite.keptkeys import KeptVersions
from vault.engines.sqlite.keptkeys import (
    with_backups as with_backups,  # re-exported: the engines' `key list`
)
from vault.engines.sqlite.schema import LEGACY_FORMAT, utcnow
from vault.errors import Interrupted, KeyProblem, VaultBusy, VaultError
from vault.files import Progress
from vault.keyjournal import (
    CURRENT,
    DESTROYED,
    PENDING,
    RETAINED,
    RETIRED,
    ROTATING_FROM,
    entry_name,
)
from vault.keys import KeyStore
from vault.keysource.store import anchor_store, destroy_versions, host_keyring
from vault.results import KeyVersionInfo, Report


class KeyLifecycle(KeptVersions, Anchored):
    """A vault file with its key: loaded, checked, rotated, revoked."""

    def __init__(self, path: Path, keystore: KeyStore | None = None) -> None:
        super().__init__(path)
        self._keystore = keystore
        self._sealer: crypto.Sealer | None = None
        self._rotation_committed = False  # read when Ctrl-C interrupts a rotation

    def journal(self) -> tuple[dict[str, str], list[keyjournal.KeyVersion]]:
        """The meta and the key versions, from one snapshot."""
        with self.connection() as conn:
            conn.execute("BEGIN")  # deferred: the first SELECT fixes the snapshot
            meta = read_meta(conn, self.path)
            return meta, keyjournal.versions(conn)

    def _untidy(self, meta: dict[str, str], versions: list[keyjournal.KeyVersion]) -> bool:
        """Whether `tidy` has work: a crash's leftovers, or a retained version no
        recorded backup needs any more (its backup was recorded again under another)."""
        moving = meta.get(ROTATING_FROM)  # retired, and still read: a rotation moves its rows
        if any(v.state in (PENDING, RETIRED) and v.kid != moving for v in versions):
            return True
        if not any(v.state == RETAINED for v in versions):
            return False
        with self.connection() as conn:
            recs = retention.records(conn)
        return any(
            v.state == RETAINED and retention.fate(v.kid, recs) == DESTROYED for v in versions
        )

    def sealer(self, refresh: bool = False) -> crypto.Sealer:
        """The sealer of the file's key: the entry `<vault_id>/<kid>`, nothing else.

        A 0.1.0 file moves its key to that entry first (vault.engines.sqlite.legacy). Then whatever
        a crash left (the journal's pending or retired versions) is tidied away.
        """
        if self._sealer is not None and not refresh:
            return self._sealer
        read: dict[str, list[keyjournal.KeyVersion]] = {}

        def snapshot() -> dict[str, str]:
            meta, read["versions"] = self.journal()
            return meta

        def own_key(meta: dict[str, str]) -> tuple[bool, str | None]:
            if meta["format"] != LEGACY_FORMAT:
                return False, None
            return True, legacy.upgrade(self, self.keystore, meta)

        meta, sealer = keyload.load(
            self.keystore, str(self.path), snapshot, fresh_meta=self.meta, own_key=own_key
        )
        self._sealer = sealer
        if meta.get("chain") != "on" and not backupmark.is_backup(meta):
            # The first command that holds the key after the upgrade links the rows the
            # file had (any command: verify too, as it moves a 0.1.0 key). Imported here:
            # every command loads this module, few need the chain.
            from vault import chainanchor, chainops
            from vault.engines.sqlite import chainrows

            vid = meta["vault_id"]
            anchored = anchor_store(self.keystore)
            chainops.refuse_unchained(
                anchored, vid, str(self.path), lambda: self.meta().get(chainops.CHAIN_META)
            )
            chainrows.build(self, chainops.key_of(sealer, vid), chainops.keys_for(sealer, vid))
            chainanchor.mark_chained(anchored, vid)
        elif not backupmark.is_backup(meta):
            self.bind_source(sealer)
        if (
            meta["format"] == LEGACY_FORMAT
            or keyjournal.LEGACY_MARK in meta
            or self._untidy(meta, read["versions"])
        ):
            self.tidy()
        if (
            isinstance(sealer, rotation.RotatingSealer)
            and not backupmark.is_backup(meta)
            and filerotation.cut_off(meta)
        ):
            # Its process is gone: this command finishes it, as `rotate` would.
            with contextlib.suppress(VaultBusy):
                self._finish_rotation(sealer.old, crypto.Sealer(sealer.master_key), None, True)
        return self._sealer

    def tidy(self) -> None:
        """Finish what a crash left: the table's "next open" column.

        Under the write lock, taken without waiting: a rotation stores a pending
        version's entry only while it holds that lock, so holding it proves no
        rotation is in flight, and a pending version is then a dead one. Retired
        versions are keys no row uses any more: kept (retained) while a recorded
        backup uses one, else gone, as a pending one's entry and a retained one no
        backup needs any more. The journal says so. Busy, or the keyring refusing a
        delete: a later open tries again.
        """
        ks = self.keystore
        with contextlib.suppress(VaultBusy, KeyProblem), self.connection(timeout=0) as conn:
            conn.execute("BEGIN IMMEDIATE")
            meta = read_meta(conn, self.path)
            if "revoked_at" in meta or backupmark.is_backup(meta):
                # A backup's journal is the live vault's at the time: its pending or
                # retired versions may be the live vault's keys now.
                return
            recs = retention.records(conn)
            for v in keyjournal.versions(conn):
                if v.kid == meta.get(ROTATING_FROM):
                    continue  # retired, and still read: an online rotation moves its rows
                if v.state in (PENDING, RETIRED, RETAINED) and v.kid != meta["kid"]:
                    if v.state != PENDING and retention.fate(v.kid, recs) == RETAINED:
                        if v.state == RETIRED:
                            keyjournal.record(conn, v.kid, RETAINED)
                        continue
                    ks.delete(entry_name(meta["vault_id"], v.kid))
                    testhooks.failpoint("tidy-after-delete")
                    keyjournal.record(conn, v.kid, DESTROYED)
            if keyjournal.LEGACY_MARK in meta:
                for name in json.loads(meta[keyjournal.LEGACY_MARK]):
                    ks.delete(name)
                    testhooks.failpoint("tidy-after-delete")
                conn.execute("DELETE FROM memvault_meta WHERE key = ?", (keyjournal.LEGACY_MARK,))
            conn.execute("COMMIT")

    def key_versions(self) -> list[KeyVersionInfo]:
        """Every key version this file knows, with its state and whether its entry exists.

        Loads the key first when it is there, which finishes a move from 0.1.0 or
        what a crash left, so the list shows the settled state.
        """
        with contextlib.suppress(KeyProblem):
            self.sealer(refresh=True)
        with self.connection() as conn:
            conn.execute("BEGIN")
            meta = read_meta(conn, self.path)
            recorded = {v.kid: v for v in keyjournal.versions(conn)}
            kids = keyjournal.known_kids(conn, meta)
            recs = retention.records(conn)
        ks = self.keystore
        ks.check_usable()
        here = keyjournal.present(ks, meta["vault_id"], kids)
        order = list(recorded) + sorted(kids - set(recorded))
        out = []
        for kid in order:
            v = recorded.get(kid)
            if v is not None:
                state, created = v.state, v.created_at or None
            else:  # a 0.1.0 file not moved yet: its audit trail names its keys
                state, created = (CURRENT if kid == meta["kid"] else DESTROYED), None
            out.append(KeyVersionInfo(kid, state, kid in here, created))
        return with_backups(out, recs)

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

    def check_writable(
        self, conn: sqlite3.Connection, sealer: crypto.Sealer, session_id: str = ""
    ) -> crypto.Sealer:
        """`check_kid`, and the file not put back from an older copy (`refuse_behind`):
        what a command checks in its write transaction before it writes."""
        sealer = self.check_kid(conn, sealer)
        self.refuse_behind(conn, sealer, session_id)
        return sealer

    def switch_meta(
        self,
        expect: dict[str, str | None],
        put: dict[str, str],
        drop: list[str],
        event: str,
        details: dict[str, Any],
    ) -> bool:
        # The key and the anchor read first: loading the key may write (it tidies what
        # a crash left), which inside the switch's transaction would wait on itself.
        with contextlib.suppress(KeyProblem):
            self.anchor_floor()
        return super().switch_meta(expect, put, drop, event, details)

    def before_switch(self, conn: sqlite3.Connection, after: dict[str, str]) -> None:
        """A `key move` refuses a file put back from an older copy (carried past its
        anchor, the rollback would be lost), and steps the vault head once, sealed for
        the source it moves to: the source it leaves then records that point, a copy of
        the file from before the move is behind it, and one given the other source's
        meta rows no longer matches its vault head."""
        self.switch_vault_head(conn, after)  # the key loaded by `switch_meta`

    def rotate(self, progress: Progress | None = None, scrub: bool = True) -> Report:
        """`_rotate`, with Ctrl-C turned into `Interrupted` saying whether it switched."""
        backupmark.refuse_writes(self, "`memvault rotate`")
        self._rotation_committed = False
        try:
            return self._rotate(progress, scrub)
        except KeyboardInterrupt:
            if not self._rotation_committed and not self._under_way():
                raise Interrupted(
                    "interrupted; the rotation was not committed: the vault keeps its old key "
                    "and nothing was changed"
                ) from None
            raise Interrupted(
                "interrupted after the rotation committed its switch to the new key (both "
                "keys read meanwhile): the next memvault command finishes it (moves the rest, "
                "deletes the old key, scrubs the old bytes)"
            ) from None

    def _under_way(self) -> bool:
        """Whether the file says a rotation is under way: a switch committed an instant
        before the interrupt, before `start` returned to say so."""
        with contextlib.suppress(VaultError):
            return ROTATING_FROM in self.meta()
        return False

    def settled_meta(self) -> dict[str, str]:
        """The meta once no rotation moves rows: one under way or cut off is joined and
        finished first, so that a backup copies rows under one key. Without a usable
        key, the meta as it is."""
        meta = self.meta()
        if ROTATING_FROM in meta and "revoked_at" not in meta and not backupmark.is_backup(meta):
            with contextlib.suppress(KeyProblem):
                sealer = self.sealer(refresh=True)  # finishes a cut-off one itself
                if isinstance(sealer, rotation.RotatingSealer):
                    self._finish_rotation(sealer.old, crypto.Sealer(sealer.master_key), None, True)
            meta = self.meta()
        return meta

    def _rotate(self, progress: Progress | None, scrub: bool) -> Report:
        """New key, online: the switch, rows moved in short batches, the end
        (vault.engines.sqlite.filerotation); a rotation under way or cut off is joined instead."""
        started = time.monotonic()
        old, new, resumed = filerotation.start(self)
        self._rotation_committed = True
        return self._finish_rotation(old, new, progress, scrub, started, resumed)

    def _finish_rotation(
        self,
        old: crypto.Sealer,
        new: crypto.Sealer,
        progress: Progress | None,
        scrub: bool,
        started: float | None = None,
        resumed: bool = True,
    ) -> Report:
        started = time.monotonic() if started is None else started
        counts = filerotation.finish(self, old, new, progress)
        return self._settle(old, new, {**counts, "resumed": resumed}, scrub, started)

    def _settle(
        self,
        old: crypto.Sealer,
        new: crypto.Sealer,
        counts: dict[str, int | bool],
        scrub: bool,
        started: float,
    ) -> Report:
        """After the last row moved: the old version retained or destroyed, the scrub."""
        vault_id = self.vault_id
        with self.write_transaction() as conn:
            # Under the write lock: a backup records the kid it copies under that lock
            # too, so every backup of the old key is in `recs` (a later one uses the new).
            recs = retention.records(conn)
            fate = retention.fate(old.kid, recs)
            retired = any(
                v.kid == old.kid and v.state == RETIRED for v in keyjournal.versions(conn)
            )
            if fate == RETAINED and retired:
                keyjournal.record(conn, old.kid, RETAINED)
        testhooks.failpoint("after-retained")
        if fate == DESTROYED:
            self.keystore.delete(entry_name(vault_id, old.kid))
            testhooks.failpoint("after-retired-deleted")
            with self.write_transaction() as conn:
                if any(v.kid == old.kid and v.state == RETIRED for v in keyjournal.versions(conn)):
                    keyjournal.record(conn, old.kid, DESTROYED)
        self._sealer = new
        scrubbed = self.scrub() if scrub else False
        return Report(
            {
                **counts,
                "old_kid": old.kid,
                "new_kid": new.kid,
                "old_key": fate,
                "backups": self.backups(),
                "seconds": round(time.monotonic() - started, 3),
                "scrubbed": scrubbed,
            },
            scrubbed,
        )

    def revoke(self) -> dict[str, Any]:
        """Destroy every key version the file records. The file stays, unreadable for ever.

        The file is marked first, so a revoke killed half-way is finished by the next
        one, and writers still holding the key in memory are refused by the triggers.
        Versions the file no longer used (retired by rotations) go too: a backup copy
        restored with an older kit becomes unreadable as well, and is named.
        """
        # A backup's key versions are the live vault's: revoking them is the live vault's call.
        backupmark.refuse_writes(self, "`memvault revoke`")
        ks = self.keystore
        ks.check_usable()
        with self.write_transaction() as conn:
            meta = read_meta(conn, self.path)
            vault_id = meta["vault_id"]
            kid = meta.get("revoked_kid", meta["kid"])
            already = "revoked_at" in meta
            if not already:
                set_meta(conn, revoked_at=utcnow(), revoked_kid=kid, kid="revoked")
                audit(conn, "revoke", kid)
            kids = keyjournal.known_kids(conn, meta)
            in_use = {kid} | {v.kid for v in keyjournal.versions(conn) if v.state == PENDING}
        testhooks.failpoint("revoke-after-mark")
        outcome = destroy_versions(ks, vault_id, kids, in_use)
        with self.write_transaction() as conn:
            known = {v.kid for v in keyjournal.versions(conn)}
            for k in sorted(kids):
                keyjournal.record(conn, k, DESTROYED, None if k in known else "")
        self._sealer = None
        return {"vault_id": vault_id, "kid": kid, "already_revoked": already, **outcome}

    def revocation_complete(self) -> bool:
        """False while a revoked vault's key is still in the keyring (revoke cut off)."""
        with self.connection() as conn:
            meta = read_meta(conn, self.path)
            kids = keyjournal.known_kids(conn, meta)
        ks = self.keystore
        stores = [ks] + [k for k in [host_keyring(ks)] if k is not None]
        return not any(keyjournal.present(k, meta["vault_id"], kids) for k in stores)
