"""A file vault's counts in SQL, and `status`: per session, its items and how many look expired.

Read from indexes, without reading or authenticating the rows, so the cost does
not grow with the items' size and barely with their number (`sessions`, `status`).
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING, Any

from vault import backupmark, paths
from vault.engines.sqlite.db import parse_ttl, read_meta
from vault.engines.sqlite.schema import (
    ITEM_TIME,
    ITEM_WINDOW,
    ITEM_WINDOW_INDEX,
    MESSAGES_TABLE,
    ROTATION_LOGGED,
    SESSIONS_TABLE,
    WINDOW_SECONDS,
    last_rotation,
    window_start,
)
from vault.results import SessionInfo
from vault.vaultops import key_state, status_doc

if TYPE_CHECKING:
    from vault.engines.sqlite.lifecycle import KeyLifecycle


def count_sessions(conn: sqlite3.Connection, ttl: int | None, now: int | None) -> list[SessionInfo]:
    infos: dict[str, SessionInfo] = {}
    for sid, updated in conn.execute(f"SELECT session_id, updated_at FROM {SESSIONS_TABLE}"):
        infos[sid] = SessionInfo(sid, 0, updated_at=updated)
    # Both read the SDK's (session_id, id) index and ours: never the rows themselves.
    for sid, n in conn.execute(
        f"SELECT session_id, count(*) FROM {MESSAGES_TABLE} GROUP BY session_id"
    ):
        infos.setdefault(sid, SessionInfo(sid, 0)).items = n
    if ttl is not None:
        cutoff = (int(time.time()) if now is None else now) - ttl
        for info in infos.values():
            if info.items:
                info.expired_unverified = count_expired(conn, info.session_id, cutoff)
    return sorted(infos.values(), key=lambda i: i.session_id)


def count_expired(conn: sqlite3.Connection, session_id: str, cutoff: int) -> int:
    """Items whose token claims a time before `cutoff`: whole windows of the index,
    and the rows themselves only in the window that holds the cut-off."""
    expired = 0
    for chars, n in conn.execute(
        f"SELECT {ITEM_WINDOW}, count(*) FROM {MESSAGES_TABLE} INDEXED BY {ITEM_WINDOW_INDEX} "
        "WHERE session_id = ? GROUP BY 1",
        (session_id,),
    ).fetchall():
        start = window_start(chars)
        if start is None or start >= cutoff:
            continue
        if start + WINDOW_SECONDS <= cutoff:
            expired += n
        else:
            expired += conn.execute(
                f"SELECT count(*) FROM {MESSAGES_TABLE} INDEXED BY {ITEM_WINDOW_INDEX} "
                f"WHERE session_id = ? AND {ITEM_WINDOW} = ? AND {ITEM_TIME} < ?",
                (session_id, chars, cutoff),
            ).fetchone()[0]
    return expired


def file_status(vault: KeyLifecycle, now: int | None) -> dict[str, Any]:
    """What `memvault status` shows of a vault file; its counts are unverified."""
    with vault.connection() as conn:
        conn.execute("BEGIN")  # one snapshot for the meta and every count
        meta = read_meta(conn, vault.path)
        ttl = parse_ttl(meta, vault.path)
        infos = count_sessions(conn, ttl, now)
        rotated = last_rotation(meta, conn.execute(ROTATION_LOGGED).fetchone() is not None)
    files = {}
    for p in paths.sidecars(vault.path):
        if p.exists():
            files[p.name] = {"size": p.stat().st_size, "mode": paths.mode_of(p)}
    where: dict[str, Any] = {
        "path": str(vault.path),
        "folder_mode": paths.mode_of(vault.path.parent),
        "files": files,
        "size": sum(f["size"] for f in files.values()),
        "scrub_pending": meta.get("scrub_pending") == "1",
        "shred_interrupted": "shred_started" in meta,
        "backup_of": meta.get(backupmark.BACKUP_OF),  # None: the live vault, not a backup
        "backed_up_at": meta.get(backupmark.BACKED_UP_AT),
    }
    out = status_doc(meta, ttl, infos, rotated, where)
    key_state(
        out,
        lambda: vault.keystore,
        vault.sealer,
        lambda: not vault.revocation_complete(),
    )
    return out
