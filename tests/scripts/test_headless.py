"""The recipe for a server or an SSH login, run as docs/headless.md gives it.

`scripts/memvault-headless` starts a private Secret Service for one user (GNOME
Keyring under dbus-run-session), unlocked from a passphrase file, for one command.
These tests take the script from docs/headless.md, run it with a temporary HOME of its own
and no D-Bus session, and check that the keyring persists in that HOME from one
D-Bus session to the next, and that a wrong passphrase is exit 4.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ROOT, CLIResult

# The script starts gnome-keyring-daemon in a D-Bus session of its own.
pytestmark = pytest.mark.secret_service

SECTION = "On a server or over SSH"
PAGE = ROOT / "docs" / "headless.md"
SCRIPT = ROOT / "scripts" / "memvault-headless"
PASSPHRASE = "correct horse battery staple\n"

ADD_ITEM = """
import asyncio, vault
s = vault.open_session("agent")
asyncio.run(s.add_items([{"role": "user", "content": "hello from the agent"}]))
print(len(asyncio.run(s.get_items())))
"""


def recipe_from_page() -> str:
    """The script exactly as docs/headless.md shows it."""
    text = PAGE.read_text()
    opening = "<summary>scripts/memvault-headless</summary>\n\n```sh\n"
    start = text.index(opening) + len(opening)
    return text[start : text.index("```\n", start)]


Headless = Callable[..., CLIResult]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    folder = tmp_path / "home"
    folder.mkdir(mode=0o700)
    return folder


@pytest.fixture
def scratch(short_tmp: Path) -> Path:
    """The runs' TMPDIR, where each keeps its runtime folder while it runs."""
    return short_tmp


@pytest.fixture
def headless(tmp_path: Path, home: Path, scratch: Path) -> Headless:
    """Run the page's script with HOME=`home`, as a user on a server would."""
    script = tmp_path / "memvault-headless"
    script.write_text(recipe_from_page())
    script.chmod(0o755)

    def run(*args: str, passfile: Path | None = None, credentials: Path | None = None) -> CLIResult:
        # No D-Bus session, no keyring variables, no MEMVAULT_DB: the vault goes to
        # its default place in this HOME, the key to this HOME's keyring.
        env = {
            "HOME": str(home),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "TMPDIR": str(scratch),
            "LANG": "C.UTF-8",
        }
        if passfile is not None:
            env["MEMVAULT_KEYRING_PASSFILE"] = str(passfile)
        if credentials is not None:
            env["CREDENTIALS_DIRECTORY"] = str(credentials)
        proc = subprocess.run(
            [str(script), *args],
            input="",
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=240,
        )
        return CLIResult(proc)

    return run


@pytest.fixture
def passfile(tmp_path: Path) -> Path:
    path = tmp_path / "keyring-passphrase"
    path.write_text(PASSPHRASE)
    path.chmod(0o600)
    return path


def processes_with_home(home: Path) -> list[int]:
    """Processes still running with HOME=`home` (a daemon left behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"HOME={home}".encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


def assert_nothing_left_running(home: Path, scratch: Path) -> None:
    # The daemons stop when their bus goes away; give a busy machine time to get there.
    deadline = time.monotonic() + 60
    while processes_with_home(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_home(home) == []
    assert list(scratch.iterdir()) == []  # every private runtime folder removed


def error_line(r: CLIResult) -> str:
    """The script's own error line (a root dbus-daemon adds chatter of its own)."""
    assert "Traceback" not in r.err, r
    lines = [ln for ln in r.err.splitlines() if ln.startswith("memvault-headless: error: ")]
    assert len(lines) == 1, r
    return lines[0]


def test_the_page_shows_the_script_and_the_keyring_error_points_to_it() -> None:
    from vault import keybackend

    assert recipe_from_page() == SCRIPT.read_text()
    assert os.access(SCRIPT, os.X_OK)
    assert f"\n## {SECTION}\n" in PAGE.read_text()
    assert "docs/headless.md" in keybackend.SECRET_SERVICE_FIX


@pytest.mark.slow
def test_the_key_persists_across_sessions_under_the_same_passphrase(
    headless: Headless, home: Path, passfile: Path, tmp_path: Path, scratch: Path
) -> None:
    r = headless("init", passfile=passfile)
    assert r.code == 0 and "created vault" in r.out, r
    keyring_file = home / ".local/share/keyrings/login.keyring"
    assert keyring_file.is_file() and PASSPHRASE.strip().encode() not in keyring_file.read_bytes()
    assert (home / ".local/share/memvault/history.db").is_file()

    # A new D-Bus session and a new daemon: the library finds the key init stored.
    r = headless("--", sys.executable, "-c", ADD_ITEM, passfile=passfile)
    assert r.code == 0 and r.out.strip() == "1", r

    # A third one, the passphrase given as a systemd credential.
    credentials = tmp_path / "credentials"
    credentials.mkdir(mode=0o700)
    shutil.copy(passfile, credentials / "memvault-keyring")
    r = headless("show", "agent", credentials=credentials)
    assert r.code == 0 and "hello from the agent" in r.out, r
    assert_nothing_left_running(home, scratch)


def test_a_wrong_passphrase_is_exit_4_and_changes_nothing(
    headless: Headless, home: Path, passfile: Path, tmp_path: Path, scratch: Path
) -> None:
    assert headless("init", passfile=passfile).code == 0
    keyring_file = home / ".local/share/keyrings/login.keyring"
    before = keyring_file.read_bytes()
    wrong = tmp_path / "wrong"
    wrong.write_text("correct horse battery stapler\n")
    for args in (["sessions"], ["rotate"], ["--", "true"]):
        r = headless(*args, passfile=wrong)
        assert r.code == 4, r
        line = error_line(r)
        assert f"the passphrase in {wrong} does not unlock the keyring in {home}" in line
    assert keyring_file.read_bytes() == before
    r = headless("sessions", passfile=passfile)
    assert r.code == 0 and "no sessions" in r.out, r
    assert_nothing_left_running(home, scratch)


def test_a_missing_or_empty_passphrase_file_is_exit_4_before_any_keyring(
    headless: Headless, home: Path, tmp_path: Path
) -> None:
    r = headless("init", passfile=tmp_path / "absent")
    assert r.code == 4 and "cannot read the keyring passphrase file" in error_line(r)
    empty = tmp_path / "empty"
    empty.write_text("")
    # GNOME Keyring would store a keyring made with an empty password unencrypted.
    r = headless("init", passfile=empty)
    assert r.code == 4 and "is empty" in error_line(r)
    assert not (home / ".local").exists()


@pytest.mark.slow
def test_an_agent_under_one_run_needs_a_new_run_after_a_rotation_made_under_another(
    headless: Headless, home: Path, passfile: Path, tmp_path: Path, scratch: Path
) -> None:
    """Runs may overlap, each with its own daemon over the same keyring file, but a
    daemon does not show an entry another daemon added while it runs: after a `rotate`
    under one run, an agent under another fails cleanly (no key for the new version,
    nothing written) until it is started again under a new run."""
    assert headless("init", passfile=passfile).code == 0
    ready, go = tmp_path / "ready", tmp_path / "go"
    agent = f"""
import asyncio, pathlib, sys, time, vault
s = vault.open_session("agent")
asyncio.run(s.add_items([{{"role": "user", "content": "before"}}]))
pathlib.Path({str(ready)!r}).touch()
while not pathlib.Path({str(go)!r}).exists():
    time.sleep(0.05)
try:
    asyncio.run(s.add_items([{{"role": "user", "content": "after"}}]))
except vault.VaultError as exc:
    sys.exit(f"agent: {{exc.message}}")
print([i["content"] for i in asyncio.run(s.get_items())])
"""
    result: list[CLIResult] = []
    worker = threading.Thread(
        target=lambda: result.append(headless("--", sys.executable, "-c", agent, passfile=passfile))
    )
    worker.start()
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert worker.is_alive() and time.monotonic() < deadline, result
            time.sleep(0.1)
        r = headless("rotate", passfile=passfile)
        assert r.code == 0 and "rotated" in r.out, r
    finally:
        go.touch()
        worker.join(300)
    (agent_run,) = result
    assert agent_run.code != 0 and "has no key" in agent_run.err, agent_run
    assert "Traceback" not in agent_run.err, agent_run
    # Nothing was half-written, and a new run reads and writes under the new key.
    r = headless("--json", "show", "agent", passfile=passfile)
    assert r.code == 0 and [i["content"] for i in r.json()["items"]] == ["before"], r
    again = agent.replace("while not", "if not").replace("time.sleep(0.05)", "pass")
    r = headless("--", sys.executable, "-c", again, passfile=passfile)
    assert r.code == 0 and r.out.strip() == "['before', 'before', 'after']", r
    assert_nothing_left_running(home, scratch)
