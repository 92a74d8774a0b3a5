"""Key sources: where the master key of each key version comes from.

A source hands out, stores and deletes one key version's master key, named by the
vault's id and the version's kid. `keyring` (vault.keysource.oskeyring) keeps the key
itself in the OS keyring, today's default; `transit` (vault.keysource.transit) keeps
only a wrapped copy, which a named transit key of OpenBao or HashiCorp Vault unwraps,
in a `WrappedKeys` store that the vault provides.

A vault chooses its source at init (`memvault init --key-source`); its meta says which
(vault.keysource.store).
"""

from __future__ import annotations

from typing import Protocol


class KeySource(Protocol):
    """One place master keys live. Failures are `KeyProblem`s (exit 4) naming the fix."""

    @property
    def name(self) -> str:
        """Short and stable: `keyring`, or `transit:KEYNAME`."""
        ...

    def where(self) -> str:
        """For people: which keyring backend, or which service, mount and key."""
        ...

    def check_usable(self) -> None:
        """Raise the `KeyProblem` that any call would meet, or return."""
        ...

    def get(self, vault_id: str, kid: str) -> str | None:
        """The key version's master key, or None when this source has none for it."""
        ...

    def put(self, vault_id: str, kid: str, master_key: str) -> None: ...

    def delete(self, vault_id: str, kid: str) -> bool:
        """Forget the key version; True if it was there. Missing is not an error."""
        ...


class WrappedKeys(Protocol):
    """Where a transit source keeps the wrapped master keys (the vault itself, once
    wired): opaque ciphertexts that only the transit key turns back into keys."""

    def load(self, vault_id: str, kid: str) -> str | None: ...

    def save(self, vault_id: str, kid: str, wrapped: str) -> None: ...

    def drop(self, vault_id: str, kid: str) -> bool: ...

    def replace(self, vault_id: str, kid: str, old: str, new: str) -> bool:
        """`new` in place of `old` (a rewrap), only if `old` is still what is stored."""
        ...
