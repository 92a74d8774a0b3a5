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

import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any, TypeVar

from vault import crypto, durations
from vault.engines.postgres import admin as pgadmin
from vault.engines.postgres import kept as pgkept
from vault.engines.postgres import rotate as pgrotate
from vault.engines.postgres import schema as pgschema
from vault.engines.postgres.base import Keys, PgVaultBase
from vault.engines.postgres.schema import audit, record_key
from vault.engines.postgres.url import INSTALL_HINT, parse
from vault.engines.sqlite.db import parse_ttl
from vault.engines.sqlite.lifecycle import KeyVersionInfo
from vault.engines.sqlite.schema import (
    DEFAULT_TTL,
    FORMAT,
    MESSAGES_TABLE,
    PREVIOUS_FORMAT,
    SESSIONS_TABLE,
    utcnow,
)
from vault.engines.sqlite.vault import COUNTS_NOTE
from vault.errors import (
    BadInput,
    ItemsUnreadable,
    KeyProblem,
    KeyRevoked,
    NotAVault,
    OperationFailed,
    UnknownSession,
    VaultBusy,
    VaultError,
    VaultExists,
)
from vault.files import Progress
from vault.keyjournal import CURRENT, entry_name
from vault.keys import KeyStore
from vault.results import Cleared, Popped, Report, SessionInfo

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


class PgVault(pgkept.PgKeptVersions, PgVaultBase):
    """A vault in a PostgreSQL database or schema. Open with `PgVault.open` / `PgVault.init`."""

    backend = "postgresql"

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
        vault = cls(parse(url), keystore)
        ks = vault.keystore
        ks.check_usable()
        key = crypto.generate_key()
        kid = crypto.key_id(key)
        vault_id = "mv-" + secrets.token_hex(12)

        async def create(conn: Any) -> None:
            created = None
            if vault.loc.schema:
                # Shred drops only a schema init created, never one a DBA (or the server) made.
                if not await conn.fetchval(
                    "SELECT 1 FROM pg_namespace WHERE nspname = $1", vault.loc.schema
                ):
                    created = vault.loc.schema
                await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {pgschema._q(vault.loc.schema)}")
            await vault.refuse_unusable_schema(conn)
            schema = await pgschema.current_schema(conn)
            if schema is None:
                raise OperationFailed(
                    f"{vault.path} has no schema to create the vault in (the search_path "
                    "names none that exists); add ?schema=NAME to the URL"
                )
            await pgschema.lock_schema_changes(conn, schema)
            if await conn.fetchval("SELECT to_regclass('memvault_meta')") is not None:
                raise VaultExists(
                    f"a vault already exists in schema {schema!r} of {vault.path}; nothing was "
                    "changed (`memvault status` describes it)"
                )
            for table in (SESSIONS_TABLE, MESSAGES_TABLE):
                if await conn.fetchval("SELECT to_regclass($1)", table) is not None:
                    raise VaultExists(
                        f"schema {schema!r} of {vault.path} already has a {table} table that "
                        "is not a memvault vault's; memvault will not take it over; give the "
                        "vault a schema of its own with ?schema=NAME"
                    )
            # The key goes in first: a failure after it leaves an unused keyring entry
            # (deleted below), never a vault without its key.
            ks.set(entry_name(vault_id, kid), key)
            await pgschema.migrate(conn, schema)
            now = utcnow()
            meta = {
                "format": FORMAT,
                "vault_id": vault_id,
                "kid": kid,
                "ttl_seconds": "never" if ttl is None else str(ttl),
                "created_at": now,
                "rotated_at": now,
            }
            if created:
                meta["schema_created"] = created
            await conn.executemany(
                "INSERT INTO memvault_meta (key, value) VALUES ($1, $2)", list(meta.items())
            )
            await record_key(conn, kid, CURRENT)
            await audit(conn, "init", kid, ttl=durations.format_duration(ttl))

        try:
            vault.run(create, write=True)
        except BaseException:
            with contextlib.suppress(VaultError):
                ks.delete(entry_name(vault_id, kid))
            raise
        vault._sealer = crypto.Sealer(key)
        return vault

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
        """One row per session, counted in SQL (unverified, as `Vault.sessions`)."""
        self.sealer()

        async def read(conn: Any) -> list[SessionInfo]:
            meta = await self.read_meta(conn)
            return await self._count(conn, parse_ttl(meta, self.path), now)  # type: ignore[arg-type]

        return self.run(read)

    def session_ids(self) -> list[str]:
        return [i.session_id for i in self.sessions()]

    async def require_session(self, conn: Any, session_id: str) -> None:
        found = await conn.fetchval(
            f"SELECT 1 FROM {SESSIONS_TABLE} WHERE session_id = $1 UNION ALL "
            f"SELECT 1 FROM {MESSAGES_TABLE} WHERE session_id = $1 LIMIT 1",
            session_id,
        )
        if not found:
            raise UnknownSession(
                f"no session {session_id!r} in {self.path}; `memvault sessions` lists them"
            )

    def items(
        self, session_id: str, limit: int | None = None, now: int | None = None
    ) -> tuple[list[Any], int, int]:
        """(readable items oldest first, expired count, unreadable count), as `Vault.items`."""
        if limit is not None and limit <= 0:
            raise OperationFailed("limit must be a positive number of items")
        self.sealer()
        for _attempt in range(50):

            async def read(conn: Any) -> tuple[dict[str, str], int | None, list[str]]:
                meta = await self.read_meta(conn)
                await self.require_session(conn, session_id)
                rows = await conn.fetch(
                    f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = $1 "
                    "ORDER BY created_at DESC, id DESC LIMIT $2",
                    session_id,
                    limit,
                )
                ttl = parse_ttl(meta, self.path)  # type: ignore[arg-type]
                return meta, ttl, [r[0] for r in rows][::-1]

            # The kids are read in the rows' own snapshot: rows read after a rotation are
            # opened with the new key, never judged unreadable under the old one, and
            # during an online rotation each row with the key its envelope names.
            meta, ttl, rows = self.run(read)
            keys = self.keys_for(meta["kid"], meta.get(pgrotate.FROM))
            if keys is None:
                continue
            out: list[Any] = []
            expired = unreadable = 0
            for data in rows:
                sealer = keys.get(pgrotate.kid_of(data) or "", keys[meta["kid"]])
                opened = sealer.open(session_id, data, ttl, now)
                if opened.state is crypto.ItemState.READABLE:
                    out.append(opened.item)
                elif opened.state is crypto.ItemState.EXPIRED:
                    expired += 1
                else:
                    unreadable += 1
            return out, expired, unreadable
        raise VaultBusy(f"{self.path} kept changing key while being read; try again")

    def opened_items(
        self,
        session_id: str,
        limit: int | None = None,
        now: int | None = None,
        include_expired: bool = False,
    ) -> Iterator[crypto.Opened]:
        """As `Vault.opened_items`: for export and search (vault.engines.postgres.read)."""
        from vault.engines.postgres.read import opened_items

        return opened_items(self, session_id, limit, now, include_expired)

    def status(self, now: int | None = None) -> dict[str, Any]:
        """What `memvault status` shows; the file fields say they do not apply."""

        async def read(
            conn: Any,
        ) -> tuple[dict[str, str], str | None, list[SessionInfo], str | None]:
            meta = await self.read_meta(conn)
            ttl = parse_ttl(meta, self.path)  # type: ignore[arg-type]
            schema, infos = await pgschema.current_schema(conn), await self._count(conn, ttl, now)
            return meta, schema, infos, await pgschema.last_rotation(conn, meta)

        meta, schema, infos, rotated = self.run(read)
        ttl = parse_ttl(meta, self.path)  # type: ignore[arg-type]
        out: dict[str, Any] = {
            "backend": self.backend,
            "path": self.path,
            "schema": schema,
            "folder_mode": NOT_APPLICABLE,
            "files": {},
            "size": NOT_APPLICABLE,
            "vault_id": meta["vault_id"],
            "kid": meta["kid"],
            "ttl": durations.format_duration(ttl),
            "created_at": meta.get("created_at"),
            "rotated_at": rotated,
            "scrub_pending": False,
            "shred_interrupted": False,
            "keyring": None,
            "key": None,
            "sessions": len(infos),
            "items": sum(i.items for i in infos),
            "expired_unverified": sum(i.expired_unverified for i in infos),
            "counts": COUNTS_NOTE,
        }
        if pgrotate.FROM in meta:  # an online rotation is running, or was cut off
            out["rotation"] = {
                "from_kid": meta[pgrotate.FROM],
                "done_through_id": int(meta.get(pgrotate.PROGRESS, "0")),
            }
        try:
            out["keyring"] = self.keystore.name
            self.sealer()
            out["key"] = "present and matching"
        except KeyRevoked:
            out["key"] = "key revoked"
        except KeyProblem as exc:
            out["key"] = "unusable"
            out["key_problem"] = exc.message
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
            if unreadable and not include_unreadable:
                raise ItemsUnreadable(
                    f"{unreadable} item(s) of session {session_id!r} do not authenticate "
                    "(tampered, corrupt or under another key); nothing was deleted; to "
                    f"delete them too, on purpose: memvault clear {session_id} "
                    "--include-unreadable",
                    unreadable,
                )
            status = await conn.execute(
                f"DELETE FROM {MESSAGES_TABLE} WHERE session_id = $1", session_id
            )
            n = int(status.split()[-1])
            await conn.execute(f"DELETE FROM {SESSIONS_TABLE} WHERE session_id = $1", session_id)
            await audit(conn, "clear", current.kid, items=n, unreadable=unreadable)
            return Cleared(n, unreadable, True)

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
            opened = sealer.open(session_id, row[1], None)
            if opened.state is not crypto.ItemState.READABLE:
                raise OperationFailed(
                    f"the newest item of session {session_id!r} does not authenticate "
                    "(tampered, corrupt or under another key); nothing was removed"
                )
            await conn.execute(f"DELETE FROM {MESSAGES_TABLE} WHERE id = $1", row[0])
            return opened.item

        return self.change(body)

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
        return report

    # -- admin (vault.engines.postgres.admin) -------------------------------------------
    def purge(self, now: int | None = None, progress: Progress | None = None) -> Report:
        return pgadmin.purge(self, now, progress)

    def pop(self, session_id: str, n: int = 1) -> Popped:
        return pgadmin.pop(self, session_id, n)

    def set_ttl(self, ttl: int | None) -> None:
        pgadmin.set_ttl(self, ttl)

    def revoke(self) -> dict[str, Any]:
        return pgadmin.revoke(self)

    def shred(self) -> dict[str, Any]:
        return pgadmin.shred(self)

    def key_versions(self) -> list[KeyVersionInfo]:
        return pgadmin.key_versions(self)

    def record(self, event: str, kid: str | None, **details: Any) -> None:
        """Append one audit event in a transaction of its own."""

        async def write(conn: Any) -> None:
            await self.read_meta(conn)
            await audit(conn, event, kid, **details)

        self.run(write, write=True)

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
