"""`scripts/with-keyring` runs one keyring daemon, however late it takes its name.

gnome-keyring-daemon returns to the script before it owns the Secret Service name on the
bus. A Secret Service call in that gap makes D-Bus start a second daemon from the
service file (the one that restarts a dead daemon): two daemons on one keyring file,
one of them queued for the name, and the one the suite checks may not be the one that
answers. On a busy machine the gap is long. Here it is made long on purpose: a stand-in
for gnome-keyring-daemon starts the real one a few seconds late, every time it is started,
and the command checks who serves the keyring.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

LATE = 3  # seconds: far longer than the script takes to reach its first keyring call

STAND_IN = """#!/bin/bash
# Every start is late: the script's own, and any D-Bus would make from the service file.
sleep {late}
echo $$ >"$XDG_RUNTIME_DIR/late-daemon"
exec {real} "$@"
"""

CHECK = r"""
import json, os, time
from pathlib import Path
from jeepney import DBusAddress, new_method_call
from jeepney.io.blocking import open_dbus_connection

run = Path(os.environ["XDG_RUNTIME_DIR"])
bus = DBusAddress("/org/freedesktop/DBus", bus_name="org.freedesktop.DBus",
                  interface="org.freedesktop.DBus")

def ask(method, sig, *args):
    with open_dbus_connection("SESSION") as conn:
        return conn.send_and_get_reply(new_method_call(bus, method, sig, args), timeout=30).body

def served():
    return ask("NameHasOwner", "s", "org.freedesktop.secrets")[0]

end = time.monotonic() + 120
while not ((run / "late-daemon").exists() and served()):
    assert time.monotonic() < end, "the late daemon never started"
    time.sleep(0.1)
daemons = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        continue
    if exe == "gnome-keyring-daemon" and str(run).encode() in environ:
        daemons.append(int(pid))
owner = ask("GetConnectionUnixProcessID", "s", "org.freedesktop.secrets")[0]
late = int((run / "late-daemon").read_text())
print(json.dumps({"daemons": sorted(daemons), "owner": owner, "late": late}))
"""


@pytest.mark.skipif(
    shutil.which("dbus-run-session") is None or shutil.which("gnome-keyring-daemon") is None,
    reason="needs dbus-run-session and gnome-keyring-daemon (scripts/with-keyring installs them)",
)
@pytest.mark.slow
def test_a_daemon_slow_to_take_its_name_is_the_only_one(tmp_path: Path) -> None:
    real = shutil.which("gnome-keyring-daemon")
    shims = tmp_path / "bin"
    shims.mkdir()
    stand_in = shims / "gnome-keyring-daemon"
    stand_in.write_text(STAND_IN.format(real=real, late=LATE))
    stand_in.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_IN_PRIVATE_KEYRING"}
    env["PATH"] = f"{shims}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "with-keyring"), sys.executable, "-c", CHECK],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["daemons"] == [seen["late"]], seen  # no second daemon started by D-Bus
    assert seen["owner"] == seen["late"], seen
