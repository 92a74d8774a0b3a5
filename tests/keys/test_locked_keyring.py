"""Every command against a vault whose keyring is locked (a private Secret Service).

A locked collection cannot be unlocked headless, so each command meets the lock
for real. The commands that read or change items need the key and refuse with exit
4 and one line; `status`, `log` and `backup` need no key and show only what the
file itself reveals to anyone (SECURITY.md, "What the file still reveals").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PASSPHRASE = "correct horse battery staple, locked"

# Every command of `memvault --help` that touches a vault (completion and demo
# open none; demo's throwaway vault is tried below as `demo`).
NEEDS_THE_KEY = {
    "show": ["show", "s1"],
    "export": ["export", "s1", "-o", "{d}/out.json"],
    "search": ["search", "hello"],
    "verify": ["verify"],
    "purge": ["purge", "--yes"],
    "clear": ["clear", "s1", "--yes"],
    "pop": ["pop", "s1"],
    "ttl": ["ttl"],
    "ttl set": ["ttl", "2d"],
    "rotate": ["rotate"],
    "key list": ["key", "list"],
    "key export": ["key", "export", "--passphrase-file", "{d}/pass", "{d}/kit2.json"],
    "key import": ["key", "import", "--passphrase-file", "{d}/pass", "{d}/kit.json"],
    "import": ["import", "{d}/plain.db"],
    "chat": ["chat", "s1"],
    "init": ["--db", "{d}/new.db", "init"],
    "demo": ["demo"],
    # Destroying commands last: revoke marks the vault before it reaches the keyring.
    "shred": ["--db", "{d}/other.db", "shred", "--yes"],
    "revoke": ["revoke", "--yes"],
}
NEED_NO_KEY = {
    "sessions": ["sessions"],  # ids and counts are in the file in clear (docs/keys.md)
    "status": ["status"],
    "log": ["log"],
    "backup": ["backup", "{d}/copy.db"],
}

DRIVER = r"""
import asyncio, json, os, sqlite3, subprocess, sys
import secretstorage
import vault
from agents import SQLiteSession
from vault.secretservice import connect

d, commands = sys.argv[1], json.loads(sys.argv[2])
db = f"{d}/v.db"
env = dict(os.environ, MEMVAULT_DB=db, OPENAI_API_KEY="sk-not-used")

def cli(*args, stdin=""):
    return subprocess.run([sys.executable, "-m", "vault", *args], input=stdin,
                          capture_output=True, text=True, env=env, timeout=120)

assert cli("init").returncode == 0
assert cli("--db", f"{d}/other.db", "init").returncode == 0
async def fill():
    s = vault.open_session("s1", db)
    await s.add_items([{"role": "user", "content": "hello"}])
    plain = SQLiteSession("p1", f"{d}/plain.db")
    await plain.add_items([{"role": "user", "content": "plain"}])
    plain.close()
asyncio.run(fill())
assert cli("key", "export", "--passphrase-file", f"{d}/pass", f"{d}/kit.json").returncode == 0

def rows():
    with sqlite3.connect(db) as c:
        return c.execute("SELECT id, message_data FROM agent_messages").fetchall()

before = rows()
secretstorage.get_default_collection(connect()).lock()
results = {}
for name, args in commands:
    p = cli(*[a.format(d=d) for a in args], stdin="y\n")
    results[name] = [p.returncode, p.stdout, p.stderr]
    if name == "revoke":
        continue
    results[name].append(rows() == before)
print(json.dumps(results))
"""


@pytest.mark.secret_service
@pytest.mark.slow
def test_with_a_locked_keyring_every_command_needing_the_key_exits_4(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_IN_PRIVATE_KEYRING"}
    env["PYTHONPATH"] = str(ROOT)
    (tmp_path / "pass").write_text(PASSPHRASE + "\n")
    (tmp_path / "pass").chmod(0o600)
    commands = [*NEED_NO_KEY.items(), *NEEDS_THE_KEY.items()]
    proc = subprocess.run(
        [
            str(ROOT / "scripts" / "with-keyring"),
            sys.executable,
            "-c",
            DRIVER,
            str(tmp_path),
            json.dumps(commands),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == set(NEEDS_THE_KEY) | set(NEED_NO_KEY)
    for name in NEEDS_THE_KEY:
        code, out, err, *unchanged = results[name]
        lines = err.strip().splitlines()
        # demo runs its checks in a throwaway vault and reports the lock as a failed one.
        expected = 1 if name == "demo" else 4
        assert code == expected, (name, code, out, err)
        assert "Traceback" not in err, name
        assert len(lines) == 1 and lines[0].startswith("memvault: error:"), (name, err)
        if name != "demo":
            assert "is locked" in lines[0] and "unlock" in lines[0], (name, err)
        else:
            assert "KeyringLocked" in out, out
        assert "hello" not in out, name
        assert unchanged in ([], [True]), f"{name} changed the items"
    for name in NEED_NO_KEY:
        code, out, err, unchanged = results[name]
        assert code == 0, (name, code, out, err)
        assert unchanged, name
        assert "hello" not in out and "Traceback" not in err, name
    # What they show is what a copy of the file shows without any key.
    status = results["status"][1]
    assert "key        unusable:" in status and "is locked" in status
    assert "unverified counts" in status
    assert "init" in results["log"][1]
    assert "this keyring cannot open it" in results["backup"][1] + results["backup"][2]
    assert (tmp_path / "copy.db").exists()
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "kit2.json").exists()
    assert not (tmp_path / "new.db").exists()
    assert (tmp_path / "other.db").exists(), "a shred that cannot reach the key keeps the file"
