"""`scripts/with-keyring`, stopped by SIGTERM or SIGINT, leaves nothing behind.

The script runs for real (a private D-Bus and gnome-keyring-daemon) around a long
`sleep`; the signal goes to the script's PID alone, as `kill PID` or a CI runner
sends it. Then its temporary folder (with the throwaway keyring password) must
be gone, and no process it started may survive: every process whose environment
points into that folder (the command, the bus daemon, the keyring daemon).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "with-keyring"
pytestmark = pytest.mark.skipif(
    shutil.which("dbus-run-session") is None or shutil.which("gnome-keyring-daemon") is None,
    reason="needs dbus-run-session and gnome-keyring-daemon (scripts/with-keyring installs them)",
)


def processes_using(folder: Path) -> list[int]:
    """PIDs of this user's processes whose environment names `folder`."""
    needle = str(folder).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{entry}/environ").read_bytes():
                found.append(int(entry))
    return found


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_with_keyring_removes_its_folder_and_ends_its_daemons(
    short_tmp: Path, sig: signal.Signals
) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MEMVAULT_IN_PRIVATE_KEYRING", "DBUS_SESSION_BUS_ADDRESS")
    }
    env["TMPDIR"] = str(short_tmp)
    started = short_tmp / "started"
    proc = subprocess.Popen(
        [str(SCRIPT), "sh", "-c", f'touch "{started}"; exec sleep 300'],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # so that a failure can end what it left, and only that
    )
    scratch: Path | None = None
    try:
        assert wait_for(started.exists, 60), "the command never started"
        (scratch,) = short_tmp.glob("memvault-keyring.*")
        assert (scratch / "run" / "keyring-password").exists()
        assert len(processes_using(scratch)) >= 3  # the command and two daemons, at least
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        assert wait_for(lambda: processes_using(scratch) == [], 10), processes_using(scratch)
        assert not scratch.exists()
    finally:
        leftovers = processes_using(scratch) if scratch else []
        for pid in leftovers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
