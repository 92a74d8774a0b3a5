"""Which engine a location names, and the one place that opens, creates or verifies a vault.

A `postgresql://` URL (in `--db`, `db_path` or `$MEMVAULT_DB`) names a PostgreSQL vault,
anything else a vault file. Callers (the CLI, `vault.open_session`, `chat`) get an
`AnyVault` (vault.engine) and never ask which engine it is. Each engine is imported only
when a location names it: asyncpg and SQLAlchemy stay unloaded for a file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vault import paths
from vault.engines.sqlite.schema import DEFAULT_TTL

if TYPE_CHECKING:
    from vault.engine import AnyVault
    from vault.engines.sqlite.restore import RestorePlan
    from vault.keys import KeyStore
    from vault.verify import VerifyReport

Location = str | os.PathLike[str] | None


def open_vault(db: Location, keystore: KeyStore | None = None) -> AnyVault:
    """The vault at `db`; NotAVault (exit 3) when there is none. The key loads when needed."""
    url = paths.postgres_url(db)
    if url is not None:
        from vault.engines.postgres.vault import PgVault

        return PgVault.open(url, keystore)
    from vault.engines.sqlite.vault import Vault

    return Vault.open(db, keystore)


def init_vault(
    db: Location, ttl: int | None = DEFAULT_TTL, keystore: KeyStore | None = None
) -> AnyVault:
    """A new vault and its key at `db`; VaultExists when anything is there."""
    url = paths.postgres_url(db)
    if url is not None:
        from vault.engines.postgres.vault import PgVault

        return PgVault.init(url, ttl, keystore)
    from vault.engines.sqlite.vault import Vault

    return Vault.init(db, ttl, keystore)


def verify_vault(db: Location) -> VerifyReport:
    """`memvault verify` of the vault at `db`: read-only, so not through `open_vault`,
    which migrates (and, for a file, finishes a pending scrub)."""
    url = paths.postgres_url(db)
    if url is not None:
        from vault.engines.postgres.vault import PgVault

        return PgVault.verify(url)
    from vault.engines.sqlite.vault import Vault

    return Vault.verify(db)


@dataclass
class Restore:
    """A restore checked and planned (`plan`, for the question to ask); `run()` does it."""

    plan: RestorePlan
    run: Callable[[], dict[str, Any]]
    # PostgreSQL replaces the vault's rows in one transaction; a file is replaced whole.
    in_place: bool = False


def check_restore(db: Location, backup: str) -> Restore:
    """The restore of the backup file `backup` as the vault at `db`, checked first.

    A file is restored by its path, where there may be no vault yet (engines.sqlite.restore);
    a PostgreSQL vault is opened, and its rows replaced (engines.postgres.restore).
    """
    url = paths.postgres_url(db)
    if url is not None:
        from vault.engines.postgres.restore import check as pg_check
        from vault.engines.postgres.restore import restore as pg_restore
        from vault.engines.postgres.vault import PgVault

        vault = PgVault.open(url)
        pg_plan = pg_check(vault, backup)
        return Restore(pg_plan, lambda: pg_restore(vault, pg_plan), in_place=True)
    from vault.engines.sqlite.restore import check, restore

    plan = check(backup, db)
    return Restore(plan, lambda: restore(plan))
