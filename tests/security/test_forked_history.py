"""A process that did not see the newest recorded state of its vault file writes on
from an older copy put back under it: a fork of the recorded history. Its writes take
the file's vault head past the anchor's `seq`, which would pass every later check; the
process tells the fork by the points it saw, marks the anchor and stops. A `restore`
or `accept` put the file aside on purpose, which is no fork. Real file, real keyring,
real `memvault` subprocesses.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import add_items, run_cli, user
from tests.security.test_history_chain_on_a_file import read_in_a_new_process
from tests.security.test_whole_file_rollback import anchor_seq, copy_of, file_seq, put_back
from vault import HistoryTampered, Vault
from vault.chaincheck import Tamper

ROLLED_BACK = Tamper.FILE_ROLLED_BACK.value

pytestmark = pytest.mark.secret_service


def _told(db: Path) -> None:
    r = run_cli("--json", "verify")
    assert r.code == 1, r
    assert ROLLED_BACK in str(r.json()["details"]["history_chain"]), r


def test_a_process_that_missed_a_recorded_write_does_not_launder_the_copy_put_back(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    import vault as vault_pkg

    add_items(vault_db, "s", [user("first")])

    async def go() -> None:
        stale = vault_pkg.open_session("s", vault_db, anchor_every=3600)
        try:
            older = copy_of(vault_db, tmp_path / "older.db")
            # Another process writes and records: the state the copy will take away.
            await asyncio.to_thread(add_items, vault_db, "t", [user("recorded, then lost")])
            put_back(older, vault_db)
            _told(vault_db)
            # The session still holds the anchor it read at its open, which the copy
            # passes: it writes, then tells the fork as it records, and stops.
            await stale.add_items([user("on the copy")])
            _told(vault_db)
            with pytest.raises(HistoryTampered) as caught:
                await stale.add_items([user("past the recorded seq")])
            assert caught.value.kind == ROLLED_BACK
            with pytest.raises(HistoryTampered):
                await stale.get_items()
        finally:
            stale.close()

    asyncio.run(go())
    _told(vault_db)
    r = run_cli("show", "s")
    assert r.code == 1 and r.out == "" and len(r.err.strip().splitlines()) == 1, r
    assert "memvault accept" in r.err and "Traceback" not in r.err

    r = run_cli("--json", "accept", "--yes")
    assert r.code == 0 and r.json()["matched"] is False, r
    assert run_cli("verify").code == 0
    assert anchor_seq(vault) == file_seq(vault_db)
    add_items(vault_db, "s", [user("after the accept")])
    assert run_cli("verify").code == 0


def test_a_session_open_across_an_accept_is_told_and_marks_no_fork(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """The `accept` of an older copy put aside, on purpose, writes of a session that the
    anchor never saw. The session wrote a state the file no longer holds: it is told
    until it is opened again, and marks no fork; opened again, it writes and records on
    the accepted history, and every reader passes it."""
    import vault as vault_pkg

    add_items(vault_db, "s", [user("first")])
    older = copy_of(vault_db, tmp_path / "older.db")

    async def go() -> None:
        early = vault_pkg.open_session("s", vault_db, anchor_every=3600)
        other = vault_pkg.open_session("t", vault_db, anchor_every=3600)
        try:
            await other.add_items([user("recorded")])
            for text in ("recorded", "unrecorded", "unrecorded too"):
                await early.add_items([user(text)])
            seen_by_early = file_seq(vault_db) - 1
            assert anchor_seq(vault) == seen_by_early - 1
            put_back(older, vault_db)
            assert run_cli("accept", "--yes").code == 0
            assert anchor_seq(vault) == file_seq(vault_db) == seen_by_early
            await other.add_items([user("after the accept, within its interval")])
            assert anchor_seq(vault) == seen_by_early
            with pytest.raises(HistoryTampered) as caught:
                await early.add_items([user("its own writes were put aside")])
            assert caught.value.kind == Tamper.FILE_ROLLED_BACK.value
        finally:
            other.close()
            early.close()
        again = vault_pkg.open_session("s", vault_db, anchor_every=0)
        try:
            await again.add_items([user("on the accepted history: recorded")])
            assert anchor_seq(vault) == file_seq(vault_db)
        finally:
            again.close()

    asyncio.run(go())
    assert run_cli("verify").code == 0


def _accept_first(older: Path, db: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Before this process's next turn at the anchor: the older copy put back and
    accepted by another process, as if it ran just after this one read the file."""
    from vault import chainanchor

    real = chainanchor.this_hosts_turn
    accepted: list[int] = []

    def turn():  # type: ignore[no-untyped-def]
        if not accepted:
            put_back(older, db)
            r = run_cli("accept", "--yes")
            assert r.code == 0, r
            accepted.append(file_seq(db))
        return real()

    monkeypatch.setattr(chainanchor, "this_hosts_turn", turn)
    return accepted


def test_a_record_that_read_the_file_before_an_accept_does_not_write_over_it(
    vault: Vault, vault_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process reads its file's state for a record, then another process's `accept`
    puts the file at an older copy, past the anchor, before this one's turn comes. The
    state it read is of the history put aside: written over the accepted anchor, it
    would make every process report the accepted file as rolled back."""
    add_items(vault_db, "s", [user(f"item {i}") for i in range(3)])
    older = copy_of(vault_db, tmp_path / "older.db")
    writer = Vault.open(vault_db)
    writer.pop("s")
    writer.pop("s")  # two writes the anchor never saw: this object records none itself
    assert file_seq(vault_db) - anchor_seq(vault) == 2
    accepted = _accept_first(older, vault_db, monkeypatch)

    writer.record_anchor()
    assert accepted and anchor_seq(vault) == accepted[0] == file_seq(vault_db)
    r = run_cli("verify")
    assert r.code == 0, r
    assert read_in_a_new_process(vault_db) == {"items": 3}


def test_a_process_open_across_an_accept_records_what_it_reads_after_it(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """A lift it did not see keeps a process from recording only a state the file no
    longer holds: one it read after the accept, and wrote on, is recorded."""
    add_items(vault_db, "s", [user(f"item {i}") for i in range(3)])
    writer = Vault.open(vault_db)
    assert writer.history_verdict("s") is None  # its floor: the anchor before the accept
    older = copy_of(vault_db, tmp_path / "older.db")
    add_items(vault_db, "s", [user("put aside by the accept")])
    put_back(older, vault_db)
    assert run_cli("accept", "--yes").code == 0
    add_items(vault_db, "s", [user("after the accept, recorded by its writer")])
    writer.pop("s")  # on the accepted history; not recorded by the pop itself
    assert file_seq(vault_db) == anchor_seq(vault) + 1

    writer.record_anchor()
    assert anchor_seq(vault) == file_seq(vault_db)
    assert run_cli("verify").code == 0


def test_an_accept_goes_past_what_was_recorded_since_it_read_the_anchor(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    """A `Vault` object whose view of the anchor is older than a record another process
    made since (writes its own floor never saw): its `accept` of a file put back goes
    past the anchor as stored now, not as it once read it, or the accepted state would
    be behind the anchor and reported as rolled back."""
    add_items(vault_db, "s", [user(f"item {i}") for i in range(3)])
    older = copy_of(vault_db, tmp_path / "older.db")
    accepting = Vault.open(vault_db)
    assert accepting.history_verdict("s") is None  # its floor: the anchor now
    writer = Vault.open(vault_db)
    writer.pop("s")
    writer.pop("s")
    writer.record_anchor()  # another process records two writes
    recorded = anchor_seq(vault)
    assert recorded == file_seq(vault_db)
    put_back(older, vault_db)

    accepted = accepting.accept_history()
    assert accepted.anchored and file_seq(vault_db) == anchor_seq(vault) == recorded + 1
    r = run_cli("verify")
    assert r.code == 0, r


def test_a_record_that_read_the_file_before_an_accept_wrote_it_does_not_take_its_place(
    vault: Vault, vault_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: the accept's write to the file lands between this process's
    read of the file and its turn at the anchor, and its own record comes after that
    turn. A state read before the accept must not be recorded then, or the accept's
    record, behind it, would leave the accepted file reported as rolled back."""
    from vault import chainanchor

    add_items(vault_db, "s", [user(f"item {i}") for i in range(3)])
    older = copy_of(vault_db, tmp_path / "older.db")
    writer = Vault.open(vault_db)
    writer.pop("s")
    writer.pop("s")  # two writes the anchor never saw
    accepting: list[Vault] = []
    real = chainanchor.this_hosts_turn

    def turn():  # type: ignore[no-untyped-def]
        if not accepting:
            put_back(older, vault_db)
            other = Vault.open(vault_db)
            accepting.append(other)
            other.record_anchor = lambda **_kw: None  # type: ignore[method-assign]
            other.accept_history()  # its record deferred to after this process's turn
            del other.record_anchor
        return real()

    monkeypatch.setattr(chainanchor, "this_hosts_turn", turn)
    writer.record_anchor()
    monkeypatch.setattr(chainanchor, "this_hosts_turn", real)
    assert accepting[0].record_anchor(lifted=True) is not None
    assert anchor_seq(vault) == file_seq(vault_db)
    r = run_cli("verify")
    assert r.code == 0, r
