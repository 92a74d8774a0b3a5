"""Which keyring backend memvault uses, and why it refuses some.

keyring's own choice (`PYTHON_KEYRING_BACKEND`, its config file, or the best found),
minus backends that do not protect a secret, and the messages that say why a backend
cannot start, each naming the fix. `vault.keys` calls into whatever this returns.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from vault.errors import KeyProblem, KeyringUnavailable

ENV_BACKEND = "PYTHON_KEYRING_BACKEND"  # keyring's own variable


# Backends that store nothing, or keep the secret in a file of their own instead of an
# OS keyring: keyrings.alt's PlaintextKeyring in the clear, its EncryptedKeyring behind a
# password it asks for on the terminal (a copied file can be attacked offline), and the
# other file-based ones. Judged by module over the class's MRO, so subclasses go too;
# anything else (macOS, Windows, Secret Service, KWallet, third-party) is accepted.
DISABLED = {
    "keyring.backends.fail": "no OS keyring backend is available",
    "keyring.backends.null": (
        "the keyring is disabled (keyring's null backend is selected, so no key can be "
        "stored or read)"
    ),
}
_FILE_BASED = ("keyrings.alt.file", "keyrings.alt.file_base")
_PLAINTEXT_REASON = (
    "it writes the key unencrypted to a file in your home folder, where anyone who can read "
    "your files (a backup, a copied disk) gets it"
)
_FILE_REASON = (
    "it keeps the key in a file of its own in your home folder, protected by a password "
    "typed at a prompt instead of by the OS keyring, so a copy of that file can be attacked "
    "offline"
)
_CHAINER = "keyring.backends.chainer"
SECRET_SERVICE_FIX = (
    "run memvault in a desktop session with an unlocked keyring, or (on a server or over "
    "SSH) through the memvault-headless script, which starts a private one with "
    "`dbus-run-session` and `gnome-keyring-daemon --unlock` from a passphrase file: see "
    "docs/headless.md"
)


def how_to_get_a_keyring() -> str:
    if sys.platform.startswith("linux") and not os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        # The usual reason on Linux: no session bus, so no Secret Service to find.
        return (
            "there is no D-Bus session (DBUS_SESSION_BUS_ADDRESS is not set), which the "
            f"Secret Service keyring needs; {SECRET_SERVICE_FIX}"
        )
    return (
        "install and unlock an OS keyring (macOS Keychain, Windows Credential Locker, "
        "GNOME Keyring or KWallet through Secret Service), or select one with "
        f"{ENV_BACKEND}"
    )


def backend_name(backend: Any) -> str:
    if isinstance(backend, ProtectedChain):
        return backend.name
    cls = getattr(type(backend), "adapts", type(backend))  # memvault's adapter: what it adapts
    return f"{cls.__module__}.{cls.__qualname__}"


def refusal(backend: Any) -> str | None:
    """Why memvault will not keep a key in this backend, or None if it will."""
    mro = type(backend).__mro__
    for cls in mro:
        if cls.__module__ in DISABLED:
            return DISABLED[cls.__module__]
    if any(cls.__module__ in _FILE_BASED for cls in mro):
        plain = any("Plaintext" in cls.__name__ for cls in mro)
        return _PLAINTEXT_REASON if plain else _FILE_REASON
    inner = getattr(backend, "_keyring", None)  # keyrings.alt.multi wraps another backend
    if type(backend).__module__ == "keyrings.alt.multi" and inner is not None:
        return refusal(inner)
    return None


class ProtectedChain:
    """keyring's chainer (reads try each backend, writes go to the first that takes
    them) over only the chained backends that protect secrets."""

    def __init__(self, backends: list[Any]) -> None:
        self.backends = backends
        names = ", ".join(backend_name(b) for b in backends)
        self.name = f"{_CHAINER}.ChainerBackend({names})"

    def get_password(self, service: str, username: str) -> Any:
        for backend in self.backends:
            value = backend.get_password(service, username)
            if value is not None:
                return value
        return None

    def set_password(self, service: str, username: str, password: str) -> None:
        for backend in self.backends:
            try:
                backend.set_password(service, username, password)
                return
            except NotImplementedError:
                pass

    def delete_password(self, service: str, username: str) -> None:
        for backend in self.backends:
            try:
                backend.delete_password(service, username)
                return
            except NotImplementedError:
                pass


def find_backend() -> Any:
    """keyring's choice (PYTHON_KEYRING_BACKEND, its config file, or the best found)."""
    import keyring
    from keyring.backends import fail

    wanted = os.environ.get(ENV_BACKEND)
    if wanted is not None:  # set, even empty: keyring would try to import it
        _check_backend_name(wanted)
    try:
        backend: Any = keyring.get_keyring()
    except Exception as exc:
        raise start_failure(wanted, exc) from exc
    from vault.secretservice import adopt  # keyring's Secret Service, its daemon kept alive

    if type(backend).__module__ == _CHAINER:
        kept = [b for b in backend.backends if refusal(b) is None]
        if not kept:
            # Judged as the backend the chain writes to; refused below with its reason.
            return backend.backends[0] if backend.backends else fail.Keyring()  # type: ignore[no-untyped-call]
        adopted = [adopt(b) for b in kept]
        if len(kept) < len(backend.backends) or adopted != kept:
            return ProtectedChain(adopted)
    return adopt(backend)


def _check_backend_name(wanted: str) -> None:
    """A mistyped PYTHON_KEYRING_BACKEND: say so, instead of an import error."""
    import importlib

    module_name, _, class_name = wanted.strip().rpartition(".")
    problem = None
    try:
        module = importlib.import_module(module_name) if module_name else None
    except ImportError as exc:
        problem = f"module {exc.name or module_name} cannot be imported"
    except Exception as exc:  # the module itself is broken
        problem = f"importing {module_name} fails with {type(exc).__name__}"
    else:
        if module is None:
            problem = "it is not a dotted module.Class name"
        elif not isinstance(getattr(module, class_name, None), type):
            problem = f"module {module_name} has no class {class_name}"
    if problem is not None:
        raise KeyringUnavailable(
            f"{ENV_BACKEND}={wanted!r} does not name a keyring backend ({problem}); set it to "
            "a backend class such as keyring.backends.SecretService.Keyring (`keyring "
            "--list-backends` lists them), or unset it"
        )


def start_failure(wanted: str | None, exc: Exception) -> KeyProblem:
    """Why keyring could not set up its backend, said for the person at the terminal."""
    what = f"the keyring backend {wanted}" if wanted else "the keyring"
    text = safe(exc)
    bus = os.environ.get("DBUS_SESSION_BUS_ADDRESS")
    if "DBUS_SESSION_BUS_ADDRESS" in text or (not bus and "SecretService" in (wanted or "")):
        return KeyringUnavailable(
            f"{what} cannot start: there is no D-Bus session (DBUS_SESSION_BUS_ADDRESS is not "
            f"set), which the Secret Service needs; {SECRET_SERVICE_FIX}"
        )
    unreachable = ("neither running nor activatable", "Unable to initialize SecretService")
    if isinstance(exc, OSError) or any(part in text for part in unreachable):
        where = f"DBUS_SESSION_BUS_ADDRESS={bus}" if bus else "the D-Bus session bus"
        return KeyringUnavailable(
            f"{what} cannot start: no Secret Service answers at {where} "
            f"({type(exc).__name__}: {text}); {SECRET_SERVICE_FIX}"
        )
    return KeyringUnavailable(
        f"{what} cannot start ({type(exc).__name__}: {text}); {how_to_get_a_keyring()}"
    )


def safe(exc: BaseException) -> str:
    """An exception's text on one line; keyring errors never contain the secret."""
    return " ".join(str(exc).split())[:200] or "no details"


def vanished(exc: BaseException) -> bool:
    """The keyring failed because an item it had just found was deleted meanwhile."""
    return type(exc.__cause__).__name__ == "ItemNotFoundException"  # secretstorage's


def default_collection_flickered(exc: BaseException) -> bool:
    """Whether keyring's failure to reach the default collection was a passing one.

    GNOME Keyring, while other clients store and delete entries, can answer for a moment
    that its `default` alias names no collection (seen with 42.1: `ItemNotFoundException`
    on the alias). keyring then asks the daemon to create one, which a headless daemon
    refuses ("Prompt dismissed"), and says so as an InitError. True when that was the
    failure and the alias resolves again now; False when the default collection is
    really missing, so a person who dismissed a real prompt is not asked again.
    """
    try:
        import secretstorage
        from secretstorage.exceptions import SecretStorageException
    except ImportError:  # not the Secret Service backend
        return False
    if not isinstance(exc.__cause__, SecretStorageException):
        return False
    from vault.secretservice import connect

    try:
        bus = connect()
    except SecretStorageException:
        return False
    try:
        secretstorage.Collection(bus)  # the default alias; reads its label
    except SecretStorageException:
        return False
    finally:
        bus.close()
    return True
