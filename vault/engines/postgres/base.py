"""`PgVaultBase`: a PostgreSQL vault's connections, meta and keys; postgres.vault builds on it.

As `VaultFile` and `KeyLifecycle` are to `Vault`: each operation opens one
asyncpg connection on an event loop of its own (vault.engines.postgres.conn); the key is the
keyring entry `<vault_id>/<kid>`, as for a file; while an online rotation runs
(vault.engines.postgres.rotate) the key it moves rows from stays readable too.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar, cast

from vault import crypto, keyload
from vault.engines.postgres import schema as pgschema
from vault.engines.postgres.conn import connect, is_driver_error, run_sync, translate
from vault.engines.postgres.url import PgLocation
from vault.engines.sqlite.schema import (
    GUARD_MESSAGE,
    session_exists_sql,
)
from vault.errors import KeyMissing, NotAVault, OperationFailed, VaultBusy, VaultError
from vault.keyjournal import ROTATING_FROM, entry_name
from vault.keys import KeyStore
from vault.vaultops import MetaKeys, unknown_session

if TYPE_CHECKING:
    from vault.engines.postgres.wrapped import PgWrappedKeys

T = TypeVar("T")
# What a host says once another host rotated and its keyring lacks the new key.
KEY_CHANGED = "the vault's key changed: import the new recovery kit"
Keys = dict[str, crypto.Sealer]


class PgVaultBase(MetaKeys):
    """A PostgreSQL vault's location, connections, meta and keys."""

    path: str  # the URL without its password: what messages and `status` show
    backend = "postgresql"
    guard_message = GUARD_MESSAGE  # the PL/pgSQL guard raises the file guard's words

    def __init__(self, loc: PgLocation, keystore: KeyStore | None = None) -> None:
        self.loc = loc
        self.path = loc.display  # what messages and `status` show: never the password
        self._keystore = keystore
        self._sealer: crypto.Sealer | None = None
        # The key a running rotation moves rows from (engines.postgres.rotate), by kid, once loaded.
        self._others: dict[str, crypto.Sealer] = {}

    # -- connections ----------------------------------------------------
    async def connect(self) -> Any:
        return await connect(self.loc)

    def run(self, body: Callable[[Any], Awaitable[T]], *, write: bool = False) -> T:
        """`body(conn)` in one transaction (REPEATABLE READ snapshot when reading)."""

        async def go() -> T:
            conn = await self.connect()
            try:
                if write:
                    async with conn.transaction():
                        return await body(conn)
                async with conn.transaction(isolation="repeatable_read", readonly=True):
                    return await body(conn)
            finally:
                await conn.close()

        return self.call(go)

    def call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run a coroutine on a loop of its own; driver and server errors become VaultErrors."""
        try:
            return run_sync(make)
        except VaultError:
            raise
        except Exception as exc:
            if not is_driver_error(exc):
                raise
            raise translate(exc, self.loc) from None

    async def read_meta(self, conn: Any) -> dict[str, str]:
        if await conn.fetchval("SELECT to_regclass('memvault_meta')") is None:
            await self.refuse_unusable_schema(conn)
            raise self.no_vault(await pgschema.current_schema(conn))
        meta = {r[0]: r[1] for r in await conn.fetch("SELECT key, value FROM memvault_meta")}
        for required in ("format", "vault_id", "kid"):
            if required not in meta:
                raise NotAVault(f"{self.path} lacks the vault's {required}; it is not usable")
        return meta

    async def refuse_unusable_schema(self, conn: Any) -> None:
        """The URL's schema exists but this user lacks USAGE on it: the server then hides
        every table in it, and "no vault, run init" would send the user the wrong way."""
        if self.loc.schema and await conn.fetchval(
            "SELECT NOT has_schema_privilege(oid, 'USAGE') FROM pg_namespace WHERE nspname = $1",
            self.loc.schema,
        ):
            raise OperationFailed(
                f"the PostgreSQL user of {self.path} lacks USAGE on schema "
                f"{self.loc.schema!r}, so it cannot see a vault there; grant it (GRANT USAGE "
                "ON SCHEMA ... TO ...), or use the vault's owner; nothing was changed"
            )

    def no_vault(self, schema: str | None) -> NotAVault:
        where = f"schema {schema!r} of " if schema else ""
        return NotAVault(
            f"no vault in {where}{self.path}; create one with `memvault init`, or point --db / "
            "MEMVAULT_DB at an existing vault"
        )

    async def require_session(self, conn: Any, session_id: str) -> None:
        found = await conn.fetchval(
            session_exists_sql("$1"),
            session_id,
        )
        if not found:
            raise unknown_session(session_id, self.path)

    def record(self, event: str, kid: str | None, **details: Any) -> None:
        """Append one audit event in a transaction of its own."""

        async def write(conn: Any) -> None:
            await self.read_meta(conn)
            await pgschema.audit(conn, event, kid, **details)

        self.run(write, write=True)

    def switch_meta(
        self,
        expect: dict[str, str | None],
        put: dict[str, str],
        drop: list[str],
        event: str,
        details: dict[str, Any],
    ) -> bool:
        """VaultFile.switch_meta's twin: one transaction, the `kid` row locked first so that
        a rotation's switch on another host comes wholly before or after it."""

        async def write(conn: Any) -> bool:
            await conn.execute("SELECT 1 FROM memvault_meta WHERE key = 'kid' FOR UPDATE")
            meta = await self.read_meta(conn)
            staged = await conn.fetchval("SELECT 1 FROM memvault_keys WHERE state = 'pending'")
            if any(meta.get(k) != v for k, v in expect.items()) or staged:
                return False
            await conn.execute("DELETE FROM memvault_meta WHERE key = ANY($1)", drop)
            await pgschema.set_meta(conn, **put)
            await pgschema.audit(conn, event, meta["kid"], **details)
            return True

        return self.run(write, write=True)

    # -- meta and key ---------------------------------------------------
    def meta(self) -> dict[str, str]:
        return self.run(self.read_meta)

    def wrapped_keys(self) -> PgWrappedKeys:
        from vault.engines.postgres.wrapped import PgWrappedKeys

        return PgWrappedKeys(self)

    def sealer(self, refresh: bool = False) -> crypto.Sealer:
        """The sealer of the key the vault uses now: the entry `<vault_id>/<kid>`."""
        if self._sealer is not None and not refresh:
            return self._sealer
        # The key a rotation moves rows from is loaded when a row names it (sealer_for_kid).
        _meta, self._sealer = keyload.load(
            self.keystore, self.path, self.meta, on_missing=self._refuse_changed_key, rotating=False
        )
        return self._sealer

    def _refuse_changed_key(self, vault_id: str, kid: str) -> None:
        """The current key is not in this keyring: if an older version of this vault is,
        another host rotated; if the vault last moved to the keyring, the host that moved
        it has the key. Either way this one must import a kit (KeyMissing, exit 4)."""

        async def read(conn: Any) -> tuple[list[str], Any]:
            rows = await conn.fetch("SELECT kid FROM memvault_keys WHERE kid <> $1", kid)
            moved = await conn.fetchrow(
                "SELECT at, details FROM memvault_audit WHERE event = 'key-move' "
                "ORDER BY id DESC LIMIT 1"
            )
            return [r[0] for r in rows], moved

        kids, moved = self.run(read)
        held = [k for k in kids if self.keystore.get(entry_name(vault_id, k))]
        fix = (
            "on a host that has the key run `memvault key export KIT`, bring KIT here, then "
            "run `memvault key import KIT`"
        )
        if held:
            raise KeyMissing(
                f"{KEY_CHANGED} (vault {vault_id} now uses key {kid}; this keyring "
                f"({self.keystore.name}) holds only {', '.join(sorted(held))}): {fix}"
            )
        move = json.loads(moved["details"]) if moved else {}
        if move.get("to") == "keyring":
            # The last move put the keys in the keyring of the host that ran it only: the
            # hosts that used the transit key hold nothing in theirs.
            raise KeyMissing(
                f"vault {vault_id} moved from {move.get('from')} to the keyring on "
                f"{moved['at']} (`memvault key move keyring`), so its key {kid} is in the "
                "keyring of the host that moved it, not in this one "
                f"({self.keystore.name}): {fix}"
            )

    def cached_sealer(self, kid: str) -> crypto.Sealer | None:
        """The sealer of a retired key this object already loaded for a rotation, if any."""
        return self._others.get(kid)

    def sealer_for_kid(self, kid: str | None) -> crypto.Sealer | None:
        """The sealer of a key id still in use besides the current one: the key a running
        rotation moves rows from. None for any other kid, or once that rotation ended."""
        if kid is None:
            return None
        if self._sealer is not None and kid == self._sealer.kid:
            return self._sealer
        if kid in self._others:
            return self._others[kid]
        meta = self.meta()
        if meta.get(ROTATING_FROM) != kid:
            return None
        ks = self.keystore

        def refuse(vault_id: str, kid: str) -> None:
            # A host that imported the new kit during the rotation: no kit holds the old
            # key any more (an older one is refused), so "import KIT" would be no way out.
            raise KeyMissing(
                f"a rotation of vault {vault_id} is still moving rows from key {kid}, "
                f"which this keyring ({ks.name}) does not hold; those rows open once it "
                "ends: wait for it, or, if it was cut off, run `memvault rotate` on a host "
                "that holds that key"
            )

        key = keyload.entry_key(ks, meta["vault_id"], kid, self.meta, ROTATING_FROM, refuse)
        if key is None:
            return None  # the rotation finished and deleted the entry meanwhile
        self._others[kid] = crypto.Sealer(key)
        return self._others[kid]

    def use_key(self, sealer: crypto.Sealer, retired: str | None = None) -> None:
        """Hold `sealer` as the current key (a rotation just moved to it); drop `retired`."""
        self._sealer = sealer
        if retired is not None:
            self._others.pop(retired, None)

    def forget_keys(self) -> None:
        """Drop the keys loaded so far: after a revoke or shred they are gone from the keyring."""
        self._sealer = None
        self._others.clear()

    def keys_for(self, kid: str, old_kid: str | None) -> dict[str, crypto.Sealer] | None:
        """The sealers of the kids a snapshot says are in use (the current one, and the old
        one while a rotation runs); None when the vault moved on since: read again."""
        current = self.sealer()
        if current.kid != kid:
            current = self.sealer(refresh=True)
            if current.kid != kid:
                return None
        keys = {kid: current}
        if old_kid is not None:
            old = self.sealer_for_kid(old_kid)
            if old is None:
                return None
            keys[old_kid] = old
        return keys

    async def _locked_kids(self, conn: Any) -> tuple[str, str | None]:
        """(current kid, kid a rotation moves from), their rows locked until the transaction
        ends: a rotation can neither switch nor finish under this change."""
        await self.read_meta(conn)
        rows = await conn.fetch(
            "SELECT key, value FROM memvault_meta WHERE key IN ('kid', $1) FOR SHARE",
            ROTATING_FROM,
        )
        found = {k: v for k, v in rows}
        return found["kid"], found.get(ROTATING_FROM)

    # -- changing -------------------------------------------------------
    def change(self, body: Callable[[Any, Keys, crypto.Sealer], Awaitable[T]]) -> T:
        """`body(conn, keys, current)` in a write transaction holding the kids' meta rows, with
        the sealers of every kid in use (the old one too while a rotation runs)."""
        current = self.sealer()
        keys: Keys = {current.kid: current}
        for _attempt in range(5):

            async def change(conn: Any, keys: Keys = keys) -> tuple[bool, Any, Any]:
                kid, old_kid = await self._locked_kids(conn)
                if kid not in keys or (old_kid is not None and old_kid not in keys):
                    return False, None, (kid, old_kid)  # the key moved on: reload, start again
                return True, await body(conn, keys, keys[kid]), None

            done, result, wanted = self.run(change, write=True)
            if done:
                return cast(T, result)
            keys = self.keys_for(*wanted) or keys
        raise VaultBusy(f"{self.path} changed key while this command ran; try again")
