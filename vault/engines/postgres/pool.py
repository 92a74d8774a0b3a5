"""The agent sessions' connection pools: one per event loop and vault location.

An asyncpg connection belongs to the event loop that opened it, so a pool serves one loop.
A session object still works from any loop (asyncio.run twice, a thread with a loop of its
own): each operation takes the pool of the loop it runs on. The sessions of one process
that use the same location on the same loop share its pool. A pool is disposed, its
connections closed, when its loop shuts down its async generators, which asyncio.run (and
asyncio.Runner) does before closing the loop. A loop closed without that step leaves its
pool's connections to the garbage collector (once another loop opens a pool), which
closes their sockets; the server then ends them.

A read's checkout first reads the vault's kid and TTL on the connection it hands out (one
statement, in the transaction the operation then runs in), so a `memvault ttl`, `rotate`
or `revoke` run on any host reaches a session's next read, as it did when every
operation opened a connection. That read also finds a pooled connection the server has
dropped (a restart, pg_terminate_backend): the pool replaces it and the read goes on.

A write (`writing()`) skips that statement: the guard trigger reads the kid in the
write's own transaction and refuses a retired or revoked one, and a write uses no TTL.
A pooled connection the server dropped then fails the write's first statement instead;
`writing()` records whether the write had reached its COMMIT, so the session retries it
on a new connection only when nothing can have been stored.

Only vault.engines.postgres.session imports this module (it imports `sqlalchemy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from vault.engines.postgres.conn import CONNECT_TIMEOUT

# Where a checkout leaves its read of the meta: the pool record's info, which is also the
# `Connection.info` of the operation that checked the connection out.
META = "memvault_meta"
ON_META = "memvault_on_meta"
META_SQL = "SELECT key, value FROM memvault_meta WHERE key IN ('ttl_seconds', 'kid')"
# Connections kept open per pool between operations; a burst beyond that opens more
# (closed when returned) rather than waiting, as when each operation connected.
POOL_SIZE = 5

Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Write:
    """One write attempt's state, as its connection's events record it."""

    committing: bool = False  # the COMMIT was sent: whether it took effect is unknown


# Set for a write's attempt on its task; SQLAlchemy's greenlets run the pool's events in
# a copy of the task's context, so the events see it.
_write: ContextVar[Write | None] = ContextVar("memvault_write", default=None)


@contextlib.contextmanager
def writing() -> Iterator[Write]:
    """Run one write attempt: its checkout reads no meta, and its COMMIT is recorded."""
    attempt = Write()
    token = _write.set(attempt)
    try:
        yield attempt
    finally:
        _write.reset(token)


class _LoopPools:
    """The pools of one event loop, and the async generator that closes them at its end."""

    def __init__(self) -> None:
        self.engines: dict[Key, AsyncEngine] = {}
        self.closed = False
        self.closer: Any = None


_guard = threading.Lock()  # threads, each with a loop of its own, share the registry
_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPools] = (
    weakref.WeakKeyDictionary()
)
_templates: dict[Key, AsyncEngine] = {}


def _key(url: str, settings: dict[str, str]) -> Key:
    return url, tuple(sorted(settings.items()))


def template(url: str, settings: dict[str, str]) -> AsyncEngine:
    """An engine that never connects: the SDK's session reads its dialect, nothing more."""
    key = _key(url, settings)
    with _guard:
        if key not in _templates:
            _templates[key] = create_async_engine(url, poolclass=NullPool)
        return _templates[key]


def engine_for(url: str, settings: dict[str, str]) -> AsyncEngine:
    """The pooled engine of the running event loop for this location."""
    loop = asyncio.get_running_loop()
    key = _key(url, settings)
    with _guard:
        pools = _loops.get(loop)
        if pools is None or pools.closed:
            # Loops closed without shutting down their async generators keep their pools
            # (the closer holds the loop): let the garbage collector have them.
            for gone in [other for other in _loops if other.is_closed()]:
                del _loops[gone]
            pools = _loops[loop] = _LoopPools()
            pools.closer = _close_at_loop_end(pools)
            _start(pools.closer)
        engine = pools.engines.get(key)
        if engine is None:
            engine = pools.engines[key] = _pooled_engine(url, settings)
        return engine


def _start(closer: Any) -> None:
    # Creating the first step of an async generator registers it with the running loop
    # (its first-iteration hook), which closes it in shutdown_asyncgens(); running that step
    # here, synchronously (the body awaits nothing before its yield), enters the `try`
    # whose `finally` then disposes the pools. The SDK asks for a session factory
    # synchronously, so there is no coroutine here to await it from.
    step = closer.__anext__()
    with contextlib.suppress(StopIteration):
        step.send(None)


async def _close_at_loop_end(pools: _LoopPools) -> AsyncIterator[None]:
    try:
        yield
    finally:
        with _guard:
            pools.closed = True
            engines = list(pools.engines.values())
        for engine in engines:
            with contextlib.suppress(Exception):  # a server gone meanwhile: nothing to close
                await engine.dispose()


def _pooled_engine(url: str, settings: dict[str, str]) -> AsyncEngine:
    engine = create_async_engine(
        url,
        pool_size=POOL_SIZE,
        max_overflow=-1,
        connect_args={"server_settings": settings, "timeout": CONNECT_TIMEOUT},
    )
    dialect = engine.dialect

    def read_meta(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        record.info[META] = None
        if _write.get() is not None:
            return  # the guard checks the kid in the write's own transaction
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(META_SQL)
            record.info[META] = dict(cursor.fetchall())
        except Exception as exc:
            # asyncpg's dialect answers from the connection itself, whatever `exc` is.
            if dialect.is_disconnect(exc, dbapi_connection, cursor):  # type: ignore[arg-type]
                # The pool drops this connection and checks out another (a new one).
                raise DisconnectionError(str(exc)) from exc
            # No vault there any more: the operation itself reports it, translated.
            dbapi_connection.rollback()
        finally:
            cursor.close()

    def mark_commit(_connection: Any) -> None:
        attempt = _write.get()
        if attempt is not None:
            attempt.committing = True

    event.listen(engine.sync_engine.pool, "checkout", read_meta)
    event.listen(engine.sync_engine, "commit", mark_commit)
    return engine


class MetaSession(Session):
    """The ORM session of one operation: hands its checkout's meta read to the vault
    session that runs the operation (`info[ON_META]`)."""


@event.listens_for(MetaSession, "after_begin")
def _deliver_meta(session: Session, _transaction: Any, connection: Any) -> None:
    on_meta: Callable[[dict[str, str] | None], None] | None = session.info.get(ON_META)
    if on_meta is not None:
        on_meta(connection.info.get(META))
