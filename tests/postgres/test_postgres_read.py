"""export, search, verify and backup on a PostgreSQL vault, against a real server.

Run with `scripts/with-postgres scripts/test -m postgres`. Each test gets a
schema of its own (the `pg_url` fixture of conftest), dropped afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from tests.conftest import run_cli
from tests.pgserver import MARKS, password, sql

pytestmark = MARKS
WARNING = "warning: the export is plaintext"


def insert(url: str, session_id: str, rows: list[str]) -> None:
    sql(
        url,
        "INSERT INTO agent_sessions (session_id) VALUES ($1) ON CONFLICT DO NOTHING",
        args=(session_id,),
    )
    for data in rows:
        sql(
            url,
            "INSERT INTO agent_messages (session_id, message_data) VALUES ($1, $2)",
            args=(session_id, data),
        )


def tampered(sealed: str) -> str:
    """An envelope under the current kid whose token no longer authenticates (the guard,
    which checks the envelope's shape and kid only, lets it in)."""
    env = json.loads(sealed)
    p = env["payload"]
    env["payload"] = p[:40] + ("A" if p[40] != "A" else "B") + p[41:]
    return json.dumps(env)


def write_history(pg_vault: Any, url: str) -> None:
    """Two sessions through the agent session, plus one expired item."""
    import vault

    async def write() -> None:
        s = vault.open_session("carnet", url)
        await s.add_items(
            [
                {"role": "user", "content": "Remember NORD-17 for me."},
                {"role": "assistant", "content": "Noted: NORD-17."},
            ]
        )
        t = vault.open_session("travel", url)
        await t.add_items([{"role": "user", "content": "Book the train to Lyon."}])

    asyncio.run(write())
    old = int(time.time()) - 7200  # the vault's TTL is one hour
    insert(
        url, "travel", [pg_vault.sealer().seal("travel", {"role": "user", "content": "old"}, old)]
    )


def test_export_and_search_on_a_url_stream_what_a_file_gives(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    write_history(pg_vault, pg_url)
    out = tmp_path / "h.jsonl"
    r = run_cli("--db", pg_url, "export", "--all", "-o", str(out))
    assert r.code == 0, r
    assert r.err.startswith(WARNING)
    assert "exported 3 items of 2 sessions as jsonl" in r.out
    assert "1 expired item left out" in r.out
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(d["session_id"], d["position"], d["item"]["content"]) for d in lines] == [
        ("carnet", 1, "Remember NORD-17 for me."),
        ("carnet", 2, "Noted: NORD-17."),
        ("travel", 1, "Book the train to Lyon."),
    ]
    assert all(d["timestamp"].endswith("Z") and not d["expired"] for d in lines)

    # The output file's rules are the file's: an existing one is refused, untouched.
    before = out.read_bytes()
    r = run_cli("--db", pg_url, "export", "carnet", "-o", str(out))
    assert r.code == 2 and r.err.count("\n") == 1, r
    assert out.read_bytes() == before
    r = run_cli(
        "--db", pg_url, "export", "--include-expired", "--format", "md", "travel", "-o", "-"
    )
    assert r.code == 0, r
    assert "## Session `travel`" in r.out and "> old" in r.out and "expired" in r.out
    assert run_cli("--db", pg_url, "export", "nope", "-o", str(tmp_path / "x")).code == 1
    assert not (tmp_path / "x").exists()

    r = run_cli("--db", pg_url, "search", "nord-17")
    assert r.code == 0, r
    assert r.out.splitlines() == [
        "carnet #1 user: Remember NORD-17 for me.",
        "carnet #2 assistant: Noted: NORD-17.",
    ]
    r = run_cli("--db", pg_url, "--json", "search", "--regex", "lyon|old", "--include-expired")
    assert r.code == 0, r
    assert [(h["session_id"], h["position"]) for h in r.json()["hits"]] == [
        ("travel", 1),
        ("travel", 2),
    ]
    r = run_cli("--db", pg_url, "search", "zebra")
    assert r.code == 1, r
    assert "no item matches 'zebra' (3 items searched in 2 sessions" in r.err
    assert password() not in r.out + r.err


def test_export_and_search_count_unreadable_items_and_exit_1(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    sealer = pg_vault.sealer()
    insert(
        pg_url,
        "s",
        [
            sealer.seal("s", {"role": "user", "content": "fine NORD"}),
            tampered(sealer.seal("s", {"role": "user", "content": "secret NORD"})),
        ],
    )
    out = tmp_path / "s.jsonl"
    r = run_cli("--db", pg_url, "export", "s", "-o", str(out))
    assert r.code == 1, r
    assert "1 item of the exported sessions failed authentication" in r.err
    assert [json.loads(x)["position"] for x in out.read_text().splitlines()] == [1]
    r = run_cli("--db", pg_url, "search", "nord")
    assert r.code == 1, r
    assert r.out.splitlines() == ["s #1 user: fine NORD"]
    assert "1 item of the searched sessions failed authentication" in r.err


def test_verify_on_a_url_checks_items_guard_migrations_and_changes_nothing(
    pg_vault: Any, pg_url: str
) -> None:
    write_history(pg_vault, pg_url)
    r = run_cli("--db", pg_url, "verify")
    assert r.code == 0, r
    assert "items      4 items in 2 sessions: 4 authenticate (1 expired)" in r.out
    assert "not applicable: PostgreSQL" in r.out and "result     ok" in r.out
    # An ok that does not vouch for what the file vault's chain would: said, not implied.
    assert "not checked: the history chain, not built on PostgreSQL yet" in r.out
    assert password() not in r.out + r.err
    doc = run_cli("--db", pg_url, "--json", "verify").json()
    assert doc["ok"] is True and doc["backend"] == "postgresql" and doc["authenticated"] == 4
    assert "not detected" in doc["not_checked"]["history_chain"]

    # One tampered item: found, exit 1.
    insert(pg_url, "carnet", [tampered(pg_vault.sealer().seal("carnet", {"x": 1}))])
    r = run_cli("--db", pg_url, "--json", "verify")
    assert r.code == 1, r
    assert r.json()["problems"]["unauthenticated_items"] == 1
    sql(pg_url, "DELETE FROM agent_messages WHERE id = (SELECT max(id) FROM agent_messages)")

    # The guard: its function's body replaced, the trigger disabled, an extra trigger.
    body = sql(
        pg_url,
        "SELECT prosrc FROM pg_proc WHERE proname = 'memvault_guard' AND "
        "pronamespace = current_schema()::regnamespace",
    )[0]["prosrc"]
    sql(
        pg_url,
        "CREATE OR REPLACE FUNCTION memvault_guard() RETURNS trigger LANGUAGE plpgsql "
        "AS $g$ BEGIN RETURN NEW; END $g$",
    )
    r = run_cli("--db", pg_url, "--json", "verify")
    assert r.code == 1 and r.json()["problems"]["guard_triggers"] == 1, r
    assert "differs" in r.json()["details"]["guard_triggers"][0]
    sql(
        pg_url,
        "CREATE OR REPLACE FUNCTION memvault_guard() RETURNS trigger LANGUAGE plpgsql "
        f"AS $guard${body}$guard$",
    )
    assert run_cli("--db", pg_url, "verify").code == 0
    sql(pg_url, "ALTER TABLE agent_messages DISABLE TRIGGER memvault_guard")
    r = run_cli("--db", pg_url, "verify")
    assert r.code == 1 and "trigger memvault_guard is disabled" in r.out, r
    sql(pg_url, "ALTER TABLE agent_messages ENABLE TRIGGER memvault_guard")
    sql(
        pg_url,
        "CREATE TRIGGER sneaky BEFORE INSERT ON memvault_meta FOR EACH ROW "
        "EXECUTE FUNCTION memvault_guard()",
    )
    r = run_cli("--db", pg_url, "verify")
    assert r.code == 1 and "unexpected trigger 'sneaky'" in r.out, r
    sql(pg_url, "DROP TRIGGER sneaky ON memvault_meta")

    # A migration not recorded: reported, and verify does not apply it (read-only).
    sql(pg_url, "DELETE FROM memvault_migrations WHERE name = 'm004_audit'")
    r = run_cli("--db", pg_url, "--json", "verify")
    assert r.code == 1 and r.json()["problems"]["schema"] == 1, r
    assert not sql(pg_url, "SELECT 1 FROM memvault_migrations WHERE name = 'm004_audit'")
    sql(pg_url, "INSERT INTO memvault_migrations VALUES ('m004_audit', 'x')")

    # Meta that names a key this keyring does not hold: the key error, exit 4.
    sql(pg_url, "UPDATE memvault_meta SET value = 'mv1:0000000000000000' WHERE key = 'kid'")
    r = run_cli("--db", pg_url, "verify")
    assert r.code == 4, r
    assert "not authenticated (no usable key)" in r.out and r.err.count("\n") == 1

    # No vault in the schema: exit 3.
    r = run_cli("--db", pg_url.rsplit("=", 1)[0] + "=t_nothing_here", "verify")
    assert r.code == 3, r


def test_backup_of_a_url_is_a_vault_file_the_same_key_opens(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    write_history(pg_vault, pg_url)
    dest = tmp_path / "copy.db"
    r = run_cli("--db", pg_url, "--json", "backup", str(dest))
    assert r.code == 0, r
    doc = r.json()
    assert password() not in r.out + r.err
    assert doc["vault_id"] == pg_vault.vault_id and doc["kid"] == pg_vault.sealer().kid
    assert doc["items"] == 4 and doc["sessions"] == 2 and doc["mode"] == "0o600"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name != "copy.db"]  # no -wal, -shm

    # The copy is a vault file: verify, show, export read it with the same keyring entry,
    # and read it as the server does.
    r = run_cli("--db", str(dest), "verify")
    assert r.code == 0 and "result     ok" in r.out, r
    for session in ("carnet", "travel"):
        a = run_cli("--db", pg_url, "--json", "show", session).json()["items"]
        b = run_cli("--db", str(dest), "--json", "show", session).json()["items"]
        assert a == b and a
    exports = []
    for where in (pg_url, str(dest)):
        target = tmp_path / f"e{len(exports)}.jsonl"
        assert (
            run_cli("--db", where, "export", "--all", "--include-expired", "-o", str(target)).code
            == 0
        )
        exports.append(target.read_bytes())
        target.unlink()
    assert exports[0] == exports[1]
    # Copied as they are: the same ciphertext rows.
    import sqlite3

    conn = sqlite3.connect(dest)
    copied = sorted(r[0] for r in conn.execute("SELECT message_data FROM agent_messages"))
    conn.close()
    assert copied == sorted(r[0] for r in sql(pg_url, "SELECT message_data FROM agent_messages"))
    # Opening the copy left the server's vault and its key alone; the backup is audited.
    assert run_cli("--db", pg_url, "show", "carnet").code == 0
    audit = sql(pg_url, "SELECT details FROM memvault_audit WHERE event = 'backup'")
    assert len(audit) == 1 and json.loads(audit[0]["details"])["to"].endswith("copy.db")

    # DEST rules are the file's: an existing file or a link is refused, untouched.
    r = run_cli("--db", pg_url, "backup", str(dest))
    assert r.code == 2 and r.err.count("\n") == 1, r
    link = tmp_path / "link.db"
    os.symlink(tmp_path / "target.db", link)
    r = run_cli("--db", pg_url, "backup", str(link))
    assert r.code == 2, r
    assert not (tmp_path / "target.db").exists()


def test_during_a_cut_off_rotation_reads_use_both_keys_and_backup_finishes_it(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    write_history(pg_vault, pg_url)
    r = run_cli("--db", pg_url, "rotate", env={"MEMVAULT_FAILPOINT": "pg-rotate-after-switch"})
    assert r.code == -9, r  # killed after the switch: every row still under the old key
    kids = {
        json.loads(r["message_data"])["kid"]
        for r in sql(pg_url, "SELECT message_data FROM agent_messages")
    }
    assert kids == {pg_vault.sealer().kid}
    assert sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'kid'")[0]["value"] not in kids

    r = run_cli("--db", pg_url, "search", "nord-17")
    assert r.code == 0 and len(r.out.splitlines()) == 2, r
    out = tmp_path / "e.jsonl"
    assert run_cli("--db", pg_url, "export", "--all", "-o", str(out)).code == 0
    assert len(out.read_text().splitlines()) == 3

    r = run_cli("--db", pg_url, "--json", "verify")
    assert r.code == 0, r  # a rotation in progress is not a problem
    assert r.json()["rotation"]["from_kid"] in kids and r.json()["authenticated"] == 4
    assert "rotation   in progress" in run_cli("--db", pg_url, "verify").out

    # A cut-off rotation blocks nothing: the backup finishes it, then copies one key.
    new_kid = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'kid'")[0]["value"]
    dest = tmp_path / "copy.db"
    r = run_cli("--db", pg_url, "--json", "backup", str(dest))
    assert r.code == 0 and r.json()["kid"] == new_kid, r
    assert not sql(pg_url, "SELECT 1 FROM memvault_meta WHERE key = 'rotating_from'")
    assert run_cli("--db", str(dest), "verify").code == 0
    rows = sql(pg_url, "SELECT message_data FROM agent_messages")
    assert {json.loads(r["message_data"])["kid"] for r in rows} == {new_kid}
    # Finished, not a second rotation started: the key is the one the switch chose.
    assert sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'kid'")[0]["value"] == new_kid


def test_import_into_a_url_seals_verifies_and_keeps_order(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    from tests.files.test_import import make_plain

    src = tmp_path / "plain.db"
    turns = [{"role": "user", "content": f"turn {i} NORD"} for i in range(7)]
    make_plain(src, {"a": turns, "b": [{"role": "user", "content": "other"}]})
    r = run_cli("--db", pg_url, "--json", "import", str(src))
    assert r.code == 0, r
    assert r.json()["items"] == 8 and password() not in r.out + r.err
    assert run_cli("--db", pg_url, "--json", "show", "a").json()["items"] == turns
    assert "NORD" not in json.dumps(
        [list(x) for x in sql(pg_url, "SELECT * FROM agent_messages")], default=str
    )
    assert run_cli("--db", pg_url, "verify").code == 0
    events = [r["event"] for r in sql(pg_url, "SELECT event FROM memvault_audit ORDER BY id")]
    assert events.count("import") == 2
    # A session already in the vault: refused, nothing imported (exit 1).
    r = run_cli("--db", pg_url, "import", str(src), "--session", "a")
    assert r.code == 1 and "already exists" in r.err, r
    assert len(run_cli("--db", pg_url, "--json", "show", "a").json()["items"]) == 7

    # --shred-source: the source is destroyed after the verified import.
    src2 = tmp_path / "plain2.db"
    make_plain(src2, {"c": [{"role": "user", "content": "last"}]})
    r = run_cli("--db", pg_url, "import", str(src2), "--shred-source", "--yes")
    assert r.code == 0, r
    assert not src2.exists()
    assert run_cli("--db", pg_url, "--json", "show", "c").json()["items"] == [
        {"role": "user", "content": "last"}
    ]
    assert "source-shred" in [
        r["event"] for r in sql(pg_url, "SELECT event FROM memvault_audit ORDER BY id")
    ]
