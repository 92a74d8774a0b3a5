"""The drop-in agent session: the SDK's EncryptedSession over SQLiteSession.

This is the only module that imports `agents` (about 2 s), and only when an
agent session is actually opened.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from agents import SQLiteSession
from agents.extensions.memory import EncryptedSession
from cryptography.fernet import InvalidToken

from .store import GUARD_MESSAGE, configure, lock_timeout, translate

if TYPE_CHECKING:
    from pathlib import Path

    from .store import Vault


class VaultSQLiteSession(SQLiteSession):
    """SQLiteSession whose connections wait for rotations and zero what they delete."""

    @staticmethod
    def _configure_connection(conn: sqlite3.Connection) -> None:
        # The SDK's 5 s busy timeout is shorter than a large rotation: wait instead of failing.
        configure(conn, lock_timeout())
        SQLiteSession._configure_connection(conn)


class VaultSession(EncryptedSession):
    """EncryptedSession that writes the vault's key id and survives rotations.

    After another process rotates, the next write is refused by the file's
    triggers (stale key id) and the next read meets envelopes under an unknown
    kid: either way the session reloads the key from the keyring and goes on.
    """

    def __init__(self, vault: Vault, session_id: str) -> None:
        sealer = vault.sealer()
        self._vault = vault
        self._db_path: Path = vault.path
        super().__init__(
            session_id=session_id,
            underlying_session=VaultSQLiteSession(session_id, vault.path),
            encryption_key=sealer.master_key,
            ttl=vault.ttl,  # type: ignore[arg-type]  # None means never, as Fernet allows
        )
        self._use(sealer)

    def _use(self, sealer: Any) -> None:
        self.cipher = sealer.fernet(self.session_id)
        self._kid = sealer.kid

    def _refresh(self) -> bool:
        """Reload the key if the file moved on; True when it changed."""
        sealer = self._vault.sealer(refresh=True)
        changed = sealer.kid != self._kid
        self._use(sealer)
        self.ttl = self._vault.ttl  # type: ignore[assignment]
        return changed

    def _file_kid(self) -> str:
        return self._vault.meta()["kid"]

    def _unwrap(self, item: Any) -> Any:
        if (
            isinstance(item, dict)
            and item.get("__enc__") == 1
            and item.get("kid") != self._kid
            and self._file_kid() != self._kid
        ):
            self._refresh()
        return super()._unwrap(item)

    async def get_items(self, limit: int | None = None, *, wrapper: Any = None) -> Any:
        # One read is one SQLite snapshot. If the key changed while unwrapping it (another
        # process rotated, perhaps twice), rows of that snapshot may be under a key this
        # session no longer holds and would be skipped as unreadable: read again rather
        # than return a partial or empty history.
        while True:
            kid = self._kid
            items = await super().get_items(limit, wrapper=wrapper)
            if self._kid == kid:
                return items

    async def add_items(self, items: list[Any], *, wrapper: Any = None) -> None:
        deadline = time.monotonic() + lock_timeout()
        while True:
            try:
                await super().add_items(items, wrapper=wrapper)
                return
            except sqlite3.IntegrityError as exc:
                # The triggers refused our key id: another process rotated. Reseal and retry.
                if GUARD_MESSAGE not in str(exc):
                    raise translate(exc, self._db_path) from exc
                if not await asyncio.to_thread(self._refresh):
                    raise translate(exc, self._db_path) from exc
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                    continue
                raise translate(exc, self._db_path) from exc

    async def pop_item(self, *, wrapper: Any = None) -> Any:
        while True:
            try:
                return await super().pop_item(wrapper=wrapper)
            except InvalidToken:
                # Nothing was removed (the SDK authenticates inside the transaction).
                if not await asyncio.to_thread(self._refresh):
                    raise

    async def clear_session(self, *, wrapper: Any = None) -> None:
        await super().clear_session(wrapper=wrapper)
        await asyncio.to_thread(self._vault.scrub)

    def close(self) -> None:
        self.underlying_session.close()  # type: ignore[attr-defined]


def make_session(vault: Vault, session_id: str) -> VaultSession:
    return VaultSession(vault, session_id)
