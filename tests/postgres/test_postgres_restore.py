"""`memvault --db URL restore B`: a backup file of a PostgreSQL vault back as its live rows.

Real subprocesses, the real keyring, a real server (`scripts/with-postgres scripts/test
-m postgres`); the kills are real SIGKILLs, at the named steps and at random instants.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, keyring_entries, run_cli
from tests.crashkit import killed_cli
from tests.keys.test_rotation import one_line_error
from tests.pgserver import MARKS, bulk_insert, raw_kids, sql
from vault.keyjournal import entry_name

pytestmark = MARKS
KILLED = -signal.SIGKILL


def write(url: str, session_id: str, *texts: str) -> None:
    """Items written through the agent session, in this process."""
    import vault

    async def go() -> None:
        await vault.open_session(session_id, url).add_items(
            [{"role": "user", "content": t} for t in texts]
        )

    asyncio.run(go())


def shown(url: str, session_id: str) -> list[str]:
    r = run_cli("--db", url, "--json", "show", session_id)
    assert r.code == 0, r
    assert r.json()["unreadable"] == 0, r
    return [i["content"] for i in r.json()["items"]]


def journal(url: str) -> dict[str, str]:
    return {r["kid"]: r["state"] for r in sql(url, "SELECT kid, state FROM memvault_keys")}


def kid_of_vault(url: str) -> str:
    return str(sql(url, "SELECT value FROM memvault_meta WHERE key = 'kid'")[0]["value"])


def rows(url: str) -> list[tuple[str, str]]:
    return [
        (r["session_id"], r["message_data"])
        for r in sql(url, "SELECT session_id, message_data FROM agent_messages ORDER BY id")
    ]


# A new process reading a session through the public library call an agent makes.
READER = textwrap.dedent(
    """
    import asyncio, json, sys
    import vault

    async def main() -> None:
        items = await vault.open_session(sys.argv[2], sys.argv[1]).get_items()
        print(json.dumps([i["content"] for i in items]))

    asyncio.run(main())
    """
)


def read_in_new_process(url: str, session_id: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", READER, url, session_id],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return list(json.loads(proc.stdout))


def backed_up(url: str, tmp_path: Path) -> tuple[Path, str]:
    """The backup holds s1 ["one", "two"] and s2 ["alpha"]; returns (B, B's kid)."""
    write(url, "s1", "one", "two")
    write(url, "s2", "alpha")
    b = tmp_path / "backup.db"
    r = run_cli("--db", url, "--json", "backup", str(b))
    assert r.code == 0, r
    return b, r.json()["kid"]


def test_a_backup_comes_back_after_more_writes_and_a_rotation(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    import vault

    b, old_kid = backed_up(pg_url, tmp_path)
    write(pg_url, "s1", "three")
    write(pg_url, "late", "written after the backup")
    r = run_cli("--db", pg_url, "--json", "rotate")
    assert r.code == 0 and r.json()["old_key"] == "retained", r
    rotated_kid = kid_of_vault(pg_url)
    # An agent's session opened before the restore, holding the rotated key.
    agent = vault.open_session("s2", pg_url)
    assert [i["content"] for i in asyncio.run(agent.get_items())] == ["alpha"]

    r = run_cli("--db", pg_url, "--json", "restore", str(b), "--yes")
    assert r.code == 0, r
    doc = r.json()
    assert (doc["kid"], doc["replaced_kid"], doc["old_key"]) == (
        old_kid,
        rotated_kid,
        "destroyed",
    )
    assert (doc["items"], doc["sessions"], doc["replaced_items"]) == (3, 2, 5)

    # Every item of the backup, under the key it was written with; nothing since.
    assert set(raw_kids(pg_url)) == {old_kid}
    assert shown(pg_url, "s1") == ["one", "two"]
    assert shown(pg_url, "s2") == ["alpha"]
    assert run_cli("--db", pg_url, "show", "late").code != 0
    assert read_in_new_process(pg_url, "s1") == ["one", "two"]
    assert run_cli("--db", pg_url, "verify").code == 0
    # One active version, the backup's; the replaced one destroyed with its entry.
    assert journal(pg_url) == {old_kid: "current", rotated_kid: "destroyed"}
    assert set(keyring_entries(pg_vault.vault_id)) == {entry_name(pg_vault.vault_id, old_kid)}
    trail = run_cli("--db", pg_url, "--json", "log").json()
    [event] = [e for e in trail if e["event"] == "restore"]
    assert event["source"] == str(b) and event["replaced_kid"] == rotated_kid

    # The agent's session goes on: its next write meets the guard, reloads the key.
    asyncio.run(agent.add_items([{"role": "user", "content": "beta"}]))
    assert shown(pg_url, "s2") == ["alpha", "beta"]

    # A later rotation carries every row to a fresh key; the backup stays readable.
    r = run_cli("--db", pg_url, "--json", "rotate")
    assert r.code == 0, r
    assert r.json()["items"] == 4 and r.json()["old_key"] == "retained"
    fresh = kid_of_vault(pg_url)
    assert set(raw_kids(pg_url)) == {fresh} and fresh not in (old_kid, rotated_kid)
    assert shown(pg_url, "s1") == ["one", "two"]
    assert run_cli("--db", str(b), "verify").code == 0
    keys = run_cli("--db", pg_url, "--json", "key", "list").json()["keys"]
    assert sorted(k["state"] for k in keys) == ["current", "destroyed", "retained"]
    [kept] = [k for k in keys if k["state"] == "retained"]
    assert kept["kid"] == old_kid and [x["path"] for x in kept["backups"]] == [str(b)]


def test_a_restore_asks_first_and_no_changes_nothing(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    b, _kid = backed_up(pg_url, tmp_path)
    write(pg_url, "s1", "three")
    before = rows(pg_url)
    r = run_cli("--db", pg_url, "restore", str(b), input="n\n")
    assert r.code == 1, r
    assert "Replace the vault at" in r.err
    assert rows(pg_url) == before
    # Without a rotation since, the key stays the same one.
    r = run_cli("--db", pg_url, "--json", "restore", str(b), input="y\n")
    assert r.code == 0, r
    assert r.json()["old_key"] is None
    assert shown(pg_url, "s1") == ["one", "two"]
    assert list(journal(pg_url).values()) == ["current"]


def refused(url: str, b: Path | str, code: int, *env: tuple[str, str]) -> str:
    before = rows(url)
    r = run_cli("--db", url, "restore", str(b), "--yes", env=dict(env))
    assert r.code == code, r
    assert rows(url) == before  # nothing changed
    return one_line_error(r)


def test_a_restore_refuses_a_backup_of_another_vault(
    pg_vault: Any, pg_url: str, vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    backed_up(pg_url, tmp_path)
    other = tmp_path / "other-backup.db"
    assert run_cli("--db", str(vault_db), "backup", str(other)).code == 0
    err = refused(pg_url, other, 2)
    assert vault.vault_id in err and pg_vault.vault_id in err
    err = refused(pg_url, vault_db, 2)  # a live file vault: another vault id too
    assert "takes back only a backup of itself" in err


def test_a_restore_refuses_what_is_not_a_backup(pg_vault: Any, pg_url: str, tmp_path: Path) -> None:
    backed_up(pg_url, tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("not a vault\n")
    refused(pg_url, text, 3)
    plain = tmp_path / "plain.db"
    with contextlib.closing(sqlite3.connect(plain)) as conn:
        conn.execute("CREATE TABLE t (x)")
    refused(pg_url, plain, 3)
    refused(pg_url, tmp_path / "missing.db", 3)


def test_a_restore_refuses_a_damaged_backup(pg_vault: Any, pg_url: str, tmp_path: Path) -> None:
    b, _kid = backed_up(pg_url, tmp_path)
    with contextlib.closing(sqlite3.connect(b)) as conn:
        (row_id, data) = conn.execute("SELECT id, message_data FROM agent_messages").fetchone()
        env = json.loads(data)
        payload = env["payload"]
        flip = "A" if payload[40] != "A" else "B"
        env["payload"] = payload[:40] + flip + payload[41:]  # the guard checks only the head
        conn.execute(
            "UPDATE agent_messages SET message_data = ? WHERE id = ?", (json.dumps(env), row_id)
        )
        conn.commit()
    assert "does not verify" in refused(pg_url, b, 1)


def test_a_restore_refuses_a_backup_this_keyring_cannot_open(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    b, old_kid = backed_up(pg_url, tmp_path)
    assert run_cli("--db", pg_url, "rotate").code == 0
    assert run_cli("--db", pg_url, "key", "forget", old_kid, "--yes").code == 0
    assert "key import" in refused(pg_url, b, 4)
    assert journal(pg_url)[old_kid] == "destroyed"


def test_a_restore_refuses_a_revoked_vault(pg_vault: Any, pg_url: str, tmp_path: Path) -> None:
    b, _kid = backed_up(pg_url, tmp_path)
    assert run_cli("--db", pg_url, "revoke", "--yes").code == 0
    assert "revoked" in refused(pg_url, b, 4)


def test_a_restore_refuses_while_a_rotation_is_cut_off_and_runs_once_it_is_finished(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    b, _kid = backed_up(pg_url, tmp_path)
    r = run_cli("--db", pg_url, "rotate", env={"MEMVAULT_FAILPOINT": "pg-rotate-after-switch"})
    assert r.code == KILLED, r
    assert "memvault rotate" in refused(pg_url, b, 5)
    assert run_cli("--db", pg_url, "rotate").code == 0
    assert run_cli("--db", pg_url, "restore", str(b), "--yes").code == 0
    assert shown(pg_url, "s1") == ["one", "two"]


def test_a_restore_waits_for_the_admin_lock(pg_vault: Any, pg_url: str, tmp_path: Path) -> None:
    b, _kid = backed_up(pg_url, tmp_path)
    write(pg_url, "s1", "three")
    rotation = subprocess.Popen(
        [sys.executable, "-m", "vault", "--db", pg_url, "rotate"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MEMVAULT_PAUSEPOINT": "pg-admin-locked"},
    )
    try:
        assert rotation.stderr is not None
        assert "paused at pg-admin-locked" in rotation.stderr.readline()
        err = refused(pg_url, b, 5, ("MEMVAULT_LOCK_TIMEOUT", "1"))
        assert "another rotation, purge, restore, revoke or shred" in err
    finally:
        rotation.kill()
        rotation.wait()


# -- killed ----------------------------------------------------------------------------
N_ITEMS = 1200
SESSIONS = 4
STEPS = ["pg-admin-locked", "pg-restore-emptied", "pg-restore-batch", "pg-restore-committed"]


def bulk_write(url: str, start: int, count: int, expected: dict[str, list[str]]) -> None:
    """`count` items sealed under the vault's key, one transaction (the guard checks each)."""
    texts = []
    for i in range(start, start + count):
        sid = f"s{i % SESSIONS}"
        text = f"{sid} item {i} " + "x" * 100
        expected.setdefault(sid, []).append(text)
        texts.append((sid, text))
    bulk_insert(url, texts)


def vault_with_backup(
    url: str, folder: Path, n: int, expected: dict[str, list[str]]
) -> tuple[str, Path, str]:
    """A new vault at `url` with `n` items (added to `expected`), backed up into
    `folder`: (vault id, the backup, the key id it was taken under)."""
    from vault.engines.postgres.vault import PgVault

    vault_id = PgVault.init(url, ttl=None).vault_id
    bulk_write(url, 0, n, expected)
    b = folder / "backup.db"
    assert run_cli("--db", url, "backup", str(b)).code == 0
    return vault_id, b, kid_of_vault(url)


def contents(url: str) -> dict[str, list[str]]:
    """Every session's items, read in this process with the keys this keyring holds."""
    from vault.engines.postgres.vault import PgVault

    v = PgVault.open(url)
    out = {}
    for sid in v.session_ids():
        items, expired, unreadable = v.items(sid)
        assert (expired, unreadable) == (0, 0), sid
        out[sid] = [i["content"] for i in items]
    return out


def killed_restore(url: str, b: Path, failpoint: str | None, delay: float | None) -> int:
    return killed_cli("--db", url, "restore", str(b), "--yes", failpoint=failpoint, delay=delay)


@pytest.mark.crash
def test_a_restore_killed_at_any_instant_leaves_the_old_rows_or_the_restored_ones(
    pg_url: str, tmp_path: Path
) -> None:

    seed = int(os.environ.get("MEMVAULT_PG_KILL_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    restored: dict[str, list[str]] = {}
    vault_id, b, b_kid = vault_with_backup(pg_url, tmp_path, N_ITEMS, restored)
    old = {sid: list(items) for sid, items in restored.items()}
    bulk_write(pg_url, N_ITEMS, 300, old)

    def make_old() -> None:
        """The live vault: the backup's items and 300 more, under a key of its own."""
        if contents(pg_url) == restored:
            bulk_write(pg_url, N_ITEMS, 300, {})
        assert run_cli("--db", pg_url, "rotate").code == 0
        assert contents(pg_url) == old

    make_old()
    started = time.monotonic()
    assert killed_restore(pg_url, b, None, None) == 0
    took = time.monotonic() - started
    assert contents(pg_url) == restored
    plan = [(step, None) for step in STEPS] + [(None, rng.uniform(0.0, took)) for _ in range(6)]
    outcomes: dict[str, int] = {}
    for failpoint, delay in plan:
        label = f"seed={seed} {failpoint or f'kill after {delay:.3f}s'}"
        make_old()
        live_kid = kid_of_vault(pg_url)
        rc = killed_restore(pg_url, b, failpoint, delay)
        got = contents(pg_url)
        assert got in (old, restored), label
        kids = set(raw_kids(pg_url))
        assert kids == ({b_kid} if got == restored else {live_kid}), label
        states = journal(pg_url)
        assert list(states.values()).count("current") == 1, (label, states)
        assert states[kid_of_vault(pg_url)] == "current", (label, states)
        outcome = "restored" if got == restored else "old"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        # A rerun finishes: the backup's rows, one active key, the others settled.
        r = run_cli("--db", pg_url, "--json", "restore", str(b), "--yes")
        assert r.code == 0, (label, rc, r)
        assert contents(pg_url) == restored, label
        states = journal(pg_url)
        assert states[b_kid] == "current", (label, states)
        assert set(states.values()) <= {"current", "destroyed"}, (label, states)
        assert set(keyring_entries(vault_id)) == {entry_name(vault_id, b_kid)}, label
    assert run_cli("--db", pg_url, "verify").code == 0, seed
    assert run_cli("--db", str(b), "verify").code == 0, seed
    print(f"seed {seed}: {outcomes}")
