"""No kill makes a legitimate history look tampered: writers, `pop`, `clear`, `purge` and
`rotate` SIGKILLed at their failpoints and at a random instant, `memvault verify` after
each kill finding every session's chain whole and every item authentic."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import insert_sealed, run_cli, user
from tests.crashkit import killed_cli, run_writer_to_death, start_writer

pytestmark = pytest.mark.crash

KILLS: list[tuple[tuple[str, ...], str]] = [
    (("pop", "a", "-n", "3"), "during-scrub"),
    (("clear", "b", "--yes"), "during-scrub"),
    (("purge", "--yes"), "purge-in-transaction"),
    (("purge", "--yes"), "during-scrub"),
    *((("rotate",), fp) for fp in ("after-pending", "after-switch", "after-batch", "after-commit")),
]


def no_tampering(db: Path, after: str) -> None:
    r = run_cli("--db", str(db), "--json", "verify")
    assert r.code in (0, 1), (after, r)
    problems = r.json()["problems"]
    assert problems["history_chain"] == 0, (after, r.json()["details"])
    assert problems["unauthenticated_items"] == 0, (after, r.json()["details"])


def test_no_kill_of_a_writer_pop_clear_purge_or_rotate_reads_as_tampering(
    vault: Any, vault_db: Path
) -> None:
    old = int(time.time()) - 7200  # past the vault's hour
    for sid in ("a", "b"):
        insert_sealed(vault_db, sid, [user(f"{sid} {i}") for i in range(20)])
    insert_sealed(vault_db, "c", [user(f"c {i}") for i in range(20)], at=old)
    written = 0
    for args, failpoint in KILLS:
        step = f"{' '.join(args)} killed at {failpoint}"
        assert killed_cli("--db", str(vault_db), *args, failpoint=failpoint) == -signal.SIGKILL
        no_tampering(vault_db, step)
        written += run_writer_to_death(vault_db, "w", written, 4, 200)
        no_tampering(vault_db, f"a writer killed after {step}")
    # A rotation killed at a random instant while an agent writes, then the agent killed.
    rng = random.Random()
    writer = start_writer(vault_db, "w", written, 400, 200, every=0.005)
    killed_cli("--db", str(vault_db), "rotate", delay=rng.uniform(0.05, 1.0))
    writer.send_signal(signal.SIGKILL)
    writer.communicate(timeout=60)
    no_tampering(vault_db, "rotate and a writer killed at random instants")
    assert run_cli("--db", str(vault_db), "rotate").code == 0
    r = run_cli("--db", str(vault_db), "--json", "verify")
    assert r.code == 0, r
