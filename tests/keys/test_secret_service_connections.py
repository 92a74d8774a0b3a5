"""memvault's keyring connections cannot abort GNOME Keyring's daemon.

gnome-keyring-daemon can dispatch a new connection's first message before it has
registered the client, and a property read met that way aborts the whole daemon
(vault.secretservice says how). keyring's own Secret Service backend opens a new
connection for every operation and reads a property first. memvault's connections ask
ReadAlias first, which only fails when the race strikes. Watched on the private bus with
a D-Bus monitor: every connection of each real `memvault` command starts with that
call, and, as a control (in a second private keyring, since it can abort its daemon),
keyring's own backend starts with a property read.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from jeepney import DBusAddress, MessageType, new_method_call
from jeepney.io.blocking import open_dbus_connection
from jeepney.low_level import HeaderFields

from tests.keys.test_keyring_edges import in_another_private_keyring
from vault.secretservice import connect

pytestmark = pytest.mark.secret_service

SECRETS = "org.freedesktop.secrets"
READ_ALIAS = ("org.freedesktop.Secret.Service", "ReadAlias")
First = dict[str, tuple[str | None, str | None]]  # connection's unique name -> (interface, member)


@contextmanager
def first_calls_to_the_secret_service() -> Iterator[First]:
    """The first method call each connection sends to the Secret Service while open.
    On leaving, a call of its own, sent last, is awaited: every call before it was seen."""
    seen: First = {}
    failed: list[BaseException] = []
    conn = open_dbus_connection(bus="SESSION")
    monitoring = DBusAddress(
        "/org/freedesktop/DBus",
        bus_name="org.freedesktop.DBus",
        interface="org.freedesktop.DBus.Monitoring",
    )
    rule = f"type='method_call',destination='{SECRETS}'"
    conn.send_and_get_reply(new_method_call(monitoring, "BecomeMonitor", "asu", ([rule], 0)))
    stop = threading.Event()

    def watch() -> None:
        try:
            while not stop.is_set():
                try:
                    msg = conn.receive(timeout=0.2)
                except TimeoutError:
                    continue
                fields = msg.header.fields
                if msg.header.message_type is MessageType.method_call:
                    call = (fields.get(HeaderFields.interface), fields.get(HeaderFields.member))
                    seen.setdefault(fields[HeaderFields.sender], call)
        except BaseException as exc:  # named in the test, not lost with the thread
            failed.append(exc)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        last = connect()  # the sentinel: its first call comes after every one before
        try:
            end = time.monotonic() + 30
            while last.unique_name not in seen and not failed and time.monotonic() < end:
                time.sleep(0.02)
            seen.pop(last.unique_name, None)
        finally:
            last.close()
            stop.set()
            thread.join(5)
            conn.close()
    if failed:
        raise failed[0]


COMMANDS = [("init",), ("status",), ("rotate", "--yes"), ("key", "list"), ("shred", "--yes")]

# Each command watched in a private keyring of its own: on the suite's, the monitor also
# sees the connections of tests running beside this one (another worker's).
WATCHED = """
cd "$1"
python - "$2" <<'P'
import json, subprocess, sys
from tests.keys.test_secret_service_connections import COMMANDS, first_calls_to_the_secret_service
out = []
for args in COMMANDS:
    with first_calls_to_the_secret_service() as first:
        proc = subprocess.run(
            [sys.executable, "-m", "vault", "--db", sys.argv[1], *args],
            capture_output=True, text=True, timeout=120,
        )
    out.append([args, proc.returncode, proc.stderr[-1000:], sorted(set(first.values()))])
print(json.dumps(out))
P
"""


def test_every_keyring_connection_of_memvault_asks_a_method_before_any_property_read(
    tmp_path: Path,
) -> None:
    proc = in_another_private_keyring(WATCHED, tmp_path / "h.db")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for args, code, stderr, first in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert code == 0, (args, stderr)
        assert first, f"{args}: no connection to the Secret Service was seen"
        assert first == [list(READ_ALIAS)], (args, first)


CONTROL = """
cd "$1"
python - <<'P'
import json
from keyring.backends.SecretService import Keyring
from tests.keys.test_secret_service_connections import first_calls_to_the_secret_service
with first_calls_to_the_secret_service() as first:
    Keyring().get_password("memvault-control", "nobody")
print(json.dumps(sorted(first.values())))
P
"""


def test_keyring_own_backend_reads_a_property_first_which_is_what_is_avoided(
    tmp_path: Path,
) -> None:
    """The control: the monitor sees the difference memvault makes."""
    proc = in_another_private_keyring(CONTROL, tmp_path / "unused.db")
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first == [["org.freedesktop.DBus.Properties", "Get"]], first
