"""The drop-in raises what the SDK raises: an SQLite failure in `get_items`, `add_items`,
`pop_item` or `clear_session` of `vault.open_session(...)` is an instance of the
`sqlite3.Error` subclass `SQLiteSession` raises for it, and also a `vault.VaultError`
(its one-line message and exit code), so code written against the SDK's session keeps
catching what it caught. Real SQLite files, the real SDK, the real keyring."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from agents import SQLiteSession

import vault as vault_pkg
from vault import VaultError
from vault.errors import VaultBusy

ITEM = {"role": "user", "content": "kept"}


def drop_table(db: Path, table: str) -> None:
    """Drop a table from another connection, so that the session's next statement fails."""
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(f"DROP TABLE {table}")


def write_lock_is_free(db: Path) -> bool:
    """Whether another connection can take the write lock at once."""
    with contextlib.closing(sqlite3.connect(db, timeout=0)) as probe:
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.rollback()
            return True
        except sqlite3.OperationalError:
            return False


def no_open_transaction(session: Any) -> bool:
    underlying = session.underlying_session
    return all(not conn.in_transaction for conn in underlying._connections)


# Adapted from the openai-agents-python 0.24 tests (tests/test_session.py):
# test_sqlite_session_failed_clear_session_rolls_back and
# test_sqlite_session_failed_pop_item_releases_write_lock, run against vault.open_session
# instead of a bare SQLiteSession: the same failure, the same exception type expected,
# no transaction left open and the write lock free afterwards.
def test_failed_clear_session_rolls_back(vault: Any, vault_db: Path) -> None:
    async def go() -> None:
        session = vault_pkg.open_session("clear_rollback", vault_db)
        await session.add_items([ITEM])
        drop_table(vault_db, "agent_sessions")
        with pytest.raises(sqlite3.OperationalError) as caught:
            await session.clear_session()
        assert isinstance(caught.value, VaultError)
        assert no_open_transaction(session)
        assert write_lock_is_free(vault_db)
        session.close()

    asyncio.run(go())


def test_failed_pop_item_releases_write_lock(vault: Any, vault_db: Path) -> None:
    async def go() -> None:
        session = vault_pkg.open_session("pop_rollback", vault_db)
        await session.add_items([ITEM])
        drop_table(vault_db, "agent_messages")
        with pytest.raises(sqlite3.OperationalError) as caught:
            await session.pop_item()
        assert isinstance(caught.value, VaultError)
        assert no_open_transaction(session)
        assert write_lock_is_free(vault_db)
        session.close()

    asyncio.run(go())


async def _sdk_and_vault_errors(
    db: Path, plain_db: Path, call: Callable[[Any], Awaitable[Any]]
) -> tuple[BaseException, BaseException]:
    """The exception `call` raises on a bare SQLiteSession and on a vault session, each
    after its messages table was dropped."""
    caught: list[BaseException] = []
    plain = SQLiteSession("s", plain_db)
    ours = vault_pkg.open_session("s", db)
    for session, path in ((plain, plain_db), (ours, db)):
        await session.add_items([ITEM])
        drop_table(path, "agent_messages")
        try:
            await call(session)
        except Exception as exc:  # the point: which type it is
            caught.append(exc)
        else:
            raise AssertionError(f"{session!r} did not fail")
        session.close()
    return caught[0], caught[1]


@pytest.mark.parametrize(
    "operation",
    ["get_items", "add_items", "pop_item"],
)
def test_each_failure_has_the_type_sqlitesession_raises(
    vault: Any, vault_db: Path, tmp_path: Path, operation: str
) -> None:
    calls: dict[str, Callable[[Any], Awaitable[Any]]] = {
        "get_items": lambda s: s.get_items(),
        "add_items": lambda s: s.add_items([ITEM]),
        "pop_item": lambda s: s.pop_item(),
    }
    sdk, ours = asyncio.run(
        _sdk_and_vault_errors(vault_db, tmp_path / "plain.db", calls[operation])
    )
    assert isinstance(sdk, sqlite3.Error)
    assert isinstance(ours, type(sdk)), (type(sdk), type(ours).__mro__)
    assert isinstance(ours, VaultError) and ours.message


def test_a_busy_vault_is_an_operational_error_and_vault_busy(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Locked past the wait: sqlite3.OperationalError, as SQLiteSession raises for
    "database is locked", and VaultBusy (exit 5)."""
    monkeypatch.setenv("MEMVAULT_LOCK_TIMEOUT", "0.2")

    async def go() -> None:
        session = vault_pkg.open_session("s", vault_db)
        await session.get_items()  # connected before the lock is taken
        holder = sqlite3.connect(vault_db)
        try:
            holder.execute("BEGIN EXCLUSIVE")
            with pytest.raises(sqlite3.OperationalError) as caught:
                await session.add_items([ITEM])
            assert isinstance(caught.value, VaultBusy) and caught.value.exit_code == 5
        finally:
            holder.rollback()
            holder.close()
        session.close()

    asyncio.run(go())
