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

from typing import Any

from keyring.backends import SecretService


def connect() -> Any:
    """A new D-Bus connection to the Secret Service (jeepney's), registered with the
    daemon by a first call whose answer does not matter. The caller closes it."""
    import secretstorage
    from jeepney import new_method_call
    from secretstorage.defines import SS_PATH, SS_PREFIX
    from secretstorage.util import DBusAddressWrapper

    conn = secretstorage.dbus_init()
    try:
        service = DBusAddressWrapper(SS_PATH, SS_PREFIX + "Service", conn)
        service.send_and_get_reply(new_method_call(service, "ReadAlias", "s", ("default",)))
    except BaseException:
        conn.close()
        raise
    return conn


class Keyring(SecretService.Keyring):
    """keyring's Secret Service backend, each of its connections opened by `connect`."""

    def get_preferred_collection(self) -> Any:
        # keyring's own, but for the connection: same collection, same errors.
        import secretstorage
        from keyring.errors import InitError, KeyringLocked
        from secretstorage.exceptions import SecretStorageException

        try:
            bus = connect()
        except SecretStorageException as exc:
            raise InitError(f"Failed to create the collection: {exc}.") from exc
        try:
            if hasattr(self, "preferred_collection"):
                collection = secretstorage.Collection(bus, self.preferred_collection)
            else:
                collection = secretstorage.get_default_collection(bus)
        except SecretStorageException as exc:
            bus.close()
            raise InitError(f"Failed to create the collection: {exc}.") from exc
        if collection.is_locked():
            collection.unlock()
            if collection.is_locked():  # the person dismissed the prompt
                bus.close()
                raise KeyringLocked("Failed to unlock the collection!")
        return collection


def adopt(backend: Any) -> Any:
    """`backend`, or, when it is keyring's own Secret Service backend, the same backend
    (its settings kept) opening its connections by `connect`."""
    if type(backend) is not SecretService.Keyring:
        return backend
    ours = Keyring.__new__(Keyring)
    ours.__dict__.update(backend.__dict__)
    return ours
