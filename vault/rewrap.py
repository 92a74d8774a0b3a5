"""`memvault key rewrap`: after the operator rotated a transit vault's transit key, its
wrapped keys move to the newest transit version (the `rewrap` endpoint: no plaintext
changes, no key leaves the service), and the result says which `min_decryption_version`
is now safe: the oldest transit version any wrapped key still needs, the vault's own
and those of its recorded backups (files holding their own wrapped copies).
"""

from __future__ import annotations

import contextlib
import sqlite3
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault.errors import BadInput, KeyRevoked
from vault.keysource.store import WRAPPED, TransitStore

if TYPE_CHECKING:
    from vault.engine import AnyVault


def _wrapped(meta: dict[str, str]) -> dict[str, str]:
    return {k[len(WRAPPED) :]: v for k, v in meta.items() if k.startswith(WRAPPED)}


def _backup_wrapped(path: str) -> dict[str, str] | None:
    """A backup file's own wrapped keys (read only), or None when it cannot be read."""
    if not Path(path).is_file():
        return None
    uri = "file:" + urllib.parse.quote(path) + "?mode=ro"
    with contextlib.suppress(sqlite3.Error):
        conn = sqlite3.connect(uri, uri=True, timeout=5)
        try:
            rows = conn.execute(
                "SELECT key, value FROM memvault_meta WHERE key LIKE ?", (WRAPPED + "%",)
            ).fetchall()
        finally:
            conn.close()
        return _wrapped(dict(rows))
    return None


def rewrap(vault: AnyVault, raise_min: bool = False) -> dict[str, Any]:
    """Rewrap every wrapped key of the vault; with `raise_min`, raise the transit key's
    `min_decryption_version` to the safe one (operator rights)."""
    from vault.keysource.transit import wrapped_version

    ks = vault.keystore
    if not isinstance(ks, TransitStore):
        raise BadInput(
            f"vault {vault.path} keeps its keys in the keyring, so nothing is wrapped; "
            "`key rewrap` is for a vault made with --key-source transit:KEYNAME"
        )
    meta = vault.meta()
    if "revoked_at" in meta:
        raise KeyRevoked(f"vault {vault.path} is revoked: it has no keys left to rewrap")
    transit = ks.transit()
    transit.check_usable()
    assert ks.wrapped is not None  # a vault's store
    moved: list[str] = []
    for kid, old in sorted(_wrapped(meta).items()):
        new = transit.rewrap(old)
        # Only over the same ciphertext: a version destroyed meanwhile stays destroyed.
        if wrapped_version(new) > wrapped_version(old) and ks.wrapped.replace(
            meta["vault_id"], kid, old, new
        ):
            moved.append(kid)
    versions = {k: wrapped_version(v) for k, v in _wrapped(vault.meta()).items()}
    older_backups = []
    unread_backups = []
    needed = list(versions.values())
    for b in vault.backups():
        held = _backup_wrapped(b["path"])
        if held is None:
            if b.get("file") == "present":
                unread_backups.append(b["path"])
            continue
        got = [wrapped_version(v) for v in held.values()]
        needed += got
        if versions and got and min(got) < min(versions.values()):
            older_backups.append(b["path"])
    safe = min(needed) if needed else None
    out: dict[str, Any] = {
        "vault_id": meta["vault_id"],
        "transit_key": ks.name,
        "rewrapped": moved,
        "versions": versions,
        "safe_min_decryption_version": safe,
        "backups_holding_older_versions": older_backups,
        "backups_not_read": unread_backups,
        "min_decryption_version": None,
    }
    if raise_min and safe is not None:
        current = transit.versions()[1]
        if safe > current:
            transit.set_min_decryption_version(safe)
        out["min_decryption_version"] = max(safe, current)
    vault.record("key-rewrap", meta["kid"], rewrapped=moved, safe_min=safe)
    return out
