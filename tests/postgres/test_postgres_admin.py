"""A PostgreSQL vault's admin commands: the admin lock, purge, pop, ttl, log, revoke, shred,
the recovery kit, and the several-hosts flow (two keyrings, one vault).

Run with `scripts/with-postgres scripts/test -q -m postgres tests/postgres/test_postgres_admin.py`.
Each test has a schema of its own (tests.postgres.test_postgres_vault's `pg_url`). Host A is this
test session's keyring (the private Secret Service under scripts/test); host B is a
subprocess environment with a keyring of its own (tests.memory_keyring, its own file).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MEMORY_BACKEND, ROOT, keyring_entries, run_cli
from tests.pgserver import MARKS, SERVER_URL, insert_sealed, sql

pytestmark = MARKS
BUSY = "another rotation, purge, restore, revoke or shred of"
KEY_CHANGED = "the vault's key changed: import the new recovery kit"


def write(url: str, session_id: str, contents: list[str]) -> None:
    import vault

    async def go() -> None:
        s = vault.open_session(session_id, url)
        await s.add_items([{"role": "user", "content": c} for c in contents])

    asyncio.run(go())


def count_rows(url: str) -> int:
    return int(sql(url, "SELECT count(*) AS n FROM agent_messages")[0]["n"])


def contents(r: Any) -> list[str]:
    assert r.code == 0, r
    return [i["content"] for i in r.json()["items"]]


def one_line_error(r: Any, code: int, text: str) -> None:
    assert r.code == code, r
    assert text in r.err, r
    assert r.err.count("\n") == 1 and "Traceback" not in r.err, r


# -- the admin lock ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("holder", ["rotate", "purge", "revoke", "shred"])
def test_one_admin_operation_at_a_time_across_processes(
    pg_vault: Any, pg_url: str, holder: str
) -> None:
    write(pg_url, "s1", ["kept"])
    args = [holder] if holder == "rotate" else [holder, "--yes"]
    held = subprocess.Popen(
        [sys.executable, "-m", "vault", "--db", pg_url, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, MEMVAULT_PAUSEPOINT="pg-admin-locked"),
    )
    try:
        assert held.stderr is not None
        line = held.stderr.readline()
        assert line.strip() == "memvault: paused at pg-admin-locked", line
        for other in (["rotate"], ["purge", "--yes"], ["revoke", "--yes"], ["shred", "--yes"]):
            r = run_cli("--db", pg_url, *other, env={"MEMVAULT_LOCK_TIMEOUT": "1"})
            one_line_error(r, 5, BUSY)
            assert "nothing was changed" in r.err
    finally:
        # Paused inside the event loop, where SIGINT only cancels at the next await: kill
        # it. The server ends its session, and so releases the lock.
        held.kill()
        held.communicate(timeout=120)
    # Nothing was changed by the refused ones, nor by the interrupted holder.
    assert contents(run_cli("--db", pg_url, "--json", "show", "s1")) == ["kept"]
    r = run_cli("--db", pg_url, "--json", "purge", "--yes")  # the lock is free again
    assert r.code == 0 and r.json()["kept"] == 1, r


# -- purge, pop, ttl, log -----------------------------------------------------
def test_ttl_purge_deletes_expired_items_keeps_fresh_and_unreadable_ones(
    pg_vault: Any, pg_url: str
) -> None:
    from vault.engines.postgres import admin as pgadmin
    from vault.engines.postgres.vault import PgVault

    old = int(time.time()) - 2 * 3600  # the vault's TTL is 1h
    insert_sealed(pg_url, "s1", [f"old {i}" for i in range(5)], old)
    insert_sealed(pg_url, "s1", ["fresh 1", "fresh 2"], None)
    insert_sealed(pg_url, "s2", ["fresh 3"], None)
    insert_sealed(pg_url, "s2", ["tampered"], old)
    sql(
        pg_url,
        "UPDATE agent_messages SET message_data = replace(message_data, 'gAAAAA', 'gAAAAAx') "
        "WHERE id = (SELECT max(id) FROM agent_messages)",
    )
    assert run_cli("--db", pg_url, "--json", "status").json()["items"] == 9

    # In batches of 2 rows, each its own transaction: the counts are those of every batch.
    seen: list[int] = []
    report = pgadmin.purge(PgVault.open(pg_url), progress=seen.append, batch=2)
    assert report.counts == {"deleted": 5, "kept": 3, "unreadable": 1, "vacuumed": True}
    assert seen == [2, 2, 2, 2, 1]
    assert count_rows(pg_url) == 4
    assert contents(run_cli("--db", pg_url, "--json", "show", "s1")) == ["fresh 1", "fresh 2"]
    r = run_cli("--db", pg_url, "--json", "show", "s2")  # exit 1: an item does not authenticate
    assert r.code == 1 and r.json()["unreadable"] == 1, r
    assert [i["content"] for i in r.json()["items"]] == ["fresh 3"]

    # The command: nothing left to purge; the audit trail has both runs' counts.
    r = run_cli("--db", pg_url, "--json", "purge", "--yes")
    assert r.code == 0, r
    assert (r.json()["deleted"], r.json()["kept"], r.json()["unreadable"]) == (0, 3, 1)
    assert r.json()["scrub"] == "nothing deleted: no VACUUM was needed"  # none ran
    purges = [e for e in pg_vault.audit_log() if e["event"] == "purge"]
    assert [(e["deleted"], e["kept"], e["unreadable"]) for e in purges] == [(5, 3, 1), (0, 3, 1)]
    # VACUUM ran on the table after the delete (the server's statistics say so).
    deadline = time.monotonic() + 60
    while True:
        row = sql(
            pg_url,
            "SELECT last_vacuum FROM pg_stat_user_tables WHERE schemaname = current_schema() "
            "AND relname = 'agent_messages'",
        )
        if row and row[0]["last_vacuum"] is not None:
            break
        assert time.monotonic() < deadline, "no VACUUM of agent_messages recorded"
        time.sleep(0.5)


def test_an_open_session_applies_a_ttl_changed_by_another_process(
    pg_vault: Any, pg_url: str
) -> None:
    import vault

    # pg_vault's TTL is 1h: an item sealed 2h ago is expired, one sealed now is not.
    insert_sealed(pg_url, "s1", ["two hours old"], int(time.time()) - 7200)
    insert_sealed(pg_url, "s1", ["fresh"], None)

    async def read(session: Any) -> list[str]:
        return [i["content"] for i in await session.get_items()]

    session = vault.open_session("s1", pg_url)
    assert asyncio.run(read(session)) == ["fresh"]
    assert run_cli("--db", pg_url, "ttl", "3h").code == 0
    assert asyncio.run(read(session)) == ["two hours old", "fresh"]
    assert run_cli("--db", pg_url, "ttl", "1h").code == 0
    assert asyncio.run(read(session)) == ["fresh"]
    assert run_cli("--db", pg_url, "ttl", "never").code == 0
    assert asyncio.run(read(session)) == ["two hours old", "fresh"]


def test_pop_ttl_and_log_on_a_url(pg_vault: Any, pg_url: str) -> None:
    write(pg_url, "s1", ["one", "two", "three"])
    r = run_cli("--db", pg_url, "--json", "pop", "s1", "-n", "2")
    assert r.code == 0, r
    assert [i["content"] for i in r.json()["popped"]] == ["three", "two"]
    assert "not applicable on PostgreSQL" in r.json()["scrub"]
    assert contents(run_cli("--db", pg_url, "--json", "show", "s1")) == ["one"]
    one_line_error(run_cli("--db", pg_url, "pop", "nope"), 1, "no session 'nope'")

    r = run_cli("--db", pg_url, "ttl")
    assert (r.code, r.out.strip()) == (0, "ttl 1h"), r
    r = run_cli("--db", pg_url, "ttl", "2d")
    assert (r.code, r.out.strip()) == (0, "ttl 2d (set)"), r
    assert run_cli("--db", pg_url, "--json", "status").json()["ttl"] == "2d"
    assert run_cli("--db", pg_url, "--json", "ttl", "never").json()["ttl_seconds"] is None
    from vault.engines.postgres.vault import PgVault

    assert PgVault.open(pg_url).ttl is None

    r = run_cli("--db", pg_url, "--json", "log")
    assert r.code == 0, r
    events = [(e["event"], e.get("old"), e.get("new")) for e in r.json()]
    assert events == [("init", None, None), ("ttl", "1h", "2d"), ("ttl", "2d", "never")]
    human = run_cli("--db", pg_url, "log")
    assert human.code == 0 and "ttl" in human.out and "three" not in human.out, human


def test_pop_refuses_an_item_that_does_not_authenticate(pg_vault: Any, pg_url: str) -> None:
    write(pg_url, "s1", ["one", "two"])
    sql(
        pg_url,
        "UPDATE agent_messages SET message_data = replace(message_data, 'gAAAAA', 'gAAAAAx') "
        "WHERE id = (SELECT max(id) FROM agent_messages)",
    )
    one_line_error(run_cli("--db", pg_url, "pop", "s1"), 1, "does not authenticate")
    assert count_rows(pg_url) == 2


# -- revoke and shred -----------------------------------------------------------
def rotated_vault(pg_url: str) -> tuple[str, str, str, str]:
    """(vault_id, retired kid, current kid, retired key) after one rotation, with items
    written before it; the retired key kept aside, as a restored copy's kit would."""
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    write(pg_url, "s1", ["secret one", "secret two"])
    meta = {r["key"]: r["value"] for r in sql(pg_url, "SELECT key, value FROM memvault_meta")}
    old_key = KeyStore().get(entry_name(meta["vault_id"], meta["kid"]))
    assert old_key
    r = run_cli("--db", pg_url, "--json", "rotate")
    assert r.code == 0, r
    return meta["vault_id"], r.json()["old_kid"], r.json()["new_kid"], old_key


def test_revoke_destroys_every_key_version_and_every_command_then_exits_4(
    pg_vault: Any, pg_url: str
) -> None:
    from vault.errors import KeyRevoked
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    vault_id, old_kid, new_kid, old_key = rotated_vault(pg_url)
    # A restored copy's key (an older version) sits in the keyring too: it goes as well.
    KeyStore().set(entry_name(vault_id, old_kid), old_key)
    assert set(keyring_entries(vault_id)) == {f"{vault_id}/{old_kid}", f"{vault_id}/{new_kid}"}
    new_key = KeyStore().get(entry_name(vault_id, new_kid))
    assert new_key
    r = run_cli("--db", pg_url, "--json", "revoke", "--yes")
    assert r.code == 0, r
    doc = r.json()
    assert doc["destroyed_kids"] == sorted([old_kid, new_kid])
    assert doc["already_revoked"] is False and doc["key_destroyed"] is True
    assert "other host" in doc["other_hosts"]
    assert keyring_entries(vault_id) == {}
    states = {x["kid"]: x["state"] for x in sql(pg_url, "SELECT kid, state FROM memvault_keys")}
    assert states == {old_kid: "destroyed", new_kid: "destroyed"}
    assert count_rows(pg_url) == 2  # the rows stay, unreadable
    # A writer still holding a key (the old one, or the one current at the revoke) is
    # refused by the guard from the revoke on...
    import asyncpg

    from vault import crypto
    from vault.engines.sqlite.schema import GUARD_MESSAGE

    insert = "INSERT INTO agent_messages (session_id, message_data) VALUES ('s1', $1)"
    late = [
        crypto.Sealer(k).seal("s1", {"role": "user", "content": "late"}) for k in (old_key, new_key)
    ]
    for row in late:
        with pytest.raises(asyncpg.CheckViolationError, match=GUARD_MESSAGE):
            sql(pg_url, insert, args=(row,))
    assert count_rows(pg_url) == 2

    st = run_cli("--db", pg_url, "--json", "status")
    assert st.code == 0 and st.json()["key"] == "key revoked", st
    keyed = [
        ["show", "s1"],
        ["sessions"],
        ["pop", "s1"],
        ["clear", "s1", "--yes"],
        ["ttl"],
        ["ttl", "1d"],
        ["purge", "--yes"],
        ["rotate"],
    ]
    for command in keyed:
        one_line_error(run_cli("--db", pg_url, *command), 4, "revoked")
    import vault

    with pytest.raises(KeyRevoked):
        vault.open_session("s1", pg_url)
    assert count_rows(pg_url) == 2
    # ...and a row written around the guard (trigger disabled, as the schema's owner can)
    # is not read by anything: every keyed command still exits 4.
    sql(pg_url, "ALTER TABLE agent_messages DISABLE TRIGGER memvault_guard")
    sql(pg_url, insert, args=(late[0],))
    sql(pg_url, "ALTER TABLE agent_messages ENABLE TRIGGER memvault_guard")
    assert count_rows(pg_url) == 3
    for command in (["show", "s1"], ["--json", "search", "late"], ["verify"]):
        r = run_cli("--db", pg_url, *command)
        assert r.code == 4 and "late" not in r.out + r.err.replace("latest", ""), r
    again = run_cli("--db", pg_url, "--json", "revoke", "--yes")
    assert again.code == 0 and again.json()["already_revoked"] is True, again
    r = run_cli("--db", pg_url, "--json", "log")
    assert [e["event"] for e in r.json()][-1] == "revoke"


def schema_of(url: str) -> str:
    return url.rsplit("schema=", 1)[1]


def tables_in(schema: str) -> list[str]:
    rows = sql(SERVER_URL, "SELECT tablename FROM pg_tables WHERE schemaname = $1", args=(schema,))
    return sorted(r["tablename"] for r in rows)


def schema_exists(schema: str) -> bool:
    rows = sql(SERVER_URL, "SELECT 1 FROM pg_namespace WHERE nspname = $1", args=(schema,))
    return bool(rows)


def test_shred_leaves_no_rows_no_tables_and_no_key(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    vault_id, old_kid, new_kid, old_key = rotated_vault(pg_url)
    KeyStore().set(entry_name(vault_id, old_kid), old_key)  # a restored copy's key
    schema = schema_of(pg_url)
    assert "agent_messages" in tables_in(schema)
    receipt = tmp_path / "receipt.json"
    r = run_cli("--db", pg_url, "--json", "shred", "--yes", "--receipt", str(receipt))
    assert r.code == 0, r
    doc = r.json()
    assert (doc["items"], doc["sessions"], doc["resumed"]) == (2, 1, False)
    assert doc["destroyed_kids"] == sorted([old_kid, new_kid]) and doc["key_destroyed"]
    assert doc["schema_dropped"] is True and doc["vacuumed"] is True
    assert doc["files"] == [] and "not applicable on PostgreSQL" in doc["files_note"]
    # No key, no rows, no tables, no schema.
    assert keyring_entries(vault_id) == {}
    assert tables_in(schema) == [] and not schema_exists(schema)
    assert json.loads(receipt.read_text())["vault_id"] == vault_id
    assert stat.S_IMODE(receipt.stat().st_mode) == 0o600
    one_line_error(run_cli("--db", pg_url, "status"), 3, "no vault")
    one_line_error(run_cli("--db", pg_url, "shred", "--yes"), 3, "no vault")


def test_shred_keeps_a_schema_holding_other_objects_and_works_after_revoke(
    pg_vault: Any, pg_url: str
) -> None:
    write(pg_url, "s1", ["secret"])
    sql(pg_url, "CREATE TABLE not_memvaults (x int)")
    vault_id = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")[0]["value"]
    assert run_cli("--db", pg_url, "revoke", "--yes").code == 0
    assert keyring_entries(vault_id) == {}
    r = run_cli("--db", pg_url, "shred", "--yes")
    assert r.code == 0, r
    assert "key already gone" in r.out and "kept (it holds other objects)" in r.out, r
    assert tables_in(schema_of(pg_url)) == ["not_memvaults"]


def test_a_shred_killed_after_destroying_the_key_is_finished_by_the_next(
    pg_vault: Any, pg_url: str
) -> None:
    write(pg_url, "s1", ["secret one", "secret two"])
    vault_id = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")[0]["value"]
    kid = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'kid'")[0]["value"]
    r = run_cli("--db", pg_url, "shred", "--yes", env={"MEMVAULT_FAILPOINT": "pg-shred-after-keys"})
    assert r.code == -9, r
    assert keyring_entries(vault_id) == {} and count_rows(pg_url) == 2
    # Meanwhile every keyed command refuses, and the guard refuses every write.
    one_line_error(run_cli("--db", pg_url, "show", "s1"), 4, "revoked")
    r = run_cli("--db", pg_url, "--json", "shred", "--yes")
    assert r.code == 0, r
    doc = r.json()
    assert doc["resumed"] is True and doc["destroyed_kids"] == [kid], doc
    assert (doc["items"], doc["sessions"]) == (2, 1)
    assert not schema_exists(schema_of(pg_url))


# -- the recovery kit and several hosts -------------------------------------------
def host_b_env(tmp_path: Path) -> dict[str, str]:
    """Host B: the same vault URL, a keyring of its own (its own file)."""
    return {
        "PYTHON_KEYRING_BACKEND": MEMORY_BACKEND,
        "MEMVAULT_TEST_KEYRING_FILE": str(tmp_path / "host-b-keyring.json"),
        "PYTHONPATH": str(ROOT),
    }


def host_b_keys(tmp_path: Path) -> set[str]:
    path = tmp_path / "host-b-keyring.json"
    if not path.exists():
        return set()
    return set(json.loads(path.read_text()).get("memvault", {}))


OPEN_SESSION = """
import asyncio, json, sys, vault
from vault.errors import VaultError
async def go():
    s = vault.open_session("s1", sys.argv[1])
    if len(sys.argv) > 2:
        await s.add_items([{"role": "user", "content": sys.argv[2]}])
    return [i["content"] for i in await s.get_items()]
try:
    print(json.dumps(asyncio.run(go())))
except VaultError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": exc.message, "code": exc.exit_code}))
"""


def session_on(url: str, env: dict[str, str], *add: str) -> Any:
    proc = subprocess.run(
        [sys.executable, "-c", OPEN_SESSION, url, *add],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, **env),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_hosts_share_a_vault_and_a_rotation_needs_the_new_kit(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    b = host_b_env(tmp_path)
    pw = tmp_path / "passphrase"
    pw.write_text("correct horse battery staple\n")
    pw.chmod(0o600)
    write(pg_url, "s1", ["from host A"])
    vault_id = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")[0]["value"]
    kid1 = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'kid'")[0]["value"]

    # Host B has no key yet: the generic missing-key line, not "changed".
    r = run_cli("--db", pg_url, "show", "s1", env=b)
    one_line_error(r, 4, "memvault key import")
    assert KEY_CHANGED not in r.err

    # Initial distribution: A exports the kit, B imports it; both read and write.
    kit1 = tmp_path / "kit1.json"
    r = run_cli("--db", pg_url, "key", "export", "--passphrase-file", str(pw), str(kit1))
    assert r.code == 0, r
    r = run_cli(
        "--db", pg_url, "--json", "key", "import", "--passphrase-file", str(pw), str(kit1), env=b
    )
    assert r.code == 0 and r.json()["restored"] is True, r
    assert host_b_keys(tmp_path) == {f"{vault_id}/{kid1}"}
    assert session_on(pg_url, b, "from host B") == ["from host A", "from host B"]
    r = run_cli("--db", pg_url, "--json", "key", "list", env=b)
    assert r.code == 0, r
    assert r.json()["keys"] == [
        {
            "kid": kid1,
            "state": "current",
            "in_keyring": True,
            "where": "keyring",
            "created_at": r.json()["keys"][0]["created_at"],
            "backups": [],
        }
    ]

    # Host A rotates. B's keyring lacks the new key: every command, and open_session, says so.
    r = run_cli("--db", pg_url, "--json", "rotate")
    assert r.code == 0, r
    kid2 = r.json()["new_kid"]
    for command in (
        ["show", "s1"],
        ["pop", "s1"],
        ["clear", "s1", "--yes"],
        ["ttl"],
        ["ttl", "2h"],
        ["purge", "--yes"],
        ["rotate"],
        ["key", "export", "--passphrase-file", str(pw), str(tmp_path / "nope.json")],
    ):
        r = run_cli("--db", pg_url, *command, env=b)
        one_line_error(r, 4, KEY_CHANGED)
        assert "memvault key import KIT" in r.err and kid2 in r.err
    st = run_cli("--db", pg_url, "--json", "status", env=b).json()
    assert st["key"] == "unusable" and KEY_CHANGED in st["key_problem"]
    # `sessions` needs no key: B still lists what is stored.
    r = run_cli("--db", pg_url, "--json", "sessions", env=b)
    assert r.code == 0 and [x["session_id"] for x in r.json()] == ["s1"], r
    failed = session_on(pg_url, b)
    assert failed["code"] == 4 and failed["message"].startswith(KEY_CHANGED), failed
    r = run_cli("--db", pg_url, "--json", "key", "list", env=b)
    states = {k["kid"]: (k["state"], k["in_keyring"]) for k in r.json()["keys"]}
    assert states == {kid1: ("destroyed", True), kid2: ("current", False)}
    # The old kit cannot be imported: it predates the rotation.
    r = run_cli("--db", pg_url, "key", "import", "--passphrase-file", str(pw), str(kit1), env=b)
    one_line_error(r, 4, "predates a rotation")

    # After each rotation: A exports the new kit, B imports it; B's old key entry goes.
    kit2 = tmp_path / "kit2.json"
    r = run_cli("--db", pg_url, "key", "export", "--passphrase-file", str(pw), str(kit2))
    assert r.code == 0, r
    r = run_cli(
        "--db", pg_url, "--json", "key", "import", "--passphrase-file", str(pw), str(kit2), env=b
    )
    assert r.code == 0, r
    assert r.json()["destroyed_here"] == [kid1]
    assert host_b_keys(tmp_path) == {f"{vault_id}/{kid2}"}
    assert session_on(pg_url, b, "B after") == ["from host A", "from host B", "B after"]
    assert session_on(pg_url, {}) == ["from host A", "from host B", "B after"]

    # Revocation: revoke on A, then on B (it finds the vault revoked, destroys B's entry).
    assert run_cli("--db", pg_url, "revoke", "--yes").code == 0
    one_line_error(run_cli("--db", pg_url, "show", "s1", env=b), 4, "revoked")
    r = run_cli("--db", pg_url, "--json", "revoke", "--yes", env=b)
    assert r.code == 0 and r.json()["already_revoked"] is True, r
    assert r.json()["destroyed_kids"] == [kid2]
    assert host_b_keys(tmp_path) == set() and keyring_entries(vault_id) == {}


def test_shred_keeps_a_schema_it_did_not_create(pg_url: str) -> None:
    # A schema made before `init` (as `public`, or one a DBA set up with its grants) is
    # the user's: shred takes the vault out of it and leaves it, saying why.
    schema = schema_of(pg_url)
    sql(SERVER_URL, f'CREATE SCHEMA "{schema}"')
    assert run_cli("--db", pg_url, "init").code == 0
    write(pg_url, "s1", ["secret"])
    r = run_cli("--db", pg_url, "--json", "shred", "--yes")
    assert r.code == 0, r
    doc = r.json()
    assert doc["schema_dropped"] is False, doc
    assert doc["schema_kept_because"] == "memvault init did not create it"
    assert schema_exists(schema) and tables_in(schema) == []
    # Created by init: dropped, and the report has no reason to give.
    sql(SERVER_URL, f'DROP SCHEMA "{schema}"')
    assert run_cli("--db", pg_url, "init").code == 0
    r = run_cli("--db", pg_url, "shred", "--yes")
    assert r.code == 0 and f"schema {schema} dropped" in r.out, r
    assert not schema_exists(schema)


def test_a_schema_the_server_will_not_drop_is_kept_and_the_shred_still_succeeds(
    pg_vault: Any, pg_url: str
) -> None:
    # The keys and tables are gone by then: a refusal of the last step must not turn
    # the shred into a failure that says "nothing was changed". Here another session's
    # open transaction creating a table in the schema holds a lock that DROP SCHEMA
    # waits for, past the lock timeout.
    import asyncpg

    from vault.engines.postgres.url import parse

    write(pg_url, "s1", ["secret"])
    vault_id = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")[0]["value"]
    schema = schema_of(pg_url)
    created = threading.Event()
    release = threading.Event()

    def hold() -> None:
        async def go() -> None:
            conn = await asyncpg.connect(parse(SERVER_URL).dsn)
            try:
                async with conn.transaction():
                    await conn.execute(f'CREATE TABLE "{schema}".not_yet (x int)')
                    created.set()
                    await asyncio.to_thread(release.wait, 120)
                    raise RuntimeError("roll back")
            except RuntimeError:
                pass
            finally:
                await conn.close()

        asyncio.run(go())

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert created.wait(60)
        r = run_cli("--db", pg_url, "--json", "shred", "--yes", env={"MEMVAULT_LOCK_TIMEOUT": "2"})
    finally:
        release.set()
        holder.join(60)
    assert r.code == 0, r
    doc = r.json()
    assert doc["schema_dropped"] is False
    assert doc["schema_kept_because"] == "the server refused to drop it (55P03)", doc
    assert keyring_entries(vault_id) == {} and tables_in(schema) == [] and schema_exists(schema)
