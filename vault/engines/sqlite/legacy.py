"""Moving a vault made by memvault 0.1.0 to one keyring entry per key version.

0.1.0 kept the key under the bare vault id (`<vault_id>`), a rotation's new
key under `<vault_id>.next`, and a key that `key import` replaced under
`<vault_id>.replaced.<kid>`. Its file says `format = memvault/1`.

On the first open that finds the file's key, under the write lock:
1. store the key as `<vault_id>/<kid>` (read back);
2. one transaction: journal the key as current and every older key the audit
   trail names as destroyed, note the 0.1.0 entries to delete, and set the
   format to `memvault/2` (0.1.0 then refuses the file instead of looking for
   a key that is no longer there);
3. `tidy` deletes the noted entries and the note.
A kill before 2 leaves a 0.1.0 file whose key is found again (step 1 is
idempotent); a kill after it leaves the note, which the next open finishes.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from vault import crypto, keyjournal, testhooks
from vault.engines.sqlite.db import audit, read_meta, set_meta
from vault.engines.sqlite.schema import FILE_FORMAT, LEGACY_FORMAT, migrate
from vault.errors import KeyMismatch, VaultBusy
from vault.keyjournal import CURRENT, DESTROYED, entry_name
from vault.keys import require_key

if TYPE_CHECKING:
    from vault.engines.sqlite.db import VaultFile
    from vault.keys import KeyStore


def upgrade(vault: VaultFile, ks: KeyStore, meta: dict[str, str]) -> str | None:
    """The 0.1.0 file's key, moved to its version entry when the lock is free.

    None when the file changed key meanwhile (the caller reads it afresh).
    """
    vault_id, kid = meta["vault_id"], meta["kid"]
    named = ks.get(entry_name(vault_id, kid))  # restored by a newer `key import`
    current, pending = ks.get(vault_id), ks.get(vault_id + ".next")
    fits = [k for k in (named, current, pending) if k and crypto.is_valid_key(k)]
    key = next((k for k in fits if crypto.key_id(k) == kid), None)
    if key is None:
        if named is None and crypto.is_valid_key(current):
            assert current is not None
            raise KeyMismatch(
                f"the keyring's key for vault {vault_id} has id {crypto.key_id(current)} but "
                f"the vault was written with {kid}; nothing was read or written; restore the "
                "matching key with `memvault key import KIT`"
            )
        require_key(named, vault_id, kid, ks.name)  # says what is missing or wrong
        return None
    try:
        with vault.connection(timeout=0) as conn:
            conn.execute("BEGIN IMMEDIATE")
            migrate(conn)
            now = read_meta(conn, vault.path)
            if now["format"] != LEGACY_FORMAT or now["kid"] != kid:
                return key if now["kid"] == kid else None  # another process moved it
            if named != key:
                ks.set(entry_name(vault_id, kid), key)
            testhooks.failpoint("upgrade-after-store")
            history = keyjournal.known_kids(conn, now)
            for old in sorted(history - {kid}):
                keyjournal.record(conn, old, DESTROYED, "")
            keyjournal.record(conn, kid, CURRENT, now.get("rotated_at", ""))
            ours = []
            # `.next` goes whatever it holds: this file's key (copied above), or a dead
            # rotation's, since 0.1.0 stored it only under the write lock we hold now.
            if pending is not None:
                ours.append(vault_id + ".next")
            # Another copy's key under the old shared name stays for that copy.
            if current is not None and (
                not crypto.is_valid_key(current) or crypto.key_id(current) in history
            ):
                ours.insert(0, vault_id)
            set_meta(conn, format=FILE_FORMAT, **{keyjournal.LEGACY_MARK: json.dumps(ours)})
            audit(conn, "upgrade", kid, keyring="one entry per key version")
            conn.execute("COMMIT")
    except VaultBusy:
        return key  # a writer holds the lock: read with the key; a later open moves it
    testhooks.failpoint("upgrade-after-commit")
    return key
