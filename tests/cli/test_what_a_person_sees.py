"""What a person (or a script) sees: help, global options on either side of the
command, one timestamp and TTL format, plurals, prompts that name what they touch,
and a JSON document for failures under --json."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import add_items, assistant, insert_sealed, raw_bytes, run_cli, user

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


@pytest.mark.parametrize(("args", "first_command"), [((), "chat"), (("key",), "export")])
def test_a_group_alone_prints_its_help(args: tuple[str, ...], first_command: str) -> None:
    r = run_cli(*args)
    assert r.code == 0, r
    assert r.err == ""
    assert r.out.startswith("Usage: memvault")
    assert "\nCommands:\n" in r.out and f"\n  {first_command} " in r.out
    assert len(r.out.splitlines()) > 10  # the normal help, not one squashed line


@pytest.mark.parametrize(
    "args",
    [
        ("status", "--version"),
        ("show", "s", "--version"),
        ("key", "export", "--version"),
        ("key", "--version"),
        ("--version", "status"),
    ],
)
def test_version_works_on_either_side_of_the_command(args: tuple[str, ...]) -> None:
    r = run_cli(*args)
    assert r.code == 0, r
    assert r.out.startswith("memvault, version "), r


def test_global_options_after_the_command(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    assert run_cli("init", "--db", str(other), "--json").json()["path"] == str(other)
    assert run_cli("key", "export", "--help").out.startswith("Usage: memvault key export")
    assert run_cli("shred", "--yes", "--db", str(other)).code == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("demo", "--json"), "--json does not apply to `demo`"),
        (("--json", "demo"), "--json does not apply to `demo`"),
        (("demo", "--db", "x.db"), "--db does not apply to `demo`"),
        (("--db", "x.db", "demo"), "--db does not apply to `demo`"),
        (("chat", "s", "--json"), "--json does not apply to `chat`"),
        (("--json", "chat", "s"), "--json does not apply to `chat`"),
    ],
)
def test_demo_and_chat_refuse_options_they_cannot_honour(
    args: tuple[str, ...], needle: str
) -> None:
    r = run_cli(*args, env={"OPENAI_API_KEY": "sk-not-used"}, timeout=60)
    assert r.code == 2, r
    assert r.err.startswith(f"memvault: error: {needle}") and r.err.count("\n") == 1, r
    if "--json" in args:
        assert json.loads(r.out)["exit_code"] == 2


def test_show_says_how_many_items_the_ttl_hides(vault: Any, vault_db: Path) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "old", [user("a"), assistant("b")], now - 7200)  # ttl is 1h
    r = run_cli("show", "old")
    assert r.code == 0, r
    assert r.out == (
        "2 expired items hidden by the TTL (1h); `memvault purge` deletes them, "
        "--include-expired shows them\n"
    )
    insert_sealed(vault_db, "mixed", [user("gone")], now - 7200)
    insert_sealed(vault_db, "mixed", [user("here")], now)
    r = run_cli("show", "mixed")
    assert r.out.splitlines() == [
        "#2 user: here",
        "1 expired item hidden by the TTL (1h); `memvault purge` deletes them, "
        "--include-expired shows them",
    ]


def test_sessions_use_the_one_timestamp_format(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    (row,) = run_cli("--json", "sessions").json()
    assert ISO.match(row["updated_at"]), row
    line = run_cli("sessions").out.splitlines()[1]
    assert ISO.match(line.split()[-1]), line
    rotated = run_cli("--json", "status").json()["rotated_at"]
    assert rotated is None or ISO.match(rotated)
    assert all(ISO.match(e["at"]) for e in run_cli("--json", "log").json())


def test_log_shows_ttls_as_durations(vault: Any) -> None:
    assert run_cli("ttl", "2d").code == 0
    assert run_cli("ttl", "never").code == 0
    events = [e for e in run_cli("--json", "log").json() if e["event"] == "ttl"]
    assert [(e["old"], e["new"]) for e in events] == [("1h", "2d"), ("2d", "never")]
    human = [ln for ln in run_cli("log").out.splitlines() if " ttl " in ln]
    assert "old=1h" in human[0] and "new=2d" in human[0], human
    assert "old=2d" in human[1] and "new=never" in human[1], human


def test_one_is_singular(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one"), assistant("two")])
    assert "2 items in 1 session, 0 expired" in run_cli("status").out
    assert run_cli("pop", "s").out == "removed 1 item from s\n"
    r = run_cli("rotate")
    assert r.out.startswith("rotated 1 item in 1 session in "), r


def test_a_second_revoke_says_already_revoked(vault: Any) -> None:
    first = run_cli("revoke", "--yes")
    assert first.code == 0 and first.out.startswith("revoked key "), first
    second = run_cli("revoke", "--yes")
    assert second.code == 0, second
    assert "was already revoked" in second.out and not second.out.startswith("revoked key")
    doc = run_cli("--json", "revoke", "--yes").json()
    assert doc["already_revoked"] is True


def test_prompts_name_the_vault_and_the_count(vault: Any, vault_db: Path) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "s", [user("a"), user("b"), user("c")], now - 7200)
    insert_sealed(vault_db, "s", [user("d")], now)
    before = raw_bytes(vault_db)
    r = run_cli("purge", input="n\n")
    assert r.code == 1, r
    assert f"Delete the 3 expired items of the vault {vault_db} for good?" in r.err
    r = run_cli("revoke", input="n\n")
    assert r.code == 1, r
    assert f"Destroy the key of the vault {vault_db}?" in r.err
    assert raw_bytes(vault_db) == before and vault.sealer(refresh=True)


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("--json", "show", "nosuch"), 1, "no session 'nosuch'"),
        (("show", "nosuch", "--json"), 1, "no session 'nosuch'"),
        (("--json", "pop", "s", "-n", "0"), 2, "Invalid value for '-n'"),
        (("--json", "bogus"), 2, "No such command 'bogus'"),
        (("--json", "--db", "", "status"), 2, "the vault path is empty"),
    ],
)
def test_json_failures_print_a_json_document(
    vault: Any, args: tuple[str, ...], code: int, needle: str
) -> None:
    r = run_cli(*args)
    assert r.code == code, r
    doc = json.loads(r.out)
    assert doc["exit_code"] == code and needle in doc["error"], doc
    assert r.err == f"memvault: error: {doc['error']}\n"


def test_without_json_failures_print_nothing_on_stdout(vault: Any) -> None:
    r = run_cli("show", "nosuch")
    assert r.code == 1 and r.out == "", r
