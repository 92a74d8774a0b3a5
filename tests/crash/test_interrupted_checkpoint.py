"""A checkpoint killed half-way must not lock the user out of a healthy vault.

The checkpoint writes the WAL's page 1, which states the new page count, before
the pages that extend the file: a kill in between leaves a file shorter than its
header says while the WAL still holds every missing page. SQLite reads them from
there; memvault must let it, and call a file truncated only when SQLite agrees.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import authenticated_counts, run_cli
from tests.crashkit import (
    header_pages,
    integrity,
    interrupt_checkpoint,
    is_mid_checkpoint,
    run_writer_to_death,
    wal_of,
    writer_items,
)
from vault import Vault, open_session

SIZE = 3000  # bytes of text per item: a few hundred items fill thousands of pages


def read_back(db: Path, sid: str) -> list[Any]:
    items, expired, unreadable = Vault.open(db).items(sid)
    assert (expired, unreadable) == (0, 0)
    return items


@pytest.mark.slow
def test_a_checkpoint_killed_after_page_one_leaves_a_usable_vault(
    vault: Any, vault_db: Path
) -> None:
    acked = run_writer_to_death(vault_db, "agent", 0, 400, SIZE)
    assert acked == 400
    assert wal_of(vault_db).stat().st_size > 0  # the agent died with its frames in the WAL
    interrupt_checkpoint(vault_db, 0.5)
    assert is_mid_checkpoint(vault_db)  # the state a killed `memvault status` left
    page_size, pages = header_pages(vault_db)

    st = run_cli("--json", "status")

    assert st.code == 0, st
    assert st.json()["items"] == acked and authenticated_counts(vault_db) == (acked, 0, 0)
    assert integrity(vault_db) == [("ok",)]
    assert read_back(vault_db, "agent") == writer_items("agent", 0, acked, SIZE)
    assert vault_db.stat().st_size >= pages * page_size  # the checkpoint was finished

    async def one_more() -> None:
        session = open_session("agent", vault_db)
        await session.add_items([{"role": "user", "content": "after"}])
        session.close()

    asyncio.run(one_more())
    assert run_cli("shred", "--yes").code == 0
    assert not vault_db.exists()


@pytest.mark.slow
def test_every_command_opens_a_vault_whose_wal_holds_the_missing_pages(
    vault: Any, vault_db: Path
) -> None:
    acked = run_writer_to_death(vault_db, "agent", 0, 300, SIZE)
    interrupt_checkpoint(vault_db, 0.3)
    image = {p: p.read_bytes() for p in (vault_db, wal_of(vault_db))}
    for args in (["sessions"], ["show", "agent"], ["log"], ["ttl"], ["rotate"]):
        for p, data in image.items():
            p.write_bytes(data)
        vault_db.with_name(vault_db.name + "-shm").unlink(missing_ok=True)
        assert is_mid_checkpoint(vault_db)
        r = run_cli(*args)
        assert r.code == 0, (args, r)
        assert "truncated" not in r.err and "damaged" not in r.err
        assert read_back(vault_db, "agent") == writer_items("agent", 0, acked, SIZE), args


@pytest.mark.slow
def test_a_truncated_file_is_refused_even_beside_a_wal(vault: Any, vault_db: Path) -> None:
    """The WAL holds recent pages only: the ones cut off the file are lost, and said so."""
    acked = run_writer_to_death(vault_db, "agent", 0, 300, SIZE)
    assert acked == 300
    assert run_cli("status").code == 0  # checkpointed: every page is in the file now
    assert run_writer_to_death(vault_db, "agent", 300, 1, 10) == 1
    assert wal_of(vault_db).stat().st_size > 0
    with open(vault_db, "r+b") as fh:
        fh.truncate(vault_db.stat().st_size // 2)
    before = {p: p.read_bytes() for p in (vault_db, wal_of(vault_db))}

    for args in (["status"], ["show", "agent"], ["rotate"]):
        r = run_cli(*args)
        assert r.code == 1, (args, r)
        assert "truncated" in r.err and "backup" in r.err, (args, r)
        assert len(r.err.strip().splitlines()) == 1, r.err
    assert {p: p.read_bytes() for p in before} == before
    with sqlite3.connect(vault_db) as conn:  # SQLite agrees: pages are missing
        try:
            bad = conn.execute("PRAGMA quick_check").fetchall() != [("ok",)]
        except sqlite3.DatabaseError:
            bad = True
    assert bad
