"""A process's own writes are states it knows, as its reads are: the file put back to a
copy from just before one, within the anchor's interval (no record reached the anchor),
is told by its next read, and its next write is refused. An open agent session's
`add_items`, `pop_item` and `clear_session`; a library `Vault` object's `pop`, `clear`,
`purge`, import and `rotate`. Real file, real keyring, the real SDK."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import add_items, user
from tests.files.test_import import make_plain
from tests.security.test_whole_file_rollback import copy_of, file_seq, put_back
from vault import HistoryTampered, Vault
from vault.chaincheck import Tamper

ROLLED_BACK = Tamper.FILE_ROLLED_BACK.value

pytestmark = pytest.mark.secret_service


async def _wrote(s: Any, _mp: pytest.MonkeyPatch, _db: Path) -> None:
    await s.add_items([user("taken away")])


async def _popped(s: Any, _mp: pytest.MonkeyPatch, _db: Path) -> None:
    assert (await s.pop_item())["content"] == "kept"


async def _cleared(s: Any, _mp: pytest.MonkeyPatch, _db: Path) -> None:
    await s.clear_session()


async def _cancelled_as_it_wrote(s: Any, mp: pytest.MonkeyPatch, db: Path) -> None:
    """`add_items` cancelled while its insert runs: the SDK lets the write finish and
    commit, then raises the cancellation."""
    from vault.engines.sqlite import chainsession

    real, started, go = chainsession.insert_items, threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        started.set()
        go.wait(30)
        return real(*args, **kwargs)

    mp.setattr(chainsession, "insert_items", held)
    task = asyncio.ensure_future(s.add_items([user("taken away, though cancelled")]))
    assert await asyncio.to_thread(started.wait, 30)
    task.cancel()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    mp.setattr(chainsession, "insert_items", real)
    # Stored, seen from another connection: a read of the session's own would raise its
    # floor whatever the write did.
    with contextlib.closing(sqlite3.connect(db)) as conn:
        sql = "SELECT message_data FROM agent_messages ORDER BY id DESC"
        (last,) = conn.execute(sql).fetchone()
    assert "gAAAA" in last  # an envelope: the write went through


_OWN_STEPS: dict[str, Callable[[Any, pytest.MonkeyPatch, Path], Awaitable[None]]] = {
    "add_items": _wrote,
    "pop_item": _popped,
    "clear_session": _cleared,
    "add_items cancelled as it committed": _cancelled_as_it_wrote,
}


@pytest.mark.parametrize("step", sorted(_OWN_STEPS))
def test_a_session_tells_a_copy_from_before_its_own_step(
    vault: Vault, vault_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """A session's own committed write, pop or clear is a state it knows, as one it
    read: the file put back to a copy from just before it (the popped or cleared items
    back in place), within the interval (the anchor never saw it), is told by the
    session's next read and write. So is a write whose caller was cancelled while its
    commit went through."""
    import vault as vault_pkg

    add_items(vault_db, "s", [user("first")])

    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db, anchor_every=3600)
        try:
            await s.add_items([user("kept")])  # its first write: recorded
            before = copy_of(vault_db, tmp_path / "before.db")
            await _OWN_STEPS[step](s, monkeypatch, vault_db)
            put_back(before, vault_db)
            seq = file_seq(vault_db)
            with pytest.raises(HistoryTampered) as caught:
                await s.get_items()
            assert caught.value.kind == ROLLED_BACK
            with pytest.raises(HistoryTampered):
                await s.add_items([user("not written on the copy")])
            assert file_seq(vault_db) == seq
        finally:
            s.close()

    asyncio.run(go())


@pytest.mark.parametrize("change", ["pop", "clear", "purge", "import", "rotate"])
def test_a_vault_object_tells_a_copy_from_before_its_own_writes(
    vault: Vault, vault_db: Path, tmp_path: Path, change: str
) -> None:
    """The library's `Vault.pop`, `clear`, `purge`, import and `rotate` are states the
    object knows, as its reads are: a copy from just before one, put back while the
    object is open (no record reached the anchor), is told by its next read, and its
    next write is refused. Rotate's case keeps the old key (a backup uses it): without
    it, a copy from before the rotation is refused as unreadable, its key gone."""
    add_items(vault_db, "s", [user("first"), user("second")])
    src = tmp_path / "carnet.db"
    make_plain(src, {"u": [user("imported")]})
    v = Vault.open(vault_db)
    assert len(v.items("s")[0]) == 2  # read: the floor is at this state
    before = copy_of(vault_db, tmp_path / "before.db")
    if change == "pop":
        v.pop("s")
    elif change == "clear":
        v.clear("s")
    elif change == "purge":
        assert v.purge(now=int(time.time()) + 7200).counts["deleted"] == 2  # past the TTL
    elif change == "import":
        v.importer(str(src), session_id="u").run()
    else:
        v.backup(tmp_path / "kept.db")  # keeps the old key: the copy stays readable
        before = copy_of(vault_db, tmp_path / "before.db")
        v.rotate()
    put_back(before, vault_db)
    seq = file_seq(vault_db)
    with pytest.raises(HistoryTampered) as caught:
        v.items("s")
    assert caught.value.kind == ROLLED_BACK
    with pytest.raises(HistoryTampered):
        v.pop("s")
    assert file_seq(vault_db) == seq
