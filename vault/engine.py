"""What a vault is, whatever stores it: the `Engine` protocol and the one vault type.

Two engines store a vault: a SQLite file (vault.engines.sqlite, `Vault`) and a
PostgreSQL schema (vault.engines.postgres, `PgVault`). Each provides `Engine`:

- connections and transactions: every method below runs in transactions of its
  own, opened by the engine's one opener (`VaultFile.write_transaction`,
  `PgVaultBase.run`/`change`), so that the layers above never write SQL;
- row batches: `row_batches`, every item row in id order, a batch at a time;
- the guard: `guard_message`, the text the engine's trigger refuses a foreign row with;
- the meta, audit and key-journal rows: `meta`, `record`, `audit_log`, `key_versions`,
  and the backups' records that keep retired versions (`record_backup` ...);
- its scrub: `scrub`, what remains of deleted or rewritten rows once it returns True.

`AnyVault` is the vault every command calls, whichever engine `--db` names
(`vault.cli.common.open_any`); the modules above the engines (export, search,
kits, import, backup's marks) take it, never an engine's class. mypy checks that
both classes satisfy it where vault.engines.registry returns them as one.

This module imports no engine, and nothing heavy: types only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vault import crypto, retention
    from vault.chainfloor import Floor
    from vault.chainvault import Point
    from vault.files import Progress
    from vault.import_source import Plan
    from vault.keys import KeyStore
    from vault.results import Accepted, Cleared, KeyVersionInfo, Popped, Report, SessionInfo

# An item row as engines hand it up: (id, session_id, message_data).
Row = tuple[int, str, str]


class Engine(Protocol):
    """What an engine provides the vault above it (see the module's docstring)."""

    @property
    def backend(self) -> str:
        """ "sqlite" or "postgresql": what `status --json` and messages call the engine."""
        ...

    @property
    def path(self) -> Path | str:
        """Where the vault is, as messages show it (a PostgreSQL URL without its password)."""
        ...

    @property
    def keystore(self) -> KeyStore: ...

    @property
    def guard_message(self) -> str:
        """What the engine's guard says when it refuses a row under another key."""
        ...

    # -- the meta, audit and key-journal rows --------------------------
    def meta(self) -> dict[str, str]: ...

    @property
    def vault_id(self) -> str: ...

    @property
    def ttl(self) -> int | None: ...

    def record(self, event: str, kid: str | None, **details: Any) -> None:
        """Append one audit event in a transaction of its own."""
        ...

    def audit_log(self) -> list[dict[str, Any]]: ...

    def switch_meta(
        self,
        expect: dict[str, str | None],
        put: dict[str, str],
        drop: list[str],
        event: str,
        details: dict[str, Any],
    ) -> bool:
        """Drop and set meta rows, audited, in one transaction, only if the meta still
        holds `expect` (None: absent) and no key version is pending; False, with
        nothing written, if not."""
        ...

    def key_versions(self) -> list[KeyVersionInfo]: ...

    def backups(self) -> list[dict[str, Any]]: ...

    def record_backup(self, target: Path) -> retention.BackupRecord: ...

    def settle_backup(self, rec: retention.BackupRecord, kid: str) -> str | None: ...

    def drop_backup(self, rec: retention.BackupRecord) -> None: ...

    # -- rows ----------------------------------------------------------
    def row_batches(self) -> Iterator[list[Row]]:
        """Every item row in id order, a batch at a time, memory flat."""
        ...

    def session_ids(self) -> list[str]: ...

    def count_items(self) -> int: ...

    # -- the key and the scrub -----------------------------------------
    def sealer(self, refresh: bool = False) -> crypto.Sealer: ...

    def scrub(self) -> bool:
        """Remove what deleted or rewritten rows left; False: not finished yet (retried later)."""
        ...


class Import(Protocol):
    """An import of a plaintext SQLiteSession file, planned (vault.importer.Importer)."""

    @property
    def plan(self) -> Plan: ...

    def run(self, progress: Progress | None = None) -> dict[str, Any]: ...

    def __enter__(self) -> Import: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable  # so that a test can ask it of both engines' vaults
class AnyVault(Engine, Protocol):
    """The vault every command calls, in a file or in PostgreSQL."""

    # What `backup` adds on this engine (None: nothing); what a revoke leaves: "file", "rows".
    backup_note: str | None
    stays: str

    def sessions(self, now: int | None = None) -> list[SessionInfo]: ...

    def items(
        self, session_id: str, limit: int | None = None, now: int | None = None
    ) -> tuple[list[Any], int, int]: ...

    def opened_items(
        self,
        session_id: str,
        limit: int | None = None,
        now: int | None = None,
        include_expired: bool = False,
        include_tampered: bool = False,
    ) -> Iterator[crypto.Opened]: ...

    def history_verdict(self, session_id: str) -> str | None: ...

    def accept_history(self) -> Accepted: ...

    def record_anchor(self, into: KeyStore | None = None) -> object: ...

    def status(self, now: int | None = None) -> dict[str, Any]: ...

    def pop(self, session_id: str, n: int = 1) -> Popped: ...

    def clear(self, session_id: str, include_unreadable: bool = False) -> Cleared: ...

    def set_ttl(self, ttl: int | None) -> None: ...

    def purge(self, now: int | None = None, progress: Progress | None = None) -> Report: ...

    def rotate(self, progress: Progress | None = None) -> Report: ...

    def revoke(self) -> dict[str, Any]: ...

    def forget(self, kid: str) -> dict[str, Any]: ...

    def settle_keyring(self) -> dict[str, list[str]]:
        """After a kit import: what this keyring dropped, or keeps for now, of the versions
        other hosts moved on from (PostgreSQL; a file's open settles its own: {})."""
        ...

    def shred(self) -> dict[str, Any]:
        """Destroy the key versions, the rows and what holds them; the report of it."""
        ...

    def backup(self, dest: str | os.PathLike[str]) -> Any:
        """A marked, recorded copy at `dest` (vault.engines.sqlite.backup.BackupResult)."""
        ...

    def importer(
        self,
        source: str,
        session_id: str | None = None,
        sessions_table: str | None = None,
        messages_table: str | None = None,
        shred_source: bool = False,
    ) -> Import:
        """What imports a plaintext SQLiteSession file here (vault.importer.Importer)."""
        ...

    def session(self, session_id: str, *, session_settings: Any = None) -> Any:
        """The SDK session over this vault (imports the Agents SDK)."""
        ...


class SessionVault(Protocol):
    """What a file vault's SDK session asks of it (engines.sqlite.session; `Vault`
    imports that module, so the session types against this, not against `Vault`)."""

    @property
    def path(self) -> Path: ...

    @property
    def ttl(self) -> int | None: ...

    def sealer(self, refresh: bool = False) -> crypto.Sealer: ...

    def meta(self) -> dict[str, str]: ...

    def scrub_after_delete(self) -> bool: ...

    def clear(self, session_id: str, include_unreadable: bool = False) -> Cleared: ...

    def anchor_floor(self) -> Floor | None: ...

    def wrote(self, point: Point | None) -> None: ...

    def record_anchor(self, into: KeyStore | None = None) -> object: ...
