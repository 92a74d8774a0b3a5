"""`memvault restore B`: put a backup back as the live vault, crash-safe.

The backup is checked first (a memvault vault, a backup of the vault at the
live path or of one that is gone there, and every item authenticates with the
keys this keyring holds). Then, holding the live vault's exclusive lock:

1. a compact copy of B is written beside the vault as `<vault>.restore-new`
   (VACUUM INTO, settled and fsynced as a backup is), its backup mark removed,
   the replaced vault's key versions added to its journal (so a later revoke
   or shred still destroys them) and the restore audited;
2. the lock is let go (its close empties and removes the WAL), the live vault
   gets a second name `<vault>.restore-old` (a hard link), and the new file is
   renamed over the vault's name: that rename is the commit point;
3. the replaced vault, now only `<vault>.restore-old`, is overwritten and
   unlinked.

At every instant the vault's name holds one whole vault, the old one or the restored
one. `finish` (run by the next open of the vault, or the next restore) ends a restore
that was cut off: before the rename it removes the new copy and the second name (the old
vault stays live); after it, it destroys the replaced vault. A running restore holds an
advisory lock on the vault's folder, so nobody tidies under its feet (POSIX only: on
Windows a cut-off restore is finished by the next `memvault restore`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vault import (
    backupmark,
    chainops,
    chainvault,
    files,
    keyjournal,
    paths,
    retention,
    targets,
    testhooks,
)
from vault.engines.sqlite.anchoring import HeadReader as Head
from vault.engines.sqlite.anchoring import (
    anchor_restored,
    head_reader,
    past_the_anchor,
    replaced_source,
)
from vault.engines.sqlite.backup import refuse_unbackable
from vault.engines.sqlite.db import (
    SCRUB_WAIT,
    audit,
    connect,
    lock_exclusively,
    meta_rows,
    peek,
    read_meta,
    set_meta,
    sqlite_errors,
)
from vault.engines.sqlite.filecopy import vacuum_copy
from vault.engines.sqlite.restorestate import (
    destroy_with_sides,
    finish,
    finish_locked,
    folder_lock,
    state_names,
)
from vault.engines.sqlite.vault import Vault
from vault.errors import BadInput, KeyProblem, NotAVault, OperationFailed, VaultBusy
from vault.keyjournal import DESTROYED, PENDING, RETAINED, RETIRED
from vault.keysource.store import WRAPPED, is_transit, same_source
from vault.verify import verify

# Why a revoked vault takes no backup back (both engines): its backups' keys were destroyed
# with it (a transit vault's with its transit key), and a restore would undo the revoke.
REVOKED = "a revoked vault takes no backup back; `memvault shred` removes it"

# The replaced vault's key versions enter the restored journal as retained: kept,
# decrypt-only while the backups the replaced vault recorded (copied over too) need
# them, and named, so that `key list` shows them and revoke or shred destroys them.


@dataclass
class RestorePlan:
    """What `restore` would do, checked; shown before the question."""

    source: str
    path: str
    vault_id: str
    kid: str
    backup_id: str | None
    backed_up_at: str | None
    items: int
    sessions: int
    replaces: bool  # a vault is at the live path and will be replaced
    replaced_items: int | None = None
    replaced_kid: str | None = None
    checked: list[str] = field(default_factory=list)
    unchained: bool = False  # made before the history chain: its rows get linked as found

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def audited(self, **more: Any) -> dict[str, Any]:
        """The details of the `restore` audit event (both engines): the backup, then `more`."""
        return {
            "source": self.source,
            "backup_id": self.backup_id,
            "backed_up_at": self.backed_up_at,
            **more,
        }


def verified_plan(
    src: Path, path: str, meta: dict[str, str], replaces: bool, checked: list[str]
) -> RestorePlan:
    """The plan of restoring the backup `src` (whose meta is `meta`) at `path`, once
    `verify` authenticated every item under a key this keyring holds; else the refusal
    (both engines' restore)."""
    report = verify(src)
    if report.key_error is not None:
        raise KeyProblem(
            f"{report.key_error.message}; the backup {src} was not restored (`memvault --db "
            f"{src} key import KIT` brings its key back)"
        )
    if not report.ok:
        found = ", ".join(f"{kind} {n}" for kind, n in report.problems.items() if n)
        raise OperationFailed(
            f"the backup {src} does not verify ({found}); `memvault --db {src} verify` lists "
            "the problems; nothing was changed"
        )
    return RestorePlan(
        source=str(src.absolute()),
        path=path,
        vault_id=meta["vault_id"],
        kid=meta["kid"],
        backup_id=meta.get(backupmark.BACKUP_ID),
        backed_up_at=meta.get(backupmark.BACKED_UP_AT),
        items=report.items,
        sessions=report.sessions,
        replaces=replaces,
        checked=["a memvault vault", *checked, "every item authenticates"],
    )


def check(source: str | os.PathLike[str], db: str | os.PathLike[str] | None) -> RestorePlan:
    """Check that `source` can replace the vault at `db` (tidies a cut-off restore only)."""
    live = paths.resolve_db_path(db)
    finish(live)
    paths.require_text_path(source, "the backup path")
    src = Path(source)
    if os.path.lexists(live) and os.path.exists(src) and os.path.samefile(src, live):
        raise BadInput(f"{src} is the live vault itself; give the backup file to restore")
    if src.absolute() in {p.absolute() for p in paths.sidecars(live)[1:] + list(state_names(live))}:
        raise BadInput(f"{src} is a side file of the vault {live}; give the backup file")
    if not os.path.lexists(live):
        targets.refuse_side_file(live, "restored vault")  # X's next open would delete it
    backup = Vault.open(src)
    meta = backup.meta()
    if os.path.lexists(live):
        current = Vault.open(live)  # exit 3 for a file that is not a vault: never replaced
        live_meta = current.meta()
        refuse_unbackable(live_meta, live, REVOKED)
        if backupmark.is_backup(live_meta):
            raise OperationFailed(
                f"{live} is itself a backup of vault {live_meta[backupmark.BACKUP_OF]}; restore "
                "into the live vault's path (a backup copied over it: move it elsewhere and "
                "restore it from there); nothing was changed"
            )
        if live_meta["vault_id"] != meta["vault_id"]:
            raise OperationFailed(
                f"{src} is a copy of vault {meta['vault_id']}, but {live} holds vault "
                f"{live_meta['vault_id']}; restore it at the path of the vault it was made "
                "from, or at a new path (--db); nothing was changed"
            )
    if not os.path.lexists(live):
        refuse_a_twin(src, meta)
    replaces = os.path.lexists(live)
    same = "the same vault id" if replaces else "no vault at the path"
    plan = verified_plan(src, str(live), meta, replaces, [same])
    plan.unchained = meta.get(chainops.CHAIN_META) != chainops.ON
    if plan.replaces:
        plan.replaced_items = current.count_items()
        plan.replaced_kid = current.meta()["kid"]
    return plan


def refuse_a_twin(src: Path, meta: dict[str, str]) -> None:
    """Refuse (exit 1) to restore into an empty path a backup whose vault is still live:
    the two would share the vault id and so the keyring entries, and the first rotation
    of either destroys the key version the other still uses."""
    source = meta.get(backupmark.BACKUP_FROM)
    if not source:
        return  # a backup made before backups named their vault: the help's rule stands
    if paths.postgres_url(source) is not None:
        raise OperationFailed(
            f"{src} is a backup of the PostgreSQL vault {source}; a file restored from it "
            "would share that vault's keys, and its first rotation would destroy the key "
            f"the PostgreSQL vault uses; read it with `memvault --db {src} show` or "
            "`export`; nothing was changed"
        )
    try:
        conn = peek(Path(source), retention.PEEK_TIMEOUT)
        try:
            row = conn.execute("SELECT value FROM memvault_meta WHERE key = 'vault_id'").fetchone()
        finally:
            conn.close()
    except (OSError, sqlite3.Error):
        return  # nothing readable there: the original is gone
    if row is not None and row[0] == meta["vault_id"]:
        raise OperationFailed(
            f"the vault {src} was backed up from is still at {source}; restore it there "
            f"(`memvault --db {source} restore {src}`): two vaults sharing one set of keys "
            "would destroy each other's key at their next rotation; nothing was changed"
        )


def restore(plan: RestorePlan) -> dict[str, Any]:
    """Put the checked backup in place of the vault at `plan.path`; see the module doc."""
    live, src = Path(plan.path), Path(plan.source)
    new, _old = state_names(live)
    folder = live.absolute().parent
    paths.ensure_private_folder(folder)
    replaced = Vault(live) if plan.replaces else None
    head = head_reader(replaced) if replaced is not None and not plan.unchained else None
    left = replaced_source(replaced) if replaced is not None else None
    with folder_lock(folder, wait=True) as held:
        if not held:
            raise OperationFailed(f"cannot lock the folder {folder}; nothing was changed")
        finish_locked(live)
        try:
            _restore_locked(plan, live, src, new, head)
        except OSError as exc:
            with contextlib.suppress(OSError):
                finish_locked(live)  # back to the vault as it was
            raise OperationFailed(
                f"the restore failed ({exc.strerror} on {exc.filename or live}); the vault "
                "is as it was; check the folder's permissions and free space"
            ) from None
        except BaseException:
            with contextlib.suppress(OSError):
                finish_locked(live)  # back to the vault as it was, or finished if committed
            raise
    anchored = anchor_restored(Vault(live), plan.unchained, left)
    return {**plan.as_dict(), "restored": True, "anchored": anchored}


def _restore_locked(plan: RestorePlan, live: Path, src: Path, new: Path, head: Head | None) -> None:
    folder = live.absolute().parent
    if plan.replaces:
        if not os.path.lexists(live):
            raise OperationFailed(f"the vault at {live} went away during the restore")
        with _exclusive(live) as conn:
            meta = read_meta(conn, live)
            if meta["vault_id"] != plan.vault_id:
                raise OperationFailed(
                    f"{live} was replaced by vault {meta['vault_id']} during the restore; "
                    "nothing was changed"
                )
            versions = keyjournal.versions(conn)
            replaced = None if head is None else head(conn)
            _copy(src, new, plan, versions, meta, retention.records(conn), replaced)
        # The lock's connection is closed: its WAL is checkpointed and removed.
        _swap(live, new)
    else:
        leftovers = [p for p in paths.sidecars(live)[1:] if os.path.lexists(p)]
        if leftovers:
            raise OperationFailed(
                f"{leftovers[0]} exists without its database; move it away before "
                "restoring a vault there; nothing was changed"
            )
        _copy(src, new, plan, [], None, [])
        try:
            os.link(new, live)  # never over a file that appeared meanwhile
        except FileExistsError:
            destroy_with_sides(new)
            raise OperationFailed(
                f"a file appeared at {live} during the restore; nothing was changed"
            ) from None
        except OSError:  # a file system without hard links
            if os.path.lexists(live):
                raise
            os.rename(new, live)
        testhooks.failpoint("restore-renamed")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(new)
        files.fsync_dir(folder)


@contextlib.contextmanager
def _exclusive(live: Path) -> Iterator[sqlite3.Connection]:
    """The live vault's exclusive lock (no other process may have it open), WAL emptied."""
    with sqlite_errors(live):
        conn = connect(live, timeout=SCRUB_WAIT)
    try:
        with sqlite_errors(live):
            lock_exclusively(conn, live, "run restore again; nothing was changed")
            conn.execute("COMMIT")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            yield conn
    finally:
        conn.close()


def _copy(
    src: Path,
    new: Path,
    plan: RestorePlan,
    replaced: list[keyjournal.KeyVersion],
    replaced_meta: dict[str, str] | None,
    replaced_backups: list[retention.BackupRecord],
    replaced_head: chainvault.Point | None = None,
) -> None:
    """Write the restored vault as `new`: the backup's rows, unmarked, its journal
    naming the replaced vault's key versions too (with their wrapped keys, for a transit
    vault), and the replaced vault's records of its backups (so the versions those
    backups use stay retained), the restore audited."""
    replaced_kid = replaced_meta["kid"] if replaced_meta else None
    lift = None if plan.unchained else past_the_anchor(Vault(src), plan.path, replaced_head)

    kept = RETAINED

    def adjust(conn: sqlite3.Connection) -> None:
        marks = ", ".join("?" * len(backupmark.MARK))
        conn.execute(f"DELETE FROM memvault_meta WHERE key IN ({marks})", backupmark.MARK)
        known = {v.kid: v.state for v in keyjournal.versions(conn)}
        for v in replaced:
            if v.kid in known and known[v.kid] in (PENDING, RETIRED) and v.state != PENDING:
                # Staged or retired when the backup was made, used by the replaced vault
                # since: the next open's tidy must not delete its entry.
                keyjournal.record(conn, v.kid, DESTROYED if v.state == DESTROYED else kept)
            elif v.kid not in known:
                keyjournal.record(
                    conn, v.kid, DESTROYED if v.state == DESTROYED else kept, v.created_at
                )
        if replaced_meta:
            _carry_wrapped(conn, replaced_meta)
        have = {r.backup_id for r in retention.records(conn)}
        for rec in replaced_backups:
            if rec.backup_id not in have:
                retention.add(conn, rec)
        set_meta(conn, scrub_pending="0")
        details = plan.audited(items=plan.items, replaced_kid=replaced_kid)
        audit(conn, "restore", plan.kid, **details)
        if lift is not None:
            lift(conn)

    try:
        vacuum_copy(Vault(src), new, adjust, "restore")
    except FileNotFoundError:
        raise NotAVault(
            f"the backup {src} went away during the restore; nothing was changed"
        ) from None
    testhooks.failpoint("restore-copied")


def _carry_wrapped(conn: sqlite3.Connection, replaced: dict[str, str]) -> None:
    """The replaced vault's wrapped keys, for the versions the journal now keeps, when
    both use the same transit key: as a keyring vault's versions stay in the keyring,
    the restored vault then holds every version it names (and a kit carries them)."""
    restored = meta_rows(conn)
    if not is_transit(restored) or not same_source(restored, replaced):
        return
    conn.executemany(
        "INSERT INTO memvault_meta (key, value) VALUES (?, ?)",
        [(k, v) for k, v in replaced.items() if k.startswith(WRAPPED) and k not in restored],
    )


def _swap(live: Path, new: Path) -> None:
    """Give the live vault a second name, rename the copy over it, destroy the old one."""
    _new, old = state_names(live)
    folder = live.absolute().parent
    opened = [p for p in paths.sidecars(live)[1:] if os.path.lexists(p)]
    if opened:  # a process opened the vault after the lock was let go
        destroy_with_sides(new)
        raise VaultBusy(
            f"{opened[0]} appeared: another process opened {live} during the restore; close "
            "it and run restore again; nothing was changed"
        )
    try:
        os.link(live, old)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: moved aside instead
        os.rename(live, old)
    testhooks.failpoint("restore-linked")
    os.replace(new, live)  # the commit point
    files.fsync_dir(folder)
    testhooks.failpoint("restore-renamed")
    with contextlib.suppress(OSError):  # committed: the next open finishes what is left
        destroy_with_sides(old)
        files.fsync_dir(folder)
