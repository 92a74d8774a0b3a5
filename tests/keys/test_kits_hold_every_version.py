"""A recovery kit holds every key version the vault needs; one kit opens every copy.

The real keyring and real `memvault` subprocesses; kits with more than one key
are made by `key export` (a rotation paused holding its pending key) or by the
kit module itself (a key saved before a rotation, as a retained version is).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tests.cli.test_ctrl_c import interrupt, rotate_until_paused
from tests.conftest import add_items, key_entries, run_cli, user
from tests.keys.test_kit import (
    PASS,
    copy_vault,
    export,
    import_,
    key_entry,
    no_secret,
    one_line_error,
)
from vault import crypto, kit
from vault.keyjournal import entry_name


@pytest.mark.slow
def test_a_kit_holds_the_pending_version_of_a_rotation_under_way(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("one")])
    current = vault.meta()["kid"]
    proc = rotate_until_paused("after-pending")  # the new key stored, nothing committed
    try:
        pending = [k for k in key_entries(vault.vault_id) if not k.endswith(current)]
        assert len(pending) == 1
        out = tmp_path / "kit.json"
        # The kit is written; recording the export waits for the rotation's lock: exit 5.
        r = run_cli(
            "key",
            "export",
            "--passphrase-stdin",
            str(out),
            input=PASS + "\n",
            env={"MEMVAULT_LOCK_TIMEOUT": "1"},
        )
        assert r.code == 5, r
    finally:
        interrupt(proc)
    doc = json.loads(out.read_text())
    assert doc["version"] == 2 and doc["kid"] == current
    assert sorted(doc["kids"]) == sorted([current, pending[0].split("/", 1)[1]])
    for key in key_entries(vault.vault_id).values():
        no_secret(key, r)


@pytest.mark.slow
def test_one_kit_opens_the_live_vault_and_a_cp_copy_made_before_a_rotation(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("NORD-42")])
    copy = tmp_path / "copy" / "history.db"
    copy_vault(vault_db, copy)  # `cp`, not `memvault backup`: no mark, the old key
    old_kid, old_key = vault.meta()["kid"], vault.keystore.get(key_entry(vault))
    assert run_cli("rotate").code == 0
    new_kid, new_key = vault.meta()["kid"], vault.keystore.get(key_entry(vault))
    # A kit holding both versions, as a vault that retained the old one exports it.
    both = tmp_path / "both.json"
    kit.write_kit_file(both, kit.seal(new_key, vault.vault_id, PASS, {old_kid: old_key}).to_json())
    assert run_cli("--db", str(copy), "show", "s").code == 4  # its key went with the rotation

    r = import_(both, "--db", str(copy), "--json")
    assert r.code == 0, r
    assert r.json()["stored_kids"] == [old_kid], r
    # The copy is older than the state the live vault recorded (its anchor): refused as
    # a whole file put back, yet the kit's key opens it, marked.
    r = run_cli("--db", str(copy), "show", "s")
    assert r.code == 1 and "older than the state memvault recorded" in r.err, r
    r = run_cli("--db", str(copy), "--json", "show", "s", "--include-tampered")
    assert r.code == 0 and "NORD-42" in r.out, r
    # The live vault needs only its own key: the old one is not stored for it.
    vault.keystore.delete(entry_name(vault.vault_id, old_kid))
    vault.keystore.delete(key_entry(vault))
    r = import_(both, "--json")
    assert r.code == 0 and r.json()["stored_kids"] == [new_kid], r
    assert sorted(key_entries(vault.vault_id)) == [entry_name(vault.vault_id, new_kid)]
    assert run_cli("show", "s").code == 0
    no_secret(old_key, r)
    no_secret(new_key, r)


def version_1_kit(path: Path, key: str, vault_id: str) -> None:
    """A kit as memvault 0.2 wrote it: one key, sealed as it is, no `kids`."""
    salt, nonce = secrets.token_bytes(16), secrets.token_bytes(12)
    fields = (vault_id, crypto.key_id(key), "2026-01-01T00:00:00Z", 2**14, 8, 1, salt, nonce)
    unsealed = kit.Kit(*fields, b"", 1)
    wrapping = kit._derive(PASS, salt, 2**14, 8, 1)
    sealed = AESGCM(wrapping).encrypt(nonce, key.encode(), unsealed.associated_data())
    kit.write_kit_file(path, kit.Kit(*fields, sealed, 1).to_json())


def test_an_old_single_key_kit_still_imports(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "s", [user("one")])
    key = vault.keystore.get(key_entry(vault))
    old = tmp_path / "v1.json"
    version_1_kit(old, key, vault.vault_id)
    doc = json.loads(old.read_text())
    assert doc["version"] == 1 and "kids" not in doc
    vault.keystore.delete(key_entry(vault))
    r = import_(old)
    assert r.code == 0 and "restored key" in r.out, r
    assert vault.keystore.get(key_entry(vault)) == key


@pytest.mark.slow
def test_unknown_kit_versions_and_edited_key_lists_are_refused(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    out = tmp_path / "kit.json"
    assert export(out).code == 0
    good = json.loads(out.read_text())
    for name, change in {
        "v3": {"version": 3},
        "true": {"version": True},
        "float": {"version": 2.0},
        "no-kids": {"kids": []},
        "kid-not-listed": {"kids": ["mv1:" + "0" * 16]},
    }.items():
        bad = tmp_path / f"{name}.json"
        bad.write_text(json.dumps({**good, **change}))
        r = import_(bad)
        assert r.code == 1, (name, r)
        assert "not a usable memvault recovery kit" in one_line_error(r), name
    # A key id added to the list is authenticated data: the kit no longer opens.
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({**good, "kids": [*good["kids"], "mv1:" + "1" * 16]}))
    r = import_(extra)
    assert r.code == 1 and "altered" in one_line_error(r), r


def test_rotate_reminds_to_export_a_new_kit_in_json_and_in_words(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("one")])
    r = run_cli("--json", "rotate")
    assert r.code == 0, r
    assert "memvault key export" in r.json()["kit_reminder"], r
    r = run_cli("rotate")
    assert r.code == 0
    assert "run `memvault key export` again" in r.out, r
