"""Which commands reach the keyring (docs/keys.md, "Which commands need the key").

`sessions` lists ids and counts that are in the file in clear: it neither loads keyring
nor calls it, so it works with a keyring that fails every call (locked, gone, another
machine's), and a revoked vault is refused by its own mark. `status` says whether the
key is present and matching, so it does reach the keyring; every command that reads or
writes items needs the key and fails with exit 4 when the keyring does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_fast_imports import probe
from tests.conftest import add_items, raw_bytes, run_cli, user

# A backend that fails every call and notes each one in $FAILING_KEYRING_LOG, so a test
# can tell "not reached" from "reached and failed".
FAILING = """
import os

from keyring.backend import KeyringBackend


def _note(what):
    with open(os.environ["FAILING_KEYRING_LOG"], "a") as log:
        log.write(what + "\\n")


class Failing(KeyringBackend):
    priority = 1

    def __init__(self):
        super().__init__()
        _note("backend")

    def get_password(self, service, username):
        _note("get")
        raise RuntimeError("this keyring fails every call")

    def set_password(self, service, username, password):
        _note("set")
        raise RuntimeError("this keyring fails every call")

    def delete_password(self, service, username):
        _note("delete")
        raise RuntimeError("this keyring fails every call")
"""


def failing_keyring(tmp_path: Path) -> tuple[dict[str, str], Path]:
    (tmp_path / "failing.py").write_text(FAILING)
    log = tmp_path / "keyring-calls.log"
    env = {
        "PYTHON_KEYRING_BACKEND": "failing.Failing",
        "PYTHONPATH": str(tmp_path),
        "FAILING_KEYRING_LOG": str(log),
    }
    return env, log


def one_error_line(r: Any, code: int, *needles: str) -> None:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memvault: error: "), r.err
    assert "Traceback" not in r.err
    for n in needles:
        assert n in r.err, (n, r.err)


def test_sessions_lists_a_vault_without_reaching_the_keyring(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s1", [user("one"), user("two")])
    add_items(vault_db, "s2", [user("three")])
    env, log = failing_keyring(tmp_path)
    before = raw_bytes(vault_db)

    r = run_cli("--json", "sessions", env=env)
    assert r.code == 0, r
    assert {s["session_id"]: s["items"] for s in r.json()} == {"s1": 2, "s2": 1}
    assert r.err == ""
    assert not log.exists(), log.read_text()  # the backend was not even constructed
    assert raw_bytes(vault_db) == before
    # Not loaded at all, with the real keyring selected too: nor its D-Bus client.
    code, loaded = probe("sessions", watch=("keyring", "secretstorage", "jeepney"))
    assert (code, loaded) == (0, [])

    # Controls: the same failing keyring is reached, and fails, where the key is needed.
    one_error_line(run_cli("show", "s1", env=env), 4)
    assert "get" in log.read_text().split()
    log.unlink()
    st = run_cli("--json", "status", env=env)
    assert st.code == 0 and st.json()["key"] == "unusable" and st.json()["key_problem"], st
    assert log.exists()
    code, loaded = probe("status", watch=("keyring",))
    assert code == 0 and "keyring" in loaded
    assert raw_bytes(vault_db) == before


def test_sessions_refuses_a_revoked_vault_by_its_mark(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s1", [user("one")])
    assert run_cli("revoke", "--yes").code == 0
    env, log = failing_keyring(tmp_path)
    one_error_line(run_cli("sessions", env=env), 4, "revoked", "memvault shred")
    assert not log.exists(), log.read_text()


@pytest.mark.parametrize(
    "args", [["--help"], ["--version"], ["log"], ["completion", "bash"], ["sessions"]]
)
@pytest.mark.sweep
def test_the_commands_that_need_no_key_neither_call_nor_load_the_keyring(
    args: list[str], vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s1", [user("one")])
    env, log = failing_keyring(tmp_path)
    r = run_cli(*args, env=env)
    assert r.code == 0, r
    assert not log.exists(), log.read_text()  # the backend was not even constructed
    code, loaded = probe(*args, watch=("keyring", "secretstorage", "jeepney"))
    assert (code, loaded) == (0, [])
