"""A vault made by memvault 0.2.0 (its file and its keyring entry) still reads, and moves
to this version's format on its first open, so that 0.2 refuses it afterwards (0.2's
start-up tidy would destroy the key versions this version keeps for backups)."""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.conftest import keyring_entries, run_cli
from vault.chainanchor import entry_name as anchor_name
from vault.engines.sqlite.schema import FILE_FORMAT
from vault.keys import KeyStore

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v0_2_0"


class OldVault(NamedTuple):
    db: Path
    expected: Any


def meta_of(db: Path) -> dict[str, str]:
    conn = sqlite3.connect(db)
    try:
        return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
    finally:
        conn.close()


@pytest.fixture
def old_vault(tmp_path: Path) -> Iterator[OldVault]:
    entries: dict[str, str] = json.loads((FIXTURE / "keyring.json").read_text())
    expected = json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))
    folder = tmp_path / "old"
    folder.mkdir(mode=0o700)
    copy = folder / "history.db"
    shutil.copyfile(FIXTURE / "history.db", copy)
    copy.chmod(0o600)
    ks = KeyStore()
    for name, secret in entries.items():
        ks.set(name, secret)
    try:
        yield OldVault(copy, expected)
    finally:
        vault_id = meta_of(FIXTURE / "history.db")["vault_id"]
        for name in keyring_entries(vault_id):  # the anchor the upgrade set too
            ks.delete(name)


def test_a_0_2_0_vault_reads_every_item_and_moves_to_the_current_format(
    old_vault: OldVault,
) -> None:
    db, expected = old_vault.db, old_vault.expected
    assert meta_of(db)["format"] == "memvault/2"
    for sid, items in expected.items():
        r = run_cli("--db", str(db), "--json", "show", sid)
        assert r.code == 0, r
        assert r.json()["items"] == items, r.out
    # memvault/4: chained (m010), which 0.2 (memvault/2) and 0.3 before the chain
    # (memvault/3) refuse; the rows the file had are linked by this first open.
    assert meta_of(db)["format"] == FILE_FORMAT == "memvault/4"
    assert meta_of(db)["chain"] == "on"
    r = run_cli("--db", str(db), "--json", "verify")
    assert r.code == 0, r
    r = run_cli("--db", str(db), "--json", "key", "list")
    assert r.code == 0, r
    assert [k["state"] for k in r.json()["keys"]] == ["destroyed", "current"], r.out


def test_the_file_from_before_the_upgrade_put_back_is_refused_not_linked_again(
    old_vault: OldVault,
) -> None:
    db = old_vault.db
    before = db.read_bytes()
    sid = next(iter(old_vault.expected))
    r = run_cli("--db", str(db), "--json", "show", sid)
    assert r.code == 0, r  # the upgrade: linked, and the vault's anchor set
    vault_id = meta_of(db)["vault_id"]
    assert anchor_name(vault_id) in keyring_entries(vault_id)
    for side in ("-wal", "-shm"):
        Path(f"{db}{side}").unlink(missing_ok=True)
    db.write_bytes(before)  # `cp` of the unchained copy over the chained vault
    for args in (["show", sid], ["verify"], ["export", "--all", "-o", str(db.parent / "out")]):
        r = run_cli("--db", str(db), *args)
        assert r.code == 1, (args, r)
        assert "never chained" in r.err and "Traceback" not in r.err, r
    assert meta_of(db).get("chain") != "on"  # nothing was linked
