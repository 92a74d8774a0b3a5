"""Hypothesis drives the CLI with generated arguments and environment values.

Whatever it generates (session ids, counts, durations, lock timeouts, paths that are
empty, missing, a folder, a FIFO, a symlink, not UTF-8), no run may end in
"unexpected error" or a traceback, and every exit code is a documented one.

Most examples run in-process (Click's CliRunner, fast); a smaller sample runs the
real `python -m vault` in subprocesses. Every path is inside the test's temporary
folder, and the commands that destroy a vault (`revoke`, `shred`) never get --yes,
so the fuzz cannot touch anything outside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, add_items, assistant, user

DOCUMENTED = {0, 1, 2, 3, 4, 5}


class World:
    """A vault with two sessions and the awkward paths around it, all in one tmp folder."""

    def __init__(self, root: Path) -> None:
        from vault import Vault

        self.root = root
        self.db = root / "vault" / "history.db"
        Vault.init(self.db, ttl=3600)
        add_items(self.db, "s1", [user("hello"), assistant("hi")])
        add_items(self.db, "s2", [user("x")])
        (root / "folder").mkdir()
        os.mkfifo(root / "fifo")
        (root / "text.txt").write_text("not a database\n")
        (root / "empty").write_bytes(b"")
        (root / "link").symlink_to(self.db)
        (root / "dangling").symlink_to(root / "nowhere")
        self.paths = [
            "",
            str(root / "missing.db"),
            str(root / "folder"),
            str(root / "fifo"),
            str(root / "text.txt"),
            str(root / "empty"),
            str(root / "link"),
            str(root / "dangling"),
            str(self.db),
            # The vault's side files, as written over by a careless -o or DEST
            str(self.db) + "-wal",
            str(self.db) + "-shm",
            str(root / "folder" / ".." / "vault" / "history.db-journal"),
            str(root / "bad\udcff.db"),
            str(root / "missing-dir" / "x.db"),
        ]

    def env(self, extra: dict[str, str | None]) -> dict[str, str | None]:
        base: dict[str, str | None] = {
            "MEMVAULT_DB": str(self.db),
            "XDG_DATA_HOME": str(self.root / "xdg"),  # the "default vault", inside tmp
            "MEMVAULT_LOCK_TIMEOUT": "2",
            "OPENAI_API_KEY": None,
            "MEMVAULT_FAILPOINT": None,
            "MEMVAULT_PAUSEPOINT": None,
            "MEMVAULT_CHAT_TEST_MODEL": None,
        }
        base.update(extra)
        return base


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with tempfile.TemporaryDirectory(prefix="memvault-fuzz-") as tmp:
        w = World(Path(tmp))
        yield w
        from vault.engines.sqlite.vault import shred

        if w.db.exists():
            shred(w.db)


# --------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**90).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["0", "1", "-1", "1e308", "inf", "nan", "0x10", " 3 ", "", "1_000"]),
    ANY_TEXT,
)
DURATIONS = st.one_of(
    st.sampled_from(
        [
            "90s",
            "15m",
            "12h",
            "30d",
            "2w",
            "never",
            "NEVER",
            "0",
            "-1s",
            "1e308",
            "99999999999999999999999999d",
            "5y",
            "",
            " 7d ",
        ]
    ),
    NUMBERS,
)
SESSIONS = st.one_of(st.sampled_from(["s1", "s2", "nosuch", "", " ", "-", "s1\x00"]), ANY_TEXT)


def _world_paths(w: World) -> st.SearchStrategy[str]:
    return st.sampled_from(w.paths)


def command_lines(w: World) -> st.SearchStrategy[list[str]]:
    path = _world_paths(w)
    db = st.tuples(st.just("--db"), path).map(list)
    option = st.one_of(
        st.just(["--json"]),
        db,
        st.just(["--json"]),
        db,
        st.sampled_from([["--version"], ["--help"]]),
    )  # these two end the run
    globals_ = st.lists(option, max_size=2).map(lambda groups: [a for g in groups for a in g])
    commands = st.one_of(
        st.just(["status"]),
        st.just(["sessions"]),
        st.just(["log"]),
        st.just(["rotate"]),
        st.tuples(st.just("show"), SESSIONS).map(list),
        st.tuples(st.just("show"), SESSIONS, st.just("--limit"), NUMBERS).map(list),
        st.tuples(st.just("pop"), SESSIONS, st.just("-n"), NUMBERS).map(list),
        st.tuples(st.just("clear"), SESSIONS).map(list),
        st.tuples(st.just("ttl"), DURATIONS).map(list),
        st.just(["ttl"]),
        st.tuples(st.just("init"), st.just("--ttl"), DURATIONS).map(list),
        st.just(["purge"]),
        st.just(["purge", "--yes"]),
        st.just(["revoke"]),
        st.just(["shred"]),  # no --yes: asked, stdin answers nothing
        st.tuples(st.just("import"), path).map(list),
        st.tuples(st.just("import"), path, st.just("--session"), SESSIONS).map(list),
        st.tuples(st.just("key"), st.just("import"), path).map(list),
        st.tuples(st.just("key"), st.just("export"), path).map(list),
        st.tuples(st.just("backup"), path).map(list),
        st.tuples(st.just("export"), SESSIONS, st.just("-o"), path).map(list),
        st.tuples(st.just("export"), st.just("--all"), st.just("-o"), path, st.just("--force")).map(
            list
        ),
        st.tuples(st.just("key"), st.just("export"), st.just("--force"), path).map(list),
        st.tuples(st.just("shred"), st.just("--receipt"), path).map(list),
        st.just(["verify"]),
        st.tuples(st.just("chat"), SESSIONS).map(list),
        st.just(["demo", "--json"]),
        st.just(["demo", "--db", str(w.db)]),
        st.just([]),
        st.just(["key"]),
        st.just(["bogus"]),
    )
    # One example in four writes a file at a spelling of the vault or a side file.
    vault_file = st.sampled_from([p for p in w.paths if "history.db" in p])
    writes = st.tuples(
        st.sampled_from(
            [
                ["export", "--all", "--force", "-o"],
                ["export", "s1", "-o"],
                ["backup"],
                ["shred", "--receipt"],
                ["import", "--shred-source"],
            ]
        ),
        vault_file,
    ).map(lambda t: [*t[0], t[1]])
    commands = st.one_of(commands, commands, commands, writes)
    return st.tuples(globals_, commands, globals_).map(lambda t: [*t[0], *t[1], *t[2]])


def _settable(value: str | None) -> bool:
    """What an environment can hold: no NUL, surrogates only as escaped bytes."""
    if value is None:
        return True
    try:
        os.fsencode(value)
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


def environments(w: World) -> st.SearchStrategy[dict[str, str | None]]:
    return st.fixed_dictionaries(
        {},
        optional={
            "MEMVAULT_DB": st.one_of(_world_paths(w), st.none()),
            "MEMVAULT_LOCK_TIMEOUT": st.one_of(NUMBERS, st.none()).filter(_settable),
        },
    )


def check(code: int, out: str, err: str, what: Any) -> None:
    event(f"exit {code}")  # shown by --hypothesis-show-statistics
    assert code in DOCUMENTED, (code, what, out, err)
    for text in (out, err):
        assert "unexpected error" not in text, (what, err)
        assert "Traceback" not in text, (what, text)
    if code != 0:
        assert err.rstrip("\n").splitlines()[-1].startswith("memvault: error: "), (what, err)


# --------------------------------------------------------------------------
@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
@pytest.mark.slow
def test_generated_command_lines_in_process(world: World, data: st.DataObject) -> None:
    from vault.cli import cli

    args = data.draw(command_lines(world), label="args")
    env = world.env(data.draw(environments(world), label="env"))
    result = CliRunner().invoke(cli, args, env=env, input="", prog_name="memvault")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError((args, env)) from result.exception
    check(result.exit_code, result.stdout, result.stderr, (args, env))
    # No command here destroys the vault on purpose (no --yes to shred or revoke), and
    # none may write over it: export -o, key export --force, backup, shred --receipt.
    with open(world.db, "rb") as fh:
        assert fh.read(16) == b"SQLite format 3\x00", (args, env)


def _encodable(args: list[str], env: dict[str, str | None]) -> bool:
    """What a real command line and environment can carry: no NUL, and surrogates only
    as the escapes of undecodable bytes."""
    try:
        for a in [*args, *(v for v in env.values() if v is not None)]:
            if "\x00" in a:
                return False
            os.fsencode(a)
    except UnicodeEncodeError:
        return False
    return True


@pytest.mark.slow
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_generated_command_lines_in_subprocesses(world: World, data: st.DataObject) -> None:
    args = data.draw(command_lines(world), label="args")
    env = world.env(data.draw(environments(world), label="env"))
    if not _encodable(args, env):
        return
    full = {k: v for k, v in os.environ.items() if env.get(k, v) is not None}
    full.update({k: v for k, v in env.items() if v is not None})
    proc = subprocess.run(
        [sys.executable, "-m", "vault", *args],
        input="",
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
        cwd=ROOT,
    )
    check(proc.returncode, proc.stdout, proc.stderr, (args, env))
