"""`shred`: destroy a vault: the key first, then the rows, then the bytes of every file.

Works without the key (revoked, or the keyring entry gone) and on a file SQLite
cannot read. What was destroyed is recorded in the file before the rows go and
stamped at its start before the bytes go, so a shred killed half-way is finished
by the next run with the same report. Files are overwritten and unlinked with
the helpers of `vault.erase` and `vault.files`, which never follow a link nor open a FIFO.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vault import backupmark, erase, exportdirs, files, keyjournal, paths, shredorder, testhooks
from vault.engines.sqlite import damaged, restorestate
from vault.engines.sqlite.db import (
    SCRUB_WAIT,
    check_header,
    connect,
    is_damage,
    lock_exclusively,
    peek,
    read_header,
    read_meta,
    set_meta,
    sqlite_errors,
    translate,
)
from vault.engines.sqlite.schema import (
    MESSAGES_TABLE,
    SESSIONS_TABLE,
    SHRED_MAGIC,
    SQLITE_MAGIC,
)
from vault.errors import NotAVault, OperationFailed, VaultCorrupt, VaultError
from vault.files import Progress
from vault.keys import KeyStore
from vault.keysource.store import store_for


class _Damaged(Exception):
    """SQLite cannot read the vault (damaged or truncated): shred it without SQLite."""


class _FileSteps:
    """Shred's steps on a vault file (vault.shredorder), on one connection in exclusive
    locking mode: the lock outlives each commit until the connection closes."""

    after_mark = "shred-after-mark"
    after_keys = "shred-after-key"

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn, self.path = conn, path

    def read_meta(self) -> dict[str, str]:
        lock_exclusively(self.conn, self.path, "run shred again; nothing was destroyed")
        return read_meta(self.conn, self.path)

    def count(self) -> tuple[int, int]:
        sessions = self.conn.execute(
            f"SELECT count(*) FROM (SELECT session_id FROM {SESSIONS_TABLE} UNION "
            f"SELECT session_id FROM {MESSAGES_TABLE})"
        ).fetchone()[0]
        items = self.conn.execute(f"SELECT count(*) FROM {MESSAGES_TABLE}").fetchone()[0]
        return sessions, items

    def mark(self, meta: dict[str, str], marker: str) -> None:
        set_meta(self.conn, **{shredorder.MARK: marker})
        self.conn.execute("COMMIT")
        self.conn.execute("BEGIN EXCLUSIVE")

    def unmark(self) -> None:
        # The key is still there: leave no sign of a shred that never destroyed anything.
        with contextlib.suppress(sqlite3.Error):
            self.conn.execute("DELETE FROM memvault_meta WHERE key = ?", (shredorder.MARK,))
            self.conn.execute("COMMIT")

    def keys_kept(self, meta: dict[str, str]) -> dict[str, Any] | None:
        if not backupmark.is_backup(meta):
            return None
        of = meta[backupmark.BACKUP_OF]
        return {"backup_of": of, "keys_kept": damaged.KEYS_KEPT.format(of)}

    def key_versions(self, meta: dict[str, str], kid: str) -> tuple[set[str], set[str]]:
        # Every version the file records: a backup restored with an older kit dies with it.
        pending = {v.kid for v in keyjournal.versions(self.conn) if v.state == keyjournal.PENDING}
        return keyjournal.known_kids(self.conn, meta), {kid} | pending

    def keys_gone(self, kids: set[str], marker: str) -> None:
        # Committed with the rows' deletion: the journal goes with the file.
        set_meta(self.conn, **{shredorder.MARK: marker})

    def destroy_rows(self) -> None:
        self.conn.execute(f"DELETE FROM {MESSAGES_TABLE}")
        self.conn.execute(f"DELETE FROM {SESSIONS_TABLE}")
        self.conn.execute("DELETE FROM memvault_audit")
        self.conn.execute("COMMIT")
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _shred_rows(path: Path, keystore: KeyStore | None, report: dict[str, Any]) -> None:
    """Under the exclusive lock: shred's order (vault.shredorder). Raises _Damaged."""
    try:
        conn = connect(path, timeout=SCRUB_WAIT)
    except sqlite3.Error as exc:
        if is_damage(exc):
            raise _Damaged() from exc
        raise translate(exc, path) from exc
    try:
        with sqlite_errors(path):
            try:
                shredorder.keys_then_rows(
                    _FileSteps(conn, path),
                    lambda meta: store_for(meta, None) or keystore or KeyStore(),
                    report,
                )
            except sqlite3.DatabaseError as exc:
                if is_damage(exc):
                    raise _Damaged() from exc
                raise
    finally:
        conn.close()


def _check_shreddable(path: Path) -> None:
    """Everything shred will need, checked before it destroys anything."""
    folder = path.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OperationFailed(
            f"cannot remove files from {folder}: the folder is not writable; make it writable "
            "(chmod u+w) and run shred again; nothing was destroyed"
        )
    for p in paths.sidecars(path):
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            raise OperationFailed(
                f"{p} is a folder where SQLite keeps a side file; move it away and run shred "
                "again; nothing was destroyed"
            )
        if stat.S_ISREG(mode) and not os.access(p, os.W_OK):
            raise OperationFailed(
                f"cannot overwrite {p}: it is read-only; make it writable (chmod u+w) and run "
                "shred again; nothing was destroyed"
            )


def _remove_planted(path: Path) -> list[dict[str, Any]]:
    """Unlink the names of side files that are links, FIFOs or devices; never follow them.

    SQLite would follow a link at `-wal` or `-journal` and overwrite its target, and
    so would a naive shred. Removing the name leaves the target untouched.
    """
    removed = []
    for p, what in files.odd_entries(paths.sidecars(path)[1:]):
        os.unlink(p)
        removed.append({"name": p.name, "size": 0, "kind": what})
    if removed:
        files.fsync_dir(path.parent)
    return removed


def _read_stamp(path: Path) -> dict[str, Any]:
    """The report an interrupted shred stamped at the start of the file."""
    try:
        with open(path, "rb") as fh:
            stamp = json.loads(fh.read(4096)[len(SHRED_MAGIC) :].split(b"\n")[0])
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def shred_target(db: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What `shred` would destroy: the path and, if it can be read, the vault id.

    Raises NotAVault when there is nothing to shred, before anyone is asked.
    """
    path = paths.resolve_db_path(db)
    header = read_header(path)
    if not header.startswith((SHRED_MAGIC, SQLITE_MAGIC)):
        check_header(path)
    vault_id = None
    if header.startswith(SHRED_MAGIC):
        vault_id = _read_stamp(path).get("vault_id")
    elif not files.odd_entries(paths.sidecars(path)[1:]):
        try:
            conn = connect(path, timeout=SCRUB_WAIT)  # as any command would: no trace left
            try:
                vault_id = read_meta(conn, path).get("vault_id")
            finally:
                conn.close()
        except NotAVault:
            raise  # a readable SQLite file that is no vault: refused before anyone is asked
        except (sqlite3.Error, VaultError):
            pass  # damaged or busy: shred itself decides
    return {"path": path, "vault_id": vault_id}


def shred(
    db: str | os.PathLike[str] | None = None,
    keystore: KeyStore | None = None,
    progress: Progress | None = None,
    on_total: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Destroy a vault: lock, key, rows, then overwrite, fsync and unlink every file.

    `on_total` learns how many bytes will be overwritten once the checkpoint has
    settled the files' sizes; `progress` then counts them.

    Works without the key (revoked, or the keyring entry gone), and on a file SQLite
    cannot read (damaged, truncated): then the keys the raw bytes still name go, and
    the report says plainly when none could be named. What was destroyed is recorded
    in the file before the rows go, so a shred killed half-way is finished by the
    next run, with the same report. Only regular files are overwritten; a link, FIFO
    or device at a side file's name is unlinked without being followed or opened.
    """
    path = paths.resolve_db_path(db)
    restorestate.finish(path)  # a cut-off restore leaves the vault (and no copy) behind
    header = read_header(path)
    report: dict[str, Any] = {"path": str(path), "resumed": False}
    if not header.startswith((SHRED_MAGIC, SQLITE_MAGIC)):
        check_header(path)  # not a vault at all: refused, nothing touched
    _check_shreddable(path)
    removed = _remove_planted(path)
    if header.startswith(SHRED_MAGIC):
        # Interrupted after the key and the rows were gone: finish the overwrite.
        report.update(_read_stamp(path))
        report["resumed"] = True
    else:
        # Read before the rows go, and kept in the stamp for a resumed run.
        report["export_folders"] = _export_folders(path)
        try:
            try:
                check_header(path)
            except VaultCorrupt:
                raise _Damaged() from None
            _shred_rows(path, keystore, report)
        except _Damaged:
            if report.get("key_destroyed") is None:
                damaged.destroy_keys(path, keystore, report)
        testhooks.failpoint("shred-after-rows")
    stamp_fields = (
        *("vault_id", "kid", "sessions", "items", "key_destroyed", "foreign_kid"),
        *("backup_of", "keys_kept", "export_folders"),
    )
    stamp_bytes = (
        SHRED_MAGIC + json.dumps({k: report.get(k) for k in stamp_fields}).encode() + b"\n"
    )
    done = []
    try:
        # Stamp the database first so that nothing opens it as SQLite again, and unlink
        # it last: a run cut off in between finds the stamp and finishes the side files.
        if on_total:
            on_total(sum(os.lstat(p).st_size for p, _ in regular_files(path)))
        size = erase.overwrite(path, stamp_bytes, progress)
        testhooks.failpoint("shred-during-overwrite")
        for p in paths.sidecars(path)[1:]:
            entry = erase.destroy(p, b"", progress)
            if entry:
                done.append(entry)
        os.unlink(path)
        done.insert(0, {"name": path.name, "size": size or 0, "kind": "file"})
        files.fsync_dir(path.parent)
    except OSError as exc:
        raise OperationFailed(
            f"could not overwrite or remove {exc.filename or path} ({exc.strerror}); the key is "
            "already destroyed; fix the cause and run `memvault shred` again"
        ) from None
    # A killed `export --force` of this vault may have left plaintext beside it, or in a
    # folder its audit trail named.
    folders = {path.absolute().parent} | {Path(f) for f in report.get("export_folders") or []}
    shredorder.finish(report, done + removed, folders)
    return report


def _export_folders(path: Path) -> list[str]:
    """The folders forced exports of this vault wrote in (vault.exportdirs); none when
    the file cannot be read."""
    with contextlib.suppress(sqlite3.Error, OSError), contextlib.closing(peek(path, 1.0)) as conn:
        return sorted(str(f) for f in exportdirs.recorded_in_file(conn))
    return []


def regular_files(path: Path) -> list[tuple[Path, int]]:
    """The database and side files that are regular files, with their sizes."""
    out = []
    for p in paths.sidecars(path):
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out.append((p, st.st_size))
    return out
