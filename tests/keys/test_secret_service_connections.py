"""memvault's keyring connections cannot abort GNOME Keyring's daemon.

gnome-keyring-daemon can dispatch a new connection's first message before it has
registered the client, and a property read met that way aborts the whole daemon
(vault.secretservice says how). keyring's own Secret Service backend opens a new
connection for every operation and reads a property first. memvault's connections ask
ReadAlias first, which only fails when the race strikes. Watched here on the private
bus with a D-Bus monitor: every connection of real `memvault` processes starts with
that call, and, as a control, keyring's own backend starts with a property read.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from jeepney import DBusAddress, MessageType, new_method_call
from jeepney.io.blocking import open_dbus_connection
from jeepney.low_level import HeaderFields

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.secret_service

SECRETS = "org.freedesktop.secrets"
First = dict[str, tuple[str | None, str | None]]  # connection's unique name -> (interface, member)


@contextmanager
def first_calls_to_the_secret_service() -> Iterator[First]:
    """The first method call each connection sends to the Secret Service while open."""
    seen: First = {}
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
        while not stop.is_set():
            try:
                msg = conn.receive(timeout=0.2)
            except TimeoutError:
                continue
            fields = msg.header.fields
            if msg.header.message_type is MessageType.method_call:
                call = (fields.get(HeaderFields.interface), fields.get(HeaderFields.member))
                seen.setdefault(fields[HeaderFields.sender], call)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(5)
        conn.close()


def test_every_keyring_connection_of_memvault_asks_a_method_before_any_property_read() -> None:
    with first_calls_to_the_secret_service() as first:
        for args in (
            ("init",),
            ("status",),
            ("rotate", "--yes"),
            ("key", "list"),
            ("shred", "--yes"),
        ):
            r = run_cli(*args)
            assert r.code == 0, r
    assert len(first) >= 4, first  # at least one connection per command
    assert set(first.values()) == {("org.freedesktop.Secret.Service", "ReadAlias")}, first


def test_keyring_own_backend_reads_a_property_first_which_is_what_is_avoided() -> None:
    """The control: the monitor sees the difference memvault makes."""
    script = (
        "from keyring.backends.SecretService import Keyring\n"
        "Keyring().get_password('memvault-control', 'nobody')\n"
    )
    with first_calls_to_the_secret_service() as first:
        subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=60)
    assert list(first.values()) == [("org.freedesktop.DBus.Properties", "Get")], first
