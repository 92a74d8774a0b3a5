"""A new vault file written beside its target, settled, checked, then linked into place.

`backup` and `restore` (and PostgreSQL's backup into a file) write their copies
through here: the copy appears at its target whole or not at all, a kill leaves
at most a locked `.memvault-backup-*` temporary that the next copy into that
folder removes, and the target is never replaced.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from vault import erase, files, paths, testhooks
from vault.engines.sqlite.db import connect, is_busy, is_damage, meta_rows, sqlite_errors
from vault.engines.sqlite.schema import MESSAGES_TABLE, SESSIONS_TABLE, SQLITE_MAGIC
from vault.errors import BadInput, OperationFailed

if TYPE_CHECKING:
    from vault.engines.sqlite.db import VaultFile

Adjust = Callable[[sqlite3.Connection], None]
Copy = tuple[str, str, int, int]

TEMP_TAG = "backup"  # built as `.memvault-backup-*` beside the target, then linked into place


def _looks_like_backup(head: bytes) -> bool:
    # Empty, a database, or zeros: SQLite may extend the new file before page 1 is written.
    return head.startswith(SQLITE_MAGIC) or not head.strip(b"\0")


def write_new_copy(
    target: Path,
    fill: Callable[[Path], None],
    adjust: Adjust,
    keep: Callable[[str], None] | None = None,
) -> Copy:
    """Let `fill` write a vault into a new private file beside `target`, settle and check
    it, then give it `target`'s name; (kid, vault_id, sessions, items).

    The copy appears at `target` whole or not at all: a kill at any instant leaves at
    most a temporary file, which the next backup into that folder removes. Anything that
    fails removes the temporary file (and its side files); `target` is never replaced.

    `adjust` changes the copy's meta in the settling transaction; `keep(kid)` may still
    refuse the settled copy.
    """
    folder = target.absolute().parent
    erase.remove_stale_temps(folder, TEMP_TAG, _looks_like_backup, paths.sidecars)
    try:
        fd, tmp = files.create_temp(folder, TEMP_TAG)  # O_EXCL | O_NOFOLLOW, 0600
    except OSError as exc:
        raise OperationFailed(
            f"cannot create a file beside {target} ({exc.strerror}); choose a writable "
            "folder; nothing was written"
        ) from None
    created = os.fstat(fd)
    try:
        fill(tmp)
        now = os.lstat(tmp)
        if (now.st_dev, now.st_ino) != (created.st_dev, created.st_ino):
            raise OperationFailed(
                f"{tmp} was replaced while the backup was written; the backup was not made"
            )
        result = _settle(tmp, adjust)
        if keep is not None:
            keep(result[0])
        testhooks.failpoint("backup-settled")
        try:
            os.link(tmp, target)  # never over a file that appeared meanwhile
        except FileExistsError:
            raise BadInput(
                f"{target} appeared while the backup was written; give a new file name; "
                "nothing was written"
            ) from None
        except OSError as exc:
            raise OperationFailed(
                f"cannot create {target} ({exc.strerror}); choose a writable folder; "
                "nothing was written"
            ) from None
        os.unlink(tmp)
        files.fsync_dir(folder)
        return result
    except BaseException:
        _remove(tmp, created)
        raise
    finally:
        os.close(fd)  # last: the lock tells another backup this file is being written


def vacuum_copy(
    source: VaultFile,
    target: Path,
    adjust: Adjust,
    what: str,
    keep: Callable[[str], None] | None = None,
) -> Copy:
    """`write_new_copy` filled by VACUUM INTO from `source`; (kid, vault_id, sessions, items).

    `what` ("backup", "restore") names the copy in messages and test pause points.
    """

    def vacuum_into(dest: Path) -> None:
        with source.connection() as conn:
            # VACUUM INTO accepts an existing empty file and keeps its mode. The
            # connection takes URIs, so the name is passed as one (a '?' or '#' in a
            # path stays part of the name).
            try:
                conn.execute("VACUUM INTO ?", ("file:" + urllib.parse.quote(str(dest)),))
            except sqlite3.Error as exc:
                if is_busy(exc) or is_damage(exc):
                    raise  # the vault's own state: said as every command says it
                raise OperationFailed(
                    f"cannot write the {what} {target} ({exc}); nothing was written; check "
                    "the free space and the permissions of its folder"
                ) from None
        testhooks.failpoint(f"{what}-vacuumed")

    return write_new_copy(target, vacuum_into, adjust, keep)


def _settle(target: Path, adjust: Adjust) -> tuple[str, str, int, int]:
    """Give the copy the vault's journal mode, mark it scrubbed, and check it.

    VACUUM INTO writes a rollback-journal file; `Vault.init` makes WAL files, so the
    copy is switched to WAL and checkpointed, and its last connection's close
    removes the `-wal` and `-shm` again. The copy has no free pages and no WAL, so
    there is nothing left to scrub.
    """
    with sqlite_errors(target):
        conn = connect(target)
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "UPDATE memvault_meta SET value = '0' WHERE key = 'scrub_pending' AND value != '0'"
            )
            adjust(conn)
            conn.execute("COMMIT")
            check = conn.execute("PRAGMA integrity_check").fetchall()
            if check != [("ok",)]:
                raise OperationFailed(
                    f"the copy written to {target} fails SQLite's integrity check "
                    f"({check[0][0]}); the backup was not made; run `memvault verify`"
                )
            meta = meta_rows(conn)
            items = conn.execute(f"SELECT count(*) FROM {MESSAGES_TABLE}").fetchone()[0]
            sessions = conn.execute(
                f"SELECT count(*) FROM (SELECT session_id FROM {SESSIONS_TABLE} UNION "
                f"SELECT session_id FROM {MESSAGES_TABLE})"
            ).fetchone()[0]
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
    _fsync(target)
    files.fsync_dir(target.absolute().parent)
    leftovers = [p for p in paths.sidecars(target)[1:] if os.path.lexists(p)]
    if leftovers:  # another process opened the copy meanwhile: not a settled file
        raise OperationFailed(
            f"{leftovers[0]} stayed beside the backup (another process opened it?); the "
            "backup was not made; try again"
        )
    return meta["kid"], meta["vault_id"], int(sessions), int(items)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | files.NO_FOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(target: Path, created: os.stat_result) -> None:
    """Remove a half-made backup: only the file this backup created, and its side files."""
    with contextlib.suppress(OSError):
        now = os.lstat(target)
        if (now.st_dev, now.st_ino) == (created.st_dev, created.st_ino):
            os.unlink(target)
    for side in paths.sidecars(target)[1:]:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(side).st_mode):
                os.unlink(side)
