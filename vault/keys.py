"""The master key in the OS keyring (service `memvault`, username = vault id).

Only this module talks to `keyring`. Every keyring failure becomes a
`KeyProblem` (exit 4) whose message names the backend and the fix; a missing
or unusable entry is never a reason to make a new key (only `init` does).
"""

from __future__ import annotations

from typing import Any

from . import crypto
from .errors import KeyMissing, KeyProblem, KeyringLocked, KeyringUnavailable

SERVICE = "memvault"
PENDING_SUFFIX = ".next"
# `<vault_id>.replaced.<kid>`: a key moved aside by `key import`, never deleted by it.
ASIDE_INFIX = ".replaced."

_HOW_TO_GET_A_KEYRING = (
    "install and unlock an OS keyring (macOS Keychain, Windows Credential Locker, "
    "GNOME Keyring or KWallet through Secret Service), or select one with "
    "PYTHON_KEYRING_BACKEND"
)


def _backend_name(backend: Any) -> str:
    cls = type(backend)
    return f"{cls.__module__}.{cls.__qualname__}"


class KeyStore:
    """A thin, error-translating wrapper over one keyring backend."""

    def __init__(self, backend: Any | None = None) -> None:
        import keyring  # deferred: keyring discovers backends on import (~0.1 s)

        self._backend = backend if backend is not None else keyring.get_keyring()
        self.name = _backend_name(self._backend)

    def check_usable(self) -> None:
        mod = type(self._backend).__module__
        if mod == "keyring.backends.fail":
            raise KeyringUnavailable(f"no OS keyring backend is available; {_HOW_TO_GET_A_KEYRING}")
        if mod == "keyring.backends.null":
            raise KeyringUnavailable(
                "the keyring is disabled (keyring's null backend is selected, so no key can be "
                f"stored or read); {_HOW_TO_GET_A_KEYRING}"
            )

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        import keyring.errors as kerr

        self.check_usable()
        try:
            return fn(*args)
        except kerr.KeyringLocked as exc:
            raise KeyringLocked(
                f"the keyring ({self.name}) is locked and could not be unlocked while trying to "
                f"{what}; unlock it (log in to the desktop session, or unlock the collection) "
                "and try again"
            ) from exc
        except kerr.NoKeyringError as exc:
            raise KeyringUnavailable(
                f"no OS keyring backend is available; {_HOW_TO_GET_A_KEYRING}"
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

    # Reads ---------------------------------------------------------------
    def get(self, vault_id: str) -> str | None:
        value = self._read("read the vault key", vault_id)
        return value if isinstance(value, str) else None

    def get_pending(self, vault_id: str) -> str | None:
        value = self._read("read the pending key", vault_id + PENDING_SUFFIX)
        return value if isinstance(value, str) else None

    def _read(self, what: str, name: str) -> Any:
        # Secret Service reads are a search, then a fetch of the item found: another
        # process deleting the entry in between (a rotation dropping its `.next`) makes
        # the fetch fail. That is a miss, not a broken keyring: search again.
        for attempt in range(5):
            try:
                return self._call(what, self._backend.get_password, SERVICE, name)
            except KeyringUnavailable as exc:
                if not _vanished(exc) or attempt == 4:
                    raise
        return None

    # Writes --------------------------------------------------------------
    def set(self, vault_id: str, key: str) -> None:
        self._call("store the vault key", self._backend.set_password, SERVICE, vault_id, key)
        self._verify(vault_id, key)

    def set_pending(self, vault_id: str, key: str) -> None:
        name = vault_id + PENDING_SUFFIX
        self._call("store the pending key", self._backend.set_password, SERVICE, name, key)
        self._verify(name, key)

    def set_aside(self, vault_id: str, kid: str, key: str) -> None:
        """Keep a key that is being replaced, under a name that says which it was."""
        name = f"{vault_id}{ASIDE_INFIX}{kid}"
        self._call("keep the replaced key", self._backend.set_password, SERVICE, name, key)
        self._verify(name, key)

    def _verify(self, name: str, key: str) -> None:
        # A backend that accepts a write but cannot give it back would lose the history.
        back = self._read("read back the key", name)
        if back != key:
            raise KeyProblem(
                f"the keyring ({self.name}) did not return the key it was just given; "
                "use a keyring that persists entries"
            )

    def delete(self, vault_id: str) -> bool:
        return self._delete(vault_id)

    def delete_pending(self, vault_id: str) -> bool:
        return self._delete(vault_id + PENDING_SUFFIX)

    def _delete(self, name: str) -> bool:
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


def require_key(value: str | None, vault_id: str, backend: str) -> str:
    """Reject an absent, empty or malformed entry instead of inventing a key."""
    if value is None:
        raise KeyMissing(
            f"the keyring ({backend}) has no key for vault {vault_id}; if you moved to a new "
            "machine run `memvault key import KIT` with your recovery kit, otherwise the "
            "history cannot be read"
        )
    if not crypto.is_valid_key(value):
        raise KeyMissing(
            f"the keyring entry memvault/{vault_id} ({backend}) is empty or is not a memvault "
            "key; restore it with `memvault key import KIT`"
        )
    return value
