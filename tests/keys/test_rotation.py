"""Rotation, scrub and revocation (issue 3, points 1, 3 and 5).

Every test runs against the private Secret Service started by scripts/test and
real SQLite files; the CLI is always a real subprocess (`python -m vault`).

A note on the scrub tests: SQLite checkpoints the WAL into the database and
deletes the WAL when the *last* connection to a file closes. A test in which
nothing else has the file open would therefore see no residue even without a
scrub, and prove nothing. The scrub tests keep a "bystander" connection open
(what a running agent does), and the control tests show that, with the scrub
disabled, the scanner does find the replaced and deleted tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet

from tests.chainkit import insert_chained
from tests.conftest import (
    CLIResult,
    add_items,
    assistant,
    keyring_items,
    raw_bytes,
    run_cli,
    user,
)
from vault import crypto
from vault.engines.sqlite.vault import Vault
from vault.errors import KeyRevoked
from vault.keyjournal import entry_name
from vault.keys import SERVICE
from vault.vaultops import tally

KILLED = -signal.SIGKILL


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------
def db_meta(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())


def rows(db: Path) -> list[tuple[int, str, dict[str, Any]]]:
    """(id, session_id, envelope) of every stored item, in id order."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [
            (rid, sid, json.loads(data))
            for rid, sid, data in conn.execute(
                "SELECT id, session_id, message_data FROM agent_messages ORDER BY id"
            )
        ]


def tokens(db: Path, session_id: str | None = None) -> list[str]:
    return [env["payload"] for _, sid, env in rows(db) if session_id in (None, sid)]


# A token is cut into chunks of this many characters and each is searched for: an item
# larger than a page spills into overflow pages, and any of them could be left behind.
CHUNK = 32


def residue(db: Path, toks: list[str]) -> list[str]:
    """The tokens of which any chunk still occurs in the db, -wal, -shm or -journal."""
    data = raw_bytes(db)
    return [
        t
        for t in toks
        if any(
            t[i : i + CHUNK].encode("ascii") in data for i in range(0, len(t) - CHUNK + 1, CHUNK)
        )
    ]


# Larger than a 4096-byte page once sealed: its token fills overflow pages.
BIG = "overflow " * 1000


def insert_sealed(
    db: Path, sealer: crypto.Sealer, session_id: str, items: list[tuple[Any, int]]
) -> None:
    """Store items sealed at chosen Fernet timestamps (the guard triggers accept them)."""
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", (session_id,))
        insert_chained(
            conn, sealer, [(session_id, sealer.seal(session_id, item, ts)) for item, ts in items]
        )
        conn.execute("COMMIT")


def insert_raw(db: Path, session_id: str, message_data: str) -> None:
    """A row as someone without the key writes it: any text for its chain link."""
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute(
            "INSERT INTO agent_messages (session_id, message_data, chain) VALUES (?, ?, 'x')",
            (session_id, message_data),
        )


def keyring_secrets() -> list[tuple[dict[str, str], str]]:
    """Every secret in every collection of the session's keyring."""
    return keyring_items()


def vault_entries(vault_id: str) -> dict[str, str]:
    """The key entries of one vault: username -> secret (its anchor holds no key)."""
    return {
        attrs["username"]: secret
        for attrs, secret in keyring_secrets()
        if attrs.get("service") == SERVICE
        and attrs.get("username", "").startswith((vault_id + "/", vault_id + "."))
        and attrs["username"] != f"{vault_id}/anchor"
        or attrs.get("username") == vault_id
    }


BYSTANDER = textwrap.dedent(
    """
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("SELECT count(*) FROM memvault_meta").fetchone()
    print("ready", flush=True)
    sys.stdin.read()
    conn.close()
    """
)


@contextlib.contextmanager
def bystander(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process with the file open but idle (not in a transaction), like an agent.

    It keeps the WAL alive: without it, whichever connection closes last checkpoints
    the WAL and deletes it, which would hide the residue a missing scrub leaves.
    """
    with _child(BYSTANDER, db) as proc:
        yield proc


@contextlib.contextmanager
def _child(script: str, db: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


READER = textwrap.dedent(
    """
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN")
    conn.execute("SELECT count(*), max(length(message_data)) FROM agent_messages").fetchone()
    print("ready", flush=True)
    sys.stdin.read()
    conn.execute("COMMIT")
    conn.close()
    """
)


@contextlib.contextmanager
def reader_holding_snapshot(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process with `BEGIN; SELECT ...` open on the file: it blocks checkpoints."""
    with _child(READER, db) as proc:
        yield proc


def end_reader(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=20) == 0


def one_line_error(r: CLIResult) -> str:
    err = r.err.strip()
    assert err.count("\n") == 0, r
    assert "Traceback" not in err, r
    assert err.startswith("memvault: error:"), r
    return err


def populate_with_a_big_item(db: Path) -> dict[str, list[Any]]:
    """populate's sessions, and in chat-a one item whose token spans overflow pages."""
    expected = populate(db)
    add_items(db, "chat-a", [user(BIG)])
    expected["chat-a"].append(user(BIG))
    assert max(len(t) for t in tokens(db, "chat-a")) > 4096
    return expected


def populate(db: Path) -> dict[str, list[Any]]:
    """Three sessions through the real SDK session; returns what each should hold."""
    expected = {
        "chat-a": [user(f"alpha {i}") for i in range(6)] + [assistant("alpha done")],
        "chat-b": [user("bravo"), assistant("bravo reply")],
        "chat-c": [user(f"charlie {i}") for i in range(4)],
    }
    for sid, items in expected.items():
        add_items(db, sid, items)
    return expected


# --------------------------------------------------------------------------
# Rotation
# --------------------------------------------------------------------------
def test_rotate_reencrypts_everything_keeps_timestamps_and_forgets_old_key(
    vault: Vault, vault_db: Path
) -> None:
    expected = populate(vault_db)
    old = vault.sealer()
    now = int(time.time())
    # Items with chosen ages: their life must not be extended by the rotation.
    aged = [({"role": "user", "content": f"aged {age}"}, now - age) for age in (3000, 1200, 60)]
    insert_sealed(vault_db, old, "chat-aged", aged)
    insert_sealed(vault_db, old, "chat-aged", [({"role": "user", "content": "stale"}, now - 7200)])
    vault_id = vault.vault_id
    before = rows(vault_db)
    ts_before = {rid: crypto.token_timestamp(json.dumps(env)) for rid, _, env in before}
    assert all(ts is not None for ts in ts_before.values())
    assert {env["kid"] for _, _, env in before} == {old.kid}

    report = vault.rotate()

    new = vault.sealer(refresh=True)
    assert new.kid != old.kid
    assert db_meta(vault_db)["kid"] == new.kid
    assert report.scrubbed is True
    assert report.counts["old_kid"] == old.kid and report.counts["new_kid"] == new.kid
    assert report.counts["sessions"] == 4
    assert report.counts["items"] == len(before)
    assert report.counts["expired"] == 1  # the 2 h old item under a 1 h TTL
    assert report.counts["unreadable"] == 0

    after = rows(vault_db)
    assert [(rid, sid) for rid, sid, _ in after] == [(rid, sid) for rid, sid, _ in before]
    for (rid, sid, env_before), (_, _, env) in zip(before, after, strict=True):
        assert env["kid"] == new.kid
        assert env["payload"] != env_before["payload"]
        token = env["payload"].encode()
        # Authenticated timestamp under the new key == the original one (MultiFernet.rotate).
        assert new.fernet(sid).extract_timestamp(token) == ts_before[rid]
        # The old key opens nothing any more.
        assert old.open(sid, json.dumps(env), None).state is crypto.ItemState.UNREADABLE
        # Same plaintext as before.
        assert (
            new.open(sid, json.dumps(env), None).item
            == old.open(sid, json.dumps(env_before), None).item
        )

    reopened = Vault.open(vault_db)
    for sid, items in expected.items():
        assert reopened.items(sid) == (items, 0, 0)
    # Rotation never extends life: each aged item expires when it would have before.
    for item, ts in aged:
        visible, _, _ = reopened.items("chat-aged", now=ts + 3600)
        assert item in visible
        visible, _, _ = reopened.items("chat-aged", now=ts + 3601)
        assert item not in visible
    assert reopened.items("chat-aged", now=now)[1] == 1  # "stale" is still expired

    # The old key exists nowhere in the keyring; the new one only under its own version.
    entries = vault_entries(vault_id)
    assert entries == {entry_name(vault_id, new.kid): new.master_key}
    everything = [secret for _, secret in keyring_secrets()]
    assert old.master_key not in everything


def test_rotate_keeps_unreadable_rows_and_counts_them(vault: Vault, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("kept")])
    old = vault.sealer()
    # A well-formed envelope under the current kid whose payload is forged: unreadable.
    forged = Fernet(Fernet.generate_key()).encrypt(b'{"role":"user","content":"forged"}')
    insert_raw(
        vault_db,
        "s",
        json.dumps({"__enc__": 1, "v": 1, "kid": old.kid, "payload": forged.decode()}),
    )
    report = vault.rotate()
    assert report.counts["items"] == 1
    assert report.counts["unreadable"] == 1
    # Nothing is deleted by a rotation: the forged row is still there, unchanged.
    assert forged.decode() in tokens(vault_db)
    fresh = Vault.open(vault_db)
    assert tally(fresh.opened_items("s", include_tampered=True)) == ([user("kept")], 0, 1)
    assert fresh.history_verdict("s") == "unauthenticated"  # the forged row, not the rotation


def test_cli_rotate_json_report(vault: Vault, vault_db: Path) -> None:
    expected = populate(vault_db)
    old_kid = db_meta(vault_db)["kid"]
    total = sum(len(v) for v in expected.values())

    r = run_cli("--json", "rotate")

    assert r.code == 0, r
    doc = r.json()
    for key in ("sessions", "items", "expired", "unreadable", "old_kid", "new_kid", "seconds"):
        assert key in doc, (key, doc)
    assert doc["sessions"] == len(expected)
    assert doc["items"] == total
    assert doc["expired"] == 0 and doc["unreadable"] == 0
    assert doc["old_kid"] == old_kid
    assert doc["new_kid"] == db_meta(vault_db)["kid"] != old_kid
    assert isinstance(doc["seconds"], (int, float)) and 0 <= doc["seconds"] < 60
    assert {env["kid"] for _, _, env in rows(vault_db)} == {doc["new_kid"]}
    shown = run_cli("--json", "show", "chat-a")
    assert shown.code == 0, shown
    assert shown.json()["items"] == expected["chat-a"]
    vid = vault.vault_id
    assert set(vault_entries(vid)) == {entry_name(vid, doc["new_kid"])}
    assert crypto.key_id(vault_entries(vid)[entry_name(vid, doc["new_kid"])]) == doc["new_kid"]


def test_rotation_writes_short_batches_under_the_lock_and_reads_them_outside_it(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kid switches in a transaction of its own; then each batch of rows is read with
    no write lock held and written in its own BEGIN IMMEDIATE ... COMMIT, synchronous=FULL,
    each row only if it still holds the text that was read (a writer may have changed it)."""
    import vault.engines.sqlite.db as db
    import vault.rotation as rotation

    populate(vault_db)
    monkeypatch.setattr(rotation, "DEFAULT_BATCH", 4)
    traces: list[tuple[int, list[str]]] = []
    real_connect = db.connect

    def traced(path: Path, timeout: float | None = None) -> sqlite3.Connection:
        conn = real_connect(path, timeout)
        log: list[str] = []
        traces.append((conn.execute("PRAGMA synchronous").fetchone()[0], log))
        conn.set_trace_callback(lambda sql: log.append(" ".join(sql.split())))
        return conn

    monkeypatch.setattr(db, "connect", traced)
    vault.rotate()
    monkeypatch.setattr(db, "connect", real_connect)

    def transactions(log: list[str]) -> list[list[str]]:
        out, current = [], None
        for s in log:
            if s.startswith("BEGIN"):
                current = [s]
            elif current is not None:
                current.append(s)
                if s in ("COMMIT", "ROLLBACK"):
                    out.append(current)
                    current = None
        return out

    batches: list[list[str]] = []
    switched = False
    for sync, log in traces:
        for tx in transactions(log):
            updates = [s for s in tx if s.startswith("UPDATE agent_messages")]
            if any("'rotating_from'" in s for s in tx) and any("'kid'" in s for s in tx):
                assert not updates  # the switch moves no row
                switched = True
            if not updates:
                continue
            assert tx[0] == "BEGIN IMMEDIATE" and tx[-1] == "COMMIT", tx
            # No row is read (nor re-encrypted) while the lock is held.
            assert not [s for s in tx if "FROM agent_messages" in s and "SELECT" in s], tx
            assert all("AND message_data = " in s for s in updates), updates
            assert sync == 2 or any("SYNCHRONOUS = FULL" in s.upper() for s in log), sync
            batches.append(updates)
    assert switched
    assert len(batches) >= 4, [len(b) for b in batches]  # 13 items, 4 a batch
    ids = [{int(s.split("WHERE id = ", 1)[1].split()[0]) for s in b} for b in batches]
    assert all(len(b) <= 4 for b in ids), ids
    updated = [rid for b in ids for rid in b]
    assert sorted(updated) == [rid for rid, _, _ in rows(vault_db)]  # each item once


def test_cli_rotate_shows_a_progress_bar_on_a_terminal(vault: Vault, vault_db: Path) -> None:
    import os
    import pty

    populate(vault_db)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vault", "rotate"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, shown
    assert b"rotating" in shown and b"100%" in shown, shown
    assert out.startswith(b"rotated 13 items")
    # Not on a terminal: no bar (the JSON test checks stdout stays clean as well).
    quiet = run_cli("rotate")
    assert quiet.code == 0 and quiet.err == "", quiet


def test_stale_vault_object_rotates_with_the_current_key(vault: Vault, vault_db: Path) -> None:
    """A Vault object whose cached key was retired by another process still rotates safely."""
    expected = populate(vault_db)
    assert run_cli("rotate").code == 0
    report = vault.rotate()  # `vault` still caches the key from before the CLI rotation
    assert report.counts["items"] == sum(len(v) for v in expected.values())
    assert report.counts["unreadable"] == 0
    fresh = Vault.open(vault_db)
    for sid, items in expected.items():
        assert fresh.items(sid) == (items, 0, 0)


# --------------------------------------------------------------------------
# Scrub
# --------------------------------------------------------------------------
@pytest.mark.parametrize("open_elsewhere", [False, True], ids=["alone", "bystander"])
def test_scrub_after_rotate_leaves_no_old_token(
    vault: Vault, vault_db: Path, open_elsewhere: bool
) -> None:
    populate_with_a_big_item(vault_db)
    old_tokens = tokens(vault_db)
    assert residue(vault_db, old_tokens) == old_tokens  # the scanner sees what is there
    with bystander(vault_db) if open_elsewhere else contextlib.nullcontext():
        report = vault.rotate()
        assert report.scrubbed
        assert residue(vault_db, old_tokens) == []
        new_tokens = tokens(vault_db)
        assert residue(vault_db, new_tokens) == new_tokens
    assert db_meta(vault_db)["scrub_pending"] == "0"


@pytest.mark.parametrize("open_elsewhere", [False, True], ids=["alone", "bystander"])
def test_scrub_after_purge_leaves_no_deleted_token(
    vault: Vault, vault_db: Path, open_elsewhere: bool
) -> None:
    sealer = vault.sealer()
    now = int(time.time())
    insert_sealed(vault_db, sealer, "old", [({"n": i}, now - 7200 - i) for i in range(20)])
    insert_sealed(vault_db, sealer, "mixed", [({"n": i}, now - 7200) for i in range(5)])
    insert_sealed(vault_db, sealer, "mixed", [({"fresh": i}, now - 10) for i in range(5)])
    insert_sealed(vault_db, sealer, "big", [({"big": BIG}, now - 7200)])
    doomed = tokens(vault_db, "old") + tokens(vault_db, "mixed")[:5] + tokens(vault_db, "big")
    kept = tokens(vault_db, "mixed")[5:]
    assert max(len(t) for t in doomed) > 4096
    with bystander(vault_db) if open_elsewhere else contextlib.nullcontext():
        report = vault.purge(now=now)
        assert report.counts == {"deleted": 26, "kept": 5, "unreadable": 0}
        assert report.scrubbed
        assert residue(vault_db, doomed) == []
        assert residue(vault_db, kept) == kept
    assert Vault.open(vault_db).items("mixed", now=now)[0] == [{"fresh": i} for i in range(5)]


@pytest.mark.sweep
@pytest.mark.parametrize("how", ["library", "cli", "session"])
def test_scrub_after_clear_leaves_no_deleted_token(vault: Vault, vault_db: Path, how: str) -> None:
    expected = populate_with_a_big_item(vault_db)
    doomed = tokens(vault_db, "chat-a")
    kept = tokens(vault_db, "chat-b") + tokens(vault_db, "chat-c")
    with bystander(vault_db):
        if how == "library":
            cleared = vault.clear("chat-a")
            assert cleared.deleted == len(expected["chat-a"]) and cleared.scrubbed
        elif how == "cli":
            r = run_cli("--json", "clear", "chat-a", "--yes")
            assert r.code == 0, r
            assert r.json()["deleted"] == len(expected["chat-a"]) and r.json()["scrubbed"]
        else:

            async def go() -> None:
                s = vault.session("chat-a")
                await s.clear_session()
                s.close()

            asyncio.run(go())
        assert residue(vault_db, doomed) == []
        assert residue(vault_db, kept) == kept
    fresh = Vault.open(vault_db)
    assert fresh.items("chat-b") == (expected["chat-b"], 0, 0)
    assert fresh.items("chat-c") == (expected["chat-c"], 0, 0)


def test_control_rotate_without_scrub_leaves_residue_the_scanner_finds(
    vault: Vault, vault_db: Path
) -> None:
    populate_with_a_big_item(vault_db)
    old_tokens = tokens(vault_db)
    with bystander(vault_db):
        report = vault.rotate(scrub=False)
        assert report.scrubbed is False
        found = residue(vault_db, old_tokens)
        assert len(found) == len(old_tokens), "the scanner must see the unscrubbed residue"
        assert db_meta(vault_db)["scrub_pending"] == "1"
        # ... and the next open finishes the scrub.
        Vault.open(vault_db)
        assert residue(vault_db, old_tokens) == []
        assert db_meta(vault_db)["scrub_pending"] == "0"


@pytest.mark.parametrize("operation", ["purge", "clear"])
def test_control_purge_and_clear_without_scrub_leave_residue(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    sealer = vault.sealer()
    now = int(time.time())
    insert_sealed(vault_db, sealer, "gone", [({"n": i}, now - 7200) for i in range(9)])
    insert_sealed(vault_db, sealer, "gone", [({"big": BIG}, now - 7200)])
    doomed = tokens(vault_db, "gone")
    real_scrub = Vault.scrub
    with bystander(vault_db):
        monkeypatch.setattr(Vault, "scrub", lambda self: False)
        if operation == "purge":
            report = vault.purge(now=now)
            assert report.counts["deleted"] == 10 and report.scrubbed is False
        else:
            cleared = vault.clear("gone")
            assert cleared.deleted == 10 and cleared.scrubbed is False
        assert residue(vault_db, doomed) == doomed, "secure_delete alone leaves the old pages"
        monkeypatch.setattr(Vault, "scrub", real_scrub)
        Vault.open(vault_db)  # the next open finishes the scrub
        assert residue(vault_db, doomed) == []


@pytest.mark.slow  # a child holds the lock for seconds: timed
def test_blocked_scrub_is_reported_and_finished_by_next_open(vault: Vault, vault_db: Path) -> None:
    expected = populate(vault_db)
    old_tokens = tokens(vault_db)
    with bystander(vault_db), reader_holding_snapshot(vault_db) as reader:
        report = vault.rotate()
        assert report.scrubbed is False
        assert report.counts["scrubbed"] is False
        assert db_meta(vault_db)["scrub_pending"] == "1"
        # The warning is true: the replaced ciphertext is still in the files.
        assert residue(vault_db, old_tokens)
        end_reader(reader)
        # Nothing scrubs by itself once the reader is gone (the bystander keeps the WAL).
        assert residue(vault_db, old_tokens)

        reopened = Vault.open(vault_db)

        assert db_meta(vault_db)["scrub_pending"] == "0"
        assert residue(vault_db, old_tokens) == []
        for sid, items in expected.items():
            assert reopened.items(sid) == (items, 0, 0)


WRITER_HOLDING_LOCK = textwrap.dedent(
    """
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("UPDATE agent_sessions SET updated_at = updated_at")
    print("ready", flush=True)
    time.sleep(float(sys.argv[2]))
    conn.execute("COMMIT")
    conn.close()
    """
)


@pytest.mark.slow  # a child holds the lock for seconds: timed
def test_a_writer_holding_the_lock_past_the_scrubs_wait_delays_the_scrub_only(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's write that outlasts the checkpoint's wait (a slow disk, a long turn)
    is not a reader holding a snapshot: the scrub tries again and finishes."""
    from vault.engines.sqlite.db import SCRUB_WAIT

    expected = populate(vault_db)
    old_tokens = tokens(vault_db)
    real_scrub = Vault.scrub
    writers: list[subprocess.Popen[str]] = []

    def scrub_behind_a_long_write(self: Vault) -> bool:
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER_HOLDING_LOCK, str(vault_db), str(SCRUB_WAIT + 1.5)],
            stdout=subprocess.PIPE,
            text=True,
        )
        writers.append(writer)
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        return real_scrub(self)

    with bystander(vault_db):
        monkeypatch.setattr(Vault, "scrub", scrub_behind_a_long_write)
        report = vault.rotate()
        assert writers and writers[0].wait(timeout=60) == 0
        assert report.scrubbed is True
        assert db_meta(vault_db)["scrub_pending"] == "0"
        assert residue(vault_db, old_tokens) == []
    for sid, items in expected.items():
        assert Vault.open(vault_db).items(sid) == (items, 0, 0)


CHECKPOINTER = textwrap.dedent(
    """
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 60000")
    print("ready", flush=True)
    conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()  # waits for the writer
    conn.close()
    """
)


@pytest.mark.slow  # a child holds the lock for seconds: timed
def test_another_connections_checkpoint_delays_the_scrub_only(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's own automatic checkpoint after a commit (here: one waiting behind a
    write) holds SQLite's checkpoint lock: the scrub waits for it, then finishes."""
    from vault.engines.sqlite.db import SCRUB_WAIT

    populate(vault_db)
    old_tokens = tokens(vault_db)
    real_scrub = Vault.scrub
    children: list[subprocess.Popen[str]] = []

    def scrub_behind_another_checkpoint(self: Vault) -> bool:
        for script, args in (
            (WRITER_HOLDING_LOCK, [str(SCRUB_WAIT + 1.5)]),
            (CHECKPOINTER, []),
        ):
            child = subprocess.Popen(
                [sys.executable, "-c", script, str(vault_db), *args],
                stdout=subprocess.PIPE,
                text=True,
            )
            children.append(child)
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the checkpointer takes its lock, then waits for the writer
        return real_scrub(self)

    with bystander(vault_db):
        monkeypatch.setattr(Vault, "scrub", scrub_behind_another_checkpoint)
        report = vault.rotate()
        assert [c.wait(timeout=60) for c in children] == [0, 0]
        assert report.scrubbed is True
        assert db_meta(vault_db)["scrub_pending"] == "0"
        assert residue(vault_db, old_tokens) == []


@pytest.mark.slow  # a child holds the lock for seconds: timed
def test_blocked_scrub_cli_rotate_exits_5_and_next_rotate_finishes(
    vault: Vault, vault_db: Path
) -> None:
    expected = populate(vault_db)
    first_tokens = tokens(vault_db)
    with bystander(vault_db), reader_holding_snapshot(vault_db) as reader:
        r = run_cli("--json", "rotate")
        assert r.code == 5, r
        err = one_line_error(r)
        assert "scrub is incomplete" in err
        assert r.json()["scrubbed"] is False  # the report still says what was done
        assert db_meta(vault_db)["kid"] == r.json()["new_kid"]
        assert db_meta(vault_db)["scrub_pending"] == "1"
        assert residue(vault_db, first_tokens)
        end_reader(reader)
        second_tokens = tokens(vault_db)

        again = run_cli("--json", "rotate")

        assert again.code == 0, again
        assert again.json()["scrubbed"] is True
        assert db_meta(vault_db)["scrub_pending"] == "0"
        assert residue(vault_db, first_tokens) == []
        assert residue(vault_db, second_tokens) == []
    fresh = Vault.open(vault_db)
    for sid, items in expected.items():
        assert fresh.items(sid) == (items, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["purge", "clear"])
def test_blocked_scrub_cli_purge_and_clear_say_so(
    vault: Vault, vault_db: Path, command: str
) -> None:
    sealer = vault.sealer()
    now = int(time.time())
    insert_sealed(vault_db, sealer, "gone", [({"n": i}, now - 7200) for i in range(9)])
    insert_sealed(vault_db, sealer, "gone", [({"big": BIG}, now - 7200)])
    doomed = tokens(vault_db, "gone")
    with bystander(vault_db), reader_holding_snapshot(vault_db) as reader:
        args = ["purge", "--yes"] if command == "purge" else ["clear", "gone", "--yes"]
        r = run_cli("--json", *args)
        assert r.code == 5, r
        assert r.json()["scrubbed"] is False
        assert "scrub incomplete" in r.err or "scrub is incomplete" in r.err, r
        assert "Traceback" not in r.err
        assert residue(vault_db, doomed)
        end_reader(reader)
        assert run_cli("status").code == 0  # the next command finishes the scrub
        assert db_meta(vault_db)["scrub_pending"] == "0"
        assert residue(vault_db, doomed) == []


# --------------------------------------------------------------------------
# Revoke
# --------------------------------------------------------------------------
NEEDS_KEY = [
    ("show", "chat-a"),
    ("sessions",),
    ("pop", "chat-a"),
    ("clear", "chat-a", "--yes"),
    ("ttl", "1h"),
    ("ttl",),
    ("purge", "--yes"),
    ("rotate",),
]


def assert_revoked_state(db: Path, vault_id: str, destroyed: list[str]) -> None:
    assert db.exists()
    assert vault_entries(vault_id) == {}
    everything = [secret for _, secret in keyring_secrets()]
    for key in destroyed:
        assert key not in everything
    st = run_cli("status")
    assert st.code == 0, st
    assert "key revoked" in st.out
    js = run_cli("--json", "status")
    assert js.code == 0, js
    assert js.json()["key"] == "key revoked"
    for args in NEEDS_KEY:
        r = run_cli(*args)
        assert r.code == 4, (args, r)
        assert "revoked" in one_line_error(r), (args, r)
    with pytest.raises(KeyRevoked):
        Vault.open(db).sealer()


def test_revoke_without_yes_and_without_tty_aborts(vault: Vault, vault_db: Path) -> None:
    expected = populate(vault_db)
    before = raw_bytes(vault_db)
    key = vault.sealer().master_key

    r = run_cli("revoke")

    assert r.code == 1, r
    # The unanswered question, then exactly one error line of its own.
    lines = r.err.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in r.err, r
    assert lines[0].startswith("Destroy the key of the vault "), r
    assert lines[1].startswith("memvault: error: aborted"), r
    assert raw_bytes(vault_db) == before
    assert "revoked_at" not in db_meta(vault_db)
    assert vault_entries(vault.vault_id) == {entry_name(vault.vault_id, vault.sealer().kid): key}
    assert run_cli("--json", "status").json()["key"] == "present and matching"
    assert Vault.open(vault_db).items("chat-a") == (expected["chat-a"], 0, 0)


@pytest.mark.parametrize("how", ["--yes", "confirmed"])
@pytest.mark.slow
def test_revoke_destroys_current_and_pending_key(vault: Vault, vault_db: Path, how: str) -> None:
    populate(vault_db)
    vault_id = vault.vault_id
    current = vault.sealer().master_key
    # A rotation killed after storing its pending key leaves that key's entry behind.
    killed = run_cli("rotate", env={"MEMVAULT_FAILPOINT": "after-pending"})
    assert killed.code == KILLED, killed
    (pending,) = [k for k in vault_entries(vault_id).values() if k != current]

    if how == "--yes":
        r = run_cli("--json", "revoke", "--yes")
    else:
        r = run_cli("--json", "revoke", input="y\n")

    assert r.code == 0, r
    doc = json.loads(r.out[r.out.index("{") :])
    assert doc["vault_id"] == vault_id and doc["key_destroyed"] is True
    assert doc["already_revoked"] is False
    kids = sorted(crypto.key_id(k) for k in (current, pending))
    assert doc["destroyed_kids"] == kids and doc["other_copies_kids"] == [], doc
    assert_revoked_state(vault_db, vault_id, [current, pending])
    # shred still works without the key.
    s = run_cli("--json", "shred", "--yes")
    assert s.code == 0, s
    assert s.json()["items"] == 13
    assert not vault_db.exists()


@pytest.mark.parametrize("point", ["revoke-after-mark", "after-destroy-entry"])
@pytest.mark.slow
def test_revoke_killed_half_way_then_run_again_finishes(
    vault: Vault, vault_db: Path, point: str
) -> None:
    populate(vault_db)
    vault_id = vault.vault_id
    current = vault.sealer().master_key
    killed = run_cli("rotate", env={"MEMVAULT_FAILPOINT": "after-pending"})
    assert killed.code == KILLED, killed
    (pending,) = [k for k in vault_entries(vault_id).values() if k != current]

    r = run_cli("revoke", "--yes", env={"MEMVAULT_FAILPOINT": point})

    assert r.code == KILLED, r
    # Killed half-way: the file is marked, so the vault already counts as revoked, and
    # status says the revocation is not finished ...
    assert "revoked_at" in db_meta(vault_db)
    st = run_cli("--json", "status").json()
    assert st["key"].startswith("key revoked (incomplete"), st
    assert "memvault revoke" in st["key_problem"]
    assert run_cli("show", "chat-a").code == 4
    # ... but a key is still in the keyring.
    assert vault_entries(vault_id)

    again = run_cli("--json", "revoke", "--yes")

    assert again.code == 0, again
    assert again.json()["already_revoked"] is True
    assert again.json()["key_destroyed"] is True
    assert_revoked_state(vault_db, vault_id, [current, pending])
    assert run_cli("shred", "--yes").code == 0


def test_writer_holding_the_key_cannot_write_after_revoke(vault: Vault, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("before")])

    async def go() -> None:
        s = vault.session("s")
        await s.add_items([user("while the key was alive")])
        assert run_cli("revoke", "--yes").code == 0
        with pytest.raises(Exception) as info:
            await s.add_items([user("after revoke")])
        assert "revoked" in str(info.value)
        s.close()

    asyncio.run(go())
    with contextlib.closing(sqlite3.connect(vault_db)) as conn:
        assert conn.execute("SELECT count(*) FROM agent_messages").fetchone()[0] == 2


def test_revoke_during_a_rotation_is_never_undone_by_its_clean_up(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A revoke that lands between a rotation's commit and its old key's deletion wins."""
    import vault.testhooks as testhooks

    populate(vault_db)
    vault_id = vault.vault_id
    revoke: list[CLIResult] = []

    def interleave(name: str) -> None:
        if name == "after-commit" and not revoke:
            revoke.append(run_cli("--json", "revoke", "--yes", env={"MEMVAULT_LOCK_TIMEOUT": "5"}))

    real = testhooks.failpoint
    monkeypatch.setattr(testhooks, "failpoint", interleave)
    with contextlib.suppress(KeyRevoked):
        vault.rotate()
    monkeypatch.setattr(testhooks, "failpoint", real)

    assert revoke and revoke[0].code == 0, revoke
    assert vault_entries(vault_id) == {}, "the rotation brought a revoked vault's key back"
    assert run_cli("--json", "status").json()["key"] == "key revoked"
    assert run_cli("show", "chat-a").code == 4
