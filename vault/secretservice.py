"""The Secret Service (GNOME Keyring, KWallet) entered so that its daemon cannot abort.

gnome-keyring-daemon records each D-Bus client in an idle callback that its message
filter queues for every incoming message, and it can dispatch a new connection's first
message before that callback has run (seen with 42.1, and reported up to 50). Met that
way, a method call only fails: ReadAlias answers "/", and a collection's path is "not
found", which keyring reports as a missing default collection. A property read, though,
finds no client, returns nothing without an error, and GLib aborts the whole daemon
("invoke_get_property_in_idle_cb: assertion failed"), ending every application's
keyring session. secretstorage's first message on a connection is such a read (the
collection's Label), and keyring opens a new connection for every operation.

So every connection memvault opens asks ReadAlias first and ignores the answer: the race
then lands on that call, and the reads after it find the client registered.
`scripts/keyring-abort-race` measures the difference in a private keyring.
"""

from __future__ import annotations

import contextlib
from typing import Any

from keyring.backends import SecretService


def register(conn: Any) -> None:
    """Have the daemon register this connection's client, by a call whose answer does
    not matter: a provider that refuses it (one without ReadAlias) is as good. Only a
    Secret Service that cannot be reached raises (secretstorage's exception)."""
    from jeepney import new_method_call
    from jeepney.wrappers import DBusErrorResponse
    from secretstorage.defines import SS_PATH, SS_PREFIX
    from secretstorage.exceptions import ItemNotFoundException
    from secretstorage.util import DBusAddressWrapper

    service = DBusAddressWrapper(SS_PATH, SS_PREFIX + "Service", conn)
    with contextlib.suppress(ItemNotFoundException, DBusErrorResponse):
        service.send_and_get_reply(new_method_call(service, "ReadAlias", "s", ("default",)))


def connect() -> Any:
    """A new D-Bus connection to the Secret Service (jeepney's), registered. The caller
    closes it."""
    import secretstorage

    conn = secretstorage.dbus_init()
    try:
        register(conn)
    except BaseException:
        conn.close()
        raise
    return conn


class Keyring(SecretService.Keyring):
    """keyring's Secret Service backend, each of its connections registered first."""

    adapts = SecretService.Keyring  # what vault.keybackend names it as

    def get_preferred_collection(self) -> Any:
        # keyring's own, but for `register`: same collection, same errors.
        import secretstorage
        from keyring.errors import InitError, KeyringLocked
        from secretstorage.exceptions import SecretStorageException

        bus = secretstorage.dbus_init()
        try:  # every way out but the collection's return closes the connection
            try:
                register(bus)
                if hasattr(self, "preferred_collection"):
                    collection = secretstorage.Collection(bus, self.preferred_collection)
                else:
                    collection = secretstorage.get_default_collection(bus)
            except SecretStorageException as exc:
                raise InitError(f"Failed to create the collection: {exc}.") from exc
            if collection.is_locked():
                collection.unlock()
                if collection.is_locked():  # the person dismissed the prompt
                    raise KeyringLocked("Failed to unlock the collection!")
        except BaseException:
            bus.close()
            raise
        return collection


# keyring registers every backend class it sees: this one is not a choice of its own
# (it would be chained beside the class it adapts), only what `adopt` makes.
SecretService.Keyring._classes.discard(Keyring)


def adopt(backend: Any) -> Any:
    """`backend`, or, when it is keyring's own Secret Service backend (exactly: a
    subclass of it is someone's choice, left as it is), the same backend, its settings
    kept, registering its connections first."""
    if type(backend) is not SecretService.Keyring:
        return backend
    ours = Keyring.__new__(Keyring)
    ours.__dict__.update(backend.__dict__)
    return ours
