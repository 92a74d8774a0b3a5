"""The PostgreSQL group's server: its URL, a schema per figure, rows copied in fast."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from collections.abc import Iterable
from typing import Any

from bench.data import chunked
from bench.workspace import CHUNK, seal_chunk, seal_init
from vault.keyjournal import entry_name
from vault.keys import KeyStore

PG_URL_VARS = ("MEMVAULT_BENCH_POSTGRES_URL", "MEMVAULT_TEST_POSTGRES_URL")
PG_WRITERS = (1, 2, 4, 8)

# A writer process for the throughput figure: one session of its own, one turn per
# add_items, as many as it can acknowledge between the "go" file and the deadline. The
# vault's session (PG_WRITER) or the bare SDK one over SQLAlchemy's default pool
# (PG_BARE_WRITER, its key on stdin, into a schema without the vault's guard).
_WRITER_ARGS = """
import asyncio, json, sys, time
from pathlib import Path
url, sid, ready, go, seconds, out, turn = sys.argv[1:8]
"""
_WRITER_LOOP = """
turn = json.loads(turn)
async def main():
    await session.add_items(turn)  # warm-up: imports, key, first connection
    Path(ready).touch()
    while not Path(go).exists():
        await asyncio.sleep(0.002)
    done, waits = 0, []
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        t = time.monotonic()
        await session.add_items(turn)
        waits.append(time.monotonic() - t)
        done += len(turn)
    Path(out).write_text(json.dumps({"items": done, "waits": waits}))
asyncio.run(main())
"""
PG_WRITER = (
    _WRITER_ARGS
    + """
import vault
session = vault.open_session(sid, url)
"""
    + _WRITER_LOOP
)
PG_BARE_WRITER = (
    _WRITER_ARGS
    + """
from agents.extensions.memory import EncryptedSession
from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
from sqlalchemy.ext.asyncio import create_async_engine
from vault.engines.postgres.url import parse
loc = parse(url)
engine = create_async_engine(
    loc.sqlalchemy_url, connect_args={"server_settings": loc.server_settings()}
)
session = EncryptedSession(
    session_id=sid,
    underlying_session=SQLAlchemySession(sid, engine=engine),
    encryption_key=sys.stdin.readline().strip(),
    ttl=30 * 86400,
)
"""
    + _WRITER_LOOP
)


def pg_url_from_env() -> str | None:
    for var in PG_URL_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


class PgSchemas:
    """Schemas of the benchmark's PostgreSQL server; each dropped (and its vault's keyring
    entries deleted) at the end."""

    def __init__(self, server: str) -> None:
        self.server = server.split("?", 1)[0]
        self.made: list[str] = []

    def url(self, name: str) -> str:
        schema = f"bench_{name}_{os.urandom(4).hex()}"
        self.made.append(schema)
        return f"{self.server}?schema={schema}"

    def sql(self, url: str, statement: str, *args: Any) -> list[Any]:
        import asyncpg

        from vault.engines.postgres.url import parse

        loc = parse(url)

        async def go() -> list[Any]:
            conn = await asyncpg.connect(loc.dsn, server_settings=loc.server_settings())
            try:
                return list(await conn.fetch(statement, *args))
            finally:
                await conn.close()

        return asyncio.run(go())

    def copy_rows(self, url: str, rows: Iterable[tuple[str, str]]) -> int:
        """(session_id, message_data) rows into the schema's SDK tables, with COPY (the
        vault's guard checks each row as it goes in)."""
        import asyncpg

        from vault.engines.postgres.url import parse

        loc = parse(url)

        async def go() -> int:
            conn = await asyncpg.connect(loc.dsn, server_settings=loc.server_settings())
            n = 0
            seen: set[str] = set()
            try:
                async with conn.transaction():
                    for batch in chunked(rows, 10_000):
                        new = {sid for sid, _ in batch} - seen
                        await conn.executemany(
                            "INSERT INTO agent_sessions (session_id) VALUES ($1) "
                            "ON CONFLICT DO NOTHING",
                            [(s,) for s in new],
                        )
                        seen |= new
                        await conn.copy_records_to_table(
                            "agent_messages", records=batch, columns=["session_id", "message_data"]
                        )
                        n += len(batch)
                await conn.execute("ANALYZE agent_messages")
            finally:
                await conn.close()
            return n

        return asyncio.run(go())

    def cleanup(self) -> None:
        ks = KeyStore()
        for schema in self.made:
            url = f"{self.server}?schema={schema}"
            with contextlib.suppress(Exception):
                if self.sql(url, "SELECT to_regclass('memvault_keys') IS NOT NULL")[0][0]:
                    vid = self.sql(url, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")
                    for (kid,) in self.sql(url, "SELECT kid FROM memvault_keys"):
                        ks.delete(entry_name(vid[0][0], kid))
            with contextlib.suppress(Exception):
                self.sql(self.server, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def pg_seal_rows(master: str, n: int, sessions: int, seed: int) -> list[tuple[str, str]]:
    """The rows build_big writes into a file, sealed under a PostgreSQL vault's key."""
    now = int(time.time())
    jobs = [(s, min(CHUNK, n - s), sessions, seed, now) for s in range(0, n, CHUNK)]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2, seal_init, (master,)) as pool:
        return [row for chunk in pool.imap(seal_chunk, jobs) for row in chunk]


def server_only(url: str) -> str:
    return url.split("?", 1)[0]
