"""`init --key-source` and `key rewrap` refusals that need no key service: one line,
the documented exit code, nothing created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli

NO_SERVICE = {"VAULT_ADDR": "", "BAO_ADDR": "", "VAULT_TOKEN": "", "BAO_TOKEN": ""}


def one_line(r: Any, code: int, *words: str) -> None:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.err, r.err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--key-source", "vault:k"], 2, "is not a key source"),
        (["--key-source", "transit:"], 2, "is not a key source"),
        (["--key-source", "transit:bad/name"], 2, "is not a transit key name"),
        (["--key-source", "transit:k", "--transit-mount", "a b"], 2, "is not a mount path"),
        (["--transit-mount", "transit"], 2, "goes with --key-source transit:KEYNAME"),
        (["--key-source", "transit:k"], 4, "set VAULT_ADDR or BAO_ADDR"),
    ],
)
def test_init_refuses_a_key_source_it_cannot_use_and_creates_nothing(
    vault_db: Path, args: list[str], code: int, says: str
) -> None:
    one_line(run_cli("init", *args, env=NO_SERVICE), code, says)
    assert not vault_db.exists()


def test_init_with_the_keyring_source_is_the_default(vault_db: Path) -> None:
    r = run_cli("--json", "init", "--key-source", "keyring")
    assert r.code == 0, r
    assert r.json()["key_source"] == "keyring"
    st = run_cli("--json", "status")
    assert st.code == 0 and st.json()["key_source"] == "keyring", st
    run_cli("shred", "--yes")


def test_key_rewrap_of_a_keyring_vault_says_there_is_nothing_wrapped(vault: Any) -> None:
    one_line(run_cli("key", "rewrap"), 2, "keeps its keys in the keyring", "--key-source")


def test_key_move_to_the_source_a_vault_already_uses_changes_nothing(vault: Any) -> None:
    r = run_cli("--json", "key", "move", "keyring")
    assert r.code == 0, r
    assert r.json()["already"] is True and r.json()["moved"] == []
    assert run_cli("--json", "status").json()["key"] == "present and matching"


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["bogus"], 2, "is not a key source"),
        (["keyring", "--transit-mount", "m"], 2, "goes with --key-source transit:KEYNAME"),
        (["transit:k"], 4, "set VAULT_ADDR or BAO_ADDR"),
    ],
)
def test_key_move_refuses_a_source_it_cannot_use_and_changes_nothing(
    vault: Any, args: list[str], code: int, says: str
) -> None:
    before = vault.meta()
    one_line(run_cli("key", "move", *args, env=NO_SERVICE), code, says)
    assert vault.meta() == before
    assert run_cli("--json", "status").json()["key"] == "present and matching"
