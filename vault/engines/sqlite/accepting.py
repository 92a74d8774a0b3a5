"""`memvault accept`: take a vault file's sessions as they stand as its state, on purpose.

The vault head (vault.engines.sqlite.vaulthead) sums every session's head; once it no
longer matches them (a session put back from an older copy, added or removed whole, or
a forged head cleared with `clear --include-unreadable`), every session of the file is
refused. Restoring a backup is the first remedy; this is the other, for a user who has
looked (`memvault verify`, `show --include-tampered`) and keeps what is there.
"""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from vault import backupmark, chainops, crypto
from vault.engines.sqlite import vaulthead
from vault.engines.sqlite.db import audit
from vault.results import Accepted

if TYPE_CHECKING:
    from vault.chainfloor import Floor
    from vault.chainvault import Point


class _File(Protocol):
    @property
    def path(self) -> Path: ...

    @property
    def vault_id(self) -> str: ...

    def meta(self) -> dict[str, str]: ...

    def sealer(self, refresh: bool = False) -> crypto.Sealer: ...

    def write_transaction(self) -> AbstractContextManager[sqlite3.Connection]: ...

    def check_kid(self, conn: sqlite3.Connection, sealer: crypto.Sealer) -> crypto.Sealer: ...

    def anchor_floor(self) -> Floor | None: ...

    def stored_anchor(self, strict: bool = False) -> Point | None: ...

    def record_anchor(self, *, lifted: bool = False) -> Point | None: ...


def accept_history(vault: _File) -> Accepted:
    """The vault head summed afresh over the sessions' heads, past the anchor, audited,
    and the anchor moved to it. Refused for a backup (it is judged as it was made) and
    while a session's own head is forged."""
    backupmark.refuse_writes(vault, "`memvault accept`")
    sealer = vault.sealer()
    floor = vault.anchor_floor()
    with vault.write_transaction() as conn:
        sealer = vault.check_kid(conn, sealer)
        key = chainops.key_of(sealer, vault.vault_id)
        # The anchor as stored now, under the write lock, not as this object first read
        # it: another process may have recorded writes since, and the accepted state
        # must go past them. While the lock is held the file cannot move on, and a record
        # reads it in its turn (chainanchor.advance): none can take the anchor past it.
        past = _later(floor.point if floor else None, vault.stored_anchor())
        n, matched, point = vaulthead.accept(conn, key, str(vault.path), past)
        # A file naming a key source its keys left (chainanchor.leave), or one another
        # process found forked from the recorded history, did not match either.
        matched = matched and not (floor is not None and (floor.left or floor.forked))
        audit(conn, "accept", sealer.kid, sessions=n, matched=matched)
    held = vault.record_anchor(lifted=True)  # None: the anchor's store failed
    # At or past the accepted state: another process may have written on it and
    # recorded that between the commit and this record.
    return Accepted(n, matched, anchored=held is not None and held.seq >= point.seq)


def _later(a: Point | None, b: Point | None) -> Point | None:
    return a if b is None or (a is not None and a.seq >= b.seq) else b
