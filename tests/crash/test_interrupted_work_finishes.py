"""Work cut off by SIGKILL is finished, or cleaned up, by the next command.

Real `memvault` processes are killed at an instant spotted from the outside (a
temporary file appearing) or at named steps: a killed `export --force` leaves no
plaintext once the next export or shred has run, and a stale file that is not
ours (a link, another name, another header) is never touched; a killed
`import --shred-source` is finished by the same command, run again. (`init` and
`backup` are killed in the crash campaign, tests/crash/test_every_command_killed_at_any_instant.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, insert_sealed, run_cli, user
from tests.pgserver import SERVER_URL

# Kills timed against a running export: one at a time, with the other kill campaigns.
pytestmark = [pytest.mark.slow, pytest.mark.crash]

KILLED = -signal.SIGKILL
SECRET = "plaintext-marker-7731"


def fill_big(db: Path) -> None:
    """Enough plaintext (~12 MB) that an export is caught while it writes."""
    insert_sealed(db, "big", [user(f"{SECRET} {i} " + "x" * 4000) for i in range(3000)])


def temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith(".memvault-"))


def kill_export_mid_write(db: Path | str, out: Path) -> Path:
    """SIGKILL `export --all -o OUT --force` once its temporary file holds plaintext."""
    for _ in range(5):  # a run that finished before it was caught is tried again
        proc = subprocess.Popen(
            [sys.executable, "-m", "vault", "--db", str(db), "export", "--all", "-o", str(out)]
            + ["--force"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
        )
        while proc.poll() is None:
            found = [p for p in temps(out.parent) if p.stat().st_size > 0]
            if found:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        proc.wait(timeout=120)
        if proc.returncode == KILLED:
            left = temps(out.parent)
            assert left and SECRET.encode() in left[0].read_bytes()
            return left[0]
    raise AssertionError("the export always finished before it could be killed")


def test_a_killed_forced_export_leaves_no_plaintext_after_the_next_export(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    fill_big(vault_db)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "history.jsonl"
    old = '{"session_id": "s", "position": 1, "timestamp": null, "expired": false, "item": {}}\n'
    out.write_text(old)  # an earlier export: --force replaces only one of those
    kill_export_mid_write(vault_db, out)
    assert out.read_text() == old  # the old export is left as it was
    again = run_cli("--db", str(vault_db), "export", "big", "-o", str(out), "--force")
    assert again.code == 0, again
    assert temps(out_dir) == []
    assert SECRET in out.read_text()


def test_a_killed_forced_export_beside_the_vault_is_destroyed_by_shred(
    vault: Any, vault_db: Path
) -> None:
    fill_big(vault_db)
    out = vault_db.parent / "history.md"
    out.write_text("# memvault export\n")  # an earlier export: --force replaces only those
    left = kill_export_mid_write(vault_db, out)
    r = run_cli("--db", str(vault_db), "--json", "shred", "--yes")
    assert r.code == 0, r
    assert not left.exists()
    assert left.name in {f["name"] for f in r.json()["files"]}
    assert sorted(p.name for p in vault_db.parent.iterdir()) == ["history.md"]


OLD_EXPORT = '{"session_id": "s", "position": 1, "timestamp": null, "expired": false, "item": {}}\n'


def killed_export_elsewhere(db: Path | str, tmp_path: Path) -> Path:
    """A forced export into a folder of its own, killed mid-write: its leftover."""
    far = tmp_path / "far-away"
    far.mkdir()
    out = far / "history.jsonl"
    out.write_text(OLD_EXPORT)  # an earlier export: --force replaces only one of those
    return kill_export_mid_write(db, out)


def test_a_killed_forced_export_elsewhere_is_destroyed_by_the_next_export_of_the_vault(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    fill_big(vault_db)
    left = killed_export_elsewhere(vault_db, tmp_path)
    # The next export writes somewhere else entirely: the vault's audit trail names
    # the folder the killed one wrote in.
    r = run_cli("--db", str(vault_db), "export", "big", "-o", str(tmp_path / "new.md"))
    assert r.code == 0, r
    assert not left.exists()
    assert temps(left.parent) == []
    assert (left.parent / "history.jsonl").read_text() == OLD_EXPORT


def test_a_killed_forced_export_elsewhere_is_destroyed_by_shred(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    fill_big(vault_db)
    left = killed_export_elsewhere(vault_db, tmp_path)
    r = run_cli("--db", str(vault_db), "--json", "shred", "--yes")
    assert r.code == 0, r
    assert not left.exists()
    assert left.name in {f["name"] for f in r.json()["files"]}


@pytest.mark.postgres
@pytest.mark.skipif(not SERVER_URL, reason="needs a PostgreSQL server (scripts/with-postgres)")
def test_a_killed_forced_export_of_a_postgresql_vault_is_destroyed_by_shred(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    import vault

    async def fill() -> None:  # ~12 MB, so that the export is caught while it writes
        s = vault.open_session("big", pg_url)
        await s.add_items([user(f"{SECRET} {i} " + "x" * 4000) for i in range(3000)])

    asyncio.run(fill())
    left = killed_export_elsewhere(pg_url, tmp_path)
    r = run_cli("--db", pg_url, "--json", "shred", "--yes")
    assert r.code == 0, r
    assert not left.exists()
    assert left.name in {f["name"] for f in r.json()["files"]}


def test_stale_temporary_names_that_are_not_ours_are_left_alone(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text('{"session_id": "mine"}\n')
    (out_dir / ".memvault-export-link").symlink_to(precious)
    os.link(precious, out_dir / ".memvault-export-hardlink")
    (out_dir / ".memvault-export-other").write_text("a file of someone else's\n")
    insert_sealed(vault_db, "s", [user("hello")])
    r = run_cli("--db", str(vault_db), "export", "s", "-o", str(out_dir / "e.jsonl"))
    assert r.code == 0, r
    assert precious.read_text() == '{"session_id": "mine"}\n'
    assert (out_dir / ".memvault-export-link").is_symlink()
    assert (out_dir / ".memvault-export-hardlink").stat().st_nlink == 2
    assert (out_dir / ".memvault-export-other").read_text() == "a file of someone else's\n"


# --------------------------------------------------------------------------
# import --shred-source
# --------------------------------------------------------------------------
def make_plain(path: Path, sessions: dict[str, int]) -> dict[str, list[Any]]:
    """A plaintext SQLiteSession file written by the real SDK."""
    import asyncio

    from agents import SQLiteSession

    items = {sid: [user(f"{sid} plain {i}") for i in range(n)] for sid, n in sessions.items()}

    async def go() -> None:
        for sid, its in items.items():
            s = SQLiteSession(sid, path)
            await s.add_items(its)
            s.close()

    asyncio.run(go())
    return items


@pytest.mark.parametrize(
    ("step", "already", "imported"),
    [
        ("import-session-committed", ["a"], ["b"]),  # killed between the two sessions
        ("import-before-source-shred", ["a", "b"], []),
        ("import-during-source-shred", [], []),  # the source is zeroed: only the shred is left
    ],
)
def test_a_killed_import_with_shred_source_is_finished_by_running_it_again(
    vault: Any, vault_db: Path, tmp_path: Path, step: str, already: list[str], imported: list[str]
) -> None:
    plain = tmp_path / "plain.db"
    want = make_plain(plain, {"a": 5, "b": 7})
    args = ["--db", str(vault_db), "import", str(plain), "--shred-source", "--yes"]
    killed = run_cli(*args, env={"MEMVAULT_FAILPOINT": step})
    assert killed.code == KILLED, killed
    again = run_cli("--json", *args)
    assert again.code == 0, again
    report = again.json()
    assert [s["session_id"] for s in report["already_imported"]] == already
    assert [s["session_id"] for s in report["sessions"]] == imported
    assert report["source_shredded"] is not None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("plain.db")] == []
    from vault import Vault

    v = Vault.open(vault_db)
    assert {sid: v.items(sid)[0] for sid in v.session_ids()} == want  # each item once
    log = run_cli("--db", str(vault_db), "--json", "log").json()
    assert sum(e["event"] == "source-shred" for e in log) == 1


def test_a_session_of_the_same_name_not_from_that_source_is_still_refused(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    plain = tmp_path / "plain.db"
    make_plain(plain, {"a": 3})
    insert_sealed(vault_db, "a", [user("a plain 0"), user("a plain 1"), user("a plain 2")])
    r = run_cli("--db", str(vault_db), "import", str(plain), "--shred-source", "--yes")
    assert r.code == 1 and "already exists in the vault" in r.err, r
    assert plain.exists()


@pytest.mark.postgres
@pytest.mark.skipif(not SERVER_URL, reason="needs a PostgreSQL server (scripts/with-postgres)")
def test_a_killed_import_into_postgresql_is_finished_by_running_it_again(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    plain = tmp_path / "plain.db"
    want = make_plain(plain, {"a": 4, "b": 3})
    args = ["--db", pg_url, "import", str(plain), "--shred-source", "--yes"]
    killed = run_cli(*args, env={"MEMVAULT_FAILPOINT": "import-session-committed"})
    assert killed.code == KILLED, killed
    again = run_cli("--json", *args)
    assert again.code == 0, again
    assert [s["session_id"] for s in again.json()["already_imported"]] == ["a"]
    assert [s["session_id"] for s in again.json()["sessions"]] == ["b"]
    assert not plain.exists()
    for sid, items in want.items():
        assert run_cli("--db", pg_url, "--json", "show", sid).json()["items"] == items
