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
from typing import TYPE_CHECKING, Any

from vault import exportdirs, keyjournal, testhooks
from vault.engines.postgres.admin import kids_in_use, known_kids, locked, set_meta
from vault.engines.postgres.conn import translate_after
from vault.engines.postgres.schema import _q, record_key
from vault.engines.sqlite.schema import MESSAGES_TABLE, SESSIONS_TABLE, utcnow
from vault.engines.sqlite.shred import SHRED_FIELDS
from vault.keyjournal import DESTROYED
from vault.keysource.store import revoke_source

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


def shred(vault: PgVault) -> dict[str, Any]:
    """Destroy a PostgreSQL vault: lock, key, rows (then VACUUM), tables, schema.

    Works without the key (revoked, or this keyring never had it). What was destroyed
    is recorded in the meta before the rows go, so a shred cut off is finished by the
    next run with the same report (`resumed`).
    """
    ks = vault.keystore
    ks.check_usable()
    report: dict[str, Any] = {"path": vault.path, "backend": vault.backend, "resumed": False}

    async def body(conn: Any, schema: str) -> dict[str, Any]:
        report["schema"] = schema
        async with conn.transaction():
            meta = await vault.read_meta(conn)
            vault_id = meta["vault_id"]
            kid = meta.get("revoked_kid", meta["kid"])
            report["vault_id"], report["kid"] = vault_id, kid
            created = meta.get("schema_created")
            if "shred_started" in meta:
                report.update(json.loads(meta["shred_started"]))
                report["resumed"] = True
            else:
                report["sessions"] = await conn.fetchval(
                    f"SELECT count(*) FROM (SELECT session_id FROM {SESSIONS_TABLE} UNION "
                    f"SELECT session_id FROM {MESSAGES_TABLE}) AS s"
                )
                report["items"] = await conn.fetchval(f"SELECT count(*) FROM {MESSAGES_TABLE}")
                for k in SHRED_FIELDS[4:]:
                    report[k] = None
                # The guard refuses every write from here on (the kid is no envelope's).
                marks = {} if "revoked_at" in meta else {"revoked_at": utcnow(), "revoked_kid": kid}
                await set_meta(
                    conn,
                    kid="revoked",
                    shred_started=json.dumps({k: report[k] for k in SHRED_FIELDS}),
                    **marks,
                )
            kids = await known_kids(conn, meta)
            in_use = await kids_in_use(conn, kid, meta)
        testhooks.failpoint("pg-shred-after-mark")
        outcome = keyjournal.destroy_entries(ks, vault_id, kids, in_use)
        if report.get("key_destroyed") is None or outcome["key_destroyed"]:
            # A resumed run keeps what the first one destroyed, adding what it finds now.
            before = set(report.get("destroyed_kids") or [])
            outcome["destroyed_kids"] = sorted(before | set(outcome["destroyed_kids"]))
            outcome["other_copies_kids"] = sorted(
                set(report.get("other_copies_kids") or []) | set(outcome["other_copies_kids"])
            )
            outcome["key_destroyed"] = bool(outcome["destroyed_kids"])
            report.update(outcome)
        report.update(revoke_source(ks))  # a transit vault's key: no copy unwraps any more
        try:
            async with conn.transaction():
                for k in sorted(kids):
                    await record_key(conn, k, DESTROYED)
                await set_meta(conn, shred_started=json.dumps({k: report[k] for k in SHRED_FIELDS}))
            testhooks.failpoint("pg-shred-after-keys")
            async with conn.transaction():
                await conn.execute(f"DELETE FROM {MESSAGES_TABLE}")
                await conn.execute(f"DELETE FROM {SESSIONS_TABLE}")
            await conn.execute(f"VACUUM {MESSAGES_TABLE}, {SESSIONS_TABLE}")
            testhooks.failpoint("pg-shred-after-vacuum")
            async with conn.transaction():
                # The audit trail goes with the tables: first, where forced exports wrote.
                rows = []
                if await conn.fetchval("SELECT to_regclass('memvault_audit')") is not None:
                    rows = await conn.fetch(
                        "SELECT event, details FROM memvault_audit WHERE event = $1",
                        exportdirs.EVENT,
                    )
                folders = exportdirs.recorded({"event": e, **json.loads(d)} for e, d in rows)
                for table in VAULT_TABLES:
                    await conn.execute(f"DROP TABLE IF EXISTS {table}")
                await conn.execute(f"DROP FUNCTION IF EXISTS {_q(schema)}.memvault_guard()")
            report["tables_dropped"] = list(VAULT_TABLES)
            report["vacuumed"] = True
            report["schema_dropped"], report["schema_kept_because"] = await _drop_schema(
                conn, schema, created
            )
        except Exception as exc:
            raise translate_after(
                exc,
                vault.loc,
                "the vault's keys are already destroyed (its rows can never be read again); "
                "fix that, then run `memvault shred` again to finish",
            ) from None
        # A killed `export --force` of this vault may have left plaintext where it wrote.
        report["files"] = exportdirs.clean(folders)
        report["files_note"] = PG_SHRED_FILES_NOTE
        report["at"] = utcnow()
        return report

    try:
        return locked(vault, body)
    finally:
        vault.forget_keys()


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
