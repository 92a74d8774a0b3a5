"""Vaults whose key source is a transit key (`init --key-source transit:KEY`), on a real
OpenBao server (scripts/with-openbao) and, for the PostgreSQL cases, a real PostgreSQL
server (scripts/with-postgres): the operator creates the vault, other hosts (real
processes with no keyring at all, holding only a token) read and write it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import baoserver, pgserver
from tests.baoserver import ADDR, ADMIN_TOKEN, admin_transit
from tests.conftest import ROOT, run_cli

pytestmark = baoserver.MARKS
ON_POSTGRES = pgserver.MARKS

# Writes one item through the library's session and reads the whole session back, in a
# process of its own: argv = location, session id, text.
HOST_WRITES = """
import asyncio, json, sys
import vault
async def main():
    s = vault.open_session(sys.argv[2], sys.argv[1])
    await s.add_items([{"role": "user", "content": sys.argv[3]}])
    items = await s.get_items()
    print(json.dumps([i["content"] for i in items]))
    assert "keyring" not in sys.modules or sys.argv[4] == "any", "a keyring was loaded"
asyncio.run(main())
"""


def host_env(tmp_path: Path, token: str, **extra: str) -> dict[str, str]:
    """Another host: no keyring at all (keyring's fail backend), its own HOME, a token."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VAULT_", "BAO_", "DBUS_", "PYTHON_KEYRING", "MEMVAULT_TEST_BAO"))
    }
    home = tmp_path / f"home-{len(os.listdir(tmp_path))}"
    home.mkdir()
    env.update(
        VAULT_ADDR=ADDR,
        VAULT_TOKEN=token,
        HOME=str(home),
        PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring",
    )
    env.update(extra)
    return env


def operator_env(tmp_path: Path) -> dict[str, str]:
    """The operator's host: its own keyring (the test's), and the admin token."""
    return {**os.environ, "VAULT_ADDR": ADDR, "VAULT_TOKEN": ADMIN_TOKEN, "HOME": str(tmp_path)}


def cli_at(db: str, env: dict[str, str], *args: str, input: str = "") -> Any:
    proc = subprocess.run(
        [sys.executable, "-m", "vault", "--db", db, *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, input=input,
    )  # fmt: skip
    return proc


def host_write(db: str, env: dict[str, str], session: str, text: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", HOST_WRITES, db, session, text, "none"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return list(__import__("json").loads(proc.stdout.strip().splitlines()[-1]))


def init_transit(db: str, key: str, tmp_path: Path) -> dict[str, Any]:
    res = run_cli(
        "--db", db, "--json", "init", "--key-source", f"transit:{key}",
        env=operator_env(tmp_path),
    )  # fmt: skip
    assert res.code == 0, res
    doc: dict[str, Any] = res.json()
    return doc


def transit_vault(
    db: str, key: str, tmp_path: Path, text: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """A transit vault that the operator made and a host with no keyring, holding only a
    host token, wrote `text` into (session s1): init's JSON, and that host's environment."""
    made = init_transit(db, key, tmp_path)
    host = host_env(tmp_path, baoserver.host_token(key))
    assert host_write(db, host, "s1", text) == [text]
    return made, host


def hosts_share_a_vault(db: str, key: str, tmp_path: Path) -> dict[str, Any]:
    """init by the operator; then two hosts with no keyring write and read, and `show`."""
    made = init_transit(db, key, tmp_path)
    assert made["key_source"] == f"transit:{key} (mount transit)"
    assert admin_transit(key).versions() == (1, 1)  # init created the key
    b = host_env(tmp_path, baoserver.host_token(key))
    c = host_env(tmp_path, baoserver.host_token(key))
    assert host_write(db, b, "s1", "from B") == ["from B"]
    assert host_write(db, c, "s1", "from C") == ["from B", "from C"]
    shown = cli_at(db, b, "--json", "show", "s1")
    assert shown.returncode == 0, shown.stderr
    assert [i["content"] for i in __import__("json").loads(shown.stdout)["items"]] == [
        "from B",
        "from C",
    ]
    status = cli_at(db, c, "--json", "status")
    assert status.returncode == 0, status.stderr
    st = __import__("json").loads(status.stdout)
    assert st["key_source"] == f"transit:{key} (mount transit)"
    assert st["key"] == "present and matching"
    return made


def test_hosts_with_only_a_token_share_a_transit_file_vault(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    made = hosts_share_a_vault(str(vault_db), key, tmp_path)
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    # The key is nowhere in the operator's keyring; the vault holds it wrapped only.
    assert KeyStore().get(entry_name(made["vault_id"], made["kid"])) is None
    with sqlite3.connect(vault_db) as conn:
        rows = dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
    assert rows["key_source"] == f"transit:{key}"
    assert rows["wrapped_key:" + made["kid"]].startswith("vault:v1:")


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_POSTGRES)])
def test_hosts_with_only_a_token_share_a_transit_postgres_vault(
    _: None, key: str, tmp_path: Path, pg_url: str
) -> None:
    made = hosts_share_a_vault(pg_url, key, tmp_path)
    rows = {
        r["key"]: r["value"] for r in pgserver.sql(pg_url, "SELECT key, value FROM memvault_meta")
    }
    assert rows["wrapped_key:" + made["kid"]].startswith("vault:v1:")
