"""memvault: an agent's conversation history, encrypted at rest, key in the OS keyring.

    import vault
    session = vault.open_session("my-chat")          # instead of SQLiteSession(...)
    await Runner.run(agent, "hello", session=session)

Importing this package is cheap: the Agents SDK is imported only when a session
is opened.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vault.engines.sqlite.vault import Vault
from vault.errors import HistoryTampered, VaultError
from vault.sessionanchor import ANCHOR_EVERY

if TYPE_CHECKING:
    from agents import SessionSettings

    from vault.engines.sqlite.session import VaultSession

__all__ = ["HistoryTampered", "Vault", "VaultError", "open_session", "__version__"]


def __getattr__(name: str) -> str:
    # One source for the version: pyproject.toml, through the installed metadata. Looked
    # up on first use: importing importlib.metadata costs every command ~20 ms otherwise.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("memvault")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_session(
    session_id: str,
    db_path: str | os.PathLike[str] | None = None,
    *,
    session_settings: SessionSettings | dict[str, Any] | None = None,
    read_cache: bool = True,
    anchor_every: float = ANCHOR_EVERY,
) -> VaultSession:
    """An `EncryptedSession` over `SQLiteSession` on the vault file, TTL from the vault.

    `db_path` (or `$MEMVAULT_DB`) may also be a URL `postgresql+asyncpg://user:password@
    host:port/dbname[?schema=NAME]`: the session is then the same EncryptedSession over
    the SDK's `SQLAlchemySession` (needs `pip install 'memvault[postgres]'`,
    or `pip install -e '.[postgres]'` in a clone).

    The vault must exist (`memvault init`); its key comes from the OS keyring and
    is checked against the file before anything is read or written.
    `session_settings` (e.g. `SessionSettings(limit=20)`) is passed to the
    `SQLiteSession` underneath, as `SQLiteSession(..., session_settings=...)` takes it.

    The session keeps each item it decrypted in memory while it is open, so the runner's
    read before each turn decrypts only what is new (vault.readcache). `read_cache=False`
    decrypts every item on every read instead (SECURITY.md, "The read cache").

    The session records the vault's state outside the file (the anchor, in the keyring)
    at its first write, after a write once `anchor_every` seconds have passed since it
    last did, and when it closes: a file put back from a copy older than that is
    refused. 0 records after every write (SECURITY.md, "The window").
    """
    from vault.engines.registry import open_vault

    # A file, or a PostgreSQL vault (preview): the same EncryptedSession, over the SDK's
    # SQLiteSession or SQLAlchemySession.
    session: VaultSession = open_vault(db_path).session(
        session_id, session_settings=session_settings
    )
    session.read_cache = read_cache
    session.anchor_every = anchor_every
    return session
