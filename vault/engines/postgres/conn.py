"""Connections to a PostgreSQL vault: the driver, one event loop per call, error translation.

asyncpg is imported only here, inside `require_driver`, and only when a URL is
used; without the `postgres` extra a URL gets one line saying how to install it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from vault.engines.postgres import schema as pgschema
from vault.engines.postgres.url import INSTALL_HINT, PgLocation
from vault.engines.sqlite.db import lock_timeout
from vault.engines.sqlite.schema import GUARD_MESSAGE
from vault.errors import BadInput, NotAVault, OperationFailed, VaultBusy, VaultError

T = TypeVar("T")
CONNECT_TIMEOUT = 30.0
# The server ended the session mid-command: a restart, a failover, pg_terminate_backend.
LOST = ("08003", "08006", "57P01", "57P02")


def server_settings(loc: PgLocation) -> dict[str, str]:
    """The URL's settings plus the lock wait: PostgreSQL reads 0 as "wait for ever",
    memvault's MEMVAULT_LOCK_TIMEOUT=0 means "do not wait"."""
    settings = loc.server_settings()
    settings["lock_timeout"] = str(max(1, int(lock_timeout() * 1000)))
    # Whatever the server's or the role's default: a rotation's switch relies on a
    # writer's guard reading the meta as committed after the switch. Under REPEATABLE
    # READ a writer that took its snapshot before the switch would still pass the guard
    # with the old key id.
    settings["default_transaction_isolation"] = "read committed"
    return settings


async def connect(loc: PgLocation) -> Any:
    asyncpg = require_driver()
    return await asyncpg.connect(
        dsn=loc.dsn, timeout=CONNECT_TIMEOUT, server_settings=server_settings(loc)
    )


def require_driver() -> Any:
    """asyncpg, or one line saying how to install the extra (exit 2)."""
    try:
        import asyncpg
    except ImportError:
        raise BadInput(f"{INSTALL_HINT}; nothing was changed") from None
    return asyncpg


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code, inside a running loop or not."""
    return off_loop(lambda: asyncio.run(make()))


def off_loop(work: Callable[[], T]) -> T:
    """`work()`, which runs event loops of its own: on a helper thread when called from a
    coroutine (the agent session reloading its key), so the caller's loop is not re-entered."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return work()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result()


class HeldConnection:
    """One connection on one event loop for a whole batched operation (a rotation): the
    admin lock it holds outlives each step, and each step is one `run` on that loop, so
    synchronous code (vault.rotation's loop) drives it between steps."""

    def __init__(self, loc: PgLocation) -> None:
        self.loop = asyncio.new_event_loop()
        self.held = contextlib.AsyncExitStack()
        try:
            self.conn = self.loop.run_until_complete(connect(loc))
        except BaseException:
            self.loop.close()
            raise

    def __enter__(self) -> HeldConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, make: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
        return self.loop.run_until_complete(make(self.conn))

    def hold(self, lock: contextlib.AbstractAsyncContextManager[T]) -> T:
        """Enter `lock` (the admin lock) until `close`."""
        return self.loop.run_until_complete(self.held.enter_async_context(lock))

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.held.aclose())
            self.loop.run_until_complete(self.conn.close(timeout=5))
        except Exception:
            # Cut off mid-step (Ctrl-C, a lost server): the server ends the session, and
            # with it a session lock, when the connection goes.
            self.conn.terminate()
        finally:
            self.loop.close()


def translate(exc: BaseException, loc: PgLocation) -> VaultError:
    """One user-facing error for each way the server or the driver can fail; no secret.

    Exit codes: a server that cannot be reached, a database or schema that is not there,
    or a login the server refuses is "no vault at that location" (3): the location cannot
    be opened as a vault, and the fix is in the URL or the server, not the keyring (4 is
    the vault's master key). A lock held past MEMVAULT_LOCK_TIMEOUT is busy (5).
    """
    where = loc.display
    exc = first_failure(exc)
    state = getattr(exc, "sqlstate", None)
    text = " ".join(str(exc).split())[:200]
    if state in ("28P01", "28000"):
        return NotAVault(
            f"the PostgreSQL server refused the login for {where} ({text}); check the user "
            "and password in the URL; nothing was changed"
        )
    if state == "3D000":
        return NotAVault(
            f"no such database on the server of {where}; create it (createdb) or fix the "
            "URL; nothing was changed"
        )
    if state in ("55P03", "40P01", "40001", "57014"):
        return VaultBusy(
            f"{where} is busy: another session holds a lock this one needs ({text}); wait "
            "for it to finish, or raise MEMVAULT_LOCK_TIMEOUT (seconds)"
        )
    if state == "42P01":
        # Every table memvault names is a vault's: one missing mid-run means the vault was
        # shredded (or its tables dropped) since this process opened it.
        return NotAVault(
            f"no vault in {where} any more (its tables are gone: shredded or dropped "
            "meanwhile); create one with `memvault init`, or point --db / MEMVAULT_DB at an "
            "existing vault"
        )
    if state == "42501":
        return OperationFailed(
            f"the PostgreSQL user of {where} lacks a privilege ({text}); grant it, or use "
            "the vault's owner; nothing was changed"
        )
    if state == pgschema.GUARD_SQLSTATE and GUARD_MESSAGE in text:
        return OperationFailed(f"{GUARD_MESSAGE}; nothing was stored")
    if state in ("53300", "57P03"):
        return VaultBusy(f"the PostgreSQL server of {where} is not accepting sessions ({text})")
    if state in LOST or type(exc).__name__ == "ConnectionDoesNotExistError" or closed(exc):
        return OperationFailed(
            f"lost the connection to the PostgreSQL server of {where} mid-command ({text}); "
            "what was committed stays; run the command again (a `memvault rotate` or "
            "`memvault shred` cut off resumes where it stopped)"
        )
    if state is not None:
        return OperationFailed(f"PostgreSQL error on {where}: {text} (SQLSTATE {state})")
    if isinstance(exc, OSError) and "rejected SSL upgrade" in text:
        # asyncpg's ConnectionError when sslmode asks for SSL the server does not offer:
        # the server is there, so "cannot reach" would send the user after the wrong fix.
        return NotAVault(
            f"the PostgreSQL server of {where} does not offer SSL, which the URL's sslmode "
            "requires; enable SSL on the server, or set sslmode=prefer or disable in the URL "
            "(only on a network you trust); nothing was changed"
        )
    if isinstance(exc, ssl.SSLError | ssl.CertificateError) or (
        type(exc).__name__ == "ClientConfigurationError" and "certificate" in text
    ):
        return NotAVault(
            f"SSL with the PostgreSQL server of {where} failed ({text}); check the server's "
            "certificate and the URL's sslmode and sslrootcert; nothing was changed"
        )
    if isinstance(exc, OSError | TimeoutError):
        why = getattr(exc, "strerror", None) or type(exc).__name__
        return NotAVault(
            f"cannot reach the PostgreSQL server of {where} ({why}); start it, or fix the "
            "host and port in the URL; nothing was changed"
        )
    if isinstance(exc, ValueError):  # asyncpg's own reading of the URL (a bad port...)
        return BadInput(f"{where} is not a URL memvault can use; nothing was changed")
    return OperationFailed(f"PostgreSQL connection to {where} failed ({type(exc).__name__})")


def first_failure(exc: BaseException) -> BaseException:
    """The error that ended the connection, not the one a transaction's exit raised over
    it: asyncpg's rollback on a connection the server has ended (a restart,
    pg_terminate_backend) raises InterfaceError ("the underlying connection is closed")."""
    seen = exc
    while closed(seen) and is_driver_error(seen.__context__):
        assert seen.__context__ is not None
        seen = seen.__context__
    return seen


def closed(exc: BaseException | None) -> bool:
    """asyncpg's word for a statement sent on a connection already ended."""
    return type(exc).__name__ == "InterfaceError" and "connection is closed" in str(exc)


def translate_after(exc: BaseException, loc: PgLocation, done: str) -> BaseException:
    """`translate` for a failure after a step that cannot be undone (the keys destroyed,
    the switch to a new key): its "nothing was changed" would be false, so the message
    says what is done and how to finish instead. Not a driver error: `exc` itself."""
    if not is_driver_error(exc):
        return exc
    err = translate(exc, loc)
    return type(err)(f"{err.message.removesuffix('; nothing was changed')}; {done}")


def is_driver_error(exc: BaseException | None) -> bool:
    """An error of the connection or the server (translated), not a bug of memvault's."""
    if isinstance(exc, OSError | TimeoutError):
        return True
    return (type(exc).__module__ or "").startswith("asyncpg")
