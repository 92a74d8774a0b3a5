"""Connections the PostgreSQL server ends (a restart, a failover, pg_terminate_backend):
what a command then says, and how the tests end one vault's connection without ending
another's (the test workers share one server).

Run with `scripts/with-postgres scripts/test -q -m postgres
tests/postgres/test_postgres_lost_connections.py`.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from tests.pgserver import MARKS, SERVER_URL, end_lock_holders

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
