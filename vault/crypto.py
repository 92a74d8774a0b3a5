"""Pure envelope cryptography: no I/O, no keyring, no SQLite, no `agents` import.

Byte-compatible with the SDK's `EncryptedSession` (agents.extensions.memory):
the same HKDF per-session key derivation, the same JSON encoding of the
payload and the same envelope `{"__enc__": 1, "v": 1, "kid": ..., "payload": ...}`,
except that the vault writes its own key id in `kid`. The tests check both
directions against the real SDK.

Every function that depends on the clock takes `now` so TTL tests never sleep
(the same idea as Fernet's `encrypt_at_time` / `decrypt_at_time`).
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

ENVELOPE_VERSION = 1
# The SDK's HKDF `info`: changing it would make vault items unreadable by the SDK.
HKDF_INFO = b"agents.session-store.hkdf.v1"
KID_PREFIX = "mv1:"
_KID_LABEL = b"memvault key id"
# Fernet refuses tokens stamped further than this in the future (cryptography's _MAX_CLOCK_SKEW).
MAX_CLOCK_SKEW = 60


def generate_key() -> str:
    """A new random master key: 32 bytes from the OS CSPRNG, urlsafe base64."""
    return Fernet.generate_key().decode("ascii")


def master_key_bytes(master_key: str) -> bytes:
    """Decode a master key; only real 32-byte Fernet-style keys are accepted."""
    try:
        raw = base64.urlsafe_b64decode(master_key.encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise ValueError("not a memvault master key") from exc
    if len(raw) != 32:
        raise ValueError("not a memvault master key")
    return raw


def is_valid_key(master_key: str | None) -> bool:
    if not master_key:
        return False
    try:
        master_key_bytes(master_key)
    except ValueError:
        return False
    return True


def looks_like_kid(value: object) -> bool:
    """A key id as `key_id` writes it (the file's `kid` is "revoked" after a revoke)."""
    return (
        isinstance(value, str)
        and value.startswith(KID_PREFIX)
        and len(value) == len(KID_PREFIX) + 16
        and all(c in "0123456789abcdef" for c in value[len(KID_PREFIX) :])
    )


def key_id(master_key: str) -> str:
    """A short public fingerprint of the key, derived one-way (HMAC-SHA256)."""
    digest = hmac.new(master_key_bytes(master_key), _KID_LABEL, hashlib.sha256).hexdigest()
    return KID_PREFIX + digest[:16]


def session_fernet(master_key: str, session_id: str) -> Fernet:
    """The per-session Fernet key, exactly as the SDK's EncryptedSession derives it."""
    hkdf = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=session_id.encode("utf-8"),
        info=HKDF_INFO,
    )
    return Fernet(base64.urlsafe_b64encode(hkdf.derive(master_key_bytes(master_key))))


def _to_json_bytes(obj: Any) -> bytes:
    # Same encoding as the SDK's _to_json_bytes, so tokens decrypt to the same items.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str).encode("utf-8")


def decode_item(plain: bytes) -> Any:
    """An item's decrypted JSON; ValueError for any text that is not one, including nesting
    deeper than the parser's stack (RecursionError), which a holder of the key can seal."""
    try:
        return json.loads(plain.decode("utf-8"))
    except RecursionError:
        raise ValueError("the item is nested too deeply to decode") from None


class ItemState(enum.Enum):
    READABLE = "readable"
    EXPIRED = "expired"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Opened:
    state: ItemState
    item: Any = None
    timestamp: int | None = None


# The row text `seal` writes (json.dumps of the envelope, default separators), read and
# written without a generic JSON parser on the hot paths (rotation, counting, purge).
_HEAD = '{"__enc__": 1, "v": 1, "kid": "'
_MID = '", "payload": "'
_TAIL = '"}'
_B64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_TOKEN_CHARS = _B64 + b"="


def _plain_json_string(s: str) -> bool:
    """Whether `s` between quotes is a JSON string that decodes to `s` itself."""
    return '"' not in s and "\\" not in s and s.isprintable()


def split_envelope(message_data: str) -> tuple[str, str] | None:
    """(kid, payload) of a row in exactly the layout `seal` writes, else None.

    Where it answers, it answers what `parse_envelope` would (both strings are
    checked to need no JSON unescaping); any other row, None, and the caller falls
    back to `parse_envelope`.
    """
    if not (message_data.startswith(_HEAD) and message_data.endswith(_TAIL)):
        return None
    k = message_data.find(_MID, len(_HEAD))
    if k < 0:
        return None
    kid = message_data[len(_HEAD) : k]
    payload = message_data[k + len(_MID) : -len(_TAIL)]
    # A payload of base64 characters only (a C-speed check; isascii is O(1)): what every
    # token is, and a JSON string that decodes to itself. Anything else: the slow path.
    if (
        payload.isascii()
        and not payload.encode("ascii").translate(None, _TOKEN_CHARS)
        and _plain_json_string(kid)
    ):
        return kid, payload
    return None


def envelope_text(kid: str, payload: str) -> str:
    """`json.dumps` of the envelope `seal` builds, for a kid and token that need no escaping."""
    return _HEAD + kid + _MID + payload + _TAIL


def payload_of(message_data: str) -> str | None:
    """The envelope's payload (the Fernet token), or None when the row is no envelope."""
    split = split_envelope(message_data)
    if split is not None:
        return split[1]
    env = parse_envelope(message_data)
    return None if env is None else str(env["payload"])


def _token_time(token: bytes) -> int:
    """The timestamp of a token Fernet has just authenticated (bytes 1-8 of its decoding)."""
    head = token[:12]
    # 12 base64 characters are the version byte and the 8-byte big-endian timestamp;
    # base64 skips characters outside its alphabet, so only a clean head is read alone.
    raw = base64.urlsafe_b64decode(head if not head.translate(None, _B64) else token)
    return int.from_bytes(raw[1:9], "big")


def parse_envelope(message_data: str) -> dict[str, Any] | None:
    """The envelope dict, or None when the row is not a well-formed envelope."""
    try:
        env = json.loads(message_data)
    except (ValueError, TypeError, RecursionError):
        # RecursionError: nesting deeper than the parser's stack (`[` x 5000), which anyone
        # who can write the file can store; an unreadable row like any other non-envelope.
        return None
    if (
        isinstance(env, dict)
        and env.get("__enc__") == 1
        and isinstance(env.get("payload"), str)
        and isinstance(env.get("kid"), str)
        and "v" in env
    ):
        return env
    return None


class Sealer:
    """Seals and opens items for one master key; caches the per-session keys."""

    def __init__(self, master_key: str) -> None:
        self._master = master_key
        self.kid = key_id(master_key)
        self._fernets: dict[str, Fernet] = {}

    def __repr__(self) -> str:  # never show the key, even in a debugger or a log
        return f"<Sealer kid={self.kid}>"

    @property
    def master_key(self) -> str:
        """The secret itself: only for handing to the SDK's EncryptedSession."""
        return self._master

    def for_kid(self, kid: str | None) -> Sealer | None:
        """The sealer that opens rows under `kid`: this one for its own kid, else None."""
        return self if kid == self.kid else None

    def fernet(self, session_id: str) -> Fernet:
        f = self._fernets.get(session_id)
        if f is None:
            f = self._fernets[session_id] = session_fernet(self._master, session_id)
        return f

    def reader(self, session_id: str, message_data: str) -> Fernet:
        """The Fernet that opens `message_data` (`open` and `state` use it): this key's
        for the session. A sealer that reads more than one key picks by the envelope."""
        return self.fernet(session_id)

    def envelope(self, session_id: str, item: Any, now: int | None = None) -> dict[str, Any]:
        f = self.fernet(session_id)
        data = _to_json_bytes(item)
        token = f.encrypt(data) if now is None else f.encrypt_at_time(data, now)
        return {"__enc__": 1, "v": ENVELOPE_VERSION, "kid": self.kid, "payload": token.decode()}

    def seal(self, session_id: str, item: Any, now: int | None = None) -> str:
        """The row text: `json.dumps(envelope)`, as SQLiteSession stores it."""
        env = self.envelope(session_id, item, now)
        return envelope_text(env["kid"], env["payload"])

    def open(
        self, session_id: str, message_data: str, ttl: int | None, now: int | None = None
    ) -> Opened:
        """Tell readable, expired and unreadable (wrong key, corrupt, tampered) apart.

        Fernet alone reports all three as InvalidToken: authenticate without a TTL
        first, then judge the authenticated timestamp.
        """
        payload = payload_of(message_data)
        if payload is None:
            return Opened(ItemState.UNREADABLE)
        f = self.reader(session_id, message_data)
        token = payload.encode("ascii", "replace")
        try:
            ts = f.extract_timestamp(token)
        except (InvalidToken, TypeError):
            return Opened(ItemState.UNREADABLE)
        current = int(time.time()) if now is None else now
        if ttl is not None and ts + ttl < current:
            return Opened(ItemState.EXPIRED, timestamp=ts)
        try:
            if ttl is None:
                plain = f.decrypt(token)
            else:
                plain = f.decrypt_at_time(token, ttl=ttl, current_time=current)
            item = decode_item(plain)
        except (InvalidToken, ValueError):
            return Opened(ItemState.UNREADABLE, timestamp=ts)
        return Opened(ItemState.READABLE, item=item, timestamp=ts)

    def state(
        self,
        session_id: str,
        message_data: str,
        ttl: int | None,
        now: int | None = None,
        *,
        decode: bool = False,
    ) -> ItemState:
        """The item's state for counting, without decrypting it (about 3x cheaper than `open`).

        Authenticate (HMAC) without a TTL, then judge the authenticated timestamp, with
        the same TTL and clock-skew rules as `open`. Only a token that authenticates but
        whose plaintext does not decode (bad padding, not JSON, nested too deeply: only a
        holder of the key could write one) is counted readable here where `open` would
        call it unreadable, unless `decode` asks for that check too (verify does).
        """
        payload = payload_of(message_data)
        if payload is None:
            return ItemState.UNREADABLE
        token = payload.encode("ascii", "replace")
        f = self.reader(session_id, message_data)
        try:
            ts = f.extract_timestamp(token)
            if decode:
                decode_item(f.decrypt(token))
        except (InvalidToken, TypeError, ValueError):
            return ItemState.UNREADABLE
        if ttl is None:
            return ItemState.READABLE
        current = int(time.time()) if now is None else now
        if ts + ttl < current:
            return ItemState.EXPIRED
        if current + MAX_CLOCK_SKEW < ts:  # decrypt_at_time refuses tokens from the future
            return ItemState.UNREADABLE
        return ItemState.READABLE


def kid_of(message_data: str) -> str | None:
    """The key id an envelope names (unauthenticated), or None for a row that is none."""
    split = split_envelope(message_data)
    if split is not None:
        return split[0]
    env = parse_envelope(message_data)
    return None if env is None else str(env["kid"])


def rotate_row_stamped(
    old: Sealer, new: Sealer, session_id: str, message_data: str
) -> tuple[str, int] | None:
    """Re-encrypt one row under the new key; return it with the token's timestamp.

    Decrypts with the old session key and encrypts at the token's own
    (authenticated) timestamp with the new one: the same token `MultiFernet([new,
    old]).rotate` makes, without its first, failing HMAC under the new key, so
    rotation never extends an item's life. A row in `seal`'s layout is rebuilt
    without a JSON parser; any other keeps its envelope, kid and payload replaced.
    Returns None when the row does not authenticate under the old key.
    """
    split = split_envelope(message_data)
    env = None
    if split is not None:
        payload = split[1]
    else:
        env = parse_envelope(message_data)
        if env is None:
            return None
        payload = env["payload"]
    token = payload.encode("ascii", "replace")
    try:
        plain = old.fernet(session_id).decrypt(token)
    except InvalidToken:
        return None
    ts = _token_time(token)
    fresh = new.fernet(session_id).encrypt_at_time(plain, ts).decode()
    if env is None:
        return envelope_text(new.kid, fresh), ts
    env["kid"] = new.kid
    env["payload"] = fresh
    return json.dumps(env), ts


def token_time(token: str) -> int:
    """The time a Fernet token claims, unauthenticated (Fernet too judges a TTL before it
    authenticates); ValueError for a token that is not base64."""
    return _token_time(token.encode("ascii", "replace"))


def token_timestamp(message_data: str) -> int | None:
    """The (unauthenticated) Fernet timestamp of a row; for counting, never for trust."""
    env = parse_envelope(message_data)
    if env is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(env["payload"].encode("ascii"))
    except (binascii.Error, ValueError):
        return None
    return int.from_bytes(raw[1:9], "big") if len(raw) >= 9 else None


def triage(
    rows: Iterable[tuple[int, str, str]],
    sealer_of: Callable[[str], Sealer],
    ttl: int | None,
    now: int,
) -> tuple[list[tuple[int]], int, int]:
    """Purge's sort of (id, session_id, message_data) rows: ([(id,) of each item past the
    TTL], items kept, unreadable items), each judged by `sealer_of(message_data)`."""
    doomed: list[tuple[int]] = []
    kept = unreadable = 0
    for row_id, sid, data in rows:
        state = sealer_of(data).state(sid, data, ttl, now)
        if state is ItemState.EXPIRED:
            doomed.append((row_id,))
        elif state is ItemState.UNREADABLE:
            unreadable += 1
        else:
            kept += 1
    return doomed, kept, unreadable
