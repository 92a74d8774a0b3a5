"""SIGKILL the online rotation of a PostgreSQL vault that has a recorded backup, at random
instants, while an agent in another process keeps writing: after each kill no item is
lost (the agent's acknowledged ones included), and after the next command (`rotate`,
which finishes a cut-off rotation) the backup still verifies and the vault has exactly
one active key version plus retained ones that `key list` explains by their backups.

The rotation is the one both engines run (vault.rotation): batches read with no row
locked, re-encrypted outside their transaction, written only where unchanged.
Bounded to about a minute: a 3000-item vault (6 batches), 10 kills, half of them timed
from the start of the process, half from the rotation's switch to the new key.
MEMVAULT_PG_KILL_SEED=<seed> replays a run (each run prints its seed).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, keyring_entries, run_cli
from tests.crashkit import item_text, start_writer
from tests.pgserver import MARKS, sql
from tests.postgres.test_postgres_restore import (
    contents,
    journal,
    kid_of_vault,
    vault_with_backup,
)
from vault.keyjournal import entry_name

pytestmark = [pytest.mark.crash, *MARKS]

N_ITEMS = 3000
N_KILLS = 10
AGENT, AGENT_SIZE = "agent", 40
KILLED = -signal.SIGKILL


def rotating(url: str) -> bool:
    rows = sql(url, "SELECT 1 FROM memvault_meta WHERE key = 'rotating_from'")
    return bool(rows)


def rotation(url: str, delay: float | None, from_switch: bool) -> tuple[int, bool, float]:
    """`memvault rotate`, SIGKILLed `delay` seconds after its start, or after its switch to
    the new key (None: not killed); (exit code, whether a rotation was left cut off after
    the switch, seconds from the switch seen to the process's end)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MEMVAULT_FAILPOINT", "MEMVAULT_DB")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vault", "--db", url, "rotate"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
    if from_switch:
        while proc.poll() is None and not rotating(url):
            time.sleep(0.01)
    switched = time.monotonic()
    if delay is not None:
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=300)
    return rc, rotating(url), time.monotonic() - switched


class Agent:
    """An agent writing in a process of its own (tests.crashkit), its acks collected."""

    def __init__(self, url: str) -> None:
        self.proc = start_writer(url, AGENT, 0, 100_000, AGENT_SIZE, every=0.05)
        self.acked = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("ack "):
                self.acked = int(line.split()[1]) + 1

    def check(self, found: list[str], acked: int, label: str) -> None:
        """Every acknowledged item is there, in order, none twice; still writing."""
        assert found == [item_text(AGENT, i, AGENT_SIZE) for i in range(len(found))], label
        assert len(found) >= acked, (label, len(found), acked)
        if self.proc.poll() is not None:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"{label}: the agent stopped: {err[-2000:]}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)


def agent_and_rest(url: str) -> tuple[list[str], dict[str, list[str]]]:
    found = contents(url)
    return found.pop(AGENT, []), found


def test_a_url_rotation_killed_at_random_instants_keeps_every_item_and_the_backups_key(
    pg_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:

    seed = int(os.environ.get("MEMVAULT_PG_KILL_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    expected: dict[str, list[str]] = {}
    vault_id, b, b_kid = vault_with_backup(pg_url, tmp_path, N_ITEMS, expected)
    # How long a rotation takes here, from its start and from its switch, to spread the kills.
    started = time.monotonic()
    assert rotation(pg_url, None, False)[0] == 0
    took = time.monotonic() - started
    rc, _cut_off, after_switch = rotation(pg_url, None, True)
    assert rc == 0
    outcomes = {"killed": 0, "cut off after the switch": 0}
    agent = Agent(pg_url)
    request.addfinalizer(agent.stop)

    def no_item_lost(label: str) -> int:
        acked = agent.acked  # read first: each item acknowledged by now must be there
        found, rest = agent_and_rest(pg_url)
        assert rest == expected, label
        agent.check(found, acked, label)
        return acked

    for n in range(N_KILLS):
        from_switch = n % 2 == 1
        delay = rng.uniform(0.0, after_switch if from_switch else took)
        rc, cut_off, _ = rotation(pg_url, delay, from_switch)
        label = f"seed={seed} kill {n} {'after the switch' if from_switch else 'from the start'}"
        label += f" +{delay:.3f}s rc={rc}"
        assert rc in (0, KILLED), label
        outcomes["killed"] += rc == KILLED
        outcomes["cut off after the switch"] += cut_off
        # Right after the kill: every item reads, with the keys this keyring holds.
        no_item_lost(label)
        assert journal(pg_url)[b_kid] in ("retained", "retired"), label

        # The next command finishes a cut-off rotation (or makes a new one).
        r = run_cli("--db", pg_url, "--json", "rotate", timeout=300)
        assert r.code == 0, (label, r)
        no_item_lost(label)
        assert run_cli("--db", str(b), "verify").code == 0, label
        r = run_cli("--db", pg_url, "--json", "key", "list")
        assert r.code == 0, (label, r)
        keys = r.json()["keys"]
        states = [k["state"] for k in keys]
        assert states.count("current") == 1, (label, states)
        assert set(states) <= {"current", "retained", "destroyed"}, (label, states)
        retained = [k for k in keys if k["state"] == "retained"]
        assert [k["kid"] for k in retained] == [b_kid], (label, keys)
        assert [x["path"] for x in retained[0]["backups"]] == [str(b)], (label, keys)
        current = kid_of_vault(pg_url)
        want = {entry_name(vault_id, current), entry_name(vault_id, b_kid)}
        assert set(keyring_entries(vault_id)) == want, label
    acked = no_item_lost(f"seed={seed} at the end")
    print(f"seed {seed}: {outcomes} of {N_KILLS}; the agent wrote {acked} items meanwhile")
    assert outcomes["cut off after the switch"] >= 1, (seed, outcomes)
    assert acked >= N_KILLS, "the agent hardly wrote during the rotations"
