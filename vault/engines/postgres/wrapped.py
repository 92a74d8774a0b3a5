"""A transit vault's wrapped keys in a PostgreSQL vault: the meta rows `wrapped_key:<kid>`,
each change in a transaction of its own (a rotation stores its new version's before the
switch, as it stores a keyring entry)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from vault.keysource.store import wrapped_row


class _Vault(Protocol):
    """What of `PgVaultBase` this uses (typed here: base imports this module)."""

    def run(self, body: Callable[[Any], Awaitable[Any]], *, write: bool = False) -> Any: ...


class PgWrappedKeys:
    """`WrappedKeys` over one PostgreSQL vault (the vault id is its own)."""

    def __init__(self, vault: _Vault) -> None:
        self.vault = vault

    def load(self, vault_id: str, kid: str) -> str | None:
        async def read(conn: Any) -> Any:
            return await conn.fetchval(
                "SELECT value FROM memvault_meta WHERE key = $1", wrapped_row(kid)
            )

        value = self.vault.run(read)
        return None if value is None else str(value)

    def save(self, vault_id: str, kid: str, wrapped: str) -> None:
        async def write(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO memvault_meta (key, value) VALUES ($1, $2) "
                "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                wrapped_row(kid),
                wrapped,
            )

        self.vault.run(write, write=True)

    def drop(self, vault_id: str, kid: str) -> bool:
        async def write(conn: Any) -> bool:
            gone = await conn.fetchval(
                "DELETE FROM memvault_meta WHERE key = $1 RETURNING 1", wrapped_row(kid)
            )
            return gone is not None

        return bool(self.vault.run(write, write=True))

    def replace(self, vault_id: str, kid: str, old: str, new: str) -> bool:
        async def write(conn: Any) -> bool:
            done = await conn.fetchval(
                "UPDATE memvault_meta SET value = $1 WHERE key = $2 AND value = $3 RETURNING 1",
                new,
                wrapped_row(kid),
                old,
            )
            return done is not None

        return bool(self.vault.run(write, write=True))
