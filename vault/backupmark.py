"""The mark that makes a vault file a backup, and the refusal it earns from writers.

`memvault backup` writes `backup_of` (the live vault's id), `backup_id` (random,
the name the live vault's records give this copy) and `backed_up_at` into the
copy's `memvault_meta`. A marked file shares its vault id and key versions with
the live vault: a write to it (a rotation, a purge, an agent's new item) would
fork the history and could destroy keys the live vault still uses, so every
writing command refuses it until `memvault restore` puts it back as the live
vault (which removes the mark). Reading it needs no change at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from vault.engines.sqlite.schema import utcnow
from vault.errors import OperationFailed

BACKUP_OF = "backup_of"
BACKUP_ID = "backup_id"
BACKED_UP_AT = "backed_up_at"
# Where the live vault was (a file's absolute path, or a PostgreSQL URL without its
# password): `restore` into another path refuses while that vault is still there.
BACKUP_FROM = "backup_from"
# The backup's own vault head, sealed under its key (vault.chainvault.seal_backup): what
# it is judged against, never the live vault's anchor (vault.engines.sqlite.anchoring).
BACKUP_POINT = "backup_point"
MARK = (BACKUP_OF, BACKUP_ID, BACKED_UP_AT, BACKUP_FROM, BACKUP_POINT)


class HasMeta(Protocol):
    @property
    def path(self) -> Path | str: ...

    def meta(self) -> dict[str, str]: ...


class IsABackup(OperationFailed):
    """A writing command was given a backup file (exit 1: the request is refused)."""


def new_mark(vault_id: str, backup_id: str, source: str) -> dict[str, str]:
    """The meta rows of a backup of `vault_id` at `source` taken now, named as its
    record names it."""
    return {BACKUP_OF: vault_id, BACKUP_ID: backup_id, BACKED_UP_AT: utcnow(), BACKUP_FROM: source}


def is_backup(meta: dict[str, str]) -> bool:
    return BACKUP_OF in meta


def refuse(meta: dict[str, str], path: Path | str, doing: str) -> None:
    """IsABackup when `meta` is a backup's; `doing` names the refused command."""
    if not is_backup(meta):
        return
    raise IsABackup(
        f"{path} is a backup of vault {meta[BACKUP_OF]} (made {meta.get(BACKED_UP_AT, '?')}); "
        f"{doing} never writes to a backup; read it with `memvault --db {path} show`, "
        f"`export` or `verify`, or run `memvault restore {path}` to make it the live vault; "
        "nothing was changed"
    )


def refuse_writes(vault: HasMeta, doing: str) -> None:
    """`refuse` for an open vault (a file or a PostgreSQL vault, which is never a backup)."""
    refuse(vault.meta(), vault.path, doing)
