"""A PostgreSQL vault's retained key versions and its backups' records.

The twins of vault.engines.sqlite.keptkeys for a file vault; the rule itself (a version a recorded
backup uses is kept) is vault.retention's, the same for both engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vault import retention, testhooks
from vault.engines.postgres.base import PgVaultBase
from vault.engines.postgres.lock import admin_lock
from vault.engines.postgres.schema import audit, current_schema, record_key
from vault.errors import BadInput
from vault.keyjournal import DESTROYED, PENDING, RETAINED, RETIRED, entry_name
from vault.keyload import refuse_revoked
from vault.keysource.store import forgotten, forgotten_paths

RECORDS = "SELECT backup_id, path, kid, created_at FROM memvault_backups ORDER BY seq"


async def records(conn: Any) -> list[retention.BackupRecord]:
    return [retention.BackupRecord(*r) for r in await conn.fetch(RECORDS)]


async def states(conn: Any) -> dict[str, str]:
    return {k: s for k, s in await conn.fetch("SELECT kid, state FROM memvault_keys")}


def records_of(vault: PgVaultBase) -> list[retention.BackupRecord]:
    async def read(conn: Any) -> list[retention.BackupRecord]:
        await vault.read_meta(conn)
        return await records(conn)

    return vault.run(read)


def backups(vault: PgVaultBase) -> list[dict[str, Any]]:
    async def read(conn: Any) -> tuple[list[retention.BackupRecord], dict[str, str]]:
        await vault.read_meta(conn)
        return await records(conn), await states(conn)

    recs, kid_states = vault.run(read)
    return retention.described(recs, kid_states)


def record_backup(vault: PgVaultBase, target: Path) -> retention.BackupRecord:
    async def write(conn: Any) -> retention.BackupRecord:
        # The kid row locked as a rotation's switch locks it: the record names the key
        # the vault uses, and a rotation ending after this commit sees the record.
        kid = await conn.fetchval("SELECT value FROM memvault_meta WHERE key = 'kid' FOR SHARE")
        refuse_revoked(await vault.read_meta(conn))
        rec = retention.new_record(target, kid)
        await conn.execute(
            "INSERT INTO memvault_backups (backup_id, path, kid, created_at) "
            "VALUES ($1, $2, $3, $4)",
            rec.backup_id,
            rec.path,
            rec.kid,
            rec.created_at,
        )
        return rec

    return vault.run(write, write=True)


def settle_backup(vault: PgVaultBase, rec: retention.BackupRecord, kid: str) -> str | None:
    async def write(conn: Any) -> str | None:
        await conn.execute(
            "UPDATE memvault_backups SET kid = $1 WHERE backup_id = $2", kid, rec.backup_id
        )
        return (await states(conn)).get(kid)

    return vault.run(write, write=True)


def drop_backup(vault: PgVaultBase, rec: retention.BackupRecord) -> None:
    async def write(conn: Any) -> None:
        await conn.execute("DELETE FROM memvault_backups WHERE backup_id = $1", rec.backup_id)

    vault.run(write, write=True)


def forget(vault: PgVaultBase, kid: str) -> dict[str, Any]:
    """Destroy a retained version on purpose (engines.sqlite.keptkeys.KeptVersions.forget's twin),
    under the admin lock, so no rotation decides about it meanwhile."""
    ks = vault.keystore
    ks.check_usable()
    lost = [b for b in backups(vault) if b["kid"] == kid]

    async def go() -> dict[str, Any]:
        conn = await vault.connect()
        try:
            schema = await current_schema(conn)
            meta = await vault.read_meta(conn)
            assert schema is not None
            async with admin_lock(conn, schema, vault.path):
                refuse_revoked(meta)
                state = (await states(conn)).get(kid)
                if state != RETAINED:
                    raise BadInput(
                        f"key {kid[:40]!r} is not a retained version of {vault.path} (it is "
                        f"{state or 'unknown here'}); `memvault key list` shows the retained ones"
                    )
                ks.delete(entry_name(meta["vault_id"], kid))
                testhooks.failpoint("forget-after-delete")
                result = forgotten(meta, kid, lost)
                async with conn.transaction():
                    await record_key(conn, kid, DESTROYED)
                    await conn.execute("DELETE FROM memvault_backups WHERE kid = $1", kid)
                    await audit(conn, "key-forget", kid, **forgotten_paths(result))
                return result
        finally:
            await conn.close()

    return vault.call(go)


async def settle_old(conn: Any, vault_id: str, kid: str, delete: Any) -> str:
    """A version no row uses any more (a rotation's old key, or one it left): retained
    while a recorded backup uses it, else its entry deleted (`delete(name)`) and the
    journal says destroyed. Returns the state it ends in."""
    fate = retention.fate(kid, await records(conn))
    if fate == RETAINED:
        async with conn.transaction():
            await record_key(conn, kid, RETAINED)
        return RETAINED
    delete(entry_name(vault_id, kid))
    async with conn.transaction():
        await record_key(conn, kid, DESTROYED)
    return DESTROYED


async def settle_leftovers(conn: Any, vault_id: str, current: str, delete: Any) -> None:
    """End the versions a cut-off rotation or restore left; the caller holds the admin lock.

    Holding it proves no rotation is between its record and its end: a pending version
    is a dead one (cut off before its switch), a retired one a key no row uses any more
    (cut off after its end, before its entry went). A pending entry goes; a retired
    one, or a retained one whose backups moved on, is judged by `settle_old`, as `tidy`
    does for a file.
    """
    rows = await conn.fetch(
        "SELECT kid, state FROM memvault_keys WHERE state = ANY($1)", [PENDING, RETIRED, RETAINED]
    )
    for kid, state in rows:
        if kid == current:
            continue
        if state == PENDING:
            delete(entry_name(vault_id, kid))
            async with conn.transaction():
                await record_key(conn, kid, DESTROYED)
        else:
            await settle_old(conn, vault_id, kid, delete)


class PgKeptVersions(PgVaultBase):
    """A base of `PgVault`: what vault.engines.sqlite.backup and `key forget` ask of a vault."""

    def backups(self) -> list[dict[str, Any]]:
        return backups(self)

    def record_backup(self, target: Path) -> retention.BackupRecord:
        return record_backup(self, target)

    def settle_backup(self, rec: retention.BackupRecord, kid: str) -> str | None:
        return settle_backup(self, rec, kid)

    def drop_backup(self, rec: retention.BackupRecord) -> None:
        drop_backup(self, rec)

    def forget(self, kid: str) -> dict[str, Any]:
        return forget(self, kid)
