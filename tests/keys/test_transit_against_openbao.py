"""The transit key source against a real OpenBao server (scripts/with-openbao).

Each test uses a transit key of its own; tokens with narrower rights are made with the
admin token, as an operator would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import baoserver
from tests.baoserver import ADDR, ADMIN_TOKEN
from tests.conftest import ROOT
from vault import crypto
from vault.errors import EXIT_KEY, KeyMissing, KeyProblem, KeySourceDenied
from vault.keysource.baotoken import Credentials
from vault.keysource.transit import Transit, wrapped_version
from vault.keysource.wrapped import TransitKeySource

pytestmark = baoserver.MARKS


def transit_with(key: str, token: str, **kw: object) -> Transit:
    return Transit(key, addr=ADDR, creds=Credentials(origin="the test", token=token), **kw)  # type: ignore[arg-type]


@pytest.fixture
def key(key: str) -> str:
    """The test's own transit key (tests/conftest.py), made here: these tests start from
    a key that exists."""
    assert transit_with(key, ADMIN_TOKEN).ensure_key() is True
    return key


@pytest.fixture
def bao_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """The environment a host has: the address, and credentials the test chooses."""
    for var in ("VAULT_TOKEN", "BAO_TOKEN", "BAO_ADDR", "MEMVAULT_TRANSIT_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VAULT_ADDR", ADDR)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.vault-token unless a test writes one
    return monkeypatch


class Store:
    """The WrappedKeys a vault will provide, in memory."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], str] = {}

    def load(self, vault_id: str, kid: str) -> str | None:
        return self.rows.get((vault_id, kid))

    def save(self, vault_id: str, kid: str, wrapped: str) -> None:
        self.rows[(vault_id, kid)] = wrapped

    def drop(self, vault_id: str, kid: str) -> bool:
        return self.rows.pop((vault_id, kid), None) is not None


def test_a_wrapped_key_unwraps_to_itself_and_the_ciphertext_is_not_the_key(key: str) -> None:
    transit = transit_with(key, baoserver.host_token(key))
    master = crypto.generate_key()
    wrapped = transit.wrap(master)
    assert wrapped.startswith("vault:v1:") and wrapped_version(wrapped) == 1
    assert master not in wrapped
    assert transit.unwrap(wrapped) == master


def test_a_data_key_is_a_master_key_and_its_wrapped_copy(key: str) -> None:
    source = TransitKeySource(transit_with(key, baoserver.host_token(key)), Store())
    kid, master = source.new_version("v1")
    assert crypto.is_valid_key(master) and crypto.key_id(master) == kid
    assert master not in source.store.rows[("v1", kid)]  # type: ignore[attr-defined]
    assert source.get("v1", kid) == master
    other = crypto.generate_key()
    source.put("v1", crypto.key_id(other), other)
    assert source.get("v1", crypto.key_id(other)) == other
    assert source.get("v2", kid) is None
    assert source.delete("v1", kid) is True and source.get("v1", kid) is None


def test_a_second_process_with_only_a_token_unwraps_what_the_first_wrapped(
    key: str, tmp_path: Path
) -> None:
    master = crypto.generate_key()
    wrapped = transit_with(key, baoserver.host_token(key)).wrap(master)
    probe = (
        "import sys\n"
        "from vault.keysource.transit import Transit\n"
        "from vault import crypto\n"
        "print(crypto.key_id(Transit(sys.argv[1]).unwrap(sys.argv[2])))\n"
        "assert 'keyring' not in sys.modules, 'a keyring was loaded'\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VAULT_", "BAO_", "DBUS_", "PYTHON_KEYRING", "MEMVAULT_TEST_BAO"))
    }
    # Another host: no keyring at all (keyring's fail backend), its own HOME, a token.
    env.update(
        VAULT_ADDR=ADDR,
        VAULT_TOKEN=baoserver.host_token(key),
        HOME=str(tmp_path),
        PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring",
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, key, wrapped],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == crypto.key_id(master)
    assert master not in proc.stdout + proc.stderr


def test_after_a_rotation_and_a_rewrap_only_rewrapped_keys_survive_a_raised_minimum(
    key: str,
) -> None:
    host = transit_with(key, baoserver.host_token(key))
    operator = transit_with(key, ADMIN_TOKEN)
    kept, left = crypto.generate_key(), crypto.generate_key()
    old_kept, old_left = host.wrap(kept), host.wrap(left)
    assert operator.rotate_key() == 2
    rewrapped = host.rewrap(old_kept)
    assert wrapped_version(rewrapped) == 2 and rewrapped != old_kept
    assert host.unwrap(old_left) == left  # still readable before the minimum is raised
    operator.set_min_decryption_version(2)
    assert operator.versions() == (2, 2)
    assert host.unwrap(rewrapped) == kept
    with pytest.raises(KeyProblem) as caught:
        host.unwrap(old_left)
    assert caught.value.exit_code == EXIT_KEY
    assert "min_decryption_version" in caught.value.message and "rewrap" in caught.value.message


def test_a_deleted_transit_key_makes_unwrap_fail_with_exit_4(key: str) -> None:
    host = transit_with(key, baoserver.host_token(key))
    wrapped = host.wrap(crypto.generate_key())
    assert transit_with(key, ADMIN_TOKEN).delete_key() is True
    with pytest.raises(KeyMissing) as caught:
        host.unwrap(wrapped)
    assert caught.value.exit_code == EXIT_KEY
    assert "does not exist" in caught.value.message and key in caught.value.message
    assert transit_with(key, ADMIN_TOKEN).delete_key() is False  # gone is gone


def test_a_wrong_token_is_refused_with_exit_4_and_never_shown(key: str) -> None:
    wrong = "s.NotARealToken0123456789"
    with pytest.raises(KeySourceDenied) as caught:
        transit_with(key, wrong).unwrap(transit_with(key, ADMIN_TOKEN).wrap(crypto.generate_key()))
    assert caught.value.exit_code == EXIT_KEY
    assert "wrong, expired or revoked" in caught.value.message
    assert wrong not in caught.value.message and ADMIN_TOKEN not in caught.value.message


def test_an_expired_token_is_refused_as_expired(key: str) -> None:
    token = baoserver.host_token(key, ttl="2s", renewable=False)
    transit = transit_with(key, token)
    wrapped = transit.wrap(crypto.generate_key())
    admin = baoserver.admin()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait for the server to drop it
        try:
            admin.auth.token.lookup(token)
        except Exception:
            break
        time.sleep(0.2)
    with pytest.raises(KeySourceDenied) as caught:
        transit.unwrap(wrapped)
    assert "wrong, expired or revoked" in caught.value.message and token not in str(caught.value)


def test_a_token_that_may_only_encrypt_cannot_unwrap(key: str) -> None:
    token = baoserver.token_with(baoserver.ENCRYPT_ONLY_POLICY.format(key=key))
    transit = transit_with(key, token)
    wrapped = transit.wrap(crypto.generate_key())
    with pytest.raises(KeySourceDenied) as caught:
        transit.unwrap(wrapped)
    assert caught.value.exit_code == EXIT_KEY
    message = caught.value.message
    assert f"transit/decrypt/{key}" in message and "the host policy" in message
    assert token not in message


def test_a_token_file_open_to_others_works_with_a_warning(
    key: str, bao_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token_file = tmp_path / ".vault-token"  # HOME is tmp_path: the default file
    token_file.write_text(baoserver.host_token(key) + "\n")
    master = crypto.generate_key()
    for mode, warned in ((0o644, True), (0o600, False)):
        token_file.chmod(mode)
        warnings: list[str] = []
        transit = Transit(key, warn=warnings.append)
        assert transit.unwrap(transit.wrap(master)) == master
        assert len(warnings) == (1 if warned else 0), warnings
    assert "chmod 600" in warnings[0] if warnings else True


def test_a_token_file_at_0644_warns_once_on_stderr(
    key: str, bao_env: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "host-token"
    token_file.write_text(baoserver.host_token(key))
    token_file.chmod(0o644)
    bao_env.setenv("MEMVAULT_TRANSIT_TOKEN_FILE", str(token_file))
    Transit(key).wrap(crypto.generate_key())
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "mode 0644" in err and "chmod 600" in err
    token_file.chmod(0o600)
    Transit(key).wrap(crypto.generate_key())
    assert capfd.readouterr().err == ""


def test_an_approle_login_gets_a_token_that_unwraps(
    key: str, bao_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    admin = baoserver.admin()
    mount = "approle-" + key[-12:]
    admin.sys.enable_auth_method("approle", path=mount)
    policy = "host-" + key
    admin.sys.create_or_update_policy(policy, baoserver.HOST_POLICY.format(key=key))
    admin.auth.approle.create_or_update_approle("host", token_policies=[policy], mount_point=mount)
    role_id = admin.auth.approle.read_role_id("host", mount_point=mount)["data"]["role_id"]
    secret_id = admin.auth.approle.generate_secret_id("host", mount_point=mount)["data"][
        "secret_id"
    ]
    secret_file = tmp_path / "secret-id"
    secret_file.write_text(secret_id)
    secret_file.chmod(0o600)
    bao_env.setenv("MEMVAULT_TRANSIT_ROLE_ID", role_id)
    bao_env.setenv("MEMVAULT_TRANSIT_SECRET_ID_FILE", str(secret_file))
    bao_env.setenv("MEMVAULT_TRANSIT_APPROLE_MOUNT", mount)
    master = crypto.generate_key()
    transit = Transit(key, warn=pytest.fail)
    assert transit.unwrap(transit.wrap(master)) == master
    # A secret id that is not the role's: refused, exit 4, the secret never shown.
    secret_file.write_text("00000000-0000-0000-0000-000000000000")
    with pytest.raises(KeySourceDenied) as caught:
        Transit(key).wrap(master)
    assert caught.value.exit_code == EXIT_KEY and "secret id" in caught.value.message
    assert secret_id not in caught.value.message and role_id not in caught.value.message


def test_a_renewable_token_is_renewed_when_its_ttl_runs_low(key: str) -> None:
    token = baoserver.host_token(key, ttl="10s")
    admin = baoserver.admin()
    transit = transit_with(key, token)
    master = crypto.generate_key()
    wrapped = transit.wrap(master)  # first use: looks the token up, nothing to renew yet
    assert not admin.auth.token.lookup(token)["data"].get("last_renewal_time")
    deadline = time.monotonic() + 60
    while admin.auth.token.lookup(token)["data"]["ttl"] > 4 and time.monotonic() < deadline:
        time.sleep(0.2)  # until less than half of its TTL is left
    assert transit.unwrap(wrapped) == master
    data = admin.auth.token.lookup(token)["data"]
    assert data.get("last_renewal_time") and data["ttl"] > 5


def test_the_fleet_pages_policies_let_each_role_do_its_part_and_no_more() -> None:
    key = baoserver.key_name()
    operator_hcl, host_hcl = baoserver.fleet_page_policies(key)
    operator = transit_with(key, baoserver.token_with(operator_hcl))
    host = transit_with(key, baoserver.token_with(host_hcl))
    assert operator.ensure_key() is True and operator.ensure_key() is False
    master, wrapped = host.new_key()
    assert host.unwrap(host.wrap(master)) == master == host.unwrap(wrapped)
    for step in (host.rotate_key, lambda: host.set_min_decryption_version(1), host.delete_key):
        with pytest.raises(KeySourceDenied, match="the operator policy"):
            step()
    assert operator.rotate_key() == 2
    rewrapped = host.rewrap(wrapped)
    operator.set_min_decryption_version(2)
    assert host.unwrap(rewrapped) == master
    with pytest.raises(KeySourceDenied):  # nor any other key
        transit_with(key + "-other", host._creds.token or "").wrap(master)  # noqa: SLF001
    assert operator.delete_key() is True
    # A host's encrypt cannot bring a deleted key back (no `create` on encrypt).
    with pytest.raises(KeyProblem):
        host.wrap(master)
    assert transit_with(key, ADMIN_TOKEN).delete_key() is False


def test_neither_the_key_nor_the_token_reaches_the_logs(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    import base64
    import logging

    token = baoserver.host_token(key)
    caplog.set_level(logging.DEBUG)  # hvac, requests, urllib3: everything they say
    transit = transit_with(key, token)
    master = crypto.generate_key()
    assert transit.unwrap(transit.wrap(master)) == master
    data_key, _ = transit.new_key()
    raw = [crypto.master_key_bytes(k) for k in (master, data_key)]
    secrets_ = [master, data_key, token] + [base64.b64encode(r).decode() for r in raw]
    assert caplog.records  # the client did log (requests' connection lines)
    assert not [s for s in secrets_ if s in caplog.text]


@pytest.mark.secret_service
def test_a_move_between_two_transit_keys_on_a_host_with_a_keyring_finishes(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """After the switch the tidy of this host's keyring reads the versions as they were
    before it: the source left cannot unwrap what the new key wrapped."""
    from tests.keys.test_transit_vaults import cli_at, host_env, host_write, operator_env

    second = baoserver.key_name()
    try:
        db, op = str(vault_db), operator_env(tmp_path)
        assert cli_at(db, op, "init", "--key-source", f"transit:{key}").returncode == 0
        moved = cli_at(db, op, "--json", "key", "move", f"transit:{second}")
        assert moved.returncode == 0, moved.stderr
        assert json.loads(moved.stdout)["already"] is False
        host = host_env(tmp_path, baoserver.host_token(second))
        assert host_write(db, host, "s1", "through the second key") == ["through the second key"]
        assert cli_at(db, host, "verify").returncode == 0
    finally:
        baoserver.admin_transit(second).delete_key()
