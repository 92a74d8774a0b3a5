"""Writers and readers that outlive rotations (issue 3, point 4).

Real processes write and read through `vault.open_session(...)` while the test
rotates the key again and again. Afterwards nothing is stored under a retired
key id, every write the writer reported as done is there and readable, no write
failed (writers wait for the lock and reseal after a rotation), and no read
returned an empty or partial history.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chainkit import insert_chained
from tests.conftest import add_items, assistant, run_cli, user
from vault import crypto
from vault.engines.sqlite.vault import Vault

ROOT = Path(__file__).resolve().parents[2]
ROTATIONS = 20

WRITER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    import vault

    async def main(db, sid, stop, interval):
        s = vault.open_session(sid, db)
        print(json.dumps({"ready": True}), flush=True)
        n = 0
        while not os.path.exists(stop):
            item = {"role": "user", "content": f"{sid} write {n}"}
            t0 = time.monotonic()
            try:
                await s.add_items([item])
            except BaseException as exc:
                out = {"failed": n, "error": f"{type(exc).__name__}: {exc}"}
            else:
                out = {"ok": n, "kid": s._kid, "waited": time.monotonic() - t0}
            print(json.dumps(out), flush=True)
            n += 1
            await asyncio.sleep(interval)
        s.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
    """
)

READER = textwrap.dedent(
    """
    import asyncio, json, os, sys
    import vault

    async def main(db, sid, stop, expected_file):
        expected = json.load(open(expected_file))
        s = vault.open_session(sid, db)
        print(json.dumps({"ready": True}), flush=True)
        while not os.path.exists(stop):
            try:
                items = await s.get_items()
            except BaseException as exc:
                out = {"error": f"{type(exc).__name__}: {exc}"}
            else:
                out = {"n": len(items), "full": items == expected, "kid": s._kid}
            print(json.dumps(out), flush=True)
            await asyncio.sleep(0.002)
        s.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)


class Lines(list[dict[str, Any]]):
    """The lines a child printed so far, filled live by a reader thread."""

    def wait_for(self, what: str, pred: Any, timeout: float = 90.0) -> None:
        """Block until a printed line satisfies `pred`: progress, not wall time, paces a test."""
        deadline = time.monotonic() + timeout
        while not any(pred(line) for line in list(self)):
            if time.monotonic() > deadline:
                raise AssertionError(f"child never {what}; last lines: {list(self)[-5:]}")
            time.sleep(0.01)


@contextlib.contextmanager
def child(script: str, *args: str, stop: Path) -> Iterator[Lines]:
    """Run a writer/reader process until the block ends; yields the lines it prints."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    if json.loads(first or "{}").get("ready") is not True:
        proc.kill()
        raise AssertionError(f"child did not start: {first!r} {proc.communicate()[1][-2000:]}")
    lines = Lines()
    errors: list[str] = []
    out, err = proc.stdout, proc.stderr

    def pump() -> None:
        for line in out:
            if line.strip():
                lines.append(json.loads(line))

    pumps = [
        threading.Thread(target=pump, daemon=True),
        threading.Thread(target=lambda: errors.append(err.read()), daemon=True),
    ]
    for t in pumps:
        t.start()
    try:
        yield lines
    finally:
        stop.touch()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for t in pumps:
            t.join(timeout=30)
        assert proc.returncode == 0, "".join(errors)[-3000:]


def ballast(db: Path, sealer: crypto.Sealer, n: int) -> None:
    """Enough items in other sessions that each rotation holds the write lock a while."""
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        for k in range(8):
            conn.execute("INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", (f"b{k}",))
        insert_chained(
            conn,
            sealer,
            [
                (f"b{i % 8}", sealer.seal(f"b{i % 8}", user(f"ballast {i} " + "z" * 80)))
                for i in range(n)
            ],
        )
        conn.execute("COMMIT")


def stored(db: Path) -> list[tuple[str, dict[str, Any]]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [
            (sid, json.loads(data))
            for sid, data in conn.execute(
                "SELECT session_id, message_data FROM agent_messages ORDER BY id"
            )
        ]


def file_kid(db: Path) -> str:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return str(conn.execute("SELECT value FROM memvault_meta WHERE key = 'kid'").fetchone()[0])


@pytest.mark.slow
def test_writer_survives_twenty_rotations(vault: Vault, vault_db: Path, tmp_path: Path) -> None:
    ballast(vault_db, vault.sealer(), 3000)
    stop = tmp_path / "stop-writer"
    kids = [vault.sealer().kid]
    rng = random.Random(7)
    with child(WRITER, str(vault_db), "agent", str(stop), "0.004", stop=stop) as lines:
        lines.wait_for("wrote", lambda line: "ok" in line)
        for _ in range(ROTATIONS):
            report = vault.rotate()
            assert report.counts["old_kid"] == kids[-1]
            kids.append(report.counts["new_kid"])
            # Paced by the writer's progress, not the clock: it must store under the new key
            # (a busy machine can starve it for seconds), then a little more, at random.
            new = kids[-1]
            lines.wait_for(f"wrote under {new}", lambda line, k=new: line.get("kid") == k)
            time.sleep(rng.uniform(0.0, 0.1))

    failed = [line for line in lines if "failed" in line]
    ok = [line for line in lines if "ok" in line]
    assert failed == [], failed[:5]
    assert len(ok) >= ROTATIONS + 1, len(ok)
    # The writer really met the rotations: it waited for the lock and moved through the keys.
    assert max(line["waited"] for line in ok) >= 0.05
    used = collections.Counter(line["kid"] for line in ok)
    assert set(used) <= set(kids)
    assert len(used) == ROTATIONS + 1, used  # a write under every key, never a failure

    final = file_kid(vault_db)
    assert final == kids[-1]
    retired = set(kids[:-1])
    rows = stored(vault_db)
    assert [env["kid"] for _, env in rows if env["kid"] in retired] == []
    assert {env["kid"] for _, env in rows} == {final}

    # Every write the writer reported is present, in order, and readable; nothing else is.
    fresh = Vault.open(vault_db)
    items, expired, unreadable = fresh.items("agent")
    assert (expired, unreadable) == (0, 0)
    assert items == [user(f"agent write {line['ok']}") for line in ok]
    # Twenty rotations re-MACed every row and head under a writer: no false alarm.
    report = Vault.verify(vault_db)
    assert report.problems["history_chain"] == 0, report.details


@pytest.mark.slow
def test_writer_waits_longer_than_the_sdk_busy_timeout(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """The SDK gives up after 5 s of lock; a vault session keeps waiting (like a long rotate)."""
    stop = tmp_path / "stop-writer"
    hold = 6.5
    with child(WRITER, str(vault_db), "agent", str(stop), "0.01", stop=stop) as lines:
        lines.wait_for("wrote", lambda line: "ok" in line)
        with contextlib.closing(sqlite3.connect(vault_db, isolation_level=None)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            time.sleep(hold)
            conn.execute("COMMIT")
        time.sleep(0.3)
    assert [line for line in lines if "failed" in line] == []
    ok = [line for line in lines if "ok" in line]
    assert max(line["waited"] for line in ok) >= hold - 1.0
    items, _, _ = Vault.open(vault_db).items("agent")
    assert items == [user(f"agent write {line['ok']}") for line in ok]


def test_session_opened_before_rotation_reads_full_history(vault: Vault, vault_db: Path) -> None:
    history = [user(f"q{i}") if i % 2 == 0 else assistant(f"a{i}") for i in range(40)]

    async def go() -> None:
        s = vault.session("chat")
        await s.add_items(history)
        assert await s.get_items() == history
        old_kid = s._kid

        r = run_cli("rotate")  # another process
        assert r.code == 0, r
        assert file_kid(vault_db) != old_kid

        assert await s.get_items() == history  # never empty, never partial
        assert await s.get_items(limit=5) == history[-5:]
        assert s._kid == file_kid(vault_db)

        # Writes and pops after yet another rotation, still from the same object.
        assert run_cli("rotate").code == 0
        await s.add_items([user("after two rotations")])
        assert await s.get_items() == [*history, user("after two rotations")]
        assert run_cli("rotate").code == 0
        assert await s.pop_item() == user("after two rotations")
        assert await s.get_items() == history
        s.close()

    asyncio.run(go())
    rows = stored(vault_db)
    assert {env["kid"] for _, env in rows} == {file_kid(vault_db)}
    assert Vault.open(vault_db).items("chat") == (history, 0, 0)


@pytest.mark.slow
def test_readers_never_see_partial_history_during_rotations(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    history = [user(f"m{i}") for i in range(60)]
    add_items(vault_db, "chat", history)
    ballast(vault_db, vault.sealer(), 1500)
    expected_file = tmp_path / "expected.json"
    expected_file.write_text(json.dumps(history))
    stops = [tmp_path / f"stop-{i}" for i in range(2)]
    with contextlib.ExitStack() as stack:
        readers = [
            stack.enter_context(
                child(READER, str(vault_db), "chat", str(stop), str(expected_file), stop=stop)
            )
            for stop in stops
        ]
        for lines in readers:
            lines.wait_for("read", lambda line: "full" in line)
        for _ in range(ROTATIONS):
            new = vault.rotate().counts["new_kid"]
            # Paced by progress: each reader must have read under the new key before the next
            # rotation, however slow a busy machine makes it.
            for lines in readers:
                lines.wait_for(f"read under {new}", lambda line, k=new: line.get("kid") == k)
        for stop in stops:
            stop.touch()
    seen: set[str] = set()
    for lines in readers:
        bad = [line for line in lines if not line.get("full")]
        assert bad == [], bad[:5]
        assert len(lines) >= ROTATIONS + 1
        kids = {line["kid"] for line in lines}
        assert len(kids) == ROTATIONS + 1, kids  # each reader lived through every rotation
        seen |= kids
    assert len(seen) == ROTATIONS + 1, seen
    # The readers' key refreshes (and promotions) left the vault and keyring consistent.
    st = run_cli("--json", "status")
    assert st.code == 0 and st.json()["key"] == "present and matching", st


def test_rotation_between_read_and_decrypt_never_empties_a_read(
    vault: Vault, vault_db: Path
) -> None:
    """Deterministic version of the race above: the session's SELECT returns rows under
    one key, then another process rotates again before they are decrypted."""
    history = [user(f"r{i}") for i in range(12)]

    async def go() -> None:
        s = vault.session("chat")
        await s.add_items(history)
        assert await s.get_items() == history
        assert run_cli("rotate").code == 0  # the session still holds the key before this
        underlying = s.underlying_session
        select = underlying.get_items
        rotated_meanwhile: list[bool] = []

        async def select_then_rotate(*args: Any, **kwargs: Any) -> Any:
            rows = await select(*args, **kwargs)
            if not rotated_meanwhile:
                rotated_meanwhile.append(run_cli("rotate").code == 0)
            return rows

        underlying.get_items = select_then_rotate
        try:
            assert await s.get_items() == history  # never empty, never partial
        finally:
            del underlying.get_items
        assert rotated_meanwhile == [True]
        assert s._kid == file_kid(vault_db)
        s.close()

    asyncio.run(go())
