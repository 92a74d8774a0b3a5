"""`backup`: a consistent, compact copy of a vault, taken while agents may be writing.

The copy is made by SQLite's `VACUUM INTO`, which reads one snapshot of the
database (WAL included) and writes only live rows into fresh pages. A file copy
could miss the WAL or catch a half-written page; SQLite's backup API copies
free pages, which may still hold ciphertext deleted without `secure_delete`.
`VACUUM INTO` has neither problem, so the copy never carries residue of items
deleted before the backup.

The copy keeps the vault id and the key id: it opens with the same keyring
key, and no key is ever copied. Every backup is recorded in the live vault first
(vault.retention): while the record exists, a rotation keeps the backup's key
version (retained) instead of destroying it. A backup whose record cannot be
written is not made, or is removed again. The copy is marked as a backup
(vault.backupmark): writing commands refuse it until `memvault restore` makes it
the live vault. A vault whose key is missing (new keyring, lost
entry) is still backed up, since a recovery kit may hold its key; the result
says so. A revoked vault is refused: nothing can ever read its copy.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vault import backupmark, paths, retention, targets, testhooks
from vault.crypto import Sealer
from vault.engines.sqlite.anchoring import seal_backup
from vault.engines.sqlite.db import set_meta
from vault.engines.sqlite.filecopy import Adjust, Copy, vacuum_copy
from vault.errors import BadInput, KeyProblem, KeyRevoked, OperationFailed, VaultBusy, VaultError
from vault.keyjournal import DESTROYED, PENDING, ROTATING_FROM

if TYPE_CHECKING:
    # Not Vault: its `backup` imports this module (no import circle).
    from vault.chainfloor import Floor
    from vault.engines.sqlite.lifecycle import KeyLifecycle

KEY_OK = "present and matching"
KEY_UNUSABLE = "unusable"


@dataclass
class BackupResult:
    """What `backup` wrote: the copy, what it holds, and whether the keyring opens it."""

    path: str
    source: str
    vault_id: str
    kid: str
    sessions: int
    items: int
    size: int
    mode: str
    key: str  # KEY_OK, or KEY_UNUSABLE with key_problem saying why
    key_problem: str | None = None
    restore: list[str] = field(default_factory=list)
    audited: bool = True  # False: made, but the audit event could not be written
    backup_id: str = ""  # also in the copy's meta and in the live vault's record

    @property
    def key_ok(self) -> bool:
        return self.key == KEY_OK

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_destination(dest: str | os.PathLike[str], vault_path: Path | None) -> Path:
    """Refuse (exit 2) a DEST that exists in any form, or whose side files exist, or
    that is the vault at `vault_path` or one of its side files (by any name).

    SQLite would write through a `-wal` or `-journal` link left beside DEST.
    """
    # SQLite takes the name as text: bytes that are not UTF-8 are refused up front.
    paths.require_text_path(dest, "the backup path")
    target = targets.check_target(dest, "backup", vault_path)
    for side in paths.sidecars(target)[1:]:
        if os.path.lexists(side):
            raise BadInput(
                f"{side} already exists beside the backup's name; SQLite would use it; "
                "move it away or choose another name for the backup; nothing was written"
            )
    return target


class Checked(Protocol):
    """What `key_check` asks of a vault (a file vault or a PostgreSQL one)."""

    def sealer(self, refresh: bool = False) -> Sealer: ...
    def backups(self) -> list[dict[str, Any]]: ...


def key_check(vault: Checked, rec: retention.BackupRecord, kid: str) -> str | None:
    """Why this keyring cannot open the copy, or None when it can: the current key, or a
    rotation committed during the backup retained the copy's key for it."""
    try:
        key_kid = vault.sealer(refresh=True).kid
    except KeyProblem as exc:  # revoked meanwhile too: the copy is made, and useless
        return exc.message
    if key_kid == kid:
        return None
    mine = [b for b in vault.backups() if b["backup_id"] == rec.backup_id]
    if mine and mine[0]["readable"]:
        return None
    return (
        f"the vault was rotated during the backup: the keyring's key {key_kid} does not "
        f"open the copy (key {kid}); run `memvault backup` again"
    )


def restore_steps(dest: Path, kid: str, key_ok: bool = True) -> list[str]:
    """How to bring the backup back on another machine: the copy plus a recovery kit."""
    kit = (
        f"memvault key export kit.json  # here: a recovery kit for key {kid}, kept apart"
        if key_ok
        else f"# the keyring here has no usable key: use a recovery kit made for key {kid}"
    )
    return [
        kit,
        f"memvault --db FILE key import kit.json  # there, with {dest.name} copied to FILE",
        "memvault --db FILE verify",
    ]


def backup(vault: KeyLifecycle, dest: str | os.PathLike[str]) -> BackupResult:
    """Write a consistent copy of `vault` to the new file `dest` (0600).

    Raises BadInput for an unusable `dest`, KeyRevoked for a revoked vault,
    OperationFailed when the copy cannot be written (the partial file is removed),
    HistoryTampered when the file is behind its anchor (put back from an older copy).
    """
    meta = vault.settled_meta()  # a rotation under way or cut off is finished first
    refuse_unbackable(meta, vault.path, "a backup could never be read")
    target = check_destination(dest, vault.path)
    floor = None
    with contextlib.suppress(KeyProblem):  # a copy is worth having without the key
        floor = vault.anchor_floor()  # before the copy's snapshot: a write moves the anchor
        with vault.connection() as conn:  # a file put back: refused before it is copied
            vault.refuse_behind(conn, vault.sealer())
    # Where the live vault is: a backup of a backup names the place its source names.
    source = meta.get(backupmark.BACKUP_FROM) or os.path.abspath(vault.path)
    mark = functools.partial(
        mark_as_backup,
        meta["vault_id"],
        source=source,
        sealer=vault.sealer,
        floor=floor,
    )
    return recorded_backup(
        vault,
        target,
        lambda rec, keep: vacuum_copy(vault, target, mark(rec.backup_id), "backup", keep),
    )


def refuse_unbackable(meta: dict[str, str], path: Path | str, revoked: str) -> None:
    """Refuse a revoked or half-shredded vault (both engines' backup, PostgreSQL's restore;
    `revoked` says why a revoked one is refused)."""
    if "revoked_at" in meta:
        raise KeyRevoked(
            f"the key of vault {meta['vault_id']} was revoked on {meta['revoked_at']}; "
            f"{revoked}; nothing was written"
        )
    if "shred_started" in meta:
        raise OperationFailed(
            f"a shred of {path} was interrupted; run `memvault shred` again to finish "
            "it; nothing was written"
        )


class Backed(Protocol):
    """What a backup asks of the live vault, a file or a PostgreSQL one."""

    @property
    def path(self) -> Path | str: ...
    def sealer(self, refresh: bool = False) -> Sealer: ...
    def backups(self) -> list[dict[str, Any]]: ...
    def record(self, event: str, kid: str | None, **details: Any) -> None: ...
    def record_backup(self, target: Path) -> retention.BackupRecord: ...
    def settle_backup(self, rec: retention.BackupRecord, kid: str) -> str | None: ...
    def drop_backup(self, rec: retention.BackupRecord) -> None: ...


def recorded_backup(
    vault: Backed,
    target: Path,
    make: Callable[[retention.BackupRecord, Callable[[str], None]], Copy],
) -> BackupResult:
    """A backup of `vault` at `target`, recorded, made by `make`, checked, audited; both
    engines (`make` is the engine's copy: VACUUM INTO, or PostgreSQL's rows)."""
    rec, (kid, vault_id, sessions, items) = recorded_copy(vault, target, make)
    testhooks.failpoint("backup-copied")
    # The key is checked, not needed: a copy of a vault whose key is missing is still
    # worth having (a recovery kit may hold the key). Checked after the copy, against
    # the copy's kid, so a rotation committed during the backup is noticed (and a
    # rotation cut off before its key was promoted is finished by `sealer`).
    key_problem = key_check(vault, rec, kid)
    audited = True
    try:
        vault.record("backup", kid, items=items, sessions=sessions, to=rec.path)
    except (VaultBusy, OperationFailed):
        audited = False  # the copy is made and sound: say so rather than fail
    st = os.stat(target)
    return BackupResult(
        path=rec.path,
        source=str(vault.path),
        vault_id=vault_id,
        kid=kid,
        sessions=sessions,
        items=items,
        size=st.st_size,
        mode=oct(stat.S_IMODE(st.st_mode)),
        key=KEY_OK if key_problem is None else KEY_UNUSABLE,
        key_problem=key_problem,
        restore=restore_steps(target, kid, key_problem is None),
        audited=audited,
        backup_id=rec.backup_id,
    )


def mark_as_backup(
    vault_id: str,
    backup_id: str,
    source: str,
    sealer: Callable[[], Sealer] | None = None,
    floor: Floor | None = None,
) -> Adjust:
    """The `adjust` of `write_new_copy` that makes the copy a backup of `vault_id` (at `source`).
    A pending version's entry the copy's tidy-up would delete (pgbackup never copies one);
    a copy amid a rotation's batches is refused: its record keeps one of its two keys.
    With the live vault's `sealer`, the copy's vault head is sealed into it, and refused
    if behind the live vault's `floor` (anchoring.seal_backup); a key that cannot be
    loaded leaves the copy unsealed."""

    def adjust(conn: sqlite3.Connection) -> None:
        if conn.execute("SELECT 1 FROM memvault_meta WHERE key = ?", (ROTATING_FROM,)).fetchone():
            raise VaultBusy("a key rotation began during the backup; run `memvault backup` again")
        conn.execute("DELETE FROM memvault_keys WHERE state = ?", (PENDING,))
        # A backup of a backup: its seal was for that copy (sealed afresh below, or none).
        conn.execute("DELETE FROM memvault_meta WHERE key = ?", (backupmark.BACKUP_POINT,))
        mark = backupmark.new_mark(vault_id, backup_id, source)
        set_meta(conn, **mark)
        if sealer is not None:
            with contextlib.suppress(KeyProblem):
                seal_backup(conn, sealer(), mark, floor)

    return adjust


class Recorder(Protocol):
    """The live vault's records of its backups (a file vault's or a PostgreSQL one's)."""

    def record_backup(self, target: Path) -> retention.BackupRecord: ...
    def settle_backup(self, rec: retention.BackupRecord, kid: str) -> str | None: ...
    def drop_backup(self, rec: retention.BackupRecord) -> None: ...


def recorded_copy(
    vault: Recorder,
    target: Path,
    make: Callable[[retention.BackupRecord, Callable[[str], None]], Copy],
) -> tuple[retention.BackupRecord, Copy]:
    """Record the backup in the live vault, then let `make` write it; both engines.

    The record comes first (committed, under the key the vault uses now), so that no
    moment exists where a backup is on disk and a rotation could destroy its key
    unrecorded. `make` calls `keep(kid)` with the copy's key before it settles: the
    record takes that kid (a rotation may have committed before the snapshot), and a
    copy whose key was destroyed meanwhile (two rotations) is removed. Any failure
    drops the record again; a crash leaves a record that `key list` flags as missing.
    """
    rec = vault.record_backup(Path(os.path.abspath(target)))

    def keep(kid: str) -> None:
        if vault.settle_backup(rec, kid) == DESTROYED:
            raise OperationFailed(
                f"the vault was rotated twice during the backup: key {kid} of the copy was "
                "destroyed meanwhile; the backup was removed; run `memvault backup` again"
            )

    try:
        return rec, make(rec, keep)
    except BaseException:
        with contextlib.suppress(VaultError):
            vault.drop_backup(rec)
        raise
