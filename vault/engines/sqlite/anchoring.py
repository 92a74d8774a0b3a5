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
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from vault import backupmark
from vault.engines.sqlite.db import read_meta, set_meta
from vault.errors import VaultError
from vault.keysource.store import anchor_store, is_transit

# The chain's modules are imported where used: every command loads this one (a base of
# `Vault`), few judge or record a vault head.
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager

    from vault import crypto
    from vault.chainanchor import Floor
    from vault.chainvault import Point
    from vault.keys import KeyStore


def backup_floor(meta: dict[str, str], sealer: crypto.Sealer) -> Floor | None:
    """A backup's floor: the point sealed into it, exact. None when it has none (made
    before backups recorded one, or from an unchained vault)."""
    from vault import chainops, chainvault
    from vault.chainanchor import Floor
    from vault.chainvault import Point

    text = meta.get(backupmark.BACKUP_POINT)
    if text is None:
        return None
    keys = chainops.keys_for(sealer, meta["vault_id"])
    point = chainvault.backup_point(keys, meta.get(backupmark.BACKUP_ID, ""), text)
    # One that does not authenticate judges the file by a point no vault head has.
    return Floor(point or Point(-1, b""), exact=True)


def floor_for(meta: dict[str, str], sealer: crypto.Sealer, ks: KeyStore) -> Floor | None:
    """The floor of a file whose meta is `meta`: its own sealed point for a backup, the
    keyring's anchor for a live keyring vault, None for a transit vault (no anchor yet)."""
    from vault import chainanchor
    from vault.chainanchor import Floor

    if backupmark.is_backup(meta):
        return backup_floor(meta, sealer)
    store = anchor_store(ks)
    if store is None:
        return None
    try:
        return Floor(chainanchor.read(store, meta["vault_id"]))
    except ValueError:  # an entry memvault did not write: judged as no anchor yet
        return Floor()


class Anchored:
    """The anchor side of a vault file (a base of `Vault`)."""

    path: Path
    _sealer: crypto.Sealer | None
    _floor: Floor | None = None
    _floor_read = False

    if TYPE_CHECKING:  # the Vault's own (vault.engines.sqlite.db, .lifecycle)

        @property
        def keystore(self) -> KeyStore: ...

        def meta(self) -> dict[str, str]: ...

        def sealer(self, refresh: bool = False) -> crypto.Sealer: ...

        def connection(
            self, timeout: float | None = None
        ) -> AbstractContextManager[sqlite3.Connection]: ...

    def anchor_floor(self) -> Floor | None:
        """The floor this object judges the file's vault head against (read once: the
        reads of this process raise it from there)."""
        if not self._floor_read:
            sealer = self.sealer()
            self._floor = floor_for(self.meta(), sealer, self.keystore)
            self._floor_read = True
        return self._floor

    def record_anchor(self) -> Point | None:
        """Advance the anchor to the file's vault head, when this object has opened the
        key and the vault head authenticates under it; returns what the anchor holds
        then. Never for a backup, a revoked or half-shredded vault, or a transit one.
        A failure (the keyring or the file gone) is not the caller's: the anchor then
        stays behind, a wider window, never a false alarm."""
        if self._sealer is None or not self.path.exists():
            return None
        from vault import chainanchor, chainops
        from vault.engines.sqlite import vaulthead

        with contextlib.suppress(VaultError, sqlite3.Error, OSError):
            store = anchor_store(self.keystore)
            if store is None:
                return None
            with self._snapshot_meta() as (conn, meta):
                # The file's own key source, read now: a `key move` to transit may have
                # run since this object chose its store (the anchor goes with the move).
                if (
                    backupmark.is_backup(meta)
                    or is_transit(meta)
                    or {"revoked_at", "shred_started"} & set(meta)
                ):
                    return None
                keys = chainops.keys_for(self._sealer, meta["vault_id"])
                vh = vaulthead.authentic(conn, keys)
            if vh is None:
                return None
            floor = self.anchor_floor()
            if floor is not None and not floor.passes(vh.point()):
                return None  # a file behind what was seen of it: never recorded as newer
            held = chainanchor.advance(store, meta["vault_id"], vh.point())
            if floor is not None:
                floor.passes(held)  # raised: this process has seen the file get there
            return held
        return None

    @contextlib.contextmanager
    def _snapshot_meta(self) -> Iterator[tuple[sqlite3.Connection, dict[str, str]]]:
        with self.connection() as conn:
            conn.execute("BEGIN")  # deferred: the meta and the vault head of one snapshot
            yield conn, read_meta(conn, self.path)


def past_the_anchor(backup: Anchored, where: str) -> Callable[[sqlite3.Connection], None]:
    """For `restore`: what moves the restored copy's vault head past the live vault's
    anchor, in the copy's own transaction (a verified backup's vault head matches its
    heads: it is summed again over them, one write past the anchor). The anchor then
    moves to it (`record_anchor` of the restored file): only forward, so that no
    process that saw the replaced file takes the restored one for a rollback."""
    from vault import chainanchor, chainops
    from vault.engines.sqlite import vaulthead

    key = chainops.key_of(backup.sealer(), backup.meta()["vault_id"])
    store = anchor_store(backup.keystore)
    try:
        anchor = None if store is None else chainanchor.read(store, key.vault_id)
    except ValueError:  # not memvault's: the restored file starts it afresh
        anchor = None

    def lift(conn: sqlite3.Connection) -> None:
        if vaulthead.exists(conn):
            vaulthead.accept(conn, key, where, anchor)

    return lift


def seal_backup(
    conn: sqlite3.Connection, sealer: crypto.Sealer, vault_id: str, backup_id: str
) -> None:
    """In a backup's own transaction, after its mark: its vault head's point, sealed
    under its key (`backup_point`), what it is judged against from then on. None for a
    copy with no vault head (of an unchained vault) or under a key `sealer` lacks."""
    from vault import chainops, chainvault
    from vault.engines.sqlite import vaulthead

    keys = chainops.keys_for(sealer, vault_id)
    vh = vaulthead.authentic(conn, keys)
    if vh is not None:
        sealed = chainvault.seal_backup(keys[vh.kid], backup_id, vh.point())
        set_meta(conn, **{backupmark.BACKUP_POINT: sealed})
