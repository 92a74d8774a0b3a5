"""The agent session on a PostgreSQL vault: EncryptedSession over the SDK's SQLAlchemySession.

Only `vault.engines.postgres.vault.PgVault.session` imports this module (it imports `agents` and
`sqlalchemy`). `PgVaultSession` is a `VaultSession` (vault.engines.sqlite.session): the same
key, kid, TTL and key reload after a rotation; only the store underneath and
its errors differ. The PL/pgSQL guard (vault.engines.postgres.schema) refuses a write under a
retired kid; the session then reloads the key from the keyring and retries, as
the SQLite one does.

Relies on the SDK internals listed in vault.engines.sqlite.session, plus:
- `SQLAlchemySession._get_compaction_snapshot`: None for a subclass, so the
  compaction wrapper replaces history through our `clear_session`/`add_items`.
- `SQLAlchemySession._deserialize_item(item)`: the SDK's one row decoder (its
  docstring invites overriding); overridden so a row too deeply nested is skipped.
- `SQLAlchemySession._session_factory`: where every SDK operation gets its ORM session
  (through `_session()`); made a property that binds it to the running event loop's pool
  (vault.engines.postgres.pool). `_engine`, set from the constructor's `engine`, is then
  read only for its dialect. tests/postgres/test_postgres_pooled_session.py counts the
  connections opened, so an SDK that bypassed the factory would fail there.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agents import SessionSettings
from agents.extensions.memory import EncryptedSession
from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from vault import crypto
from vault.engines.postgres import pool
from vault.engines.postgres.conn import server_settings, translate
from vault.engines.sqlite.db import lock_timeout
from vault.engines.sqlite.schema import GUARD_MESSAGE
from vault.engines.sqlite.session import VaultSession
from vault.errors import UnknownSession, VaultError
from vault.vaultops import parse_ttl

if TYPE_CHECKING:
    # The base, not PgVault: PgVault.session imports this module (no import circle).
    from vault.engines.postgres.base import PgVaultBase as PgVault


class VaultSQLAlchemySession(SQLAlchemySession):
    """The SDK's SQLAlchemySession on the vault's tables, over the pool of whichever event
    loop each operation runs on (vault.engines.postgres.pool); never creates tables."""

    def __init__(
        self,
        session_id: str,
        *,
        url: str,
        settings: dict[str, str],
        on_meta: Callable[[dict[str, str] | None], None],
        session_settings: SessionSettings | dict[str, Any] | None = None,
    ) -> None:
        self._url = url
        self._settings = settings
        self._on_meta = on_meta
        super().__init__(
            session_id,
            engine=pool.template(url, settings),
            create_tables=False,
            session_settings=session_settings,
        )

    @property  # the SDK's attribute, made per event loop
    def _session_factory(self) -> async_sessionmaker[AsyncSession]:
        return async_sessionmaker(
            pool.engine_for(self._url, self._settings),
            expire_on_commit=False,
            sync_session_class=pool.MetaSession,
            info={pool.ON_META: self._on_meta},
        )

    @_session_factory.setter
    def _session_factory(self, _sdk_own: object) -> None:
        # The SDK sets one factory bound to one engine, hence to one event loop: ignored.
        return None

    async def _deserialize_item(self, item: str) -> Any:
        # The SDK skips a row whose decoding raises JSONDecodeError, not RecursionError or
        # a plain ValueError: a row nested deeper than the parser's stack (`[` x 5000) or
        # holding a number of more digits than Python converts, storable by a writer of the
        # tables, is skipped the same way instead of ending the agent's read.
        try:
            return json.loads(item)
        except json.JSONDecodeError:
            raise
        except (ValueError, RecursionError):
            raise json.JSONDecodeError("not a readable item", item[:20], 0) from None


def _driver_error(exc: BaseException) -> BaseException:
    """The asyncpg (or OS) error under SQLAlchemy's wrapping, for `pgconn.translate`."""
    seen = exc
    for _ in range(5):
        inner = getattr(seen, "orig", None) or seen.__cause__
        if inner is None or inner is seen:
            break
        seen = inner
        if getattr(seen, "sqlstate", None):
            break
    return seen


class PgVaultSession(VaultSession):
    """EncryptedSession over SQLAlchemySession on a PostgreSQL vault; survives rotations."""

    def __init__(
        self,
        vault: PgVault,
        session_id: str,
        *,
        session_settings: SessionSettings | dict[str, Any] | None = None,
    ) -> None:
        sealer = vault.sealer()
        self._vault = vault  # type: ignore[assignment]  # the same duck type as Vault
        self._db_path = vault.path  # type: ignore[assignment]  # the redacted URL
        # Every read's connection, pooled or new, first reads the TTL and the kid, and a
        # write's guard reads the kid in its own transaction (vault.engines.postgres.pool),
        # so a `memvault ttl`, `rotate` or `revoke` run on any host applies at this
        # session's next operation, as a SQLite session sees it through data_version.
        self._meta_kid: str | None = None
        underlying = VaultSQLAlchemySession(
            session_id,
            url=vault.loc.sqlalchemy_url,
            settings=server_settings(vault.loc),
            on_meta=self._apply_meta,
            session_settings=session_settings,
        )
        self._start(session_id, underlying, sealer, vault.ttl)

    def _apply_meta(self, meta: dict[str, str] | None) -> None:
        if meta is None:
            return  # the read failed (no vault any more): the operation says so itself
        if "ttl_seconds" in meta:
            self.ttl = parse_ttl(meta, self._db_path)  # type: ignore[assignment]
        self._meta_kid = meta.get("kid")

    def _open_envelope(self, item: Any) -> Any:
        # As VaultSession's (reload the key when the vault moved on), and while an online
        # rotation runs (vault.engines.postgres.rotate), open a row not yet moved with the old key.
        kid = item.get("kid") if isinstance(item, dict) and item.get("__enc__") == 1 else None
        if kid is not None and kid != self._kid:
            vault: PgVault = self._vault  # type: ignore[assignment]
            # The old key once loaded: no round trip per row of a long history.
            other = vault.cached_sealer(kid)
            if other is None:
                if vault.meta()["kid"] != self._kid:
                    self._refresh()
                other = vault.sealer_for_kid(kid) if kid != self._kid else None
            if other is not None:
                opened = other.open(self.session_id, json.dumps(item), self.ttl)
                return opened.item if opened.state is crypto.ItemState.READABLE else None
        return self._sdk_unwrap(item)

    def _translate(self, exc: BaseException) -> VaultError:
        return translate(_driver_error(exc), self._vault.loc)  # type: ignore[attr-defined]

    async def get_items(self, limit: int | None = None, *, wrapper: Any = None) -> Any:
        # One read is one statement's snapshot; if the key changed while unwrapping it
        # (another process rotated), read again rather than return a partial history.
        while True:
            kid = self._kid
            try:
                with self._reading():
                    items = await EncryptedSession.get_items(self, limit, wrapper=wrapper)
            except (DBAPIError, OSError, TimeoutError) as exc:
                raise self._translate(exc) from None
            if self._meta_kid not in (None, self._kid):
                # The vault moved on (a rotation, or a revoke on any host: KeyRevoked,
                # exit 4, as a file session says): the key held in memory must not go on
                # reading a history that was cut off from every key.
                await asyncio.to_thread(self._refresh)
            if self._kid == kid:
                return items

    async def add_items(self, items: list[Any], *, wrapper: Any = None) -> None:
        deadline = time.monotonic() + lock_timeout()
        redone = False
        while True:
            sealed_with = self._kid
            try:
                with pool.writing() as attempt:
                    await EncryptedSession.add_items(self, items, wrapper=wrapper)
                return
            except IntegrityError as exc:
                # The guard refused our kid: another process rotated. Reload the key from
                # the keyring and reseal; a refusal under the current key is final.
                if GUARD_MESSAGE not in str(exc):
                    raise self._translate(exc) from None
                await asyncio.to_thread(self._refresh)
                if self._kid == sealed_with:
                    raise self._translate(exc) from None
            except DBAPIError as exc:
                # A pooled connection the server had ended (a restart, an operator's
                # pg_terminate_backend) fails the write's first statement, and the pool
                # drops it. Nothing was stored unless the COMMIT had been sent: write
                # once more, on a new connection.
                if exc.connection_invalidated and not attempt.committing and not redone:
                    redone = True
                    continue
                err = self._translate(exc)
                if err.exit_code == 5 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    continue
                raise err from None
            except (OSError, TimeoutError) as exc:
                raise self._translate(exc) from None

    async def pop_item(self, *, wrapper: Any = None) -> Any:
        # Authenticated before the delete, in its transaction (the SDK's generic pop would
        # delete first): an item that does not authenticate stays.
        self.forget_reads()
        return await asyncio.to_thread(self._vault.pop_newest, self.session_id)  # type: ignore[attr-defined]

    async def clear_session(self, *, wrapper: Any = None) -> None:
        """Empty the session as `memvault clear` does (refuses unreadable items, audited)."""
        self.forget_reads()
        try:
            await asyncio.to_thread(self._vault.clear, self.session_id)
        except UnknownSession:
            return

    def close(self) -> None:
        # The pools belong to event loops, shared by the sessions on each, and close when
        # their loop ends (vault.engines.postgres.pool): nothing of this session's to release.
        self.forget_reads()
