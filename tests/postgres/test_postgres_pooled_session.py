"""The PostgreSQL agent session's pooled connections: one pool per event loop, closed when
the loop ends, and every operation still seeing what another process changed (TTL, key,
revoke) since the last one, on the same pooled connection.

Run with `scripts/with-postgres scripts/test -q -m postgres
tests/postgres/test_postgres_pooled_session.py`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.pgserver import MARKS, insert_sealed, sql

pytestmark = MARKS


@pytest.fixture
def opened() -> Iterator[list[int]]:
    """The server pid of every connection a SQLAlchemy pool of this process opens."""
    from sqlalchemy import event
    from sqlalchemy.pool import Pool

    pids: list[int] = []

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        pids.append(dbapi_connection.driver_connection.get_server_pid())

    event.listen(Pool, "connect", on_connect)
    yield pids
    event.remove(Pool, "connect", on_connect)


def alive(url: str, pids: list[int]) -> set[int]:
    rows = sql(url, "SELECT pid FROM pg_stat_activity WHERE pid = ANY($1::int[])", args=(pids,))
    return {r["pid"] for r in rows}


def all_gone(url: str, pids: list[int]) -> set[int]:
    """The pids still connected once the server has ended the closed ones (it does so
    right after the client's goodbye, asynchronously): empty when nothing leaked."""
    deadline = time.monotonic() + 10
    left = alive(url, pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = alive(url, pids)
    return left


def texts(items: list[Any]) -> list[str]:
    return [i["content"] for i in items]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_operations_on_one_loop_share_one_connection_closed_when_the_loop_ends(
    pg_vault: Any, pg_url: str, opened: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    import vault

    session = vault.open_session("s1", pg_url)

    async def go() -> set[int]:
        await session.add_items([user("one")])
        assert texts(await session.get_items()) == ["one"]
        await session.add_items([user("two")])
        assert texts(await session.get_items(1)) == ["two"]
        return await asyncio.to_thread(alive, pg_url, list(opened))

    caplog.set_level(logging.DEBUG, logger="asyncio")
    gc.collect()  # what earlier tests left is finalized before the check, not inside it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        during = asyncio.run(go())
        gc.collect()  # any finalizer left behind runs now, inside the check
    assert len(opened) == 1, f"four operations opened {len(opened)} connections, not one pool's"
    assert during == set(opened), "the pooled connection was not open between operations"
    assert all_gone(pg_url, opened) == set(), "the loop ended, its pool's connection stayed open"
    left = [w for w in caught if "loop" in str(w.message) or w.category is ResourceWarning]
    assert not left, [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in left]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_one_session_object_works_from_successive_loops_and_a_thread_with_its_own(
    pg_vault: Any, pg_url: str, opened: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    import vault

    session = vault.open_session("s1", pg_url)
    caplog.set_level(logging.DEBUG, logger="asyncio")
    asyncio.run(session.add_items([user("first loop")]))
    assert texts(asyncio.run(session.get_items())) == ["first loop"]
    # The previous loops' connections are closed already; two new loops opened one each.
    assert len(opened) == 2
    assert all_gone(pg_url, opened) == set()

    def in_a_thread() -> list[str]:
        async def go() -> list[str]:
            await session.add_items([user("thread")])
            return texts(await session.get_items())

        return asyncio.run(go())

    async def main_loop_while_a_thread_runs_its_own() -> list[str]:
        await session.add_items([user("main")])
        from_thread = await asyncio.to_thread(in_a_thread)  # a loop of its own, meanwhile
        assert from_thread == ["first loop", "main", "thread"]
        return texts(await session.get_items())

    assert asyncio.run(main_loop_while_a_thread_runs_its_own()) == [
        "first loop",
        "main",
        "thread",
    ]
    done: list[list[str]] = []
    t = threading.Thread(target=lambda: done.append(in_a_thread()))
    t.start()
    t.join()
    assert done == [["first loop", "main", "thread", "thread"]]
    gc.collect()
    assert len(opened) == 5, "one connection per loop: two, then two at once, then one"
    assert all_gone(pg_url, opened) == set()
    assert "Event loop is closed" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_ttl_change_by_another_process_reaches_the_next_operation_on_a_pooled_connection(
    pg_vault: Any, pg_url: str, opened: list[int]
) -> None:
    import vault

    # pg_vault's TTL is 1h: an item sealed 2h ago is expired, one sealed now is not.
    insert_sealed(pg_url, "s1", ["two hours old"], int(time.time()) - 7200)
    insert_sealed(pg_url, "s1", ["fresh"], None)
    session = vault.open_session("s1", pg_url)

    async def go() -> None:
        assert texts(await session.get_items()) == ["fresh"]
        for ttl, seen in (("3h", ["two hours old", "fresh"]), ("1h", ["fresh"])):
            assert (await asyncio.to_thread(run_cli, "--db", pg_url, "ttl", ttl)).code == 0
            assert texts(await session.get_items()) == seen, ttl
        assert (await asyncio.to_thread(run_cli, "--db", pg_url, "ttl", "never")).code == 0
        assert texts(await session.get_items()) == ["two hours old", "fresh"]

    asyncio.run(go())
    assert len(opened) == 1, "the reads did not share the pooled connection"


def test_a_rotation_by_another_process_reaches_the_next_operation_on_a_pooled_connection(
    pg_vault: Any, pg_url: str, opened: list[int]
) -> None:
    import vault

    session = vault.open_session("s1", pg_url)
    old_kid = session._kid

    async def go() -> None:
        await session.add_items([user("before the rotation")])
        r = await asyncio.to_thread(run_cli, "--db", pg_url, "--json", "rotate")
        assert r.code == 0, r.err
        # The write is sealed under the old key first: the guard refuses it, the session
        # reloads the key and stores it under the new one.
        await session.add_items([user("after the rotation")])
        assert session._kid != old_kid
        assert texts(await session.get_items()) == ["before the rotation", "after the rotation"]
        r = await asyncio.to_thread(run_cli, "--db", pg_url, "--json", "rotate")
        assert r.code == 0, r.err
        # A read first this time: the rows are under a key the session has not loaded.
        assert texts(await session.get_items()) == ["before the rotation", "after the rotation"]

    asyncio.run(go())
    assert len(opened) == 1, "the operations did not share the pooled connection"
    rows = sql(pg_url, "SELECT message_data FROM agent_messages")
    assert {json.loads(r["message_data"])["kid"] for r in rows} == {session._kid}


def test_a_revoke_by_another_process_reaches_the_next_operation_on_a_pooled_connection(
    pg_vault: Any, pg_url: str, opened: list[int]
) -> None:
    import vault
    from vault.errors import KeyRevoked

    session = vault.open_session("s1", pg_url)

    async def go() -> None:
        await session.add_items([user("before the revoke")])
        assert texts(await session.get_items()) == ["before the revoke"]
        r = await asyncio.to_thread(run_cli, "--db", pg_url, "revoke", "--yes")
        assert r.code == 0, r.err
        # The key is still in this process's memory and the row's envelope names it: only
        # the vault's meta, read on the pooled connection, says the history is cut off.
        with pytest.raises(KeyRevoked) as read:
            await session.get_items()
        assert read.value.exit_code == 4
        with pytest.raises(KeyRevoked):
            await session.add_items([user("after the revoke")])

    asyncio.run(go())
    assert len(opened) == 1, "the operations did not share the pooled connection"
    assert len(sql(pg_url, "SELECT id FROM agent_messages")) == 1


def test_a_pooled_connection_the_server_ended_is_replaced_and_the_operation_goes_on(
    pg_vault: Any, pg_url: str, opened: list[int]
) -> None:
    import vault

    session = vault.open_session("s1", pg_url)

    async def go() -> list[str]:
        await session.add_items([user("before")])
        # As a server restart or an operator's pg_terminate_backend would.
        await asyncio.to_thread(sql, pg_url, f"SELECT pg_terminate_backend({opened[0]})")
        await session.add_items([user("after")])
        return texts(await session.get_items())

    assert asyncio.run(go()) == ["before", "after"]
    assert len(opened) == 2


def test_a_write_whose_connection_drops_at_its_commit_is_reported_not_written_twice(
    pg_vault: Any, pg_url: str, opened: list[int]
) -> None:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    import vault
    from vault.errors import VaultError

    session = vault.open_session("s1", pg_url)
    asyncio.run(session.add_items([user("before")]))

    left: list[set[int]] = []

    def end_at_commit(connection: Any) -> None:
        # The server ends the backend after the write's INSERT, before its COMMIT arrives:
        # whether a COMMIT lost in flight took effect is unknown to the client, so a
        # second write could store the turn twice.
        if left:
            return  # the first COMMIT only: a second attempt would be let through
        pid = connection.connection.driver_connection.get_server_pid()

        def end() -> None:  # its own thread: sql() runs a loop, and this one is running
            sql(pg_url, f"SELECT pg_terminate_backend({pid})")
            left.append(all_gone(pg_url, [pid]))

        killer = threading.Thread(target=end)
        killer.start()
        killer.join()
        assert left == [set()]

    event.listen(Engine, "commit", end_at_commit)
    try:
        with pytest.raises(VaultError):
            asyncio.run(session.add_items([user("cut at its commit")]))
    finally:
        event.remove(Engine, "commit", end_at_commit)
    assert texts(asyncio.run(session.get_items())) == ["before"]


def test_a_loop_closed_without_its_shutdown_leaves_no_connection_once_another_loop_runs(
    pg_vault: Any, pg_url: str, opened: list[int]
) -> None:
    import vault

    session = vault.open_session("s1", pg_url)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(session.add_items([user("one")]))
    loop.close()  # no shutdown_asyncgens(): its pool cannot be closed on its loop
    del loop
    with warnings.catch_warnings():
        # asyncpg and asyncio warn of the connection dropped with its closed loop.
        warnings.simplefilter("ignore", ResourceWarning)
        assert texts(asyncio.run(session.get_items())) == ["one"]
        gc.collect()
    assert len(opened) == 2
    assert all_gone(pg_url, opened) == set(), "the closed loop's connection stayed open"
