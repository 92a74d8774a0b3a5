"""The commands as a person runs them: real subprocesses, real keyring, real SQLite."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import keyring
import pytest

from tests.conftest import (
    add_items,
    assistant,
    authenticated_counts,
    insert_sealed,
    key_entry,
    keyring_entries,
    raw_bytes,
    rows,
    run_cli,
    user,
)
from vault import Vault


def all_commands() -> list[str]:
    """Every command and subcommand the `memvault` group has, walked from Click itself,
    so a new command cannot miss its --help test."""
    import click

    from vault.cli import cli

    def walk(group: click.Group, prefix: str) -> list[str]:
        out = []
        for name, cmd in sorted(group.commands.items()):
            out.append(prefix + name)
            if isinstance(cmd, click.Group):
                out += walk(cmd, prefix + name + " ")
        return out

    return walk(cli, "")


COMMANDS = all_commands()


def test_the_command_list_is_walked_from_the_group() -> None:
    # A walk that found nothing would make the --help test below pass vacuously.
    assert {"init", "status", "rotate", "shred", "key", "key list", "key import"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command_has_an_example(command: str) -> None:
    r = run_cli(*command.split(), "--help")
    assert r.code == 0, r
    assert "Usage: memvault " + command in r.out
    assert "Example" in r.out
    assert r.err == ""


def test_top_level_help_and_version() -> None:
    r = run_cli("--help")
    assert r.code == 0
    for command in COMMANDS:
        if " " not in command:
            assert f"  {command}" in r.out
    v = run_cli("--version")
    assert v.code == 0 and "memvault, version" in v.out


def test_init_creates_private_files_and_a_keyring_key(vault_db: Path) -> None:
    r = run_cli("--json", "init", "--ttl", "12h")
    assert r.code == 0, r
    info = r.json()
    assert info["ttl"] == "12h" and info["kid"].startswith("mv1:")
    add_items(vault_db, "s", [user("x")])
    import sqlite3

    live = sqlite3.connect(vault_db)  # an open WAL connection keeps -wal and -shm on disk
    live.execute("SELECT count(*) FROM agent_messages").fetchone()
    try:
        assert stat.S_IMODE(vault_db.parent.stat().st_mode) == 0o700
        for suffix in ("", "-wal", "-shm"):
            p = vault_db.with_name(vault_db.name + suffix)
            assert p.exists(), p
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    finally:
        live.close()
    key = keyring.get_password("memvault", f"{info['vault_id']}/{info['kid']}")
    assert key and Vault.open(vault_db).sealer().kid == info["kid"]
    # The key is nowhere in the file, nor in what init printed.
    assert key.encode() not in raw_bytes(vault_db)
    assert key not in r.out + r.err


def test_init_refuses_an_existing_vault_and_changes_nothing(vault: Any, vault_db: Path) -> None:
    before = raw_bytes(vault_db)
    key = keyring.get_password("memvault", key_entry(vault))
    r = run_cli("init")
    assert r.code == 1
    assert "already exists" in r.err and len(r.err.strip().splitlines()) == 1
    assert raw_bytes(vault_db) == before
    assert keyring.get_password("memvault", key_entry(vault)) == key


def test_init_refuses_to_overwrite_another_file(vault_db: Path) -> None:
    vault_db.parent.mkdir()
    vault_db.write_text("my notes")
    r = run_cli("init")
    assert r.code == 1 and "not a memvault vault" in r.err
    assert vault_db.read_text() == "my notes"


def test_db_option_env_and_default(tmp_path: Path, vault_db: Path) -> None:
    other = tmp_path / "other.db"
    assert run_cli("--db", str(other), "init").code == 0
    assert other.exists() and not vault_db.exists()
    # --db after the command works too.
    assert run_cli("status", "--db", str(other)).code == 0
    # With no --db and no MEMVAULT_DB, the platformdirs data folder under HOME.
    env = {"MEMVAULT_DB": "", "XDG_DATA_HOME": str(tmp_path / "xdg")}
    r = run_cli("--json", "init", env=env)
    assert r.code == 0, r
    assert r.json()["path"] == str(tmp_path / "xdg" / "memvault" / "history.db")
    for db in (other, tmp_path / "xdg" / "memvault" / "history.db"):
        assert run_cli("--db", str(db), "shred", "--yes").code == 0


def test_status_and_sessions_count_items_and_expired_by_timestamp_unverified(
    vault: Any, vault_db: Path
) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "a", [user("fresh 1"), user("fresh 2")], now)
    insert_sealed(vault_db, "a", [user("old")], now - 7200)  # ttl is 1h
    insert_sealed(vault_db, "b", [user("b fresh")], now)
    # An unreadable row: a valid-looking envelope whose token was tampered with.
    import sqlite3

    conn = sqlite3.connect(vault_db)
    with conn:
        data = json.loads(rows(vault_db, "b")[0])
        data["payload"] = data["payload"][:-8] + ("A" * 8)
        conn.execute(
            "UPDATE agent_messages SET message_data = ? WHERE session_id = 'b'", (json.dumps(data),)
        )
    conn.close()
    st = run_cli("--json", "status").json()
    # Counted without authenticating: the tampered item kept its timestamp, so it counts
    # as an item that has not expired; the output says the counts are unverified.
    assert (st["items"], st["expired_unverified"]) == (4, 1)
    assert "unverified" in st["counts"] and "memvault verify" in st["counts"]
    assert "readable" not in st and "unreadable" not in st
    assert st["key"] == "present and matching" and st["sessions"] == 2
    assert st["files"]["history.db"]["mode"] == "0o600"
    ss = {s["session_id"]: s for s in run_cli("--json", "sessions").json()}
    assert (ss["a"]["items"], ss["a"]["expired_unverified"]) == (3, 1)
    assert (ss["b"]["items"], ss["b"]["expired_unverified"]) == (1, 0)
    human = run_cli("status")
    assert "4 items in 2 sessions, 1 expired by their timestamps" in human.out
    assert "unverified counts: `memvault verify` authenticates every item" in human.out
    human = run_cli("sessions")
    assert "unverified" in human.out and "memvault verify" in human.out
    # Reading authenticates: the tampered item is found there.
    assert authenticated_counts(vault_db) == (2, 1, 1)
    assert run_cli("show", "b").code == 1


def test_show_pop_and_limit(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one"), assistant("two"), user("three")])
    r = run_cli("show", "s")
    assert r.code == 0
    assert r.out.splitlines() == ["#1 user: one", "#2 assistant: two", "#3 user: three"]
    assert run_cli("--json", "show", "s", "--limit", "2").json()["items"] == [
        assistant("two"),
        user("three"),
    ]
    r = run_cli("--json", "pop", "s", "-n", "2")
    assert r.code == 0 and r.json()["popped"] == [user("three"), assistant("two")]
    assert run_cli("--json", "show", "s").json()["items"] == [user("one")]


def test_pop_refuses_an_item_that_does_not_authenticate(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one"), user("two")])
    import sqlite3

    conn = sqlite3.connect(vault_db)
    with conn:
        row_id, data = conn.execute(
            "SELECT id, message_data FROM agent_messages ORDER BY id DESC LIMIT 1"
        ).fetchone()
        env = json.loads(data)
        env["payload"] = env["payload"][:-4] + "AAAA"
        conn.execute(
            "UPDATE agent_messages SET message_data = ? WHERE id = ?", (json.dumps(env), row_id)
        )
    conn.close()
    before = rows(vault_db)
    r = run_cli("pop", "s")
    assert r.code == 1 and "does not authenticate" in r.err
    assert rows(vault_db) == before


def test_clear_asks_unless_yes_and_spares_other_sessions(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("secret-one")])
    add_items(vault_db, "t", [user("keep me")])
    r = run_cli("clear", "s")  # no terminal, no --yes: the question gets no answer
    assert r.code == 1 and "aborted" in r.err
    assert r.err.splitlines()[-1].startswith("memvault: error: aborted"), r.err
    assert len(rows(vault_db, "s")) == 1
    r = run_cli("clear", "s", input="y\n")
    assert r.code == 0, r
    assert rows(vault_db, "s") == []
    assert run_cli("--json", "show", "t").json()["items"] == [user("keep me")]
    assert run_cli("show", "s").code == 1  # unknown now


def test_ttl_print_and_set(vault: Any) -> None:
    assert run_cli("ttl").out.strip() == "ttl 1h"
    assert run_cli("ttl", "2w").code == 0
    assert run_cli("--json", "ttl").json() == {"ttl": "2w", "ttl_seconds": 1209600}
    assert run_cli("ttl", "never").code == 0
    assert run_cli("--json", "ttl").json()["ttl_seconds"] is None


def test_purge_deletes_only_authenticated_expired_items(vault: Any, vault_db: Path) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "s", [user("old-1"), user("old-2")], now - 7200)
    insert_sealed(vault_db, "s", [user("new")], now)
    # An expired-looking row under another key: not ours to judge, so it stays.
    from vault.crypto import Sealer, generate_key

    foreign = Sealer(generate_key()).seal("s", user("foreign"), now - 7200)
    import sqlite3

    conn = sqlite3.connect(vault_db)
    with conn:
        env = json.loads(foreign)
        env["kid"] = vault.sealer().kid  # pass the trigger; still unreadable under our key
        conn.execute(
            "INSERT INTO agent_messages (session_id, message_data, chain) VALUES ('s', ?, 'x')",
            (json.dumps(env),),
        )
    conn.close()
    r = run_cli("--json", "purge", "--yes")
    assert r.code == 0, r
    assert r.json()["deleted"] == 2 and r.json()["kept"] == 1 and r.json()["unreadable"] == 1
    left = rows(vault_db, "s")
    assert len(left) == 2 and json.dumps(env) in left
    assert b"old-1" not in raw_bytes(vault_db)


def test_log_records_events_without_content(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("private words")])
    run_cli("ttl", "2h")
    run_cli("clear", "s", "--yes")
    events = [e["event"] for e in run_cli("--json", "log").json()]
    assert events == ["init", "ttl", "clear"]
    assert "private words" not in run_cli("log").out


def test_shred_removes_key_rows_and_files(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "s", [user("to be destroyed")])
    vid = vault.vault_id
    receipt = tmp_path / "receipt.json"
    r = run_cli("--json", "shred", "--yes", "--receipt", str(receipt))
    assert r.code == 0, r
    rep = r.json()
    assert rep["items"] == 1 and rep["key_destroyed"] is True
    assert {f["name"] for f in rep["files"]} >= {"history.db"}
    assert not any(
        vault_db.with_name(vault_db.name + s).exists() for s in ("", "-wal", "-shm", "-journal")
    )
    assert keyring_entries(vid) == {}
    assert json.loads(receipt.read_text())["vault_id"] == vid
    assert stat.S_IMODE(os.stat(receipt).st_mode) == 0o600


def test_shred_asks_first(vault: Any, vault_db: Path) -> None:
    r = run_cli("shred")
    assert r.code == 1 and "aborted" in r.err
    assert vault_db.exists() and keyring.get_password("memvault", key_entry(vault))


@pytest.mark.parametrize("args", [["rotate"], ["purge", "--yes"], ["shred", "--yes"]])
def test_long_work_shows_a_progress_bar_on_a_terminal(
    vault: Any, vault_db: Path, args: list[str]
) -> None:
    from tests.conftest import run_on_terminal

    now = int(time.time())
    insert_sealed(vault_db, "s", [user(f"item {i}") for i in range(300)], now - 7200)
    code, out = run_on_terminal(args, [])
    assert code == 0, out
    assert b"100%" in out, out
    # Without a terminal there is no bar (nothing on stderr to parse around).
    assert run_cli("--db", str(vault_db), "status").err == "" or args == ["shred", "--yes"]
