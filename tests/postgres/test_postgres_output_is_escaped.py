"""Text output on a PostgreSQL vault escapes control characters as on a file vault.

Run with `scripts/with-postgres scripts/test -m postgres`.
"""

from __future__ import annotations

from typing import Any

from tests.cli.test_control_characters_are_escaped import CLEAR, OSC52, one_line_each
from tests.conftest import add_items, run_cli, user
from tests.pgserver import MARKS

pytestmark = MARKS


def test_a_postgresql_vault_prints_ids_and_items_escaped(pg_vault: Any, pg_url: str) -> None:
    sid = f"s{CLEAR}\nforged   9  0  -"
    add_items(pg_url, sid, [user(f"hi{OSC52}\tthere")])
    r = run_cli("--db", pg_url, "sessions")
    assert r.code == 0, r
    assert one_line_each(r.out)[1].startswith("s\\x1b[2J\\x1b[H\\nforged   9  0  - "), r
    r = run_cli("--db", pg_url, "show", "--", sid)
    assert r.out == "#1 user: hi\\x1b]52;c;aGVsbG8=\\x07\tthere\n", r
    assert run_cli("--db", pg_url, "--json", "sessions").json()[0]["session_id"] == sid
