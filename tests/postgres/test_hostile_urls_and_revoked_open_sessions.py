"""A PostgreSQL vault under hostile or careless use: malformed URLs, a password hidden in a
disguised query key, and an open agent session whose vault another process revokes or
shreds.

Run with `scripts/with-postgres scripts/test -q -m postgres
tests/postgres/test_hostile_urls_and_revoked_open_sessions.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.pgserver import MARKS, SERVER_URL, password

pytestmark = MARKS


def _with_port(port: str) -> str:
    """The test server's URL with its port replaced."""
    head, _, rest = SERVER_URL.rpartition("@")
    hostport, _, tail = rest.partition("/")
    host = hostport.rsplit(":", 1)[0]
    return f"{head}@{host}:{port}/{tail}"


@pytest.mark.parametrize("port", ["notaport", "99999", "0", "-1"])
def test_a_bad_port_is_a_usage_error_on_one_line(port: str) -> None:
    r = run_cli("--db", _with_port(port), "status")
    assert r.code == 2, r.err
    assert len(r.err.strip().splitlines()) == 1, r.err
    assert "port" in r.err and "Traceback" not in r.err
    assert password() not in r.err + r.out


def test_an_unclosed_ipv6_bracket_is_a_usage_error() -> None:
    url = SERVER_URL.rpartition("@")[0] + "@[::1:5432/db"
    r = run_cli("--db", url, "status")
    assert r.code == 2, r.err
    assert len(r.err.strip().splitlines()) == 1, r.err
    assert password() not in r.err + r.out


@pytest.mark.parametrize("key", ["pass%77ord", "PASSWORD", "%70assword", "sslpass%77ord"])
def test_a_password_in_a_percent_encoded_query_key_is_never_printed(pg_url: str, key: str) -> None:
    # parse_qsl decodes the key, so the driver gets `password=...`: the shown URL must
    # hide it as it hides `password=`.
    r = run_cli("--db", pg_url, "init")
    assert r.code == 0, r.err
    secret = "Zq" + password()
    r = run_cli("--db", f"{pg_url}&{key}={secret}", "status", "--json")
    assert secret not in r.out + r.err


def test_an_open_session_refuses_to_read_once_another_process_revokes(pg_url: str) -> None:
    import vault
    from vault.engines.postgres.vault import PgVault
    from vault.errors import KeyRevoked

    PgVault.init(pg_url, ttl=3600)

    async def go() -> Any:
        s = vault.open_session("s1", pg_url)
        await s.add_items([{"role": "user", "content": "before the revoke"}])
        assert len(await s.get_items()) == 1
        r = await asyncio.to_thread(run_cli, "--db", pg_url, "revoke", "--yes")
        assert r.code == 0, r.err
        # A file session refuses here too: the history was cut off from every key.
        with pytest.raises(KeyRevoked) as refused:
            await s.get_items()
        assert "file" not in refused.value.message  # a PostgreSQL vault has none

    asyncio.run(go())


def test_an_open_session_says_no_vault_once_another_process_shreds(pg_url: str) -> None:
    import vault
    from vault.engines.postgres.vault import PgVault
    from vault.errors import NotAVault

    PgVault.init(pg_url, ttl=3600)

    async def go() -> Any:
        s = vault.open_session("s1", pg_url)
        await s.add_items([{"role": "user", "content": "before the shred"}])
        r = await asyncio.to_thread(run_cli, "--db", pg_url, "shred", "--yes")
        assert r.code == 0, r.err
        with pytest.raises(NotAVault) as read:
            await s.get_items()
        assert read.value.exit_code == 3
        assert password() not in read.value.message
        with pytest.raises(NotAVault):
            await s.add_items([{"role": "user", "content": "after"}])

    asyncio.run(go())


def test_a_rotation_whose_connection_drops_says_so_and_the_next_one_finishes(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.pgserver import end_lock_holders, raw_kids
    from vault import testhooks
    from vault.engines.postgres.lock import ADMIN_LOCK
    from vault.engines.postgres.vault import PgVault
    from vault.errors import OperationFailed

    PgVault.init(pg_url, ttl=3600)

    async def fill() -> None:
        import vault

        s = vault.open_session("s1", pg_url)
        await s.add_items([{"role": "user", "content": f"m{i}"} for i in range(30)])

    asyncio.run(fill())
    killed = []

    def drop_the_connection(name: str) -> None:
        # The server ends the rotation's backend (the advisory lock's holder) after a batch:
        # what a restart, a failover or an idle-session killer does.
        if name == "pg-rotate-after-batch" and not killed:
            # Called inside the rotation's event loop: the helper's own loop on a thread.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                killed.extend(pool.submit(end_lock_holders, pg_url, ADMIN_LOCK).result())

    monkeypatch.setattr(testhooks, "failpoint", drop_the_connection)
    with pytest.raises(OperationFailed) as cut:
        PgVault.open(pg_url).rotate(batch=10)
    assert killed
    message = cut.value.message
    assert "connection" in message and "memvault rotate" in message, message
    assert password() not in message
    monkeypatch.undo()
    report = PgVault.open(pg_url).rotate(batch=10)
    assert set(raw_kids(pg_url)) == {report.counts["new_kid"]}
    items, _expired, unreadable = PgVault.open(pg_url).items("s1")
    assert len(items) == 30 and unreadable == 0


def test_a_schema_the_user_may_not_use_is_a_privilege_error_not_no_vault(pg_url: str) -> None:
    from tests.pgserver import sql
    from vault.engines.postgres.vault import PgVault

    schema = PgVault.init(pg_url, ttl=3600).loc.schema
    assert schema is not None
    # The owner takes its own USAGE away: what a role without the DBA's GRANT USAGE meets.
    sql(pg_url, f"REVOKE USAGE ON SCHEMA {schema} FROM CURRENT_USER")
    try:
        r = run_cli("--db", pg_url, "status")
        assert r.code == 1, r
        assert "USAGE" in r.err and "memvault init" not in r.err, r.err
        assert len(r.err.strip().splitlines()) == 1 and password() not in r.err
        r = run_cli("--db", pg_url, "verify")
        assert r.code == 1 and "USAGE" in r.err, r
        r = run_cli("--db", pg_url, "init")
        assert r.code == 1 and "USAGE" in r.err, r
    finally:
        sql(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO CURRENT_USER")


def test_an_unencoded_at_sign_in_the_password_is_refused_before_any_lookup() -> None:
    # The driver would split at the first '@' and look the password's tail up as a host.
    user, _, hostpart = SERVER_URL.partition("://")[2].rpartition("@")
    name = user.split(":", 1)[0]
    url = f"postgresql+asyncpg://{name}:Zq{password()}@tail@{hostpart}"
    r = run_cli("--db", url, "status")
    assert r.code == 2, r
    assert "%40" in r.err and len(r.err.strip().splitlines()) == 1
    assert password() not in r.err + r.out and "tail" not in r.err


def kit_of_current_key(url: str, kit: Path, passphrase: str) -> None:
    """A kit of the vault's current key alone, made without `key export` (which carries
    both keys while a rotation is unfinished): as another route (an older memvault, a
    copied keyring) would."""
    from vault.engines.postgres.vault import PgVault
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore
    from vault.kit import seal, write_kit_file

    meta = PgVault.open(url).meta()
    key = KeyStore().get(entry_name(meta["vault_id"], meta["kid"]))
    assert key is not None
    write_kit_file(kit, seal(key, meta["vault_id"], passphrase).to_json())


@pytest.mark.slow
def test_a_kit_imported_during_a_rotation_says_the_old_key_stays_until_it_ends(
    pg_url: str, tmp_path: Path
) -> None:
    from tests.pgserver import sql
    from tests.postgres.test_postgres_admin import host_b_env, host_b_keys, write
    from vault.engines.postgres.vault import PgVault

    PgVault.init(pg_url, ttl=3600)
    write(pg_url, "s1", [f"m{i}" for i in range(5)])
    b = host_b_env(tmp_path)
    pw = tmp_path / "passphrase"
    pw.write_text("correct horse battery staple\n")
    pw.chmod(0o600)
    kit1, kit2 = tmp_path / "kit1.json", tmp_path / "kit2.json"

    def export(kit: Path) -> None:
        r = run_cli("--db", pg_url, "key", "export", "--passphrase-file", str(pw), str(kit))
        assert r.code == 0, r

    export(kit1)
    imp1 = run_cli("--db", pg_url, "key", "import", "--passphrase-file", str(pw), str(kit1), env=b)
    assert imp1.code == 0, imp1
    kid1 = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'kid'")[0]["value"]
    vault_id = sql(pg_url, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")[0]["value"]

    # Host A's rotation is cut off after its switch: rows still under kid1, the new key current.
    cut = run_cli("--db", pg_url, "rotate", env={"MEMVAULT_FAILPOINT": "pg-rotate-after-switch"})
    assert cut.code != 0
    # A kit of the new key alone (`key export` would carry both keys now).
    kit_of_current_key(pg_url, kit2, "correct horse battery staple")
    r = run_cli(
        "--db", pg_url, "--json", "key", "import", "--passphrase-file", str(pw), str(kit2), env=b
    )
    assert r.code == 0, r
    # B still needs kid1 for the rows not yet moved: the import must keep it, and say so.
    assert f"{vault_id}/{kid1}" in host_b_keys(tmp_path)
    assert r.json()["kept_until_rotation_ends"] == [kid1], r.out
    human = run_cli("--db", pg_url, "key", "import", "--passphrase-file", str(pw), str(kit2), env=b)
    assert kid1 in human.out and "again" in human.out, human

    # A finishes the rotation; B's second import, as told, takes kid1 out of B's keyring.
    assert run_cli("--db", pg_url, "rotate").code == 0
    r = run_cli(
        "--db", pg_url, "--json", "key", "import", "--passphrase-file", str(pw), str(kit2), env=b
    )
    assert r.code == 0 and r.json()["destroyed_here"] == [kid1], r
    assert r.json()["kept_until_rotation_ends"] == []
    assert f"{vault_id}/{kid1}" not in host_b_keys(tmp_path)


def test_a_straggler_in_another_json_layout_is_moved_before_the_old_key_goes(
    pg_url: str,
) -> None:
    """The guard accepts any JSON layout of an envelope (compact, keys in another order, as
    a client other than the SDK writes it): the straggler sweep must find such a row under
    the old key too, or its key is destroyed with the row still under it."""
    import json

    import vault
    from tests.pgserver import raw_kids, sql
    from vault import crypto
    from vault.engines.postgres.vault import PgVault
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    PgVault.init(pg_url, ttl=3600)

    async def write() -> None:
        s = vault.open_session("s1", pg_url)
        await s.add_items([{"role": "user", "content": f"turn {i}"} for i in range(600)])

    asyncio.run(write())  # more than one batch of 500
    r = run_cli("--db", pg_url, "rotate", env={"MEMVAULT_FAILPOINT": "pg-rotate-after-batch"})
    assert r.code == -9, r
    meta = dict(sql(pg_url, "SELECT key, value FROM memvault_meta"))
    old_key = KeyStore().get(entry_name(meta["vault_id"], meta["rotating_from"]))
    assert old_key is not None
    first = sql(pg_url, "SELECT min(id) AS id FROM agent_messages")[0]["id"]
    sealed = json.loads(crypto.Sealer(old_key).seal("s1", {"role": "user", "content": "turn 0"}))
    compact = json.dumps(dict(reversed(list(sealed.items()))), separators=(",", ":"))
    sql(
        pg_url,
        "ALTER TABLE agent_messages DISABLE TRIGGER USER",
        "UPDATE agent_messages SET message_data = $1 WHERE id = $2",
        args=(compact, first),
    )
    sql(pg_url, "ALTER TABLE agent_messages ENABLE TRIGGER USER")

    r = run_cli("--db", pg_url, "--json", "rotate")

    assert r.code == 0, r
    assert r.json()["stragglers"] == 1, r.json()
    assert set(raw_kids(pg_url)) == {meta["kid"]}
    shown = run_cli("--db", pg_url, "--json", "show", "s1")
    assert shown.code == 0, shown
    assert [i["content"] for i in shown.json()["items"]] == [f"turn {i}" for i in range(600)]


def test_a_schema_name_with_capitals_holds_a_vault_from_init_to_shred() -> None:
    import secrets

    from tests.pgserver import sql

    schema = "Team_" + secrets.token_hex(4)
    url = f"{SERVER_URL}?schema={schema}"
    try:
        r = run_cli("--db", url, "init")
        assert r.code == 0, r
        r = run_cli("--db", url, "--json", "status")
        assert r.code == 0 and r.json()["schema"] == schema, r
        r = run_cli("--db", url, "--json", "shred", "--yes")
        assert r.code == 0, r
        assert r.json()["schema_dropped"] is True, r.json()
    finally:
        sql(SERVER_URL, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_a_host_that_joined_during_a_rotation_reads_every_row_with_the_kit_made_meanwhile(
    pg_url: str, tmp_path: Path
) -> None:
    """A cut-off rotation blocks nothing: the kit exported meanwhile carries both key
    versions, so a new host reads the rows not yet moved as well as the moved ones."""
    from tests.postgres.test_postgres_admin import host_b_env, write
    from vault.engines.postgres.vault import PgVault

    PgVault.init(pg_url, ttl=3600)
    write(pg_url, "s1", [f"m{i}" for i in range(600)])  # more than one batch of 500
    cut = run_cli("--db", pg_url, "rotate", env={"MEMVAULT_FAILPOINT": "pg-rotate-after-batch"})
    assert cut.code == -9, cut
    pw = tmp_path / "passphrase"
    pw.write_text("correct horse battery staple\n")
    pw.chmod(0o600)
    kit = tmp_path / "kit.json"
    r = run_cli("--db", pg_url, "key", "export", "--passphrase-file", str(pw), str(kit))
    assert r.code == 0, r
    # Host C is new: the kit is all it has.
    c = host_b_env(tmp_path)
    r = run_cli("--db", pg_url, "key", "import", "--passphrase-file", str(pw), str(kit), env=c)
    assert r.code == 0, r
    r = run_cli("--db", pg_url, "--json", "show", "s1", env=c)  # some rows not yet moved
    assert r.code == 0 and len(r.json()["items"]) == 600, r
    # Once the rotation is finished, host C still reads everything.
    assert run_cli("--db", pg_url, "rotate").code == 0
    r = run_cli("--db", pg_url, "--json", "show", "s1", env=c)
    assert r.code == 0 and len(r.json()["items"]) == 600, r


def test_a_shred_refused_a_privilege_after_destroying_the_key_does_not_say_nothing_changed(
    pg_url: str,
) -> None:
    from tests.pgserver import entries_left, sql
    from tests.postgres.test_postgres_admin import write
    from vault.engines.postgres.vault import PgVault

    PgVault.init(pg_url, ttl=3600)
    write(pg_url, "s1", ["doomed"])
    # A role without DELETE on the messages (the owner takes its own away to play one).
    sql(pg_url, "REVOKE DELETE ON agent_messages FROM CURRENT_USER")
    r = run_cli("--db", pg_url, "shred", "--yes")
    assert r.code == 1, r
    assert not any(entries_left(pg_url).values())  # the keys went first, as designed
    assert "nothing was changed" not in r.err, r.err
    assert "memvault shred" in r.err and len(r.err.strip().splitlines()) == 1, r.err
    sql(pg_url, "GRANT DELETE ON agent_messages TO CURRENT_USER")
    again = run_cli("--db", pg_url, "--json", "shred", "--yes")
    assert again.code == 0 and again.json()["resumed"] is True, again


def test_a_rotation_refused_a_privilege_after_its_switch_says_how_to_finish(pg_url: str) -> None:
    from tests.pgserver import sql
    from tests.postgres.test_postgres_admin import write
    from vault.engines.postgres.vault import PgVault

    PgVault.init(pg_url, ttl=3600)
    write(pg_url, "s1", ["kept"])
    sql(pg_url, "REVOKE UPDATE ON agent_messages FROM CURRENT_USER")
    r = run_cli("--db", pg_url, "rotate")
    assert r.code == 1, r
    meta = dict(sql(pg_url, "SELECT key, value FROM memvault_meta"))
    assert "rotating_from" in meta  # the switch committed: something did change
    assert "nothing was changed" not in r.err, r.err
    assert "memvault rotate" in r.err and len(r.err.strip().splitlines()) == 1, r.err
    sql(pg_url, "GRANT UPDATE ON agent_messages TO CURRENT_USER")
    assert run_cli("--db", pg_url, "rotate").code == 0
    shown = run_cli("--db", pg_url, "--json", "show", "s1")
    assert shown.code == 0 and shown.json()["items"][0]["content"] == "kept", shown


def test_a_revoke_refused_a_privilege_after_its_mark_does_not_say_nothing_changed(
    pg_url: str,
) -> None:
    from tests.pgserver import entries_left, sql
    from vault.engines.postgres.vault import PgVault

    PgVault.init(pg_url, ttl=3600)
    sql(pg_url, "REVOKE UPDATE ON memvault_keys FROM CURRENT_USER")
    r = run_cli("--db", pg_url, "revoke", "--yes")
    assert r.code == 1, r
    assert not any(entries_left(pg_url).values())
    assert "nothing was changed" not in r.err, r.err
    assert "memvault revoke" in r.err and len(r.err.strip().splitlines()) == 1, r.err
    sql(pg_url, "GRANT UPDATE ON memvault_keys TO CURRENT_USER")
    assert run_cli("--db", pg_url, "revoke", "--yes").code == 0
