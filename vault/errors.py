"""The one hierarchy of user-facing failures.

Each error carries a message written for the person at the terminal (what
happened, then what to do) and the exit code DESIGN.md documents. `cli.main`
is the single place that turns them into a line on stderr.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_VAULT = 3
EXIT_KEY = 4
EXIT_BUSY = 5
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C


class VaultError(Exception):
    """Base class: an operation failed; nothing secret is in the message."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class OperationFailed(VaultError):
    """Bad data, an I/O error, a refused request (exit 1)."""


class VaultExists(VaultError):
    """`init` found a vault already there."""


class VaultCorrupt(VaultError):
    """The file is a vault but SQLite reports damage."""


class ItemsUnreadable(OperationFailed):
    """A delete refused because items do not authenticate (exit 1); `count` says how many."""

    def __init__(self, message: str, count: int) -> None:
        super().__init__(message)
        self.count = count


class HistoryTampered(VaultError):
    """A chained session's history does not verify: reordered, replayed, cut or forged
    (docs/history-chain.md). `session_id` and `kind` name what was found (exit 1)."""

    def __init__(self, message: str, session_id: str = "", kind: str = "") -> None:
        super().__init__(message)
        self.session_id = session_id
        self.kind = kind


class UnknownSession(VaultError):
    """The session id is not in the vault."""


class BadInput(VaultError):
    """A value the user gave cannot be used (exit 2, like Click's usage errors)."""

    exit_code = EXIT_USAGE


class NotAVault(VaultError):
    """No vault at that path, or the file is not a memvault vault (exit 3)."""

    exit_code = EXIT_NO_VAULT


class KeyProblem(VaultError):
    """Anything wrong with the master key or the keyring (exit 4)."""

    exit_code = EXIT_KEY


class KeyringUnavailable(KeyProblem):
    """No usable keyring backend (none found, or the null backend)."""


class KeyringLocked(KeyProblem):
    """The keyring collection is locked and could not be unlocked."""


class KeyMissing(KeyProblem):
    """The keyring has no (or an empty, or a malformed) entry for this vault."""


class KeyRevoked(KeyProblem):
    """The key was destroyed on purpose with `memvault revoke`."""


class KeyMismatch(KeyProblem):
    """The keyring holds a key, but not the one the vault was written with."""


class KeySourceUnavailable(KeyProblem):
    """A key service (OpenBao or Vault transit) cannot be reached or used: no address,
    no client library, down, or not answering within the deadline."""


class KeySourceDenied(KeyProblem):
    """The key service refused: no token, a wrong or expired one, or one without the
    permission the operation needs."""


class VaultBusy(VaultError):
    """Another process holds the lock past the timeout (exit 5)."""

    exit_code = EXIT_BUSY


class Interrupted(VaultError):
    """Ctrl-C (SIGINT); the message says what was committed before it (exit 130)."""

    exit_code = EXIT_INTERRUPTED
