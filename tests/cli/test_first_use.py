"""What a new user meets first: units on durations, a question before a pop empties a
session, an honest "never rotated", one numbering of items, help that says what it means.

Each test runs the real `memvault` CLI in a subprocess against the real keyring.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, add_items, assistant, insert_sealed, rows, run_cli, user


def one_line(r: Any, code: int, needle: str) -> None:
    assert r.code == code, r
    assert r.err.startswith("memvault: error: ") and r.err.count("\n") == 1, r
    assert "Traceback" not in r.err and needle in r.err, r


# -- durations ------------------------------------------------------------------


@pytest.mark.parametrize("bare", ["1", "3600", " 30 "])
def test_a_number_without_a_unit_is_not_a_ttl(vault: Any, bare: str) -> None:
    r = run_cli("ttl", bare)
    one_line(r, 2, "has no unit")
    n = bare.strip()
    assert f"{n}s" in r.err and f"{n}d" in r.err and "never" in r.err, r
    assert run_cli("--json", "ttl").json()["ttl"] == "1h"  # unchanged


def test_init_refuses_a_ttl_without_a_unit_and_creates_nothing(vault_db: Path) -> None:
    one_line(run_cli("init", "--ttl", "60"), 2, "has no unit")
    assert not vault_db.exists() and not vault_db.parent.exists()
    assert run_cli("init", "--ttl", "60s").code == 0
    assert run_cli("--json", "ttl").json()["ttl_seconds"] == 60


# -- status -----------------------------------------------------------------------

STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def test_status_says_never_until_the_first_rotation(vault_db: Path) -> None:
    assert run_cli("init").code == 0
    assert run_cli("--json", "status").json()["rotated_at"] is None
    assert "rotated    never" in run_cli("status").out.splitlines()
    # Often within init's second: the audit trail, not the time, tells the two apart.
    assert run_cli("rotate").code == 0
    rotated = run_cli("--json", "status").json()["rotated_at"]
    assert rotated is not None and STAMP.match(rotated), rotated
    assert f"rotated    {rotated}" in run_cli("status").out.splitlines()


# -- pop --------------------------------------------------------------------------


def test_pop_asks_before_it_empties_a_session(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one"), assistant("two")])
    before = rows(vault_db, "s")
    r = run_cli("pop", "s", "-n", "100")  # no terminal, no --yes: the question gets no answer
    assert r.code == 1 and r.err.startswith("Remove all 2 items of session 's', emptying it?")
    assert r.err.splitlines()[-1].startswith("memvault: error: aborted; nothing was changed"), r
    assert rows(vault_db, "s") == before
    r = run_cli("pop", "s", "-n", "100", input="y\n")
    assert r.code == 0, r
    assert r.out == "removed 2 items from s (asked for 100: it had no more)\n", r
    assert rows(vault_db, "s") == []


def test_pop_with_yes_empties_without_asking_and_says_how_many(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one"), assistant("two")])
    r = run_cli("--json", "pop", "s", "-n", "2", "--yes")
    assert r.code == 0, r
    doc = r.json()
    assert doc["popped"] == [assistant("two"), user("one")] and doc["requested"] == 2
    assert rows(vault_db, "s") == []


def test_pop_short_of_the_whole_session_does_not_ask(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one"), assistant("two"), user("three")])
    r = run_cli("pop", "s", "-n", "2")
    assert r.code == 0 and r.out == "removed 2 items from s\n" and r.err == "", r
    assert len(rows(vault_db, "s")) == 1


# -- show -------------------------------------------------------------------------


def test_show_numbers_items_as_export_and_search_do(vault: Any, vault_db: Path) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "s", [user("old one")], now - 7200)  # the vault's TTL is 1h
    add_items(vault_db, "s", [user("alpha"), assistant("beta"), user("gamma")])
    r = run_cli("show", "s")
    assert r.code == 0, r
    assert r.out.splitlines()[:3] == ["#2 user: alpha", "#3 assistant: beta", "#4 user: gamma"]
    found = run_cli("search", "beta").out.split()[1]
    assert found == "#3"
    exported = run_cli("export", "s", "--include-expired", "-o", "-").out.splitlines()
    assert [line.count('"position": ') for line in exported] == [1, 1, 1, 1]
    assert '"position": 3' in exported[2] and "beta" in exported[2]
    assert run_cli("show", "s", "--limit", "2").out.splitlines() == [
        "#3 assistant: beta",
        "#4 user: gamma",
    ]
    assert run_cli("--json", "show", "s", "--limit", "2").json()["positions"] == [3, 4]


def test_show_include_expired_shows_and_marks_expired_items(vault: Any, vault_db: Path) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "s", [user("old one")], now - 7200)
    add_items(vault_db, "s", [user("fresh")])
    hidden = run_cli("show", "s").out.splitlines()
    assert hidden[0] == "#2 user: fresh" and "--include-expired shows them" in hidden[1], hidden
    r = run_cli("show", "s", "--include-expired")
    assert r.code == 0 and r.out.splitlines() == ["#1 (expired) user: old one", "#2 user: fresh"]
    doc = run_cli("--json", "show", "s", "--include-expired").json()
    assert doc["items"] == [user("old one"), user("fresh")] and doc["expired"] == 1


def test_show_says_when_a_session_is_empty(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one")])
    assert run_cli("pop", "s", "--yes").code == 0
    r = run_cli("show", "s")
    assert r.code == 0 and r.out == "session s is empty\n", r


# -- help texts -------------------------------------------------------------------


def helps() -> dict[str, str]:
    """Every command's --help, rendered by Click in this process (test_cli runs each one
    as a subprocess)."""
    import click

    from tests.cli.test_cli import COMMANDS
    from vault.cli import cli

    out = {}
    for command in ["", *COMMANDS]:
        args = command.split()
        with cli.make_context("memvault", [*args, "--help"], resilient_parsing=True) as ctx:
            sub: click.Context = ctx
            for name in args:
                group = sub.command
                assert isinstance(group, click.Group)
                cmd = group.get_command(sub, name)
                assert cmd is not None
                sub = click.Context(cmd, parent=sub, info_name=name)
            out[command or "memvault"] = sub.get_help()
    assert len(out) > 20
    return out


def test_every_db_option_takes_a_file_or_a_postgresql_url() -> None:
    for command, text in helps().items():
        assert "Vault file" not in text, command
        if "--db PATH" in text:
            assert "a file, or a postgresql:// URL" in " ".join(text.split()), command
    top = " ".join(helps()["memvault"].split())
    assert "SQLite file, or a PostgreSQL database" in top, top


def test_help_shows_counts_as_a_readable_range() -> None:
    texts = helps()
    for command, text in texts.items():
        assert "9223372036854775807" not in text, command
    assert "[x>=1]" in texts["show"] and "[default: 1; x>=1]" in texts["pop"]
    one_line(run_cli("show", "s", "--limit", str(2**63)), 2, "is not in the range")


def test_help_leaves_out_the_options_a_command_refuses() -> None:
    options = {c: text.split("\nOptions:\n", 1)[1] for c, text in helps().items()}
    for command in ("demo", "completion"):
        assert "--db" not in options[command] and "--json" not in options[command], command
    assert "--json" not in options["chat"] and "--db" in options["chat"]
    assert "--db" in options["status"] and "--json" in options["status"]
    one_line(run_cli("demo", "--db", "x.db"), 2, "--db does not apply to `demo`")


def test_demo_help_names_its_four_checks() -> None:
    text = " ".join(helps()["demo"].split())
    for check in ("1. write:", "2. recall:", "a new process", "3. clear:", "4. negative control:"):
        assert check in text, text
    assert "guide" not in text


def test_every_command_that_can_ask_takes_yes(vault: Any) -> None:
    import inspect

    import click

    from tests.cli.test_cli import COMMANDS
    from vault.cli import cli

    asking = []
    for command in COMMANDS:
        cmd: Any = cli
        for name in command.split():
            cmd = cmd.commands[name]
        if isinstance(cmd, click.Group):
            continue
        source = inspect.getsource(inspect.getmodule(cmd.callback))  # type: ignore[arg-type]
        body = inspect.getsource(cmd.callback)
        helpers = re.findall(r"\b(_\w+)\(", body)  # the command's own helpers ask too
        texts = [body] + [
            inspect.getsource(getattr(inspect.getmodule(cmd.callback), h))
            for h in helpers
            if f"def {h}(" in source
        ]
        if any("confirm(" in t for t in texts) or command == "rotate":
            asking.append(command)
            assert "yes" in {p.name for p in cmd.params}, command
    assert {"pop", "clear", "purge", "rotate", "revoke", "shred", "import"} <= set(asking)
    r = run_cli("--json", "rotate", "--yes")
    assert r.code == 0 and r.json()["items"] == 0, r


# -- scripts ----------------------------------------------------------------------


@pytest.mark.secret_service
def test_headless_shows_the_commands_stderr_and_not_the_bus_chatter(
    tmp_path: Path, short_tmp: Path
) -> None:
    # As root (this suite's usual machine), dbus-daemon cannot raise its fd limit and
    # said so on every run.
    from tests.scripts.test_headless import PASSPHRASE, SCRIPT

    home, scratch, passfile = tmp_path / "home", short_tmp, tmp_path / "pass"
    home.mkdir(mode=0o700)
    passfile.write_text(PASSPHRASE)
    passfile.chmod(0o600)
    env = {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "TMPDIR": str(scratch),
        "LANG": "C.UTF-8",
        "MEMVAULT_KEYRING_PASSFILE": str(passfile),
    }
    proc = subprocess.run(
        [str(SCRIPT), "status"], input="", capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 3, proc
    assert proc.stderr.startswith("memvault: error: no vault at "), proc.stderr
    assert proc.stderr.count("\n") == 1 and "fd limit" not in proc.stderr, proc.stderr
    assert list(scratch.iterdir()) == []  # the bus's stderr file went with its folder


def test_the_test_run_lists_each_skip_reason_once_with_its_count() -> None:
    # Without a server every test of that file is skipped, for one reason.
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_TEST_POSTGRES_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/postgres/test_first_use_on_postgres.py"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    skipped = [ln for ln in proc.stdout.splitlines() if "SKIPPED" in ln]
    assert len(skipped) == 1, proc.stdout
    # The count is the file's own number of tests, as pytest reports it: one line for all.
    tests = int(re.search(r"(\d+) skipped", proc.stdout).group(1))  # type: ignore[union-attr]
    assert tests > 1, proc.stdout
    assert skipped[0].startswith(f"SKIPPED {tests}: needs a PostgreSQL server"), skipped
