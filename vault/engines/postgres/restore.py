"""`memvault --db URL restore B`: a backup file of a PostgreSQL vault back as its live rows.

B is a vault file that `memvault backup` wrote from this PostgreSQL vault (the same
vault id). `check` reads it first: a memvault vault, of this vault id, and every item
authenticates with the key this keyring holds for B's key id (B's kid is current,
or retained because B is recorded, or put back with `key import`). `restore` then,
holding the vault's admin lock (the one rotate, purge, revoke and shred take):

1. ends what a cut-off rotation or restore left (vault.engines.postgres.kept.settle_leftovers);
2. in ONE transaction: waits for the writes in flight and holds new ones (the tables
   locked EXCLUSIVE: readers go on), deletes every session and item, sets the meta's
   `kid` to B's, records B's version `current` and the replaced one `retired`, inserts
   B's sessions and items as they are (ciphertext under B's key, each authenticated
   again as it is read, so a B changed since the check is refused whole), audits
   `restore`; commit. A kill before the commit leaves the old rows, after it the
   restored ones: never a mix;
3. settles the replaced version as a rotation's end does: retained while a recorded
   backup uses it, else its keyring entry is deleted and it is destroyed (a kill
   before leaves it `retired`: the next restore or rotate settles it);
4. VACUUMs the two tables, so the server may reuse the replaced rows' space.

The rows come back under the key they were written with, and the vault uses that
key again: the guard admits only the current kid, so there is one key for every row
and no exception for a retained one. A later `rotate` carries them to a fresh key.
The meta (TTL), key journal, backups' records and audit trail stay the live vault's.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault import paths, retention, testhooks
from vault.crypto import ItemState, Sealer
from vault.engines.postgres import kept as pgkept
from vault.engines.postgres.backup import refuse_unsettled
from vault.engines.postgres.lock import locked
from vault.engines.postgres.schema import audit, record_key
from vault.engines.sqlite.db import peek, sqlite_errors
from vault.engines.sqlite.restore import REVOKED, RestorePlan, verified_plan
from vault.engines.sqlite.schema import MESSAGES_TABLE, SESSIONS_TABLE
from vault.engines.sqlite.vault import Vault
from vault.errors import BadInput, KeyProblem, OperationFailed
from vault.keyjournal import CURRENT, RETIRED, entry_name
from vault.keysource.store import (
    DEFAULT_MOUNT,
    KEYRING,
    MOUNT,
    SOURCE,
    WRAPPED,
    is_transit,
    same_source,
    source_of,
)
from vault.verify import BATCH

if TYPE_CHECKING:
    from vault.engines.postgres.vault import PgVault

THEN = "restore"


def check(vault: PgVault, source: str | os.PathLike[str]) -> RestorePlan:
    """Check that the file `source` can replace the PostgreSQL vault's rows; changes nothing."""
    paths.require_text_path(source, "the backup path")
    src = Path(source)
    live = vault.meta()  # exit 3: no vault at the URL
    refuse_unsettled(vault, live, THEN, REVOKED)
    meta = Vault.open(src).meta()  # exit 3: not a vault file
    if meta["vault_id"] != live["vault_id"]:
        raise BadInput(
            f"{src} is a copy of vault {meta['vault_id']}, but {vault.path} holds vault "
            f"{live['vault_id']}; a PostgreSQL vault takes back only a backup of itself; "
            "nothing was changed"
        )
    plan = verified_plan(src, vault.path, meta, True, ["the same vault id"])
    _refuse_keyless(vault, live, meta, plan.kid, src)
    plan.replaced_items, plan.replaced_kid = vault.count_items(), live["kid"]
    return plan


def _refuse_keyless(
    vault: PgVault, live: dict[str, str], backup: dict[str, str], kid: str, src: Path
) -> None:
    """KeyProblem unless the vault's own key source will hold the backup's version once
    restored: its rows come back under that key and the vault names it current. A
    `key move` since the backup (with the version forgotten, or never moved) would
    otherwise leave the vault with no key for any row."""
    if WRAPPED + kid in live:
        return
    same = same_source(backup, live)
    if is_transit(live):
        if same and WRAPPED + kid in backup:
            return  # _carry_wrapped takes the backup's copy along
    elif vault.keystore.get(entry_name(live["vault_id"], kid)) is not None:
        return
    back = backup.get(SOURCE, KEYRING)
    if is_transit(backup) and backup.get(MOUNT, DEFAULT_MOUNT) != DEFAULT_MOUNT:
        back += f" --transit-mount {backup[MOUNT]}"
    raise KeyProblem(
        f"the backup {src} uses key {kid}, which the vault's key source "
        f"({source_of(live)}) does not hold: the vault moved from the backup's "
        f"({source_of(backup)}) since; run `memvault key move {back}` first, then restore "
        "again; nothing was changed"
    )


def restore(vault: PgVault, plan: RestorePlan) -> dict[str, Any]:
    """Replace the vault's sessions and items with the checked backup's; see the module doc."""
    ks = vault.keystore
    ks.check_usable()
    src = Path(plan.source)
    sealer = Vault(src).sealer(refresh=True)
    if sealer.kid != plan.kid:
        raise OperationFailed(f"{src} changed since it was checked; run restore again")

    async def body(conn: Any, _schema: str) -> dict[str, Any]:
        return await _locked(vault, conn, plan, sealer)

    out = locked(vault, body)
    vault.forget_keys()
    vault.use_key(sealer)
    return out


async def _locked(vault: PgVault, conn: Any, plan: RestorePlan, sealer: Sealer) -> dict[str, Any]:
    ks = vault.keystore
    meta = await vault.read_meta(conn)
    refuse_unsettled(vault, meta, THEN, REVOKED)
    vault_id = meta["vault_id"]
    await pgkept.settle_leftovers(conn, vault_id, meta["kid"], ks.delete)
    src = Path(plan.source)
    with sqlite_errors(src):
        reader = peek(src, retention.PEEK_TIMEOUT)
    with contextlib.closing(reader):
        with sqlite_errors(src):
            reader.execute("BEGIN")  # one snapshot of the backup
            got = dict(reader.execute("SELECT key, value FROM memvault_meta").fetchall())
        if (got.get("vault_id"), got.get("kid")) != (vault_id, sealer.kid):
            raise OperationFailed(
                f"{src} changed since it was checked; run restore again; nothing was changed"
            )
        async with conn.transaction():
            old = await conn.fetchval(
                "SELECT value FROM memvault_meta WHERE key = 'kid' FOR UPDATE"
            )
            # After the meta row, in the writers' order: the SDK writes its session row,
            # then its items. EXCLUSIVE waits for the writes in flight (a row they commit
            # behind the DELETE would stay, under the replaced key) and lets readers on.
            await conn.execute(f"LOCK TABLE {SESSIONS_TABLE}, {MESSAGES_TABLE} IN EXCLUSIVE MODE")
            replaced = await conn.fetchval(f"SELECT count(*) FROM {MESSAGES_TABLE}")
            await conn.execute(f"DELETE FROM {MESSAGES_TABLE}")
            await conn.execute(f"DELETE FROM {SESSIONS_TABLE}")
            # The guard admits the backup's rows from here: its kid is the current one.
            await conn.execute("UPDATE memvault_meta SET value = $1 WHERE key = 'kid'", sealer.kid)
            await _carry_wrapped(conn, meta, got, sealer.kid)
            if old != sealer.kid:
                await record_key(conn, old, RETIRED)
            await record_key(conn, sealer.kid, CURRENT)
            testhooks.failpoint("pg-restore-emptied")
            sessions, items = await _copy_rows(conn, reader, src, sealer)
            details = plan.audited(
                items=items, sessions=sessions, replaced_kid=old, replaced_items=replaced
            )
            await audit(conn, "restore", sealer.kid, **details)
    testhooks.failpoint("pg-restore-committed")
    fate = None
    if old != sealer.kid:
        # Its rows are gone: kept only while a recorded backup uses it, as after a rotation.
        fate = await pgkept.settle_old(conn, vault_id, old, ks.delete)
    await conn.execute(f"VACUUM {MESSAGES_TABLE}, {SESSIONS_TABLE}")
    return {
        **plan.as_dict(),
        "items": items,
        "sessions": sessions,
        "replaced_kid": old,
        "replaced_items": replaced,
        "old_key": fate,
        "vacuumed": True,
        "restored": True,
    }


async def _carry_wrapped(conn: Any, live: dict[str, str], backup: dict[str, str], kid: str) -> None:
    """A transit vault that no longer holds the backup's version wrapped (`key forget`
    dropped it) takes the backup's copy, which the check just unwrapped: the restored
    vault then opens as the backup did, not without its key. The admin lock held keeps
    the wrapped rows as `live` read them."""
    row = WRAPPED + kid
    same = same_source(backup, live)
    if is_transit(live) and row not in live and same and row in backup:
        insert = "INSERT INTO memvault_meta (key, value) VALUES ($1, $2)"
        await conn.execute(insert, row, backup[row])


async def _copy_rows(
    conn: Any, reader: sqlite3.Connection, src: Path, sealer: Sealer
) -> tuple[int, int]:
    """Insert the backup's sessions, then its items in its order, each authenticated under
    the backup's key first; (sessions, items). Any item that does not is refused whole."""
    with sqlite_errors(src):
        sessions = reader.execute(
            f"SELECT session_id, created_at, updated_at FROM {SESSIONS_TABLE} "
            f"UNION ALL SELECT DISTINCT session_id, NULL, NULL FROM {MESSAGES_TABLE} "
            f"WHERE session_id NOT IN (SELECT session_id FROM {SESSIONS_TABLE})"
        ).fetchall()
    await conn.executemany(
        f"INSERT INTO {SESSIONS_TABLE} (session_id, created_at, updated_at) VALUES ($1, "
        "COALESCE($2::text::timestamp, CURRENT_TIMESTAMP), "
        "COALESCE($3::text::timestamp, CURRENT_TIMESTAMP))",
        sessions,
    )
    items = 0
    with sqlite_errors(src):
        cursor = reader.execute(
            f"SELECT session_id, message_data, created_at FROM {MESSAGES_TABLE} ORDER BY id"
        )
    while True:
        with sqlite_errors(src):
            batch = cursor.fetchmany(BATCH)
        if not batch:
            return len(sessions), items
        for sid, data, _at in batch:
            if sealer.state(str(sid), str(data), None, decode=True) is not ItemState.READABLE:
                raise OperationFailed(
                    f"an item of session {str(sid)!r} in {src} does not authenticate under "
                    f"key {sealer.kid}; `memvault --db {src} verify` lists it; nothing was "
                    "changed"
                )
        # Numbered afresh in the backup's order: the server reads a session by
        # (created_at, id), as the backup's file did by id.
        await conn.executemany(
            f"INSERT INTO {MESSAGES_TABLE} (session_id, message_data, created_at) "
            "VALUES ($1, $2, COALESCE($3::text::timestamp, CURRENT_TIMESTAMP))",
            batch,
        )
        items += len(batch)
        testhooks.failpoint("pg-restore-batch")
