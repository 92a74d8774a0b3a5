"""The vault head on a vault file: a session put back whole from an older copy (its rows
and its head, consistent with each other), removed whole, or added whole from another
copy, is reported by `memvault verify` as the vault's (no single session can be named),
refused by `show`, `export` and an agent session in a new process, and served again
only once restored or accepted on purpose (`memvault accept`). Real file, real keyring,
real `memvault` subprocesses.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import add_items, run_cli, user
from tests.security.test_history_chain_on_a_file import read_in_a_new_process
from vault import HistoryTampered, Vault
from vault.chaincheck import Tamper

MISMATCH = Tamper.VAULT_MISMATCH.value
Rows = list[tuple[str, str, str]]


def _db(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _session(db: Path, sid: str) -> tuple[Rows, str | None]:
    """A session's rows (session id, envelope, link) and head, as stored."""
    with _db(db) as conn:
        rows = conn.execute(
            "SELECT session_id, message_data, chain FROM agent_messages WHERE session_id = ? "
            "ORDER BY id",
            (sid,),
        ).fetchall()
        head = conn.execute(
            "SELECT head FROM memvault_chain_heads WHERE session_id = ?", (sid,)
        ).fetchone()
    return rows, None if head is None else head[0]


def _replace(db: Path, sid: str, rows: Rows, head: str | None) -> None:
    """Put `rows` and `head` in the place of the session's, as someone with write access
    to the file and an older copy of it can."""
    conn = _db(db)
    conn.execute("BEGIN")
    conn.execute("DELETE FROM agent_messages WHERE session_id = ?", (sid,))
    conn.execute("DELETE FROM memvault_chain_heads WHERE session_id = ?", (sid,))
    conn.executemany(
        "INSERT INTO agent_messages (session_id, message_data, chain) VALUES (?, ?, ?)", rows
    )
    conn.execute("INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", (sid,))
    if head is None:
        conn.execute("DELETE FROM agent_sessions WHERE session_id = ?", (sid,))
    else:
        conn.execute(
            "INSERT INTO memvault_chain_heads (session_id, head) VALUES (?, ?)", (sid, head)
        )
    conn.execute("COMMIT")
    conn.close()


def put_back_whole(db: Path, tmp: Path) -> None:
    rows, head = _session(db, "s")
    add_items(db, "s", [user("a turn the rollback takes away")])
    _replace(db, "s", rows, head)


def removed_whole(db: Path, tmp: Path) -> None:
    _replace(db, "t", [], None)


def added_whole(db: Path, tmp: Path) -> None:
    # A copy of the file, written to as the live vault (same key): its session `u` put
    # into the live file with its head, consistent with each other.
    fork = tmp / "fork" / "history.db"
    fork.parent.mkdir()
    shutil.copy(db, fork)
    add_items(fork, "u", [user("from another copy")])
    rows, head = _session(fork, "u")
    _replace(db, "u", rows, head)


KINDS: dict[str, Callable[[Path, Path], None]] = {
    "a session put back whole from an older copy": put_back_whole,
    "a session removed whole": removed_whole,
    "a session added whole from another copy": added_whole,
}


@pytest.fixture
def two_sessions(vault: Vault, vault_db: Path) -> Vault:
    add_items(vault_db, "s", [user(f"item {i}") for i in range(5)])
    add_items(vault_db, "t", [user("another session's item")])
    return vault


def _vault_line(details: list[str]) -> list[str]:
    return [d for d in details if d.startswith("the vault as a whole")]


@pytest.mark.sweep
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_session_changed_whole_is_the_vaults_problem_until_accepted(
    two_sessions: Vault, vault_db: Path, tmp_path: Path, kind: str
) -> None:
    assert run_cli("verify").code == 0
    KINDS[kind](vault_db, tmp_path)

    r = run_cli("--json", "verify")
    assert r.code == 1, r
    details = r.json()["details"]["history_chain"]
    # Each session is consistent with its own head: only the vault head tells.
    assert details == [_vault_line(details)[0]] and MISMATCH in details[0], details

    r = run_cli("show", "s")
    assert r.code == 1 and r.out == "", r
    err = r.err.strip().splitlines()
    assert len(err) == 1 and "do not match its vault head" in err[0], r
    assert "memvault accept" in err[0] and "Traceback" not in r.err
    r = run_cli("show", "s", "--include-tampered")
    assert r.code == 0 and "item 0" in r.out, r
    out = tmp_path / "export.jsonl"
    r = run_cli("export", "s", "-o", str(out))
    assert r.code == 1 and not out.exists(), r
    assert read_in_a_new_process(vault_db) == {"tampered": MISMATCH, "session": "s"}

    # Accepting asks first; "n" changes nothing.
    r = run_cli("accept", input="n\n")
    assert r.code == 1 and run_cli("verify").code == 1, r
    r = run_cli("--json", "accept", "--yes")
    assert r.code == 0 and r.json()["matched"] is False, r
    r = run_cli("verify")
    assert r.code == 0, r
    assert read_in_a_new_process(vault_db)["items"] >= 5
    assert any(e["event"] == "accept" for e in run_cli("--json", "log").json())


def test_a_rotation_carries_the_vault_head_and_never_launders_a_mismatch(
    two_sessions: Vault, vault_db: Path, tmp_path: Path
) -> None:
    assert run_cli("rotate").code == 0
    assert run_cli("verify").code == 0, "a rotation sums the vault head under the new key"
    put_back_whole(vault_db, tmp_path)
    assert run_cli("rotate").code == 0
    r = run_cli("--json", "verify")
    assert r.code == 1 and _vault_line(r.json()["details"]["history_chain"]), r
    # Writes go on being refused: a write moves the vault head, never re-sums it.
    r = run_cli("pop", "t", "--yes")
    assert r.code == 1 and "vault head" in r.err, r


def _forge_head(db: Path, sid: str) -> None:
    """The session's head with its seq moved on, its MAC left: it no longer authenticates,
    and its state is not the one the vault head sums."""
    _rows, head = _session(db, sid)
    assert head is not None
    parts = head.split(".")
    parts[5] = str(int(parts[5]) + 5)
    with _db(db) as conn:
        conn.execute(
            "UPDATE memvault_chain_heads SET head = ? WHERE session_id = ?", (".".join(parts), sid)
        )


def test_accept_refuses_a_backup_before_asking_and_a_forged_head(
    two_sessions: Vault, vault_db: Path, tmp_path: Path
) -> None:
    backup = tmp_path / "backup.db"
    assert run_cli("backup", str(backup)).code == 0
    r = run_cli("--db", str(backup), "accept")  # no answer given: refused before the question
    assert r.code == 1 and "is a backup" in r.err and "Accept every session" not in r.err, r

    _forge_head(vault_db, "t")
    r = run_cli("accept", "--yes")
    assert r.code == 1 and "clear 't' --include-unreadable" in r.err, r
    assert run_cli("verify").code == 1


def test_accept_names_no_clear_for_a_forged_head_of_a_session_with_no_rows(
    two_sessions: Vault, vault_db: Path
) -> None:
    assert run_cli("clear", "t", "--yes").code == 0  # its head stays, its rows go
    _forge_head(vault_db, "t")
    r = run_cli("accept", "--yes")
    assert r.code == 1 and "'t'" in r.err and "restore the vault from a backup" in r.err, r
    assert "clear 't'" not in r.err


def test_a_forged_head_kept_through_a_rotation_is_cleared_then_accepted(
    two_sessions: Vault, vault_db: Path
) -> None:
    # The rotation cannot sum the vault head afresh (it does not match), so it stays under
    # the old key: the documented remedy must still work after it.
    _forge_head(vault_db, "t")
    assert run_cli("rotate").code == 0
    r = run_cli("--json", "verify")
    assert r.code == 1 and _vault_line(r.json()["details"]["history_chain"]), r
    r = run_cli("clear", "t", "--include-unreadable", "--yes")
    assert r.code == 0, r
    assert run_cli("accept", "--yes").code == 0
    r = run_cli("verify")
    assert r.code == 0, r
    assert run_cli("show", "s").code == 0


@pytest.mark.sweep
@pytest.mark.parametrize(
    "unmark",
    [
        "UPDATE memvault_meta SET value = 'building' WHERE key = 'chain'",
        "DELETE FROM memvault_meta WHERE key = 'chain'",
    ],
)
def test_a_file_marked_unchained_that_keeps_its_vault_head_is_refused_not_summed_again(
    two_sessions: Vault, vault_db: Path, tmp_path: Path, unmark: str
) -> None:
    # Without the anchor (as a transit vault has none), only the file can tell: a vault
    # head is written as a build ends, so a file "building" with one was rewritten.
    from vault import chainanchor
    from vault.keys import KeyStore

    put_back_whole(vault_db, tmp_path)
    chainanchor.forget(KeyStore(), two_sessions.vault_id)
    with _db(vault_db) as conn:
        conn.execute(unmark)
    for args in (["verify"], ["show", "s"], ["show", "t"]):
        r = run_cli(*args)
        assert r.code == 1 and "never chained" in r.err and "Traceback" not in r.err, r
    with _db(vault_db) as conn:
        assert conn.execute("SELECT value FROM memvault_meta WHERE key = 'chain'").fetchall() == (
            [("building",)] if "UPDATE" in unmark else []
        )


def test_a_dropped_vault_head_is_reported_and_accept_brings_it_back(
    two_sessions: Vault, vault_db: Path
) -> None:
    with _db(vault_db) as conn:
        conn.execute("DROP TABLE memvault_vault_head")
    r = run_cli("--json", "verify")
    assert r.code == 1 and _vault_line(r.json()["details"]["history_chain"]), r
    assert run_cli("show", "s").code == 1
    r = run_cli("accept", "--yes")
    assert r.code == 0, r
    assert run_cli("verify").code == 0


def test_an_open_session_sees_its_session_and_the_vault_head_put_back_together(
    two_sessions: Vault, vault_db: Path
) -> None:
    # What this process judged before (that vault head, that head of `s`) is no proof:
    # only the other sessions' newer heads tell, so each read compares them all.
    import vault as vault_pkg

    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db)
        try:
            assert len(await s.get_items()) == 5  # judged: this vault head, these heads
            rows, head = _session(vault_db, "s")
            with _db(vault_db) as conn:
                (old_vh,) = conn.execute("SELECT head FROM memvault_vault_head").fetchone()
            for sid, text in (("s", "a turn the rollback takes away"), ("t", "t goes on")):
                other = vault_pkg.open_session(sid, vault_db)  # another writer
                await other.add_items([user(text)])
                other.close()
            _replace(vault_db, "s", rows, head)
            with _db(vault_db) as conn:
                conn.execute("UPDATE memvault_vault_head SET head = ?", (old_vh,))
            with pytest.raises(HistoryTampered) as caught:
                await s.get_items()
            assert caught.value.kind == MISMATCH
        finally:
            s.close()

    asyncio.run(go())
    assert read_in_a_new_process(vault_db) == {"tampered": MISMATCH, "session": "s"}


def test_an_open_session_sees_its_own_session_put_back_whole(
    two_sessions: Vault, vault_db: Path, tmp_path: Path
) -> None:
    import vault as vault_pkg

    rows, head = _session(vault_db, "s")

    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db)
        try:
            await s.add_items([user("newest")])
            assert len(await s.get_items()) == 6  # read, judged, kept
            _replace(vault_db, "s", rows, head)  # by someone else, meanwhile
            with pytest.raises(HistoryTampered) as caught:
                await s.get_items()
            assert caught.value.kind == MISMATCH and caught.value.session_id == "s"
        finally:
            s.close()

    asyncio.run(go())
