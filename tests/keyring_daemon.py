"""The private keyring's daemon, watched (used by tests/conftest.py under scripts/test).

Should gnome-keyring-daemon die mid-test, D-Bus restarts it (scripts/with-keyring's
service file), and a retry, or Hypothesis's replay of the failing example, passes: a
flaky failure that names only its symptom ("disconnected from message bus without
replying", then Hypothesis's FlakyFailure or FlakyStrategyDefinition). So:

- the daemon's PID is recorded at the start and checked after every test's call and
  teardown: the test during which it changed fails, with the death first in its report;
- a keyring call of the test's own process that fails while the daemon is dead, or
  replaced, raises KeyringDaemonDied instead of its error: the test stops there, before
  Hypothesis can replay anything.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

# pytest's base of its own outcomes (fail, skip, exit): not public API, but what its
# runner and its fixtures treat as a test's outcome rather than an interrupt.
from _pytest.outcomes import OutcomeException

SERVICE = "org.freedesktop.secrets"
_daemon: dict[str, Any] = {}


class KeyringDaemonDied(OutcomeException):  # noqa: N818  it is no error of the code under test
    """A keyring call failed because the daemon died under it.

    Not an Exception, as KeyboardInterrupt is not: memvault's error handling does not turn
    it into a keyring error, and Hypothesis does not catch it to replay the example against
    the restarted daemon (where it would pass, and be reported as flaky). A pytest outcome,
    as `pytest.fail`'s is: raised in a fixture's set-up, pytest records that fixture as
    failed for this test alone. A bare BaseException left the fixture half set up, and
    every later test that used it errored ("assert not self._finalizers")."""


def daemon_pid(bus: str, start: bool = False) -> int | None:
    """PID of the process that owns the Secret Service name on `bus`, or None. With
    `start`, have D-Bus start the daemon first if nothing owns the name."""
    from jeepney import DBusAddress, MessageType, new_method_call
    from jeepney.io.blocking import open_dbus_connection

    dbus = DBusAddress(
        "/org/freedesktop/DBus", bus_name="org.freedesktop.DBus", interface="org.freedesktop.DBus"
    )
    with open_dbus_connection(bus) as conn:
        if start:
            conn.send_and_get_reply(
                new_method_call(dbus, "StartServiceByName", "su", (SERVICE, 0)), timeout=60
            )
        call = new_method_call(dbus, "GetConnectionUnixProcessID", "s", (SERVICE,))
        reply = conn.send_and_get_reply(call, timeout=30)
    if reply.header.message_type is MessageType.error:
        return None  # no owner: the daemon is gone and nothing restarted it yet
    return int(reply.body[0])


def watch(bus: str) -> None:
    """Record the daemon serving `bus` now, and make the keyring backend's calls in this
    process raise KeyringDaemonDied when they fail because it died."""
    from keyring.backends.SecretService import Keyring

    exits = Path(os.environ.get("XDG_RUNTIME_DIR", "/nonexistent")) / "keyring-exit"
    _daemon.update(bus=bus, pid=daemon_pid(bus), exits=exits, told=len(_ends(exits)))
    for name in ("get_password", "set_password", "delete_password", "get_credential"):
        setattr(Keyring, name, _checked(getattr(Keyring, name)))


def _checked(call: Any) -> Any:
    @functools.wraps(call)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            death = death_of_the_daemon()
            if death is None:
                raise
            raise KeyringDaemonDied(death) from exc

    return checked


def death_of_the_daemon() -> str | None:
    """What happened to the daemon recorded at the start (or after the last death), if
    it is no longer the one serving the keyring; None while it is, or when not watched."""
    if not _daemon:
        return None
    now = daemon_pid(_daemon["bus"])
    if now == _daemon["pid"]:
        return None
    after = f"PID {now} serves it now (restarted by D-Bus)" if now else "nothing serves it now"
    return (
        f"the private keyring's daemon (gnome-keyring-daemon, PID {_daemon['pid']}) died "
        f"during this test{how_it_ended()}; {after}. What the test reported below is its "
        "consequence."
    )


def _ends(exits: Path) -> list[str]:
    try:
        return exits.read_text().split()
    except OSError:
        return []


def how_it_ended() -> str:
    """How the daemon ended, from the exit statuses scripts/with-keyring's watcher appends
    (128+N: killed by signal N); empty when none was recorded since the last report."""
    ends = _ends(_daemon["exits"])[_daemon["told"] :]
    if not ends:
        return ""
    _daemon["told"] += len(ends)
    status = int(ends[-1])
    if status > 128 and status - 128 in signal.valid_signals():
        return f" (killed by {signal.Signals(status - 128).name})"
    return f" (it exited with status {status})"


def blamed() -> None:
    """The current test took the blame for a death: record the daemon serving now,
    starting one if none does yet, so that the next test starts from a live daemon and
    is not blamed for the restart."""
    _daemon["pid"] = daemon_pid(_daemon["bus"], start=True)
