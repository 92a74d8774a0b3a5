"""Commands that run no agent must not import the Agents SDK (~2 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, add_items, user

PROBE = """
import sys, runpy
sys.argv = ["memvault", *{args!r}]
try:
    runpy.run_module("vault", run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
watch = {watch!r}
loaded = sorted(m for m in sys.modules if any(m == w or m.startswith(w + ".") for w in watch))
sys.stderr.write("\\nAGENTS-MODULES:" + ",".join(loaded) + "\\n")
sys.stderr.write("EXIT:" + str(code) + "\\n")
"""


def probe(
    *args: str, env: dict[str, str] | None = None, watch: tuple[str, ...] = ("agents",)
) -> tuple[int, list[str]]:
    """Run memvault ARGS in a new process: (exit code, the `watch` modules it loaded)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=list(args), watch=list(watch))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    lines = proc.stderr.splitlines()
    mods = next(x for x in lines if x.startswith("AGENTS-MODULES:")).split(":", 1)[1]
    code = next(x for x in lines if x.startswith("EXIT:")).split(":", 1)[1]
    return int(code) if code.isdigit() else 1, [m for m in mods.split(",") if m]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["status"],
        ["sessions"],
        ["ttl"],
        ["ttl", "2h"],
        ["purge", "--yes"],
        ["show", "s1"],
        ["pop", "s1"],
        ["log"],
        ["rotate"],
        ["clear", "s1", "--yes"],
        ["key", "list"],
        ["export", "s1", "-o", "-"],
        ["export", "--all", "--format", "md", "-o", "-"],
        ["search", "hello"],
        ["completion", "bash"],
        ["completion", "zsh"],
        ["completion", "fish"],
        ["verify"],
    ],
)
@pytest.mark.sweep
def test_command_does_not_import_agents(vault: Any, vault_db: Path, args: list[str]) -> None:
    add_items(vault_db, "s1", [user("hello"), user("again")])
    code, mods = probe(*args)
    assert code == 0
    assert mods == []


@pytest.mark.parametrize("command", ["status", "sessions"])
def test_counting_commands_load_only_what_they_use(
    vault: Any, vault_db: Path, command: str
) -> None:
    # Every command pays for what the CLI imports at start; these cost ~35 ms of a
    # ~200 ms `status`: the version string, export/search, and reading a PostgreSQL URL.
    add_items(vault_db, "s1", [user("hello")])
    watch = ("importlib.metadata", "vault.export", "vault.search", "vault.engines.postgres.url")
    code, mods = probe(command, watch=watch)
    assert code == 0
    assert mods == []
    # Controls: the probe sees each of them when a command needs it.
    code, mods = probe("--version", watch=watch)
    assert code == 0 and "importlib.metadata" in mods and "vault.engines.postgres.url" not in mods
    code, mods = probe(
        "--db", "postgresql+asyncpg://u@h/db?schema=not-a-name", command, watch=watch
    )
    assert code == 2 and "vault.engines.postgres.url" in mods


def test_completing_a_session_id_does_not_import_agents(vault: Any, vault_db: Path) -> None:
    # What the installed completion script runs at each TAB.
    add_items(vault_db, "s1", [user("hello")])
    env = {
        "_MEMVAULT_COMPLETE": "bash_complete",
        "COMP_WORDS": "memvault show s",
        "COMP_CWORD": "2",
    }
    code, mods = probe(env=env)
    assert code == 0
    assert mods == []


def test_shred_does_not_import_agents(vault: Any) -> None:
    code, mods = probe("shred", "--yes")
    assert code == 0
    assert mods == []


def test_backup_does_not_import_agents(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "s1", [user("hello")])
    code, mods = probe("backup", str(tmp_path / "backup.db"))
    assert code == 0
    assert mods == []
    assert (tmp_path / "backup.db").exists()


def test_restore_does_not_import_agents(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "s1", [user("hello")])
    code, _ = probe("backup", str(tmp_path / "backup.db"))
    assert code == 0
    code, mods = probe("restore", str(tmp_path / "backup.db"), "--yes")
    assert code == 0
    assert mods == []


def test_accept_does_not_import_agents(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s1", [user("hello")])
    code, mods = probe("accept", "--yes")
    assert code == 0
    assert mods == []


@pytest.mark.slow
def test_probe_detects_an_agents_import(vault: Any) -> None:
    # Control: the probe sees the SDK when a command does load it.
    code, mods = probe("demo", "--help")
    assert code == 0
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE.format(args=["--help"], watch=["agents"]).replace(
                "runpy.run_module", "import agents; runpy.run_module"
            ),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert "AGENTS-MODULES:agents" in proc.stderr


@pytest.mark.parametrize(
    "args", [["--help"], ["status"], ["show", "s1"], ["verify"], ["search", "hello"]]
)
@pytest.mark.sweep
def test_file_vault_commands_do_not_import_the_postgres_driver(
    vault: Any, vault_db: Path, args: list[str]
) -> None:
    # sqlalchemy and asyncpg load only for a PostgreSQL URL.
    add_items(vault_db, "s1", [user("hello")])
    code, mods = probe(*args, watch=("agents", "sqlalchemy", "asyncpg"))
    assert code == 0
    assert mods == []


@pytest.mark.parametrize("args", [["--help"], ["status"], ["key", "list"]])
@pytest.mark.sweep
def test_commands_do_not_import_the_transit_client(
    vault: Any, vault_db: Path, args: list[str]
) -> None:
    # hvac (and requests under it) load only when a transit key is used.
    code, mods = probe(*args, watch=("hvac", "requests", "vault.keysource.transit"))
    assert code == 0
    assert mods == []
    # Control: the probe sees them once the transit source is used.
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=["--help"], watch=["hvac"]).replace(
            "runpy.run_module",
            "from vault.keysource.transit import Transit; "
            "Transit('k', addr='http://127.0.0.1:1')._hvac(); runpy.run_module",
        )],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert "AGENTS-MODULES:hvac" in proc.stderr
