"""`verify`'s history-chain check of a vault file (vault.verify): every session's rows
judged against its head, then the vault head against every head and against the
floor the caller read before its snapshot (vault.engines.sqlite.anchoring).
Read-only: a file the upgrade has not linked yet is reported, never linked here."""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Protocol

from vault import backupmark, chainops, crypto
from vault.chaincheck import Tamper
from vault.engines.sqlite import chainrows, vaulthead

if TYPE_CHECKING:
    from vault.chainfloor import Floor


class Report(Protocol):
    def add(self, problem: str, detail: str, count: int = 1) -> None: ...


def _why(kind: Tamper, backup: bool, exact: bool) -> str:
    if kind is Tamper.VAULT_MISMATCH:
        return "its sessions do not match its vault head; `memvault accept` takes them as they are"
    if exact:
        return "it is not the state this backup was made in"
    if backup:  # judged as the live vault: a backup found where the live vault is
        return (
            "it is a backup copied over the live vault, older than the state memvault "
            "recorded of it; put the newer file back, or move this one elsewhere and "
            "`memvault restore` it from there"
        )
    return (
        "the file is older than the state memvault recorded of it outside the file; put "
        "the newer file back, or `memvault accept` takes this one as it is"
    )


def judge_chains(
    conn: sqlite3.Connection,
    report: Report,
    sealer: crypto.Sealer,
    meta: dict[str, str],
    floor: Floor | None,
) -> None:
    """The first problem of each session, by kind, then the vault's as a whole."""
    backup = backupmark.is_backup(meta)
    if meta.get(chainops.CHAIN_META) != chainops.ON and not vaulthead.exists(conn):
        if backup:
            return  # made before the upgrade: it has no chain to judge (SECURITY.md)
        report.add(
            "history_chain",
            "the upgrade has not linked the history yet: any "
            "command that uses the key (`memvault show SESSION`) links it",
        )
        return
    keys = chainops.keys_for(sealer, meta["vault_id"])
    for sid in chainrows.judged_sessions(conn):
        verdict = chainrows.judge(conn, keys, sid, whole_vault=False)
        if verdict.kind is not None:
            at = "" if verdict.index is None else f" (its item #{verdict.index + 1})"
            report.add("history_chain", f"session {sid[:60]!r}: {verdict.kind.value}{at}")
    kind = vaulthead.verdict(conn, keys, floor)
    if kind is not None:
        why = _why(kind, backup, floor is not None and floor.exact)
        report.add("history_chain", f"the vault as a whole: {kind.value} ({why})")
