"""A vault file and its anchor (vault.chainanchor): the floor its reads are judged
against, and the step that records the file's state outside it.

The live file's floor is the keyring's anchor, read once when first needed; a backup's
is the point sealed into it when it was made (`backup_point`), which it must equal,
never the live vault's anchor (it is older by design). `record_anchor` advances the
anchor to the file's vault head: every command that opened the key does it as it
ends (vault.cli.common.open_any), an open agent session when it closes and at least
every `anchor_every` seconds while it writes. Docs: docs/history-chain.md, "The anchor".
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from vault import backupmark
from vault.engines.sqlite.db import meta_rows, read_meta, set_meta
from vault.errors import KeyProblem, VaultError
from vault.keysource.store import anchor_store, marked_left, serves

# The chain's modules are imported where used: every command loads this one (a base of
# `Vault`), few judge or record a vault head.
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager

    from vault import crypto
    from vault.chainfloor import Floor
    from vault.chainvault import Point
    from vault.keys import KeyStore


def backup_floor(
    meta: dict[str, str], sealer: crypto.Sealer, through: str | None = None
) -> Floor | None:
    """A backup's floor: the point sealed into it, exact; one whose seal does not
    authenticate (made for another state or place) is judged by a point no vault head
    has. None for a backup with no seal: made where its key could not be loaded (a copy
    worth having all the same), or of an unchained vault."""
    from vault import chainops, chainvault
    from vault.chainfloor import Floor
    from vault.chainvault import Point

    text = meta.get(backupmark.BACKUP_POINT)
    if text is None:
        return None
    keys = chainops.keys_for(sealer, meta["vault_id"])
    backup_id, source = meta.get(backupmark.BACKUP_ID, ""), meta.get(backupmark.BACKUP_FROM, "")
    point = chainvault.backup_point(keys, backup_id, source, text)
    return Floor(point or Point(-1, b""), exact=True, source=through)


def at_its_source(meta: dict[str, str], path: Path) -> bool:
    """Whether a backup's file is the one at the live vault's place: copied back over
    it, it is the live vault put back, judged by the live anchor, not by its seal."""
    try:
        return os.path.samefile(meta.get(backupmark.BACKUP_FROM, ""), path)
    except (OSError, ValueError):
        return False  # no file there (or a PostgreSQL vault's URL)


def backup_away(meta: dict[str, str], path: Path) -> bool:
    """Whether the file at `path` is a backup judged by its own seal: one not at its
    live vault's place."""
    return backupmark.is_backup(meta) and not at_its_source(meta, path)


def floor_for(
    meta: dict[str, str], sealer: crypto.Sealer, ks: KeyStore, path: Path, *, away: bool
) -> Floor | None:
    """The floor of the file at `path` whose meta is `meta`: its own sealed point for a
    backup `away` from its place (`backup_away`), the anchor for a live vault (the keyring's,
    or a transit vault's key service's), or for a backup copied back over it."""
    from vault import chainanchor
    from vault.chainfloor import Floor
    from vault.engines.sqlite.vaulthead import store_source

    # The source this process reads the file through: a file naming another one at its
    # judgment is not judged by this floor (vaulthead.refuse_other_source).
    through = store_source(ks)
    if away:
        return backup_floor(meta, sealer, through)
    try:
        vid, named = meta["vault_id"], serves(ks, meta)
        return chainanchor.floor(anchor_store(ks), vid, named=named, source=through)
    except ValueError:  # an entry memvault did not write: judged as no anchor yet
        return Floor(source=through)


# How long a record, in this host's anchor turn, waits to read the file's marks: a
# writer's commit or a last connection's checkpoint is over by then, a shred is not.
MARK_WAIT = 0.5

# `head_reader`'s: a file's vault head point, None when none authenticates (or no key).
HeadReader: TypeAlias = "Callable[[sqlite3.Connection], Point | None]"


class Anchored:
    """The anchor side of a vault file (a base of `Vault`)."""

    path: Path
    _sealer: crypto.Sealer | None
    _floor: Floor | None = None
    _floor_read = False
    # The vault id, and whether a backup, as the floor was read: rows no MAC covers,
    # changed under an open session, must not stop its records (a copy from past the
    # change, put back, would pass). A record stops for a backup only while the file
    # still says so: one `restore` made the live vault again records.
    _judged: tuple[str, bool, bool] | None = None  # vault id, backup, backup elsewhere

    if TYPE_CHECKING:  # the Vault's own (vault.engines.sqlite.db, .lifecycle)

        @property
        def keystore(self) -> KeyStore: ...

        def meta(self) -> dict[str, str]: ...

        def sealer(self, refresh: bool = False) -> crypto.Sealer: ...

        def connection(
            self, timeout: float | None = None
        ) -> AbstractContextManager[sqlite3.Connection]: ...

        def write_transaction(
            self, timeout: float | None = None
        ) -> AbstractContextManager[sqlite3.Connection]: ...

    def anchor_floor(self) -> Floor | None:
        """The floor this object judges the file's vault head against (read once: the
        reads of this process raise it from there)."""
        if not self._floor_read:
            sealer = self.sealer()
            meta = self.meta()
            elsewhere = backup_away(meta, self.path)
            self._floor = floor_for(meta, sealer, self.keystore, self.path, away=elsewhere)
            self._judged = (meta["vault_id"], backupmark.is_backup(meta), elsewhere)
            self._floor_read = True
        return self._floor

    def stored_anchor(self, strict: bool = False) -> Point | None:
        """The anchor's point as its store holds it now (None: none yet, or one memvault
        did not write). A store that fails reads as None too, unless `strict`: `accept`
        falls back to its floor, while `restore` must not move an anchor it could not read."""
        from vault import chainanchor

        try:
            return chainanchor.read(anchor_store(self.keystore), self.meta()["vault_id"])
        except ValueError:
            return None
        except (VaultError, KeyError):
            if strict:
                raise
            return None

    def wrote(self, point: Point | None) -> None:
        """After this object's own write committed (pop, clear, purge, import, rotate): its
        floor, once read, passes the vault head it wrote, a state it knows as well as one
        it read, so a copy from before it, put back, is told (an agent session shares
        this floor)."""
        if point is not None and self._floor is not None:
            self._floor.passes(point)

    def record_anchor(self, into: KeyStore | None = None, *, lifted: bool = False) -> Point | None:
        """Advance the anchor to the file's vault head, when this object has opened the
        key and the vault head authenticates under it; returns what the anchor holds
        then. Never for a backup, nor into an anchor a revoke or shred has forgotten
        (`chainanchor.advance`'s `held`). `into`: the
        anchor of that key source (`key move`'s, of the source it left), not this
        object's. `lifted`: `restore` or `accept` has just put the vault head past the
        anchor on purpose, which then clears a mark left by a `key move`.
        A failure (the keyring or the file gone) is not the caller's: the anchor then
        stays behind, a wider window, never a false alarm."""
        if self._sealer is None or not self.path.exists():
            return None
        from vault import chainanchor, chainops
        from vault.engines.sqlite import vaulthead

        with contextlib.suppress(VaultError, sqlite3.Error, OSError, ValueError, KeyError):
            store = anchor_store(into or self.keystore)
            floor = self.anchor_floor()
            if self._judged is None:
                return None
            vid, was_backup, away = self._judged
            keys = chainops.keys_for(self._sealer, vid)

            def now() -> Point | None:
                # In the anchor's turn: the file's state then, not one read before another
                # process's `accept` put it aside (chainanchor.advance).
                with self._snapshot_meta() as (conn, meta):
                    if away or (was_backup and backupmark.is_backup(meta)):
                        return None  # a backup, as judged and still (a mark added stops none)
                    # Rows no MAC covers: believed only as far as revoke or shred acted on
                    # them (the anchor forgotten), asked again in the turn (`_marked`).
                    if into is not None:
                        vh = vaulthead.authentic(conn, keys)
                    else:
                        # A head sealed for the source this object loaded its key and
                        # anchor through, whatever the rows say: rows changed under an open
                        # session must not stop its records (a 0.2 head vouches for none).
                        through = vaulthead.store_source(self.keystore)
                        vh = vaulthead.authentic(conn, keys, through)
                        if vh is not None and vh.source is None and not serves(self.keystore, meta):
                            vh = None
                if vh is None:
                    return None
                if floor is not None and lifted:
                    floor.lift(vh.point())
                if floor is not None and not floor.passes(vh.point()):
                    return None  # a file behind what was seen of it: never recorded as newer
                return vh.point()

            try:
                held = chainanchor.advance(
                    store, vid, now, lifted=lifted, held=self._marked,
                    seen=floor if into is None else None,
                )  # fmt: skip
            except chainanchor.Forked:
                return None  # the anchor and this process's floor marked (`advance`)
            if floor is not None and held is not None:
                floor.passes(held)  # raised: this process has seen the file get there
            return held
        return None

    def bind_source(self, sealer: crypto.Sealer) -> None:
        """As the key is loaded, before anything copies the file (`backup`): a 0.2 vault
        head sealed, at the same point, for the key source the key was loaded through
        (vaulthead.bind). Only if the write lock is free at once: a command that only
        reads never waits on a writer for it, and a later one does it."""
        from vault import chainops
        from vault.engines.sqlite import vaulthead

        with contextlib.suppress(VaultError, sqlite3.Error, OSError):
            with self.connection() as conn:
                if not vaulthead.unbound(conn):
                    return
            through = vaulthead.store_source(self.keystore)
            with self.write_transaction(timeout=0) as conn:
                keys = chainops.keys_for(sealer, read_meta(conn, self.path)["vault_id"])
                vaulthead.bind(conn, keys, through)

    def refuse_behind(
        self, conn: sqlite3.Connection, sealer: crypto.Sealer, session_id: str = ""
    ) -> None:
        """Inside a write transaction, before a command writes: refuse a file behind this
        process's floor. Written to, it would move on from the older state past the
        anchor, and the rollback would be lost (`accept` takes it on purpose)."""
        floor = self.anchor_floor()
        if floor is None:
            return
        from vault import chainops
        from vault.engines.sqlite import vaulthead

        # The vault id from the caller's own transaction: no second connection.
        key = chainops.key_of(sealer, read_meta(conn, self.path)["vault_id"])
        vaulthead.refuse_behind(conn, key, floor, session_id, str(self.path))

    def switch_vault_head(self, conn: sqlite3.Connection, to: dict[str, str]) -> None:
        """Inside a `key move`'s switch: `refuse_behind`, then the vault head one write
        on, sealed for the key source the meta `to` names (vaulthead.step). Without the
        key loaded, a file that has a vault head is not switched: its rows would name a
        source its vault head is not sealed for, a mismatch to every reader."""
        from vault import chainops
        from vault.engines.sqlite import vaulthead

        sealer = self._sealer
        if sealer is None:
            if vaulthead.exists(conn):
                raise KeyProblem(
                    f"the key of {self.path} could not be loaded to seal the move; nothing "
                    "was moved; check that its key source answers, then run `memvault key "
                    "move` again"
                )
            return
        self.refuse_behind(conn, sealer)
        vaulthead.step(conn, chainops.key_of(sealer, read_meta(conn, self.path)["vault_id"]), to)

    @contextlib.contextmanager
    def _snapshot_meta(self) -> Iterator[tuple[sqlite3.Connection, dict[str, str]]]:
        # In the anchor's turn: a file held by another (a restore's exclusive lock) is
        # not waited for long, as the turn is this host's (`_marked`).
        with self.connection(timeout=MARK_WAIT) as conn:
            conn.execute("BEGIN")  # deferred: the meta and the vault head of one snapshot
            yield conn, meta_rows(conn)  # a required row deleted stops no record

    def _marked(self) -> bool:
        """In the anchor's turn: whether the file is marked revoked or being shredded.
        Waits on SQLite only briefly (a shred holds the file as it waits for the turn): a
        file not to be read by then counts as marked, which moves only an anchor there."""
        try:
            with self.connection(timeout=MARK_WAIT) as conn:
                return bool({"revoked_at", "shred_started"} & set(meta_rows(conn)))
        except (VaultError, sqlite3.Error, OSError):
            return True


def head_reader(live: Anchored) -> HeadReader:
    """For `restore`: what reads, later, under its lock, the point of the file `live`
    replaces, if its vault head authenticates. Its key is loaded now: loading reads
    the file, which the lock then closes to other connections."""
    from vault import chainops
    from vault.engines.sqlite import vaulthead

    try:
        keys = chainops.keys_for(live.sealer(), live.meta()["vault_id"])
    except VaultError:  # no key: judged by the anchor alone
        keys = {}

    def read(conn: sqlite3.Connection) -> Point | None:
        vh = vaulthead.authentic(conn, keys) if keys else None
        return None if vh is None else vh.point()

    return read


def past_the_anchor(
    backup: Anchored, where: str, replaced: Point | None = None
) -> Callable[[sqlite3.Connection], None]:
    """For `restore`: what moves the restored copy's vault head past the live vault's
    anchor and past the `replaced` file's own vault head (writes a session made since
    the last record), in the copy's own transaction (a verified backup's vault head
    matches its heads: it is summed again over them, one write past both). The anchor
    then moves to it (`record_anchor` of the restored file): only forward, so that no
    process that saw the replaced file takes the restored one for a rollback."""
    from vault import chainops
    from vault.engines.sqlite import vaulthead

    key = chainops.key_of(backup.sealer(), backup.meta()["vault_id"])
    anchor = backup.stored_anchor(strict=True)  # None, not memvault's: started afresh
    if replaced is not None and (anchor is None or replaced.seq > anchor.seq):
        anchor = replaced

    def lift(conn: sqlite3.Connection) -> None:
        if vaulthead.exists(conn):
            vaulthead.accept(conn, key, where, anchor)

    return lift


def seal_backup(
    conn: sqlite3.Connection,
    sealer: crypto.Sealer,
    mark: dict[str, str],
    floor: Floor | None,
) -> None:
    """In a backup's own transaction, after its `mark`: its vault head's point, sealed
    under its key (`backup_point`), what it is judged against from then on. Refused for
    a copy behind the live vault's `floor` (read before the copy was taken): a backup
    would vouch for a file put back from an older copy. None for a copy with no vault
    head (of an unchained vault) or under a key `sealer` lacks."""
    from vault import chainops, chainvault
    from vault.chaincheck import Tamper
    from vault.engines.sqlite import vaulthead

    vault_id = mark[backupmark.BACKUP_OF]
    keys = chainops.keys_for(sealer, vault_id)
    if floor is not None and floor.source is not None:
        vaulthead.bind(conn, keys, floor.source)  # a 0.2 head the live vault's open left
    vh = vaulthead.authentic(conn, keys)
    if vh is None:
        return
    if floor is not None and not floor.passes(vh.point()):
        raise chainops.tampered("", Tamper.FILE_ROLLED_BACK, mark[backupmark.BACKUP_FROM])
    backup_id, source = mark[backupmark.BACKUP_ID], mark[backupmark.BACKUP_FROM]
    sealed = chainvault.seal_backup(keys[vh.kid], backup_id, source, vh.point())
    set_meta(conn, **{backupmark.BACKUP_POINT: sealed})


def replaced_source(live: Anchored) -> KeyStore | None:
    """For `restore`: the key source of the file it replaces, None out of reach."""
    try:
        return live.keystore
    except VaultError:
        return None


def anchor_restored(restored: Anchored, unchained: bool, left: KeyStore | None) -> bool:
    """After `restore`: the anchor moved to the restored state, which `lift` put past it,
    or, for a copy from before the chain, forgotten on purpose (the next open links its
    rows as restored). A replaced file that named another transit key leaves it, as a
    `key move` would (chainanchor.leave): a copy of it put back is from before. False
    when the record did not reach the anchor (its keyring or key service failed)."""
    from vault import chainanchor

    meta = restored.meta()
    anchored = True
    if unchained:
        chainanchor.forget(anchor_store(restored.keystore), meta["vault_id"])
    else:
        with contextlib.suppress(VaultError):
            restored.sealer()
        anchored = restored.record_anchor(lifted=True) is not None
    if marked_left(left, meta):  # as keymove._leave
        with contextlib.suppress(VaultError):  # out of reach: that source's window stays
            chainanchor.leave(anchor_store(left), meta["vault_id"])
    return anchored
