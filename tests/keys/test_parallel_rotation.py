"""A large rotation re-encrypts in worker processes (vault.rotationpool), a small one here.

Real keyring, real files, real worker processes, seen through /proc (Linux): which
processes the rotation started, what their command line and environment hold, and
that none outlives the rotation. The kill of a rotating process is the crash
campaign's (tests/crash/test_parallel_rotation_killed_at_any_instant.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import authenticated_counts, insert_sealed, rows, run_cli, user
from vault import crypto, rotation, rotationpool, testhooks
from vault.engines.sqlite.vault import Vault

real_failpoint = testhooks.failpoint

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the worker processes in /proc"
)

N = 240
BATCH = 20  # 12 batches: the workers are seen at work amid them


def children(pid: int) -> set[int]:
    """The live child processes of `pid`, from every thread of it."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out |= {int(p) for p in (task / "children").read_text().split()}
    return {p for p in out if alive(p)}


def alive(pid: int) -> bool:
    """Running, not a zombie that nobody reaped (an orphan's parent may be a container's
    init that reaps nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def fill(db: Path) -> dict[str, list[Any]]:
    """N items in three sessions, stamped at distinct times (within the TTL of an hour)."""
    now = int(time.time())
    expected: dict[str, list[Any]] = {}
    for k, sid in enumerate(("a", "b", "c")):
        items = [user(f"{sid} {i}") for i in range(N // 3)]
        insert_sealed(db, sid, items, at=now - 600 * (k + 1))
        expected[sid] = items
    return expected


def stamps(db: Path) -> list[int | None]:
    return [crypto.token_timestamp(text) for text in rows(db)]


def use_workers(monkeypatch: pytest.MonkeyPatch, from_rows: int | None = N) -> None:
    """Batches of BATCH rows, two workers whatever this machine has, started from
    `from_rows` rows on (None: the shipped threshold, which this vault is below)."""
    monkeypatch.setattr(rotation, "DEFAULT_BATCH", BATCH)
    if from_rows is not None:
        monkeypatch.setattr(rotation, "PARALLEL_MIN_ROWS", from_rows)
    monkeypatch.setattr(rotationpool, "cores", lambda: 2)


@contextlib.contextmanager
def at_failpoints(monkeypatch: pytest.MonkeyPatch, hook: Any) -> Iterator[None]:
    """`hook(name)` at each failpoint while the block runs; the real ones after it."""
    monkeypatch.setattr(testhooks, "failpoint", hook)
    try:
        yield
    finally:
        monkeypatch.setattr(testhooks, "failpoint", real_failpoint)


def assert_whole_under_one_key(db: Path, expected: dict[str, list[Any]]) -> None:
    """A fresh open reads every item, and every row is under the file's one key."""
    fresh = Vault.open(db)
    assert {sid: fresh.items(sid)[0] for sid in expected} == expected
    assert {json.loads(t)["kid"] for t in rows(db)} == {fresh.sealer().kid}


def test_a_large_rotation_re_encrypts_in_worker_processes_that_end_with_it(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = fill(vault_db)
    before = stamps(vault_db)
    old_key = vault.sealer().master_key
    use_workers(monkeypatch)
    here = 0
    rotate_row = crypto.rotate_row_stamped

    def counting(*args: Any) -> Any:
        nonlocal here
        here += 1
        return rotate_row(*args)

    monkeypatch.setattr(crypto, "rotate_row_stamped", counting)
    seen: dict[int, tuple[bytes, bytes]] = {}

    def look(name: str) -> None:
        if name == "after-batch":
            for pid in children(os.getpid()):
                with contextlib.suppress(OSError):
                    proc = Path(f"/proc/{pid}")
                    seen[pid] = ((proc / "cmdline").read_bytes(), (proc / "environ").read_bytes())

    monkeypatch.setenv("VAULT_TOKEN", "s.a-token-no-worker-needs")
    with at_failpoints(monkeypatch, look):
        report = vault.rotate()

    assert report.counts["items"] == N
    assert here == 0  # not one row re-encrypted in this process
    assert len(seen) == 2, seen
    new_key = Vault.open(vault_db).sealer().master_key
    for pid, (cmdline, environ) in seen.items():
        assert b"vault.rotationworker" in cmdline, cmdline
        # The keys went through the worker's stdin: not its command line, not its
        # environment (both readable by the user's other processes).
        for key in (old_key, new_key):
            assert key.encode() not in cmdline and key.encode() not in environ
        assert b"s.a-token-no-worker-needs" not in environ  # nor a secret of the parent's
        assert not alive(pid), f"worker {pid} outlived the rotation"
    assert children(os.getpid()) == set()
    # The same result as in one process: every item, its timestamp kept, under the new key.
    assert stamps(vault_db) == before
    assert authenticated_counts(vault_db) == (N, 0, 0)
    assert_whole_under_one_key(vault_db, expected)


def test_a_small_rotation_starts_no_worker(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(vault_db)
    use_workers(monkeypatch, from_rows=None)
    started: list[int] = []
    assert N < rotation.PARALLEL_MIN_ROWS
    with at_failpoints(monkeypatch, lambda name: started.extend(children(os.getpid()))):
        assert vault.rotate().counts["items"] == N
    assert started == []


def test_a_worker_that_dies_stops_the_rotation_in_one_line_and_rotate_finishes_it(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = fill(vault_db)
    use_workers(monkeypatch)
    killed: list[int] = []

    def kill_workers(name: str) -> None:
        if name == "after-batch" and not killed:
            killed.extend(children(os.getpid()))
            for pid in killed:
                os.kill(pid, signal.SIGKILL)

    with (
        at_failpoints(monkeypatch, kill_workers),
        pytest.raises(rotationpool.WorkerFailed) as failed,
    ):
        vault.rotate()
    assert len(killed) == 2
    message = failed.value.message
    assert "\n" not in message and "`memvault rotate` again" in message, message
    assert failed.value.exit_code == 1
    assert children(os.getpid()) == set()
    # Switched, rows under both keys: the next `memvault rotate` (a new process) ends it.
    r = run_cli("--json", "rotate")
    assert r.code == 0, r
    assert authenticated_counts(vault_db) == (N, 0, 0)
    assert_whole_under_one_key(vault_db, expected)


def test_a_rotation_whose_workers_cannot_start_re_encrypts_here(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = fill(vault_db)
    use_workers(monkeypatch)
    monkeypatch.setattr(sys, "executable", str(vault_db.parent / "no-such-python"))
    assert vault.rotate().counts["items"] == N
    assert_whole_under_one_key(vault_db, expected)
