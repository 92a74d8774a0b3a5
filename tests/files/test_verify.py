"""`memvault verify`: each kind of damage found and counted, deterministically built.

Real subprocesses, the real keyring, real SQLite files; the damage is made with
plain sqlite3 or by rewriting bytes of a page, as an attacker or a bad disk would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import add_items, insert_sealed, run_cli, user
from tests.keys.test_keyring_edges import in_another_private_keyring
from tests.keys.test_rotation import one_line_error
from vault import Vault
from vault.engines.sqlite import schema
from vault.verify import BATCH, PROBLEMS

NONE = dict.fromkeys(PROBLEMS, 0)


def filled(vault_db: Path) -> None:
    add_items(vault_db, "carnet-local", [user("code name NORD-17"), user("repeat it")])
    add_items(vault_db, "work", [user("standup at nine")])


def sql(db: Path, *statements: str | tuple[str, tuple[Any, ...]]) -> None:
    """Run statements with plain sqlite3 (no memvault), committed."""
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        for st in statements:
            if isinstance(st, tuple):
                conn.execute(*st)
            else:
                conn.execute(st)


def tamper(db: Path, row_id: int) -> None:
    """Flip one character in the middle of an item's Fernet token; the envelope's
    shape and kid stay valid, so the guard trigger lets the UPDATE through."""
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        (data,) = conn.execute(
            "SELECT message_data FROM agent_messages WHERE id = ?", (row_id,)
        ).fetchone()
        env = json.loads(data)
        token = env["payload"]
        i = len(token) // 2
        env["payload"] = token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1 :]
        conn.execute(
            "UPDATE agent_messages SET message_data = ? WHERE id = ?", (json.dumps(env), row_id)
        )


def verify_json(*extra: str) -> tuple[int, dict[str, Any], str]:
    r = run_cli(*extra, "--json", "verify")
    return r.code, r.json(), r.err


def test_a_healthy_vault_verifies(vault: Vault, vault_db: Path) -> None:
    filled(vault_db)
    r = run_cli("verify")
    assert r.code == 0, r
    assert r.err == ""
    assert "result     ok" in r.out
    assert "3 items in 2 sessions: 3 authenticate" in r.out
    code, doc, err = verify_json()
    assert code == 0 and err == ""
    assert doc["ok"] is True
    assert doc["problems"] == NONE
    assert (doc["items"], doc["authenticated"], doc["sessions"]) == (3, 3, 2)
    assert doc["key"] == "present and matching"
    assert doc["kid"] == vault.meta()["kid"]


def test_tampered_items_are_counted_across_batches(vault: Vault, vault_db: Path) -> None:
    filled(vault_db)
    insert_sealed(vault_db, "bulk", [{"n": i} for i in range(BATCH * 2 + 10)])
    total = 3 + BATCH * 2 + 10
    assert run_cli("verify").code == 0  # control: healthy before the damage
    tamper(vault_db, 2)  # in the first batch
    tamper(vault_db, total - 1)  # in the last one
    r = run_cli("verify")
    assert r.code == 1, r
    err = one_line_error(r)
    assert "unauthenticated_items 2" in err, err
    assert "unauthenticated_items (2)" in r.out
    assert "item 2 of session 'carnet-local'" in r.out
    assert f"item {total - 1} of session 'bulk'" in r.out
    assert "what to do:" in r.out
    code, doc, _ = verify_json()
    assert code == 1
    assert doc["ok"] is False
    # Each in a chained session: its session's history does not verify either.
    assert doc["problems"] == {**NONE, "unauthenticated_items": 2, "history_chain": 2}
    assert (doc["items"], doc["authenticated"]) == (total, total - 2)
    assert "unauthenticated_items" in doc["fixes"]


GUARD_SQL = "SELECT sql FROM sqlite_master WHERE name = 'memvault_guard_update'"


@pytest.mark.sweep
@pytest.mark.parametrize(
    ("damage", "detail"),
    [
        ("dropped", "memvault_guard_update is missing"),
        ("neutered", "memvault_guard_update differs from the one memvault creates"),
        ("extra", "unexpected trigger 'copy_out'"),
    ],
)
def test_guard_trigger_damage_is_counted(
    vault: Vault, vault_db: Path, damage: str, detail: str
) -> None:
    filled(vault_db)
    if damage == "dropped":
        sql(vault_db, "DROP TRIGGER memvault_guard_update")
    elif damage == "neutered":  # same name, never fires
        sql(
            vault_db,
            "DROP TRIGGER memvault_guard_update",
            "CREATE TRIGGER memvault_guard_update BEFORE UPDATE OF message_data ON "
            "agent_messages WHEN 0 BEGIN SELECT RAISE(ABORT, 'no'); END",
        )
    else:  # a trigger that would copy every new item elsewhere
        sql(
            vault_db,
            "CREATE TABLE loot (d TEXT)",
            "CREATE TRIGGER copy_out AFTER INSERT ON agent_messages "
            "BEGIN INSERT INTO loot VALUES (NEW.message_data); END",
        )
    code, doc, err = verify_json()
    assert code == 1, err
    assert doc["problems"] == {**NONE, "guard_triggers": 1}
    assert doc["details"]["guard_triggers"] == [detail]
    assert doc["authenticated"] == 3


def put_back_m003s_guard(db: Path) -> None:
    """The file's guard as m003 made it, before m008 replaced it."""
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("DROP TRIGGER memvault_guard_insert")
        conn.execute("DROP TRIGGER memvault_guard_update")
        schema.m003_guard_triggers(conn)


def test_m003s_guard_under_a_recorded_m008_is_reported(vault: Vault, vault_db: Path) -> None:
    """Going back to the older, costlier guard (which let duplicate labels in) is a
    tampered file once m008 is recorded as applied."""
    filled(vault_db)
    put_back_m003s_guard(vault_db)
    code, doc, err = verify_json()
    assert code == 1, err
    assert doc["problems"] == {**NONE, "guard_triggers": 2}
    assert doc["details"]["guard_triggers"] == [
        "memvault_guard_insert differs from the one memvault creates",
        "memvault_guard_update differs from the one memvault creates",
    ]


def test_a_file_not_yet_given_m008_is_judged_by_m003s_guard(vault: Vault, vault_db: Path) -> None:
    """A file an older memvault wrote has m003's triggers until a command migrates it:
    verify reports the migrations, not the triggers, and still finds a tampered one."""
    filled(vault_db)
    put_back_m003s_guard(vault_db)
    sql(
        vault_db,
        "DELETE FROM memvault_migrations "
        "WHERE name IN ('m008_guard_triggers_text_first', 'm010_history_chain')",
    )
    code, doc, err = verify_json()
    assert code == 1, err
    assert doc["problems"] == {**NONE, "schema": 2}
    assert doc["details"]["schema"] == [
        "migration m008_guard_triggers_text_first is not applied",
        "migration m010_history_chain is not applied",
    ]

    sql(
        vault_db,
        "DROP TRIGGER memvault_guard_update",
        "CREATE TRIGGER memvault_guard_update BEFORE UPDATE OF message_data ON "
        "agent_messages WHEN 0 BEGIN SELECT RAISE(ABORT, 'no'); END",
    )
    code, doc, err = verify_json()
    assert code == 1, err
    assert doc["problems"] == {**NONE, "schema": 2, "guard_triggers": 1}
    assert doc["details"]["guard_triggers"] == [
        "memvault_guard_update differs from the one memvault creates"
    ]
    # Control: a command migrates the file, which then has m008's guard and verifies.
    assert run_cli("status").code == 0
    assert run_cli("verify").code == 0


def test_broken_meta_is_counted(vault: Vault, vault_db: Path) -> None:
    filled(vault_db)
    sql(
        vault_db,
        "UPDATE memvault_meta SET value = 'soon' WHERE key = 'ttl_seconds'",
        "DELETE FROM memvault_meta WHERE key = 'created_at'",
    )
    code, doc, err = verify_json()
    assert code == 1, err
    assert doc["problems"] == {**NONE, "meta": 2}
    assert sorted(doc["details"]["meta"]) == [
        "created_at is missing",
        "ttl_seconds 'soon' is not a TTL",
    ]
    assert doc["authenticated"] == 3  # the items are still checked


def test_a_vault_whose_meta_lacks_its_kid_is_reported_not_refused(
    vault: Vault, vault_db: Path
) -> None:
    filled(vault_db)
    sql(vault_db, "DELETE FROM memvault_meta WHERE key = 'kid'")
    assert run_cli("status").code == 3  # every other command: not a usable vault
    code, doc, err = verify_json()
    assert code == 1, err
    assert doc["problems"] == {**NONE, "meta": 1}
    assert doc["details"]["meta"] == ["kid is missing"]
    assert doc["authenticated"] is None and doc["items"] == 3
    assert doc["unverified_reason"] == "the meta does not name the vault's key"


def page_bytes(db: Path, name: str) -> tuple[int, int]:
    """(offset, size) of the root page of table or index `name`, in a checkpointed file."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (root,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)
        ).fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    return (root - 1) * size, size


def test_a_corrupt_index_page_fails_the_integrity_check(vault: Vault, vault_db: Path) -> None:
    add_items(vault_db, "sess-abcdef", [user(f"hello {i}") for i in range(10)])
    assert run_cli("verify").code == 0
    offset, size = page_bytes(vault_db, "idx_agent_messages_session_id")
    data = bytearray(vault_db.read_bytes())
    # One index entry now names another session: the table and its index disagree.
    at = data.index(b"sess-abcdef", offset, offset + size)
    data[at + 10] = ord("g")
    vault_db.write_bytes(bytes(data))
    with contextlib.closing(sqlite3.connect(vault_db)) as conn:
        lines = [r[0] for r in conn.execute("PRAGMA integrity_check")]
    assert lines != ["ok"]
    code, doc, err = verify_json()
    assert code == 1, err
    assert doc["problems"] == {**NONE, "integrity": len(lines)}
    assert doc["details"]["integrity"] == lines
    assert doc["authenticated"] == 10  # the rows themselves are intact


def test_a_corrupt_table_page_is_reported_without_a_traceback(vault: Vault, vault_db: Path) -> None:
    filled(vault_db)
    offset, _ = page_bytes(vault_db, "agent_messages")
    data = bytearray(vault_db.read_bytes())
    data[offset] = 0xFF  # not a b-tree page type
    vault_db.write_bytes(bytes(data))
    r = run_cli("verify")
    assert r.code == 1, r
    assert "integrity" in one_line_error(r)
    assert "not authenticated (the file is damaged)" in r.out
    code, doc, _ = verify_json()
    assert code == 1
    assert doc["problems"]["integrity"] >= 1
    assert {k: n for k, n in doc["problems"].items() if k != "integrity"} == {
        k: 0 for k in PROBLEMS if k != "integrity"
    }
    assert doc["authenticated"] is None


def test_verify_reports_instead_of_fixing(vault: Vault, vault_db: Path) -> None:
    """An unfinished scrub and a missing migration are reported, and left as they are
    (any other command would finish the one and apply the other)."""
    filled(vault_db)
    sql(
        vault_db,
        "INSERT OR REPLACE INTO memvault_meta (key, value) VALUES ('scrub_pending', '1')",
        "DELETE FROM memvault_migrations WHERE name = 'm004_audit'",
    )
    sql(vault_db, "PRAGMA wal_checkpoint(TRUNCATE)")
    before = hashlib.sha256(vault_db.read_bytes()).hexdigest()
    code, doc, err = verify_json()
    assert code == 1, err
    assert doc["problems"] == {**NONE, "scrub_pending": 1, "schema": 1}
    assert doc["details"]["schema"] == ["migration m004_audit is not applied"]
    assert hashlib.sha256(vault_db.read_bytes()).hexdigest() == before
    # Control: an ordinary command fixes both, and then verify is content.
    assert run_cli("status").code == 0
    assert run_cli("verify").code == 0


def test_a_revoked_vault_is_the_key_error(vault: Vault, vault_db: Path) -> None:
    filled(vault_db)
    assert run_cli("revoke", "--yes").code == 0
    r = run_cli("verify")
    assert r.code == 4, r
    assert "revoked" in one_line_error(r)
    assert "key        key revoked" in r.out  # the key-free checks are still reported
    code, doc, _ = verify_json()
    assert code == 4
    assert doc["key"] == "key revoked" and doc["ok"] is False
    assert doc["problems"] == NONE and doc["authenticated"] is None


@pytest.mark.slow
def test_a_missing_key_is_the_key_error_with_the_file_checks_reported(
    vault: Vault, vault_db: Path
) -> None:
    """On a machine whose keyring lacks the key (a second private keyring)."""
    filled(vault_db)
    script = 'cd "$1" && python -m vault --db "$2" --json verify; echo "exit=$?" >&2'
    proc = in_another_private_keyring(script, vault_db)
    assert "exit=4" in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("memvault: error:")]
    assert len(errors) == 1 and "not verified" in errors[0], proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["key"] == "unusable" and doc["key_problem"]
    assert doc["ok"] is False and doc["problems"] == NONE
    assert (doc["items"], doc["authenticated"]) == (3, None)
    assert run_cli("verify").code == 0  # here, where the key is


def test_verify_without_a_vault_is_exit_3(tmp_path: Path, vault_db: Path) -> None:
    r = run_cli("verify")
    assert r.code == 3, r
    assert "no vault" in one_line_error(r)
    plain = tmp_path / "plain.db"
    sql(plain, "CREATE TABLE t (x)")
    r = run_cli("--db", str(plain), "verify")
    assert r.code == 3, r
    assert "not a memvault vault" in one_line_error(r)
