"""A vault's key store, chosen by its meta: the OS keyring's (`KeyStore`, the default),
or `TransitStore`, for a vault whose meta says `key_source` = `transit:NAME`.

The engines call either the same way: get, set and delete of the entry `<vault_id>/<kid>`.
A `TransitStore` keeps each version's master key only wrapped by the transit key, in the
vault itself (the meta row `wrapped_key:<kid>`, through the engine's `WrappedKeys`), and
unwraps it through the service on each get. Meta rows rather than a table of their own:
they are written in the very transaction that switches the vault's `kid` (so a kill
leaves the old state or the new one), and backups, restores and shred already carry or
drop the meta whole, on both engines, with no migration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

from vault.errors import (
    BadInput,
    KeyProblem,
    KeySourceDenied,
    KeySourceUnavailable,
    VaultBusy,
)
from vault.keys import KeyStore

if TYPE_CHECKING:
    from vault.chainanchor import Store
    from vault.keysource import WrappedKeys
    from vault.keysource.transit import Transit
    from vault.keysource.wrapped import TransitKeySource

SOURCE = "key_source"  # meta: absent or `keyring`, or `transit:NAME`
MOUNT = "transit_mount"  # meta: the transit engine's mount, for a transit vault
WRAPPED = "wrapped_key:"  # meta rows `wrapped_key:<kid>`: one version's wrapped master key
DEFAULT_MOUNT = "transit"
KEYRING = "keyring"


def parse_source(text: str) -> str | None:
    """The transit key's name of `transit:NAME`, None for `keyring`; anything else refused."""
    if text == KEYRING:
        return None
    kind, _, name = text.partition(":")
    if kind != "transit" or not name:
        raise BadInput(
            f"{text!r} is not a key source; give keyring, or transit:KEYNAME (a transit key "
            "of OpenBao or HashiCorp Vault)"
        )
    return name


def source_of(meta: dict[str, str]) -> str:
    """What the vault's key source is, for people: `keyring`, or `transit:NAME (mount M)`."""
    source = meta.get(SOURCE, KEYRING)
    if source == KEYRING:
        return source
    return f"{source} (mount {meta.get(MOUNT, DEFAULT_MOUNT)})"


def same_source(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether two vaults' metas name the same key source: the keyring, or one transit
    key at one mount (so wrapped versions from one unwrap under the other)."""
    return a.get(SOURCE, KEYRING) == b.get(SOURCE, KEYRING) and mount_of(a) == mount_of(b)


def mount_of(meta: dict[str, str]) -> str | None:
    """A transit vault's mount as the service spells it (`transit/`, an absent row: the
    default), so that two spellings of one mount are one source; None: the keyring."""
    return meta.get(MOUNT, DEFAULT_MOUNT).strip("/") if is_transit(meta) else None


def is_transit(meta: dict[str, str]) -> bool:
    """Whether the vault's keys are wrapped by a transit key (a keyring vault has no
    source recorded)."""
    return meta.get(SOURCE, KEYRING) != KEYRING


def forgotten(meta: dict[str, str], kid: str, lost: list[Any]) -> dict[str, Any]:
    """`key forget`'s result. A transit vault's backups each keep their own wrapped copy
    of the version, which the transit key still unwraps: forgetting drops only their
    records (`no_longer_recorded`), where a keyring vault's become `unreadable`."""
    transit = is_transit(meta)
    return {
        "vault_id": meta["vault_id"],
        "kid": kid,
        "unreadable": [] if transit else lost,
        "no_longer_recorded": lost if transit else [],
    }


def forgotten_paths(result: dict[str, Any]) -> dict[str, list[str]]:
    """What `key forget`'s audit entry keeps of its result: the backups' paths."""
    return {k: [b["path"] for b in result[k]] for k in ("unreadable", "no_longer_recorded")}


def wrapped_row(kid: str) -> str:
    return WRAPPED + kid


def _split(name: str) -> tuple[str, str]:
    vault_id, _, kid = name.partition("/")
    return vault_id, kid


class TransitStore(KeyStore):
    """The KeyStore of a transit vault: nothing in the OS keyring, the wrapped keys in the
    vault. The service is reached on first need (a delete needs none: it drops the row)."""

    def __init__(
        self, key_name: str, mount: str = DEFAULT_MOUNT, wrapped: WrappedKeys | None = None
    ) -> None:
        # Not KeyStore's: no keyring backend is looked for.
        self.key_name = key_name
        self.mount = mount.strip("/")  # as mount_of, and the service, spell it
        self.wrapped = wrapped
        self._transit: Transit | None = None
        self._prewrapped: dict[str, tuple[str, str]] = {}  # entry -> (key id, wrapped)
        self._created_key = False  # init made the transit key: a failed init deletes it
        self._backend = None
        self._broken = None
        self.name = f"transit:{key_name} (mount {mount})"

    def transit(self) -> Transit:
        if self._transit is None:
            from vault.keysource.transit import Transit

            self._transit = Transit(self.key_name, mount=self.mount)
            self.timeout = self._transit.timeout
            self.name = f"transit:{self.key_name} at {self._transit.addr} (mount {self.mount})"
        return self._transit

    def source_rows(self) -> dict[str, str]:
        return {SOURCE: f"transit:{self.key_name}", MOUNT: self.mount}

    def check_usable(self) -> None:
        self.transit().check_usable()

    def _keys(self) -> TransitKeySource:
        from vault.keysource.wrapped import TransitKeySource

        if self.wrapped is None:  # pragma: no cover (only init's store has none)
            raise BadInput("this transit store belongs to no vault yet")
        return TransitKeySource(self.transit(), self.wrapped)

    def get(self, name: str) -> str | None:
        if self.wrapped is None:
            return None  # init's store, or a file shred's: no wrapped keys to read
        return self._keys().get(*_split(name))

    def set(self, name: str, key: str) -> None:
        vault_id, kid = _split(name)
        staged = self._prewrapped.pop(name, None)
        if staged is not None and staged[0] == kid and self.wrapped is not None:
            self.wrapped.save(vault_id, kid, staged[1])  # wrapped by `prewrap`
            return
        self._keys().put(vault_id, kid, key)

    def prewrap(self, name: str, key: str) -> None:
        """Wrap a new version's key before anything about it is written, so that a
        token without `encrypt` fails the rotation with nothing written; `set` then
        stores this wrapped copy."""
        from vault import crypto

        kid = _split(name)[1]
        if crypto.key_id(key) != kid:
            raise BadInput(f"refusing to wrap another key under {kid}")
        self._prewrapped[name] = (kid, self.transit().wrap(key))

    def delete(self, name: str) -> bool:
        """Drop the wrapped key from the vault: no service call, so it works after revoke."""
        if self.wrapped is None:
            return False  # init's store: the row dies with the vault that was not made
        return self.wrapped.drop(*_split(name))

    def new_vault_rows(self, kid: str, master_key: str) -> dict[str, str]:
        """The meta rows a new vault holds: its source, and its first key wrapped. Creates
        the transit key (deletion allowed) if it does not exist yet; a wrap that fails
        then takes that key away again (`drop_created_key`), and the line says so."""
        transit = self.transit()
        transit.check_usable()
        self._created_key = transit.ensure_key()
        try:
            wrapped = transit.wrap(master_key)
        except KeyProblem as exc:
            # An operator's token that may create the key but not use it (docs/fleet.md's
            # operator policy alone) ends here.
            needs = (
                "; init needs a token with both the operator and the host policy"
                if isinstance(exc, KeySourceDenied)
                else ""
            )
            raise type(exc)(f"{exc.message}{needs}; {self.drop_created_key()}") from None
        return {**self.source_rows(), wrapped_row(kid): wrapped}

    def drop_created_key(self) -> str:
        """After a failed init: delete the transit key that init created (no vault uses
        it), never one it found. What became of it, for the error line."""
        if not self._created_key:
            return "no vault was created"
        self._created_key = False
        transit = self.transit()
        name, mount = transit.key_name, transit.mount
        try:
            transit.delete_key()
        except KeyProblem as exc:
            why = (
                "this token may not delete it"
                if isinstance(exc, KeySourceDenied)
                else "deleting it failed too"
            )
            return (
                f"no vault was created, but the transit key {name} that init created is "
                f"left in the service ({why}): ask the operator to run bao write "
                f"{mount}/keys/{name}/config deletion_allowed=true, then bao delete "
                f"{mount}/keys/{name} (or to keep it for the next init)"
            )
        return f"no vault was created, and the transit key {name} that init created was deleted"


def refuse_moved(ks: KeyStore, meta: dict[str, str], path: object) -> None:
    """A rotation about to switch: VaultBusy if `key move` switched the vault to another
    key source since `ks` was chosen (its new key would land in the old source)."""
    if not serves(ks, meta):
        raise VaultBusy(
            f"{path} moved to another key source while the rotation began; nothing was "
            "rotated; run `memvault rotate` again"
        )


def prewrap(ks: KeyStore, name: str, key: str) -> None:
    """Before a rotation records its new version: a transit vault wraps the key now."""
    if isinstance(ks, TransitStore):
        ks.prewrap(name, key)


def stage_first_key(ks: KeyStore, vault_id: str, kid: str, key: str) -> dict[str, str]:
    """Init's first key: into the keyring (no meta rows), or wrapped into meta rows."""
    if isinstance(ks, TransitStore):
        return ks.new_vault_rows(kid, key)
    from vault.keyjournal import entry_name

    ks.set(entry_name(vault_id, kid), key)
    return {}


def unstage_first_key(ks: KeyStore, vault_id: str, kid: str) -> None:
    """Undo `stage_first_key` after init failed: the keyring entry, or the transit key
    that init created."""
    if isinstance(ks, TransitStore):
        ks.drop_created_key()
        return
    from vault.keyjournal import entry_name

    ks.delete(entry_name(vault_id, kid))


def init_store(source: str, mount: str | None) -> TransitStore | None:
    """The store `init --key-source SOURCE [--transit-mount MOUNT]` asks for: None for the
    keyring; a transit store, its name, mount and the service's address checked."""
    name = parse_source(source)
    if name is None:
        if mount is not None:
            raise BadInput("--transit-mount goes with --key-source transit:KEYNAME only")
        return None
    store = TransitStore(name, mount if mount is not None else DEFAULT_MOUNT)
    store.transit()  # a bad name or mount, or no VAULT_ADDR/BAO_ADDR: said now
    return store


def entry_for_import(ks: KeyStore, name: str) -> str | None:
    """What `key import` finds at an entry: the key, or None. A transit vault's wrapped
    key that its transit key no longer unwraps (the key was lost and made again under
    the same name) is "", something else, which the kit's key then replaces."""
    if not isinstance(ks, TransitStore):
        return ks.get(name)
    try:
        return ks.get(name)
    except (KeySourceUnavailable, KeySourceDenied):
        raise  # the service or the token: no statement about the wrapped key
    except KeyProblem:
        return ""


def store_for(meta: dict[str, str], wrapped: WrappedKeys | None) -> TransitStore | None:
    """The vault's transit store when its meta names one, else None (the keyring). Without
    `wrapped` (a file shred: the wrapped keys die with its rows) it deletes nothing."""
    name = parse_source(meta.get(SOURCE, KEYRING))
    if name is None:
        return None
    return TransitStore(name, meta.get(MOUNT, DEFAULT_MOUNT), wrapped)


def host_keyring(ks: KeyStore) -> KeyStore | None:
    """A transit vault's other place on this host: the OS keyring, which may still hold
    versions from the vault's keyring days (kept for a backup by `key move`, or left by
    a move cut off). None for a keyring vault (`ks` is that keyring) and on a host with
    no usable keyring (it holds nothing memvault could read either)."""
    if not isinstance(ks, TransitStore):
        return None
    local = KeyStore()
    try:
        local.check_usable()
    except KeyProblem:
        return None
    return local


def anchor_store(ks: KeyStore) -> Store:
    """Where the vault's anchor (vault.chainanchor) lives: a keyring vault's keyring, a
    transit vault's key service (vault.keysource.transitanchor)."""
    if isinstance(ks, TransitStore):
        from vault.keysource.transitanchor import ServiceAnchor

        return ServiceAnchor(ks.transit())
    return ks


def marked_left(ks: KeyStore | None, meta: dict[str, str]) -> TypeGuard[TransitStore]:
    """Whether a source the vault's keys left, `ks`, gets its anchor marked so
    (chainanchor.leave): a key service's only, which every host reads (a keyring is one
    host's: marked, it would refuse the vault there after it came back through another
    host), and only while the file, `meta`, no longer names it."""
    return isinstance(ks, TransitStore) and not serves(ks, meta)


def serves(ks: KeyStore, meta: dict[str, str]) -> bool:
    """Whether `ks` is the key source `meta` names (a `key move` may have run since the
    store was chosen: the anchor went with it)."""
    if isinstance(ks, TransitStore):
        return meta.get(SOURCE) == f"transit:{ks.key_name}" and mount_of(meta) == ks.mount
    return not is_transit(meta)


def forget_anchor(store: Store | None, vault_id: str, in_use: set[str]) -> None:
    """Before revoke or shred destroys the vault's keys: its anchor (vault.chainanchor)
    goes first, while the vault's own key is there to tell that the anchor is this
    vault's. A copy whose key the live vault no longer uses (it rotated since) leaves
    the live vault's anchor alone; a kill after this step leaves a vault without an
    anchor, which the finished revoke or shred then destroys anyway. The key service's
    anchor goes with the transit key, which revoke and shred delete for any copy."""
    if store is None:
        return
    from vault import chainanchor
    from vault.keyjournal import entry_name

    if not isinstance(store, KeyStore) or any(
        store.get(entry_name(vault_id, kid)) is not None for kid in sorted(in_use)
    ):
        chainanchor.forget(store, vault_id)


def destroy_versions(
    ks: KeyStore, vault_id: str, kids: set[str], in_use: set[str]
) -> dict[str, Any]:
    """Revoke's and shred's key step, once for both: every version's entry in the vault's
    source (vault.keyjournal.destroy_entries), then, for a transit vault, what this host's
    keyring still holds of it, then its transit key (`revoke_source`)."""
    from vault import keyjournal

    local = host_keyring(ks)
    if isinstance(ks, TransitStore):  # its keyring anchor goes with any version kept here
        forget_anchor(local, vault_id, kids)
    else:
        forget_anchor(ks, vault_id, in_use)
    outcome = keyjournal.destroy_entries(ks, vault_id, kids, in_use)
    if local is not None:
        here = keyjournal.destroy_entries(local, vault_id, kids, in_use)
        for field in ("destroyed_kids", "other_copies_kids"):
            outcome[field] = sorted(set(outcome[field]) | set(here[field]))
        outcome["key_destroyed"] = bool(outcome["destroyed_kids"])
    outcome.update(revoke_source(ks))
    if isinstance(ks, TransitStore):
        from vault.keysource.transitanchor import forget_after_key

        outcome.update(forget_after_key(ks.transit(), vault_id, outcome))
    return outcome


def revoke_source(ks: KeyStore) -> dict[str, str]:
    """After a revoke dropped a transit vault's wrapped keys: delete its transit key, so
    that no copy or backup of the vault can be unwrapped either. A token without the
    right leaves that to the operator, and the result says so (the vault is marked
    revoked all the same: every host refuses it)."""
    if not isinstance(ks, TransitStore):
        return {}
    transit = ks.transit()
    try:
        transit.delete_key()
    except KeySourceDenied:
        return {
            "transit_key": "kept",
            "transit_key_fix": (
                f"this token may not delete {transit.where()}: the operator must delete it "
                "to finish the erase (until then a copy or backup of the vault can still "
                "be unwrapped): bao write "
                f"{transit.mount}/keys/{transit.key_name}/config deletion_allowed=true, "
                f"then bao delete {transit.mount}/keys/{transit.key_name}"
            ),
        }
    return {"transit_key": "deleted"}
