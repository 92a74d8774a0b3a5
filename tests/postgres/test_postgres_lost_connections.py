"""Connections the PostgreSQL server ends (a restart, a failover, pg_terminate_backend):
what a command then says, and how the tests end one vault's connection without ending
another's (the test workers share one server).

Run with `scripts/with-postgres scripts/test -q -m postgres
tests/postgres/test_postgres_lost_connections.py`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from tests.conftest import run_cli
from tests.pgserver import MARKS, SERVER_URL, end_lock_holders, password

pytestmark = MARKS
ADVISORY = "SELECT pg_advisory_lock(hashtext($1), hashtext($2))"
ADVISORY_XACT = "SELECT pg_advisory_xact_lock(hashtext($1), hashtext($2))"


def test_ending_one_vaults_lock_holder_spares_the_connections_of_other_vaults(
    pg_url: str,
) -> None:
    """Another worker's connection holding its own vault's locks (an init's migration lock,
    a rotation's admin lock) stays up when a test ends this vault's rotation backend;
    ended, it failed that worker's fixture with asyncpg's "connection is closed"."""
    import asyncpg

    from vault.engines.postgres.lock import ADMIN_LOCK
    from vault.engines.postgres.schema import MIGRATION_LOCK
    from vault.engines.postgres.url import parse

    mine = parse(pg_url)
    other = parse(f"{SERVER_URL}?schema=t_other_{secrets.token_hex(6)}")

    async def go() -> tuple[list[int], int, Any]:
        rotation = await asyncpg.connect(mine.dsn)
        elsewhere = await asyncpg.connect(other.dsn)
        try:
            await rotation.execute(ADVISORY, ADMIN_LOCK, mine.schema)
            async with elsewhere.transaction():
                await elsewhere.execute(ADVISORY_XACT, MIGRATION_LOCK, other.schema)
                await elsewhere.execute(ADVISORY, ADMIN_LOCK, other.schema)
                ended = await asyncio.to_thread(end_lock_holders, pg_url, ADMIN_LOCK)
                answer = await elsewhere.fetchval("SELECT 1")
            return ended, rotation.get_server_pid(), answer
        finally:
            rotation.terminate()
            await elsewhere.close()

    ended, rotation_pid, answer = asyncio.run(go())
    assert ended == [rotation_pid]
    assert answer == 1


def test_an_init_whose_connection_the_server_ends_says_it_was_lost_and_leaves_no_vault(
    pg_url: str,
) -> None:
    """The server ends init's connection while init waits for its schema's lock: one line
    saying the connection was lost and to run the command again, not the driver's
    InterfaceError (which the transaction's rollback raised over the real error); no
    vault left behind."""
    import asyncpg

    from vault.engines.postgres.schema import MIGRATION_LOCK
    from vault.engines.postgres.url import parse

    loc = parse(pg_url)

    async def go() -> tuple[Any, list[int]]:
        holder = await asyncpg.connect(loc.dsn)
        try:
            async with holder.transaction():
                await holder.execute(ADVISORY_XACT, MIGRATION_LOCK, loc.schema)
                init = asyncio.ensure_future(asyncio.to_thread(run_cli, "--db", pg_url, "init"))
                ended: list[int] = []
                deadline = time.monotonic() + 120
                while not ended and not init.done() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    ended = await asyncio.to_thread(
                        end_lock_holders, pg_url, MIGRATION_LOCK, waiting=True
                    )
                return await init, ended
        finally:
            await holder.close()

    r, ended = asyncio.run(go())
    assert len(ended) == 1, r
    assert r.code == 1, r
    assert len(r.err.strip().splitlines()) == 1, r.err
    assert "lost the connection" in r.err and "run the command again" in r.err, r.err
    assert "InterfaceError" not in r.err and "Traceback" not in r.err, r.err
    assert password() not in r.err + r.out
    assert run_cli("--db", pg_url, "status").code == 3
