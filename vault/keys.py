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
from vault.keybackend import (
    DISABLED,
    ENV_BACKEND,
    backend_name,
    default_collection_flickered,
    find_backend,
    how_to_get_a_keyring,
    refusal,
    safe,
    vanished,
)

SERVICE = "memvault"

ENV_TIMEOUT = "MEMVAULT_KEYRING_TIMEOUT"
DEFAULT_TIMEOUT = 10.0
MAX_TIMEOUT = 3600.0


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
                backend = self._within_deadline("find the keyring backend", find_backend)
            except KeyProblem as exc:
                self._broken = exc
                self._backend: Any = None
                self.name = os.environ.get(ENV_BACKEND) or "no keyring backend"
                return
        self._backend = backend
        self.name = backend_name(backend)

    def check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        reason = refusal(self._backend)
        if reason is None:
            return
        if any(cls.__module__ in DISABLED for cls in type(self._backend).__mro__):
            raise KeyringUnavailable(f"{reason}; {how_to_get_a_keyring()}")
        chosen = (
            f"{ENV_BACKEND} selects it"
            if os.environ.get(ENV_BACKEND)
            else "keyring chose it, finding nothing better"
        )
        raise KeyringUnavailable(
            f"memvault refuses the keyring backend {self.name} ({chosen}): {reason}; "
            f"{how_to_get_a_keyring()}"
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

    def _call(
        self, what: str, fn: Any, *args: Any, also: Callable[[Exception], bool] | None = None
    ) -> Any:
        """fn(*args), within the deadline, its failure translated; tried again (five
        tries in all) while GNOME Keyring's default collection flickers away under other
        clients' writes, or while also(the failure) says it is a passing one."""
        for attempt in range(4):
            try:
                return self._call_once(what, fn, *args)
            except KeyringUnavailable as exc:
                if not (self._flickered(exc) or (also is not None and also(exc))):
                    raise
            time.sleep(0.05 * (attempt + 1))
        return self._call_once(what, fn, *args)

    def _flickered(self, exc: KeyProblem) -> bool:
        cause = exc.__cause__
        if cause is None or type(cause).__name__ != "InitError":
            return False  # only keyring's "cannot reach the collection" is worth a look
        return bool(
            self._within_deadline(
                "check the default collection", default_collection_flickered, cause
            )
        )

    def _call_once(self, what: str, fn: Any, *args: Any) -> Any:
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
                f"no OS keyring backend is available; {how_to_get_a_keyring()}"
            ) from exc
        except kerr.KeyringError as exc:
            raise KeyringUnavailable(
                f"the keyring ({self.name}) failed to {what}: {type(exc).__name__}: "
                f"{safe(exc)}; check that the keyring service is running and unlocked"
            ) from exc
        except Exception as exc:  # D-Bus and OS errors surface as anything
            raise KeyringUnavailable(
                f"the keyring ({self.name}) failed to {what}: {type(exc).__name__}: "
                f"{safe(exc)}; check that the keyring service is running and unlocked"
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
                if not vanished(exc):
                    raise
            time.sleep(0.05 * (attempt + 1))  # the daemon's index may lag the deletion
        return None  # found, then gone every time: deleted, so it is not there

    def set(self, name: str, key: str) -> None:
        """Store a key, and read it back: a backend that accepts a write but cannot
        give it back would lose the history."""
        # Stored, then its item gone from under it while another client stores and
        # deletes (GNOME Keyring reuses item paths): storing again replaces it.
        self._call("store a key", self._backend.set_password, SERVICE, name, key, also=vanished)
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
            if isinstance(exc.__cause__, kerr.PasswordDeleteError) or vanished(exc):
                return False
            raise
        if self._read("look up a key", name) is not None:
            raise KeyProblem(f"the keyring ({self.name}) kept the key after deleting it; try again")
        return True


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
