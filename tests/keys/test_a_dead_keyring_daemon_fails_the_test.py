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

# What every inner test file starts with: how to find, kill and replace the daemon.
PREFIX = """
import os, signal, threading, time

import keyring
import pytest
from jeepney import DBusAddress, MessageType, new_method_call
from jeepney.io.blocking import open_dbus_connection

BUS = DBusAddress("/org/freedesktop/DBus", bus_name="org.freedesktop.DBus",
                  interface="org.freedesktop.DBus")


def daemon_pid():
    call = new_method_call(BUS, "GetConnectionUnixProcessID", "s", ("org.freedesktop.secrets",))
    with open_dbus_connection("SESSION") as conn:
        return conn.send_and_get_reply(call, timeout=30).body[0]


def kill_daemon():
    pid = daemon_pid()
    os.kill(pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)


# Killing the daemon at a chosen instant of a call is a race; an impostor is not: it takes
# the Secret Service name from the killed daemon and leaves the bus on the first call it
# gets, without replying, as a daemon that dies then does ("disconnected from message bus
# without replying").
def impostor(ready):
    conn = open_dbus_connection("SESSION")
    call = new_method_call(BUS, "RequestName", "su", ("org.freedesktop.secrets", 4))
    assert conn.send_and_get_reply(call, timeout=30).body[0] == 1  # the name is ours
    ready.set()
    while conn.receive().header.message_type is not MessageType.method_call:
        pass
    conn.close()  # gone, without a reply


def kill_daemon_and_leave_an_impostor():
    kill_daemon()
    ready = threading.Event()
    threading.Thread(target=impostor, args=(ready,), daemon=True).start()
    assert ready.wait(30)
"""


def run_inner(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    """pytest, with the suite's conftest, on PREFIX + `body`, inside a private keyring of
    its own (whose daemon it may kill)."""
    inner = tmp_path / "test_inner.py"
    inner.write_text(PREFIX + body)
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_IN_PRIVATE_KEYRING"} | env
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [str(ROOT / "scripts" / "with-keyring"), sys.executable, "-m", "pytest", "-q",
         "-p", "tests.conftest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "-c", str(ROOT / "pyproject.toml"), str(inner)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=240,
    )  # fmt: skip


INNER = """
def test_kills_its_keyring_daemon():
    kill_daemon()
    keyring.set_password("memvault", "probe", "x")  # D-Bus starts a new daemon for this
    assert keyring.get_password("memvault", "probe") == "x"


def test_after_the_death_is_not_blamed():
    assert keyring.get_password("memvault", "probe") == "x"
"""


@pytest.mark.slow
@pytest.mark.secret_service
def test_the_test_during_which_the_daemon_died_fails_and_names_it(tmp_path: Path) -> None:
    proc = run_inner(tmp_path, INNER)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    # How it ended, from the watcher scripts/with-keyring puts on the daemon.
    assert "died during this test (killed by SIGKILL)" in out, out[-3000:]
    assert "the private keyring's daemon (gnome-keyring-daemon, PID " in out, out[-3000:]
    assert "test_kills_its_keyring_daemon" in out.split("died during this test")[0], out
    assert "1 passed" in out, out[-3000:]  # the next test is not blamed


# A Hypothesis example during which the daemon dies, mid-call.
INNER_HYPOTHESIS = """
from hypothesis import given, settings, strategies as st

LOG = os.environ["EXAMPLES_LOG"]


@settings(database=None, max_examples=20, deadline=None)
@given(st.integers(0, 1000))
def test_an_example_during_which_the_daemon_dies(n):
    with open(LOG, "a") as log:
        log.write(f"{n}\\n")
    if not os.path.exists(LOG + ".done"):
        open(LOG + ".done", "w").close()
        kill_daemon_and_leave_an_impostor()
    keyring.get_password("memvault", "probe")


def test_after_the_death_is_not_blamed():
    keyring.set_password("memvault", "probe", "x")
    assert keyring.get_password("memvault", "probe") == "x"
"""


@pytest.mark.slow
@pytest.mark.secret_service
def test_a_hypothesis_test_whose_daemon_dies_fails_at_once_not_as_flaky(tmp_path: Path) -> None:
    """Hypothesis replays a failing example to shrink it: against the daemon D-Bus
    restarted, the replay passes, and Hypothesis reports a flaky test (or an inconsistent
    strategy) instead of the death. The death stops the test at once instead."""
    log = tmp_path / "examples"
    proc = run_inner(tmp_path, INNER_HYPOTHESIS, EXAMPLES_LOG=str(log))
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    assert "died during this test" in out, out[-3000:]
    assert "KeyringDaemonDied" in out, out[-3000:]
    assert "Flaky" not in out, out[-3000:]
    assert len(log.read_text().splitlines()) == 1, out[-3000:]  # no replay after the death
    assert "1 passed" in out, out[-3000:]  # the next test is not blamed


# The death during a fixture's set-up: the tests after it that use the same fixture run
# as usual. (pytest once left such a fixture half set up, and all of them errored.)
INNER_FIXTURE = """
@pytest.fixture
def dies():
    kill_daemon_and_leave_an_impostor()


@pytest.fixture
def stored():
    keyring.set_password("memvault", "probe", "x")
    yield keyring.get_password("memvault", "probe")
    keyring.delete_password("memvault", "probe")


def test_whose_fixture_meets_the_death(dies, stored):
    pass


@pytest.mark.parametrize("n", range(3))
def test_after_the_death_uses_the_same_fixture(stored, n):
    assert stored == "x"
"""


@pytest.mark.slow
@pytest.mark.secret_service
def test_a_death_in_a_fixtures_set_up_fails_that_test_only(tmp_path: Path) -> None:
    proc = run_inner(tmp_path, INNER_FIXTURE)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    assert "died during this test" in out, out[-3000:]
    assert "ERROR" in out and "test_whose_fixture_meets_the_death" in out, out[-3000:]
    assert "_finalizers" not in out, out[-3000:]
    assert "3 passed" in out, out[-3000:]  # the tests after it, same fixture, are not blamed
