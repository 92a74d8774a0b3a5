"""Online, batched key rotation of a PostgreSQL vault.

A file vault rotates in one transaction under SQLite's write lock; a server
vault with agents on other hosts must keep serving them. So:

1. One rotation at a time: the vault's admin lock (vault.engines.postgres.lock), held throughout;
   purge, revoke and shred take it too.
2. The new version is recorded `pending` (committed), then its keyring entry
   is stored (the journal always knows of every entry, vault.keyjournal).
3. The switch, one short transaction: meta `kid` = new (from here the guard
   refuses the old kid, so every writer moves to the new key: the agent
   session reloads it and retries), `rotating_from` = old kid,
   `rotation_progress` = 0, old `retired`, new `current`.
4. Batches, each its own transaction: rows after `rotation_progress` (by id),
   locked, re-encrypted from the old key to the new (timestamps kept), then
   `rotation_progress` moves on. Readers meanwhile open each row with the key
   its envelope names: both keys stay readable (`PgVault.sealer_for_kid`).
5. The end: the rotation marks leave the meta, `rotate` is audited, the old
   entry is deleted from the keyring, the journal says `destroyed`.

A rotation cut off at any step is finished by the next `memvault rotate`:
after the switch it resumes from `rotation_progress`; before it, the pending
version (no row uses it) is dropped, and after its end the retired version's
entry, as `tidy` does for a file.
Old ciphertext stays in dead row versions until PostgreSQL's VACUUM reuses
their space: it is under the old key, whose entry is destroyed at the end.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vault import crypto, testhooks
from vault.engines.postgres import kept as pgkept
from vault.engines.postgres.conn import translate_after
from vault.engines.postgres.lock import admin_lock
from vault.engines.postgres.schema import audit, current_schema, record_key
from vault.engines.sqlite.lifecycle import refuse_revoked
from vault.engines.sqlite.schema import MESSAGES_TABLE, utcnow
from vault.errors import VaultBusy
from vault.files import Progress
from vault.keyjournal import CURRENT, PENDING, RETIRED, ROTATING_FROM, entry_name
from vault.keys import require_key
from vault.results import Report

if TYPE_CHECKING:
    from vault.engines.postgres.base import PgVaultBase as PgVault

FROM, PROGRESS = ROTATING_FROM, "rotation_progress"
# The next batch of rows after id $1, locked until its transaction ends (rotation, purge).
ROW_BATCH = (
    f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} "
    "WHERE id > $1 ORDER BY id LIMIT $2 FOR UPDATE"
)
DEFAULT_BATCH = 500


async def _set(conn: Any, **values: str) -> None:
    await conn.executemany(
        "INSERT INTO memvault_meta (key, value) VALUES ($1, $2) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        list(values.items()),
    )


async def rotate(
    vault: PgVault, progress: Progress | None, batch: int, resume_only: bool = False
) -> Report | None:
    """With `resume_only`, finish a rotation under way or cut off, and start none (None)."""
    started = time.monotonic()
    ks = vault.keystore
    ks.check_usable()
    conn = await vault.connect()
    try:
        schema = await current_schema(conn)
        await vault.read_meta(conn)  # no vault here: exit 3 before any lock
        assert schema is not None
        async with admin_lock(conn, schema, vault.path):
            if resume_only and FROM not in await vault.read_meta(conn):
                return None
            old, new = await _start_or_resume(vault, conn)
            try:
                counts = await _batches(vault, conn, old, new, progress, batch)
                # The old key is retired only when no row under it remains, wherever it is.
                counts["stragglers"] = await _stragglers(conn, old, new, batch)
            except Exception as exc:
                raise translate_after(
                    exc,
                    vault.loc,
                    f"the vault already switched to key {new.kid} (both keys read meanwhile); "
                    "fix that, then run `memvault rotate` again to finish",
                ) from None
            async with conn.transaction():
                await conn.execute(
                    "DELETE FROM memvault_meta WHERE key = ANY($1)", [FROM, PROGRESS]
                )
                await audit(conn, "rotate", new.kid, old_kid=old.kid, online=True, **counts)
            testhooks.failpoint("pg-rotate-after-finish")
            vault_id = (await vault.read_meta(conn))["vault_id"]
            # Kept while a recorded backup uses it (vault.retention), else destroyed.
            fate = await pgkept.settle_old(conn, vault_id, old.kid, ks.delete)
    finally:
        await conn.close()
    vault.use_key(new, retired=old.kid)
    return Report(
        {
            **counts,
            "old_kid": old.kid,
            "new_kid": new.kid,
            "old_key": fate,
            "backups": pgkept.backups(vault),
            "seconds": round(time.monotonic() - started, 3),
            "scrubbed": True,
        },
        True,
    )


async def _start_or_resume(vault: PgVault, conn: Any) -> tuple[crypto.Sealer, crypto.Sealer]:
    """(old, new): a rotation cut off after its switch is resumed; else a new one starts."""
    ks = vault.keystore
    meta = await vault.read_meta(conn)
    refuse_revoked(meta)
    vault_id = meta["vault_id"]
    if FROM in meta:
        old_kid, new_kid = meta[FROM], meta["kid"]
        old = crypto.Sealer(
            require_key(ks.get(entry_name(vault_id, old_kid)), vault_id, old_kid, ks.name)
        )
        new = crypto.Sealer(
            require_key(ks.get(entry_name(vault_id, new_kid)), vault_id, new_kid, ks.name)
        )
        return old, new
    await pgkept.settle_leftovers(conn, vault_id, meta["kid"], ks.delete)
    old = vault.sealer(refresh=True)
    new = crypto.Sealer(crypto.generate_key())
    async with conn.transaction():
        await record_key(conn, new.kid, PENDING)
    testhooks.failpoint("pg-rotate-after-record-pending")
    ks.set(entry_name(vault_id, new.kid), new.master_key)
    testhooks.failpoint("pg-rotate-after-pending")
    async with conn.transaction():
        kid = await conn.fetchval("SELECT value FROM memvault_meta WHERE key = 'kid' FOR UPDATE")
        # A writer whose guard passed under the old kid but that has not committed yet
        # would commit its row under the old key behind the batches (invisible to them),
        # after the old entry is gone: wait for the writes in flight. SHARE mode lets
        # readers through and holds new writers only until this short transaction
        # commits; their guard then sees the new kid. (After the meta row: the library's
        # own changes lock that row before the table, so the order cannot deadlock.)
        await conn.execute(f"LOCK TABLE {MESSAGES_TABLE} IN SHARE MODE")
        if kid != old.kid:  # cannot happen under the lock; refuse rather than guess
            raise VaultBusy(f"{vault.path} changed key while the rotation began; try again")
        await _set(conn, kid=new.kid, rotated_at=utcnow(), **{FROM: old.kid, PROGRESS: "0"})
        await record_key(conn, old.kid, RETIRED)
        await record_key(conn, new.kid, CURRENT)
    testhooks.failpoint("pg-rotate-after-switch")
    return old, new


async def _batches(
    vault: PgVault,
    conn: Any,
    old: crypto.Sealer,
    new: crypto.Sealer,
    progress: Progress | None,
    batch: int,
) -> dict[str, int]:
    ttl = vault.ttl
    cutoff = None if ttl is None else int(time.time()) - ttl
    items = expired = unreadable = 0
    sessions: set[str] = set()
    while True:
        async with conn.transaction():
            last = int(
                await conn.fetchval(
                    "SELECT value FROM memvault_meta WHERE key = $1 FOR UPDATE", PROGRESS
                )
            )
            rows = await conn.fetch(ROW_BATCH, last, batch)
            if not rows:
                return {
                    "sessions": len(sessions),
                    "items": items,
                    "expired": expired,
                    "unreadable": unreadable,
                }
            updates = []
            for row_id, sid, data in rows:
                sessions.add(sid)
                if kid_of(data) == new.kid:
                    continue  # written under the new key since the switch
                stamped = crypto.rotate_row_stamped(old, new, sid, data)
                if stamped is None:
                    unreadable += 1  # kept as it is: a rotation deletes nothing
                    continue
                rotated, ts = stamped
                items += 1
                if cutoff is not None and ts < cutoff:
                    expired += 1
                updates.append((rotated, row_id))
            await conn.executemany(
                f"UPDATE {MESSAGES_TABLE} SET message_data = $1 WHERE id = $2", updates
            )
            await _set(conn, **{PROGRESS: str(rows[-1][0])})
        if progress:
            progress(len(rows))
        testhooks.failpoint("pg-rotate-after-batch")


# The key id an envelope names: one function for both engines (the file vault's online
# rotation reads it too); kept under this name for the PostgreSQL modules.
kid_of = crypto.kid_of


async def _stragglers(conn: Any, old: crypto.Sealer, new: crypto.Sealer, batch: int) -> int:
    """Re-encrypt the rows still under the old key that the ordered batches went past
    (a write committed under it behind their progress): none, when writers behave."""
    # The kid's text alone, not `"kid": "..."`: the guard lets any JSON layout of an
    # envelope in (compact, keys in another order), and each candidate is checked below.
    marker = old.kid
    moved, last = 0, 0
    while True:
        async with conn.transaction():
            rows = await conn.fetch(
                f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} "
                "WHERE id > $3 AND strpos(message_data, $1) > 0 ORDER BY id LIMIT $2 "
                "FOR UPDATE",
                marker,
                batch,
                last,
            )
            if not rows:
                return moved
            last = rows[-1][0]
            updates = []
            for row_id, sid, data in rows:
                if kid_of(data) != old.kid:
                    continue  # the kid inside some other text: not an envelope under it
                stamped = crypto.rotate_row_stamped(old, new, sid, data)
                if stamped is not None:  # else unreadable: kept, as the batches keep it
                    updates.append((stamped[0], row_id))
            await conn.executemany(
                f"UPDATE {MESSAGES_TABLE} SET message_data = $1 WHERE id = $2", updates
            )
            moved += len(updates)
