"""`TransitKeySource`: a `KeySource` whose master keys live only wrapped, in the vault's
`WrappedKeys` store, and are unwrapped through a transit key on each use."""

from __future__ import annotations

from vault import crypto
from vault.errors import KeyMismatch
from vault.keysource import WrappedKeys
from vault.keysource.transit import Transit


class TransitKeySource:
    """`KeySource`: the vault's store keeps each version's master key wrapped."""

    def __init__(self, transit: Transit, store: WrappedKeys) -> None:
        self.transit = transit
        self.store = store

    @property
    def name(self) -> str:
        return f"transit:{self.transit.key_name}"

    def where(self) -> str:
        return self.transit.where()

    def check_usable(self) -> None:
        self.transit.check_usable()

    def get(self, vault_id: str, kid: str) -> str | None:
        wrapped = self.store.load(vault_id, kid)
        if wrapped is None:
            return None
        master_key = self.transit.unwrap(wrapped)
        if crypto.key_id(master_key) != kid:
            raise KeyMismatch(
                f"the wrapped key stored for key {kid} of vault {vault_id} unwraps to another "
                "key; nothing was read or written; restore it with `memvault key import KIT`"
            )
        return master_key

    def put(self, vault_id: str, kid: str, master_key: str) -> None:
        if crypto.key_id(master_key) != kid:
            raise KeyMismatch(f"refusing to store another key under {kid}")
        self.store.save(vault_id, kid, self.transit.wrap(master_key))

    def new_version(self, vault_id: str) -> tuple[str, str]:
        """A new key version from the data-key endpoint, stored wrapped: (kid, master key)."""
        master_key, wrapped = self.transit.new_key()
        kid = crypto.key_id(master_key)
        self.store.save(vault_id, kid, wrapped)
        return kid, master_key

    def delete(self, vault_id: str, kid: str) -> bool:
        return self.store.drop(vault_id, kid)
