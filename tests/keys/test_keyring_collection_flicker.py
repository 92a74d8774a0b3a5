"""GNOME Keyring's default collection can seem to vanish for a moment.

While other clients store and delete entries, gnome-keyring-daemon can answer that
its `default` alias names no collection. keyring then asks it to create one, which a
headless daemon refuses ("Prompt dismissed"). That failed a reader during rotations in
a test run. Here the real daemon is made to say it, by removing the alias (the Secret
Service's SetAlias to "/") before a call of the real backend; a default collection
really missing is a second private keyring whose login collection is deleted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keyring
import pytest
from secretstorage.defines import SS_PATH, SS_PREFIX
from secretstorage.exceptions import ItemNotFoundException
from secretstorage.util import DBusAddressWrapper

from tests.keys.test_keyring_edges import in_another_private_keyring
from vault import secretservice
from vault.errors import KeyringUnavailable
from vault.keys import SERVICE, KeyStore

pytestmark = pytest.mark.secret_service

NAME = "mv-flicker/mv1:0000000000000000"
VALUE = "the stored key"


@pytest.fixture
def alias() -> Iterator[Any]:
    """Remove and restore the real daemon's `default` alias."""
    conn = secretservice.connect()
    service = DBusAddressWrapper(SS_PATH, SS_PREFIX + "Service", conn)
    (login,) = service.call("ReadAlias", "s", "default")
    assert login != "/", "the private keyring has a default collection to begin with"

    class Alias:
        def remove(self) -> None:
            service.call("SetAlias", "so", "default", "/")

        def restore(self) -> None:
            service.call("SetAlias", "so", "default", login)

    try:
        yield Alias()
    finally:
        Alias().restore()
        conn.close()


class AliasGoneFor:
    """The real Secret Service backend, whose first `gone` calls run with the default
    alias removed (the daemon points it back at its login collection as it fails)."""

    def __init__(self, alias: Any, gone: int) -> None:
        self.real, self.alias, self.gone, self.calls = keyring.get_keyring(), alias, gone, 0

    def _around(self, fn: Any, *args: Any) -> Any:
        self.calls += 1
        if self.calls > self.gone:
            return fn(*args)
        # Removed once the call's connection is registered: the daemon points the alias
        # back at its login collection as it registers a new client, and memvault's
        # connections register before their first use (vault.secretservice).
        real = secretservice.register

        def register_then_remove(conn: Any) -> None:
            real(conn)
            self.alias.remove()

        secretservice.register = register_then_remove
        try:
            return fn(*args)
        finally:
            secretservice.register = real

    def get_password(self, service: str, username: str) -> Any:
        return self._around(self.real.get_password, service, username)

    def set_password(self, service: str, username: str, password: str) -> None:
        self._around(self.real.set_password, service, username, password)


def test_a_read_survives_the_default_collection_vanishing_for_a_moment(alias: Any) -> None:
    keyring.set_password(SERVICE, NAME, VALUE)
    backend = AliasGoneFor(alias, gone=2)
    assert KeyStore(backend=backend).get(NAME) == VALUE
    assert backend.calls == 3


def test_a_store_survives_the_default_collection_vanishing_for_a_moment(alias: Any) -> None:
    backend = AliasGoneFor(alias, gone=1)
    KeyStore(backend=backend).set(NAME + "-stored", VALUE)
    assert keyring.get_password(SERVICE, NAME + "-stored") == VALUE


NO_DEFAULT_COLLECTION = """
cd "$1"
python - <<'P'
import keyring, secretstorage
from tests.keys.test_keyring_edges import in_another_private_keyring
from vault import secretservice
from vault.errors import KeyringUnavailable
from vault.keys import KeyStore
conn = secretservice.connect()
for collection in secretstorage.get_all_collections(conn):
    if collection.collection_path.endswith("/login"):
        collection.delete()
calls = []
real = secretservice.adopt(keyring.get_keyring())
class Counting:
    def get_password(self, service, username):
        calls.append(1)
        return real.get_password(service, username)
try:
    KeyStore(backend=Counting()).get("mv-x/mv1:0000000000000000")
except KeyringUnavailable as exc:
    print("error:", exc)
print("calls:", len(calls))
P
"""


@pytest.mark.secret_service
def test_a_default_collection_really_missing_fails_at_once_without_asking_again(
    tmp_path: Path,
) -> None:
    # Its own private keyring: deleting the login collection must not touch the suite's.
    proc = in_another_private_keyring(NO_DEFAULT_COLLECTION, tmp_path / "unused.db")
    lines = proc.stdout.splitlines()
    assert lines[-1] == "calls: 1", proc  # a person who dismissed a real prompt is not asked again
    (error,) = [line for line in lines if line.startswith("error: ")]
    assert "failed to read the vault key: InitError: Failed to create the collection" in error
    assert "Traceback" not in proc.stderr, proc.stderr


class StoredThenItemGone:
    """A store whose item path the daemon reuses: stored, then the item is gone when
    keyring reads its label (seen with two clients storing and deleting at once)."""

    def __init__(self, fails: int) -> None:
        self.real, self.fails, self.calls = keyring.get_keyring(), fails, 0

    def get_password(self, service: str, username: str) -> Any:
        return self.real.get_password(service, username)

    def set_password(self, service: str, username: str, password: str) -> None:
        self.calls += 1
        self.real.set_password(service, username, password)
        if self.calls <= self.fails:
            raise ItemNotFoundException("Item does not exist!")


def test_a_store_whose_item_vanished_as_it_was_made_is_stored_again() -> None:
    backend = StoredThenItemGone(fails=2)
    KeyStore(backend=backend).set(NAME + "-again", VALUE)
    assert backend.calls == 3
    assert keyring.get_password(SERVICE, NAME + "-again") == VALUE


def test_a_store_that_keeps_vanishing_is_a_keyring_failure_after_five_tries() -> None:
    backend = StoredThenItemGone(fails=99)
    with pytest.raises(KeyringUnavailable, match="failed to store a key"):
        KeyStore(backend=backend).set(NAME + "-never", VALUE)
    assert backend.calls == 5
