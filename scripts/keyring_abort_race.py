"""gnome-keyring-daemon's abort under short-lived clients, keyring's connections against
memvault's (run it through scripts/keyring-abort-race, which gives it a private keyring).

Rounds alternate between the two kinds of client. Each round starts four Python
processes at once; each stores, reads and deletes an entry of its own five times, then
exits, with nothing killed. After each round the Secret Service's owner is asked for:
when the daemon has aborted ("gkd_secret_service_get_pkcs11_session: assertion 'client'
failed", then GLib's "invoke_get_property_in_idle_cb: assertion failed" on its stderr),
D-Bus starts a new one, and the round's kind counts an abort. vault.secretservice says
why memvault's connections avoid it.

Exit 0 and a summary line per kind either way; the counts are the finding.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.keyring_daemon import daemon_pid  # noqa: E402

CLIENT = """
import sys
from keyring.backends.SecretService import Keyring
from vault.secretservice import adopt

name, kind = sys.argv[1], sys.argv[2]
backend = adopt(Keyring()) if kind == "memvault" else Keyring()
for _ in range(5):
    backend.set_password("memvault-race", name, "x" * 44)
    backend.get_password("memvault-race", name)
    backend.delete_password("memvault-race", name)
"""
KINDS = ("keyring", "memvault")
CLIENTS = 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seconds", type=float, nargs="?", default=300.0)
    args = ap.parse_args()
    bus = os.environ["DBUS_SESSION_BUS_ADDRESS"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    serving = daemon_pid(bus, start=True)
    counts = {kind: {"clients": 0, "failed": 0, "aborts": 0} for kind in KINDS}
    end, round_ = time.monotonic() + args.seconds, 0
    while time.monotonic() < end:
        kind = KINDS[round_ % 2]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CLIENT, f"r{round_}c{i}", kind],
                env=env,
                stderr=subprocess.DEVNULL,
            )
            for i in range(CLIENTS)
        ]
        counts[kind]["failed"] += sum(p.wait() != 0 for p in procs)
        counts[kind]["clients"] += CLIENTS
        if daemon_pid(bus) != serving:
            counts[kind]["aborts"] += 1
            serving = daemon_pid(bus, start=True)
        round_ += 1
    for kind, c in counts.items():
        print(
            f"{kind}'s connections: the keyring daemon aborted {c['aborts']} times under "
            f"{c['clients']} clients ({c['failed']} clients failed)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
