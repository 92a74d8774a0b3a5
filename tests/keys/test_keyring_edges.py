"""The keyring at its edges: every failure is exit 4 with its fix, nothing hangs,
and no backend that leaves the key unprotected is accepted.

The real cases run against real D-Bus and a real gnome-keyring-daemon (a stopped
one for the hang); a fake backend only adds the focused hang-at-start case.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import keyring
import pytest

from tests.conftest import ROOT, CLIResult, add_items, key_entry, keyring_entries, raw_bytes, user

PLAINTEXT = "keyrings.alt.file.PlaintextKeyring"
ENCRYPTED = "keyrings.alt.file.EncryptedKeyring"
# What keyring falls back to without a session bus: the encrypted file backend where
# pycryptodome is installed (the test extra installs it), else the plaintext one.
FALLBACK = ENCRYPTED if importlib.util.find_spec("Crypto") else PLAINTEXT


def run(
    *args: str,
    set_env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
    timeout: float = 90,
) -> CLIResult:
    """`python -m vault ARGS` in a subprocess, with variables set and removed."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(set_env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "vault", *args],
        input="",
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )
    return CLIResult(proc)


def one_line(r: CLIResult, code: int, *needles: str) -> str:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memvault: error: "), r.err
    assert "Traceback" not in r.err and "unexpected error" not in r.err, r.err
    for n in needles:
        assert n in r.err, (n, r.err)
    return lines[0]


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def filled(vault: Any, vault_db: Path) -> Path:
    add_items(vault_db, "s", [user("x")])
    return vault_db


# Commands that need the key (`sessions` does not: tests/keys/test_which_commands_need_the_key.py).
COMMANDS = (["show", "s"], ["ttl"], ["rotate"], ["clear", "s", "--yes"])


# -- No Secret Service reachable -----------------------------------------------
@pytest.mark.secret_service
def test_no_dbus_session_says_what_is_missing_and_how_to_start_one(
    filled: Path, tmp_path: Path
) -> None:
    before = raw_bytes(filled)
    for args in COMMANDS:
        one_line(
            run(*args, unset=("DBUS_SESSION_BUS_ADDRESS",)),
            4,
            "DBUS_SESSION_BUS_ADDRESS is not set",
            "dbus-run-session",
            "gnome-keyring-daemon --unlock",
            "docs/headless.md",
        )
    new = tmp_path / "new" / "h.db"
    one_line(run("--db", str(new), "init", unset=("DBUS_SESSION_BUS_ADDRESS",)), 4, "D-Bus")
    assert not new.exists()
    assert raw_bytes(filled) == before


@pytest.mark.secret_service
@pytest.mark.parametrize("address", ["unix:path={tmp}/no-bus-here", "not-an-address"])
def test_an_unreachable_bus_address_is_named_with_the_fix(
    filled: Path, tmp_path: Path, address: str
) -> None:
    address = address.format(tmp=tmp_path)
    before = raw_bytes(filled)
    for args in COMMANDS:
        one_line(
            run(*args, set_env={"DBUS_SESSION_BUS_ADDRESS": address}),
            4,
            "cannot start",
            f"DBUS_SESSION_BUS_ADDRESS={address}",
            "dbus-run-session",
        )
    assert raw_bytes(filled) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("keyring.backends.SecretServce.Keyring", "cannot be imported"),
        ("keyring.backends.SecretService.Keyrin", "has no class Keyrin"),
        ("SecretService", "not a dotted module.Class name"),
        ("", "not a dotted module.Class name"),
    ],
)
def test_a_mistyped_backend_variable_is_named_with_its_value(
    filled: Path, tmp_path: Path, value: str, problem: str
) -> None:
    env = {"PYTHON_KEYRING_BACKEND": value}
    for args in COMMANDS:
        one_line(
            run(*args, set_env=env),
            4,
            f"PYTHON_KEYRING_BACKEND={value!r}",
            problem,
            "keyring.backends.SecretService.Keyring",
        )
    new = tmp_path / "new" / "h.db"
    one_line(run("--db", str(new), "init", set_env=env), 4, "PYTHON_KEYRING_BACKEND")
    assert not new.exists()


# -- Backends that do not protect the key --------------------------------------
def test_the_plaintext_backend_is_refused_and_writes_no_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    # The plaintext keyring writes under XDG_DATA_HOME (else HOME): both point here.
    env = {
        "PYTHON_KEYRING_BACKEND": PLAINTEXT,
        "HOME": str(home),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
    }
    db = tmp_path / "v" / "h.db"
    line = one_line(
        run("--db", str(db), "init", set_env=env),
        4,
        PLAINTEXT,
        "refuses",
        "unencrypted",
        "PYTHON_KEYRING_BACKEND selects it",
    )
    assert "mv1:" not in line
    assert files_under(home) == []
    assert not db.exists() and not db.parent.exists()


def test_the_encrypted_file_backend_is_refused_without_asking_for_a_password(
    filled: Path, tmp_path: Path
) -> None:
    # keyrings.alt's EncryptedKeyring keeps the key in a file behind a typed password:
    # refused before it prompts (stdin is empty: a prompt would fail, not hang).
    home = tmp_path / "home"
    home.mkdir()
    backend = ENCRYPTED
    env = {
        "PYTHON_KEYRING_BACKEND": backend,
        "HOME": str(home),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
    }
    db = tmp_path / "v" / "h.db"
    line = one_line(run("--db", str(db), "init", set_env=env), 4, backend, "refuses")
    assert "password" in line and "mv1:" not in line
    for args in COMMANDS:
        one_line(run(*args, set_env=env), 4, backend, "refuses")
    assert files_under(home) == []
    assert not db.exists() and not db.parent.exists()


def test_an_existing_vault_is_not_opened_through_the_plaintext_backend(
    filled: Path, vault: Any, tmp_path: Path
) -> None:
    # Even with the key copied into the plaintext file, memvault does not read it there.
    home = tmp_path / "home"
    env = {
        "PYTHON_KEYRING_BACKEND": PLAINTEXT,
        "HOME": str(home),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
    }
    planted = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import keyring
            keyring.set_password("memvault", {key_entry(vault)!r}, {vault.sealer().master_key!r})
        """),
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert planted.returncode == 0, planted.stderr
    plain = files_under(home)
    assert plain, "the plaintext keyring wrote nothing: the test would prove nothing"
    for args in COMMANDS:
        one_line(run(*args, set_env=env), 4, "refuses", PLAINTEXT)
    assert files_under(home) == plain


def test_the_file_backend_keyring_picks_by_itself_is_refused(filled: Path, tmp_path: Path) -> None:
    # No session bus and no choice made: keyring falls back to a keyrings.alt file backend.
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "XDG_DATA_HOME": str(home / "share"),
        "XDG_CONFIG_HOME": str(home / "config"),
    }
    unset = ("DBUS_SESSION_BUS_ADDRESS", "PYTHON_KEYRING_BACKEND")
    new = tmp_path / "new" / "h.db"
    one_line(
        run("--db", str(new), "init", set_env=env, unset=unset),
        4,
        FALLBACK,
        "keyring chose it",
        "DBUS_SESSION_BUS_ADDRESS is not set",
    )
    one_line(run("show", "s", set_env=env, unset=unset), 4, FALLBACK, "refuses")
    assert files_under(home) == []
    assert not new.exists()


def test_a_chain_of_only_file_backends_is_refused(tmp_path: Path) -> None:
    # Without a session bus the chainer holds nothing but a keyrings.alt file backend.
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PYTHON_KEYRING_BACKEND": "keyring.backends.chainer.ChainerBackend",
        "HOME": str(home),
        "XDG_DATA_HOME": str(home / "share"),
    }
    db = tmp_path / "v" / "h.db"
    one_line(
        run("--db", str(db), "init", set_env=env, unset=("DBUS_SESSION_BUS_ADDRESS",)),
        4,
        "refuses",
        FALLBACK,
    )
    assert files_under(home) == []
    assert not db.exists()


@pytest.mark.secret_service  # the chain is of the backends keyring finds: Secret Service
def test_a_chain_keeps_the_key_only_in_the_backends_that_protect_it(
    vault_db: Path, tmp_path: Path
) -> None:
    # The Secret Service and the plaintext file are both chained: only the first is used.
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PYTHON_KEYRING_BACKEND": "keyring.backends.chainer.ChainerBackend",
        "HOME": str(home),
        "XDG_DATA_HOME": str(home / "share"),
    }
    r = run("--json", "init", set_env=env)
    assert r.code == 0, r
    made = r.json()
    assert made["keyring"] == (
        "keyring.backends.chainer.ChainerBackend(keyring.backends.SecretService.Keyring)"
    )
    assert keyring.get_password("memvault", f"{made['vault_id']}/{made['kid']}")
    assert files_under(home) == []
    assert run("shred", "--yes", set_env=env).code == 0
    assert keyring_entries(made["vault_id"]) == {}


# -- A keyring that stops answering --------------------------------------------
STOPPED_DAEMON = r"""
set -e
cd "$1"
python -m vault --db "$2" init >/dev/null
pid=$(python - <<'P'
from jeepney import DBusAddress, new_method_call
from jeepney.io.blocking import open_dbus_connection
bus = DBusAddress("/org/freedesktop/DBus", bus_name="org.freedesktop.DBus",
                  interface="org.freedesktop.DBus")
with open_dbus_connection("SESSION") as conn:
    call = new_method_call(bus, "GetConnectionUnixProcessID", "s", ("org.freedesktop.secrets",))
    print(conn.send_and_get_reply(call, timeout=30).body[0])
P
)
# Only this private keyring's own daemon, found through its own private bus.
trap 'kill -CONT "$pid"' EXIT
kill -STOP "$pid"
set +e
MEMVAULT_KEYRING_TIMEOUT=2 timeout 60 python -m vault --db "$2" show s
echo "exit=$?" >&2
"""


def in_another_private_keyring(script: str, db: Path) -> subprocess.CompletedProcess[str]:
    """`bash -c SCRIPT x ROOT DB` inside a second private keyring of its own, so that
    stopping or killing its daemon cannot touch the one the rest of the suite uses."""
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_IN_PRIVATE_KEYRING"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [str(ROOT / "scripts" / "with-keyring"), "bash", "-c", script, "x", str(ROOT), str(db)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )


@pytest.mark.secret_service
@pytest.mark.slow
def test_a_stopped_keyring_daemon_is_exit_4_not_a_hang(tmp_path: Path) -> None:
    proc = in_another_private_keyring(STOPPED_DAEMON, tmp_path / "h.db")
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert err and err[-1] == "exit=4", proc.stderr  # `timeout` would make it 124
    errors = [line for line in err if line.startswith("memvault: error:")]
    assert len(errors) == 1, proc.stderr
    assert "did not answer within 2 s" in errors[0], proc.stderr
    assert "MEMVAULT_KEYRING_TIMEOUT" in errors[0]
    assert "Traceback" not in proc.stderr


SILENT_BACKENDS = """
import threading

from keyring.backend import KeyringBackend
from keyring.compat import properties


class Silent(KeyringBackend):
    priority = 1

    def get_password(self, service, username):
        threading.Event().wait()

    def set_password(self, service, username, password):
        threading.Event().wait()

    def delete_password(self, service, username):
        threading.Event().wait()


class SilentAtStart(Silent):
    @properties.classproperty
    def priority(cls):
        threading.Event().wait()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "doing"),
    [("silent.Silent", "read the vault key"), ("silent.SilentAtStart", "find the keyring backend")],
)
def test_a_backend_that_never_answers_is_given_up_on(
    filled: Path, tmp_path: Path, backend: str, doing: str
) -> None:
    (tmp_path / "silent.py").write_text(SILENT_BACKENDS)
    env = {
        "PYTHON_KEYRING_BACKEND": backend,
        "PYTHONPATH": str(tmp_path),
        "MEMVAULT_KEYRING_TIMEOUT": "1.5",
    }
    before = raw_bytes(filled)
    for args in (["show", "s"], ["rotate"]):
        one_line(run(*args, set_env=env, timeout=60), 4, "did not answer within 1.5 s", doing)
    new = tmp_path / "new" / "h.db"
    one_line(run("--db", str(new), "init", set_env=env, timeout=60), 4, "did not answer")
    assert not new.exists()
    assert raw_bytes(filled) == before


@pytest.mark.parametrize("value", ["abc", "inf", "nan", "-5", "0", "1e308", "10s"])
@pytest.mark.sweep
def test_a_bad_keyring_timeout_is_a_usage_error(filled: Path, value: str) -> None:
    one_line(
        run("sessions", set_env={"MEMVAULT_KEYRING_TIMEOUT": value}),
        2,
        f"MEMVAULT_KEYRING_TIMEOUT={value!r}",
        "unset it",
    )


def test_a_sane_keyring_timeout_is_accepted(filled: Path) -> None:
    r = run("show", "s", set_env={"MEMVAULT_KEYRING_TIMEOUT": "30"})
    assert r.code == 0 and "x" in r.out, r


# -- The private keyring the suite runs in (scripts/with-keyring) ----------------
DAEMON_DIES = r"""
set -e
cd "$1"
python -m vault --db "$2" init >/dev/null
pid=$(python - <<'P'
from jeepney import DBusAddress, new_method_call
from jeepney.io.blocking import open_dbus_connection
bus = DBusAddress("/org/freedesktop/DBus", bus_name="org.freedesktop.DBus",
                  interface="org.freedesktop.DBus")
with open_dbus_connection("SESSION") as conn:
    call = new_method_call(bus, "GetConnectionUnixProcessID", "s", ("org.freedesktop.secrets",))
    print(conn.send_and_get_reply(call, timeout=30).body[0])
P
)
# Only this private keyring's own daemon, found through its own private bus.
kill -KILL "$pid"
while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
set +e
python -m vault --db "$2" sessions
echo "exit=$?" >&2
"""


@pytest.mark.secret_service
@pytest.mark.slow
def test_the_private_keyring_comes_back_unlocked_if_its_daemon_dies(tmp_path: Path) -> None:
    # D-Bus restarts a dead daemon on the next call; it must come back unlocked, with the
    # keys it held, or every later test meets a locked keyring.
    proc = in_another_private_keyring(DAEMON_DIES, tmp_path / "h.db")
    assert proc.stderr.strip().splitlines()[-1:] == ["exit=0"], proc.stderr
    assert proc.stdout.strip() == "no sessions", proc.stdout


# -- An entry deleted between the keyring's search and its fetch ---------------
class ItemNotFoundException(Exception):  # noqa: N818  secretstorage's name, matched by name
    pass


class Vanishing:
    """A backend whose entry is found, then gone when fetched (another process deleted
    it: a rotation dropping the key it retired), `fails` times in a row."""

    def __init__(self, fails: int, value: str | None) -> None:
        self.fails, self.value, self.calls = fails, value, 0

    def get_password(self, service: str, username: str) -> str | None:
        self.calls += 1
        if self.calls <= self.fails:
            raise ItemNotFoundException("Item does not exist!")
        return self.value


def test_an_entry_deleted_while_being_read_is_missing_not_a_broken_keyring() -> None:
    from vault.keys import KeyStore

    always = Vanishing(fails=99, value=None)
    assert KeyStore(backend=always).get("mv-x/mv1:0000000000000000") is None
    assert always.calls == 5  # searched again each time, then judged gone

    once = Vanishing(fails=1, value="a key")
    assert KeyStore(backend=once).get("mv-x/mv1:0000000000000000") == "a key"
