"""A legitimate operation on a tampered session never approves the tampering, never
loses an authentic item, and never stops the others: pop, purge, rotate and write,
on a real vault file, after an edit by someone who holds no key."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

import vault as vault_pkg
from tests.conftest import add_items, run_cli, user
from vault import Vault, chainanchor
from vault.errors import HistoryTampered
from vault.keys import KeyStore


def rows(db: Path, sid: str) -> list[tuple[int, str, str | None]]:
    with sqlite3.connect(db) as conn:
        sql = "SELECT id, message_data, chain FROM agent_messages WHERE session_id = ? ORDER BY id"
        return conn.execute(sql, (sid,)).fetchall()


def sql(db: Path, statement: str, *args: Any) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute(statement, args)
    finally:
        conn.close()


def tampered_sessions(db: Path) -> int:
    r = run_cli("--json", "--db", str(db), "verify")
    assert r.code in (0, 1), r
    return int(r.json()["problems"]["history_chain"])


def contents(db: Path, sid: str) -> list[str]:
    r = run_cli("--json", "--db", str(db), "show", sid, "--include-tampered")
    assert r.code == 0, r
    return [i["content"] for i in r.json()["items"]]


def agent_pop(db: Path, sid: str) -> Any:
    async def go() -> Any:
        s = vault_pkg.open_session(sid, db)
        try:
            return await s.pop_item()
        finally:
            s.close()

    return asyncio.run(go())


@pytest.mark.parametrize("how", ["memvault pop", "agent pop_item"])
def test_a_pop_never_approves_an_item_put_back_in_place_of_another(
    vault: Vault, vault_db: Path, how: str
) -> None:
    """A0, A1; A1 popped; B1, B2 written; A1 put back in B1's place. Popping B2 must
    leave the session reported, not turn it into the history A0, A1."""
    add_items(vault_db, "s", [user("A0"), user("A1")])
    _id, a1_text, a1_link = rows(vault_db, "s")[1]
    vault.pop("s")
    add_items(vault_db, "s", [user("B1"), user("B2")])
    b1_id = rows(vault_db, "s")[1][0]
    sql(vault_db, "UPDATE agent_messages SET message_data = ?, chain = ? WHERE id = ?",
        a1_text, a1_link, b1_id)  # fmt: skip
    assert tampered_sessions(vault_db) == 1
    if how == "memvault pop":
        assert run_cli("pop", "s", "--yes").code == 0
    else:
        assert agent_pop(vault_db, "s")["content"] == "B2"
    assert tampered_sessions(vault_db) == 1


def test_a_pop_of_the_item_put_in_place_of_the_last_is_refused(
    vault: Vault, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("A0"), user("A1")])
    _id, a1_text, a1_link = rows(vault_db, "s")[1]
    vault.pop("s")
    add_items(vault_db, "s", [user("B1")])
    sql(vault_db, "UPDATE agent_messages SET message_data = ?, chain = ? WHERE id = ?",
        a1_text, a1_link, rows(vault_db, "s")[1][0])  # fmt: skip
    with pytest.raises(HistoryTampered):
        agent_pop(vault_db, "s")
    r = run_cli("pop", "s", "--yes")
    assert r.code == 1 and "does not verify" in r.err and "Traceback" not in r.err, r
    assert len(rows(vault_db, "s")) == 2  # nothing was taken


def test_a_purge_keeps_a_session_whose_expired_row_carries_a_copied_link_and_purges_the_rest(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh item's link copied onto an expired row must not carry the base past the
    fresh items (which the attacker could then delete unseen); one such row must not
    stop the purge of every other session either."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3 * 86400)
    add_items(vault_db, "s", [user("E0")])
    add_items(vault_db, "u", [user("old u 1"), user("old u 2")])
    monkeypatch.setattr(time, "time", real)
    add_items(vault_db, "s", [user("F1"), user("F2")])
    assert run_cli("ttl", "1d").code == 0
    e0_id, f2_link = rows(vault_db, "s")[0][0], rows(vault_db, "s")[2][2]
    sql(vault_db, "UPDATE agent_messages SET chain = ? WHERE id = ?", f2_link, e0_id)
    r = run_cli("purge", "--yes")
    assert r.code == 0 and "does not verify: s" in r.out, r
    assert rows(vault_db, "u") == []
    assert len(rows(vault_db, "s")) == 3  # E0 stays, expired (so not shown), and F1, F2
    assert contents(vault_db, "s") == ["F1", "F2"]
    assert tampered_sessions(vault_db) == 1


def test_a_rotation_moves_a_row_whose_link_was_removed_and_the_vault_stays_usable(
    vault: Vault, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("one"), user("two")])
    add_items(vault_db, "t", [user("untouched")])
    sql(vault_db, "UPDATE agent_messages SET chain = NULL WHERE id = ?", rows(vault_db, "s")[0][0])
    assert run_cli("rotate").code == 0
    kid = Vault.open(vault_db).meta()["kid"]
    assert all(f'"kid": "{kid}"' in text for _i, text, _l in rows(vault_db, "s"))
    assert contents(vault_db, "s") == ["one", "two"]
    assert contents(vault_db, "t") == ["untouched"]
    assert tampered_sessions(vault_db) == 1
    assert run_cli("rotate").code == 0


def test_a_write_to_a_session_whose_head_was_edited_or_deleted_is_refused(
    vault: Vault, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("s0")])
    add_items(vault_db, "t", [user("t0")])
    with sqlite3.connect(vault_db) as conn:
        (head,) = conn.execute(
            "SELECT head FROM memvault_chain_heads WHERE session_id = 's'"
        ).fetchone()
    parts = head.split(".")
    parts[1] = "mv1:" + "0" * 16  # another key id
    sql(
        vault_db, "UPDATE memvault_chain_heads SET head = ? WHERE session_id = 's'", ".".join(parts)
    )
    sql(vault_db, "DELETE FROM memvault_chain_heads WHERE session_id = 't'")
    for sid in ("s", "t"):
        with pytest.raises(HistoryTampered):
            add_items(vault_db, sid, [user("more")])
        assert len(rows(vault_db, sid)) == 1


def test_an_upgrade_stops_on_a_row_whose_session_id_is_not_text(
    vault: Vault, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("s0")])
    text = rows(vault_db, "s")[0][1]
    conn = sqlite3.connect(vault_db, isolation_level=None)
    conn.execute("INSERT INTO agent_messages (session_id, message_data, chain) VALUES (?, ?, 'x')",
                 (b"A", text))  # fmt: skip
    conn.execute("UPDATE agent_messages SET chain = NULL")
    conn.execute("DELETE FROM memvault_chain_heads")
    conn.execute("DELETE FROM memvault_vault_head")
    conn.execute("UPDATE memvault_meta SET value = 'building' WHERE key = 'chain'")
    conn.close()
    chainanchor.forget(KeyStore(), vault.vault_id)  # as a vault from before the chain
    r = run_cli("--json", "verify", timeout=60)
    assert r.code == 1, r
    assert contents(vault_db, "s") == ["s0"]


def test_a_chained_vault_rewritten_to_look_unchained_is_refused_not_linked_again(
    vault: Vault, vault_db: Path
) -> None:
    """Its upgrade would link the rows in whatever order they are found: an attacker who
    edits the history, removes the links and heads and says "building" must not get
    the edit vouched for. The vault's anchor, outside the file, says it was chained."""
    add_items(vault_db, "s", [user(f"A{i}") for i in range(5)])
    ids = [r[0] for r in rows(vault_db, "s")]
    sql(vault_db, "DELETE FROM agent_messages WHERE id = ?", ids[2])
    sql(vault_db, "UPDATE agent_messages SET chain = NULL")
    sql(vault_db, "DELETE FROM memvault_chain_heads")
    sql(vault_db, "UPDATE memvault_meta SET value = 'building' WHERE key = 'chain'")
    for args in (["verify"], ["show", "s"], ["show", "s", "--include-tampered"]):
        r = run_cli("--db", str(vault_db), *args)
        assert r.code == 1 and "never chained" in r.err and "Traceback" not in r.err, r
    with pytest.raises(HistoryTampered):
        add_items(vault_db, "s", [user("more")])
    assert all(link is None for _i, _t, link in rows(vault_db, "s"))  # nothing linked
