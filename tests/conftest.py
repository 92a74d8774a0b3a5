"""Shared fixtures.

`scripts/test` (and CI) run the suite inside a private, throwaway Secret Service
(gnome-keyring-daemon under dbus-run-session with a temporary HOME): every test
runs, against the real keyring, and the developer's own keyring is never touched.

Run with plain `python -m pytest` instead (macOS, Windows, or no gnome-keyring),
the suite uses a test-only keyring backend (tests/memory_keyring.py) kept in
the session's temporary folder, and skips the tests marked `secret_service`,
which need the real daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import pty
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import keyring
import pytest

from tests import keyring_daemon

ROOT = Path(__file__).resolve().parent.parent


MEMORY_BACKEND = "tests.memory_keyring.Keyring"
SECRET_SERVICE_SKIP = (
    "marked secret_service: needs the real Secret Service (gnome-keyring-daemon on D-Bus); "
    "run it with scripts/test"
)


def in_private_keyring() -> bool:
    """True under scripts/test (and CI): the real, private Secret Service."""
    return os.environ.get("MEMVAULT_IN_PRIVATE_KEYRING") == "1"


_memory_dir: str | None = None


POSTGRES_URL_VAR = "MEMVAULT_TEST_POSTGRES_URL"
BAO_ADDR_VAR = "MEMVAULT_TEST_BAO_ADDR"


def _refuse_postgres_run_without_a_server(config: pytest.Config) -> None:
    """`-m postgres` without a server would skip every test and report green: refuse it."""
    marks = config.getoption("markexpr", "") or ""
    wants = "postgres" in marks.split() and "not postgres" not in " ".join(marks.split())
    if wants and not os.environ.get(POSTGRES_URL_VAR):
        raise pytest.UsageError(
            f"-m postgres needs a PostgreSQL server and {POSTGRES_URL_VAR} is not set; "
            "run: scripts/with-postgres scripts/test -m postgres"
        )


def _refuse_openbao_run_without_a_server(config: pytest.Config) -> None:
    """The same for `-m openbao`: every test would skip."""
    marks = " ".join((config.getoption("markexpr", "") or "").split())
    wants = "openbao" in marks.split() and "not openbao" not in marks
    if wants and not os.environ.get(BAO_ADDR_VAR):
        raise pytest.UsageError(
            f"-m openbao needs an OpenBao server and {BAO_ADDR_VAR} is not set; "
            "run: scripts/with-openbao scripts/test -m openbao"
        )


def pytest_configure(config: pytest.Config) -> None:
    global _memory_dir
    _refuse_postgres_run_without_a_server(config)
    _refuse_openbao_run_without_a_server(config)
    if in_private_keyring():
        from vault.secretservice import adopt

        backend = keyring.get_keyring()
        assert type(backend).__module__ == "keyring.backends.SecretService", backend
        # The tests' own keyring calls open their connections as memvault's do.
        keyring.set_keyring(adopt(backend))
        # The bus is saved: a test may change the variable.
        keyring_daemon.watch(os.environ["DBUS_SESSION_BUS_ADDRESS"])
        return
    # Outside scripts/test: never the developer's own keyring. The memory backend's file
    # lives in a temporary folder; the variables reach every subprocess a test starts.
    from tests import memory_keyring

    _memory_dir = tempfile.mkdtemp(prefix="memvault-test-keyring-")
    os.environ[memory_keyring.ENV_FILE] = str(Path(_memory_dir) / "keyring.json")
    os.environ["PYTHON_KEYRING_BACKEND"] = MEMORY_BACKEND
    # So that a subprocess started from another folder can still import tests.memory_keyring.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    keyring.set_keyring(memory_keyring.Keyring())


def pytest_unconfigure(config: pytest.Config) -> None:
    if _memory_dir is not None:
        shutil.rmtree(_memory_dir, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before -m deselects a sweep's later cases
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_sweeps(items)
    if in_private_keyring():
        return  # CI and scripts/test run everything
    skip = pytest.mark.skip(reason=SECRET_SERVICE_SKIP)
    for item in items:
        if item.get_closest_marker("secret_service") is not None:
            item.add_marker(skip)


def mark_sweeps(items: list[pytest.Item]) -> None:
    """A test marked `sweep` runs the same check over many cases (every command, every bad
    value): its first case stays in the fast tier; the others are `later_case`, which the
    fast tier leaves out and --all runs with the rest, in parallel."""
    seen: set[str] = set()
    for item in items:
        if item.get_closest_marker("sweep") is None:
            continue
        if getattr(item, "callspec", None) is None:
            raise pytest.UsageError(f"{item.nodeid} is marked sweep but is not parametrized")
        function = item.nodeid.split("[")[0]
        if function in seen:
            item.add_marker(pytest.mark.later_case)
        seen.add(function)


# -- The private keyring's daemon: a death mid-test fails that test, by name ------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when == "setup":
        return  # a death in setup is caught at the call, or at the teardown
    death = keyring_daemon.death_of_the_daemon()
    if death is None:
        return
    keyring_daemon.blamed()  # this test alone
    report = outcome.get_result()
    report.outcome = "failed"
    report.longrepr = f"{death}\n{report.longrepr or ''}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per skip reason, with its count: the same reason on 50 tests is one line."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_sep("=", "skipped, by reason")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"SKIPPED {n}: {reason}")


@pytest.fixture(autouse=True)
def vault_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own vault path (not created), via MEMVAULT_DB."""
    db = tmp_path / "vaultdir" / "history.db"
    monkeypatch.setenv("MEMVAULT_DB", str(db))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("MEMVAULT_FAILPOINT", raising=False)
    return db


class CLIResult:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self) -> Any:
        return json.loads(self.out)

    def __repr__(self) -> str:
        return f"<exit {self.code} out={self.out[-500:]!r} err={self.err[-500:]!r}>"


def run_cli(
    *args: str, input: str | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> CLIResult:
    """`python -m vault ARGS` in a real subprocess."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "vault", *args],
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )
    return CLIResult(proc)


GUIDE_CODE = "ZEPHYR-4821"


def guide_step(name: str, db: str | Path) -> dict[str, Any]:
    """One step of the guide's four checks (vault.demo) in a process of its own, on a vault
    file or a PostgreSQL URL: its last stdout line, as JSON."""
    proc = subprocess.run(
        [sys.executable, "-m", "vault.demo", name, str(db), GUIDE_CODE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder of the test's own straight under /tmp, for a TMPDIR the keyring scripts
    keep their folders in (under a deeper one they use /tmp, where a test cannot tell
    theirs from another run's); removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="mvt-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def cli() -> Any:
    return run_cli


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL into a fresh schema of the test server; the schema is dropped afterwards."""
    from tests.pgserver import SERVER_URL, sql

    schema = "t_" + secrets.token_hex(6)
    url = f"{SERVER_URL}?schema={schema}"
    yield url
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    if sql(url, "SELECT to_regclass('memvault_keys') IS NOT NULL AS x")[0]["x"]:
        ks = KeyStore()
        for vault_id, kid in sql(
            url,
            "SELECT (SELECT value FROM memvault_meta WHERE key = 'vault_id'), kid "
            "FROM memvault_keys",
        ):
            ks.delete(entry_name(vault_id, kid))
    sql(SERVER_URL, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def key() -> Iterator[str]:
    """A transit key name of the test's own on the OpenBao test server (tests.baoserver),
    not created yet (`init` or the test creates it); deleted afterwards, if it exists."""
    from tests import baoserver

    name = baoserver.key_name()
    yield name
    baoserver.admin_transit(name).delete_key()


@pytest.fixture
def pg_vault(pg_url: str) -> Any:
    from vault.engines.postgres.vault import PgVault

    return PgVault.init(pg_url, ttl=3600)


@pytest.fixture
def vault(vault_db: Path) -> Iterator[Any]:
    """An initialised vault (real keyring); shredded afterwards if still there."""
    from vault import Vault

    v = Vault.init(vault_db, ttl=3600)
    yield v
    if vault_db.exists():
        from vault.engines.sqlite.vault import shred

        if holds_open(vault_db):
            # An SDK session the test left unclosed keeps its connection until collected:
            # shred would wait out its lock timeout for it, then fail and leave the key.
            gc.collect()
        with contextlib.suppress(Exception):
            shred(vault_db)


def holds_open(db: Path) -> bool:
    """True if this process has the database or a side file of it open. Where the OS
    cannot tell (no /proc), say so: the caller then collects garbage to be sure."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        return True
    names = {os.path.realpath(db) + suffix for suffix in ("", "-wal", "-shm", "-journal")}
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd) in names:
                return True
    return False


def key_entry(vault: Any) -> str:
    """The keyring username of the key version the vault file uses now."""
    from vault.keyjournal import entry_name

    return entry_name(vault.vault_id, vault.meta()["kid"])


def keyring_items() -> list[tuple[dict[str, str], str]]:
    """Every secret in the session's keyring, any service, any collection: (attributes, secret).

    The `keyring` API cannot list, so this reads the store underneath: through
    secretstorage in the Secret Service, or the test backend's file.
    """
    if not in_private_keyring():
        from tests import memory_keyring

        return [
            ({"service": service, "username": name}, secret)
            for service, stored in memory_keyring.entries().items()
            for name, secret in stored.items()
        ]

    import secretstorage

    from vault.secretservice import connect

    conn = connect()
    try:
        for _attempt in range(20):
            out = []
            try:
                for coll in secretstorage.get_all_collections(conn):
                    assert not coll.is_locked(), "a locked collection cannot be listed"
                    for item in coll.get_all_items():
                        secret = item.get_secret().decode("utf-8", "replace")
                        out.append((item.get_attributes(), secret))
            except secretstorage.exceptions.ItemNotFoundException:
                continue  # deleted while listed, by a test sharing the daemon: list again
            return out
        raise AssertionError("the keyring's items kept changing while listed")
    finally:
        conn.close()


def keyring_entries(vault_id: str) -> dict[str, str]:
    """Every keyring entry of this vault, in any collection: username -> secret.

    This is how a test sees a key memvault left behind under a name it did not look up.
    """
    out: dict[str, str] = {}
    for attrs, secret in keyring_items():
        name = attrs.get("username", "")
        mine = name == vault_id or name.startswith((vault_id + "/", vault_id + "."))
        if attrs.get("service") == "memvault" and mine:
            assert name not in out, f"two keyring entries named {name}"
            out[name] = secret
    return out


def key_entries(vault_id: str) -> dict[str, str]:
    """The vault's key versions' entries: `keyring_entries` without its anchor
    (vault.chainanchor), which holds no key."""
    from vault.chainanchor import entry_name as anchor_name

    return {k: v for k, v in keyring_entries(vault_id).items() if k != anchor_name(vault_id)}


def add_items(db: Path, session_id: str, items: list[Any]) -> None:
    """Write items through the real SDK session, in this process."""
    import vault as vault_pkg

    async def go() -> None:
        s = vault_pkg.open_session(session_id, db)
        await s.add_items(items)
        s.close()

    asyncio.run(go())


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def raw_bytes(db: Path) -> bytes:
    """Every byte of the database and its side files."""
    out = b""
    for suffix in ("", "-wal", "-shm", "-journal"):
        p = db.with_name(db.name + suffix)
        if p.exists():
            out += p.read_bytes()
    return out


def insert_sealed(db: Path, session_id: str, items: list[Any], at: int | None = None) -> None:
    """Seal items with the vault's key at a chosen Fernet time and insert them with SQL."""
    import sqlite3

    from tests.chainkit import insert_chained
    from vault import Vault

    sealer = Vault.open(db).sealer()
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", (session_id,))
        insert_chained(
            conn, sealer, [(session_id, sealer.seal(session_id, item, at)) for item in items]
        )
    conn.close()


def authenticated_counts(db: Path) -> tuple[int, int, int]:
    """(readable, expired, unreadable) over every item, each authenticated under the key.

    What `status` used to count and no longer does (its counts are unverified now):
    the tests that check that items survived check it here, item by item.
    """
    from vault import Vault
    from vault.vaultops import tally

    v = Vault.open(db)
    readable = expired = unreadable = 0
    for sid in v.session_ids():
        # Every row, in a tampered session too (whose history `items` refuses).
        items, exp, bad = tally(v.opened_items(sid, include_tampered=True))
        readable, expired, unreadable = readable + len(items), expired + exp, unreadable + bad
    return readable, expired, unreadable


def rows(db: Path, session_id: str | None = None) -> list[str]:
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        if session_id is None:
            return [
                r[0] for r in conn.execute("SELECT message_data FROM agent_messages ORDER BY id")
            ]
        return [
            r[0]
            for r in conn.execute(
                "SELECT message_data FROM agent_messages WHERE session_id = ? ORDER BY id",
                (session_id,),
            )
        ]
    finally:
        conn.close()


def default_sigint() -> None:
    """Give a child Ctrl-C's default action back.

    A shell starts background jobs with SIGINT ignored, and an ignored signal stays
    ignored across exec, so Python would never raise KeyboardInterrupt: the Ctrl-C
    tests would hang when the suite itself runs in the background.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_on_terminal(
    args: list[str],
    answers: list[tuple[bytes, str]],
    timeout: float = 120,
    *,
    argv: list[str] | None = None,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """Run `python -m vault ARGS` (or `argv`) on a pseudo-terminal, answering each prompt
    in turn."""
    command = argv if argv is not None else [sys.executable, "-m", "vault", *args]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its stdin, stdout, stderr and controlling tty
        default_sigint()
        os.chdir(cwd)
        os.execve(command[0], command, os.environ if env is None else env)
    output = b""
    seen = 0
    pending = list(answers)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            if pending and pending[0][0] in output[seen:]:
                prompt, answer = pending.pop(0)
                seen = output.index(prompt, seen) + len(prompt)
                os.write(fd, answer.encode() + b"\r")
    finally:
        # Never wait for ever on a child that ignored what it was sent: the test fails instead.
        done, status = os.waitpid(pid, os.WNOHANG)
        end = time.monotonic() + 10
        while not done and time.monotonic() < end:
            time.sleep(0.05)
            done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert not pending, output
    return os.waitstatus_to_exitcode(status), output


class ScriptedCompactor:
    """Stands in for the Responses compact endpoint, as ScriptedModel does for the model:
    pass `.client` as `OpenAIResponsesCompactionSession(..., client=...)`."""

    def __init__(self, text: str = "summary", role: str = "assistant") -> None:
        self.calls: list[dict[str, Any]] = []
        self.text = text
        self.role = role
        self.client = SimpleNamespace(responses=self)

    async def compact(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        kind = "output_text" if self.role == "assistant" else "input_text"
        content: dict[str, Any] = {"type": kind, "text": self.text}
        if kind == "output_text":
            content["annotations"] = []
        summary = {"type": "message", "role": self.role, "content": [content]}
        return SimpleNamespace(output=[summary], usage=None)
