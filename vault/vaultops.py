"""What the vault's operations mean, written once for both engines.

The engines (vault.engines.sqlite, vault.engines.postgres) fetch and store rows
in their own SQL and transactions; what a row means once fetched is decided
here: how an item is opened and counted, what `status` reports, which item
refuses a `pop` or a `clear`, what a new vault's meta holds, and what an
unknown session is told.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from vault import crypto, durations
from vault.errors import (
    ItemsUnreadable,
    KeyProblem,
    KeyRevoked,
    OperationFailed,
    UnknownSession,
    VaultCorrupt,
    VaultError,
)
from vault.keys import KeyStore
from vault.keysource.store import source_of
from vault.results import SessionInfo

if TYPE_CHECKING:
    from vault.keysource import WrappedKeys

# What `status` says of its counts (and `sessions` of its columns): they come from SQL.
COUNTS_NOTE = (
    "unverified: items counted and judged expired by their timestamps, without "
    "authenticating them; `memvault verify` authenticates every item"
)


def parse_ttl(meta: dict[str, str], path: Path | str) -> int | None:
    """The vault's TTL in seconds (None: never), or VaultCorrupt for a value no command wrote."""
    raw = meta.get("ttl_seconds", "never")
    if raw == "never":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise VaultCorrupt(
            f"{path} has an invalid TTL {raw[:40]!r} in memvault_meta; nothing was read; "
            "set it again with `memvault ttl 30d` (or `never`)"
        )
    return value


class MetaKeys:
    """The vault id, the TTL and the keystore, the same on both engines (a base of
    `VaultFile` and `PgVaultBase`, which read the meta each their own way)."""

    path: Path | str
    _keystore: KeyStore | None = None
    _source_known = False

    def meta(self) -> dict[str, str]:  # pragma: no cover (each engine's)
        raise NotImplementedError

    def wrapped_keys(self) -> WrappedKeys:  # pragma: no cover (each engine's)
        raise NotImplementedError

    @property
    def keystore(self) -> KeyStore:
        """The store the vault's meta names: the keyring (default, or the one given), or
        its transit key with the wrapped keys kept in the vault."""
        if not self._source_known:
            from vault.keysource.store import store_for

            try:
                meta = self.meta()
            except VaultError:
                meta = None  # no vault (yet, or any more): only the keyring can be meant
            if meta is not None:
                self._source_known = True
                transit = store_for(meta, self.wrapped_keys())
                if transit is not None:
                    self._keystore = transit
        if self._keystore is None:
            self._keystore = KeyStore()
        return self._keystore

    @property
    def vault_id(self) -> str:
        return self.meta()["vault_id"]

    @property
    def ttl(self) -> int | None:
        return parse_ttl(self.meta(), self.path)


def ttl_value(ttl: int | None) -> str:
    """The TTL as the meta row `ttl_seconds` holds it (`parse_ttl` reads it back)."""
    return "never" if ttl is None else str(ttl)


def new_identity(ks: KeyStore) -> tuple[str, str, str]:
    """A new vault's (master key, key id, vault id), once the keyring is known usable."""
    ks.check_usable()
    key = crypto.generate_key()
    return key, crypto.key_id(key), "mv-" + secrets.token_hex(12)


def new_meta(fmt: str, vault_id: str, kid: str, ttl: int | None, now: str) -> dict[str, str]:
    """The meta rows `init` writes into a new vault, on either engine."""
    return {
        "format": fmt,
        "vault_id": vault_id,
        "kid": kid,
        "ttl_seconds": ttl_value(ttl),
        "created_at": now,
        "rotated_at": now,
    }


def check_limit(limit: int | None) -> None:
    if limit is not None and limit <= 0:
        raise OperationFailed("limit must be a positive number of items")


def unknown_session(session_id: str, path: Path | str) -> UnknownSession:
    return UnknownSession(f"no session {session_id!r} in {path}; `memvault sessions` lists them")


def open_rows(
    pick: Callable[[str], crypto.Sealer],
    session_id: str,
    rows: Iterable[str],
    ttl: int | None,
    now: int | None,
    include_expired: bool,
) -> Iterator[crypto.Opened]:
    """Each row of a session opened with the key `pick(row)` chooses, one at a time.

    With `include_expired`, an expired item is decrypted too and keeps its EXPIRED state.
    """
    for data in rows:
        sealer = pick(data)
        item = sealer.open(session_id, data, ttl, now)
        if include_expired and item.state is crypto.ItemState.EXPIRED:
            item = sealer.open(session_id, data, None)  # authenticated, TTL not applied
            if item.state is crypto.ItemState.READABLE:
                item = crypto.Opened(crypto.ItemState.EXPIRED, item.item, item.timestamp)
        yield item


def tally(opened: Iterable[crypto.Opened]) -> tuple[list[Any], int, int]:
    """(readable items in order, expired count, unreadable count): `items()` on both engines."""
    out: list[Any] = []
    expired = unreadable = 0
    for item in opened:
        if item.state is crypto.ItemState.READABLE:
            out.append(item.item)
        elif item.state is crypto.ItemState.EXPIRED:
            expired += 1
        else:
            unreadable += 1
    return out, expired, unreadable


class _OpensItems(Protocol):
    def opened_items(
        self, session_id: str, limit: int | None = None, now: int | None = None
    ) -> Iterator[crypto.Opened]: ...


class ReadsItems:
    """A base of `Vault` and `PgVault`: `items()`, once, over each engine's `opened_items`."""

    def items(
        self, session_id: str, limit: int | None = None, now: int | None = None
    ) -> tuple[list[Any], int, int]:
        """(readable items oldest first, expired count, unreadable count).

        With `limit`, the newest `limit` stored rows are considered, as the SDK does.
        """
        return tally(cast(_OpensItems, self).opened_items(session_id, limit, now))


def popped_item(sealer: crypto.Sealer, session_id: str, row_id: int | str, data: str) -> Any:
    """The item `pop` removes, authenticated first: one that does not stops the whole pop."""
    opened = sealer.open(session_id, data, None)
    if opened.state is not crypto.ItemState.READABLE:
        raise OperationFailed(
            f"item {row_id} of session {session_id!r} does not authenticate (tampered, "
            "corrupt or under another key); nothing was removed"
        )
    return opened.item


def refuse_unreadable(session_id: str, unreadable: int, include_unreadable: bool) -> None:
    """`clear` leaves a session whole when some of its items do not authenticate: they are
    evidence, not history, and go only on purpose."""
    if unreadable and not include_unreadable:
        raise ItemsUnreadable(
            f"{unreadable} item(s) of session {session_id!r} do not authenticate "
            "(tampered, corrupt or under another key); nothing was deleted; to delete "
            f"them too, on purpose: memvault clear {session_id} --include-unreadable",
            unreadable,
        )


def status_doc(
    meta: dict[str, str],
    ttl: int | None,
    infos: list[SessionInfo],
    rotated: str | None,
    where: dict[str, Any],
) -> dict[str, Any]:
    """What `status` shows on both engines; `where` holds the engine's own fields first."""
    return {
        **where,
        "vault_id": meta["vault_id"],
        "kid": meta["kid"],
        "ttl": durations.format_duration(ttl),
        "created_at": meta.get("created_at"),
        "rotated_at": rotated,
        "key_source": source_of(meta),
        "keyring": None,
        "key": None,
        "sessions": len(infos),
        "items": sum(i.items for i in infos),
        "expired_unverified": sum(i.expired_unverified for i in infos),
        "counts": COUNTS_NOTE,
    }


def key_state(
    out: dict[str, Any],
    keystore: Callable[[], KeyStore],
    sealer: Callable[[], object],
    revoked_incomplete: Callable[[], bool],
) -> None:
    """`status`'s key fields: is the key there, revoked (and wholly), or unusable, and why."""
    try:
        out["keyring"] = keystore().name
        sealer()
        out["key"] = "present and matching"
    except KeyRevoked:
        out["key"] = "key revoked"
        try:
            incomplete = revoked_incomplete()
        except KeyProblem:
            incomplete = False  # no keyring to ask: the vault's mark is all there is to say
        if incomplete:
            out["key"] = "key revoked (incomplete: the key is still in the keyring)"
            out["key_problem"] = "run `memvault revoke` again to finish destroying it"
    except KeyProblem as exc:
        out["key"] = "unusable"
        out["key_problem"] = exc.message
