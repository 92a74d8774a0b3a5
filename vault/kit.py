"""The recovery kit: the master key wrapped under a passphrase, in a small JSON file.

    memvault key export kit.json   # on the old machine (passphrase asked twice)
    memvault key import kit.json   # on the new one, after copying the vault file

Format (version 2; version 1, one key and no `kids`, is still read)::

    {"format": "memvault-recovery-kit", "version": 2,
     "vault_id": "mv-…", "kid": "mv1:…", "kids": ["mv1:…", …], "created_at": "…Z",
     "kdf": {"name": "scrypt", "n": 131072, "r": 8, "p": 1, "salt": "<b64>"},
     "cipher": "AES-256-GCM", "nonce": "<b64>", "ciphertext": "<b64>"}

`kid` is the vault's current key; `kids` every key version the kit holds (the
current one, and those the vault still needs: retained for backups, pending).
Version 1 seals the key itself; version 2 seals `{"keys": {kid: key, …}}`.

The wrapping key is scrypt(passphrase, random 16-byte salt); the master key is
sealed with AES-256-GCM under a random 96-bit nonce, and every header field
(format, version, vault id, key id, cipher, KDF parameters and salt) is bound as
associated data, so editing any of them makes the kit fail to open, exactly
like a wrong passphrase. The file is created 0600 and never holds the key in
clear; nothing in this module prints or logs the key.

Import (vault.kitops) checks the kit's vault id and key ids against the vault
before it asks for the passphrase, and each decrypted key's id again after: a
kit from another vault, or without the key the file uses, is refused naming the
ids.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from vault import crypto, files
from vault.engines.sqlite.schema import utcnow
from vault.errors import BadInput, OperationFailed
from vault.kitfile import KIT_FORMAT
from vault.kitfile import check_kit_target as check_kit_target  # re-exported
from vault.kitfile import write_kit_file as write_kit_file  # re-exported

KIT_VERSION = 2
KIT_VERSIONS = (1, 2)  # what `load` reads
MAX_KIDS = 64  # far more versions than a vault keeps
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
    version: int = KIT_VERSION
    kids: tuple[str, ...] = ()  # version 2: every key version sealed in it

    @property
    def held(self) -> tuple[str, ...]:
        """The key ids the kit holds (a version 1 kit: its one key)."""
        return self.kids if self.version >= 2 else (self.kid,)

    def header(self) -> dict[str, Any]:
        many = {"kids": list(self.kids)} if self.version >= 2 else {}
        return {
            "format": KIT_FORMAT,
            "version": self.version,
            "vault_id": self.vault_id,
            "kid": self.kid,
            **many,
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

    def open(self, passphrase: str, path: Path) -> dict[str, str]:
        """kid -> key for every key the kit holds, or OperationFailed for a wrong
        passphrase or an altered kit."""
        wrapping = _derive(passphrase, self.salt, self.n, self.r, self.p)
        try:
            raw = AESGCM(wrapping).decrypt(self.nonce, self.ciphertext, self.associated_data())
        except InvalidTag:
            raise OperationFailed(
                f"the recovery kit {path} did not open: wrong passphrase, or the kit was "
                "altered; nothing was changed"
            ) from None
        if self.version == 1:
            keys: Any = {self.kid: raw.decode("ascii", "replace")}
        else:
            try:
                keys = json.loads(raw.decode("ascii")).get("keys")
            except (UnicodeDecodeError, ValueError, AttributeError):
                keys = None
        if not isinstance(keys, dict) or sorted(keys) != sorted(self.held):
            raise _not_a_kit(path, "its sealed keys do not match its key ids")
        for kid, key in keys.items():
            if (
                not isinstance(key, str)
                or not crypto.is_valid_key(key)
                or crypto.key_id(key) != kid
            ):
                # Authenticated, yet inconsistent: only a kit forged with the passphrase.
                raise _not_a_kit(path, "its key does not match its own key id")
        return dict(keys)


def seal(
    master_key: str, vault_id: str, passphrase: str, others: dict[str, str] | None = None
) -> Kit:
    """A version 2 kit of `master_key` (the current key) and the `others` (kid -> key)."""
    check_passphrase(passphrase)
    kid = crypto.key_id(master_key)
    keys = {**(others or {}), kid: master_key}
    salt = secrets.token_bytes(SALT_BYTES)
    nonce = secrets.token_bytes(NONCE_BYTES)
    fields = (vault_id, kid, utcnow(), SCRYPT_N, SCRYPT_R, SCRYPT_P, salt, nonce)
    kids = tuple(sorted(keys))
    unsealed = Kit(*fields, b"", KIT_VERSION, kids)
    wrapping = _derive(passphrase, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    sealed = json.dumps({"keys": keys}, sort_keys=True).encode("ascii")
    ciphertext = AESGCM(wrapping).encrypt(nonce, sealed, unsealed.associated_data())
    return Kit(*fields, ciphertext, KIT_VERSION, kids)


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
    version = doc.get("version")
    if type(version) is not int or version not in KIT_VERSIONS:  # not true, not 1.0
        raise _not_a_kit(p, f"unknown kit version {version!r}; upgrade memvault")
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
    kids: tuple[str, ...] = ()
    if version >= 2:
        listed = doc.get("kids")
        if (
            not isinstance(listed, list)
            or not 0 < len(listed) <= MAX_KIDS
            or not all(crypto.looks_like_kid(k) for k in listed)
            or len(set(listed)) != len(listed)
            or doc["kid"] not in listed
        ):
            raise _not_a_kit(p, "its list of key ids is malformed")
        kids = tuple(listed)
    return Kit(
        doc["vault_id"],
        doc["kid"],
        doc["created_at"],
        n,
        r,
        par,
        salt,
        nonce,
        ciphertext,
        version,
        kids,
    )


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
