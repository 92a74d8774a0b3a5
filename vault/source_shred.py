"""`import --shred-source`: destroying the plaintext source, and finishing a killed run.

The source is destroyed only after every session is in the vault, while the
import's connection still holds its exclusive lock (`shred_locked`). A killed
run is finished by running the same command again:

Each session's import event in the vault's audit trail carries two marks: one of
the source (its resolved path) and one of the session within it, both one-way
hashes, so the trail names neither. The `source-shred` event that ends a run
carries the source's mark too. Marks recorded after the last `source-shred` of a
source are that source's pending work; on the rerun:

* a session the marks record, whose items the vault's copy of that session still
  begins with (same count, same contents, decrypted and compared), is already in:
  it is not imported twice;
* a session they do not record is imported as usual (and a clash with a vault
  session of the same id is refused as usual);
* a source the shred already zeroed or removed (not SQLite any more) is finished:
  only what is left of its files is overwritten and removed (its shred began only
  once every session was in).

This module never imports `agents`.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault import crypto, erase, files, paths, testhooks
from vault.errors import OperationFailed
from vault.import_source import Plan, SourceSession, digest_update, quote_name

if TYPE_CHECKING:
    from vault.engine import AnyVault
    from vault.export import ItemSource

SOURCE_EVENT = "source-shred"


def source_mark(source: Path) -> str:
    return hashlib.sha256(b"memvault import source\0" + os.fsencode(str(source))).hexdigest()[:32]


def session_mark(source: str, session_id: str) -> str:
    data = f"{source}\0{session_id}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"memvault import session\0" + data).hexdigest()[:32]


@dataclass(frozen=True)
class Interrupted:
    """What killed runs of `import SOURCE --shred-source` recorded in the vault."""

    mark: str  # the source's
    done: dict[str, int]  # session mark -> items, since the source's last source-shred
    shred_source: bool

    @classmethod
    def of(cls, vault: AnyVault, source: Path, shred_source: bool) -> Interrupted:
        mark = source_mark(source)
        return cls(mark, pending(vault.audit_log(), mark) if shred_source else {}, shred_source)

    def recorded(self, session_id: str) -> int | None:
        """The items a killed run imported into the session, if it did."""
        return self.done.get(session_mark(self.mark, session_id))

    def already_in(self, vault: ItemSource, s: SourceSession, items: Iterable[Any]) -> bool:
        """Imported by a killed run (as the marks say), and still whole in the vault."""
        if self.recorded(s.session_id) != s.items:
            return False
        digest = hashlib.sha256()
        for item in items:
            digest_update(digest, item)
        return vault_begins_with(vault, s.session_id, digest.digest(), s.items)

    def marks(self, session_id: str) -> dict[str, str]:
        """The audit marks of one session's import (none without --shred-source)."""
        if not self.shred_source:
            return {}
        return {"source": self.mark, "session": session_mark(self.mark, session_id)}


def pending(log: list[dict[str, Any]], source: str) -> dict[str, int]:
    """Session mark -> items, for this source's imports since its last source-shred."""
    out: dict[str, int] = {}
    for event in log:
        if event.get("source") != source:
            continue
        if event.get("event") == SOURCE_EVENT:
            out.clear()
        elif event.get("event") == "import" and isinstance(event.get("session"), str):
            out[event["session"]] = int(event.get("items", 0))
    return out


def vault_begins_with(vault: ItemSource, session_id: str, digest: bytes, count: int) -> bool:
    """Whether the vault's session starts with exactly `count` items of this digest."""
    h = hashlib.sha256()
    seen = 0
    if session_id not in vault.session_ids():
        return False
    for one in vault.opened_items(session_id, include_expired=True):
        if seen == count:
            break
        if one.state is crypto.ItemState.UNREADABLE:
            return False
        digest_update(h, one.item)
        seen += 1
    return seen == count and h.digest() == digest


def looks_destroyed(source: Path) -> bool:
    """The database is gone, or holds only zeros: what a shred cut off leaves."""
    try:
        with open(source, "rb", opener=lambda p, f: os.open(p, f | files.NO_FOLLOW)) as fh:
            while chunk := fh.read(1 << 16):
                if chunk.count(0) != len(chunk):
                    return False
    except FileNotFoundError:
        return True  # removed already, maybe with side files left
    except OSError:
        return False
    return True


def finish_destroying(source: Path) -> dict[str, Any]:
    """Overwrite and remove what an interrupted shred left of the source's files."""
    done = []
    try:
        for p in paths.sidecars(source):
            entry = erase.destroy(p)
            if entry:
                done.append(entry)
        files.fsync_dir(source.parent)
    except OSError as exc:
        raise OperationFailed(
            f"every session of {source} is in the vault, but overwriting "
            f"{exc.filename or source} failed ({exc.strerror}); remove the source files yourself"
        ) from None
    return {"path": str(source), "rows": 0, "files": done, "resumed": True}


def check_shreddable(plan: Plan, all_sessions: set[str], session_id: str | None) -> None:
    """Refuse, before anything is imported, a source whose destruction would lose data.

    `all_sessions`: the source's sessions not already imported by a killed run.
    """
    src = plan.source
    if plan.other_tables:
        raise OperationFailed(
            f"{src} also holds table(s) {', '.join(plan.other_tables)} that the import does "
            "not carry over; --shred-source would destroy them; drop --shred-source; "
            "nothing was imported"
        )
    left = sorted(all_sessions - {s.session_id for s in plan.sessions})
    if left:
        raise OperationFailed(
            f"{src} holds {len(left)} other session(s) besides {session_id!r}; "
            "--shred-source destroys the whole file; import every session (no --session) "
            "or drop --shred-source; nothing was imported"
        )
    present = [p for p in paths.sidecars(src) if p.exists()]
    for p in present:
        try:
            os.close(os.open(p, os.O_RDWR | files.NO_FOLLOW))
        except OSError as exc:
            raise OperationFailed(
                f"cannot overwrite {p} ({exc.strerror}); --shred-source needs write "
                "access to the source and its side files; nothing was imported"
            ) from None


def shred(conn: sqlite3.Connection | None, plan: Plan, close: Callable[[], None]) -> dict[str, Any]:
    """Destroy the source: through `conn`, which holds its lock, or (None) finish the shred
    a killed run began, which left no SQLite file to open."""
    if conn is None:
        return finish_destroying(plan.source)
    return shred_locked(conn, plan, close)


def shred_locked(conn: sqlite3.Connection, plan: Plan, close: Callable[[], None]) -> dict[str, Any]:
    """Delete the rows (secure_delete), then overwrite, fsync and unlink every file.

    `conn` holds the source's exclusive lock; `close` closes it, before the unlinks.
    """
    src = plan.source
    try:
        testhooks.failpoint("import-before-source-shred")
        rows = conn.execute(f"DELETE FROM {quote_name(plan.messages_table)}").rowcount
        conn.execute(f"DELETE FROM {quote_name(plan.sessions_table)}")
        conn.execute("COMMIT")
        # Copy the zeroed pages into the database without truncating the WAL: its
        # older frames (plaintext) are overwritten below, not merely released.
        conn.execute("PRAGMA wal_checkpoint(FULL)")
    except sqlite3.Error as exc:
        raise OperationFailed(
            f"every session is in the vault, but deleting the rows of {src} failed ({exc}); "
            "the source is intact; remove it yourself"
        ) from None
    sizes: dict[Path, int] = {}
    try:
        # While this connection still holds the exclusive lock: WAL first (it may hold
        # plaintext frames), then -shm and -journal, then the database. Regular files
        # only: a link planted since the checks is never followed.
        for p in reversed(paths.sidecars(src)):
            size = erase.overwrite(p)
            if size is not None:
                sizes[p] = size
        testhooks.failpoint("import-during-source-shred")
        close()
        done = []
        for p in paths.sidecars(src):
            entry = erase.destroy(p)  # again: closing may have written to it
            if entry:
                entry["size"] = max(entry["size"], sizes.get(p, 0))
                done.append(entry)
            elif p in sizes:  # overwritten above, then removed by SQLite on close
                done.append({"name": p.name, "size": sizes[p], "kind": "file"})
        files.fsync_dir(src.parent)
    except OSError as exc:
        raise OperationFailed(
            f"every session is in the vault and the source's rows are deleted, but "
            f"overwriting {exc.filename or src} failed ({exc.strerror}); remove the "
            "source files yourself"
        ) from None
    return {"path": str(src), "rows": rows, "files": done}
