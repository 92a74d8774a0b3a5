"""Shred's last resort for a file SQLite cannot read: the keys it can still name.

A `memvault_meta` row keeps its key and value side by side in a page, so a vault
id, its key ids and a backup mark can be found in the raw bytes of a damaged file
(page 1 included); the keyring entries they name are destroyed, or the report says
plainly why none was.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from vault import files, keyjournal, paths
from vault.keys import KeyStore
from vault.keysource.store import anchor_store, forget_anchor

_RAW_VAULT_ID = re.compile(rb"vault_id(mv-[0-9a-f]{24})")
_RAW_KID = re.compile(rb"(mv1:[0-9a-f]{16})")
_RAW_BACKUP_OF = re.compile(rb"backup_of(mv-[0-9a-f]{24})")
# What a backup's shred says of the keys it leaves (vault.backupmark).
KEYS_KEPT = (
    "kept: this file was a backup of vault {}, whose key versions the live vault (and "
    "its other backups) still use; `memvault revoke` or `shred` of the live vault destroys them"
)


def _raw_ids(path: Path) -> tuple[set[str], set[str], set[str]]:
    """Vault ids, key ids and backup marks (the vault ids of `backup_of`) found in the
    raw bytes of the file and its side files.

    A `memvault_meta` row keeps its key and value side by side in a page, so the
    vault id survives damage to other pages (page 1 included); every key id the
    file ever recorded or stamped on an envelope is this file's.
    """
    ids: set[str] = set()
    kids: set[str] = set()
    backup_of: set[str] = set()
    for p in paths.sidecars(path):
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            fd = os.open(p, os.O_RDONLY | files.NO_FOLLOW)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as fh:
            tail = b""
            while block := fh.read(1 << 22):
                data = tail + block
                ids.update(m.decode() for m in _RAW_VAULT_ID.findall(data))
                kids.update(m.decode() for m in _RAW_KID.findall(data))
                backup_of.update(m.decode() for m in _RAW_BACKUP_OF.findall(data))
                tail = data[-64:]
    return ids, kids, backup_of


def destroy_keys(path: Path, keystore: KeyStore | None, report: dict[str, Any]) -> None:
    """Destroy the keys a damaged file can still name; say so plainly when it names none."""
    ids, kids, backup_of = _raw_ids(path)
    if report.get("vault_id"):
        ids.add(report["vault_id"])
    if report.get("kid"):
        kids.add(report["kid"])
    report["damaged"] = True
    report.setdefault("sessions", None)
    report.setdefault("items", None)
    if len(ids) != 1:
        report.update(
            vault_id=None,
            kid=None,
            key_destroyed=False,
            destroyed_kids=[],
            other_copies_kids=[],
            foreign_kid=None,
        )
        report["key_problem"] = (
            "the file is too damaged to name its vault id, so no keyring entry was destroyed; "
            "if you know the vault id, delete the keyring entry (service `memvault`) yourself"
        )
        return
    (vault_id,) = ids
    report["vault_id"] = vault_id
    if vault_id in backup_of:  # a damaged backup: its keys are still the live vault's
        report.update(backup_of=vault_id, keys_kept=KEYS_KEPT.format(vault_id))
        report.update(key_destroyed=False, destroyed_kids=[], other_copies_kids=[])
        report.setdefault("kid", None)
        report["foreign_kid"] = None
        return
    if not report.get("kid") and len(kids) == 1:
        report["kid"] = next(iter(kids))
    report.setdefault("kid", None)
    ks = keystore or KeyStore()
    ks.check_usable()
    in_use = {report["kid"]} - {None}
    forget_anchor(anchor_store(ks), vault_id, in_use or kids)
    report.update(keyjournal.destroy_entries(ks, vault_id, kids, in_use))
    if report.get("foreign_kid"):
        report["key_problem"] = (
            f"the keyring entry of {vault_id} holds key {report['foreign_kid']}, which this file "
            "never used (another copy's key?); it was left in place"
        )
