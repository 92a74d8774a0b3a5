"""Every SQLite connection memvault opens keeps temporary data in memory.

`temp_store = MEMORY`: a sort, an index build or a VACUUM never writes a
temporary file, which would hold vault bytes (or an import source's plaintext)
outside the files that scrub and shred reach. Each command below runs in a real
process whose `sqlite3.connect` is wrapped: every connection it opens, memvault's
own, the agent session's and the import source's, is asked before it closes (or
at exit) what its temp_store is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, add_items, user
from tests.files.test_import import make_plain

DRIVER = r"""
import atexit, json, sqlite3, sys

LOG, ARGS = sys.argv[1], sys.argv[2:]
seen = []
opened = []
MEMORY = 2  # PRAGMA temp_store: 0 default, 1 file, 2 memory


class Watched(sqlite3.Connection):
    def close(self):
        self.report()
        super().close()

    def report(self):
        if getattr(self, "_reported", False):
            return
        self._reported = True
        try:
            seen.append(self.execute("PRAGMA temp_store").fetchone()[0])
        except sqlite3.ProgrammingError:  # already closed by SQLite's own means
            seen.append(None)


real_connect = sqlite3.connect


def connect(*args, **kwargs):
    # memvault may pass a factory of its own: watch a subclass of it.
    base = kwargs.get("factory", sqlite3.Connection)
    kwargs["factory"] = Watched if base is sqlite3.Connection else type(
        "Watched" + base.__name__, (Watched, base), {}
    )
    conn = real_connect(*args, **kwargs)
    opened.append(conn)
    return conn


sqlite3.connect = connect


def at_exit():
    for conn in opened:
        conn.report()
    with open(LOG, "a") as out:
        run = {"args": ARGS, "opened": len(opened), "temp_store": seen}
        out.write(json.dumps(run) + "\n")


atexit.register(at_exit)
from vault.cli import main

sys.argv = ["memvault", *ARGS]
main()
"""


def run_watched(log: Path, *args: str, env: dict[str, str] | None = None) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(log), *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode


SESSION = r"""
import asyncio, sys
import vault

async def go():
    s = vault.open_session("agent", sys.argv[1])
    await s.add_items([{"role": "user", "content": "through the agent session"}])
    await s.get_items()
    await s.pop_item()
    s.close()

asyncio.run(go())
"""


@pytest.mark.slow
def test_every_connection_memvault_opens_keeps_temporary_data_in_memory(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("one"), user("two")])
    plain = tmp_path / "plain.db"
    make_plain(plain, {"p": [user("plaintext to import")]})
    pw = tmp_path / "pw"
    pw.write_text("correct horse battery staple, temp\n")
    pw.chmod(0o600)
    log = tmp_path / "connections.jsonl"
    commands = [
        ["status"],
        ["sessions"],
        ["show", "s"],
        ["search", "one"],
        ["verify"],
        ["log"],
        ["ttl", "2d"],
        ["export", "s", "-o", str(tmp_path / "out.json")],
        ["backup", str(tmp_path / "copy.db")],
        ["key", "export", "--passphrase-file", str(pw), str(tmp_path / "kit.json")],
        ["key", "list"],
        ["import", str(plain)],
        ["pop", "s"],
        ["rotate"],
        ["purge", "--yes"],
        ["clear", "s", "--yes"],
    ]
    # The agent session's connections, in a process of its own under the same watch.
    session = DRIVER.replace("from vault.cli import main", SESSION.replace("sys.argv[1]", "DB"))
    session = session.replace('sys.argv = ["memvault", *ARGS]\nmain()', "")
    agent = subprocess.run(
        [sys.executable, "-c", session.replace("DB", repr(str(vault_db))), str(log), "agent"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert agent.returncode == 0, agent.stderr
    for args in commands:
        assert run_watched(log, *args) == 0, args
    # Shell completion reads session ids without any key, from its own connection.
    complete = {
        "_MEMVAULT_COMPLETE": "bash_complete",
        "COMP_WORDS": "memvault show ",
        "COMP_CWORD": "2",
    }
    add_items(vault_db, "left", [user("x")])
    assert run_watched(log, env=complete) == 0
    assert run_watched(log, "shred", "--yes") == 0
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == len(commands) + 3
    assert [r for r in runs if r["opened"] != len(r["temp_store"])] == []
    bad = [r for r in runs if any(v != 2 for v in r["temp_store"])]
    assert not bad, json.dumps(bad)
    assert sum(run["opened"] for run in runs) > len(commands)
