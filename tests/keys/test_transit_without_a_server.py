"""The transit key source where no working server is needed: configuration, credentials,
and a server that is down or does not answer (exit 4 with the fix, within the deadline).
And the keyring source, which satisfies the same protocol."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vault import crypto
from vault.errors import (
    EXIT_KEY,
    EXIT_USAGE,
    BadInput,
    KeyProblem,
    KeySourceDenied,
    KeySourceUnavailable,
)
from vault.keysource import KeySource
from vault.keysource.baotoken import Credentials, credentials
from vault.keysource.oskeyring import KeyringSource
from vault.keysource.transit import Transit, wrapped_version
from vault.keysource.wrapped import TransitKeySource

TOKEN = "s.SomeTokenThatMustNeverBeShown"
WRAPPED = "vault:v1:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for var in (
        "VAULT_ADDR", "BAO_ADDR", "VAULT_TOKEN", "BAO_TOKEN", "MEMVAULT_TRANSIT_TOKEN_FILE",
        "MEMVAULT_TRANSIT_ROLE_ID", "MEMVAULT_TRANSIT_ROLE_ID_FILE",
        "MEMVAULT_TRANSIT_SECRET_ID", "MEMVAULT_TRANSIT_SECRET_ID_FILE",
    ):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return monkeypatch


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_server_that_is_down_fails_with_exit_4_and_the_fix(env: pytest.MonkeyPatch) -> None:
    env.setenv("VAULT_ADDR", f"http://127.0.0.1:{closed_port()}")
    env.setenv("VAULT_TOKEN", TOKEN)
    transit = Transit("k")
    with pytest.raises(KeySourceUnavailable) as caught:
        transit.unwrap(WRAPPED)
    assert caught.value.exit_code == EXIT_KEY
    assert "cannot reach the key service" in caught.value.message
    assert "VAULT_ADDR" in caught.value.message and TOKEN not in caught.value.message


def test_a_server_that_never_answers_fails_at_the_deadline_then_at_once(
    env: pytest.MonkeyPatch, silent_server: str
) -> None:
    env.setenv("BAO_ADDR", silent_server)
    env.setenv("BAO_TOKEN", TOKEN)
    env.setenv("MEMVAULT_KEYRING_TIMEOUT", "0.5")
    transit = Transit("k")
    with pytest.raises(KeySourceUnavailable) as caught:
        transit.wrap(crypto.generate_key())
    assert caught.value.exit_code == EXIT_KEY
    assert "did not answer within 0.5 s" in caught.value.message
    assert "MEMVAULT_KEYRING_TIMEOUT" in caught.value.message
    with pytest.raises(KeySourceUnavailable) as again:  # no second wait
        transit.unwrap(WRAPPED)
    assert again.value is caught.value


def test_no_address_says_which_variables_to_set(env: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeySourceUnavailable) as caught:
        Transit("k")
    assert caught.value.exit_code == EXIT_KEY and "VAULT_ADDR or BAO_ADDR" in str(caught.value)
    env.setenv("VAULT_ADDR", "bao.example.com:8200")
    with pytest.raises(BadInput) as bad:
        Transit("k")
    assert bad.value.exit_code == EXIT_USAGE and "http(s) URL" in str(bad.value)


def test_two_address_or_token_variables_that_differ_are_refused(env: pytest.MonkeyPatch) -> None:
    env.setenv("VAULT_ADDR", "http://a:8200")
    env.setenv("BAO_ADDR", "http://a:8200")
    assert Transit("k").addr == "http://a:8200"  # the same: fine
    env.setenv("BAO_ADDR", "http://b:8200")
    with pytest.raises(BadInput, match="VAULT_ADDR and BAO_ADDR are both set"):
        Transit("k")
    env.setenv("VAULT_TOKEN", TOKEN)
    env.setenv("BAO_TOKEN", TOKEN + "x")
    with pytest.raises(BadInput) as caught:
        credentials()
    assert TOKEN not in caught.value.message


def test_no_credentials_names_every_way_to_give_them(env: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeySourceDenied) as caught:
        credentials()
    message = caught.value.message
    assert caught.value.exit_code == EXIT_KEY
    for way in ("VAULT_TOKEN", "BAO_TOKEN", "~/.vault-token", "MEMVAULT_TRANSIT_ROLE_ID"):
        assert way in message
    env.setenv("MEMVAULT_TRANSIT_ROLE_ID", "role")
    with pytest.raises(KeySourceDenied, match="MEMVAULT_TRANSIT_SECRET_ID"):
        credentials()


def test_credentials_come_first_from_the_environment_then_a_file_then_approle(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env.setenv("MEMVAULT_TRANSIT_ROLE_ID", "role")
    env.setenv("MEMVAULT_TRANSIT_SECRET_ID", "secret")
    approle = credentials()
    assert (approle.role_id, approle.secret_id, approle.token) == ("role", "secret", None)
    assert "secret" not in repr(approle)
    (tmp_path / ".vault-token").write_text("from-home\n")
    (tmp_path / ".vault-token").chmod(0o600)
    assert credentials().token == "from-home"
    env.setenv("BAO_TOKEN", TOKEN)
    found = credentials()
    assert (found.token, found.origin) == (TOKEN, "BAO_TOKEN") and TOKEN not in repr(found)


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o640, True), (0o600, False)])
def test_a_token_file_others_may_open_is_used_with_one_warning(
    env: pytest.MonkeyPatch, tmp_path: Path, mode: int, warned: bool
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(mode)
    env.setenv("MEMVAULT_TRANSIT_TOKEN_FILE", str(token_file))
    warnings: list[str] = []
    assert credentials(warnings.append).token == TOKEN
    assert len(warnings) == int(warned)
    if warned:
        assert f"mode {mode:04o}" in warnings[0] and f"chmod 600 {token_file}" in warnings[0]
        assert TOKEN not in warnings[0]


def test_a_named_token_file_that_is_missing_or_empty_is_refused(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env.setenv("MEMVAULT_TRANSIT_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(BadInput, match="does not exist"):
        credentials()
    (tmp_path / "empty").write_text("\n")
    env.setenv("MEMVAULT_TRANSIT_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(BadInput, match="does not hold one token"):
        credentials()


def test_without_hvac_the_fix_is_the_transit_extra(
    env: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "hvac", None)  # as if not installed
    transit = Transit("k", addr="http://127.0.0.1:1", creds=Credentials("t", token=TOKEN))
    with pytest.raises(KeySourceUnavailable) as caught:
        transit.check_usable()
    assert caught.value.exit_code == EXIT_KEY
    assert "pip install 'memvault[transit]'" in caught.value.message


@pytest.mark.parametrize("name", ["", "a/b", "../k", "k k", "x" * 129])
def test_a_key_name_that_is_not_one_path_segment_is_refused(name: str) -> None:
    with pytest.raises(BadInput):
        Transit(name, addr="http://127.0.0.1:1")


def test_a_damaged_wrapped_key_is_refused_before_it_is_sent() -> None:
    assert wrapped_version("vault:v12:abc=") == 12
    with pytest.raises(KeyProblem, match="damaged"):
        wrapped_version("vault:vx:abc")


def test_the_keyring_source_keeps_a_key_version_by_vault_and_kid() -> None:
    master = crypto.generate_key()
    kid = crypto.key_id(master)
    source: KeySource = KeyringSource()
    source.check_usable()
    assert source.name == "keyring" and "keyring" in source.where()
    assert source.get("transit-test-vault", kid) is None
    source.put("transit-test-vault", kid, master)
    try:
        assert source.get("transit-test-vault", kid) == master
    finally:
        assert source.delete("transit-test-vault", kid) is True
    assert source.get("transit-test-vault", kid) is None


def test_the_transit_source_is_a_key_source() -> None:
    class Nowhere:
        def load(self, vault_id: str, kid: str) -> str | None:
            return None

        def save(self, vault_id: str, kid: str, wrapped: str) -> None:
            raise AssertionError("nothing is saved here")

        def drop(self, vault_id: str, kid: str) -> bool:
            return False

    source: KeySource = TransitKeySource(Transit("k", addr="http://127.0.0.1:1"), Nowhere())
    assert source.name == "transit:k" and "mount transit" in source.where()
    assert source.get("v", "mv1:0000000000000000") is None  # nothing stored: nothing asked
