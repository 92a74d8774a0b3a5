"""`memvault init` on a URL: the tables, the guard and a random master key in a schema.

Refuses a schema that already holds a vault or the SDK's tables (VaultExists). The key
goes into the keyring first: a failure after it deletes that entry again (or the transit
key that init created), so there is never a vault without its key.
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar

from vault import crypto, durations
from vault.engines.postgres import schema as pgschema
from vault.engines.postgres.base import PgVaultBase
from vault.engines.postgres.schema import audit, record_key
from vault.engines.postgres.url import parse
from vault.engines.sqlite.schema import FORMAT, MESSAGES_TABLE, SESSIONS_TABLE, utcnow
from vault.errors import OperationFailed, VaultError, VaultExists
from vault.keyjournal import CURRENT
from vault.keys import KeyStore
from vault.keysource.store import TransitStore, stage_first_key, unstage_first_key
from vault.vaultops import new_identity, new_meta

V = TypeVar("V", bound=PgVaultBase)  # PgVault, which calls this: no import circle


def create(cls: type[V], url: str, ttl: int | None, keystore: KeyStore | None) -> V:
    """Create the tables and a random master key; refuse if a vault or the SDK's tables
    are already there."""
    vault = cls(parse(url), keystore)
    ks = vault.keystore
    key, kid, vault_id = new_identity(ks)

    async def build(conn: Any) -> None:
        created = None
        if vault.loc.schema:
            # Shred drops only a schema init created, never one a DBA (or the server) made.
            if not await conn.fetchval(
                "SELECT 1 FROM pg_namespace WHERE nspname = $1", vault.loc.schema
            ):
                created = vault.loc.schema
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {pgschema._q(vault.loc.schema)}")
        await vault.refuse_unusable_schema(conn)
        schema = await pgschema.current_schema(conn)
        if schema is None:
            raise OperationFailed(
                f"{vault.path} has no schema to create the vault in (the search_path "
                "names none that exists); add ?schema=NAME to the URL"
            )
        await pgschema.lock_schema_changes(conn, schema)
        if await conn.fetchval("SELECT to_regclass('memvault_meta')") is not None:
            raise VaultExists(
                f"a vault already exists in schema {schema!r} of {vault.path}; nothing was "
                "changed (`memvault status` describes it)"
            )
        for table in (SESSIONS_TABLE, MESSAGES_TABLE):
            if await conn.fetchval("SELECT to_regclass($1)", table) is not None:
                raise VaultExists(
                    f"schema {schema!r} of {vault.path} already has a {table} table that "
                    "is not a memvault vault's; memvault will not take it over; give the "
                    "vault a schema of its own with ?schema=NAME"
                )
        # The key goes in first: a failure after it leaves an unused keyring entry
        # (deleted below), never a vault without its key.
        rows = stage_first_key(ks, vault_id, kid, key)  # a transit key: wrapped, for meta
        await pgschema.migrate(conn, schema)
        meta = {**new_meta(FORMAT, vault_id, kid, ttl, utcnow()), **rows}
        if created:
            meta["schema_created"] = created
        await conn.executemany(
            "INSERT INTO memvault_meta (key, value) VALUES ($1, $2)", list(meta.items())
        )
        await record_key(conn, kid, CURRENT)
        await audit(conn, "init", kid, ttl=durations.format_duration(ttl))

    try:
        vault.run(build, write=True)
    except BaseException:
        with contextlib.suppress(VaultError):
            unstage_first_key(ks, vault_id, kid)
        raise
    if isinstance(ks, TransitStore):
        vault = cls(parse(url), None)  # its store is read from its meta, bound to it
    vault._sealer = crypto.Sealer(key)
    return vault
