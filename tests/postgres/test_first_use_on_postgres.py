"""What a new user meets on a PostgreSQL vault: an SSL refusal named as such, a second
host's revoke that says what it did, status's "never rotated".

Run with `scripts/with-postgres scripts/test -q -m postgres
tests/postgres/test_first_use_on_postgres.py`
(the throwaway server runs without SSL).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.pgserver import MARKS, insert_sealed
from tests.postgres.test_postgres_admin import (
    host_b_env,
    host_b_keys,
    one_line_error,
    write,
)

pytestmark = MARKS


def test_sslmode_require_on_a_server_without_ssl_names_ssl(pg_url: str) -> None:
    r = run_cli("--db", f"{pg_url}&sslmode=require", "init")
    one_line_error(r, 3, "does not offer SSL, which the URL's sslmode requires")
    assert "cannot reach" not in r.err and "sslmode=prefer or disable" in r.err, r
    # The same server answers without SSL: nothing else was wrong with the URL.
    assert run_cli("--db", f"{pg_url}&sslmode=disable", "init").code == 0


def test_a_missing_root_certificate_is_an_ssl_problem_not_a_bad_url(pg_url: str) -> None:
    # Without sslrootcert the driver looks for ~/.postgresql/root.crt (not in the test HOME).
    r = run_cli("--db", f"{pg_url}&sslmode=verify-full", "status")
    one_line_error(r, 3, "SSL with the PostgreSQL server of")
    assert "root certificate" in r.err and "not a URL" not in r.err, r


def test_a_second_hosts_revoke_says_it_destroyed_that_hosts_key(
    pg_vault: Any, pg_url: str, tmp_path: Path
) -> None:
    b = host_b_env(tmp_path)
    pw = tmp_path / "passphrase"
    pw.write_text("correct horse battery staple\n")
    pw.chmod(0o600)
    kit = tmp_path / "kit.json"
    r = run_cli("--db", pg_url, "key", "export", "--passphrase-file", str(pw), str(kit))
    assert r.code == 0, r
    r = run_cli("--db", pg_url, "key", "import", "--passphrase-file", str(pw), str(kit), env=b)
    assert r.code == 0, r
    kid = run_cli("--db", pg_url, "--json", "status").json()["kid"]
    assert run_cli("--db", pg_url, "revoke", "--yes").code == 0  # host A
    r = run_cli("--db", pg_url, "revoke", "--yes", env=b)  # host B
    assert r.code == 0, r
    assert f"was already revoked (key {kid}); this keyring still held its key: " in r.out, r
    assert f"destroyed it ({kid})" in r.out and "cut-off" not in r.out, r
    assert host_b_keys(tmp_path) == set()
    # Nothing left to destroy on B now: the line says only that it was revoked.
    again = run_cli("--db", pg_url, "revoke", "--yes", env=b)
    assert again.code == 0 and "still held" not in again.out, again


def test_status_of_a_url_says_never_until_the_first_rotation(pg_vault: Any, pg_url: str) -> None:
    assert run_cli("--db", pg_url, "--json", "status").json()["rotated_at"] is None
    assert "rotated    never" in run_cli("--db", pg_url, "status").out.splitlines()
    assert run_cli("--db", pg_url, "rotate", "--yes").code == 0
    rotated = run_cli("--db", pg_url, "--json", "status").json()["rotated_at"]
    assert rotated is not None
    assert f"rotated    {rotated}" in run_cli("--db", pg_url, "status").out.splitlines()


@pytest.mark.parametrize("bare", ["1", "86400"])
def test_a_url_vault_refuses_a_ttl_without_a_unit(pg_vault: Any, pg_url: str, bare: str) -> None:
    one_line_error(run_cli("--db", pg_url, "ttl", bare), 2, "has no unit")
    assert run_cli("--db", pg_url, "--json", "ttl").json()["ttl"] == "1h"


def test_pop_on_a_url_asks_before_it_empties_a_session(pg_vault: Any, pg_url: str) -> None:
    write(pg_url, "s1", ["one", "two"])
    r = run_cli("--db", pg_url, "pop", "s1", "-n", "5")
    assert r.code == 1 and r.err.startswith("Remove all 2 items of session 's1'"), r
    r = run_cli("--db", pg_url, "pop", "s1", "-n", "5", "--yes")
    assert r.code == 0 and r.out.startswith("removed 2 items from s1 (asked for 5"), r
    assert run_cli("--db", pg_url, "show", "s1").out == "session s1 is empty\n"


def test_show_on_a_url_numbers_and_includes_expired_items(pg_vault: Any, pg_url: str) -> None:
    import time

    insert_sealed(pg_url, "s1", ["old"], int(time.time()) - 7200)  # the vault's TTL is 1h
    write(pg_url, "s1", ["new"])
    assert run_cli("--db", pg_url, "show", "s1").out.splitlines()[0] == "#2 user: new"
    r = run_cli("--db", pg_url, "show", "s1", "--include-expired")
    assert r.out.splitlines() == ["#1 (expired) user: old", "#2 user: new"], r
