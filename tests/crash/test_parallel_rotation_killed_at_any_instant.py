"""SIGKILL a rotation whose cryptography runs in worker processes, amid its batches.

The same vault, restore and checks as the rotation's kill campaign
(test_rotation_killed_at_any_instant.py), whose 10,000 items stay below the size at
which a rotation starts workers: here the rotating process lowers that size, so every
batch goes through them. After each kill, besides everything the campaign checks
(the next command finishes the rotation, nothing lost, one key), no worker is left
running: each ends once the pipe from its dead parent closes.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import textwrap
import time

import pytest

from tests.crash.test_rotation_killed_at_any_instant import (  # noqa: F401 (big: its fixture)
    KILLED,
    N_ITEMS,
    BigVault,
    big,
    check_after_kill,
    restore,
    start_rotator,
)
from tests.keys.test_parallel_rotation import alive, children

pytestmark = [
    pytest.mark.crash,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="reads the worker processes in /proc"
    ),
]

BATCH = 500
N_KILLS = 8
ROTATOR = textwrap.dedent(
    f"""
    import sys
    from vault import rotation, rotationpool, testhooks
    from vault.engines.sqlite.vault import Vault
    rotation.PARALLEL_MIN_ROWS = 0  # the campaign's vault is below it: workers all the same
    rotation.DEFAULT_BATCH = {BATCH}
    rotationpool.cores = lambda: 2
    v = Vault.open(sys.argv[1])
    v.sealer()
    testhooks.failpoint = lambda name: print(name, flush=True)
    print("ready", flush=True)
    v.rotate()
    print("done", flush=True)
    """
)


def wait_gone(pids: set[int], label: str) -> None:
    """Every worker ends on its own once its parent is gone (it has one batch at most to
    finish): wait for that, generously on a loaded machine, then name any left."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        left = {p for p in pids if alive(p)}
        if not left:
            return
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    pytest.fail(f"{label}: workers {sorted(left)} outlived the killed rotation")


def test_sigkill_amid_the_workers_batches_leaves_no_worker_and_loses_nothing(
    request: pytest.FixtureRequest,
) -> None:
    vault: BigVault = request.getfixturevalue("big")  # the campaign's, built once
    seed = int(os.environ.get("MEMVAULT_CRASH_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)

    restore(vault)
    proc = start_rotator(vault.db, ROTATOR)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert out.split().count("after-batch") == N_ITEMS // BATCH
    assert check_after_kill(vault, "uninterrupted").rotated

    moving = 0
    for i in range(N_KILLS):
        restore(vault)
        proc = start_rotator(vault.db, ROTATOR)
        assert proc.stdout is not None
        target = 1 + int((i + rng.random()) / N_KILLS * (N_ITEMS // BATCH - 2))
        workers: set[int] = set()
        batches = 0
        for line in proc.stdout:
            if line.strip() == "after-batch":
                batches += 1
                workers |= children(proc.pid)
                if batches >= target:
                    break
        time.sleep(rng.random() * 0.05)  # anywhere in the next batch
        workers |= children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        label = f"seed={seed} kill {i} after batch {target} rc={proc.returncode}"
        assert proc.returncode == KILLED, label
        assert len(workers) == 2, (label, workers)  # the rotation was using its workers
        wait_gone(workers, label)
        o = check_after_kill(vault, label)
        assert o.rotated, label
        moving += o.moving_before
    # The kills landed amid the batches: rows under both keys for the next command.
    assert moving >= N_KILLS // 2, f"seed={seed} moving={moving}"
