"""Loading the sealer of the key a vault uses now, once for both engines.

The vault's meta names its current key version (`kid`) and, while an online
rotation moves rows, the version it moves them from (`rotating_from`). Each is
the keyring entry `<vault_id>/<kid>` (vault.keyjournal.entry_name), read through
the vault's `keystore`. Between reading the meta and reading the keyring another
process may finish a rotation and delete the entry just named: an absent entry is
an error only while the meta still names it; otherwise the meta is read afresh,
up to `ATTEMPTS` times.

What differs between the engines comes in as hooks: a 0.1.0 file moves its key
first (`own_key`), and a PostgreSQL vault explains a key another host rotated
away (`on_missing`).
"""

from __future__ import annotations

from collections.abc import Callable

from vault import crypto, rotation
from vault.errors import KeyRevoked, VaultBusy
from vault.keyjournal import ROTATING_FROM, entry_name
from vault.keys import KeyStore, require_key

ATTEMPTS = 5
Meta = dict[str, str]


def refuse_revoked(meta: Meta) -> None:
    """A revoked vault's key is gone for ever: say so, and what removes the vault."""
    if "revoked_at" in meta:
        raise KeyRevoked(
            f"the key of vault {meta['vault_id']} was revoked on {meta['revoked_at']}; its "
            "history can never be read again; `memvault shred` removes the vault"
        )


def entry_key(
    ks: KeyStore,
    vault_id: str,
    kid: str,
    fresh_meta: Callable[[], Meta],
    field: str = "kid",
    on_missing: Callable[[str, str], None] | None = None,
) -> str | None:
    """The key of the entry `<vault_id>/<kid>`; None when it is absent because the vault
    moved on meanwhile (`fresh_meta()[field]` no longer names `kid`: read it again).

    Absent while still named: `on_missing(vault_id, kid)` may raise a better error,
    else KeyMissing; a malformed or foreign entry is refused (keys.require_key).
    """
    key = ks.get(entry_name(vault_id, kid))
    if key is None and fresh_meta().get(field) != kid:
        return None
    if key is None and on_missing is not None:
        on_missing(vault_id, kid)
    return require_key(key, vault_id, kid, ks.name)


def load(
    ks: KeyStore,
    where: str,
    read_meta: Callable[[], Meta],
    *,
    fresh_meta: Callable[[], Meta] | None = None,
    own_key: Callable[[Meta], tuple[bool, str | None]] | None = None,
    on_missing: Callable[[str, str], None] | None = None,
    rotating: bool = True,
) -> tuple[Meta, crypto.Sealer]:
    """The meta an attempt read, and the sealer of its current key.

    `read_meta` is one attempt's snapshot, `fresh_meta` (default: `read_meta`) what is
    read to tell a vanished entry from a missing one. `own_key(meta)` returns
    (True, key) when the engine finds the key its own way (None: the vault moved on).
    With `rotating`, a vault whose rows a rotation moves gets a RotatingSealer that
    opens both versions. Revoked: KeyRevoked. Changing key on every attempt: VaultBusy.
    """
    ks.check_usable()
    fresh = fresh_meta or read_meta
    for _attempt in range(ATTEMPTS):
        meta = read_meta()
        refuse_revoked(meta)
        vault_id, kid = meta["vault_id"], meta["kid"]
        handled, key = own_key(meta) if own_key is not None else (False, None)
        if not handled:
            key = entry_key(ks, vault_id, kid, fresh, "kid", on_missing)
        if key is None:
            continue  # the vault moved on while we looked: read it afresh
        sealer = crypto.Sealer(key)
        if rotating and ROTATING_FROM in meta:
            # An online rotation moves rows from this key: both open until it ends.
            old_kid = meta[ROTATING_FROM]
            old = entry_key(ks, vault_id, old_kid, fresh, ROTATING_FROM)
            if old is None:
                continue  # it ended and dropped that entry meanwhile
            sealer = rotation.RotatingSealer(key, crypto.Sealer(old))
        return meta, sealer
    raise VaultBusy(f"{where} kept changing key while memvault read it; try again")
