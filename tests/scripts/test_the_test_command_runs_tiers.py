"""`scripts/test` runs the fast tier; `scripts/test --all` runs every test, each once.

The tiers are pytest's marks: the fast tier leaves out `slow`, `crash`, `deep`,
`postgres`, `openbao` and a sweep's `later_case`s;
--all runs the rest in parallel and then the slow tests and kill campaigns one at a
time. Checked with --collect-only against pytest's own collection of the same marks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.scripts.test_fast_tier_covers_every_command_and_module import FAST

pytestmark = pytest.mark.slow  # each run starts private keyrings and collects everything


def env() -> dict[str, str]:
    drop = ("MEMVAULT_IN_PRIVATE_KEYRING", "MEMVAULT_TEST_POSTGRES_URL", "MEMVAULT_TEST_BAO_ADDR")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST")}


def node_ids(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "::" in line]


def collected(*args: str, extra: dict[str, str] | None = None) -> list[str]:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "test"), "--collect-only", "-q", "-p", "no:cacheprovider",
         *args],
        capture_output=True, text=True, env={**env(), **(extra or {})}, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return node_ids(proc.stdout)


def pytest_collects(marks: str | None) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", *(["-m", marks] if marks else [])],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return node_ids(proc.stdout)


def test_scripts_test_runs_the_fast_tier_only() -> None:
    fast = collected()
    assert sorted(fast) == sorted(pytest_collects(FAST))
    # Spelt as the fast tier's complement: `-m "... or postgres"` without a server is
    # refused (conftest), and no server is needed to collect.
    left_out = pytest_collects(f"not ({FAST})")
    assert left_out and not set(left_out) & set(fast)
    assert sorted(fast + left_out) == sorted(pytest_collects(None))


def test_scripts_test_all_runs_every_test_once() -> None:
    # URLs set: scripts/test --all then skips starting servers (nothing connects here).
    url = {
        "MEMVAULT_TEST_POSTGRES_URL": "postgresql+asyncpg://u:p@127.0.0.1:9/none",
        "MEMVAULT_TEST_BAO_ADDR": "http://127.0.0.1:9",
    }
    everything = collected("--all", extra=url)
    assert sorted(everything) == sorted(pytest_collects(None))


def test_a_named_file_runs_whole_whatever_its_tier() -> None:
    name = "tests/crash/test_rotation_killed_at_any_instant.py"
    assert collected(name) == [i for i in pytest_collects(None) if i.startswith(name + "::")]
