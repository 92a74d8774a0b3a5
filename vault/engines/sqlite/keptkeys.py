"""The retained key versions of a vault file: its backups' records, `key forget`.

vault.retention holds the rule (a version a recorded backup uses is kept); this is
the file vault's side of it, a base of `KeyLifecycle`, kept apart so that module
stays readable. PostgreSQL's twins are in vault.engines.postgres.admin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vault import keyjournal, retention, testhooks
from vault.engines.sqlite.db import VaultFile, audit, read_meta
from vault.errors import BadInput
from vault.keyjournal import DESTROYED, RETAINED, entry_name
from vault.keyload import refuse_revoked
from vault.keysource.store import forgotten, forgotten_paths
from vault.results import KeyVersionInfo


class KeptVersions(VaultFile):
    """What a file vault keeps for its backups; `KeyLifecycle` adds the keys themselves."""

    def backups(self) -> list[dict[str, Any]]:
        """Every recorded backup, whether it is there, and whether it opens here."""
        with self.connection() as conn:
            conn.execute("BEGIN")
            recs = retention.records(conn)
            states = {v.kid: v.state for v in keyjournal.versions(conn)}
        return retention.described(recs, states)

    # -- the records of backups (vault.engines.sqlite.backup) ------------------------------
    def record_backup(self, target: Path) -> retention.BackupRecord:
        """Record a backup about to be copied, under the key the file uses now."""
        with self.write_transaction() as conn:
            meta = read_meta(conn, self.path)
            refuse_revoked(meta)
            rec = retention.new_record(target, meta["kid"])
            retention.add(conn, rec)
        return rec

    def settle_backup(self, rec: retention.BackupRecord, kid: str) -> str | None:
        """The copy uses `kid` (a rotation may have committed before its snapshot): the
        record says so; the journal state of `kid` (DESTROYED: the copy is dead)."""
        with self.write_transaction() as conn:
            retention.set_kid(conn, rec.backup_id, kid)
            return {v.kid: v.state for v in keyjournal.versions(conn)}.get(kid)

    def drop_backup(self, rec: retention.BackupRecord) -> None:
        with self.write_transaction() as conn:
            retention.drop(conn, rec.backup_id)

    def forget(self, kid: str) -> dict[str, Any]:
        """Destroy a retained version on purpose: its entry, then its backups' records.

        Killed between the two, the version is still recorded retained with no entry
        (`key list` shows it); `key forget` again finishes.
        """
        ks = self.keystore
        ks.check_usable()
        with self.connection() as conn:
            conn.execute("BEGIN")
            meta = read_meta(conn, self.path)
            states = {v.kid: v.state for v in keyjournal.versions(conn)}
        refuse_revoked(meta)
        if states.get(kid) != RETAINED:
            raise BadInput(
                f"key {kid[:40]!r} is not a retained version of {self.path} (it is "
                f"{states.get(kid, 'unknown here')}); `memvault key list` shows the retained ones"
            )
        lost = [b for b in self.backups() if b["kid"] == kid]
        ks.delete(entry_name(meta["vault_id"], kid))
        testhooks.failpoint("forget-after-delete")
        result = forgotten(meta, kid, lost)
        with self.write_transaction() as conn:
            keyjournal.record(conn, kid, DESTROYED)
            retention.drop_kid(conn, kid)
            audit(conn, "key-forget", kid, **forgotten_paths(result))
        return result


def with_backups(
    versions: list[KeyVersionInfo], recs: list[retention.BackupRecord]
) -> list[KeyVersionInfo]:
    """Each version with the recorded backups that use it (both engines' `key list`)."""
    states = {v.kid: v.state for v in versions}
    described = retention.described(recs, states)
    return [
        KeyVersionInfo(
            v.kid,
            v.state,
            v.in_keyring,
            v.created_at,
            tuple(b for b in described if b["kid"] == v.kid),
        )
        for v in versions
    ]
