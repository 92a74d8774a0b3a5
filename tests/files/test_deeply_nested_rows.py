"""A row nested deeper than the JSON parser can take counts as unreadable, everywhere.

Two kinds of hostile row, each written as its author could: the row text itself
`[` x 5000 (a writer of the file, after dropping the guard triggers and putting
them back), and an envelope under the vault's real key whose decrypted item is
`[` x 5000 (a holder of the key; the guard lets it in, on the session's chain).
Every command that reads, counts, deletes or rotates must treat both as unreadable
items, never end in "unexpected error"; the first, which no key holder wrote, makes
its session's history tampered (docs/history-chain.md). Real subprocesses, real
keyring, real SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import vault as vault_pkg
from tests.chainkit import insert_chained
from tests.conftest import add_items, rows, run_cli, user
from tests.files.test_export import one_line
from vault import crypto

DEEP = "[" * 5000


def plant_deep_rows(db: Path, session_id: str) -> tuple[str, str]:
    """Add both hostile rows to the session; return (row text, sealed row)."""
    sealer = vault_pkg.Vault.open(db).sealer()
    token = sealer.fernet(session_id).encrypt(DEEP.encode()).decode()
    sealed = crypto.envelope_text(sealer.kid, token)
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        guard = [
            sql
            for (sql,) in conn.execute(
                "SELECT sql FROM sqlite_master "
                "WHERE type = 'trigger' AND tbl_name = 'agent_messages'"
            )
        ]
        for name in ("memvault_guard_insert", "memvault_guard_update"):
            conn.execute(f"DROP TRIGGER {name}")
        conn.execute(  # with a made-up chain link: its writer holds no key
            "INSERT INTO agent_messages (session_id, message_data, chain) VALUES (?, ?, 'x')",
            (session_id, DEEP),
        )
        for sql in guard:  # put back as they were, so verify sees only the row
            conn.execute(sql)
        insert_chained(conn, sealer, [(session_id, sealed)])
    return DEEP, sealed


def plant_sealed_deep_row(db: Path, session_id: str) -> None:
    """Only the second kind: written by a holder of the key, on the session's chain."""
    sealer = vault_pkg.Vault.open(db).sealer()
    token = sealer.fernet(session_id).encrypt(DEEP.encode()).decode()
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        insert_chained(conn, sealer, [(session_id, crypto.envelope_text(sealer.kid, token))])


def no_crash(r: Any) -> None:
    assert "unexpected error" not in r.err and "Traceback" not in r.err, r


@pytest.mark.slow
def test_deep_rows_are_unreadable_items_for_every_command(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("kept one"), user("kept two")])
    plant_deep_rows(vault_db, "s")

    v = run_cli("--json", "verify")
    no_crash(v)
    assert v.code == 1 and v.json()["problems"]["unauthenticated_items"] == 2, v
    assert v.json()["details"]["history_chain"] == ["session 's': unauthenticated (its item #3)"]
    st = run_cli("--json", "status")
    no_crash(st)
    assert st.code == 0 and st.json()["items"] == 4, st

    for refused in (("show", "s"), ("export", "--all", "-o", "-"), ("search", "kept")):
        r = run_cli(*refused)
        no_crash(r)
        assert r.code == 1 and "does not verify" in r.err and "kept" not in r.out, r
    show = run_cli("--json", "show", "s", "--include-tampered")
    no_crash(show)
    assert show.code == 1 and "2 item" in show.err, show
    human = run_cli("show", "s", "--include-tampered")
    no_crash(human)
    assert "kept one" in human.out and "kept two" in human.out
    exp = run_cli("export", "--all", "-o", "-", "--include-tampered")
    no_crash(exp)
    assert "kept two" in exp.out and exp.code == 1, exp

    purge = run_cli("--json", "purge", "--yes")
    no_crash(purge)
    # Purge only authenticates (it deletes what is ours and expired): the sealed deep item
    # authenticates and is not expired, so it is kept; the row text is unreadable.
    assert purge.code == 0 and purge.json()["unreadable"] == 1, purge
    assert purge.json()["kept"] == 3 and purge.json()["deleted"] == 0
    assert len(rows(vault_db, "s")) == 4


def test_the_agents_session_skips_a_deep_row_a_key_holder_wrote(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("kept one")])
    plant_sealed_deep_row(vault_db, "s")
    add_items(vault_db, "s", [user("kept two")])

    async def read() -> Any:
        s = vault_pkg.open_session("s", vault_db)
        try:
            return await s.get_items(), await s.get_items(limit=1)
        finally:
            s.close()

    everything, last = asyncio.run(read())
    assert everything == [user("kept one"), user("kept two")]
    assert last == [user("kept two")]


def test_the_agents_session_refuses_a_deep_row_planted_without_the_key(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("kept one")])
    plant_deep_rows(vault_db, "s")

    async def read() -> Any:
        s = vault_pkg.open_session("s", vault_db)
        try:
            return await s.get_items()
        finally:
            s.close()

    with pytest.raises(vault_pkg.HistoryTampered, match="unauthenticated"):
        asyncio.run(read())


def test_rotate_carries_deep_rows_as_unreadable_and_clear_removes_them(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("kept")])
    text, _ = plant_deep_rows(vault_db, "s")
    r = run_cli("--json", "rotate")
    no_crash(r)
    assert r.code == 0, r
    assert r.json()["unreadable"] == 1, r  # the row text: no envelope, kept as it is
    assert text in rows(vault_db, "s")
    v = run_cli("--json", "verify")
    assert v.code == 1 and v.json()["problems"]["unauthenticated_items"] == 2, v
    assert v.json()["problems"]["history_chain"] == 1, v
    assert run_cli("show", "s", "--include-tampered").out.count("kept") == 1

    refused = run_cli("clear", "s", "--yes")
    one_line(refused, 1, "--include-unreadable")
    cleared = run_cli("clear", "s", "--yes", "--include-unreadable")
    no_crash(cleared)
    assert cleared.code == 0, cleared
    assert rows(vault_db, "s") == []
    assert run_cli("verify").code == 0


# More digits than Python converts to an int (4,300 by default): json.loads raises a
# plain ValueError, which the SDK's row decoding does not catch as it catches
# JSONDecodeError.
LONG_NUMBER = "[" + "1" * 5000 + "]"


def test_the_agents_session_refuses_a_row_whose_number_is_too_long_to_read(
    vault: Any, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("kept one")])
    with contextlib.closing(sqlite3.connect(vault_db)) as conn, conn:
        guard = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'memvault_guard_insert'"
        ).fetchone()[0]
        conn.execute("DROP TRIGGER memvault_guard_insert")
        conn.execute(
            "INSERT INTO agent_messages (session_id, message_data, chain) VALUES (?, ?, 'x')",
            ("s", LONG_NUMBER),
        )
        conn.execute(guard)

    async def read(limit: int | None) -> Any:
        s = vault_pkg.open_session("s", vault_db)
        try:
            return await s.get_items(limit)
        finally:
            s.close()

    # Planted without the key: tampering, not a row to skip (it was skipped before the
    # chain), whether the read takes every item or only the window that holds it.
    for limit in (None, 1):
        with pytest.raises(vault_pkg.HistoryTampered, match="unauthenticated"):
            asyncio.run(read(limit))
    v = run_cli("--json", "verify")
    no_crash(v)
    assert v.code == 1 and v.json()["problems"]["unauthenticated_items"] == 1, v
    assert v.json()["problems"]["history_chain"] == 1, v
