"""No command writes over the vault, and --force replaces only a file of its own kind.

Every command that writes a file (export -o, key export, backup, shred --receipt)
refuses, with exit 2 and before it writes anything, a target that is the vault or its
-wal, -shm or -journal, by any name: absolute, relative, through a symbolic link, a
hard link or a `..` detour, with --force too. An import source that is one of them is
refused the same way.

The headline cases run the real CLI in new processes; the Hypothesis property drives
the Click app in-process over every command and every spelling.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, add_items, run_cli, user

PASS = "correct horse battery staple"
SIDES = ("", "-wal", "-shm", "-journal")


def one_line(r: Any, code: int, *needles: str) -> None:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memvault: error: "), r.err
    assert "Traceback" not in r.err and "unexpected error" not in r.err, r.err
    for n in needles:
        assert n in r.err, (n, r.err)


def digest(db: Path) -> str:
    """The database's bytes and its -wal's: what a write over the vault would change."""
    h = hashlib.sha256()
    for side in ("", "-wal"):
        p = Path(f"{db}{side}")
        h.update(p.read_bytes() if p.exists() else b"<none>")
    return h.hexdigest()


def listing(*folders: Path) -> list[tuple[str, bool]]:
    return sorted((str(p), p.is_symlink()) for folder in folders for p in folder.iterdir())


@pytest.fixture
def filled(vault: Any, vault_db: Path) -> Path:
    add_items(vault_db, "S", [user("remember NORD-17")])
    return vault_db


def still_readable(db: Path) -> None:
    r = run_cli("--db", str(db), "show", "S")
    assert r.code == 0 and "NORD-17" in r.out, r


# --------------------------------------------------------------------------
# The headline scenarios, each in a new process
# --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "side"),
    [
        (["key", "export", "--force", "--passphrase-stdin"], ""),
        (["export", "--all", "--force", "-o"], ""),
        (["export", "S", "-o"], "-wal"),
        (["backup"], "-shm"),
        (["backup"], "-journal"),
        (["backup"], "-wal"),
        (["shred", "--yes", "--receipt"], "-journal"),
        (["import", "--shred-source", "--yes"], ""),
        (["import"], "-journal"),
    ],
)
def test_a_command_never_writes_over_the_vault_or_a_side_file(
    filled: Path, args: list[str], side: str
) -> None:
    target = f"{filled}{side}"
    before = digest(filled)
    existed = os.path.exists(target)
    r = run_cli(*args, target, input=PASS + "\n")
    one_line(r, 2, "the vault's own", "nothing was written")
    assert digest(filled) == before
    assert os.path.exists(target) == existed  # no -journal or -shm left behind either
    still_readable(filled)


@pytest.mark.slow
@pytest.mark.parametrize("name", [".restore-new", ".restore-old"])
@pytest.mark.parametrize(
    "args",
    [
        ["backup"],
        ["export", "--all", "-o"],
        ["key", "export", "--passphrase-stdin"],
        ["--db", "{target}", "init"],
    ],
)
def test_no_command_writes_where_the_vaults_next_open_would_delete_it(
    filled: Path, args: list[str], name: str
) -> None:
    # The next open of the vault takes a file at a restore's names for a cut-off
    # restore's leftover and destroys it: a backup or kit written there would die unseen.
    target = f"{filled}{name}"
    argv = [a.replace("{target}", target) for a in args]
    if "{target}" not in args:
        argv.append(target)
    r = run_cli(*argv, input=PASS + "\n")
    one_line(r, 2, "nothing was written")
    assert not os.path.lexists(target)
    still_readable(filled)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["backup"], ".memvault-backup-monday"),
        (["export", "--all", "-o"], ".memvault-export-notes"),
        (["key", "export", "--passphrase-stdin"], ".memvault-kit-x"),
        (["shred", "--yes", "--receipt"], ".memvault-write-x"),
    ],
)
@pytest.mark.sweep
def test_no_command_writes_a_file_named_as_memvaults_temporary_files(
    filled: Path, tmp_path: Path, args: list[str], name: str
) -> None:
    # The next backup or export in that folder takes such a file for a killed writer's
    # leftover and destroys it: a recorded backup written there would die unseen.
    target = tmp_path / name
    one_line(run_cli(*args, str(target), input=PASS + "\n"), 2, "nothing was written")
    assert not os.path.lexists(target)
    still_readable(filled)


@pytest.mark.parametrize("side", ["-journal", "-wal", "-shm"])
@pytest.mark.sweep
def test_init_never_makes_a_vault_at_a_side_file_name_of_a_database(
    filled: Path, side: str
) -> None:
    # The vault's next open would take it for its journal or WAL, and delete or reset it.
    before = digest(filled)
    r = run_cli("--db", f"{filled}{side}", "init")
    one_line(r, 2, "side file of the SQLite database", "nothing was written")
    assert not os.path.lexists(f"{filled}{side}") and digest(filled) == before
    still_readable(filled)


def test_a_file_name_that_is_not_utf8_is_refused_before_anything_is_written(
    filled: Path, tmp_path: Path
) -> None:
    # Once written, the file's name could not be printed: the command ended in
    # "unexpected error" with the plaintext export left behind.
    bad = str(tmp_path / "bad\udcff.out")
    for args in (
        ["export", "--all", "--force", "-o", bad],
        ["key", "export", "--passphrase-stdin", bad],
        ["shred", "--receipt", bad],
    ):
        one_line(run_cli(*args, input=PASS + "\n"), 2, "not valid UTF-8")
    assert not os.path.lexists(bad)
    still_readable(filled)


def test_a_link_or_a_detour_to_the_vault_is_the_vault(filled: Path, tmp_path: Path) -> None:
    link = tmp_path / "innocent.jsonl"
    link.symlink_to(filled)
    hard = tmp_path / "hard.json"
    os.link(filled, hard)
    dangling = tmp_path / "later.json"  # a link to the -journal, which does not exist yet
    dangling.symlink_to(f"{filled}-journal")
    detour = f"{filled.parent}/../{filled.parent.name}/{filled.name}-wal"
    relative = os.path.relpath(filled, ROOT)  # run_cli runs in ROOT
    before = digest(filled)
    for target in (link, hard, dangling, detour, relative):
        one_line(run_cli("export", "--all", "-o", str(target), "--force"), 2, "the vault's own")
        one_line(
            run_cli("key", "export", "--force", "--passphrase-stdin", str(target), input=PASS),
            2,
            "the vault's own",
        )
    assert digest(filled) == before and not os.path.lexists(f"{filled}-journal")
    still_readable(filled)


@pytest.mark.slow
def test_force_replaces_a_kit_of_this_vault_only(filled: Path, tmp_path: Path) -> None:
    ours = tmp_path / "ours.json"
    assert run_cli("key", "export", "--passphrase-stdin", str(ours), input=PASS).code == 0
    r = run_cli("key", "export", "--force", "--passphrase-stdin", str(ours), input=PASS)
    assert r.code == 0, r
    theirs = tmp_path / "theirs.json"
    doc = json.loads(ours.read_text())
    doc["vault_id"] = "mv-someone-else"
    theirs.write_text(json.dumps(doc))
    before = theirs.read_bytes()
    r = run_cli("key", "export", "--force", "--passphrase-stdin", str(theirs), input=PASS)
    one_line(r, 2, "a recovery kit of another vault", "--force replaces only")
    assert theirs.read_bytes() == before
    backup = tmp_path / "backup.db"
    assert run_cli("backup", str(backup)).code == 0
    before = backup.read_bytes()
    r = run_cli("key", "export", "--force", "--passphrase-stdin", str(backup), input=PASS)
    one_line(r, 2, "a SQLite database")
    r = run_cli("export", "--all", "--force", "-o", str(backup))
    one_line(r, 2, "a SQLite database")
    assert backup.read_bytes() == before


# --------------------------------------------------------------------------
# The property: every writing command x every spelling of a vault file
# --------------------------------------------------------------------------
class World:
    """A vault holding S, held open so that its -wal and -shm exist, and the links."""

    def __init__(self, root: Path) -> None:
        from vault import Vault

        self.root = root
        self.db = root / "vault" / "history.db"
        Vault.init(self.db, ttl=3600)
        add_items(self.db, "S", [user("remember NORD-17")])
        self.reader = sqlite3.connect(self.db)  # keeps -wal and -shm in place
        self.reader.execute("SELECT count(*) FROM memvault_meta").fetchone()
        self.links = root / "links"
        self.links.mkdir()
        (root / "elsewhere").mkdir()
        for side in SIDES:
            (self.links / f"sym{side or '-db'}").symlink_to(f"{self.db}{side}")
        os.link(self.db, self.links / "hard-db")

    def spellings(self, side: str) -> list[str]:
        name = f"{self.db.name}{side}"
        absolute = f"{self.db}{side}"
        return [
            absolute,
            os.path.relpath(absolute),
            f"{self.root}/elsewhere/../vault/{name}",
            f"{self.root}/vault/./{name}",
            f"{self.root}/vault//{name}",
            str(self.links / f"sym{side or '-db'}"),
            f"{self.links}/../links/sym{side or '-db'}",
            *([str(self.links / "hard-db")] if side == "" else []),
        ]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with tempfile.TemporaryDirectory(prefix="memvault-targets-") as tmp:
        w = World(Path(tmp))
        yield w
        w.reader.close()
        from vault.engines.sqlite.vault import shred

        shred(w.db)


def commands(target: str, force: bool) -> list[list[str]]:
    f = ["--force"] if force else []
    return [
        ["export", "S", "-o", target, *f],
        ["export", "--all", "--format", "md", "-o", target, *f],
        ["key", "export", "--passphrase-stdin", target, *f],
        ["backup", target],
        ["shred", "--receipt", target],  # no --yes: a refusal must come before the question
        ["import", target, *(["--shred-source"] if force else [])],
    ]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
@pytest.mark.slow
def test_every_writing_command_refuses_every_spelling_of_a_vault_file(
    world: World, data: st.DataObject
) -> None:
    from vault.cli import cli

    before, files_before = digest(world.db), listing(world.db.parent, world.links)
    side = data.draw(st.sampled_from(SIDES), label="side")
    hard_side = side in ("-wal", "-shm") and data.draw(st.booleans(), label="hard link")
    if hard_side:  # made for this example only: its mere presence stops every open
        target = str(world.links / f"hard{side}")
        os.link(f"{world.db}{side}", target)
    else:
        target = data.draw(st.sampled_from(world.spellings(side)), label="spelling")
    force = data.draw(st.booleans(), label="force")
    args = data.draw(st.sampled_from(commands(target, force)), label="args")
    env = {"MEMVAULT_DB": str(world.db), "MEMVAULT_LOCK_TIMEOUT": "2"}
    try:
        r = CliRunner().invoke(cli, args, env=env, input=PASS + "\n", prog_name="memvault")
    finally:
        if hard_side:
            os.unlink(target)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(args) from r.exception
    err = r.stderr.strip().splitlines()
    assert r.exit_code == 2, (args, r.stdout, r.stderr)
    assert len(err) == 1 and "the vault's own" in err[0], (args, r.stderr)
    assert digest(world.db) == before, args
    assert listing(world.db.parent, world.links) == files_before, args
    shown = CliRunner().invoke(cli, ["show", "S"], env=env, prog_name="memvault")
    assert shown.exit_code == 0 and "NORD-17" in shown.stdout, shown.stderr


# --------------------------------------------------------------------------
# A PostgreSQL vault has no file, but no command writes over a SQLite database
# --------------------------------------------------------------------------
def _postgres(fn: Any) -> Any:
    from tests.pgserver import MARKS

    for mark in MARKS:
        fn = mark(fn)
    return fn


@_postgres
def test_a_url_vault_never_writes_over_a_database_either(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    from vault import Vault

    file_vault = tmp_path / "laptop.db"
    Vault.init(file_vault)
    try:
        before = file_vault.read_bytes()
        for args in (
            ["export", "--all", "--force", "-o", str(file_vault)],
            ["key", "export", "--force", "--passphrase-stdin", str(file_vault)],
            ["backup", f"{file_vault}-wal"],
            ["shred", "--receipt", f"{file_vault}-journal"],
        ):
            r = run_cli("--db", pg_url, *args, input=PASS + "\n")
            one_line(r, 2, "SQLite database")
        assert file_vault.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["laptop.db"]
        out = tmp_path / "export.jsonl"
        assert run_cli("--db", pg_url, "export", "--all", "-o", str(out)).code == 0
        r = run_cli("--db", pg_url, "export", "--all", "--force", "-o", str(out))
        assert r.code == 0, r  # an export over an earlier export
    finally:
        from vault.engines.sqlite.vault import shred

        shred(file_vault)
