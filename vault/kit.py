"""The recovery kit: the master key wrapped under a passphrase, in a small JSON file.

    memvault key export kit.json   # on the old machine (passphrase asked twice)
    memvault key import kit.json   # on the new one, after copying the vault file

Format (version 1)::

    {"format": "memvault-recovery-kit", "version": 1,
     "vault_id": "mv-…", "kid": "mv1:…", "created_at": "…Z",
     "kdf": {"name": "scrypt", "n": 131072, "r": 8, "p": 1, "salt": "<b64>"},
     "cipher": "AES-256-GCM", "nonce": "<b64>", "ciphertext": "<b64>"}

The wrapping key is scrypt(passphrase, random 16-byte salt); the master key is
sealed with AES-256-GCM under a random 96-bit nonce, and every header field
(format, version, vault id, key id, cipher, KDF parameters and salt) is bound as
associated data, so editing any of them makes the kit fail to open, exactly
like a wrong passphrase. The file is created 0600 and never holds the key in
clear; nothing in this module prints or logs the key.

Import checks the kit's vault id and key id against the vault before it asks
for the passphrase, and the decrypted key's id again after: a kit from another
vault, or from before a rotation, is refused naming both ids. Revocation and
rotation therefore make older kits useless, which is the point.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from . import crypto, files
from .errors import (
    BadInput,
    KeyMismatch,
    KeyProblem,
    KeyRevoked,
    OperationFailed,
    VaultBusy,
    VaultError,
)
from .keyjournal import ROTATING_FROM, entry_name
from .kitfile import KIT_FORMAT, check_kit_target, write_kit_file
from .schema import utcnow
from .store import Vault

if TYPE_CHECKING:
    from .pg import PgVault

KIT_VERSION = 1
CIPHER = "AES-256-GCM"
# scrypt cost: 2**17 * 8 * 128 bytes = 128 MiB of memory, about half a second.
SCRYPT_N = 2**17
SCRYPT_R = 8
SCRYPT_P = 1
SALT_BYTES = 16
NONCE_BYTES = 12
# Bounds accepted on import: enough for any kit we write, and no kit can make
# `key import` allocate gigabytes or run for minutes.
_N_RANGE = (2**14, 2**20)
_R_RANGE = (1, 32)
_P_RANGE = (1, 16)
# The cost a kit may ask of `key import`, checked before the KDF runs: a kit is a file
# from anywhere, and n=2**20, r=32, p=16 (inside the ranges above) takes minutes and
# gigabytes. Our own kits need 128 MiB and 2**20 units of work (about half a second).
MAX_KDF_MEMORY = 256 * 1024 * 1024
MAX_KDF_WORK = 2**22
MAX_KIT_BYTES = 64 * 1024
SHORT_PASSPHRASE = 12


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str, path: Path) -> bytes:
    if not isinstance(text, str):
        raise _not_a_kit(path, f"its {what} is missing")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise _not_a_kit(path, f"its {what} is not base64") from None


def _not_a_kit(path: Path, why: str) -> OperationFailed:
    return OperationFailed(
        f"{path} is not a usable memvault recovery kit ({why}); nothing was changed"
    )


def check_passphrase(passphrase: str) -> None:
    if passphrase == "":
        raise BadInput("the passphrase is empty; a recovery kit needs a passphrase")


def _derive(passphrase: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase.encode("utf-8"))


@dataclass(frozen=True)
class Kit:
    """A parsed kit: header fields plus the sealed key."""

    vault_id: str
    kid: str
    created_at: str
    n: int
    r: int
    p: int
    salt: bytes
    nonce: bytes
    ciphertext: bytes

    def header(self) -> dict[str, Any]:
        return {
            "format": KIT_FORMAT,
            "version": KIT_VERSION,
            "vault_id": self.vault_id,
            "kid": self.kid,
            "created_at": self.created_at,
            "kdf": {
                "name": "scrypt",
                "n": self.n,
                "r": self.r,
                "p": self.p,
                "salt": _b64(self.salt),
            },
            "cipher": CIPHER,
        }

    def associated_data(self) -> bytes:
        """Every header field, canonically encoded: editing any of them breaks the tag."""
        return json.dumps(self.header(), sort_keys=True, separators=(",", ":")).encode("utf-8")

    def to_json(self) -> str:
        doc = {**self.header(), "nonce": _b64(self.nonce), "ciphertext": _b64(self.ciphertext)}
        return json.dumps(doc, indent=2) + "\n"

    def open(self, passphrase: str, path: Path) -> str:
        """The master key, or OperationFailed for a wrong passphrase or an altered kit."""
        wrapping = _derive(passphrase, self.salt, self.n, self.r, self.p)
        try:
            raw = AESGCM(wrapping).decrypt(self.nonce, self.ciphertext, self.associated_data())
        except InvalidTag:
            raise OperationFailed(
                f"the recovery kit {path} did not open: wrong passphrase, or the kit was "
                "altered; nothing was changed"
            ) from None
        key = raw.decode("ascii", "replace")
        if not crypto.is_valid_key(key) or crypto.key_id(key) != self.kid:
            # Authenticated, yet inconsistent: only a kit forged with the passphrase.
            raise _not_a_kit(path, "its key does not match its own key id")
        return key


def seal(master_key: str, vault_id: str, passphrase: str) -> Kit:
    check_passphrase(passphrase)
    salt = secrets.token_bytes(SALT_BYTES)
    nonce = secrets.token_bytes(NONCE_BYTES)
    unsealed = Kit(
        vault_id,
        crypto.key_id(master_key),
        utcnow(),
        SCRYPT_N,
        SCRYPT_R,
        SCRYPT_P,
        salt,
        nonce,
        b"",
    )
    wrapping = _derive(passphrase, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    ciphertext = AESGCM(wrapping).encrypt(
        nonce, master_key.encode("ascii"), unsealed.associated_data()
    )
    return Kit(
        unsealed.vault_id,
        unsealed.kid,
        unsealed.created_at,
        unsealed.n,
        unsealed.r,
        unsealed.p,
        salt,
        nonce,
        ciphertext,
    )


def load(path: str | os.PathLike[str]) -> Kit:
    """Parse a kit file; OperationFailed (exit 1) when it is not a well-formed kit."""
    p = Path(path)
    files.refuse_too_long(p, "the recovery kit path")
    kind = files.special(p)
    if kind:  # reading a FIFO would wait for a writer for ever
        raise BadInput(f"{p} is a {kind}; give the path of the recovery kit file")
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_KIT_BYTES + 1)
    except FileNotFoundError:
        raise BadInput(
            f"no recovery kit at {p}; give the path of the file `memvault key export` wrote"
        ) from None
    except IsADirectoryError:
        raise BadInput(f"{p} is a folder; give the path of the recovery kit file") from None
    except OSError as exc:
        raise OperationFailed(f"cannot read {p} ({exc.strerror}); nothing was changed") from None
    if len(data) > MAX_KIT_BYTES:
        raise _not_a_kit(p, "it is far larger than a kit")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise _not_a_kit(p, "it is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != KIT_FORMAT:
        raise _not_a_kit(p, "its format field is not memvault-recovery-kit")
    # The type exactly: in Python true == 1.0 == 1, and neither is a kit version.
    if type(doc.get("version")) is not int or doc["version"] != KIT_VERSION:
        raise _not_a_kit(p, f"unknown kit version {doc.get('version')!r}; upgrade memvault")
    kdf = doc.get("kdf")
    if not isinstance(kdf, dict) or kdf.get("name") != "scrypt":
        raise _not_a_kit(p, "its kdf is not scrypt")
    if doc.get("cipher") != CIPHER:
        raise _not_a_kit(p, f"its cipher is not {CIPHER}")
    n, r, par = kdf.get("n"), kdf.get("r"), kdf.get("p")
    if not (
        type(n) is int
        and _N_RANGE[0] <= n <= _N_RANGE[1]
        and n & (n - 1) == 0
        and type(r) is int
        and _R_RANGE[0] <= r <= _R_RANGE[1]
        and type(par) is int
        and _P_RANGE[0] <= par <= _P_RANGE[1]
        and n < 2 ** (16 * r)  # RFC 7914's bound; past it OpenSSL raises MemoryError
    ):
        raise _not_a_kit(p, "its scrypt parameters are out of range")
    check_kdf_cost(n, r, par, p)
    for name in ("vault_id", "kid", "created_at"):
        if not isinstance(doc.get(name), str) or not doc[name]:
            raise _not_a_kit(p, f"its {name} is missing")
    salt = _unb64(kdf.get("salt"), "salt", p)
    nonce = _unb64(doc.get("nonce"), "nonce", p)
    ciphertext = _unb64(doc.get("ciphertext"), "ciphertext", p)
    if len(nonce) != NONCE_BYTES or not salt:
        raise _not_a_kit(p, "its salt or nonce has the wrong length")
    return Kit(doc["vault_id"], doc["kid"], doc["created_at"], n, r, par, salt, nonce, ciphertext)


def kdf_cost(n: int, r: int, p: int) -> tuple[int, int]:
    """scrypt's memory in bytes (the V array plus the p blocks) and its work (n * r * p)."""
    return 128 * r * (n + p), n * r * p


def check_kdf_cost(n: int, r: int, p: int, path: Path) -> None:
    """Refuse, before deriving anything, a kit that asks for more than memvault ever uses."""
    memory, work = kdf_cost(n, r, p)
    if memory > MAX_KDF_MEMORY or work > MAX_KDF_WORK:
        ours = SCRYPT_N * SCRYPT_R * SCRYPT_P
        raise OperationFailed(
            f"{path} asks scrypt for {memory // 2**20} MiB of memory and {work / ours:g} times "
            f"the work of memvault's own kits (limits: {MAX_KDF_MEMORY // 2**20} MiB, "
            f"{MAX_KDF_WORK // ours} times); memvault never writes such a kit, so it was "
            "refused before deriving any key; nothing was changed"
        )


# --------------------------------------------------------------------------
# The two operations behind `memvault key export` / `memvault key import`
# --------------------------------------------------------------------------
def export_kit(
    vault: Vault | PgVault,
    path: str | os.PathLike[str],
    passphrase: str,
    force: bool = False,
) -> dict[str, Any]:
    """Write the vault's current key, wrapped under `passphrase`, to a new 0600 file."""
    check_passphrase(passphrase)
    sealer = vault.sealer()  # a working key, checked against the file
    if ROTATING_FROM in vault.meta():
        # A kit holds one key: it would not open the rows still under the old one.
        raise VaultBusy(
            f"a key rotation of {vault.path} is under way (or was cut off); wait for it, or "
            "run `memvault rotate` to finish it, then export the kit; nothing was written"
        )
    check_kit_target(vault, path, force)
    vault_id = vault.vault_id
    kit = seal(sealer.master_key, vault_id, passphrase)
    target = write_kit_file(path, kit.to_json(), force=force)
    vault.record("key-export", kit.kid, kit_version=KIT_VERSION, kdf="scrypt")
    return {"path": str(target), "vault_id": vault_id, "kid": kit.kid, "created_at": kit.created_at}


def check_kit_fits(vault: Vault | PgVault, kit: Kit, path: Path) -> dict[str, str]:
    """Refuse, naming the ids, a kit from another vault or another (older) key."""
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
    if kit.kid != meta["kid"]:
        raise KeyMismatch(
            f"the recovery kit {path} holds key {kit.kid} but vault {meta['vault_id']} now uses "
            f"key {meta['kid']} (the kit predates a rotation); use a kit exported after the "
            "last rotation"
        )
    return meta


def import_kit(
    vault: Vault | PgVault,
    path: str | os.PathLike[str],
    passphrase: str | Callable[[], str],
    confirm_replace: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Put the kit's key in the keyring as its own version entry, after checking it
    against the vault's key id.

    Touches no other entry: a live vault and a restored backup copy of it (at an
    older key) each keep theirs. An entry of that version that already holds the
    key is left alone; one that holds something else (damaged) is replaced after
    `confirm_replace(what_it_held)`. `passphrase` may be a callable, asked only once
    the kit is known to fit the vault.
    """
    p = Path(path)
    kit = load(p)
    meta = check_kit_fits(vault, kit, p)
    secret = passphrase() if callable(passphrase) else passphrase
    check_passphrase(secret)
    key = kit.open(secret, p)
    if crypto.key_id(key) != meta["kid"]:  # kit.open checked key_id(key) == kit.kid
        raise KeyMismatch(f"the kit's key does not match vault {meta['vault_id']}")
    vault_id = meta["vault_id"]
    ks = vault.keystore
    ks.check_usable()
    name = entry_name(vault_id, kit.kid)
    before = ks.get(name)
    replaced: str | None = None
    if before == key:
        state = "present"
    elif before is None:
        state = "missing"
    else:
        state = "mismatched"
        replaced = crypto.key_id(before) if crypto.is_valid_key(before) else "unknown"
        if confirm_replace is not None:
            confirm_replace(replaced)  # raises to refuse
    if state != "present":
        ks.set(name, key)  # verified by reading it back
    try:
        fresh = vault.sealer(refresh=True)  # a 0.1.0 file moves to the new layout here
        if fresh.kid != meta["kid"]:
            raise KeyProblem(f"the keyring did not keep the restored key for vault {vault_id}")
    except BaseException:
        # A revoke or shred that ran since the kit was checked destroyed the entries it
        # knew of before this one was stored: the entry this import added goes too.
        if state == "missing":
            with contextlib.suppress(VaultError):
                ks.delete(name)
        raise
    extra = {"replaced_kid": replaced} if replaced else {}
    vault.record("key-import", kit.kid, keyring_before=state, **extra)
    return {
        "path": str(p),
        "vault_id": vault_id,
        "kid": kit.kid,
        "keyring_before": state,
        "replaced_kid": replaced,
        "restored": state != "present",
        "keyring": ks.name,
    }
