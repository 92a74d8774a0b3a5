"""Online, batched key rotation of a PostgreSQL vault: the key-journal steps around
vault.rotation's loop, the one both engines run.

1. One rotation at a time: the vault's admin lock (vault.engines.postgres.lock), held
   throughout on one connection (`HeldConnection`); purge, revoke and shred take it too.
2. The new version is recorded `pending` (committed), then its keyring entry
   is stored (the journal always knows of every entry, vault.keyjournal).
3. The switch, one short transaction: meta `kid` = new (from here the guard
   refuses the old kid, so every writer moves to the new key: the agent
   session reloads it and retries), `rotating_from` = old kid,
   `rotation_progress` = 0, old `retired`, new `current`.
4. The batches (vault.rotation, through `PgRows`): each read after the progress id
   with no row locked, re-encrypted outside any transaction, then written in one
   short transaction, each row only where it still holds the text read, with
   `rotation_progress` moved on. Readers meanwhile open each row with the key its
   envelope names: both keys stay readable (`PgVault.sealer_for_kid`).
5. The end: the rotation marks leave the meta, `rotate` is audited, the old
   version is retained while a recorded backup uses it, else its entry is deleted
   from the keyring and the journal says `destroyed` (vault.engines.postgres.kept).

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

from vault import crypto, rotation, testhooks
from vault.engines.postgres import kept as pgkept
from vault.engines.postgres.conn import (
    HeldConnection,
    is_driver_error,
    off_loop,
    translate,
    translate_after,
)
from vault.engines.postgres.lock import admin_lock
from vault.engines.postgres.schema import audit, current_schema, record_key, set_meta
from vault.engines.sqlite.db import parse_ttl
from vault.engines.sqlite.schema import MESSAGES_TABLE, utcnow
from vault.errors import VaultBusy, VaultError
from vault.files import Progress
from vault.keyjournal import CURRENT, PENDING, RETIRED, ROTATING_FROM, entry_name
from vault.keyload import refuse_revoked
from vault.keys import require_key
from vault.keysource.store import prewrap, refuse_moved
from vault.results import Report

if TYPE_CHECKING:
    from vault.engines.postgres.base import PgVaultBase as PgVault

FROM, PROGRESS = ROTATING_FROM, "rotation_progress"
# The next batch of rows after id $1, locked until its transaction ends (purge).
ROW_BATCH = (
    f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} "
    "WHERE id > $1 ORDER BY id LIMIT $2 FOR UPDATE"
)
DEFAULT_BATCH = 500
# A batch's write: each row only where it still holds the text the batch read (a writer
# may have deleted or cleared it since); the count in the status says how many moved.
UNCHANGED_UPDATE = (
    f"UPDATE {MESSAGES_TABLE} AS m SET message_data = u.new "
    "FROM unnest($1::text[], $2::int8[], $3::text[]) AS u(new, id, old) "
    "WHERE m.id = u.id AND m.message_data = u.old"
)


def rotate(
    vault: PgVault, progress: Progress | None, batch: int, resume_only: bool = False
) -> Report | None:
    """With `resume_only`, finish a rotation under way or cut off, and start none (None)."""
    try:
        return off_loop(lambda: _rotate(vault, progress, batch, resume_only))
    except VaultError:
        raise
    except Exception as exc:
        if not is_driver_error(exc):
            raise
        raise translate(exc, vault.loc) from None


def _rotate(
    vault: PgVault, progress: Progress | None, batch: int, resume_only: bool
) -> Report | None:
    started = time.monotonic()
    ks = vault.keystore
    ks.check_usable()
    with HeldConnection(vault.loc) as held:
        schema = held.run(current_schema)
        held.run(vault.read_meta)  # no vault here: exit 3 before any lock
        assert schema is not None
        held.hold(admin_lock(held.conn, schema, vault.path))
        meta = held.run(vault.read_meta)
        if resume_only and FROM not in meta:
            return None
        old, new = held.run(lambda conn: _start_or_resume(vault, conn))
        try:
            begin = int(held.run(vault.read_meta).get(PROGRESS, "0") or 0)
            rows = PgRows(held)
            moved = rotation.move_rows(
                rows,
                old,
                new,
                begin,
                parse_ttl(meta, vault.path),
                progress,
                batch,
                0,  # row locks, not a database lock: a writer waits for no pause
                step="pg-rotate-after-batch",
                # The old key is retired only when no row under it remains, wherever it is.
                sweep=True,
                rows_left=rows.last_id() - begin,
            )
        except Exception as exc:
            raise translate_after(
                exc,
                vault.loc,
                f"the vault already switched to key {new.kid} (both keys read meanwhile); "
                "fix that, then run `memvault rotate` again to finish",
            ) from None
        if moved.superseded:  # under the admin lock: cannot happen; refuse rather than guess
            raise VaultBusy(f"{vault.path} changed key during the rotation; try again")
        counts = moved.counts()
        fate = held.run(lambda conn: _finish(vault, conn, old, new, counts))
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


async def _finish(
    vault: PgVault, conn: Any, old: crypto.Sealer, new: crypto.Sealer, counts: dict[str, int]
) -> str:
    """The rotation's marks go and it is audited; then the old version is settled."""
    async with conn.transaction():
        await conn.execute("DELETE FROM memvault_meta WHERE key = ANY($1)", [FROM, PROGRESS])
        await audit(conn, "rotate", new.kid, old_kid=old.kid, online=True, **counts)
    testhooks.failpoint("pg-rotate-after-finish")
    vault_id = (await vault.read_meta(conn))["vault_id"]
    # Kept while a recorded backup uses it (vault.retention), else destroyed.
    return await pgkept.settle_old(conn, vault_id, old.kid, vault.keystore.delete)


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
    # A transit key wraps it first: a token that may not do so fails with nothing written.
    prewrap(ks, entry_name(vault_id, new.kid), new.master_key)
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
        refuse_moved(ks, await vault.read_meta(conn), vault.path)
        await set_meta(conn, kid=new.kid, rotated_at=utcnow(), **{FROM: old.kid, PROGRESS: "0"})
        await record_key(conn, old.kid, RETIRED)
        await record_key(conn, new.kid, CURRENT)
    testhooks.failpoint("pg-rotate-after-switch")
    return old, new


class PgRows:
    """vault.rotation's `RotationRows` over the rotation's held connection: each call one
    statement or one short transaction."""

    def __init__(self, held: HeldConnection) -> None:
        self.held = held

    def read_rows(self, after: int, limit: int, naming: str | None = None) -> list[rotation.Row]:
        # No FOR UPDATE: a writer deleting these rows meanwhile does not wait for the
        # batch's cryptography; the write below skips any row it changed.
        where = "" if naming is None else "AND strpos(message_data, $3) > 0 "
        sql = (
            f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} "
            f"WHERE id > $1 {where}ORDER BY id LIMIT $2"
        )
        args = (after, limit) if naming is None else (after, limit, naming)
        rows = self.held.run(lambda conn: conn.fetch(sql, *args))
        return [(r[0], r[1], r[2]) for r in rows]

    def last_id(self) -> int:
        """The highest row id (0 for none): how far the batches go, at most."""
        sql = f"SELECT coalesce(max(id), 0) FROM {MESSAGES_TABLE}"
        return int(self.held.run(lambda conn: conn.fetchval(sql)))

    def write_rows(
        self, old_kid: str, new_kid: str, updates: list[rotation.Update], progress: int | None
    ) -> int | None:
        async def write(conn: Any) -> int | None:
            async with conn.transaction():
                # FOR SHARE, as a writer's change locks them: a batch never waits for a
                # writer's lock on the kid, so the two cannot deadlock over the rows.
                kids = dict(
                    await conn.fetch(
                        "SELECT key, value FROM memvault_meta WHERE key IN ('kid', $1) FOR SHARE",
                        FROM,
                    )
                )
                if kids.get("kid") != new_kid or kids.get(FROM) != old_kid:
                    return None
                status = await conn.execute(
                    UNCHANGED_UPDATE,
                    [u[0] for u in updates],
                    [u[1] for u in updates],
                    [u[2] for u in updates],
                )
                if progress is not None:
                    await set_meta(conn, **{PROGRESS: str(progress)})
                return int(status.split()[-1])

        return self.held.run(write)


# The key id an envelope names: one function for both engines; kept under this name for
# the PostgreSQL modules.
kid_of = crypto.kid_of
