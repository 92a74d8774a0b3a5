"""A transit vault's anchor (vault.chainanchor), held by the key service beside its
transit key: the KV version 2 secret `<kv mount>/memvault/<transit mount>/<key>/<vault_id>`.

The hosts that share the vault share its anchor, so a file put back from an older copy
is told on every host, and no host needs a keyring. A host's token needs `create`,
`read`, `update` and `delete` on `<kv mount>/data/memvault/<transit mount>/<key>/*`
(docs/fleet.md's host policy). A write is check-and-set against the version read
before it, so two hosts recording at once never leave the older point. The KV mount is
the host's MEMVAULT_ANCHOR_MOUNT (`secret` by default), never the file's: a file
rewritten to name another place would otherwise be judged by an empty one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vault.chainanchor import Raced
from vault.errors import KeySourceUnavailable

if TYPE_CHECKING:
    from vault.keysource.transit import Transit

ENV_MOUNT = "MEMVAULT_ANCHOR_MOUNT"
DEFAULT_KV_MOUNT = "secret"
FIELD = "anchor"
_MISSING, _RACED, _NO_MOUNT = object(), object(), object()


def kv_mount() -> str:
    return (os.environ.get(ENV_MOUNT, "").strip() or DEFAULT_KV_MOUNT).strip("/")


class ServiceAnchor:
    """The anchor entries (`<vault_id>/anchor`, vault.chainanchor.Store) of the vaults
    one transit key wraps, in the service's KV store."""

    def __init__(self, transit: Transit, mount: str | None = None) -> None:
        self.transit = transit
        self.mount = mount or kv_mount()
        self._versions: dict[str, int] = {}  # secret path -> the version last read

    def _folder(self) -> str:
        return f"memvault/{self.transit.mount}/{self.transit.key_name}"

    def _path(self, name: str) -> str:
        return f"{self._folder()}/{name.partition('/')[0]}"

    def where(self, name: str) -> str:
        return f"{self.mount}/data/{self._path(name)}"

    def _run(self, what: str, name: str, fn: Any, where: str = "") -> Any:
        import hvac.exceptions as herr

        def guarded() -> Any:
            try:
                return fn(self.transit.client().secrets.kv.v2)
            except herr.InvalidPath as exc:
                if "route" in str(exc):
                    return _NO_MOUNT  # said below, in words of its own
                return _MISSING
            except herr.InvalidRequest as exc:
                if "check-and-set" in str(exc):
                    return _RACED
                raise

        answer = self.transit.call(what, where or self.where(name), guarded)
        if answer is _NO_MOUNT:
            raise KeySourceUnavailable(
                f"the key service at {self.transit.addr} has no KV version 2 engine at "
                f"mount {self.mount}/ to hold the vault's anchor; enable one (bao secrets "
                f"enable -path={self.mount} kv-v2) or name its mount with {ENV_MOUNT}"
            )
        return answer

    def get(self, name: str) -> str | None:
        path = self._path(name)
        answer = self._run(
            "read the vault's anchor",
            name,
            lambda kv: kv.read_secret_version(
                path=path, mount_point=self.mount, raise_on_deleted_version=False
            ),
        )
        if answer is _MISSING:
            self._versions[path] = 0
            return None
        data = answer.get("data") or {}
        meta = data.get("metadata")
        if not isinstance(meta, dict) or "version" not in meta:
            raise KeySourceUnavailable(
                f"the mount {self.mount}/ of the key service at {self.transit.addr} is not a "
                f"KV version 2 engine; the vault's anchor needs one (set {ENV_MOUNT})"
            )
        self._versions[path] = int(meta["version"])
        value = (data.get("data") or {}).get(FIELD)  # None once deleted
        return None if value is None else str(value)

    def set(self, name: str, value: str) -> None:
        """Write `value` only if the secret is still as this object last read it (or
        absent, unread): raises `Raced` if another host wrote it meanwhile."""
        path = self._path(name)
        cas = self._versions.get(path, 0)
        answer = self._run(
            "record the vault's anchor",
            name,
            lambda kv: kv.create_or_update_secret(
                path=path, secret={FIELD: value}, cas=cas, mount_point=self.mount
            ),
        )
        if answer is _RACED:
            raise Raced(self.where(name))
        self._versions[path] = int((answer.get("data") or {}).get("version") or cas + 1)

    def delete_command(self, vault_id: str) -> str:
        """The command with which an operator deletes the vault's anchor."""
        return f"bao kv delete -mount={self.mount} {self._path(vault_id)}"

    def vault_ids(self) -> list[str]:
        """The vaults whose anchors this transit key's folder holds (deleted ones too)."""
        folder = self._folder()
        answer = self._run(
            "list the anchors of the vaults of its transit key",
            "",
            lambda kv: kv.list_secrets(path=folder, mount_point=self.mount),
            f"{self.mount}/metadata/{folder}/",
        )
        if answer is _MISSING:
            return []
        return [str(k) for k in (answer.get("data") or {}).get("keys") or [] if "/" not in k]

    def delete(self, name: str) -> bool:
        """Delete the anchor's latest version (its older ones hold nothing secret)."""
        if self.get(name) is None:
            return False
        path = self._path(name)
        self._run(
            "delete the vault's anchor",
            name,
            lambda kv: kv.delete_latest_version_of_secret(path=path, mount_point=self.mount),
        )
        return True


def forget_after_key(transit: Transit, vault_id: str, outcome: dict[str, Any]) -> dict[str, str]:
    """Revoke's and shred's last step on a transit vault (`outcome`: theirs so far): its
    anchor deleted once its transit key is (nothing unwraps any copy then). A key kept
    (a token that may not delete it, say a host shredding a stray copy) keeps the
    anchor, which the live vault may still need: the operator deletes both."""
    from vault.chainanchor import forget
    from vault.errors import VaultError

    store = ServiceAnchor(transit)
    if outcome.get("transit_key") != "deleted":
        return {
            "transit_key_fix": f"{outcome['transit_key_fix']}; and {store.delete_command(vault_id)}"
        }
    try:
        forget(store, vault_id)  # in this host's turn, as every anchor is forgotten
    except VaultError:  # nothing secret in it: said, not failed
        return {"anchor": "kept", "anchor_fix": store.delete_command(vault_id)}
    return {}
