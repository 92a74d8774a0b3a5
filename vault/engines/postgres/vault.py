"""`PgVault`: a vault in a PostgreSQL database (preview), for the commands that support it.

The same vault as a file, only the storage differs: the same key derivation,
envelope, kid and keyring entries (`<vault_id>/<kid>`, vault.keyjournal), the
same meta, audit and key-journal rows (`schema` here). Supported so far: `init`,
`status`, `sessions`, `show`, `clear`, `rotate` (online, `rotate`), `purge`, `pop`,
`ttl`, `log`, `revoke`, `shred`, `key list/export/import` (`admin`), `export`,
`search`, `verify` (`read`), `backup` (`backup`), `restore` (`restore`),
`import` (`importer`) and agent sessions (`session`), the modules of this package
named in brackets. Every other command refuses a URL in `paths.resolve_db_path`.

The library is synchronous, as `Vault` is; each operation opens one asyncpg
connection and runs on an event loop of its own (engines.postgres.base, engines.postgres.conn).
asyncpg is imported only when a URL is used. Every message names the vault
by its redacted URL.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from vault import crypto
from vault.engines.postgres import admin as pgadmin
from vault.engines.postgres import kept as pgkept
from vault.engines.postgres import rotate as pgrotate
from vault.engines.postgres import schema as pgschema
from vault.engines.postgres.base import Keys
from vault.engines.postgres.schema import audit
from vault.engines.postgres.url import INSTALL_HINT, parse
from vault.engines.sqlite.schema import (
    DEFAULT_TTL,
    FORMAT,
    MESSAGES_TABLE,
    PREVIOUS_FORMAT,
    SESSIONS_TABLE,
)
from vault.errors import (
    BadInput,
    NotAVault,
    OperationFailed,
)
from vault.files import Progress
from vault.importing import ImportsFiles
from vault.keyload import refuse_revoked
from vault.keys import KeyStore
from vault.results import Accepted, Cleared, KeyVersionInfo, Popped, Report, SessionInfo
from vault.vaultops import (
    ReadsItems,
    key_state,
    parse_ttl,
    popped_item,
    refuse_unreadable,
    status_doc,
)

if TYPE_CHECKING:
    from vault.engines.postgres.importer import PgImporter
    from vault.engines.postgres.read import PgVerifyReport
    from vault.engines.sqlite.backup import BackupResult

T = TypeVar("T")
NOT_APPLICABLE = "not applicable: PostgreSQL"
# What `clear` says instead of a scrub: PostgreSQL frees a deleted row's space lazily.
PG_SCRUB_NOTE = (
    "not applicable on PostgreSQL: the deleted rows' ciphertext stays in the table's pages "
    "and the server's WAL until PostgreSQL reuses the space (VACUUM); it is ciphertext "
    "under the vault's key"
)

PG_ROTATE_NOTE = (
    "not applicable on PostgreSQL: the old ciphertext stays in dead row versions until "
    "PostgreSQL reuses the space (VACUUM); it is under the old key, whose keyring entry "
    "is destroyed unless a recorded backup retains it (`memvault key list`)"
)


class PgVault(pgkept.PgKeptVersions, ImportsFiles, ReadsItems):
    """A vault in a PostgreSQL database or schema. Open with `PgVault.open` / `PgVault.init`."""

    backup_note: str | None = (
        "the copy is a vault file (SQLite) holding one snapshot of the PostgreSQL vault; "
        "for a server-side backup use pg_dump"
    )
    stays = "rows"  # what a revoke leaves: other hosts keep their keyrings too

    # -- construction ---------------------------------------------------
    @classmethod
    def open(cls, url: str, keystore: KeyStore | None = None) -> PgVault:
        """Check that the location holds a vault (and migrate it); the key loads when needed."""
        vault = cls(parse(url), keystore)

        async def check(conn: Any) -> bool:
            meta = await vault.read_meta(conn)
            if meta.get("format") not in (FORMAT, PREVIOUS_FORMAT):
                raise NotAVault(
                    f"{vault.path} has an unknown memvault format {meta.get('format')!r}; "
                    "upgrade memvault"
                )
            return await pgschema.needs_migration(conn)

        if vault.run(check):

            async def upgrade(conn: Any) -> None:
                schema = await pgschema.current_schema(conn)
                assert schema is not None
                await pgschema.lock_schema_changes(conn, schema)
                await pgschema.migrate(conn, schema)

            vault.run(upgrade, write=True)
        return vault

    @classmethod
    def init(
        cls, url: str, ttl: int | None = DEFAULT_TTL, keystore: KeyStore | None = None
    ) -> PgVault:
        """Create the tables and a random master key; refuse if a vault or the SDK's tables
        are already there."""
        from vault.engines.postgres.create import create

        return create(cls, url, ttl, keystore)

    @classmethod
    def verify(cls, url: str) -> PgVerifyReport:
        """`memvault verify` on a URL, read-only (engines.postgres.read; no migration)."""
        from vault.engines.postgres.read import verify

        return verify(url)

    # -- reading --------------------------------------------------------
    async def _count(self, conn: Any, ttl: int | None, now: int | None) -> list[SessionInfo]:
        infos: dict[str, SessionInfo] = {}
        for sid, updated in await conn.fetch(
            'SELECT session_id, to_char(updated_at, \'YYYY-MM-DD"T"HH24:MI:SS"Z"\') '
            f"FROM {SESSIONS_TABLE}"
        ):
            infos[sid] = SessionInfo(sid, 0, updated_at=updated)
        cutoff = None if ttl is None else (int(time.time()) if now is None else now) - ttl
        for sid, n, expired in await conn.fetch(
            f"SELECT session_id, count(*), count(*) FILTER (WHERE {pgschema.ITEM_TIME} < $1) "
            f"FROM {MESSAGES_TABLE} GROUP BY session_id",
            cutoff,
        ):
            info = infos.setdefault(sid, SessionInfo(sid, 0))
            info.items = n
            info.expired_unverified = expired if cutoff is not None else 0
        return sorted(infos.values(), key=lambda i: i.session_id)

    def sessions(self, now: int | None = None) -> list[SessionInfo]:
        """One row per session, counted in SQL (unverified, as `Vault.sessions`): no key
        needed, no keyring reached; a revoked vault is refused by its mark."""

        async def read(conn: Any) -> list[SessionInfo]:
            meta = await self.read_meta(conn)
            refuse_revoked(meta)
            return await self._count(conn, parse_ttl(meta, self.path), now)

        return self.run(read)

    def session_ids(self) -> list[str]:
        return [i.session_id for i in self.sessions()]

    def opened_items(
        self,
        session_id: str,
        limit: int | None = None,
        now: int | None = None,
        include_expired: bool = False,
        include_tampered: bool = False,  # no chain on PostgreSQL yet: nothing to refuse
    ) -> Iterator[crypto.Opened]:
        """As `Vault.opened_items`: for export and search (vault.engines.postgres.read)."""
        from vault.engines.postgres.read import opened_items

        return opened_items(self, session_id, limit, now, include_expired)

    def history_verdict(self, session_id: str) -> str | None:
        """None: PostgreSQL's history is not chained yet (docs/history-chain.md)."""
        return None

    def record_anchor(self, into: KeyStore | None = None) -> None:
        """Nothing: no history chain, so no anchor, on PostgreSQL yet."""

    def accept_history(self) -> Accepted:
        raise OperationFailed(
            f"{self.path} keeps no history chain yet (docs/history-chain.md): there is no "
            "state to accept; nothing was changed"
        )

    def status(self, now: int | None = None) -> dict[str, Any]:
        """What `memvault status` shows; the file fields say they do not apply."""

        async def read(
            conn: Any,
        ) -> tuple[dict[str, str], str | None, list[SessionInfo], str | None]:
            meta = await self.read_meta(conn)
            ttl = parse_ttl(meta, self.path)
            schema, infos = await pgschema.current_schema(conn), await self._count(conn, ttl, now)
            return meta, schema, infos, await pgschema.last_rotation(conn, meta)

        meta, schema, infos, rotated = self.run(read)
        where: dict[str, Any] = {
            "backend": self.backend,
            "path": self.path,
            "schema": schema,
            "folder_mode": NOT_APPLICABLE,
            "files": {},
            "size": NOT_APPLICABLE,
            "scrub_pending": False,
            "shred_interrupted": False,
        }
        out = status_doc(meta, parse_ttl(meta, self.path), infos, rotated, where)
        if pgrotate.FROM in meta:  # an online rotation is running, or was cut off
            out["rotation"] = {
                "from_kid": meta[pgrotate.FROM],
                "done_through_id": int(meta.get(pgrotate.PROGRESS, "0")),
            }
        key_state(out, lambda: self.keystore, self.sealer, lambda: False)
        return out

    def audit_log(self) -> list[dict[str, Any]]:
        async def read(conn: Any) -> list[dict[str, Any]]:
            await self.read_meta(conn)
            rows = await conn.fetch(
                "SELECT at, event, kid, details FROM memvault_audit ORDER BY id"
            )
            return [{"at": a, "event": e, "kid": k, **json.loads(d)} for a, e, k, d in rows]

        return self.run(read)

    # -- changing -------------------------------------------------------
    def clear(self, session_id: str, include_unreadable: bool = False) -> Cleared:
        """Empty one session, as `Vault.clear`: refuses (ItemsUnreadable) items that do not
        authenticate unless `include_unreadable`. `scrubbed` is True: PostgreSQL has no WAL
        file of the vault's own to checkpoint (see PG_SCRUB_NOTE)."""

        async def body(conn: Any, keys: Keys, current: crypto.Sealer) -> Cleared:
            await self.require_session(conn, session_id)
            rows = await conn.fetch(
                f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = $1 FOR UPDATE",
                session_id,
            )
            unreadable = sum(
                keys.get(pgrotate.kid_of(r[0]) or "", current).state(session_id, r[0], None)
                is crypto.ItemState.UNREADABLE
                for r in rows
            )
            refuse_unreadable(session_id, unreadable, include_unreadable)
            status = await conn.execute(
                f"DELETE FROM {MESSAGES_TABLE} WHERE session_id = $1", session_id
            )
            n = int(status.split()[-1])
            await conn.execute(f"DELETE FROM {SESSIONS_TABLE} WHERE session_id = $1", session_id)
            await audit(conn, "clear", current.kid, items=n, unreadable=unreadable)
            return Cleared(n, unreadable, True, PG_SCRUB_NOTE)

        return self.change(body)

    def pop_newest(self, session_id: str) -> Any:
        """Remove and return the session's newest item (the agent session's `pop_item`).

        Authenticated before it is deleted, in the same transaction: an item that does not
        authenticate stays (OperationFailed). None for an empty session.
        """

        async def body(conn: Any, keys: Keys, current: crypto.Sealer) -> Any:
            row = await conn.fetchrow(
                f"SELECT id, message_data FROM {MESSAGES_TABLE} WHERE session_id = $1 "
                "ORDER BY created_at DESC, id DESC LIMIT 1 FOR UPDATE",
                session_id,
            )
            if row is None:
                return None
            sealer = keys.get(pgrotate.kid_of(row[1]) or "", current)
            item = popped_item(sealer, session_id, row[0], row[1])
            await conn.execute(f"DELETE FROM {MESSAGES_TABLE} WHERE id = $1", row[0])
            return item

        return self.change(body)

    def row_batches(self) -> Iterator[list[tuple[int, str, str]]]:
        """Every item row in id order, a batch at a time, each batch read on its own."""
        last = 0
        while True:

            async def read(conn: Any, last: int = last) -> list[tuple[int, str, str]]:
                await self.read_meta(conn)
                rows = await conn.fetch(
                    f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} "
                    "WHERE id > $1 ORDER BY id LIMIT $2",
                    last,
                    pgrotate.DEFAULT_BATCH,
                )
                return [(r[0], r[1], r[2]) for r in rows]

            batch = self.run(read)
            if not batch:
                return
            yield batch
            last = batch[-1][0]

    def scrub(self) -> bool:
        """Nothing of the vault's own to checkpoint: PostgreSQL reuses a deleted row's space
        when it VACUUMs (PG_SCRUB_NOTE); True, as `clear` reports."""
        return True

    def backup(self, dest: str | os.PathLike[str]) -> BackupResult:
        """A vault file (SQLite) holding one snapshot of this vault (engines.postgres.backup)."""
        from vault.engines.postgres.backup import backup

        return backup(self, dest)

    def count_items(self) -> int:
        async def read(conn: Any) -> int:
            await self.read_meta(conn)
            return int(await conn.fetchval(f"SELECT count(*) FROM {MESSAGES_TABLE}"))

        return self.run(read)

    def rotate(
        self, progress: Progress | None = None, batch: int = pgrotate.DEFAULT_BATCH
    ) -> Report:
        """A new key, rows re-encrypted online in batches (engines.postgres.rotate); also finishes a
        rotation that was cut off."""
        self.sealer()  # the key errors (missing, revoked) before any change
        report = pgrotate.rotate(self, progress, batch)
        assert report is not None  # None only when asked to resume alone
        report.notes["scrub"] = PG_ROTATE_NOTE
        return report

    # -- admin (vault.engines.postgres.admin) -------------------------------------------
    def purge(self, now: int | None = None, progress: Progress | None = None) -> Report:
        return pgadmin.purge(self, now, progress)

    def pop(self, session_id: str, n: int = 1) -> Popped:
        popped = pgadmin.pop(self, session_id, n)
        popped.note = PG_SCRUB_NOTE
        return popped

    def set_ttl(self, ttl: int | None) -> None:
        pgadmin.set_ttl(self, ttl)

    def revoke(self) -> dict[str, Any]:
        r = pgadmin.revoke(self)
        if "transit_key" in r:
            return r  # the keys were in the vault itself: no host holds one of its own
        # The rows stay in the server, and other hosts keep their own keyrings.
        r["other_hosts"] = (
            "only this host's keyring entries were destroyed: run `memvault revoke --yes` "
            "on every other host that holds the key"
        )
        return r

    def shred(self) -> dict[str, Any]:
        from vault.engines.postgres.shred import shred

        return shred(self)

    def key_versions(self) -> list[KeyVersionInfo]:
        return pgadmin.key_versions(self)

    def settle_keyring(self) -> dict[str, list[str]]:
        return {
            # Another host rotated: the versions the vault destroyed leave this keyring too.
            "destroyed_here": pgadmin.forget_destroyed(self),
            # A rotation still under way needs its old key here until it ends.
            "kept_until_rotation_ends": pgadmin.kept_for_rotation(self),
        }

    def importer_class(self) -> type[PgImporter]:
        from vault.engines.postgres.importer import PgImporter

        return PgImporter

    # -- agent sessions -------------------------------------------------
    def session(self, session_id: str, *, session_settings: Any = None) -> Any:
        """An `EncryptedSession` over the SDK's SQLAlchemySession (imports the Agents SDK)."""
        try:
            from vault.engines.postgres.session import PgVaultSession
        except ImportError as exc:
            if exc.name not in ("sqlalchemy", "asyncpg") and not str(exc.name).startswith(
                "sqlalchemy."
            ):
                raise
            raise BadInput(f"{INSTALL_HINT}; nothing was changed") from None

        return PgVaultSession(self, session_id, session_settings=session_settings)
