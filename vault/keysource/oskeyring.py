"""The `keyring` key source: the master key itself, one OS keyring entry per version."""

from __future__ import annotations

from vault.keyjournal import entry_name
from vault.keys import KeyStore


class KeyringSource:
    """`KeySource` over the KeyStore: the entry `<vault_id>/<kid>` of service memvault."""

    def __init__(self, store: KeyStore | None = None) -> None:
        self.store = store if store is not None else KeyStore()

    @property
    def name(self) -> str:
        return "keyring"

    def where(self) -> str:
        return f"the keyring ({self.store.name})"

    def check_usable(self) -> None:
        self.store.check_usable()

    def get(self, vault_id: str, kid: str) -> str | None:
        return self.store.get(entry_name(vault_id, kid))

    def put(self, vault_id: str, kid: str, master_key: str) -> None:
        self.store.set(entry_name(vault_id, kid), master_key)

    def delete(self, vault_id: str, kid: str) -> bool:
        return self.store.delete(entry_name(vault_id, kid))
