"""`accept` and `restore` move the anchor outside the file on purpose. When that record
fails (the keyring refuses the write), the file has changed and the anchor has not:
the command says so on stderr, in one line with what to do, instead of reporting
success alone. A fake failure of the keyring's write of the anchor entry only; the
key and everything else go through the real Secret Service."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import add_items, run_cli, user
from tests.security.test_whole_file_rollback import anchor_seq, copy_of, file_seq, put_back
from vault import Vault, chainanchor
from vault.cli import cli
from vault.errors import KeyProblem
from vault.keys import KeyStore


def refuse_anchor_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    real_set = KeyStore.set

    def refusing(self: KeyStore, name: str, key: str) -> None:
        if name == chainanchor.entry_name(name.removesuffix("/anchor")):
            raise KeyProblem("the keyring refused to store the entry (a test's fault)")
        real_set(self, name, key)

    monkeypatch.setattr(KeyStore, "set", refusing)


def invoke(db: Path, *args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, ["--db", str(db), *args], prog_name="memvault")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(args) from r.exception
    return r.exit_code, r.stdout, r.stderr


def test_an_accept_whose_anchor_is_not_moved_says_so(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("kept")])
    older = copy_of(vault_db, tmp_path / "older.db")
    add_items(vault_db, "s", [user("taken away")])
    recorded = anchor_seq(vault)
    put_back(older, vault_db)

    with pytest.MonkeyPatch.context() as refused:
        refuse_anchor_writes(refused)
        assert Vault(vault_db).accept_history().anchored is False
        code, out, err = invoke(vault_db, "accept", "--yes")
    assert code == 0 and "accepted 1 session" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the state is accepted"), err
    assert "could not be moved" in lines[0]
    assert f"memvault --db {vault_db} accept --yes" in lines[0]
    assert anchor_seq(vault) == recorded  # the anchor was not moved

    # The keyring answers again: the advice given works.
    r = run_cli("--json", "accept", "--yes")
    assert r.code == 0 and r.json()["anchored"] is True and r.err == "", r
    assert anchor_seq(vault) == file_seq(vault_db)
    assert run_cli("verify").code == 0


def test_a_restore_whose_anchor_is_not_moved_says_so(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("in the backup")])
    backup = tmp_path / "b.db"
    assert run_cli("backup", str(backup)).code == 0
    add_items(vault_db, "s", [user("after the backup")])
    recorded = anchor_seq(vault)

    with pytest.MonkeyPatch.context() as refused:
        refuse_anchor_writes(refused)
        code, out, err = invoke(vault_db, "--json", "restore", str(backup), "--yes")
    assert code == 0 and '"anchored": false' in out, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the backup is restored"), err
    assert f"memvault --db {vault_db} accept --yes" in lines[0]
    assert anchor_seq(vault) == recorded

    r = run_cli("--json", "accept", "--yes")
    assert r.code == 0 and r.json()["anchored"] is True, r
    assert anchor_seq(vault) == file_seq(vault_db)
    assert run_cli("verify").code == 0
