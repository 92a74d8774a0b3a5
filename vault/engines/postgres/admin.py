"""A PostgreSQL vault's admin operations: purge, pop, ttl, revoke, key versions (shred:
vault.engines.postgres.shred, on the helpers here).

The same meaning, results and exit codes as a file vault's (vault.engines.sqlite.vault,
vault.engines.sqlite.lifecycle, vault.engines.sqlite.shred); `PgVault` delegates here. What differs:

* `purge`, `revoke` and `shred` hold the vault's admin lock (vault.engines.postgres.lock), as
  `rotate` does: one of them at a time across every host.
* Scrubbing: PostgreSQL's storage is the server's, not memvault's. After deleting
  rows memvault runs VACUUM on the tables, so the server may reuse their space;
  it cannot overwrite pages, WAL segments, archives, replicas or backups. Destroying
  the key is the guarantee; deleting the rows is best effort (SECURITY.md).
* Revoke and shred destroy the entries of this host's keyring only: every other
  host runs `memvault revoke` too (docs/postgres.md, "Several hosts").
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

from vault import crypto, keyjournal, testhooks
from vault.engines.postgres import kept as pgkept
from vault.engines.postgres.conn import translate_after
from vault.engines.postgres.lock import locked
from vault.engines.postgres.rotate import FROM, PROGRESS, ROW_BATCH, kid_of
from vault.engines.postgres.schema import audit, record_key, set_meta
from vault.engines.sqlite.keptkeys import with_backups
from vault.engines.sqlite.schema import MESSAGES_TABLE, utcnow
from vault.errors import KeyProblem, OperationFailed, VaultBusy
from vault.files import Progress
from vault.keyjournal import CURRENT, DESTROYED, PENDING, entry_name
from vault.keyload import refuse_revoked
from vault.keysource.store import destroy_versions
from vault.results import KeyVersionInfo, Popped, Report
from vault.vaultops import parse_ttl, popped_item, ttl_value

if TYPE_CHECKING:
    from vault.engines.postgres.base import Keys
    from vault.engines.postgres.kept import PgKeptVersions as PgVault

DEFAULT_BATCH = 500
PG_PURGE_NOTE = (
    "VACUUM ran on the table, so PostgreSQL may reuse the deleted rows' space; it does not "
    "overwrite them: their ciphertext may stay in its pages, WAL, archives, replicas and "
    "backups, under the vault's key"
)


async def known_kids(conn: Any, meta: dict[str, str]) -> set[str]:
    """Every key id this vault ever named: the journal, the meta and the audit trail
    (vault.keyjournal.known_kids's twin)."""
    kids = {r[0] for r in await conn.fetch("SELECT kid FROM memvault_keys")}
    kids.update(meta[k] for k in ("kid", "revoked_kid", FROM) if crypto.looks_like_kid(meta.get(k)))
    for kid, details in await conn.fetch("SELECT kid, details FROM memvault_audit"):
        if crypto.looks_like_kid(kid):
            kids.add(kid)
        with contextlib.suppress(ValueError, AttributeError):
            old = json.loads(details).get("old_kid")
            if crypto.looks_like_kid(old):
                kids.add(old)
    return kids


async def kids_in_use(conn: Any, kid: str, meta: dict[str, str]) -> set[str]:
    """The versions the vault itself uses or staged: the rest are other copies' keys."""
    rows = await conn.fetch("SELECT kid FROM memvault_keys WHERE state = $1", PENDING)
    return {kid} | {r[0] for r in rows} | ({meta[FROM]} if FROM in meta else set())


# -- the history ---------------------------------------------------------
def purge(
    vault: PgVault,
    now: int | None = None,
    progress: Progress | None = None,
    batch: int = DEFAULT_BATCH,
) -> Report:
    """Delete the items that authenticate and are past the TTL, in batches (each its own
    transaction), then VACUUM. Unreadable items stay; so do fresh ones."""
    vault.sealer()  # the key errors (missing, revoked) before any lock

    async def body(conn: Any, _schema: str) -> Report:
        meta = await vault.read_meta(conn)
        refuse_revoked(meta)
        ttl = parse_ttl(meta, vault.path)
        current = int(time.time()) if now is None else now
        # Under the admin lock no rotation moves on: the kids in use stay these.
        keys: Keys | None = vault.keys_for(meta["kid"], meta.get(FROM))
        if keys is None:
            raise VaultBusy(f"{vault.path} changed key while the purge began; try again")
        default = keys[meta["kid"]]
        deleted = kept = unreadable = 0
        last = 0
        while True:
            async with conn.transaction():
                rows = await conn.fetch(ROW_BATCH, last, batch)
                if not rows:
                    break
                doomed, fresh, bad = crypto.triage(
                    rows, lambda data: keys.get(kid_of(data) or "", default), ttl, current
                )
                kept, unreadable = kept + fresh, unreadable + bad
                await conn.executemany(f"DELETE FROM {MESSAGES_TABLE} WHERE id = $1", doomed)
                deleted += len(doomed)
                last = rows[-1][0]
            if progress:
                progress(len(rows))
            testhooks.failpoint("pg-purge-after-batch")
        async with conn.transaction():
            await audit(
                conn, "purge", meta["kid"], deleted=deleted, kept=kept, unreadable=unreadable
            )
        if deleted:
            await conn.execute(f"VACUUM {MESSAGES_TABLE}")
        return Report(
            {"deleted": deleted, "kept": kept, "unreadable": unreadable, "vacuumed": deleted > 0},
            True,
            {"scrub": PG_PURGE_NOTE if deleted else "nothing deleted: no VACUUM was needed"},
        )

    return locked(vault, body)


def pop(vault: PgVault, session_id: str, n: int = 1) -> Popped:
    """Remove the newest `n` items; refuses, removing nothing, if one does not authenticate."""
    if n <= 0:
        raise OperationFailed("the number of items to pop must be positive")

    async def body(conn: Any, keys: Keys, current: crypto.Sealer) -> Popped:
        await vault.require_session(conn, session_id)
        rows = await conn.fetch(
            f"SELECT id, message_data FROM {MESSAGES_TABLE} WHERE session_id = $1 "
            "ORDER BY created_at DESC, id DESC LIMIT $2 FOR UPDATE",
            session_id,
            n,
        )
        popped = [
            popped_item(keys.get(kid_of(data) or "", current), session_id, row_id, data)
            for row_id, data in rows
        ]
        await conn.executemany(
            f"DELETE FROM {MESSAGES_TABLE} WHERE id = $1", [(r[0],) for r in rows]
        )
        return Popped(popped, True)

    return vault.change(body)


def set_ttl(vault: PgVault, ttl: int | None) -> None:
    """Set the vault-wide TTL (audited with the old and new values)."""

    async def body(conn: Any, _keys: Keys, current: crypto.Sealer) -> None:
        old = (await vault.read_meta(conn)).get("ttl_seconds")
        new = ttl_value(ttl)
        await set_meta(conn, ttl_seconds=new)
        await audit(conn, "ttl", current.kid, old=old, new=new)

    vault.change(body)


# -- the key -------------------------------------------------------------
def revoke(vault: PgVault) -> dict[str, Any]:
    """Mark the vault revoked, then destroy every recorded key version's entry in this
    host's keyring (engines.sqlite.lifecycle.KeyLifecycle.revoke's twin). The rows stay, unreadable.

    The mark comes first: from then on the guard refuses every write (the meta's kid
    is "revoked"), and a revoke cut off before the keyring is finished by the next
    one. Run on another host, it finds the vault revoked and destroys that host's entries.
    """
    ks = vault.keystore
    ks.check_usable()

    async def body(conn: Any, _schema: str) -> dict[str, Any]:
        async with conn.transaction():
            meta = await vault.read_meta(conn)
            vault_id = meta["vault_id"]
            kid = meta.get("revoked_kid", meta["kid"])
            already = "revoked_at" in meta
            kids = await known_kids(conn, meta)
            in_use = await kids_in_use(conn, kid, meta)
            if not already:
                await set_meta(conn, revoked_at=utcnow(), revoked_kid=kid, kid="revoked")
                # A rotation cut off can never finish now: its marks go.
                await conn.execute(
                    "DELETE FROM memvault_meta WHERE key = ANY($1)", [FROM, PROGRESS]
                )
                await audit(conn, "revoke", kid)
        testhooks.failpoint("pg-revoke-after-mark")
        outcome = destroy_versions(ks, vault_id, kids, in_use)
        try:
            async with conn.transaction():
                for k in sorted(kids):
                    await record_key(conn, k, DESTROYED)
        except Exception as exc:
            raise translate_after(
                exc,
                vault.loc,
                "the vault is marked revoked and this keyring's entries of it are destroyed; "
                "fix that, then run `memvault revoke --yes` again to finish",
            ) from None
        return {"vault_id": vault_id, "kid": kid, "already_revoked": already, **outcome}

    try:
        return locked(vault, body)
    finally:
        vault.forget_keys()


def key_versions(vault: PgVault) -> list[KeyVersionInfo]:
    """Every key version the vault records, with its state and whether this host's
    keyring holds its entry (vault.engines.sqlite.lifecycle.KeyLifecycle.key_versions's twin)."""
    with contextlib.suppress(KeyProblem):
        vault.sealer(refresh=True)

    async def read(conn: Any) -> tuple[dict[str, str], list[Any], set[str]]:
        meta = await vault.read_meta(conn)
        recorded = await conn.fetch("SELECT kid, state, created_at FROM memvault_keys ORDER BY seq")
        return meta, list(recorded), await known_kids(conn, meta)

    meta, recorded, kids = vault.run(read)
    ks = vault.keystore
    ks.check_usable()
    here = keyjournal.present(ks, meta["vault_id"], kids)
    out = [KeyVersionInfo(k, s, k in here, c or None) for k, s, c in recorded]
    seen = {v.kid for v in out}
    for kid in sorted(kids - seen):
        state = CURRENT if kid == meta["kid"] else DESTROYED
        out.append(KeyVersionInfo(kid, state, kid in here, None))
    return with_backups(out, pgkept.records_of(vault))


def forget_destroyed(vault: PgVault) -> list[str]:
    """Delete this host's entries of the versions the vault records as destroyed.

    A rotation on one host destroys the old key there only; `key import` of the new
    kit on another host calls this, so the old key leaves that host's keyring too.
    """

    async def read(conn: Any) -> tuple[str, list[str]]:
        meta = await vault.read_meta(conn)
        rows = await conn.fetch("SELECT kid FROM memvault_keys WHERE state = $1", DESTROYED)
        return meta["vault_id"], [r[0] for r in rows]

    vault_id, kids = vault.run(read)
    ks = vault.keystore
    return [k for k in kids if ks.delete(entry_name(vault_id, k))]


def kept_for_rotation(vault: PgVault) -> list[str]:
    """The key a running (or cut-off) rotation still moves rows from, if this keyring holds
    it: `key import` cannot delete it yet (those rows need it), and says to run again."""
    meta = vault.meta()
    old = meta.get(FROM)
    if old is None or vault.keystore.get(entry_name(meta["vault_id"], old)) is None:
        return []
    return [old]
