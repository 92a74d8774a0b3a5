"""The drop-in agent session: the SDK's EncryptedSession over SQLiteSession.

Only this module imports `agents` (about 2 s), and only when a session is opened.

SDK internals this module relies on (all private or undocumented, as of
openai-agents 0.24). tests/session/test_compat.py checks each one's signature and
behaviour, and that this list names every one the code here touches, so raising
the `openai-agents` pin in pyproject.toml is a deliberate step:

- `SQLiteSession._configure_connection(conn)`: static hook the SDK calls on every
  connection it opens; overridden to add the vault's pragmas, then chained.
- `SQLiteSession._init_db_for_connection(conn)`: the SDK's schema creation at
  construction; overridden so a session never creates tables in a file.
- `SQLiteSession._get_connection()`: where every SDK read and write gets its
  thread's connection; overridden to open it mode=rw and notice changed files.
- `SQLiteSession._check_not_closed()`: called first, as the SDK's own does.
- `SQLiteSession._local`, `SQLiteSession._connections`,
  `SQLiteSession._connection_owners`, `SQLiteSession._connections_lock`,
  `SQLiteSession._close_connections_from_exited_threads()`: the SDK's per-thread
  connection registry, kept by our `_get_connection` as the SDK's own keeps it,
  so that `close()` closes every connection.
- `SQLiteSession._pop_item_with_validation(validate)`: EncryptedSession.pop_item
  authenticates inside the delete's transaction through it; replaced, to take the
  row with its link and move the chain head back in that transaction.
- `SQLiteSession._insert_items(conn, items)`: the insert in `add_items`'s transaction;
  overridden to write each row's chain link and the session's head.
- `SQLiteSession._locked_connection()`, `SQLiteSession._write_connection()`: a thread's
  connection under the SDK's lock; the second rolls back on any error (our pop).
- `SQLiteSession._get_compaction_snapshot(limit, *, prune_prefix)`: None for a
  subclass, so `OpenAIResponsesCompactionSession` replaces history through our
  `clear_session`/`add_items` (audited, scrubbed), never in raw SQL.
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
import contextvars
import json
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agents import SessionSettings, SQLiteSession
from agents.extensions.memory import EncryptedSession
from agents.memory.session_settings import resolve_session_limit
from cryptography.fernet import InvalidToken

from vault import chainops, crypto, readcache
from vault.backupmark import is_backup, refuse
from vault.engines.sqlite import chainsession, sdkerrors
from vault.engines.sqlite.db import configure, is_busy, lock_timeout, parse_ttl, read_meta
from vault.engines.sqlite.schema import GUARD_MESSAGE
from vault.engines.sqlite.sdkerrors import also_sqlite, sdk_error, undecodable_rows_as_none
from vault.errors import UnknownSession, VaultError
from vault.readcache import CachedReads
from vault.sessionanchor import AnchorClock

if TYPE_CHECKING:
    from pathlib import Path

    from vault.engine import SessionVault as Vault


# Stands for "never expires" where the SDK needs a number of seconds.
NEVER = 1 << 62

# The vault head points an `add_items` wrote, set while it runs (asyncio.to_thread copies
# it to the SDK's thread). A write reads no meta first: the file's triggers refuse an item
# under a stale key id, and `VaultSession.add_items` reloads the key and retries.
_WRITING: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("memvault_writing")


class VaultSQLiteSession(SQLiteSession):
    """SQLiteSession whose connections wait for rotations, zero what they delete,
    never create a file, and notice when another connection changed the file."""

    def __init__(
        self,
        session_id: str,
        db_path: Path,
        session_settings: SessionSettings | dict[str, Any] | None = None,
    ) -> None:
        self._vault_path = db_path
        self._identity = sdkerrors.file_identity(db_path)
        self.on_change: Callable[[sqlite3.Connection], None] | None = None  # file changed
        self._versions: dict[sqlite3.Connection, int] = {}
        self.deleted = False  # set by a pop that removed a row, for the scrub
        self.chain = chainsession.SessionChain()  # set by VaultSession
        super().__init__(session_id, db_path, session_settings=session_settings)

    @staticmethod
    def _configure_connection(conn: sqlite3.Connection) -> None:
        # The SDK's 5 s busy timeout is shorter than a large rotation: wait instead of failing.
        configure(conn, lock_timeout())
        conn.row_factory = undecodable_rows_as_none
        SQLiteSession._configure_connection(conn)

    def _check_file(self) -> None:
        """The file this session opened is still the one at the path (not shredded/replaced)."""
        sdkerrors.check_identity(self._vault_path, self._identity)

    def _init_db_for_connection(self, conn: sqlite3.Connection) -> None:
        # The vault made the SDK's tables; making them here could only write another file.
        self._check_file()

    def _get_connection(self) -> sqlite3.Connection:
        # The SDK's thread-local connections, opened with mode=rw: a session that outlives
        # its vault (shredded meanwhile) must fail, not create an empty file at the path.
        self._check_not_closed()
        self._check_file()
        if not hasattr(self._local, "connection"):
            with self._connections_lock:
                self._close_connections_from_exited_threads()
                for old in [c for c in self._versions if c not in self._connections]:
                    del self._versions[old]
            uri = "file:" + urllib.parse.quote(str(self._vault_path)) + "?mode=rw"
            try:
                connection = sqlite3.connect(uri, uri=True, check_same_thread=False)
                self._configure_connection(connection)
            except sqlite3.Error as exc:
                raise sdk_error(exc, self._vault_path) from exc
            self._local.connection = connection
            with self._connections_lock:
                self._connections.add(connection)
                self._connection_owners[connection] = threading.current_thread()
        conn: sqlite3.Connection = self._local.connection
        if _WRITING.get(None) is None:
            # The version stays unseen until the next read, which then notices the change.
            self._notice_changes(conn)
        return conn

    def _notice_changes(self, conn: sqlite3.Connection) -> None:
        # data_version moves only when another connection committed: the meta is reread then.
        try:
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            if self._versions.get(conn) != version:
                if self.on_change is not None:
                    self.on_change(conn)
                self._versions[conn] = version
        except sqlite3.Error as exc:
            raise sdk_error(exc, self._vault_path) from exc

    async def add_items(self, items: list[Any]) -> None:
        written: list[Any] = []  # per call: two writes at once each pass their own point
        token = _WRITING.set(written)
        try:
            await super().add_items(items)
            chainsession.committed(self.chain, written[-1] if written else None)
        finally:
            _WRITING.reset(token)

    def _insert_items(self, conn: sqlite3.Connection, items: list[Any]) -> None:
        texts = [json.dumps(item) for item in items]  # the SDK's own text of each row
        key, where, floor = self.chain.key(), str(self._vault_path), self.chain.floor
        point = chainsession.insert_items(conn, self.session_id, texts, key, where, floor)  # type: ignore[arg-type]
        _WRITING.get([]).append(point)

    async def get_items(self, limit: int | None = None) -> list[Any]:
        # The SDK's read, its rows judged with their head in the same snapshot first.
        wanted = resolve_session_limit(limit, self.session_settings)
        return await asyncio.to_thread(self._read_checked, wanted)

    def _read_checked(self, wanted: int | None) -> list[Any]:
        with self._locked_connection() as conn:
            try:
                where = str(self._vault_path)
                return chainsession.read_items(conn, self.session_id, wanted, self.chain, where)
            except sqlite3.Error as exc:
                raise sdk_error(exc, self._vault_path) from exc

    async def _pop_item_with_validation(self, validate: Callable[[Any], None] | None = None) -> Any:
        # The SDK's pop, its row taken with its link (chainsession.pop_newest); a stale key
        # rolls back, and VaultSession.pop_item reloads it and retries.
        def pop() -> Any:
            with self._write_connection() as conn:
                sid, where = self.session_id, str(self._vault_path)
                item, point = chainsession.pop_newest(conn, sid, validate, self.chain, where)
                conn.commit()
            chainsession.committed(self.chain, point)
            return item

        item = await asyncio.to_thread(pop)
        if item is not None:
            self.deleted = True
        return item


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
        if file_kid != self._kid and _WRITING.get(None) is None:
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
