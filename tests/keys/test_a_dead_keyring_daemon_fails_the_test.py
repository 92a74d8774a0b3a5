"""A keyring daemon that dies mid-test is one clear failure of that test, never a flake.

D-Bus restarts a dead gnome-keyring-daemon (scripts/with-keyring's service file), so a
test whose daemon died can pass on a retry, or in Hypothesis's replay. The suite
records the daemon's PID and fails the test during which it changed, naming it. Shown
here on a pytest run of its own, inside a private keyring of its own, whose first test
kills that keyring's daemon (and passes, since the restarted one answers).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

INNER = """
import os, signal, time

import keyring
from jeepney import DBusAddress, new_method_call
from jeepney.io.blocking import open_dbus_connection


def daemon_pid():
    bus = DBusAddress("/org/freedesktop/DBus", bus_name="org.freedesktop.DBus",
                      interface="org.freedesktop.DBus")
    call = new_method_call(bus, "GetConnectionUnixProcessID", "s", ("org.freedesktop.secrets",))
    with open_dbus_connection("SESSION") as conn:
        return conn.send_and_get_reply(call, timeout=30).body[0]


def test_kills_its_keyring_daemon():
    pid = daemon_pid()
    os.kill(pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    keyring.set_password("memvault", "probe", "x")  # D-Bus starts a new daemon for this
    assert keyring.get_password("memvault", "probe") == "x"


def test_after_the_death_is_not_blamed():
    assert keyring.get_password("memvault", "probe") == "x"
"""


@pytest.mark.secret_service
def test_the_test_during_which_the_daemon_died_fails_and_names_it(tmp_path: Path) -> None:
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER)
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_IN_PRIVATE_KEYRING"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [str(ROOT / "scripts" / "with-keyring"), sys.executable, "-m", "pytest", "-q",
         "-p", "tests.conftest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "-c", str(ROOT / "pyproject.toml"), str(inner)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=240,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    assert "died during this test" in out, out[-3000:]
    assert "the private keyring's daemon (gnome-keyring-daemon, PID " in out, out[-3000:]
    assert "test_kills_its_keyring_daemon" in out.split("died during this test")[0], out
    assert "1 passed" in out, out[-3000:]  # the next test is not blamed
