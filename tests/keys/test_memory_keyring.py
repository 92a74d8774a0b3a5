"""The suite's two keyring modes.

Under scripts/test (and CI) every test runs against the real Secret Service. Outside
it (macOS, Windows, no gnome-keyring) the suite runs on the test-only file-backed
keyring of tests/memory_keyring.py and skips only the tests marked `secret_service`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keyring
import pytest
from keyring.backends import SecretService

from tests import memory_keyring
from tests.conftest import MEMORY_BACKEND, ROOT, in_private_keyring

OWN_VARS = ("MEMVAULT_IN_PRIVATE_KEYRING", "PYTHON_KEYRING_BACKEND", memory_keyring.ENV_FILE)


def env_without(*names: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in names}
    env.update(extra)
    return env


def vault_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vault", *args],
        input="",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )


def run_probes(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """This file's two probe tests, in a pytest of their own."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-k", "probe", "-rs", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )


# -- Probes: run by the tests below in a pytest of their own ------------------------
def test_probe_the_session_uses_the_keyring_its_mode_promises(tmp_path: Path) -> None:
    if in_private_keyring():
        assert isinstance(keyring.get_keyring(), SecretService.Keyring)
        return
    assert isinstance(keyring.get_keyring(), memory_keyring.Keyring)
    assert os.environ["PYTHON_KEYRING_BACKEND"] == MEMORY_BACKEND
    # A CLI subprocess inherits the session's backend: its key is in the session's file.
    made = vault_cli("--db", str(tmp_path / "v.db"), "--json", "init", env=dict(os.environ))
    assert made.returncode == 0, made.stderr
    vault_id, kid = json.loads(made.stdout)["vault_id"], json.loads(made.stdout)["kid"]
    stored = memory_keyring.entries("memvault")["memvault"]
    assert f"{vault_id}/{kid}" in stored


@pytest.mark.secret_service
def test_probe_a_secret_service_test() -> None:
    assert isinstance(keyring.get_keyring(), SecretService.Keyring)


# -- The modes -------------------------------------------------------------------
def test_memvault_accepts_the_test_backend_as_it_is() -> None:
    from vault.keybackend import refusal

    assert refusal(memory_keyring.Keyring()) is None


def test_the_test_keyring_file_keeps_a_key_across_processes(tmp_path: Path) -> None:
    store = tmp_path / "keyring.json"
    env = env_without(
        *OWN_VARS, PYTHON_KEYRING_BACKEND=MEMORY_BACKEND, **{memory_keyring.ENV_FILE: str(store)}
    )
    db = tmp_path / "v.db"
    made = vault_cli("--db", str(db), "init", env=env)
    assert made.returncode == 0, made.stderr
    entries = json.loads(store.read_text())["memvault"]
    assert len([name for name in entries if not name.endswith("/anchor")]) == 1
    status = vault_cli("--db", str(db), "--json", "status", env=env)
    assert status.returncode == 0, status.stderr
    assert MEMORY_BACKEND in status.stdout  # the backend it names is the test one
    # Another process reads the key the first one stored: the vault opens.
    shown = vault_cli("--db", str(db), "ttl", env=env)  # needs the key (sessions does not)
    assert shown.returncode == 0, shown.stderr
    # And without the file the key is gone: it was kept there, nowhere else.
    store.unlink()
    assert vault_cli("--db", str(db), "ttl", env=env).returncode == 4


WRITER = """
import sys
from tests.memory_keyring import Keyring
k = Keyring()
for i in range(int(sys.argv[2])):
    k.set_password("svc", f"{sys.argv[1]}-{i}", "secret")
"""


def test_concurrent_writers_lose_no_entry(tmp_path: Path) -> None:
    store = tmp_path / "keyring.json"
    env = env_without(*OWN_VARS, **{memory_keyring.ENV_FILE: str(store)})
    env["PYTHONPATH"] = str(ROOT)
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(n), "60"], env=env, cwd=tmp_path)
        for n in range(4)
    ]
    assert [w.wait(timeout=300) for w in writers] == [0] * 4
    assert len(json.loads(store.read_text())["svc"]) == 4 * 60


@pytest.mark.slow
def test_outside_scripts_test_the_memory_keyring_is_used_and_secret_service_tests_skip() -> None:
    proc = run_probes(env_without(*OWN_VARS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout
    assert "marked secret_service" in proc.stdout and "scripts/test" in proc.stdout, proc.stdout


@pytest.mark.secret_service
def test_under_scripts_test_no_test_is_skipped_for_the_secret_service() -> None:
    proc = run_probes(dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout
