"""A `key move` on a vault file put back from an older copy: refused, nothing moved. A
move to a transit key drops the keyring's anchor and a move back starts it afresh, so
the two would carry the older state past the rollback's evidence. Real keyring, real
OpenBao server, real `memvault` subprocesses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import baoserver
from tests.conftest import add_items, run_cli, user
from tests.keys.test_key_move import keyring_write
from tests.keys.test_transit_vault_lifecycle import meta_rows
from tests.keys.test_transit_vaults import cli_at, operator_env
from tests.security.test_whole_file_rollback import copy_of, file_seq, put_back
from vault import Vault
from vault.chaincheck import Tamper

pytestmark = [pytest.mark.secret_service, *baoserver.MARKS]


def test_a_key_move_refuses_a_file_put_back_and_moves_nothing(
    vault: Vault, vault_db: Path, tmp_path: Path, key: str
) -> None:
    add_items(vault_db, "s", [user("first")])
    older = copy_of(vault_db, tmp_path / "older.db")
    add_items(vault_db, "s", [user("the turn a rollback takes away")])
    put_back(older, vault_db)
    seq, rows = file_seq(vault_db), meta_rows(str(vault_db))
    op = operator_env(tmp_path)

    proc = cli_at(str(vault_db), op, "key", "move", f"transit:{key}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "older than the state memvault recorded" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert meta_rows(str(vault_db)) == rows and file_seq(vault_db) == seq
    r = run_cli("--json", "verify")
    assert r.code == 1, r
    assert Tamper.FILE_ROLLED_BACK.value in r.json()["details"]["history_chain"][0], r

    # Accepted on purpose, the same move goes through.
    assert run_cli("accept", "--yes").code == 0
    proc = cli_at(str(vault_db), op, "key", "move", f"transit:{key}")
    assert proc.returncode == 0, proc.stderr
    assert meta_rows(str(vault_db))["key_source"] == f"transit:{key}"


def test_a_key_move_after_a_rotation_cut_off_at_its_switch_goes_through_at_once(
    key: str, tmp_path: Path
) -> None:
    """Loading the key finishes the cut-off rotation and destroys its old key: the move
    takes the new one only (it used to ask for the old one, and fail once)."""
    db = str(tmp_path / "v" / "history.db")
    op = operator_env(tmp_path)
    made = json.loads(cli_at(db, op, "--json", "init").stdout)
    keyring_write(db, op, "s", "one")
    cut = cli_at(db, {**op, "MEMVAULT_FAILPOINT": "after-switch"}, "rotate")
    assert cut.returncode == -9, cut.stderr
    meta = meta_rows(db)
    assert meta["rotating_from"] == made["kid"] != meta["kid"]

    proc = cli_at(db, op, "--json", "key", "move", f"transit:{key}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["moved"] == [meta["kid"]]
    assert cli_at(db, op, "verify").returncode == 0
