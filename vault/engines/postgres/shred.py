"""`memvault shred` of a PostgreSQL vault: key versions, rows, tables, and the schema
`memvault init` made.

There are no files to overwrite: every recorded key version's keyring entry goes,
then the rows (deleted, VACUUMed), the vault's tables, and the URL's `?schema=` if
`memvault init` created it and nothing else is left in it. Holds the admin lock
(vault.engines.postgres.lock), as purge, revoke and rotate do. A shred cut off at
any step is finished by the next one, with the same report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault import exportdirs, shredorder, testhooks
from vault.engines.postgres.admin import kids_in_use, known_kids
from vault.engines.postgres.conn import (
    HeldConnection,
    is_driver_error,
    translate,
    translate_after,
)
from vault.engines.postgres.lock import admin_lock
from vault.engines.postgres.schema import _q, current_schema, record_key, set_meta
from vault.engines.sqlite.schema import MESSAGES_TABLE, SESSIONS_TABLE, utcnow
from vault.keyjournal import DESTROYED

if TYPE_CHECKING:
    from vault.engines.postgres.kept import PgKeptVersions as PgVault

PG_SHRED_FILES_NOTE = (
    "not applicable on PostgreSQL: the server's files are not memvault's to overwrite; the "
    "rows were deleted, the tables VACUUMed and dropped; copies in the server's WAL, "
    "archives, replicas and backups stay, unreadable now that the key is destroyed"
)
# The vault's tables, dropped by `shred` in this order (the messages, and their trigger, first).
VAULT_TABLES = (
    MESSAGES_TABLE,
    SESSIONS_TABLE,
    "memvault_audit",
    "memvault_backups",
    "memvault_keys",
    "memvault_migrations",
    "memvault_meta",
)


class _PgSteps:
    """Shred's steps on a PostgreSQL vault (vault.shredorder), on one connection that
    holds the admin lock throughout."""

    after_mark = "pg-shred-after-mark"
    after_keys = "pg-shred-after-keys"

    def __init__(self, vault: PgVault, held: HeldConnection) -> None:
        self.vault, self.held = vault, held
        self.meta: dict[str, str] = {}
        self.keys_touched = False  # from here on a failure says the keys are gone

    def read_meta(self) -> dict[str, str]:
        self.meta = self.held.run(self.vault.read_meta)
        return self.meta

    def count(self) -> tuple[int, int]:
        async def go(conn: Any) -> tuple[int, int]:
            sessions = await conn.fetchval(
                f"SELECT count(*) FROM (SELECT session_id FROM {SESSIONS_TABLE} UNION "
                f"SELECT session_id FROM {MESSAGES_TABLE}) AS s"
            )
            return sessions, await conn.fetchval(f"SELECT count(*) FROM {MESSAGES_TABLE}")

        return self.held.run(go)

    def mark(self, meta: dict[str, str], marker: str) -> None:
        kid = meta.get("revoked_kid", meta["kid"])
        # The guard refuses every write from here on (the kid is no envelope's).
        marks = {} if "revoked_at" in meta else {"revoked_at": utcnow(), "revoked_kid": kid}

        async def go(conn: Any) -> None:
            async with conn.transaction():
                await set_meta(conn, kid="revoked", shred_started=marker, **marks)

        self.held.run(go)

    def unmark(self) -> None:
        """Nothing to take back: the mark revoked the vault, and a revoke stays."""

    def keys_kept(self, meta: dict[str, str]) -> dict[str, Any] | None:
        return None  # a PostgreSQL vault is never a backup (those are files)

    def key_versions(self, meta: dict[str, str], kid: str) -> tuple[set[str], set[str]]:
        async def go(conn: Any) -> tuple[set[str], set[str]]:
            return await known_kids(conn, meta), await kids_in_use(conn, kid, meta)

        found = self.held.run(go)
        self.keys_touched = True
        return found

    def keys_gone(self, kids: set[str], marker: str) -> None:
        async def go(conn: Any) -> None:
            async with conn.transaction():
                for k in sorted(kids):
                    await record_key(conn, k, DESTROYED)
                await set_meta(conn, shred_started=marker)

        self.held.run(go)

    def destroy_rows(self) -> None:
        async def go(conn: Any) -> None:
            async with conn.transaction():
                await conn.execute(f"DELETE FROM {MESSAGES_TABLE}")
                await conn.execute(f"DELETE FROM {SESSIONS_TABLE}")
            await conn.execute(f"VACUUM {MESSAGES_TABLE}, {SESSIONS_TABLE}")

        self.held.run(go)
        testhooks.failpoint("pg-shred-after-vacuum")


def shred(vault: PgVault) -> dict[str, Any]:
    """Destroy a PostgreSQL vault: lock, key, rows (then VACUUM), tables, schema.

    Works without the key (revoked, or this keyring never had it). What was destroyed
    is recorded in the meta before the rows go, so a shred cut off is finished by the
    next run with the same report (`resumed`).
    """
    ks = vault.keystore
    ks.check_usable()
    report: dict[str, Any] = {"path": vault.path, "backend": vault.backend, "resumed": False}
    steps: _PgSteps | None = None
    try:
        with HeldConnection(vault.loc) as held:
            schema = held.run(current_schema)
            held.run(vault.read_meta)  # no vault here: exit 3 before any lock
            assert schema is not None
            held.hold(admin_lock(held.conn, schema, vault.path))
            report["schema"] = schema
            steps = _PgSteps(vault, held)
            shredorder.keys_then_rows(steps, lambda meta: ks, report)
            folders = held.run(lambda conn: _drop_tables(conn, schema))
            report["tables_dropped"] = list(VAULT_TABLES)
            report["vacuumed"] = True
            created = steps.meta.get("schema_created")
            report["schema_dropped"], report["schema_kept_because"] = held.run(
                lambda conn: _drop_schema(conn, schema, created)
            )
    except Exception as exc:
        if steps is not None and steps.keys_touched:
            raise translate_after(
                exc,
                vault.loc,
                "the vault's keys are already destroyed (its rows can never be read again); "
                "fix that, then run `memvault shred` again to finish",
            ) from None
        if is_driver_error(exc):
            raise translate(exc, vault.loc) from None
        raise
    finally:
        vault.forget_keys()
    # A killed `export --force` of this vault may have left plaintext where it wrote.
    report["files_note"] = PG_SHRED_FILES_NOTE
    shredorder.finish(report, [], folders)
    return report


async def _drop_tables(conn: Any, schema: str) -> set[Path]:
    """Drop the vault's tables and guard; first, read where forced exports wrote."""
    async with conn.transaction():
        rows = []
        if await conn.fetchval("SELECT to_regclass('memvault_audit')") is not None:
            rows = await conn.fetch(
                "SELECT event, details FROM memvault_audit WHERE event = $1", exportdirs.EVENT
            )
        folders = exportdirs.recorded({"event": e, **json.loads(d)} for e, d in rows)
        for table in VAULT_TABLES:
            await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.execute(f"DROP FUNCTION IF EXISTS {_q(schema)}.memvault_guard()")
    return folders


async def _drop_schema(conn: Any, schema: str, created: str | None) -> tuple[bool, str | None]:
    """Drop the vault's schema if `memvault init` created it and nothing else is in it.

    The tables are gone already, so a refusal here (other objects, no privilege) keeps
    the schema and says why: the shred itself has succeeded.
    """
    if created != schema:
        return False, "memvault init did not create it"
    try:
        async with conn.transaction():
            await conn.execute(f"DROP SCHEMA {_q(schema)} RESTRICT")
    except Exception as exc:
        state = getattr(exc, "sqlstate", None)
        if state == "2BP01":  # dependent objects still exist
            return False, "it holds other objects"
        if state is None:
            raise
        return False, f"the server refused to drop it ({state})"
    return True, None
