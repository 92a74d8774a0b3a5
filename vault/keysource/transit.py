"""The `transit` key source: master keys wrapped by a named transit key of OpenBao or
HashiCorp Vault, unwrapped through the service on each host.

Only this module talks to the service, through hvac (the `memvault[transit]` extra),
imported when a transit key is first used. Every failure becomes a `KeyProblem`
(exit 4) whose one line names the fix and never the token; each HTTP call has the
keyring's deadline (MEMVAULT_KEYRING_TIMEOUT), and after a call that ran out of it
every later call fails at once. An unwrapped key is returned, never written or logged.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Callable
from typing import Any

from vault import crypto
from vault.errors import (
    BadInput,
    KeyMissing,
    KeyProblem,
    KeySourceDenied,
    KeySourceUnavailable,
)
from vault.keys import ENV_TIMEOUT, keyring_timeout
from vault.keysource.baotoken import Credentials, Warn, address, credentials, warn_on_stderr

KEY_TYPE = "aes256-gcm96"
# A renewable token is renewed once less than this share of its TTL is left.
RENEW_BELOW = 0.5
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_MOUNT = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
# Each endpoint the calls use, below the mount; the first three need the operator's rights.
_PATHS = {
    "keys": "keys/{}", "config": "keys/{}/config", "rotate": "keys/{}/rotate",
    "encrypt": "encrypt/{}", "decrypt": "decrypt/{}", "datakey": "datakey/plaintext/{}",
    "rewrap": "rewrap/{}",
}  # fmt: skip
_OPERATOR = ("keys", "config", "rotate")
_WRAPPED = re.compile(r"(?:vault|bao):v([0-9]+):[A-Za-z0-9+/=]+")


def wrapped_version(wrapped: str) -> int:
    """The transit key version that wrapped this key (`vault:v3:...` -> 3)."""
    match = _WRAPPED.fullmatch(wrapped)
    if match is None:
        raise KeyProblem("a wrapped key is damaged (not a transit ciphertext); restore it")
    return int(match.group(1))


def _safe(exc: BaseException) -> str:
    """hvac's and requests' text on one line (a URL and the server's words, no token)."""
    return " ".join(str(exc).split())[:200] or type(exc).__name__


class Transit:
    """One named transit key, at a mount of one server."""

    def __init__(
        self,
        key_name: str,
        *,
        mount: str = "transit",
        addr: str | None = None,
        creds: Credentials | None = None,
        timeout: float | None = None,
        warn: Warn = warn_on_stderr,
    ) -> None:
        if not _NAME.fullmatch(key_name):
            raise BadInput(
                f"{key_name!r} is not a transit key name; use letters, digits, '_', '.' or "
                "'-' (at most 128)"
            )
        mount = mount.strip("/")
        if not _MOUNT.fullmatch(mount):
            raise BadInput(f"{mount!r} is not a mount path; give e.g. transit")
        self.key_name = key_name
        self.mount = mount
        self.addr = addr if addr is not None else address()
        self.timeout = timeout if timeout is not None else keyring_timeout()
        self._creds = creds
        self._warn = warn
        self._client: Any = None
        self._broken: KeyProblem | None = None
        self._renew_at: float | None = None  # monotonic; None: never (root, or not renewable)
        self._expires_at = 0.0

    def where(self) -> str:
        return f"transit key {self.key_name} (mount {self.mount}) at {self.addr}"

    # The connection, the token and its renewal --------------------------------
    def _hvac(self) -> Any:
        try:
            import hvac
        except ImportError:
            raise KeySourceUnavailable(
                "the transit key source needs the hvac package; install it with "
                "pip install 'memvault[transit]'"
            ) from None
        return hvac

    def _connected(self) -> Any:
        if self._client is not None:
            self._renew_if_low()
            return self._client
        hvac = self._hvac()
        creds = self._creds if self._creds is not None else credentials(self._warn)
        self._creds = creds
        # token="" rather than None: hvac would read VAULT_TOKEN or ~/.vault-token itself.
        client = hvac.Client(url=self.addr, token=creds.token or "", timeout=self.timeout)
        if creds.token is None:
            self._log_in(client, creds)
        self._note_ttl(self._call("look up its token", "", client.auth.token.lookup_self))
        self._client = client
        return client

    def _log_in(self, client: Any, creds: Credentials) -> None:
        """AppRole: the token it returns stays in this client, in memory."""
        try:
            self._call(
                "log in with AppRole",
                "",
                lambda: client.auth.approle.login(
                    role_id=creds.role_id,
                    secret_id=creds.secret_id,
                    mount_point=creds.approle_mount,
                    use_token=True,
                ),
            )
        except (KeySourceUnavailable, KeySourceDenied):
            raise
        except KeyProblem:  # 400 "invalid role or secret ID", or no such auth mount
            raise KeySourceDenied(
                f"the key service at {self.addr} refused the {creds.origin}: the role id or "
                "secret id is wrong, or the secret id expired or was used up; get a new "
                "secret id from the operator, or check MEMVAULT_TRANSIT_APPROLE_MOUNT"
            ) from None

    def _note_ttl(self, answer: Any, before: float | None = None) -> None:
        data = (answer or {}).get("data") or {}
        ttl, full = int(data.get("ttl") or 0), int(data.get("creation_ttl") or 0)
        if not data.get("renewable") or ttl <= 0 or (before is not None and ttl <= before):
            # Not renewable, never expiring, or at its maximum TTL: renewing again is no use.
            self._renew_at = None
            return
        self._expires_at = time.monotonic() + ttl
        self._renew_at = self._expires_at - (full or ttl) * RENEW_BELOW

    def _renew_if_low(self) -> None:
        if self._renew_at is None or time.monotonic() < self._renew_at:
            return
        client = self._client
        left = self._expires_at - time.monotonic()
        try:
            self._call("renew its token", "", client.auth.token.renew_self)
        except KeySourceDenied:
            # A policy without renew-self: the token works until it expires, and the call
            # after that says so.
            self._renew_at = None
            return
        self._note_ttl(self._call("look up its token", "", client.auth.token.lookup_self), left)

    def check_usable(self) -> None:
        """Reach the server and check the token (nothing is decrypted)."""
        self._connected()

    def client(self) -> Any:
        """The hvac client, connected and its token renewed when low."""
        return self._connected()

    def call(self, what: str, endpoint: str, fn: Callable[[], Any]) -> Any:
        """fn() against the server, its failures as this key's calls' are: a refusal
        names `endpoint` (a path outside the transit mount) and the host policy."""
        return self._call(what, endpoint, fn)

    # Every call, and what its failures mean ------------------------------------
    def _call(self, what: str, path: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """fn(...) against the server; `path` names the endpoint a refusal concerns."""
        if self._broken is not None:
            raise self._broken
        import hvac.exceptions as herr
        import requests.exceptions as rerr

        try:
            return fn(*args, **kw)
        except rerr.Timeout:
            self._broken = KeySourceUnavailable(
                f"the key service at {self.addr} did not answer within {self.timeout:g} s "
                f"while trying to {what}; check that it is running and reachable, or allow "
                f"it longer with {ENV_TIMEOUT}"
            )
            raise self._broken from None
        except rerr.RequestException as exc:
            raise KeySourceUnavailable(
                f"cannot reach the key service at {self.addr} to {what} "
                f"({type(exc).__name__}); check that it is running and that VAULT_ADDR or "
                "BAO_ADDR is right"
            ) from None
        except (herr.Forbidden, herr.Unauthorized):
            raise self._refusal(what, path) from None
        except herr.VaultDown:
            raise KeySourceUnavailable(
                f"the key service at {self.addr} is sealed or in standby and could not "
                f"{what}; ask its operator to unseal it"
            ) from None
        except herr.InvalidPath as exc:
            if "route" in str(exc):
                raise KeySourceUnavailable(
                    f"the key service at {self.addr} has no transit engine at mount "
                    f"{self.mount}/ (while trying to {what}); enable it (bao secrets enable "
                    "transit) or give the right mount"
                ) from None
            raise self._missing(what) from None
        except herr.InvalidRequest as exc:
            text = str(exc)
            if "not found" in text or "no existing key" in text:
                raise self._missing(what) from None
            if "too old" in text:
                raise KeyProblem(
                    f"{self.where()} refuses to decrypt this wrapped key: its transit version "
                    "is below the key's min_decryption_version; lower that setting, or rewrap "
                    "the vault's keys before raising it"
                ) from None
            raise KeyProblem(
                f"{self.where()} refused to {what} ({_safe(exc)}); nothing was changed"
            ) from None
        except herr.VaultError as exc:
            raise KeySourceUnavailable(
                f"the key service at {self.addr} failed to {what} ({type(exc).__name__}: "
                f"{_safe(exc)}); check the server's health and try again"
            ) from None

    def _missing(self, what: str) -> KeyMissing:
        return KeyMissing(
            f"{self.where()} does not exist (deleted, or never created) while trying to "
            f"{what}; the keys it wrapped cannot be unwrapped: with the vault's recovery kit, "
            "the operator creates the key again (same name) and `memvault key import KIT` "
            "wraps the kit's keys with it; otherwise check the key name and mount"
        )

    def _refusal(self, what: str, path: str) -> KeySourceDenied:
        """A 403: a bad token, or a good one whose policy lacks the endpoint."""
        origin = self._creds.origin if self._creds else "its configuration"
        bad_token = KeySourceDenied(
            f"the key service at {self.addr} refused the token from {origin} while trying "
            f"to {what}: it is wrong, expired or revoked; get a new token (bao login, or "
            "from the operator)"
        )
        if not path or self._client is None:
            return bad_token
        try:
            self._client.auth.token.lookup_self()
        except Exception:
            return bad_token  # the token itself no longer works
        role = "operator" if path in _OPERATOR else "host"
        endpoint = f"{self.mount}/{_PATHS[path].format(self.key_name)}" if path in _PATHS else path
        return KeySourceDenied(
            f"the token from {origin} may not {what}: its policy does not allow it on "
            f"{endpoint}; ask the operator for a token with the {role} policy "
            "(docs/fleet.md)"
        )

    def _transit(self) -> Any:
        return self._connected().secrets.transit

    # The key's own lifecycle (operator rights) ---------------------------------
    def ensure_key(self) -> bool:
        """Use the named key, creating it (deletion allowed) if missing; True if created."""
        t = self._transit()
        try:
            self._call("read the transit key", "keys", t.read_key, self.key_name, self.mount)
            return False
        except KeyMissing:
            pass
        self._call(
            "create the transit key",
            "keys",
            t.create_key,
            self.key_name,
            key_type=KEY_TYPE,
            mount_point=self.mount,
        )
        self._configure(deletion_allowed=True)
        return True

    def _configure(self, **settings: Any) -> None:
        self._call(
            "configure the transit key",
            "config",
            self._transit().update_key_configuration,
            self.key_name,
            mount_point=self.mount,
            **settings,
        )

    def versions(self) -> tuple[int, int]:
        """(latest version, min_decryption_version) of the transit key."""
        t = self._transit()
        answer = self._call("read the transit key", "keys", t.read_key, self.key_name, self.mount)
        data = answer["data"]
        return int(data["latest_version"]), int(data["min_decryption_version"])

    def rotate_key(self) -> int:
        """A new version of the transit key, which new wraps use; returns its number."""
        t = self._transit()
        self._call("rotate the transit key", "rotate", t.rotate_key, self.key_name, self.mount)
        return self.versions()[0]

    def set_min_decryption_version(self, version: int) -> None:
        self._configure(min_decryption_version=version)

    def delete_key(self) -> bool:
        """Delete the transit key: everything it wrapped is lost. False if already gone."""
        try:
            self._configure(deletion_allowed=True)
        except KeyMissing:
            return False
        t = self._transit()
        self._call("delete the transit key", "keys", t.delete_key, self.key_name, self.mount)
        return True

    # Wrapping (host rights: encrypt, decrypt, datakey, rewrap) ----------------
    def wrap(self, master_key: str) -> str:
        try:
            plain = base64.b64encode(crypto.master_key_bytes(master_key)).decode("ascii")
        except ValueError:
            raise KeyProblem("refusing to wrap something that is not a memvault key") from None
        t = self._transit()
        answer = self._call(
            "wrap a key (encrypt)", "encrypt", t.encrypt_data, self.key_name, plain,
            mount_point=self.mount,
        )  # fmt: skip
        return str(answer["data"]["ciphertext"])

    def unwrap(self, wrapped: str) -> str:
        wrapped_version(wrapped)  # a damaged one is refused before it is sent
        t = self._transit()
        answer = self._call(
            "unwrap a key (decrypt)", "decrypt", t.decrypt_data, self.key_name, wrapped,
            mount_point=self.mount,
        )  # fmt: skip
        return _master_key(answer["data"]["plaintext"], self.where())

    def new_key(self) -> tuple[str, str]:
        """(master key, wrapped) from the service's data-key endpoint."""
        t = self._transit()
        answer = self._call(
            "make a data key", "datakey", t.generate_data_key, self.key_name, "plaintext",
            bits=256, mount_point=self.mount,
        )  # fmt: skip
        data = answer["data"]
        return _master_key(data["plaintext"], self.where()), str(data["ciphertext"])

    def rewrap(self, wrapped: str) -> str:
        """The same key wrapped by the transit key's newest version."""
        wrapped_version(wrapped)
        t = self._transit()
        answer = self._call(
            "rewrap a key", "rewrap", t.rewrap_data, self.key_name, wrapped,
            mount_point=self.mount,
        )  # fmt: skip
        return str(answer["data"]["ciphertext"])


def _master_key(plaintext_b64: Any, where: str) -> str:
    try:
        raw = base64.b64decode(str(plaintext_b64), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise KeyProblem(f"{where} returned something that is not a memvault key")
    return base64.urlsafe_b64encode(raw).decode("ascii")
