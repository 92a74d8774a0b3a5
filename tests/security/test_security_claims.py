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
import pytest
from agents import SQLiteSession

import vault as vault_pkg
from tests.conftest import (
    ROOT,
    add_items,
    key_entries,
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


def test_the_file_reveals_its_audit_trail_vault_id_ttl_and_key_history(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("a"), user("b")])
    backup = tmp_path / "nightly-backup.db"
    assert run_cli("ttl", "3d").code == 0
    assert run_cli("backup", str(backup)).code == 0
    first_kid = vault.meta()["kid"]
    assert run_cli("rotate").code == 0
    assert run_cli("purge", "--yes").code == 0
    # Read with plain sqlite3 from a copy, no key anywhere: only the file's own tables.
    copy = tmp_path / "copy.db"
    shutil.copy(vault_db, copy)
    conn = sqlite3.connect(copy)
    meta = dict(conn.execute("SELECT key, value FROM memvault_meta"))
    audit = conn.execute("SELECT at, event, kid, details FROM memvault_audit").fetchall()
    keys = dict(conn.execute("SELECT kid, state FROM memvault_keys"))
    conn.close()
    assert meta["vault_id"] == vault.vault_id
    assert meta["ttl_seconds"] == str(3 * 86400)
    assert keys[first_kid] != "current" and keys[meta["kid"]] == "current"
    assert meta["created_at"] and meta["rotated_at"]
    events = [e for _, e, _, _ in audit]
    assert {"init", "ttl", "backup", "rotate", "purge"} <= set(events), events
    assert all(at for at, _, _, _ in audit)  # times
    assert first_kid in {k for _, _, k, _ in audit}  # key ids
    details = " ".join(d for _, _, _, d in audit)
    assert "nightly-backup.db" in details  # backup paths
    assert '"items": 2' in details and '"sessions": 1' in details  # counts


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


def key_spellings(keys: set[str]) -> set[str]:
    """Each master key as stored, in standard base64, and its 32 raw bytes in hex."""
    out = set()
    for key in keys:
        out |= {key, key.replace("-", "+").replace("_", "/"), crypto.master_key_bytes(key).hex()}
    return out


@pytest.mark.slow
def test_no_output_or_error_ever_contains_any_key_version(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("x")])
    pass_file = tmp_path / "pass"
    pass_file.write_text("correct horse battery staple, output\n")
    pass_file.chmod(0o600)
    kit = str(tmp_path / "kit.json")
    # Every key version this vault's keyring ever held, read after each command: a
    # rotation deletes the old entry, so reading only at the end would miss it.
    keys: set[str] = set()

    def run(*args: str, code: int | None = None) -> Any:
        keys.update(key_entries(vault.vault_id).values())
        r = run_cli(*args)
        keys.update(key_entries(vault.vault_id).values())
        assert code is None or r.code == code, (args, r)
        return r

    outputs = []
    for json_flag in ([], ["--json"]):
        outputs += [
            run(*json_flag, "status", code=0),
            run(*json_flag, "sessions", code=0),
            run(*json_flag, "show", "s", code=0),
            run(*json_flag, "search", "x", code=0),
            run(*json_flag, "verify", code=0),
            run(*json_flag, "key", "list", code=0),
            run(*json_flag, "ttl", code=0),
            run(*json_flag, "log", code=0),
            run(*json_flag, "export", "s", "-o", str(tmp_path / f"e{len(json_flag)}.json"), code=0),
            run(*json_flag, "key", "export", "--passphrase-file", str(pass_file), kit, code=0),
            run(*json_flag, "backup", str(tmp_path / f"b{len(json_flag)}.db"), code=0),
            run(*json_flag, "rotate", code=0),
            # Error paths: a kit of a retired key, a key export over a kit, a missing
            # session, a usage error, no vault, then a wrong key in the keyring.
            run(*json_flag, "key", "import", "--passphrase-file", str(pass_file), kit),
            run(*json_flag, "key", "export", "--passphrase-file", str(pass_file), kit),
            run(*json_flag, "show", "no-such-session"),
            run(*json_flag, "pop", "s", "-n", "0", code=2),
            run(*json_flag, "--db", str(tmp_path / "none.db"), "show", "s", code=3),
            run(*json_flag, "init", code=1),
        ]
        (tmp_path / "kit.json").unlink()
    entry = key_entry(vault)
    right = keyring.get_password("memvault", entry)
    assert right
    wrong = crypto.generate_key()
    keyring.set_password("memvault", entry, wrong)
    outputs += [run("show", "s", code=4), run("--json", "rotate", code=4)]
    keyring.set_password("memvault", entry, right)
    outputs += [run("--json", "rotate", code=0)]
    assert wrong in keys and len(keys) >= 5, "the keys were not collected"
    spellings = key_spellings(keys)
    for r in outputs:
        for key in spellings:
            assert key not in r.out and key not in r.err, r
    files = [vault_db, *tmp_path.glob("b*.db"), *tmp_path.glob("e*.json")]
    assert len(files) == 5
    for path in files:
        data = path.read_bytes()
        assert not any(key.encode() in data for key in spellings), path
    assert not any(key in repr(vault_pkg.Vault.open(vault_db).sealer()) for key in spellings)


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
    # ...but what they plant does not authenticate, so the vault never shows it: in a
    # chained session it is tampering, and the whole session is refused...
    r = run_cli("show", "s")
    assert r.code == 1 and "does not verify (unauthenticated)" in r.err, r
    assert "planted" not in r.out + r.err
    # ...and `verify` reports the planted row, its session and the dropped trigger.
    r = run_cli("--json", "verify")
    assert r.code == 1, r
    doc = r.json()
    assert doc["problems"]["unauthenticated_items"] == 1, doc
    assert doc["details"]["history_chain"] == ["session 's': unauthenticated"]  # no head either
    assert (doc["items"], doc["authenticated"]) == (1, 0)
    assert any("memvault_guard_insert is missing" in d for d in json.dumps(doc).split('"')), doc


def raw_envelope(vault_db: Path, payload: str) -> str:
    kid = vault_pkg.Vault.open(vault_db).meta()["kid"]
    return json.dumps({"__enc__": 1, "v": 1, "kid": kid, "payload": payload})


def test_the_guard_checks_the_token_head_not_the_payload_and_verify_catches_it(
    vault: Any, vault_db: Path
) -> None:
    # The SQLite guard reads the kid and a `gAAAAA` head, no more: plaintext after a
    # Fernet-looking head, under the current kid, gets into the file...
    add_items(vault_db, "s", [user("a real item")])
    planted = raw_envelope(vault_db, "gAAAAA my card 4111 1111 1111 1111")
    with sqlite3.connect(vault_db) as conn:
        conn.execute(  # any text in the chain column passes the guard: it cannot check a MAC
            "INSERT INTO agent_messages (session_id, message_data, chain) VALUES ('s', ?, 'x')",
            (planted,),
        )
    conn.close()
    assert b"my card 4111" in raw_bytes(vault_db)
    # ...where it never authenticates: memvault never shows it and `verify` reports it.
    r = run_cli("show", "s")
    assert r.code == 1 and "does not verify (unauthenticated)" in r.err, r
    assert "4111" not in r.out + r.err
    r = run_cli("show", "s", "--include-tampered")
    assert r.code == 1 and "failed authentication" in r.err and "a real item" in r.out, r
    assert "4111" not in r.out + r.err
    r = run_cli("--json", "verify")
    assert r.code == 1, r
    assert r.json()["problems"]["unauthenticated_items"] == 1
    assert "4111" not in r.out + r.err


def session_rows(vault_db: Path, session_id: str) -> list[tuple[int, str, str]]:
    with sqlite3.connect(vault_db) as conn:
        got = conn.execute(
            "SELECT id, message_data, chain FROM agent_messages WHERE session_id = ? ORDER BY id",
            (session_id,),
        ).fetchall()
    conn.close()
    return got


def test_swapped_duplicated_or_replayed_envelopes_within_a_session_are_detected(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    # An envelope authenticates its session; its chain link, its place in it (the history
    # chain): reordering, copying or bringing back valid rows, links and all, is named.
    add_items(vault_db, "s", [user("first"), user("second"), user("third")])
    copy = tmp_path / "older.db"
    shutil.copy(vault_db, copy)
    assert run_cli("pop", "s").code == 0
    (id1, one, l1), (id2, two, l2) = session_rows(vault_db, "s")
    popped = session_rows(copy, "s")[2][1:]  # the item `pop` removed, from an older copy
    with sqlite3.connect(vault_db) as conn:
        for data, link, at in ((two, l2, id1), (one, l1, id2)):
            conn.execute(
                "UPDATE agent_messages SET message_data = ?, chain = ? WHERE id = ?",
                (data, link, at),
            )
        for data, link in ((one, l1), popped):
            conn.execute(
                "INSERT INTO agent_messages (session_id, message_data, chain) VALUES ('s', ?, ?)",
                (data, link),
            )
    conn.close()
    r = run_cli("show", "s")
    assert r.code == 1 and r.out == "" and "does not verify (swapped)" in r.err, r
    r = run_cli("--json", "verify")
    assert r.code == 1, r
    assert r.json()["details"]["history_chain"] == ["session 's': swapped (its item #1)"], r
