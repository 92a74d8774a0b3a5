"""A transit vault when the key service cannot help: down, not answering, a wrong token,
a token without the right to unwrap. Every command exits 4 with one line naming the fix
(never the token), makes no key and writes nothing; on a real OpenBao server."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import baoserver, pgserver
from tests.baoserver import admin_transit
from tests.conftest import ROOT
from tests.keys.test_transit_vaults import (
    HOST_WRITES,
    ON_POSTGRES,
    cli_at,
    host_env,
    host_write,
    operator_env,
    transit_vault,
)
from vault.errors import KeyMissing

pytestmark = baoserver.MARKS
DECRYPT_ONLY_POLICY = (
    'path "transit/decrypt/{key}" {{ capabilities = ["update"] }}\n' + baoserver.ANCHOR_POLICY
)


def closed_port_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_addr() -> Iterator[str]:
    """A server that takes connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def snapshot(db: str) -> tuple[list[Any], ...]:
    """Every row of the vault's meta, key journal, items and audit, on either engine."""
    tables = ("memvault_meta", "memvault_keys", "agent_messages", "memvault_audit")
    if db.startswith("postgresql"):
        return tuple(
            [tuple(r) for r in pgserver.sql(db, f"SELECT * FROM {t} ORDER BY 1")] for t in tables
        )
    with sqlite3.connect(db) as conn:
        return tuple(conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in tables)


def has_vault(db: str) -> bool:
    """Whether anything of a vault exists at `db` (a file, or a table in the schema)."""
    if db.startswith("postgresql"):
        rows = pgserver.sql(
            db, "SELECT count(*) AS n FROM pg_tables WHERE schemaname = current_schema()"
        )
        return bool(rows[0]["n"])
    path = Path(db)
    return path.exists() or (path.parent.exists() and any(path.parent.iterdir()))


def location(where: str, vault_db: Path, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("pg_url")) if where == "postgres" else str(vault_db)


ENGINES = pytest.mark.parametrize("where", ["file", pytest.param("postgres", marks=ON_POSTGRES)])


def meta_and_journal(db: str) -> tuple[Any, ...]:
    query = (
        "SELECT key, value FROM memvault_meta ORDER BY key",
        "SELECT kid, state FROM memvault_keys ORDER BY kid",
    )
    if db.startswith("postgresql"):
        return tuple([tuple(r) for r in pgserver.sql(db, q)] for q in query)
    with sqlite3.connect(db) as conn:
        return tuple(conn.execute(q).fetchall() for q in query)


def one_line_exit_4(proc: Any, *words: str, token: str = "") -> str:
    assert proc.returncode == 4, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    if token:
        assert token not in proc.stderr + proc.stdout
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def token_works(token: str) -> bool:
    import hvac

    try:
        hvac.Client(url=baoserver.ADDR, token=token, timeout=30).auth.token.lookup_self()
    except Exception:
        return False
    return True


def revoke_token(token: str) -> None:
    """What an operator does to a stolen token: the service refuses it from now on."""
    import hvac

    hvac.Client(url=baoserver.ADDR, token=baoserver.ADMIN_TOKEN, timeout=30).auth.token.revoke(
        token
    )
    assert not token_works(token)


def key_exists(key: str) -> bool:
    try:
        admin_transit(key).versions()
    except KeyMissing:
        return False
    return True


@ENGINES
@pytest.mark.parametrize("why", ["down", "silent", "wrong token", "host token"])
def test_init_that_the_service_refuses_makes_no_vault_and_no_key(
    why: str,
    where: str,
    key: str,
    tmp_path: Path,
    vault_db: Path,
    silent_addr: str,
    request: pytest.FixtureRequest,
) -> None:
    db = location(where, vault_db, request)
    env = operator_env(tmp_path)
    words: tuple[str, ...]
    if why == "down":
        env["VAULT_ADDR"] = closed_port_addr()
        words = ("cannot reach the key service", "check that it is running")
    elif why == "silent":
        env.update(VAULT_ADDR=silent_addr, MEMVAULT_KEYRING_TIMEOUT="1")
        words = ("did not answer within 1 s", "MEMVAULT_KEYRING_TIMEOUT")
    elif why == "wrong token":
        env["VAULT_TOKEN"] = "s.not-a-real-token-0123456789"
        words = ("refused the token", "get a new token")
    else:  # a host's token may use a key, not create one
        env["VAULT_TOKEN"] = baoserver.host_token(key)
        words = ("may not", "operator")
    proc = cli_at(db, env, "init", "--key-source", f"transit:{key}")
    one_line_exit_4(proc, *words, token=env["VAULT_TOKEN"])
    assert not has_vault(db)
    assert not key_exists(key)


@pytest.fixture(params=["file", pytest.param("postgres", marks=ON_POSTGRES)])
def shared(
    key: str, tmp_path: Path, vault_db: Path, request: pytest.FixtureRequest
) -> tuple[str, str]:
    """A transit vault with one item in it, in a file or on PostgreSQL."""
    db = location(request.param, vault_db, request)
    transit_vault(db, key, tmp_path, "kept")
    return key, db


def failing_hosts(key: str, tmp_path: Path, silent_addr: str) -> list[tuple[dict[str, str], str]]:
    encrypt_only = baoserver.token_with(baoserver.ENCRYPT_ONLY_POLICY.format(key=key))
    revoked = baoserver.host_token(key)
    revoke_token(revoked)
    expired = baoserver.host_token(key, ttl="1s", renewable=False)
    return [
        (host_env(tmp_path, "x", VAULT_ADDR=closed_port_addr()), "cannot reach"),
        (
            host_env(tmp_path, "x", VAULT_ADDR=silent_addr, MEMVAULT_KEYRING_TIMEOUT="1"),
            "did not answer within 1 s",
        ),
        (host_env(tmp_path, "s.not-a-real-token-0123456789"), "refused the token"),
        (host_env(tmp_path, encrypt_only), "may not unwrap a key (decrypt)"),
        (host_env(tmp_path, revoked), "refused the token"),
        (host_env(tmp_path, expired), "refused the token"),
    ]


def test_a_host_the_service_refuses_reads_nothing_and_writes_nothing(
    shared: tuple[str, str], tmp_path: Path, silent_addr: str
) -> None:
    key, db = shared
    before = snapshot(db)
    hosts = failing_hosts(key, tmp_path, silent_addr)
    expired = hosts[-1][0]["VAULT_TOKEN"]
    while token_works(expired):  # its 1 s TTL runs out
        time.sleep(0.1)
    for env, words in hosts:
        for args in (("show", "s1"), ("rotate", "--yes"), ("status",)):
            proc = cli_at(db, env, *args)
            if args == ("status",):
                assert proc.returncode == 0, proc.stderr
                assert (
                    words in json.loads(cli_at(db, env, "--json", "status").stdout)["key_problem"]
                )
                continue
            one_line_exit_4(proc, words, token=env["VAULT_TOKEN"])
        writer = subprocess.run(
            [sys.executable, "-c", HOST_WRITES, db, "s1", "refused", "none"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
        )  # fmt: skip
        assert writer.returncode != 0
        assert words in writer.stderr and env["VAULT_TOKEN"] not in writer.stderr
        assert snapshot(db) == before, words
    good = host_env(tmp_path, baoserver.host_token(key))
    assert host_write(db, good, "s1", "after") == ["kept", "after"]


@ENGINES
def test_a_rotation_by_a_token_that_may_not_wrap_writes_nothing(
    where: str, key: str, tmp_path: Path, vault_db: Path, request: pytest.FixtureRequest
) -> None:
    db = location(where, vault_db, request)
    transit_vault(db, key, tmp_path, "kept")
    before = meta_and_journal(db)
    decrypt_only = baoserver.token_with(DECRYPT_ONLY_POLICY.format(key=key))
    env = host_env(tmp_path, decrypt_only)
    assert cli_at(db, env, "show", "s1").returncode == 0  # it may read
    one_line_exit_4(cli_at(db, env, "rotate"), "may not wrap a key (encrypt)", token=decrypt_only)
    assert meta_and_journal(db) == before


@ENGINES
@pytest.mark.parametrize("may_delete", [True, False])
def test_init_by_a_token_that_may_make_the_key_but_not_wrap_with_it_leaves_nothing(
    may_delete: bool,
    where: str,
    key: str,
    tmp_path: Path,
    vault_db: Path,
    request: pytest.FixtureRequest,
) -> None:
    """The fleet page's operator policy alone: init creates the transit key, then may not
    wrap the vault's first key with it. No vault, and the key it made is deleted again,
    or (a token that may not delete it) the line tells the operator how."""
    db = location(where, vault_db, request)
    operator_hcl, host_hcl = baoserver.fleet_page_policies(key)
    policy = operator_hcl
    if not may_delete:
        policy = operator_hcl.replace('"update", "delete"', '"update"')
        assert policy != operator_hcl
    token = baoserver.token_with(policy)
    env = {**operator_env(tmp_path), "VAULT_TOKEN": token}
    line = one_line_exit_4(
        cli_at(db, env, "init", "--key-source", f"transit:{key}"),
        "may not wrap a key (encrypt)",
        "both the operator and the host policy",
        "no vault was created",
        token=token,
    )
    assert not has_vault(db)
    if may_delete:
        assert f"the transit key {key} that init created was deleted" in line
        assert not key_exists(key)
    else:
        assert "this token may not delete it" in line
        assert f"bao delete transit/keys/{key}" in line
        assert key_exists(key)
    # The fix the line names: a token with both policies makes the vault.
    env["VAULT_TOKEN"] = baoserver.token_with(operator_hcl + host_hcl)
    made = cli_at(db, env, "init", "--key-source", f"transit:{key}")
    assert made.returncode == 0, made.stderr
    assert has_vault(db)
