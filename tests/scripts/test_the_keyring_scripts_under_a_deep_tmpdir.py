"""Both keyring scripts work under a TMPDIR too deep for a Unix socket's path.

gnome-keyring-daemon binds its control socket at RUNTIME/keyring/control. A Unix
socket's path holds at most 107 bytes; a longer one is cut short, and when the cut lands
on an existing folder the daemon cannot bind and never starts. A TMPDIR of exactly 107
bytes makes the cut land on TMPDIR itself, whatever the scripts put under it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.scripts.test_headless import PASSPHRASE

pytestmark = pytest.mark.secret_service

SOCKET_PATH_MAX = 107


def deep_folder(base: Path) -> Path:
    """An empty folder under `base` whose path is exactly SOCKET_PATH_MAX bytes long."""
    folder = base
    while len(str(folder)) < SOCKET_PATH_MAX - 20:
        folder = folder / "deeper"
    folder = folder / ("d" * (SOCKET_PATH_MAX - len(str(folder)) - 1))
    folder.mkdir(parents=True)
    assert len(str(folder)) == SOCKET_PATH_MAX
    return folder


def test_with_keyring_runs_its_command_under_a_deep_tmpdir(tmp_path: Path) -> None:
    deep = deep_folder(tmp_path)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MEMVAULT_IN_PRIVATE_KEYRING", "DBUS_SESSION_BUS_ADDRESS")
    }
    env["TMPDIR"] = str(deep)
    proc = subprocess.run(
        [str(ROOT / "scripts" / "with-keyring"), "sh", "-c", 'echo "$XDG_RUNTIME_DIR"'],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc
    runtime = Path(proc.stdout.strip())
    assert not runtime.exists()  # removed on exit, wherever it was
    assert list(deep.iterdir()) == []


def test_headless_runs_its_command_under_a_deep_tmpdir(tmp_path: Path) -> None:
    deep = deep_folder(tmp_path / "tmp")
    home, passfile = tmp_path / "home", tmp_path / "pass"
    home.mkdir(mode=0o700)
    passfile.write_text(PASSPHRASE)
    passfile.chmod(0o600)
    env = {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "TMPDIR": str(deep),
        "LANG": "C.UTF-8",
        "MEMVAULT_KEYRING_PASSFILE": str(passfile),
    }
    proc = subprocess.run(
        [str(ROOT / "scripts" / "memvault-headless"), "init"],
        input="",
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0 and "created vault" in proc.stdout, proc
    assert list(deep.iterdir()) == []
