"""A row nested deeper than the JSON parser can take, on a PostgreSQL vault: unreadable,
never "unexpected error" (the file-vault side is tests/files/test_deeply_nested_rows.py).

Run with `scripts/with-postgres scripts/test -m postgres`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import run_cli, user
from tests.files.test_deeply_nested_rows import DEEP, LONG_NUMBER, no_crash
from tests.pgserver import MARKS, sql
from tests.postgres.test_postgres_read import insert
from vault import crypto

pytestmark = MARKS


def plant(pg_vault: Any, url: str) -> None:
    """A good item, the row text `[` x 5000 (guard disabled meanwhile), and an envelope
    under the real key whose item is `[` x 5000, then another good item."""
    sealer = pg_vault.sealer()
    token = sealer.fernet("s").encrypt(DEEP.encode()).decode()
    insert(url, "s", [sealer.seal("s", user("kept one"))])
    sql(url, "ALTER TABLE agent_messages DISABLE TRIGGER memvault_guard")
    insert(url, "s", [DEEP])
    sql(url, "ALTER TABLE agent_messages ENABLE TRIGGER memvault_guard")
    insert(url, "s", [crypto.envelope_text(sealer.kid, token), sealer.seal("s", user("kept two"))])


def test_deep_rows_on_a_url_are_unreadable_items(pg_vault: Any, pg_url: str) -> None:
    plant(pg_vault, pg_url)
    v = run_cli("--db", pg_url, "--json", "verify")
    no_crash(v)
    assert v.code == 1 and v.json()["problems"]["unauthenticated_items"] == 2, v
    st = run_cli("--db", pg_url, "--json", "status")
    no_crash(st)
    assert st.code == 0, st
    show = run_cli("--db", pg_url, "show", "s")
    no_crash(show)
    assert show.code == 1 and "kept one" in show.out and "kept two" in show.out, show
    exp = run_cli("--db", pg_url, "export", "s", "-o", "-")
    no_crash(exp)
    assert exp.code == 1 and "kept two" in exp.out, exp
    found = run_cli("--db", pg_url, "--json", "search", "kept")
    no_crash(found)
    assert found.json()["unreadable"] == 2 and len(found.json()["hits"]) == 2, found
    purge = run_cli("--db", pg_url, "--json", "purge", "--yes")
    no_crash(purge)
    assert purge.code == 0 and purge.json()["unreadable"] == 1, purge

    import vault

    async def read() -> Any:
        s = vault.open_session("s", pg_url)
        return await s.get_items()

    assert asyncio.run(read()) == [user("kept one"), user("kept two")]

    r = run_cli("--db", pg_url, "--json", "rotate")
    no_crash(r)
    assert r.code == 0, r
    v = run_cli("--db", pg_url, "--json", "verify")
    assert v.code == 1 and v.json()["problems"]["unauthenticated_items"] == 2, v
    cleared = run_cli("--db", pg_url, "clear", "s", "--yes", "--include-unreadable")
    no_crash(cleared)
    assert cleared.code == 0, cleared
    assert run_cli("--db", pg_url, "verify").code == 0


def test_the_agents_session_on_a_url_skips_a_row_whose_number_is_too_long_to_read(
    pg_vault: Any, pg_url: str
) -> None:
    sealer = pg_vault.sealer()
    insert(pg_url, "s", [sealer.seal("s", user("kept one"))])
    sql(pg_url, "ALTER TABLE agent_messages DISABLE TRIGGER memvault_guard")
    insert(pg_url, "s", [LONG_NUMBER])
    sql(pg_url, "ALTER TABLE agent_messages ENABLE TRIGGER memvault_guard")
    insert(pg_url, "s", [sealer.seal("s", user("kept two"))])

    import vault

    async def read() -> Any:
        s = vault.open_session("s", pg_url)
        return await s.get_items()

    assert asyncio.run(read()) == [user("kept one"), user("kept two")]
