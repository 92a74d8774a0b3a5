"""The master keys in the OS keyring: service `memvault`, one entry per key version.

The entries' names (`<vault_id>/<kid>`) and which ones exist are the business
of `vault.keyjournal`; this module reads, stores and deletes one named entry.

Only this module talks to `keyring`. Every keyring failure becomes a
`KeyProblem` (exit 4) whose message names the backend and the fix; a missing
or unusable entry is never a reason to make a new key (only `init` does).
Every call into the backend, finding it included, has a deadline
(`MEMVAULT_KEYRING_TIMEOUT`), and backends that do not protect a secret
(keyring's null and fail, keyrings.alt's files) are refused.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from vault import crypto
from vault.errors import (
    BadInput,
    KeyMismatch,
    KeyMissing,
    KeyProblem,
    KeyringLocked,
    KeyringUnavailable,
)

SERVICE = "memvault"

ENV_BACKEND = "PYTHON_KEYRING_BACKEND"  # keyring's own variable
ENV_TIMEOUT = "MEMVAULT_KEYRING_TIMEOUT"
DEFAULT_TIMEOUT = 10.0
MAX_TIMEOUT = 3600.0

# Backends that store nothing, or keep the secret in a file of their own instead of an
# OS keyring: keyrings.alt's PlaintextKeyring in the clear, its EncryptedKeyring behind a
# password it asks for on the terminal (a copied file can be attacked offline), and the
# other file-based ones. Judged by module over the class's MRO, so subclasses go too;
# anything else (macOS, Windows, Secret Service, KWallet, third-party) is accepted.
_DISABLED = {
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
_SECRET_SERVICE_FIX = (
    "run memvault in a desktop session with an unlocked keyring, or (on a server or over "
    "SSH) through the memvault-headless script, which starts a private one with "
    "`dbus-run-session` and `gnome-keyring-daemon --unlock` from a passphrase file: see "
    "docs/headless.md"
)


def _how_to_get_a_keyring() -> str:
    if sys.platform.startswith("linux") and not os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        # The usual reason on Linux: no session bus, so no Secret Service to find.
        return (
            "there is no D-Bus session (DBUS_SESSION_BUS_ADDRESS is not set), which the "
            f"Secret Service keyring needs; {_SECRET_SERVICE_FIX}"
        )
    return (
        "install and unlock an OS keyring (macOS Keychain, Windows Credential Locker, "
        "GNOME Keyring or KWallet through Secret Service), or select one with "
        f"{ENV_BACKEND}"
    )


def keyring_timeout() -> float:
    """Seconds any one keyring call may take before memvault gives up (exit 4)."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT:  # NaN fails this too
        raise BadInput(
            f"{ENV_TIMEOUT}={raw!r} is not a number of seconds above 0 and at most "
            f"{MAX_TIMEOUT:g}; set it to e.g. 30, or unset it for the default of "
            f"{DEFAULT_TIMEOUT:g}"
        )
    return value


def _backend_name(backend: Any) -> str:
    if isinstance(backend, _ProtectedChain):
        return backend.name
    cls = type(backend)
    return f"{cls.__module__}.{cls.__qualname__}"


def _refusal(backend: Any) -> str | None:
    """Why memvault will not keep a key in this backend, or None if it will."""
    mro = type(backend).__mro__
    for cls in mro:
        if cls.__module__ in _DISABLED:
            return _DISABLED[cls.__module__]
    if any(cls.__module__ in _FILE_BASED for cls in mro):
        plain = any("Plaintext" in cls.__name__ for cls in mro)
        return _PLAINTEXT_REASON if plain else _FILE_REASON
    inner = getattr(backend, "_keyring", None)  # keyrings.alt.multi wraps another backend
    if type(backend).__module__ == "keyrings.alt.multi" and inner is not None:
        return _refusal(inner)
    return None


class _ProtectedChain:
    """keyring's chainer (reads try each backend, writes go to the first that takes
    them) over only the chained backends that protect secrets."""

    def __init__(self, backends: list[Any]) -> None:
        self.backends = backends
        names = ", ".join(_backend_name(b) for b in backends)
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


def _find_backend() -> Any:
    """keyring's choice (PYTHON_KEYRING_BACKEND, its config file, or the best found)."""
    import keyring
    from keyring.backends import fail

    wanted = os.environ.get(ENV_BACKEND)
    if wanted is not None:  # set, even empty: keyring would try to import it
        _check_backend_name(wanted)
    try:
        backend: Any = keyring.get_keyring()
    except Exception as exc:
        raise _start_failure(wanted, exc) from exc
    if type(backend).__module__ == _CHAINER:
        kept = [b for b in backend.backends if _refusal(b) is None]
        if kept and len(kept) < len(backend.backends):
            return _ProtectedChain(kept)
        if not kept:
            # Judged as the backend the chain writes to; refused below with its reason.
            return backend.backends[0] if backend.backends else fail.Keyring()  # type: ignore[no-untyped-call]
    return backend


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


def _start_failure(wanted: str | None, exc: Exception) -> KeyProblem:
    """Why keyring could not set up its backend, said for the person at the terminal."""
    what = f"the keyring backend {wanted}" if wanted else "the keyring"
    text = _safe(exc)
    bus = os.environ.get("DBUS_SESSION_BUS_ADDRESS")
    if "DBUS_SESSION_BUS_ADDRESS" in text or (not bus and "SecretService" in (wanted or "")):
        return KeyringUnavailable(
            f"{what} cannot start: there is no D-Bus session (DBUS_SESSION_BUS_ADDRESS is not "
            f"set), which the Secret Service needs; {_SECRET_SERVICE_FIX}"
        )
    unreachable = ("neither running nor activatable", "Unable to initialize SecretService")
    if isinstance(exc, OSError) or any(part in text for part in unreachable):
        where = f"DBUS_SESSION_BUS_ADDRESS={bus}" if bus else "the D-Bus session bus"
        return KeyringUnavailable(
            f"{what} cannot start: no Secret Service answers at {where} "
            f"({type(exc).__name__}: {text}); {_SECRET_SERVICE_FIX}"
        )
    return KeyringUnavailable(
        f"{what} cannot start ({type(exc).__name__}: {text}); {_how_to_get_a_keyring()}"
    )


class KeyStore:
    """A thin, error-translating wrapper over one keyring backend."""

    def __init__(self, backend: Any | None = None) -> None:
        import keyring  # noqa: F401  deferred: keyring discovers backends on import (~0.1 s)

        self.timeout = keyring_timeout()
        # After a call overran its deadline the keyring is not answering: every later
        # call fails at once with the same error instead of waiting again.
        self._broken: KeyProblem | None = None
        if backend is None:
            try:
                backend = self._within_deadline("find the keyring backend", _find_backend)
            except KeyProblem as exc:
                self._broken = exc
                self._backend: Any = None
                self.name = os.environ.get(ENV_BACKEND) or "no keyring backend"
                return
        self._backend = backend
        self.name = _backend_name(backend)

    def check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        reason = _refusal(self._backend)
        if reason is None:
            return
        if any(cls.__module__ in _DISABLED for cls in type(self._backend).__mro__):
            raise KeyringUnavailable(f"{reason}; {_how_to_get_a_keyring()}")
        chosen = (
            f"{ENV_BACKEND} selects it"
            if os.environ.get(ENV_BACKEND)
            else "keyring chose it, finding nothing better"
        )
        raise KeyringUnavailable(
            f"memvault refuses the keyring backend {self.name} ({chosen}): {reason}; "
            f"{_how_to_get_a_keyring()}"
        )

    def _within_deadline(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a daemon thread: a hung keyring daemon cannot hang memvault,
        nor keep the process from exiting afterwards."""
        if self._broken is not None:
            raise self._broken
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller's thread
                outcome["error"] = exc

        worker = threading.Thread(target=run, name="memvault-keyring", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            self._broken = KeyringUnavailable(
                f"the keyring ({getattr(self, 'name', None) or 'its backend'}) did not answer "
                f"within {self.timeout:g} s while trying to {what}; check that the keyring "
                f"service is running and unlocked, or allow it longer with {ENV_TIMEOUT}"
            )
            raise self._broken
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        import keyring.errors as kerr

        self.check_usable()
        try:
            return self._within_deadline(what, fn, *args)
        except KeyProblem:
            raise
        except kerr.KeyringLocked as exc:
            raise KeyringLocked(
                f"the keyring ({self.name}) is locked and could not be unlocked while trying to "
                f"{what}; unlock it (log in to the desktop session, or unlock the collection) "
                "and try again"
            ) from exc
        except kerr.NoKeyringError as exc:
            raise KeyringUnavailable(
                f"no OS keyring backend is available; {_how_to_get_a_keyring()}"
            ) from exc
        except kerr.KeyringError as exc:
            raise KeyringUnavailable(
                f"the keyring ({self.name}) failed to {what}: {type(exc).__name__}: "
                f"{_safe(exc)}; check that the keyring service is running and unlocked"
            ) from exc
        except Exception as exc:  # D-Bus and OS errors surface as anything
            raise KeyringUnavailable(
                f"the keyring ({self.name}) failed to {what}: {type(exc).__name__}: "
                f"{_safe(exc)}; check that the keyring service is running and unlocked"
            ) from exc

    # One named entry -----------------------------------------------------
    def get(self, name: str) -> str | None:
        """The entry's secret, or None when there is none."""
        value = self._read("read the vault key", name)
        return value if isinstance(value, str) else None

    def _read(self, what: str, name: str) -> Any:
        # Secret Service reads are a search, then a fetch of the item found: another
        # process deleting the entry in between (a rotation dropping a retired key)
        # makes the fetch fail. That is a miss, not a broken keyring: search again.
        for attempt in range(5):
            try:
                return self._call(what, self._backend.get_password, SERVICE, name)
            except KeyringUnavailable as exc:
                if not _vanished(exc):
                    raise
            time.sleep(0.05 * (attempt + 1))  # the daemon's index may lag the deletion
        return None  # found, then gone every time: deleted, so it is not there

    def set(self, name: str, key: str) -> None:
        """Store a key, and read it back: a backend that accepts a write but cannot
        give it back would lose the history."""
        self._call("store a key", self._backend.set_password, SERVICE, name, key)
        if self._read("read back the key", name) != key:
            raise KeyProblem(
                f"the keyring ({self.name}) did not return the key it was just given; "
                "use a keyring that persists entries"
            )

    def delete(self, name: str) -> bool:
        """Delete an entry; True if one was there. Missing is not an error."""
        import keyring.errors as kerr

        if self._read("look up a key", name) is None:
            return False
        try:
            self._call("delete a key", self._backend.delete_password, SERVICE, name)
        except KeyringUnavailable as exc:
            # Deleted by another process meanwhile (before or after our search): gone is gone.
            if isinstance(exc.__cause__, kerr.PasswordDeleteError) or _vanished(exc):
                return False
            raise
        if self._read("look up a key", name) is not None:
            raise KeyProblem(f"the keyring ({self.name}) kept the key after deleting it; try again")
        return True


def _vanished(exc: BaseException) -> bool:
    """The keyring failed because the entry it had just found was deleted meanwhile."""
    return type(exc.__cause__).__name__ == "ItemNotFoundException"  # secretstorage's


def _safe(exc: BaseException) -> str:
    """An exception's text on one line; keyring errors never contain the secret."""
    return " ".join(str(exc).split())[:200] or "no details"


def require_key(value: str | None, vault_id: str, kid: str, backend: str) -> str:
    """Reject an absent, empty or malformed entry, or another key, instead of inventing one."""
    if value is None:
        raise KeyMissing(
            f"the keyring ({backend}) has no key {kid} for vault {vault_id}; if you moved to "
            "a new machine, or this is a copy from before a rotation, run `memvault key "
            "import KIT` with the recovery kit of that key, otherwise the history cannot be read"
        )
    if not crypto.is_valid_key(value):
        raise KeyMissing(
            f"the keyring entry for key {kid} of vault {vault_id} ({backend}) is empty or is "
            "not a memvault key; restore it with `memvault key import KIT`"
        )
    if crypto.key_id(value) != kid:
        raise KeyMismatch(
            f"the keyring entry for key {kid} of vault {vault_id} ({backend}) holds another "
            f"key ({crypto.key_id(value)}); nothing was read or written; restore the right "
            "one with `memvault key import KIT`"
        )
    return value
