"""`memvault key move`: a vault's key versions from one key source to another (the
OS keyring, or a transit key), once for both engines.

The order makes a kill at any instant harmless, and a second run finishes the move:
1. every version the vault needs (current, retained, the one an unfinished rotation
   moves rows from; while a rotation has a new version staged, the move waits) is
   read from the old source and put in the new one: keyring entries stored and read
   back, or keys wrapped and unwrapped again (so a token that may not decrypt is
   refused before anything changes); a file vault's anchor (vault.chainanchor) in
   the new source is set to the old source's, so that the file is never judged
   afresh, nor by what the new source kept from an earlier stay;
2. one transaction switches the meta (`key_source`, `transit_mount`) and, in the same
   transaction, sets or drops the wrapped keys (which live in the meta), only if the
   vault's key ids and source are still the ones read in 1 (else: busy, run again);
3. the old source is tidied: this host's keyring entries of a vault now in transit
   (those a recorded backup still needs are kept and named). A kill before 3 leaves
   entries that the next `key move` to the same source deletes.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from vault import backupmark, chainanchor, crypto, testhooks
from vault.chainops import CHAIN_META, ON
from vault.errors import KeyProblem, VaultBusy, VaultError
from vault.keyjournal import CURRENT, PENDING, RETAINED, ROTATING_FROM, entry_name
from vault.keyload import refuse_revoked
from vault.keys import KeyStore, require_key
from vault.keysource.store import (
    KEYRING,
    MOUNT,
    SOURCE,
    WRAPPED,
    TransitStore,
    anchor_store,
    init_store,
    marked_left,
    mount_of,
    wrapped_row,
)

if TYPE_CHECKING:
    from vault.engine import AnyVault
    from vault.results import KeyVersionInfo

NEEDED = (CURRENT, RETAINED)


def _busy(vault: AnyVault) -> VaultBusy:
    # A rotation stages its new key in the vault's source of the moment: moving then
    # could leave that key behind, so a move waits for the rotation's switch.
    return VaultBusy(
        f"a rotation of {vault.path} is under way (a new key version is staged, or the key "
        "changed meanwhile); nothing was moved; run `memvault key move` again once it is "
        "done (`memvault rotate` finishes one that was cut off)"
    )


def _names(meta: dict[str, str]) -> tuple[str, str | None]:
    """The vault's source as its meta names it, and its mount (None for the keyring)."""
    return meta.get(SOURCE, KEYRING), mount_of(meta)


def move(vault: AnyVault, target: str, mount: str | None = None) -> dict[str, Any]:
    """Move the vault's keys to `target` (`keyring` or `transit:NAME`), or finish a move."""
    backupmark.refuse_writes(vault, "`memvault key move`")
    meta = vault.meta()
    refuse_revoked(meta)
    new = init_store(target, mount)
    vault_id, old_source = meta["vault_id"], _names(meta)
    new_source = (KEYRING, None) if new is None else (f"transit:{new.key_name}", new.mount)
    out: dict[str, Any] = {"vault_id": vault_id, "from": old_source[0], "to": new_source[0]}
    # A move cut off after its switch: the source it left is recorded and marked now,
    # here too before a move elsewhere (that move's rerun can no longer do it).
    _record_left(vault)
    if old_source == new_source:  # already there: only the tidy is left
        return {**out, "moved": [], "already": True, **_tidy(vault, meta)}
    old_ks = vault.keystore
    versions = vault.key_versions()
    # Read again: loading the key for `key_versions` finishes a file's cut-off rotation,
    # whose old key is then gone (the move must not ask for it).
    meta = vault.meta()
    states = {v.kid: v.state for v in versions}
    if PENDING in states.values():
        raise _busy(vault)
    kids = {k for k, s in states.items() if s in NEEDED} | {meta["kid"]}
    if ROTATING_FROM in meta:
        kids.add(meta[ROTATING_FROM])
    keys = {
        kid: require_key(old_ks.get(entry_name(vault_id, kid)), vault_id, kid, old_ks.name)
        for kid in sorted(kids)
    }
    put, drop = _into(new, vault_id, keys)
    drop += [k for k in meta if k.startswith(WRAPPED) and k not in put]
    if vault.backend == "sqlite":  # a PostgreSQL vault has no anchor yet
        _carry_anchor(old_ks, new or KeyStore(), vault_id)
    testhooks.failpoint("key-move-after-new-source")
    expect: dict[str, str | None] = {
        "kid": meta["kid"],
        ROTATING_FROM: meta.get(ROTATING_FROM),
        SOURCE: meta.get(SOURCE),
        MOUNT: meta.get(MOUNT),
    }
    details = {
        "from": old_source[0], "from_mount": old_source[1], "to": new_source[0],
        "kids": sorted(keys),
    }  # fmt: skip
    if not vault.switch_meta(expect, put, drop, "key-move", details):
        raise _busy(vault)
    testhooks.failpoint("key-move-after-switch")
    # The switch stepped the file's vault head: the source left records that point, so a
    # copy from before the move, opened through it, is behind (its key may be kept there).
    _leave(vault, old_ks)
    vault.record_anchor(new or KeyStore())
    switched = dict(meta)
    for k in drop:
        switched.pop(k, None)
    switched.update(put)
    return {**out, "moved": sorted(keys), "already": False, **_tidy(vault, switched, versions)}


def _into(
    new: TransitStore | None, vault_id: str, keys: dict[str, str]
) -> tuple[dict[str, str], list[str]]:
    """Put every key in the new source and check it reads back; the meta rows to set and
    to drop at the switch."""
    if new is None:
        ks = KeyStore()
        ks.check_usable()
        for kid, key in keys.items():
            ks.set(entry_name(vault_id, kid), key)
            require_key(ks.get(entry_name(vault_id, kid)), vault_id, kid, ks.name)
        return {}, [SOURCE, MOUNT]
    transit = new.transit()
    transit.check_usable()
    transit.ensure_key()
    put = new.source_rows()
    for kid, key in keys.items():
        wrapped = transit.wrap(key)
        if crypto.key_id(transit.unwrap(wrapped)) != kid:  # pragma: no cover (a broken service)
            raise KeyProblem(f"{transit.where()} did not give back key {kid}; nothing was moved")
        put[wrapped_row(kid)] = wrapped
    return put, []


def _record_left(vault: AnyVault) -> None:
    """A move run again (the first was cut off after its switch, or it is done): the
    file's point recorded in the source the last move left, as the first run does after
    its switch, so that a copy from before it, opened through that source, is behind."""
    if vault.backend != "sqlite":
        return  # a PostgreSQL vault has no anchor yet
    moves = [e for e in vault.audit_log() if e.get("event") == "key-move"]
    if not moves:
        return
    last = moves[-1]
    with contextlib.suppress(VaultError):  # that source out of reach: the window stays
        left = init_store(str(last.get("from", KEYRING)), last.get("from_mount"))
        vault.sealer()
        _leave(vault, left or KeyStore())


def _leave(vault: AnyVault, left: KeyStore) -> None:
    """After the switch: the file's point recorded in the source left, and, in the key
    service, marked there as left (chainanchor.leave): a file naming that source is then
    a copy from before the move, even one given its meta rows over a later state. Not
    in a keyring: it is one host's, and that host would go on refusing the vault after
    it came back to the keyring through another host."""
    vault.record_anchor(left)
    if vault.backend != "sqlite":
        return  # a PostgreSQL vault has no anchor yet
    meta = vault.meta()
    if marked_left(left, meta):  # not if the file names it again (an `accept` since)
        with contextlib.suppress(VaultError):  # out of reach: a rerun of the move marks it
            chainanchor.leave(anchor_store(left), meta["vault_id"])


def _carry_anchor(old: KeyStore, new: KeyStore, vault_id: str) -> None:
    """Before the switch: the new source's anchor set to the old one's, so that the file
    is judged from where it was, never afresh, nor by what the new source kept from an
    earlier stay (a restore since may have put the vault behind it on purpose)."""
    try:
        point = chainanchor.read(anchor_store(old), vault_id)
    except ValueError:  # not memvault's: the new source starts it afresh
        point = None
    chainanchor.replace(anchor_store(new), vault_id, point)


def _tidy(
    vault: AnyVault, meta: dict[str, str], versions: list[KeyVersionInfo] | None = None
) -> dict[str, Any]:
    """Delete this host's keyring entries of a vault whose keys now live wrapped, except
    the versions a recorded backup (a keyring copy) still reads through them. `versions`:
    as read before the switch (after it, `vault`'s store is the source it left, which
    cannot unwrap the keys wrapped by another transit key)."""
    nothing: dict[str, Any] = {"removed_from_keyring": [], "kept_in_keyring": []}
    if meta.get(SOURCE, KEYRING) == KEYRING:
        if meta.get(CHAIN_META) == ON:  # the anchor lives beside the keys (a keyring's)
            chainanchor.mark_chained(KeyStore(), meta["vault_id"])
        return nothing  # the wrapped keys left with the switch's transaction
    ks = KeyStore()
    try:
        ks.check_usable()
    except KeyProblem:
        return nothing  # no keyring on this host: nothing of the vault can be in it
    vault_id = meta["vault_id"]
    versions = versions if versions is not None else vault.key_versions()
    kept = sorted(v.kid for v in versions if v.backups and ks.get(entry_name(vault_id, v.kid)))
    removed = []
    for v in versions:
        if v.kid not in kept and ks.delete(entry_name(vault_id, v.kid)):
            removed.append(v.kid)
            testhooks.failpoint("key-move-after-tidy-one")
    if not kept:  # nothing of the vault is left to open a copy with: nor is its anchor
        chainanchor.forget(ks, vault_id)
    # Kept: the point the move recorded judges a copy from the keyring days, which opens
    # through the versions kept (a move back sets it afresh, `_carry_anchor`).
    return {"removed_from_keyring": sorted(removed), "kept_in_keyring": kept}
