"""An open session decrypts each stored item once: a later read decrypts only what is
new, returns new objects, still hides what expired, and sees every change made by the
session itself or by another process (vault.readcache)."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, Runner, SessionSettings
from agents.testing import ScriptedModel, assistant_message
from cryptography.fernet import Fernet

import vault as vault_pkg
from tests.conftest import ROOT, add_items, insert_sealed, run_cli, user
from tests.files.test_import import make_plain
from vault import HistoryTampered, readcache

# Runs another process's write through the real SDK session.
WRITER = """
import asyncio, sys, vault
async def go():
    s = vault.open_session(sys.argv[2], sys.argv[1])
    await s.add_items([{"role": "user", "content": t} for t in sys.argv[3:]])
    s.close()
asyncio.run(go())
"""


@pytest.fixture
def decrypts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many Fernet tokens this process has decrypted (any path: the cache's, the
    SDK's own, the vault's)."""
    count = [0]
    for name in ("decrypt", "decrypt_at_time"):
        real = getattr(Fernet, name)

        def counted(self: Fernet, *a: Any, _real: Any = real, **kw: Any) -> bytes:
            count[0] += 1
            return bytes(_real(self, *a, **kw))

        monkeypatch.setattr(Fernet, name, counted)
    yield count


def read(session: Any, limit: int | None = None) -> list[Any]:
    return list(asyncio.run(session.get_items(limit)))


def fresh_read(db: Path | str, sid: str) -> list[Any]:
    """What a new session, with no cache, reads now."""
    s = vault_pkg.open_session(sid, db, read_cache=False)
    try:
        return read(s)
    finally:
        s.close()


def decrypted_by(count: list[int], call: Any) -> tuple[Any, int]:
    before = count[0]
    result = call()
    return result, count[0] - before


def test_each_turn_of_an_agent_decrypts_only_what_the_last_turn_added(
    vault: Any, vault_db: Path, decrypts: list[int]
) -> None:
    add_items(vault_db, "chat", [user(f"earlier {i}") for i in range(40)])
    model = ScriptedModel([[assistant_message(f"answer {n}")] for n in range(4)])
    agent = Agent(name="t", instructions="be brief", model=model)
    session = vault_pkg.open_session("chat", vault_db)
    per_turn = []

    async def turns() -> None:
        for n in range(4):
            before = decrypts[0]
            await Runner.run(agent, f"question {n}", session=session)
            per_turn.append(decrypts[0] - before)

    asyncio.run(turns())
    # The first turn reads all 40; each later one only the question and answer before it.
    assert per_turn == [40, 2, 2, 2]
    # And the model was sent the whole history every time.
    assert [len(call.input) for call in model.calls] == [41, 43, 45, 47]
    assert read(session) == fresh_read(vault_db, "chat")
    session.close()


def test_a_repeated_read_decrypts_nothing_and_gives_the_same_history(
    vault: Any, vault_db: Path, decrypts: list[int]
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(25)])
    s = vault_pkg.open_session("s", vault_db)
    first, n1 = decrypted_by(decrypts, lambda: read(s))
    second, n2 = decrypted_by(decrypts, lambda: read(s))
    tail, n3 = decrypted_by(decrypts, lambda: read(s, 5))
    assert (n1, n2, n3) == (25, 0, 0)
    assert first == second == fresh_read(vault_db, "s")
    assert tail == first[-5:]
    s.close()


def test_with_the_cache_off_every_read_decrypts_every_item(
    vault: Any, vault_db: Path, decrypts: list[int]
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(12)])
    s = vault_pkg.open_session("s", vault_db, read_cache=False)
    assert not s.read_cache
    counts = [decrypted_by(decrypts, lambda: read(s))[1] for _ in range(3)]
    assert counts == [12, 12, 12]
    s.read_cache = True
    counts = [decrypted_by(decrypts, lambda: read(s))[1] for _ in range(2)]
    assert counts == [12, 0]
    s.close()


def test_what_a_caller_does_to_its_items_never_changes_the_next_read(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}])
    s = vault_pkg.open_session("s", vault_db)
    got = read(s)
    got[0]["role"] = "system"
    got[0]["content"][0]["text"] = "changed by the caller"
    got.append(user("appended by the caller"))
    assert read(s) == [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]
    assert read(s) is not read(s) and read(s)[0] is not read(s)[0]
    s.close()


def test_an_item_that_expires_while_kept_is_hidden_at_the_next_read(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch, decrypts: list[int]
) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "s", [user("nearly an hour old")], now - 3590)
    insert_sealed(vault_db, "s", [user("fresh")], now)
    s = vault_pkg.open_session("s", vault_db)
    assert [i["content"] for i in read(s)] == ["nearly an hour old", "fresh"]
    # 20 s later (Fernet and the cache read the same clock): past the vault's 1 h TTL.
    monkeypatch.setattr(time, "time", lambda: now + 20.0)
    later, n = decrypted_by(decrypts, lambda: read(s))
    assert [i["content"] for i in later] == ["fresh"] and n == 0
    assert later == fresh_read(vault_db, "s")
    assert len(s._reads) == 1  # the expired item's plaintext went with it
    s.close()


def test_an_item_already_expired_is_never_decrypted_into_the_cache(
    vault: Any, vault_db: Path, decrypts: list[int]
) -> None:
    insert_sealed(vault_db, "s", [user("a day old")], int(time.time()) - 86400)
    insert_sealed(vault_db, "s", [user("fresh")])
    s = vault_pkg.open_session("s", vault_db)
    got, n = decrypted_by(decrypts, lambda: read(s))
    assert got == [user("fresh")] and n == 1 and len(s._reads) == 1
    s.close()


def test_a_session_that_reads_a_limited_window_keeps_only_that_window(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(10)])
    s = vault_pkg.open_session("s", vault_db, session_settings=SessionSettings(limit=3))
    assert read(s) == [user(f"item {i}") for i in range(7, 10)] and len(s._reads) == 3
    assert run_cli("clear", "s", "--yes").code == 0
    add_items(vault_db, "s", [user("after the clear")])
    assert read(s) == [user("after the clear")] and len(s._reads) == 1
    s.close()


def test_a_ttl_changed_by_another_process_applies_to_what_is_kept(
    vault: Any, vault_db: Path
) -> None:
    insert_sealed(vault_db, "s", [user("ten minutes old")], int(time.time()) - 600)
    insert_sealed(vault_db, "s", [user("fresh")])
    s = vault_pkg.open_session("s", vault_db)
    assert len(read(s)) == 2
    assert run_cli("ttl", "5m").code == 0
    assert [i["content"] for i in read(s)] == ["fresh"]
    s.close()


def test_the_sessions_own_pop_and_clear_are_seen_and_drop_what_was_kept(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(6)])
    s = vault_pkg.open_session("s", vault_db)
    assert len(read(s)) == 6 and len(s._reads) == 6
    popped = asyncio.run(s.pop_item())
    assert popped == user("item 5") and len(s._reads) == 0
    assert read(s) == fresh_read(vault_db, "s") and len(read(s)) == 5
    asyncio.run(s.add_items([user("after the pop")]))
    assert read(s)[-1] == user("after the pop") and read(s) == fresh_read(vault_db, "s")
    asyncio.run(s.clear_session())
    assert len(s._reads) == 0 and read(s) == []
    s.close()


@pytest.mark.sweep
@pytest.mark.parametrize(
    "change",
    ["write", "pop", "pop then write", "clear", "rotate", "purge", "import"],
)
def test_a_change_made_by_another_process_is_seen_by_the_next_read(
    vault: Any, vault_db: Path, tmp_path: Path, change: str
) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "s", [user("two hours old")], now - 7200)
    add_items(vault_db, "s", [user(f"item {i}") for i in range(8)])
    s = vault_pkg.open_session("s", vault_db)
    before = read(s)
    assert len(before) == 8

    def writer(*texts: str) -> None:
        proc = [sys.executable, "-c", WRITER, str(vault_db), "s", *texts]
        import subprocess

        subprocess.run(proc, check=True, cwd=ROOT, timeout=120)

    if change == "write":
        writer("from another process")
    elif change == "pop":
        assert run_cli("pop", "s", "-n", "2").code == 0
    elif change == "pop then write":
        assert run_cli("pop", "s").code == 0
        writer("in its place", "and one more")
    elif change == "clear":
        assert run_cli("clear", "s", "--yes").code == 0
    elif change == "rotate":
        assert run_cli("rotate", "--yes").code == 0
    elif change == "purge":
        assert run_cli("purge", "--yes").code == 0
    else:
        plain = tmp_path / "plain.db"
        make_plain(plain, {"other": [user("imported")]})
        r = run_cli("import", str(plain))
        assert r.code == 0, r
    after = read(s)
    assert after == fresh_read(vault_db, "s")
    expected = {
        "write": 9,
        "pop": 6,
        "pop then write": 9,
        "clear": 0,
        "rotate": 8,
        "purge": 8,
        "import": 8,
    }[change]
    assert len(after) == expected
    s.close()


def test_rows_rewritten_under_an_open_session_are_never_served_and_a_new_one_refuses_them(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(5)])
    s = vault_pkg.open_session("s", vault_db)
    honest = read(s)
    conn = sqlite3.connect(vault_db)
    with conn:  # swap the first two rows' contents, links and all: no key needed
        (a, da, la), (b, db, lb) = conn.execute(
            "SELECT id, message_data, chain FROM agent_messages ORDER BY id LIMIT 2"
        ).fetchall()
        conn.execute(
            "UPDATE agent_messages SET message_data = ?, chain = ? WHERE id = ?", (db, lb, a)
        )
        conn.execute(
            "UPDATE agent_messages SET message_data = ?, chain = ? WHERE id = ?", (da, la, b)
        )
    conn.close()
    # The open session keeps serving the history it verified, never the swapped one;
    assert read(s) == honest
    # a session opened now (the agent's next run) refuses the file, as verify does.
    with pytest.raises(HistoryTampered):
        read(vault_pkg.open_session("s", vault_db))
    assert run_cli("verify").code == 1
    s.close()


@pytest.mark.parametrize("read_first", [True, False], ids=["after-a-read", "before-any-read"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
def test_a_file_made_to_look_unchained_under_an_open_session_is_refused(
    vault: Any, vault_db: Path, cache: bool, read_first: bool
) -> None:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(5)])
    s = vault_pkg.open_session("s", vault_db, read_cache=cache)
    if read_first:
        read(s)
    conn = sqlite3.connect(vault_db)
    with conn:  # say "never chained", then swap two rows: nothing here needs the key
        conn.execute("UPDATE memvault_meta SET value = 'building' WHERE key = 'chain'")
        conn.execute("DELETE FROM memvault_vault_head")  # which would say "chained"
        (a, da), (b, db) = conn.execute(
            "SELECT id, message_data FROM agent_messages ORDER BY id LIMIT 2"
        ).fetchall()
        conn.execute("UPDATE agent_messages SET message_data = ? WHERE id = ?", (db, a))
        conn.execute("UPDATE agent_messages SET message_data = ? WHERE id = ?", (da, b))
    conn.close()
    # The session opened a chained file; nothing unchains one, so this is tampering.
    with pytest.raises(HistoryTampered) as caught:
        read(s)
    assert caught.value.kind == "replaced by an older copy" and caught.value.session_id == "s"
    s.close()


def test_a_history_longer_than_the_bound_is_read_right_without_keeping_it_all(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch, decrypts: list[int]
) -> None:
    monkeypatch.setattr(readcache, "MAX_ITEMS", 10)
    add_items(vault_db, "s", [user(f"item {i}") for i in range(25)])
    s = vault_pkg.open_session("s", vault_db)
    first, n1 = decrypted_by(decrypts, lambda: read(s))
    second, n2 = decrypted_by(decrypts, lambda: read(s))
    assert first == second == fresh_read(vault_db, "s") and len(first) == 25
    assert len(s._reads) == 10 and s.underlying_session.chain.memo is None
    assert (n1, n2) == (25, 15)
    s.close()


def test_close_drops_what_was_kept(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("kept until close")])
    s = vault_pkg.open_session("s", vault_db)
    read(s)
    assert len(s._reads) == 1
    s.close()
    assert len(s._reads) == 0
