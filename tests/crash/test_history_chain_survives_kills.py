"""No kill makes a legitimate history look tampered: writers, `pop`, `clear`, `purge`,
`rotate` and `import` SIGKILLed at their failpoints and at a random instant, `memvault
verify` after each kill (and after the rerun that finishes an import) finding every
session's chain whole and every item authentic."""

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


IMPORT_KILLS = (
    "import-in-transaction",
    "import-session-committed",
    "import-before-source-shred",
    "import-during-source-shred",
)


def test_no_kill_of_an_import_reads_as_tampering_and_the_rerun_finishes_it(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    from tests.files.test_import import make_plain

    insert_sealed(vault_db, "a", [user(f"a {i}") for i in range(5)])
    rng = random.Random()
    for n, failpoint in enumerate((*IMPORT_KILLS, None)):
        source = tmp_path / f"plain-{n}.db"
        make_plain(
            source, {f"p{n}-{j}": [user(f"{n}/{j}/{i}") for i in range(30)] for j in range(3)}
        )
        args = ["--db", str(vault_db), "import", str(source)]
        if failpoint is None or "shred" in failpoint:
            args += ["--shred-source", "--yes"]
        step = f"import killed at {failpoint or 'a random instant'}"
        if failpoint is None:
            killed_cli(*args, delay=rng.uniform(0.05, 1.5))
        else:
            assert killed_cli(*args, failpoint=failpoint) == -signal.SIGKILL, step
        no_tampering(vault_db, step)
        if source.exists():  # not shredded yet: the rerun finishes the import
            r = run_cli(*args)
            if r.code == 1 and "already exists" in r.err:  # a session committed before the kill
                for j in range(3):  # the others one by one, as the error says
                    r = run_cli(
                        "--db", str(vault_db), "import", str(source), "--session", f"p{n}-{j}"
                    )
                    assert r.code == 0 or "already exists" in r.err, (step, r)
            else:
                assert r.code == 0, (step, r)
            no_tampering(vault_db, f"the import rerun after {step}")
        for j in range(3):
            r = run_cli("--db", str(vault_db), "--json", "show", f"p{n}-{j}")
            assert r.code == 0 and len(r.json()["items"]) == 30, (step, r)
    r = run_cli("--db", str(vault_db), "--json", "verify")
    assert r.code == 0, r
