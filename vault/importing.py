"""`importer()`, once for both vault classes: each names its engine's `Importer`.

Kept apart from vault.importer so that opening a vault does not load the import
machinery until a command imports (the class is named lazily).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from vault.engine import AnyVault
    from vault.importer import Importer


class ImportsFiles:
    """A base of `Vault` and `PgVault`: what imports a plaintext SQLiteSession file."""

    def importer_class(self) -> type[Importer]:  # pragma: no cover (each engine's)
        raise NotImplementedError

    def importer(
        self,
        source: str,
        session_id: str | None = None,
        sessions_table: str | None = None,
        messages_table: str | None = None,
        shred_source: bool = False,
    ) -> Importer:
        """What imports a plaintext SQLiteSession file into this vault (vault.importer)."""
        make = self.importer_class()
        vault = cast("AnyVault", self)
        return make(vault, source, session_id, sessions_table, messages_table, shred_source)
