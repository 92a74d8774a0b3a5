"""The one advisory lock of a PostgreSQL vault's long admin operations.

`rotate`, `purge`, `restore`, `revoke` and `shred` each hold it for their whole run, on the
connection they work on, so only one of them runs at a time across every host
using the vault (one lock per schema: one vault per schema). A second one waits
up to MEMVAULT_LOCK_TIMEOUT, then stops with exit 5, changing nothing. Agents and
the other commands never take it: they go on during a rotation or a purge.

A session-level lock (not a transaction one): those operations commit in batches,
and the lock must outlive each batch. The server releases it if the process dies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from vault import testhooks
from vault.engines.postgres.schema import current_schema
from vault.engines.sqlite.db import lock_timeout
from vault.errors import VaultBusy

if TYPE_CHECKING:
    from vault.engines.postgres.base import PgVaultBase

T = TypeVar("T")

ADMIN_LOCK = "memvault-admin"
OPERATIONS = "rotation, purge, restore, revoke or shred"


@asynccontextmanager
async def admin_lock(conn: Any, schema: str, where: str) -> AsyncIterator[None]:
    """Hold the vault's admin lock on `conn` for the body; VaultBusy past the timeout."""
    deadline = time.monotonic() + lock_timeout()
    while not await conn.fetchval(
        "SELECT pg_try_advisory_lock(hashtext($1), hashtext($2))", ADMIN_LOCK, schema
    ):
        if time.monotonic() >= deadline:
            raise VaultBusy(
                f"another {OPERATIONS} of {where} is running; nothing was changed; wait for "
                "it to finish, or raise MEMVAULT_LOCK_TIMEOUT (seconds)"
            )
        await asyncio.sleep(0.2)
    try:
        testhooks.failpoint("pg-admin-locked")
        yield
    finally:
        if not conn.is_closed():
            await conn.execute(
                "SELECT pg_advisory_unlock(hashtext($1), hashtext($2))", ADMIN_LOCK, schema
            )


def locked(vault: PgVaultBase, body: Callable[[Any, str], Awaitable[T]]) -> T:
    """`body(conn, schema)` on one connection holding the admin lock (no vault: exit 3
    before any lock is taken)."""

    async def go() -> T:
        conn = await vault.connect()
        try:
            schema = await current_schema(conn)
            await vault.read_meta(conn)
            assert schema is not None
            async with admin_lock(conn, schema, vault.path):
                return await body(conn, schema)
        finally:
            await conn.close()

    return vault.call(go)
