"""SIGKILL a rotation of a vault that has a recorded backup, at every named step and at
random instants: after the next open, the live vault and the backup both read every
item, the old key version is retained (never destroyed: the backup uses it), and the
journal holds no pending or retired version. Bounded: a 600-item vault, 14 kills.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.chainkit import insert_chained
from tests.conftest import ROOT, key_entries, run_cli
from tests.crashkit import put_back
from vault.engines.sqlite.vault import Vault, shred
from vault.keyjournal import entry_name

pytestmark = pytest.mark.crash

N_ITEMS = 600
N_SESSIONS = 6
N_RANDOM_KILLS = 8
KILLED = -signal.SIGKILL
POINTS = [
    "after-record-pending",
    "after-pending",
    "after-batch",
    "after-commit",
    "after-retained",
    "during-scrub",
]


@dataclass
class Setup:
    db: Path
    backup: Path
    vault_id: str
    kid: str
    key: str = field(repr=False)
    image: bytes = field(repr=False)
    expected: dict[str, list[Any]] = field(repr=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("crash-retained")
    db = folder / "vault" / "history.db"
    v = Vault.init(db, ttl=None)
    sealer = v.sealer()
    now = int(time.time())
    expected: dict[str, list[Any]] = {f"s{i}": [] for i in range(N_SESSIONS)}
    rows = []
    for i in range(N_ITEMS):
        sid = f"s{i % N_SESSIONS}"
        item = {"role": "user", "content": f"item {i} of {sid}"}
        expected[sid].append(item)
        rows.append((sid, sealer.seal(sid, item, now - N_ITEMS + i)))
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO agent_sessions (session_id) VALUES (?)", [(s,) for s in expected]
        )
        insert_chained(conn, sealer, rows)
        conn.execute("COMMIT")
    backup = folder / "backup.db"
    r = run_cli("--db", str(db), "backup", str(backup))
    assert r.code == 0, r
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    yield Setup(db, backup, v.vault_id, sealer.kid, sealer.master_key, db.read_bytes(), expected)
    with contextlib.suppress(Exception):
        shred(db)
    shutil.rmtree(folder, ignore_errors=True)


def restore(s: Setup) -> None:
    """The vault as built (its backup recorded), only the original key in the keyring."""
    put_back(s.db, s.image, s.vault_id, s.kid, s.key)


def check(s: Setup, label: str) -> None:
    r = run_cli("--db", str(s.db), "--json", "status")  # the next open finishes or undoes
    assert r.code == 0, (label, r)
    with contextlib.closing(sqlite3.connect(s.db)) as conn:
        states = dict(conn.execute("SELECT kid, state FROM memvault_keys").fetchall())
        kid = conn.execute("SELECT value FROM memvault_meta WHERE key = 'kid'").fetchone()[0]
    assert not {"pending", "retired"} & set(states.values()), (label, states)
    assert states[s.kid] in ("current", "retained"), (label, states)
    want = {entry_name(s.vault_id, kid), entry_name(s.vault_id, s.kid)}
    assert set(key_entries(s.vault_id)) == want, label
    for db in (s.db, s.backup):
        r = run_cli("--db", str(db), "--json", "verify")
        assert r.code == 0, (label, db, r)
        for sid in ("s0", f"s{N_SESSIONS - 1}"):
            r = run_cli("--db", str(db), "--json", "show", sid)
            assert r.code == 0 and r.json()["items"] == s.expected[sid], (label, db, r)


@pytest.mark.parametrize("point", POINTS)
def test_a_rotation_killed_at_each_step_keeps_the_recorded_backup_readable(
    setup: Setup, point: str
) -> None:
    restore(setup)
    r = run_cli("--db", str(setup.db), "rotate", env={"MEMVAULT_FAILPOINT": point})
    assert r.code == KILLED, r
    check(setup, point)


@pytest.mark.slow
def test_a_rotation_killed_at_random_instants_keeps_the_recorded_backup_readable(
    setup: Setup,
) -> None:
    restore(setup)
    started = time.monotonic()
    assert run_cli("--db", str(setup.db), "rotate").code == 0
    took = time.monotonic() - started
    rng = random.Random(18)
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_FAILPOINT"}
    for n in range(N_RANDOM_KILLS):
        restore(setup)
        delay = rng.uniform(0.0, took)
        proc = subprocess.Popen(
            [sys.executable, "-m", "vault", "--db", str(setup.db), "rotate"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        check(setup, f"random kill {n} after {delay:.3f}s")
