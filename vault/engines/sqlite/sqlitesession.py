"""The store under the agent session: the SDK's SQLiteSession on the vault file
(vault.engines.sqlite.session puts EncryptedSession over it). Imported with it, only
when a session is opened.

SQLiteSession internals this module relies on (all private or undocumented, as of
openai-agents 0.24; tests/session/test_compat.py checks each one, as it checks those
vault.engines.sqlite.session lists):

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
  connection under the SDK's lock; the second rolls back on any error (our pop), and
  `add_items`'s COMMIT is the last statement of its block, so a block that ends
  without raising committed (overridden to pass the point written to the floor).
- `SQLiteSession._get_compaction_snapshot(limit, *, prune_prefix)`: None for a
  subclass, so `OpenAIResponsesCompactionSession` replaces history through our
  `clear_session`/`add_items` (audited, scrubbed), never in raw SQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agents import SessionSettings, SQLiteSession
from agents.memory.session_settings import resolve_session_limit

from vault.chainvault import Point
from vault.engines.sqlite import chainsession, sdkerrors
from vault.engines.sqlite.db import configure, lock_timeout
from vault.engines.sqlite.sdkerrors import sdk_error, undecodable_rows_as_none


class _Write:
    """One `add_items` call: the vault head point its insert wrote, once it has."""

    __slots__ = ("point",)

    def __init__(self) -> None:
        self.point: Point | None = None


# Set while an `add_items` runs (asyncio.to_thread copies it to the SDK's thread). A
# write reads no meta first: the file's triggers refuse an item under a stale key id,
# and `VaultSession.add_items` reloads the key and retries.
_WRITING: contextvars.ContextVar[_Write] = contextvars.ContextVar("memvault_writing")


def writing() -> bool:
    """Whether this call runs inside an `add_items` (its thread included)."""
    return _WRITING.get(None) is not None


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
        if not writing():
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
        token = _WRITING.set(_Write())  # per call: two writes at once each pass their own
        try:
            await super().add_items(items)
        finally:
            _WRITING.reset(token)

    @contextlib.contextmanager
    def _write_connection(self) -> Iterator[sqlite3.Connection]:
        with super()._write_connection() as conn:
            yield conn
            # The SDK's `add_items` block ends with its COMMIT, so reached, the write is a
            # state this session knows (`SessionChain.wrote`), even if its caller was
            # cancelled meanwhile; still under the SDK's lock, before another read.
            write = _WRITING.get(None)
            if write is not None and write.point is not None:
                self.chain.wrote(write.point)

    def _insert_items(self, conn: sqlite3.Connection, items: list[Any]) -> None:
        texts = [json.dumps(item) for item in items]  # the SDK's own text of each row
        key, where, floor = self.chain.key(), str(self._vault_path), self.chain.floor
        point = chainsession.insert_items(conn, self.session_id, texts, key, where, floor)  # type: ignore[arg-type]
        write = _WRITING.get(None)
        if write is not None:
            write.point = point

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
            self.chain.wrote(point)
            return item

        item = await asyncio.to_thread(pop)
        if item is not None:
            self.deleted = True
        return item
