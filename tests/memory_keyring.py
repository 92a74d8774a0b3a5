"""A test-only keyring backend, for running the suite where there is no Secret Service.

Selected with ``PYTHON_KEYRING_BACKEND=tests.memory_keyring.Keyring`` (tests/conftest.py
does it when the suite runs outside ``scripts/test``). It is never used by memvault
itself, and memvault's own rules on backends apply to it unchanged.

Why a file and not a dict: most tests run the CLI in real subprocesses (``run_cli``,
``python -m vault``), and a key stored by ``memvault init`` in one process must be there
for ``memvault status`` in the next, as it is with a real OS keyring. A dict in one
process's memory would vanish with that process, so the entries live in one JSON file
named by ``MEMVAULT_TEST_KEYRING_FILE`` (in the test session's temporary folder), shared
by every process of the session. Each read-modify-write holds a lock file, so concurrent
processes do not lose each other's writes; the JSON file is replaced atomically, so a
reader never sees half of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from keyring.backend import KeyringBackend
from keyring.errors import PasswordDeleteError

ENV_FILE = "MEMVAULT_TEST_KEYRING_FILE"


def store_path() -> Path:
    raw = os.environ.get(ENV_FILE)
    if not raw:
        raise RuntimeError(f"{ENV_FILE} is not set: the test keyring needs a file to share")
    return Path(raw)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on PATH.lock for one read-modify-write."""
    # Builtin open, never os.open: some tests spy on os.open to see memvault's own flags.
    lock_file = open(path.with_name(path.name + ".lock"), "a+b")  # noqa: SIM115
    fd = lock_file.fileno()
    try:
        if os.name == "nt":
            import msvcrt

            while True:  # LK_LOCK gives up after ~10 s; a busy test machine can take longer
                try:
                    msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                    break
                except OSError:
                    time.sleep(0.01)
            try:
                yield
            finally:
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        lock_file.close()


def _read(path: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    assert isinstance(data, dict), path
    return data


def _write(path: Path, data: dict[str, dict[str, str]]) -> None:
    # Only this process writes this name (the lock is held), so "x" cannot collide.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def entries(service: str | None = None) -> dict[str, dict[str, str]]:
    """Every stored entry: service -> {username: secret} (one service if named)."""
    path = store_path()
    with _locked(path):
        data = _read(path)
    if service is not None:
        return {service: dict(data.get(service, {}))}
    return data


class Keyring(KeyringBackend):
    """Entries in one JSON file shared by every process of a test session."""

    priority = 1  # type: ignore[assignment]  # only ever chosen by name

    def get_password(self, service: str, username: str) -> str | None:
        return entries(service)[service].get(username)

    def set_password(self, service: str, username: str, password: str) -> None:
        path = store_path()
        with _locked(path):
            data = _read(path)
            data.setdefault(service, {})[username] = password
            _write(path, data)

    def delete_password(self, service: str, username: str) -> None:
        path = store_path()
        with _locked(path):
            data = _read(path)
            if username not in data.get(service, {}):
                raise PasswordDeleteError("Password not found")
            del data[service][username]
            _write(path, data)
