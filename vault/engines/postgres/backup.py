"""`memvault backup` of a PostgreSQL vault: one snapshot into a new SQLite vault file.

The rows are copied as they are (ciphertext under the vault's key), with the
same vault id, key id, meta, key journal and audit trail, into a file made
0600 by the one private-file writer (never through a link): `memvault --db
FILE verify` / `show` open it with the same keyring entry, as they open a file
vault's backup. The snapshot is one read-only REPEATABLE READ transaction, read
in batches from a server-side cursor; the file is settled and checked as
vault.engines.sqlite.backup settles its own copies. `memvault --db URL restore
FILE` puts it back (`restore` here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault import chainops
from vault.engines.postgres import rotate as pgrotate
from vault.engines.sqlite import backup as file_backup
from vault.engines.sqlite import chainrows, filecopy, vaulthead
from vault.engines.sqlite.db import connect, sqlite_errors
from vault.engines.sqlite.schema import FILE_FORMAT, MESSAGES_TABLE, SESSIONS_TABLE, migrate
from vault.errors import VaultBusy
from vault.keyjournal import CURRENT, DESTROYED
from vault.verify import BATCH

if TYPE_CHECKING:
    from vault.engines.postgres.kept import PgKeptVersions as PgVault


def backup(vault: PgVault, dest: str | os.PathLike[str]) -> file_backup.BackupResult:
    """Copy one snapshot of the PostgreSQL vault into the new SQLite vault file `dest`.

    The rows are copied as they are (ciphertext under the vault's key), with the
    same vault id, key id, meta, key journal and audit trail: `memvault --db DEST`
    opens the copy with the same keyring entry. Raises BadInput for an unusable
    `dest`, KeyRevoked for a revoked vault, VaultBusy when a rotation began meanwhile
    (one under way or cut off is finished first).
    """
    meta = vault.meta()
    if pgrotate.FROM in meta and "revoked_at" not in meta:
        # A cut-off rotation blocks nothing: it is finished (none started), one key copied.
        pgrotate.rotate(vault, None, pgrotate.DEFAULT_BATCH, resume_only=True)
        meta = vault.meta()
    _refuse(vault, meta)
    target = file_backup.check_destination(dest, None)
    # Recorded in the vault first, and marked, as a file vault's backup is
    # (vault.engines.sqlite.backup.recorded_backup, vault.backupmark).
    r = file_backup.recorded_backup(
        vault,
        target,
        lambda rec, keep: filecopy.write_new_copy(
            target,
            lambda dest: _copy(vault, dest),
            file_backup.mark_as_backup(
                meta["vault_id"], rec.backup_id, str(vault.path), vault.sealer
            ),
            keep,
        ),
    )
    if r.key_problem is None:  # `key export` reads the copy: the same keyring entry
        r.restore[0] = (
            f"memvault --db {target} key export kit.json  # here: a recovery kit for key "
            f"{r.kid}, kept apart"
        )
    return r


def _refuse(vault: PgVault, meta: dict[str, str]) -> None:
    refuse_unsettled(vault, meta, "back up", "a backup could never be read")


def refuse_unsettled(vault: PgVault, meta: dict[str, str], then: str, revoked: str) -> None:
    """Refuse a vault that is revoked, half shredded or mid-rotation: backup and restore
    need its rows under one key (`then` is what the user does after, `revoked` why a
    revoked vault is refused)."""
    file_backup.refuse_unbackable(meta, vault.path, revoked)
    if pgrotate.FROM in meta:
        # A file's guard admits only the current kid: rows still under the old key
        # cannot enter the copy until the rotation has moved them; a restore's rows
        # would meet a rotation that moves them from a key they do not use.
        raise VaultBusy(
            f"a key rotation of {vault.path} is under way (or was cut off); wait for it, or "
            f"run `memvault rotate` to finish it, then {then}; nothing was written"
        )


def _copy(vault: PgVault, target: Path) -> None:
    """Build the vault file: memvault's schema, then the snapshot's rows in batches."""
    sealer = vault.sealer()  # a cut-off rotation was finished: one key seals every row
    key = chainops.key_of(sealer, vault.meta()["vault_id"])
    with sqlite_errors(target):
        out = connect(target)
        try:
            out.execute("BEGIN IMMEDIATE")
            migrate(out)

            async def read(conn: Any) -> None:
                meta = {
                    r[0]: r[1] for r in await conn.fetch("SELECT key, value FROM memvault_meta")
                }
                _refuse(vault, meta)  # again, in the snapshot that is copied
                meta["format"] = FILE_FORMAT  # a vault file, chained (the server's is not)
                out.executemany(
                    "INSERT INTO memvault_meta (key, value) VALUES (?, ?)", meta.items()
                )
                # Only the versions the copy uses or that are gone: a pending or retired
                # entry belongs to the server's rotation, and the file's tidy-up on open
                # would delete it from the keyring under that rotation's feet; a retained
                # one is the server's to keep for its backups (their records stay there).
                out.executemany(
                    "INSERT INTO memvault_keys (kid, state, created_at, changed_at) "
                    "VALUES (?, ?, ?, ?)",
                    [
                        tuple(r)
                        for r in await conn.fetch(
                            "SELECT kid, state, created_at, changed_at FROM memvault_keys "
                            "WHERE state = ANY($1::text[]) ORDER BY seq",
                            [CURRENT, DESTROYED],
                        )
                    ],
                )
                out.executemany(
                    "INSERT INTO memvault_audit (at, event, kid, details) VALUES (?, ?, ?, ?)",
                    [
                        tuple(r)
                        for r in await conn.fetch(
                            "SELECT at, event, kid, details FROM memvault_audit ORDER BY id"
                        )
                    ],
                )
                when = "to_char({}, 'YYYY-MM-DD HH24:MI:SS')"  # SQLite's CURRENT_TIMESTAMP
                out.executemany(
                    f"INSERT INTO {SESSIONS_TABLE} (session_id, created_at, updated_at) "
                    "VALUES (?, ?, ?)",
                    [
                        tuple(r)
                        for r in await conn.fetch(
                            f"SELECT session_id, {when.format('created_at')}, "
                            f"{when.format('updated_at')} FROM {SESSIONS_TABLE}"
                        )
                    ],
                )
                # In the agent session's order: the file numbers them afresh, so its
                # `ORDER BY id` reads each session as the server's (created_at, id) does.
                cursor = await conn.cursor(
                    f"SELECT session_id, message_data, {when.format('created_at')} "
                    f"FROM {MESSAGES_TABLE} ORDER BY created_at, id"
                )
                while batch := await cursor.fetch(BATCH):
                    # Linked as the file vault's writers link them: a vault file is
                    # chained (docs/history-chain.md), this history from the copy on.
                    chainrows.insert_rows(
                        out, key, [(r[0], r[1]) for r in batch], [r[2] for r in batch]
                    )

            vault.run(read)
            vaulthead.start(out, key)  # chained from the copy on: its heads summed
            out.execute("COMMIT")
        finally:
            out.close()
