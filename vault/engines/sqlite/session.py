"""The drop-in agent session: the SDK's EncryptedSession over SQLiteSession.

Only this module and vault.engines.sqlite.sqlitesession, the store under it, import
`agents` (about 2 s), and only when a session is opened.

SDK internals this module relies on (all private or undocumented, as of
openai-agents 0.24; the store's are listed in its own module). tests/session/
test_compat.py checks each one's signature and behaviour, and that the two lists
name every one the code touches, so raising the `openai-agents` pin in
pyproject.toml is a deliberate step:

- `EncryptedSession.cipher`: the per-session Fernet that seals and opens; set
  from the vault's key, and again after a rotation.
- `EncryptedSession._kid`: the `kid` written into every envelope; set to the
  vault's key id, which the file's triggers require.
- `EncryptedSession._unwrap(item)`: opens one envelope; overridden by the read cache
  (vault.readcache.CachedReads), and behind it (`_open_envelope`) to reload the key
  when an envelope is under a newer key id.
- `EncryptedSession._get_compaction_snapshot(limit)`: what the compaction wrapper
  reads; it computes `now - ttl`, so it is overridden for a vault that never expires.
- `EncryptedSession.ttl`: read on every call; `None` (never) goes to Fernet as
  no TTL, and a TTL changed by another process is set here.
- `EncryptedSession.get_items(limit, *, wrapper)`, `EncryptedSession.add_items(items,
  *, wrapper)`, `EncryptedSession.pop_item(*, wrapper)`,
  `EncryptedSession.clear_session(*, wrapper)`: overridden; the Runner passes its
  context as `wrapper` only to methods that take a keyword of that name.

"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from agents import SessionSettings
from agents.extensions.memory import EncryptedSession
from cryptography.fernet import InvalidToken

from vault import chainops, crypto, readcache
from vault.backupmark import is_backup, refuse
from vault.engines.sqlite import chainsession
from vault.engines.sqlite.db import is_busy, lock_timeout, parse_ttl, read_meta
from vault.engines.sqlite.schema import GUARD_MESSAGE
from vault.engines.sqlite.sdkerrors import also_sqlite, sdk_error
from vault.engines.sqlite.sqlitesession import VaultSQLiteSession, writing
from vault.errors import UnknownSession, VaultError
from vault.readcache import CachedReads
from vault.sessionanchor import AnchorClock

if TYPE_CHECKING:
    from pathlib import Path

    from vault.engine import SessionVault as Vault


# Stands for "never expires" where the SDK needs a number of seconds.
NEVER = 1 << 62


class VaultSession(AnchorClock, CachedReads, EncryptedSession):
    """EncryptedSession that writes the vault's key id and survives rotations.

    After another process rotates, the next write is refused by the file's
    triggers (stale key id) and the next read meets envelopes under an unknown
    kid: either way the session reloads the key from the keyring and goes on.
    A TTL changed by another process applies from the session's next call.
    """

    def __init__(
        self,
        vault: Vault,
        session_id: str,
        *,
        session_settings: SessionSettings | dict[str, Any] | None = None,
    ) -> None:
        sealer = vault.sealer()
        self._vault: Vault = vault
        # Read once: a restore puts a new file at the path, which this session refuses.
        meta = vault.meta()
        self._backup_meta = meta if is_backup(meta) else None
        self._db_path: Path = vault.path
        self._vault_id = meta["vault_id"]
        underlying = VaultSQLiteSession(session_id, vault.path, session_settings)
        self._start(session_id, underlying, sealer, vault.ttl)
        underlying.on_change = self._on_change
        underlying.chain = chainsession.SessionChain(
            keys_of=self._chain_keys,
            key=lambda: chainops.key_of(self._sealer, self._vault_id),
            keep=lambda: readcache.MAX_ITEMS if self.read_cache else 0,
            was_chained=meta.get(chainops.CHAIN_META) == chainops.ON,
            floor=vault.anchor_floor(),
            wrote=vault.wrote,
        )

    def _start(self, session_id: str, underlying: Any, sealer: Any, ttl: int | None) -> None:
        """EncryptedSession over `underlying` under the current key (both engines)."""
        EncryptedSession.__init__(
            self,
            session_id=session_id,
            underlying_session=underlying,
            encryption_key=sealer.master_key,
            ttl=ttl,  # type: ignore[arg-type]  # None means never, as Fernet allows
        )
        self._use(sealer)
        self.read_cache = True

    def _use(self, sealer: Any) -> None:
        self.cipher = sealer.fernet(self.session_id)
        self._kid = sealer.kid
        self._sealer = sealer

    def _refresh(self) -> bool:
        """Reload the key if the file moved on; True when it changed."""
        sealer = self._vault.sealer(refresh=True)
        changed = sealer.kid != self._kid
        self._use(sealer)
        self.ttl = self._vault.ttl  # type: ignore[assignment]
        return changed

    def _on_change(self, conn: sqlite3.Connection) -> None:
        meta = read_meta(conn, self._db_path)  # NotAVault when its kid is gone
        self.ttl = parse_ttl(meta, self._db_path)  # type: ignore[assignment]
        if meta["kid"] != self._kid:
            self._refresh()

    def _chain_keys(self, file_kid: str) -> dict[str, Any] | None:
        """The chain keys for a file whose kid is `file_kid`, the key reloaded if stale
        (not while writing: a write is refused and retried, its items sealed again)."""
        if file_kid != self._kid and not writing():
            self._refresh()
        if file_kid != self._kid:
            return None
        return chainops.keys_for(self._sealer, self._vault_id)

    def _open_envelope(self, item: Any) -> Any:
        if (
            isinstance(item, dict)
            and item.get("__enc__") == 1
            and item.get("kid") != self._kid
            and self._vault.meta()["kid"] != self._kid
        ):
            self._refresh()
        kid = item.get("kid") if isinstance(item, dict) and item.get("__enc__") == 1 else None
        other = self._sealer.for_kid(kid) if kid != self._kid else None
        if other is not None:
            # An online rotation is moving rows from that key (vault.rotation): a row
            # not moved yet opens with it.
            opened = other.open(self.session_id, json.dumps(item), self.ttl)
            return opened.item if opened.state is crypto.ItemState.READABLE else None
        return self._sdk_unwrap(item)

    def _sdk_unwrap(self, item: Any) -> Any:
        try:
            return EncryptedSession._unwrap(self, item)  # not the read cache's (CachedReads)
        except (ValueError, RecursionError):
            # Authenticated, yet no JSON item (only a holder of the key seals one): skipped,
            # as the SDK skips a token it cannot open, rather than ending the agent's read.
            return None

    async def get_items(self, limit: int | None = None, *, wrapper: Any = None) -> Any:
        # One read is one SQLite snapshot. If the key changed while unwrapping it (another
        # process rotated), read again rather than return a partial or empty history.
        while True:
            kid = self._kid
            try:
                with self._reading():
                    items = await super().get_items(limit, wrapper=wrapper)
            except sqlite3.Error as exc:
                raise sdk_error(exc, self._db_path) from exc
            if self._kid == kid:
                return items

    def _refuse_backup(self, doing: str) -> None:
        if self._backup_meta is not None:
            refuse(self._backup_meta, self._db_path, doing)

    async def add_items(self, items: list[Any], *, wrapper: Any = None) -> None:
        self._refuse_backup("an agent session's add_items")
        started = time.monotonic()
        deadline: float | None = None  # read only when the file is busy: rare, and not free
        while True:
            sealed_with = self._kid
            try:
                await super().add_items(items, wrapper=wrapper)
                return await self._wrote()
            except sqlite3.IntegrityError as exc:
                # The triggers refused our key id: another process rotated. Reseal and retry
                # (the key may already have been reloaded while the items were being stored).
                if GUARD_MESSAGE not in str(exc):
                    raise sdk_error(exc, self._db_path) from exc
                await asyncio.to_thread(self._refresh)
                if self._kid == sealed_with:
                    raise sdk_error(exc, self._db_path) from exc
            except sqlite3.OperationalError as exc:
                if deadline is None:
                    deadline = started + lock_timeout()
                if is_busy(exc) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                    continue
                raise sdk_error(exc, self._db_path) from exc

    async def pop_item(self, *, wrapper: Any = None) -> Any:
        self._refuse_backup("an agent session's pop_item")
        underlying: VaultSQLiteSession = self.underlying_session  # type: ignore[assignment]
        underlying.deleted = False
        try:
            while True:
                try:
                    item = await super().pop_item(wrapper=wrapper)
                    await self._wrote()
                    return item
                except InvalidToken:
                    # Nothing was removed (the SDK authenticates inside the transaction).
                    if not await asyncio.to_thread(self._refresh):
                        raise
                except sqlite3.Error as exc:
                    raise sdk_error(exc, self._db_path) from exc
        finally:
            if underlying.deleted:
                self.forget_reads()
                # Like `memvault pop`: the popped ciphertext must not stay readable in
                # the WAL or free pages under the current key.
                await asyncio.to_thread(self._vault.scrub_after_delete)

    async def clear_session(self, *, wrapper: Any = None) -> None:
        """Empty the session as `Vault.clear` does: refuses (ItemsUnreadable, nothing
        deleted) if an item fails authentication; audited and scrubbed."""
        self.forget_reads()
        try:
            await asyncio.to_thread(self._vault.clear, self.session_id)
            await self._wrote()
        except UnknownSession:
            return  # nothing stored under this id: already empty, as the SDK treats it
        except VaultError as exc:
            cause = exc.__cause__
            if isinstance(cause, sqlite3.Error):  # Vault.clear translated an SQLite failure
                raise also_sqlite(exc, cause) from cause
            raise

    async def _get_compaction_snapshot(self, limit: int) -> Any:
        # The SDK computes `now - ttl`, which fails for a vault that never expires: for the
        # length of the read, "never" is a TTL no timestamp can outlive.
        if self.ttl is not None:
            return await super()._get_compaction_snapshot(limit)
        self.ttl = NEVER
        try:
            return await super()._get_compaction_snapshot(limit)
        finally:
            if self.ttl == NEVER:  # unless a TTL change arrived meanwhile
                self.ttl = None

    def close(self) -> None:
        self.forget_reads()
        self._anchor_at_close()
        self.underlying_session.close()  # type: ignore[attr-defined]
