"""A PostgreSQL vault's format: the same tables as a vault file, a PL/pgSQL guard, migrations.

The SDK's own `agent_sessions` / `agent_messages`, with the DDL its
`SQLAlchemySession(create_tables=True)` emits on PostgreSQL (so the SDK uses the
tables as its own), plus `memvault_meta`, `memvault_audit`, `memvault_keys` and
`memvault_migrations`, all in the URL's `?schema=` when it names one. The guard
trigger refuses what the SQLite triggers refuse (vault.engines.sqlite.schema): any row that is
not an envelope under the current kid. Migrations are applied once each, in
order, under a transaction-scoped advisory lock, and recorded by name.
"""

from __future__ import annotations

import json
from typing import Any

from vault import keyjournal
from vault.engines.sqlite.schema import (
    AUDIT_COLUMNS,
    BACKUP_COLUMNS,
    FORMAT,
    GUARD_MESSAGE,
    KEY_COLUMNS,
    KEY_STATES_SQL,
    MESSAGES_TABLE,
    PREVIOUS_FORMAT,
    ROTATION_LOGGED,
    SESSIONS_TABLE,
    utcnow,
)
from vault.engines.sqlite.schema import last_rotation as _last_rotation

# The guard's SQLSTATE: check_violation, so that SQLAlchemy reports it as an IntegrityError
# (as sqlite3 reports the SQLite trigger's refusal), and the session retries it alike.
GUARD_SQLSTATE = "23514"
# pg_advisory_xact_lock key for schema changes (init, migrations) of one schema.
MIGRATION_LOCK = "memvault-migrate"


def _q(name: str) -> str:
    """A quoted SQL identifier (schema names are checked as plain names already)."""
    return '"' + name.replace('"', '""') + '"'


def _sdk_tables(schema: str) -> list[str]:
    # What SQLAlchemy's create_all emits for the SDK's metadata on PostgreSQL.
    return [
        f"""CREATE TABLE {SESSIONS_TABLE} (
                session_id VARCHAR NOT NULL,
                created_at TIMESTAMP WITHOUT TIME ZONE DEFAULT CURRENT_TIMESTAMP NOT NULL,
                updated_at TIMESTAMP WITHOUT TIME ZONE DEFAULT CURRENT_TIMESTAMP NOT NULL,
                PRIMARY KEY (session_id)
            )""",
        f"""CREATE TABLE {MESSAGES_TABLE} (
                id SERIAL NOT NULL,
                session_id VARCHAR NOT NULL,
                message_data TEXT NOT NULL,
                created_at TIMESTAMP WITHOUT TIME ZONE DEFAULT CURRENT_TIMESTAMP NOT NULL,
                PRIMARY KEY (id),
                FOREIGN KEY (session_id) REFERENCES {SESSIONS_TABLE} (session_id)
                    ON DELETE CASCADE
            )""",
        f"CREATE INDEX idx_{MESSAGES_TABLE}_session_time ON {MESSAGES_TABLE} "
        "(session_id, created_at)",
    ]


def _meta(schema: str) -> list[str]:
    return ["CREATE TABLE memvault_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"]


def _guard_function(schema: str, extra_check: str = "") -> str:
    # Anything that is not a 4-member envelope object {__enc__: 1, v, kid, payload: "gAAAAA..."}
    # whose kid is the meta's current one is refused, plaintext from a bare
    # SQLAlchemySession and a writer still holding a retired key alike. The meta is
    # named with its schema: the trigger must not depend on the writer's search_path.
    message = GUARD_MESSAGE.replace("'", "''")
    return f"""CREATE OR REPLACE FUNCTION {_q(schema)}.memvault_guard() RETURNS trigger
            LANGUAGE plpgsql AS $guard$
            DECLARE
                env jsonb;
                members bigint;
                current_kid text;
            BEGIN
                BEGIN
                    env := NEW.message_data::jsonb;
                    -- Counted on json, which keeps a label given twice; jsonb keeps
                    -- only its last value.
                    IF jsonb_typeof(env) = 'object' THEN
                        members := (SELECT count(*) FROM json_object_keys(NEW.message_data::json));
                    END IF;
                EXCEPTION WHEN others THEN
                    env := NULL;
                END;
                SELECT value INTO current_kid FROM {_q(schema)}.memvault_meta
                    WHERE key = 'kid';
                IF env IS NULL
                    OR jsonb_typeof(env) IS DISTINCT FROM 'object'
                    OR env -> '__enc__' IS DISTINCT FROM '1'::jsonb
                    OR jsonb_typeof(env -> 'payload') IS DISTINCT FROM 'string'
                    OR left(env ->> 'payload', 6) IS DISTINCT FROM 'gAAAAA'
                    OR env ->> 'kid' IS DISTINCT FROM current_kid{extra_check}
                    OR members IS DISTINCT FROM 4
                THEN
                    RAISE EXCEPTION USING MESSAGE = '{message}', ERRCODE = '{GUARD_SQLSTATE}';
                END IF;
                RETURN NEW;
            END
            $guard$"""


def _guard(schema: str) -> list[str]:
    return [
        _guard_function(schema),
        f"""CREATE TRIGGER memvault_guard
            BEFORE INSERT OR UPDATE OF message_data ON {MESSAGES_TABLE}
            FOR EACH ROW EXECUTE FUNCTION {_q(schema)}.memvault_guard()""",
    ]


# m003's function let any fourth member through in place of `v` (plaintext under
# "content" had the right count): the envelope's `v` must be there, a number.
_V_CHECK = """
                    OR jsonb_typeof(env -> 'v') IS DISTINCT FROM 'number'"""


def guard_function(schema: str) -> str:
    """The guard function as the latest migration creates it (verify compares with it)."""
    return _guard_function(schema, _V_CHECK)


def _guard_requires_v(schema: str) -> list[str]:
    return [guard_function(schema)]


# m006's function counted members on jsonb, which keeps only the last of a label given
# twice: {"payload": "plaintext", ..., "payload": "gAAAAA..."} counted four and got in.
# The function now counts on json; this step puts it into vaults made before.
_guard_counts_json_members = _guard_requires_v


def _audit(schema: str) -> list[str]:
    # Events and counts only: never content, never a session's items.
    return [
        f"""CREATE TABLE memvault_audit (
               id BIGSERIAL PRIMARY KEY,
               {AUDIT_COLUMNS}
           )"""
    ]


def _key_versions(schema: str) -> list[str]:
    # The journal of every key version (vault.keyjournal); `seq` orders it as SQLite's rowid.
    return [
        f"""CREATE TABLE memvault_keys (
               seq BIGSERIAL,
               {KEY_COLUMNS}
           )"""
    ]


def _retained_keys_and_backups(schema: str) -> list[str]:
    # engines.sqlite.schema's m009: the `retained` state, the backups' records, the format bump.
    return [
        "ALTER TABLE memvault_keys DROP CONSTRAINT IF EXISTS memvault_keys_state_check",
        f"ALTER TABLE memvault_keys ADD CONSTRAINT memvault_keys_state_check "
        f"CHECK (state IN ({KEY_STATES_SQL}))",
        f"""CREATE TABLE memvault_backups (
               seq BIGSERIAL,
               {BACKUP_COLUMNS}
           )""",
        f"UPDATE memvault_meta SET value = '{FORMAT}' "
        f"WHERE key = 'format' AND value = '{PREVIOUS_FORMAT}'",
    ]


# Applied in this order, each recorded once by name (names as in engines.sqlite.schema where the
# step is the same).
MIGRATIONS = [
    ("m001_sdk_tables", _sdk_tables),
    ("m002_meta", _meta),
    ("m003_guard_triggers", _guard),
    ("m004_audit", _audit),
    ("m005_key_versions", _key_versions),
    ("m006_guard_requires_v", _guard_requires_v),
    ("m007_guard_counts_json_members", _guard_counts_json_members),
    ("m009_retained_keys_and_backups", _retained_keys_and_backups),
]


async def current_schema(conn: Any) -> str | None:
    """The schema new tables go to (the URL's, or the server's default); None: none exists."""
    value: str | None = await conn.fetchval("SELECT current_schema()")
    return value


async def lock_schema_changes(conn: Any, schema: str) -> None:
    """Serialise init and migrations of one schema (held until the transaction ends)."""
    await conn.execute(
        "SELECT pg_advisory_xact_lock(hashtext($1), hashtext($2))", MIGRATION_LOCK, schema
    )


async def migrate(conn: Any, schema: str) -> list[str]:
    """Apply the migrations not yet recorded; the caller holds a transaction and the lock."""
    await conn.execute(
        "CREATE TABLE IF NOT EXISTS memvault_migrations "
        "(name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)"
    )
    done = {r[0] for r in await conn.fetch("SELECT name FROM memvault_migrations")}
    applied = []
    for name, ddl in MIGRATIONS:
        if name in done:
            continue
        for statement in ddl(schema):
            await conn.execute(statement)
        await conn.execute(
            "INSERT INTO memvault_migrations (name, applied_at) VALUES ($1, $2)", name, utcnow()
        )
        applied.append(name)
    return applied


async def needs_migration(conn: Any) -> bool:
    done = {r[0] for r in await conn.fetch("SELECT name FROM memvault_migrations")}
    return any(name not in done for name, _ in MIGRATIONS)


# An item's Fernet timestamp read from its envelope in SQL, unauthenticated (as
# engines.sqlite.schema.ITEM_TIME): characters 2-12 of the token are the version byte's tail and
# the 8-byte big-endian time; NULL for a row without a clean token head.
_TOKEN_AT = "strpos(message_data, '\"gAAAAA')"
_HEAD12 = f"substr(message_data, {_TOKEN_AT} + 1, 12)"
ITEM_TIME = (
    f"(CASE WHEN {_TOKEN_AT} > 0 AND {_HEAD12} ~ '^[A-Za-z0-9_-]{{12}}$' THEN "
    f"('x' || encode(substring(decode(translate({_HEAD12}, '-_', '+/'), 'base64') "
    "FROM 2 FOR 8), 'hex'))::bit(64)::bigint END)"
)


async def audit(conn: Any, event: str, kid: str | None, **details: Any) -> None:
    """Append an audit event inside the caller's transaction: counts only, never content."""
    await conn.execute(
        "INSERT INTO memvault_audit (at, event, kid, details) VALUES ($1, $2, $3, $4)",
        utcnow(),
        event,
        kid,
        json.dumps(details, sort_keys=True),
    )


async def set_meta(conn: Any, **values: str) -> None:
    """Set meta rows, inserting those not there yet (VaultFile's set_meta's twin)."""
    await conn.executemany(
        "INSERT INTO memvault_meta (key, value) VALUES ($1, $2) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        list(values.items()),
    )


async def record_key(conn: Any, kid: str, state: str) -> None:
    """Set one key version's state in the journal (vault.keyjournal.record's twin)."""
    assert state in keyjournal.STATES
    now = utcnow()
    await conn.execute(
        "INSERT INTO memvault_keys (kid, state, created_at, changed_at) VALUES ($1, $2, $3, $3) "
        "ON CONFLICT (kid) DO UPDATE SET state = excluded.state, changed_at = excluded.changed_at",
        kid,
        state,
        now,
    )


async def last_rotation(conn: Any, meta: dict[str, str]) -> str | None:
    """`rotated_at`, or None for a vault never rotated (engines.sqlite.schema.last_rotation)."""
    return _last_rotation(meta, await conn.fetchval(ROTATION_LOGGED) is not None)
