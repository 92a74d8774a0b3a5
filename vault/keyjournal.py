"""The file as the journal of its keys, and the keyring entries it names.

Every key version a vault has used or staged is a row of `memvault_keys`
(kid, state, when), written before its keyring entry is stored and kept after
the entry is gone. The keyring holds one entry per version, service
`memvault`, username `<vault_id>/<kid>`; nothing else is ever looked up, so
nothing depends on listing the keyring (its API cannot). `docs/keys.md` has
the states and the transitions between them.

Vaults made by memvault 0.1.0 used other names (`<vault_id>`,
`<vault_id>.next`, `<vault_id>.replaced.<kid>`); `legacy_names` lists them so
that revoke and shred destroy those too.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from vault import crypto, testhooks
from vault.engines.sqlite.schema import utcnow
from vault.keys import KeyStore

PENDING, CURRENT, RETIRED, DESTROYED = "pending", "current", "retired", "destroyed"
# Retired, but its entry kept (decrypt-only) while a recorded backup needs it (vault.retention).
RETAINED = "retained"
STATES = (PENDING, CURRENT, RETIRED, RETAINED, DESTROYED)
# meta `legacy_entries`: 0.1.0-style entry names an upgrade still has to delete (JSON list).
LEGACY_MARK = "legacy_entries"
# The meta row naming the key an unfinished online rotation moves rows from (a
# PostgreSQL vault's; vault.engines.postgres.rotate): while it exists, rows need two keys.
ROTATING_FROM = "rotating_from"


def entry_name(vault_id: str, kid: str) -> str:
    """The keyring username of one key version."""
    return f"{vault_id}/{kid}"


def legacy_names(vault_id: str, kids: set[str]) -> list[str]:
    """The names memvault 0.1.0 used for this vault's keys."""
    return [vault_id, vault_id + ".next"] + [f"{vault_id}.replaced.{k}" for k in sorted(kids)]


@dataclass(frozen=True)
class KeyVersion:
    kid: str
    state: str
    created_at: str
    changed_at: str


def versions(conn: sqlite3.Connection) -> list[KeyVersion]:
    """Every key version the file records, oldest first (none in a 0.1.0 file)."""
    try:
        rows = conn.execute(
            "SELECT kid, state, created_at, changed_at FROM memvault_keys ORDER BY rowid"
        ).fetchall()
    except sqlite3.OperationalError:
        return []  # not migrated yet: a file opened read-only before its first write
    return [KeyVersion(*row) for row in rows]


def record(conn: sqlite3.Connection, kid: str, state: str, created_at: str | None = None) -> None:
    """Set one version's state, inside the caller's write transaction.

    A version first recorded now was created now, unless `created_at` says when
    ("" for a key only the audit trail of a 0.1.0 file remembers).
    """
    assert state in STATES
    now = utcnow()
    conn.execute(
        "INSERT INTO memvault_keys (kid, state, created_at, changed_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(kid) DO UPDATE SET state = excluded.state, changed_at = excluded.changed_at",
        (kid, state, now if created_at is None else created_at, now),
    )


def known_kids(conn: sqlite3.Connection, meta: dict[str, str]) -> set[str]:
    """Every key id this file ever named: the journal, the meta and the audit trail.

    The audit trail covers files from 0.1.0, which had no journal: `init`, `rotate`
    (old and new), `key-import` all name their keys.
    """
    kids = {v.kid for v in versions(conn)}
    kids.update(meta[k] for k in ("kid", "revoked_kid") if crypto.looks_like_kid(meta.get(k)))
    try:
        for kid, details in conn.execute("SELECT kid, details FROM memvault_audit"):
            if crypto.looks_like_kid(kid):
                kids.add(kid)
            try:
                old = json.loads(details).get("old_kid")
            except (ValueError, AttributeError):
                continue
            if crypto.looks_like_kid(old):
                kids.add(old)
    except sqlite3.OperationalError:
        pass  # no audit table
    return kids


def destroy_entries(
    ks: KeyStore, vault_id: str, kids: set[str], in_use: set[str]
) -> dict[str, Any]:
    """Delete the keyring entry of every key version in `kids`, and 0.1.0's names for them.

    `in_use` are the kids this file itself used or staged at the time (current,
    pending); a destroyed entry of any other kid belonged to another copy of the
    vault (a backup restored with an older kit). A 0.1.0 entry named `<vault_id>`
    or `<vault_id>.next` is destroyed only when it holds one of `kids` (or is not a
    key): otherwise it is another copy's key, left in place and reported.
    """
    destroyed: set[str] = set()
    for kid in sorted(kids):
        if ks.delete(entry_name(vault_id, kid)):
            destroyed.add(kid)
            testhooks.failpoint("after-destroy-entry")
    foreign = None
    for name in legacy_names(vault_id, kids):
        key = ks.get(name)
        if key is None:
            continue
        held = crypto.key_id(key) if crypto.is_valid_key(key) else None
        if name.startswith(vault_id + ".replaced.") or held is None or held in kids:
            if ks.delete(name) and held:
                destroyed.add(held)
        else:
            foreign = held
    return {
        "key_destroyed": bool(destroyed),
        "destroyed_kids": sorted(destroyed),
        "other_copies_kids": sorted(destroyed - in_use),
        "foreign_kid": foreign,
    }


def present(ks: KeyStore, vault_id: str, kids: set[str]) -> set[str]:
    """Which of these key versions still have an entry (new or 0.1.0 names)."""
    found = {k for k in kids if ks.get(entry_name(vault_id, k)) is not None}
    for name in legacy_names(vault_id, kids):
        key = ks.get(name)
        if key and crypto.is_valid_key(key) and crypto.key_id(key) in kids:
            found.add(crypto.key_id(key))
    return found
