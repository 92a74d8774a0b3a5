"""What the vault's operations return: typed results, for the CLI to print or dump as JSON.

A change that deletes or rewrites rows also says whether its scrub finished
(`scrubbed`): False means another process's read transaction kept the old bytes
in the WAL for now; the change is committed and the next open finishes the scrub.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SessionInfo:
    """A session's counts from SQL: unverified (no item is authenticated to count it).

    `expired_unverified` judges each item by the timestamp its token claims;
    `memvault verify` authenticates every item.
    """

    session_id: str
    items: int
    expired_unverified: int = 0
    updated_at: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Report:
    """What a long operation (purge, rotate) did: its counts, and whether it scrubbed."""

    counts: dict[str, Any] = field(default_factory=dict)
    scrubbed: bool = True
    # What the engine adds to the command's report (PostgreSQL: what became of the old rows).
    notes: dict[str, str] = field(default_factory=dict)


@dataclass
class Popped:
    """`Vault.pop`: the removed items, oldest first."""

    items: list[Any]
    scrubbed: bool
    note: str | None = None  # what the engine adds about the removed rows (PostgreSQL)


@dataclass
class Cleared:
    """`Vault.clear`: how many items went, and how many of those did not authenticate."""

    deleted: int
    unreadable_deleted: int
    scrubbed: bool
    note: str | None = None  # what the engine adds about the removed rows (PostgreSQL)


@dataclass(frozen=True)
class KeyVersionInfo:
    """One line of `memvault key list`: never the key itself."""

    kid: str
    state: str
    in_keyring: bool
    created_at: str | None
    backups: tuple[dict[str, Any], ...] = ()  # the recorded backups that use it


@dataclass(frozen=True)
class Accepted:
    """`Vault.accept_history`: the vault head summed afresh over this many sessions'
    heads, on purpose, past the anchor; `matched` says whether the stored one already
    matched them and was not older than the anchor; `anchored`, whether the anchor
    outside the file holds the new state or a later one (False: the keyring or key
    service failed, or a record of another state got there first)."""

    sessions: int
    matched: bool
    anchored: bool = True
