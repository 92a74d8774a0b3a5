"""One test per claim in SECURITY.md that no other test already makes."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import keyring
from agents import SQLiteSession

import vault as vault_pkg
from tests.conftest import (
    ROOT,
    add_items,
    authenticated_counts,
    key_entry,
    keyring_entries,
    raw_bytes,
    run_cli,
    user,
)
from vault import crypto


def test_a_copy_of_the_file_holds_no_plaintext_and_no_key(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("BACKUP-CANARY-7731")])
    copy = tmp_path / "backup.db"
    shutil.copy(vault_db, copy)
    key = keyring.get_password("memvault", key_entry(vault))
    assert key
    assert b"BACKUP-CANARY" not in copy.read_bytes()
    assert key.encode() not in copy.read_bytes()

    # Whoever opens the copy with the SDK gets only envelopes.
    async def go() -> list[Any]:
        return await SQLiteSession("s", copy).get_items()

    items = asyncio.run(go())
    assert len(items) == 1 and set(items[0]) == {"__enc__", "v", "kid", "payload"}


def test_any_process_of_the_user_can_read_the_key_while_the_keyring_is_unlocked(
    vault: Any,
) -> None:
    # Not protected: code running as you while the keyring is unlocked.
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import keyring; print(keyring.get_password('memvault', {key_entry(vault)!r}))",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.stdout.strip() == keyring.get_password("memvault", key_entry(vault))


def test_the_file_reveals_session_ids_counts_sizes_and_timestamps(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "patient-jane-doe", [user("a"), user("bb" * 500)])
    raw = raw_bytes(vault_db)
    assert b"patient-jane-doe" in raw  # session ids are plaintext
    conn = sqlite3.connect(vault_db)
    n, created = conn.execute("SELECT count(*), max(created_at) FROM agent_messages").fetchone()
    lengths = [len(r[0]) for r in conn.execute("SELECT message_data FROM agent_messages")]
    data = conn.execute("SELECT message_data FROM agent_messages").fetchone()[0]
    conn.close()
    assert n == 2 and created  # counts and row times, without any key
    assert lengths[1] > lengths[0] + 500  # sizes leak through the ciphertext length
    assert crypto.token_timestamp(data) is not None  # Fernet's timestamp is not encrypted


def test_destroying_the_key_makes_every_copy_unreadable(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("gone for good")])
    copy = tmp_path / "copy-taken-before.db"
    shutil.copy(vault_db, copy)
    assert run_cli("revoke", "--yes").code == 0
    assert keyring_entries(vault.vault_id) == {}
    r = run_cli("--db", str(copy), "show", "s")
    assert r.code == 4 and "no key" in r.err


def test_rotation_does_not_protect_old_copies_from_the_old_key(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("rotated away")])
    old_key = keyring.get_password("memvault", key_entry(vault))
    assert old_key
    copy = tmp_path / "before-rotation.db"
    shutil.copy(vault_db, copy)
    assert run_cli("rotate").code == 0
    old = crypto.Sealer(old_key)
    conn = sqlite3.connect(copy)
    before = [r[0] for r in conn.execute("SELECT message_data FROM agent_messages")]
    conn.close()
    assert old.open("s", before[0], None).item == user("rotated away")  # still readable
    conn = sqlite3.connect(vault_db)
    after = [r[0] for r in conn.execute("SELECT message_data FROM agent_messages")]
    conn.close()
    assert old.open("s", after[0], None).state is crypto.ItemState.UNREADABLE


def test_no_output_or_error_ever_contains_the_key(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    key = keyring.get_password("memvault", key_entry(vault))
    assert key
    outputs = [
        run_cli(*a)
        for a in (
            ["--json", "status"],
            ["--json", "sessions"],
            ["--json", "show", "s"],
            ["--json", "log"],
            ["--json", "rotate"],
        )
    ]
    key = keyring.get_password("memvault", key_entry(vault))  # the rotated one
    assert key
    outputs += [run_cli("--json", "status"), run_cli("init")]
    for r in outputs:
        assert key not in r.out and key not in r.err
    assert key not in repr(vault_pkg.Vault.open(vault_db).sealer())
    log = json.dumps(run_cli("--json", "log").json())
    assert key not in log


def test_the_guard_is_no_defence_against_someone_who_can_write_the_file(
    vault: Any, vault_db: Path
) -> None:
    # SECURITY.md: the triggers stop accidents, not an attacker with write access.
    conn = sqlite3.connect(vault_db)
    with conn:
        conn.execute("DROP TRIGGER memvault_guard_insert")
        conn.execute(
            "INSERT INTO agent_messages (session_id, message_data) VALUES ('s', ?)",
            (json.dumps(user("planted")),),
        )
    conn.close()
    # ...but what they plant does not authenticate, so the vault never shows it.
    assert authenticated_counts(vault_db) == (0, 0, 1)
