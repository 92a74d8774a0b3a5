"""The PostgreSQL test server: its URL, the marks of every test that needs it, and SQL.

`scripts/with-postgres` starts a throwaway server and sets MEMVAULT_TEST_POSTGRES_URL.
Without it every test marked with `MARKS` is skipped with that reason (and `-m
postgres` alone is refused by conftest, so it cannot pass green on zero tests). The
fixtures `pg_url` (a fresh schema per test, dropped afterwards) and `pg_vault` live
in conftest.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

URL_VAR = "MEMVAULT_TEST_POSTGRES_URL"
SERVER_URL = os.environ.get(URL_VAR, "")
MARKS = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        not SERVER_URL,
        reason=f"needs a PostgreSQL server: run scripts/with-postgres scripts/test -m postgres "
        f"(or set {URL_VAR})",
    ),
]


def password() -> str:
    from vault.engines.postgres.url import parse

    base = parse(SERVER_URL).dsn.split("://", 1)[1].split("@", 1)[0]
    assert ":" in base, "the test server's URL must carry a password (redaction is tested)"
    return base.split(":", 1)[1]


def sql(url: str, *statements: str, args: tuple[Any, ...] = ()) -> list[Any]:
    """Run statements on a plain connection into the URL's schema; the last one's rows."""
    import asyncpg

    from vault.engines.postgres.url import parse

    loc = parse(url)

    async def go() -> list[Any]:
        conn = await asyncpg.connect(loc.dsn, server_settings=loc.server_settings())
        try:
            rows: list[Any] = []
            for i, statement in enumerate(statements):
                last = i == len(statements) - 1
                rows = await conn.fetch(statement, *(args if last else ()))
            return rows
        finally:
            await conn.close()

    return asyncio.run(go())


def end_lock_holders(url: str, lock: str, *, waiting: bool = False) -> list[Any]:
    """End the backends holding advisory lock `lock` of the URL's vault (or, `waiting`,
    those waiting for it), as a restart, a failover or an idle-session killer would: the
    pids ended.

    Only this vault's lock (keyed by the lock's name and the URL's schema, as
    vault.engines.postgres.lock and schema take them): the test workers share the server,
    and ending every holder of any advisory lock also ended another worker's connection
    mid-init (its migration lock held), which then failed its fixture.
    """
    from vault.engines.postgres.url import parse

    rows = sql(
        url,
        "SELECT pid, pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND objsubid = 2 AND classid = hashtext($1)::oid AND objid = hashtext($2)::oid "
        "AND granted = $3 AND pid <> pg_backend_pid()",
        args=(lock, parse(url).schema, not waiting),
    )
    return [r["pid"] for r in rows]


def insert_sealed(url: str, session_id: str, contents: list[str], at: int | None) -> None:
    """Items sealed with the vault's key at a chosen Fernet time, inserted with SQL."""
    from vault.engines.postgres.vault import PgVault

    sealer = PgVault.open(url).sealer()
    sql(
        url,
        "INSERT INTO agent_sessions (session_id) VALUES ($1) ON CONFLICT DO NOTHING",
        args=(session_id,),
    )
    for c in contents:
        sql(
            url,
            "INSERT INTO agent_messages (session_id, message_data) VALUES ($1, $2)",
            args=(session_id, sealer.seal(session_id, {"role": "user", "content": c}, at)),
        )


def raw_kids(url: str) -> list[str | None]:
    from vault.engines.postgres.rotate import kid_of

    return [kid_of(r["message_data"]) for r in sql(url, "SELECT * FROM agent_messages ORDER BY id")]


def entries_left(url: str) -> dict[str, bool]:
    """Each key version the journal records: whether its keyring entry still exists."""
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    ks = KeyStore()
    vault_id = sql(url, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")[0]["value"]
    return {
        r["kid"]: ks.get(entry_name(vault_id, r["kid"])) is not None
        for r in sql(url, "SELECT kid FROM memvault_keys")
    }


def bulk_insert(url: str, texts: list[tuple[str, str]]) -> None:
    """(session id, text) items sealed under the vault's key and copied in with COPY, in
    one transaction (the guard checks each row); their sessions are made as needed."""
    import asyncpg

    from vault.engines.postgres.url import parse
    from vault.engines.postgres.vault import PgVault

    sealer = PgVault.open(url).sealer()
    records = [(sid, sealer.seal(sid, {"role": "user", "content": t})) for sid, t in texts]
    loc = parse(url)

    async def go() -> None:
        conn = await asyncpg.connect(loc.dsn, server_settings=loc.server_settings())
        try:
            async with conn.transaction():
                await conn.executemany(
                    "INSERT INTO agent_sessions (session_id) VALUES ($1) ON CONFLICT DO NOTHING",
                    [(sid,) for sid in dict.fromkeys(sid for sid, _ in texts)],
                )
                await conn.copy_records_to_table(
                    "agent_messages", records=records, columns=["session_id", "message_data"]
                )
        finally:
            await conn.close()

    asyncio.run(go())
