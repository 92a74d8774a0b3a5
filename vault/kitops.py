"""The two operations behind `memvault key export` / `memvault key import`.

A kit (vault.kit) holds every key version the vault still needs: the current
one, those retained for recorded backups and a pending one. Import stores, of
the kit's versions, each one the target file needs (its own key, and the
versions its journal keeps): one kit brings back the live vault and every
backup of it, `cp` copies included, since a copy's key is one of those.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault import backupmark, crypto
from vault.errors import KeyMismatch, KeyProblem, KeyRevoked, VaultError
from vault.keyjournal import CURRENT, PENDING, RETAINED, ROTATING_FROM, entry_name
from vault.keysource.store import entry_for_import
from vault.kit import KIT_VERSION, Kit, check_passphrase, load, seal
from vault.kitfile import check_kit_target, write_kit_file

if TYPE_CHECKING:
    from vault.engine import AnyVault

# The journal states whose keys a kit carries: the journal's `retained` state keeps a
# version decrypt-only for recorded backups.
NEEDED_STATES = (CURRENT, PENDING, RETAINED)


def needed_kids(vault: AnyVault, meta: dict[str, str]) -> set[str]:
    """The key versions this file needs: its own key, and those its journal keeps."""
    # While a rotation moves rows (under way, or cut off), the key it moves them from.
    kids = {meta["kid"], meta.get(ROTATING_FROM, "")}
    with contextlib.suppress(VaultError):  # no usable keyring: the file's kid is enough
        kids |= {v.kid for v in vault.key_versions() if v.state in NEEDED_STATES}
    return {k for k in kids if crypto.looks_like_kid(k)}


def export_kit(
    vault: AnyVault,
    path: str | os.PathLike[str],
    passphrase: str,
    force: bool = False,
) -> dict[str, Any]:
    """Write every key version the vault needs, wrapped under `passphrase`, to a new
    0600 file. A version whose entry is not in this keyring is left out, and named."""
    check_passphrase(passphrase)
    sealer = vault.sealer()  # a working key, checked against the file
    meta = vault.meta()
    check_kit_target(vault, path, force)
    vault_id = meta["vault_id"]
    others: dict[str, str] = {}
    missing: list[str] = []
    for kid in sorted(needed_kids(vault, meta) - {sealer.kid}):
        key = vault.keystore.get(entry_name(vault_id, kid))
        if key and crypto.is_valid_key(key) and crypto.key_id(key) == kid:
            others[kid] = key
        else:
            missing.append(kid)
    kit = seal(sealer.master_key, vault_id, passphrase, others)
    target = write_kit_file(path, kit.to_json(), force=force)
    if not backupmark.is_backup(meta):  # a backup is read, never written
        vault.record(
            "key-export", kit.kid, kit_version=KIT_VERSION, kdf="scrypt", kids=list(kit.kids)
        )
    return {
        "path": str(target),
        "vault_id": vault_id,
        "kid": kit.kid,
        "kids": list(kit.kids),
        "kids_missing": missing,
        "created_at": kit.created_at,
    }


def check_kit_fits(vault: AnyVault, kit: Kit, path: Path) -> dict[str, str]:
    """Refuse, naming the ids, a kit from another vault or without the file's key."""
    meta = vault.meta()
    if kit.vault_id != meta["vault_id"]:
        raise KeyMismatch(
            f"the recovery kit {path} belongs to vault {kit.vault_id}, not to vault "
            f"{meta['vault_id']} at {vault.path}; use the kit exported from this vault"
        )
    if "revoked_at" in meta:
        raise KeyRevoked(
            f"the key of vault {meta['vault_id']} was revoked on {meta['revoked_at']}; a "
            "recovery kit cannot bring it back (its rows were cut off from every key)"
        )
    if meta["kid"] not in kit.held:
        raise KeyMismatch(
            f"the recovery kit {path} holds key {', '.join(kit.held)} but vault "
            f"{meta['vault_id']} at {vault.path} uses key {meta['kid']} (the kit predates a "
            "rotation, or this copy's key was forgotten); use a kit exported after the last "
            "rotation"
        )
    return meta


def import_kit(
    vault: AnyVault,
    path: str | os.PathLike[str],
    passphrase: str | Callable[[], str],
    confirm_replace: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Put the kit's keys the file needs in the keyring, each as its own version entry,
    after checking them against the file's key ids.

    Touches no other entry: a live vault and a restored backup copy of it (at an
    older key) each keep theirs. An entry that already holds its key is left alone;
    one that holds something else (damaged) is replaced after
    `confirm_replace(what_it_held)`. `passphrase` may be a callable, asked only once
    the kit is known to fit the vault.
    """
    p = Path(path)
    kit = load(p)
    meta = check_kit_fits(vault, kit, p)
    wanted = needed_kids(vault, meta) & set(kit.held)
    secret = passphrase() if callable(passphrase) else passphrase
    check_passphrase(secret)
    keys = kit.open(secret, p)  # each key's id checked against the kit's
    vault_id = meta["vault_id"]
    ks = vault.keystore
    ks.check_usable()
    states: dict[str, str] = {}
    replaced: str | None = None
    for kid in sorted(wanted):
        name = entry_name(vault_id, kid)
        before = entry_for_import(ks, name)
        if before == keys[kid]:
            states[kid] = "present"
            continue
        if before is None:
            states[kid] = "missing"
        else:
            states[kid] = "mismatched"
            held = crypto.key_id(before) if crypto.is_valid_key(before) else "unknown"
            if kid == meta["kid"]:
                replaced = held
            if confirm_replace is not None:
                confirm_replace(held)  # raises to refuse
        ks.set(name, keys[kid])  # verified by reading it back
    added = [kid for kid, st in states.items() if st == "missing"]
    try:
        fresh = vault.sealer(refresh=True)  # a 0.1.0 file moves to the new layout here
        if fresh.kid != meta["kid"]:
            raise KeyProblem(f"the keyring did not keep the restored key for vault {vault_id}")
    except BaseException:
        # A revoke or shred that ran since the kit was checked destroyed the entries it
        # knew of before these were stored: the entries this import added go too.
        for kid in added:
            with contextlib.suppress(VaultError):
                ks.delete(entry_name(vault_id, kid))
        raise
    state = states[meta["kid"]]
    stored = sorted(k for k, st in states.items() if st != "present")
    if not backupmark.is_backup(meta):  # a backup is read, never written
        extra = {"replaced_kid": replaced} if replaced else {}
        vault.record("key-import", meta["kid"], keyring_before=state, stored=stored, **extra)
    return {
        "path": str(p),
        "vault_id": vault_id,
        "kid": meta["kid"],
        "keyring_before": state,
        "replaced_kid": replaced,
        "restored": bool(stored),
        "stored_kids": stored,
        "kit_kids": list(kit.held),
        "keyring": ks.name,
    }
