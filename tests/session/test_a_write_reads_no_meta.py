"""An agent's write costs what the SDK's does: `add_items` reads nothing of the vault's
meta (no `PRAGMA data_version`, no `memvault_meta` row), even after another process
changed the file. It loses no check: the file's triggers refuse an item under a stale
key id (the session then reloads the key and writes again), and the next read still
notices another process's change (here a new TTL)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import vault as vault_pkg
from tests.conftest import rows, run_cli, user
from vault.engines.sqlite import sqlitesession as session_module


def _traced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every SQL statement the session's connections run (whichever worker thread's)."""
    statements: list[str] = []
    real = session_module.configure

    def configure(conn: sqlite3.Connection, timeout: float) -> None:
        real(conn, timeout)
        conn.set_trace_callback(statements.append)

    monkeypatch.setattr(session_module, "configure", configure)
    return statements


def _meta_reads(statements: list[str]) -> list[str]:
    # A trigger's own statements show as "-- TRIGGER name" comments: not the session's reads.
    return [
        s
        for s in statements
        if not s.lstrip().startswith("--") and ("data_version" in s or "memvault_meta" in s)
    ]


def test_a_write_reads_no_meta_and_the_next_read_sees_other_processes(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    statements = _traced(monkeypatch)

    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db)
        try:
            await s.add_items([user("one")])
            assert await s.get_items() == [user("one")]
            assert run_cli("ttl", "2h").code == 0  # another process changes the meta
            statements.clear()
            await s.add_items([user("two")])
            assert statements, "the trace saw nothing: the test would prove nothing"
            assert _meta_reads(statements) == []
            # The read after it notices the other process's change.
            assert await s.get_items() == [user("one"), user("two")]
            assert _meta_reads(statements)
            assert s.ttl == 7200

            # Another process rotates: the write is refused by the triggers, the key
            # reloaded, and the item stored under the new key.
            r = run_cli("--json", "rotate")
            assert r.code == 0, r
            new_kid = r.json()["new_kid"]
            await s.add_items([user("three")])
            assert [json.loads(x)["kid"] for x in rows(vault_db, "s")] == [new_kid] * 3
            assert await s.get_items() == [user("one"), user("two"), user("three")]
        finally:
            s.close()

    asyncio.run(go())
