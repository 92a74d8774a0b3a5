"""The history chain's cryptography: pure functions, no I/O, no engine, no `agents`.

Each stored item carries a *link*: its epoch, position, write sequence, a tag of
its session, the id of the item before it (`prev`), its own id (`ident`), and a
MAC over all of that, the vault id and the stored envelope text, under a chain
key derived from the key version's master key (HKDF, its own `info` label). A
session's *head* (epoch, base, end, sequence, floor, last) is MACed the same way.
`vault.chaincheck.check` judges a session's rows against its head.

An item's `ident` is its MAC when written and never changes; the chain links
idents, not current MACs. A rotation re-MACs each re-encrypted row under the new
key (`remac`) with no cascade, so the online rotation's batches (vault.rotation)
re-MAC rows in any order, each in the UPDATE that re-encrypts it. Design:
docs/history-chain.md.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import hmac as _chmac
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from vault import crypto

# Distinct from the SDK's envelope label (crypto.HKDF_INFO): a chain key is never a
# Fernet key, and knowing one tells nothing of the other.
CHAIN_INFO = b"memvault.history-chain.v1"
MAC_BYTES = 16  # HMAC-SHA256 truncated to 128 bits (NIST SP 800-107 allows >= 64)
LINK_VERSION = "l1"
HEAD_VERSION = "h1"
_LINK_DOMAIN = b"memvault chain link v1"
_RELINK_DOMAIN = b"memvault chain relink v1"  # a link re-MACed by a rotation
_HEAD_DOMAIN = b"memvault chain head v1"
_GENESIS_DOMAIN = b"memvault chain genesis v1"
_TAG_DOMAIN = b"memvault chain session v1"


def hex_text(raw: bytes) -> str:
    return raw.hex()


def unhex(text: str) -> bytes:
    # Hex, not base64: bytes.fromhex is a C call, base64's decoder several Python ones,
    # and a link is decoded for every item read. Only the canonical spelling is taken.
    if len(text) != 2 * MAC_BYTES:
        raise ValueError("not a chain value")
    raw = bytes.fromhex(text)
    if raw.hex() != text:
        raise ValueError("not a chain value")
    return raw


def fields(*parts: bytes) -> bytes:
    # Length-prefixed, so no two different field lists give the same input.
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


def utf8(text: str) -> bytes:
    # surrogatepass: a session id or row is any Python str, lone surrogates included.
    return text.encode("utf-8", "surrogatepass")


def num(n: int) -> bytes:
    return struct.pack(">Q", n)


@dataclass(frozen=True)
class ChainKey:
    """The chain key of one key version of one vault."""

    kid: str
    vault_id: str
    secret: bytes
    _keyed: _chmac.HMAC = field(init=False, repr=False, compare=False)
    _prefixes: dict[tuple[bool, bytes, int], _chmac.HMAC] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        # Keyed once: copying a keyed HMAC is about twice as fast as keying a new one.
        object.__setattr__(self, "_keyed", _chmac.HMAC(self.secret, hashes.SHA256()))

    def __repr__(self) -> str:  # never show the secret
        return f"<ChainKey kid={self.kid}>"

    def link_prefix(self, relinked: bool, tag: bytes, epoch: int) -> _chmac.HMAC:
        """A keyed HMAC already fed the fields a session's links of one epoch share;
        callers copy it per item, never update it (threads share it). Kept: the
        next read of the session needs the same one."""
        h = self._prefixes.get((relinked, tag, epoch))
        if h is None:
            if len(self._prefixes) >= 256:
                self._prefixes.clear()
            h = self._keyed.copy()
            domain = _RELINK_DOMAIN if relinked else _LINK_DOMAIN
            h.update(fields(domain, utf8(self.vault_id), tag, num(epoch)))
            self._prefixes[(relinked, tag, epoch)] = h
        return h

    def mac(self, data: bytes) -> bytes:
        h = self._keyed.copy()
        h.update(data)
        return h.finalize()[:MAC_BYTES]


def chain_key(master_key: str, vault_id: str) -> ChainKey:
    """The chain key of `master_key` for `vault_id`: HKDF-SHA256, salt the vault id."""
    hkdf = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=vault_id.encode("utf-8"), info=CHAIN_INFO
    )
    secret = hkdf.derive(crypto.master_key_bytes(master_key))
    return ChainKey(crypto.key_id(master_key), vault_id, secret)


def session_tag(vault_id: str, session_id: str) -> bytes:
    """A key-independent tag of the session (its id is in the row already): lets `check`
    tell an item moved from another session of the vault from a forged one."""
    return hashlib.sha256(fields(_TAG_DOMAIN, utf8(vault_id), utf8(session_id))).digest()[
        :MAC_BYTES
    ]


def genesis(vault_id: str, session_id: str, epoch: int) -> bytes:
    """The `prev` of an epoch's first item; key-independent so a rotation keeps it."""
    data = fields(_GENESIS_DOMAIN, utf8(vault_id), utf8(session_id), num(epoch))
    return hashlib.sha256(data).digest()[:MAC_BYTES]


class Link(NamedTuple):
    """One item's chain record; `mac` equals `ident` until a rotation re-MACs it.
    A named tuple: one is built for every item read, and a frozen dataclass's
    constructor costs several times as much."""

    epoch: int
    pos: int
    seq: int
    tag: bytes
    prev: bytes
    ident: bytes
    mac: bytes

    def encode(self) -> str:
        parts = [LINK_VERSION, str(self.epoch), str(self.pos), str(self.seq)]
        parts += [hex_text(self.tag), hex_text(self.prev), hex_text(self.ident)]
        if self.mac != self.ident:
            parts.append(hex_text(self.mac))
        return ".".join(parts)

    @classmethod
    def decode(cls, text: str | None) -> Link | None:
        """The link a row stores, or None for a missing or malformed one."""
        if text is None:
            return None
        parts = text.split(".")
        if len(parts) not in (7, 8) or parts[0] != LINK_VERSION:
            return None
        try:
            epoch, pos, seq = count_of(parts[1]), count_of(parts[2]), count_of(parts[3])
            tag, prev, ident = unhex(parts[4]), unhex(parts[5]), unhex(parts[6])
            mac = unhex(parts[7]) if len(parts) == 8 else ident
        except ValueError:
            return None
        if len(parts) == 8 and mac == ident:
            return None  # not how encode writes it
        return cls(epoch, pos, seq, tag, prev, ident, mac)


# Counts are 64-bit fields: one read stays below 2^63 (its +1 fits), a huge one refused.
MAX_COUNT = 2**63 - 1


def count_of(text: str) -> int:
    if not text.isdigit() or not text.isascii() or (len(text) > 1 and text[0] == "0"):
        raise ValueError("not a count")
    if len(text) > 19 or int(text) > MAX_COUNT:
        raise ValueError("count too large")
    return int(text)


_POSITION = struct.Struct(f">QQ{MAC_BYTES}s")


def _link_mac(
    prefix: _chmac.HMAC, pos: int, seq: int, prev: bytes, ident: bytes | None, text: str
) -> bytes:
    """The MAC of one item: `ident` only in a re-MACed link (its prefix's domain says
    so). Fixed-size fields, then the text last: no length prefix is needed."""
    h = prefix.copy()
    fixed = _POSITION.pack(pos, seq, prev)
    if ident is not None:
        fixed += ident
    h.update(fixed + utf8(text))
    return h.finalize()[:MAC_BYTES]


def link_ok(key: ChainKey, link: Link, text: str) -> bool:
    """Whether the link's MAC holds for this envelope text under `key`."""
    relinked = link.mac != link.ident
    prefix = key.link_prefix(relinked, link.tag, link.epoch)
    ident = link.ident if relinked else None
    mac = _link_mac(prefix, link.pos, link.seq, link.prev, ident, text)
    return _hmac.compare_digest(mac, link.mac)


@dataclass(frozen=True)
class Anchor:
    """A head's key-independent state: what is kept outside the file, and survives
    rotation. A head at the same `seq` with another state is a fork."""

    epoch: int
    base: int
    end: int
    seq: int
    last: bytes


@dataclass(frozen=True)
class Head:
    """A session's authenticated state: live positions are [base, end) of `epoch`,
    `floor` is the `prev` of the item at `base`, `last` the ident of the item at
    end - 1 (`floor` when empty), `seq` counts the operations that changed it."""

    kid: str
    epoch: int
    base: int
    end: int
    seq: int
    floor: bytes
    last: bytes
    mac: bytes

    @property
    def count(self) -> int:
        return self.end - self.base

    def anchor(self) -> Anchor:
        return Anchor(self.epoch, self.base, self.end, self.seq, self.last)

    def encode(self) -> str:
        nums = (self.epoch, self.base, self.end, self.seq)
        vals = (self.floor, self.last, self.mac)
        return ".".join([HEAD_VERSION, self.kid, *map(str, nums), *map(hex_text, vals)])

    @classmethod
    def decode(cls, text: str | None) -> Head | None:
        if text is None:
            return None
        parts = text.split(".")
        if len(parts) != 9 or parts[0] != HEAD_VERSION or not crypto.looks_like_kid(parts[1]):
            return None
        try:
            epoch, base, end, seq = (count_of(p) for p in parts[2:6])
            floor, last, mac = (unhex(p) for p in parts[6:9])
        except ValueError:
            return None
        if end < base:
            return None
        return cls(parts[1], epoch, base, end, seq, floor, last, mac)


def _head_input(key: ChainKey, session_id: str, h: Head) -> bytes:
    return fields(
        _HEAD_DOMAIN,
        utf8(key.vault_id),
        utf8(session_id),
        utf8(h.kid),
        num(h.epoch),
        num(h.base),
        num(h.end),
        num(h.seq),
        h.floor,
        h.last,
    )


def _sealed(key: ChainKey, session_id: str, h: Head) -> Head:
    h = replace(h, kid=key.kid, mac=b"")
    return replace(h, mac=key.mac(_head_input(key, session_id, h)))


def head_ok(key: ChainKey, session_id: str, h: Head) -> bool:
    return key.kid == h.kid and _hmac.compare_digest(
        key.mac(_head_input(key, session_id, h)), h.mac
    )


def new_head(key: ChainKey, session_id: str) -> Head:
    """The head of a session with no items yet (written with its first item)."""
    g = genesis(key.vault_id, session_id, 0)
    return _sealed(key, session_id, Head(key.kid, 0, 0, 0, 0, g, g, b""))


def extend(
    key: ChainKey,
    session_id: str,
    head: Head,
    texts: Sequence[str],
    item_keys: Sequence[ChainKey] | None = None,
) -> tuple[list[Link], Head]:
    """The links of new items appended after `head`, and the head after them (one `seq`).
    `item_keys` (one per text) MAC each under the key its envelope names: an upgrade
    amid a cut-off rotation links rows under both keys."""
    seq = head.seq + 1
    tag = session_tag(key.vault_id, session_id)
    prefix = key.link_prefix(False, tag, head.epoch)
    prev, links = head.last, []
    for i, text in enumerate(texts):
        own = prefix if item_keys is None else item_keys[i].link_prefix(False, tag, head.epoch)
        ident = _link_mac(own, head.end + i, seq, prev, None, text)
        links.append(Link(head.epoch, head.end + i, seq, tag, prev, ident, ident))
        prev = ident
    moved = replace(head, end=head.end + len(links), seq=seq, last=prev)
    return links, _sealed(key, session_id, moved)


def _own_item(
    key: ChainKey, session_id: str, head: Head, link: Link, text: str, link_key: ChainKey | None
) -> bool:
    """Whether `link` is a live item of this session, its MAC over `text` sound."""
    return (
        link.epoch == head.epoch
        and head.base <= link.pos < head.end
        and link.tag == session_tag(key.vault_id, session_id)
        and link_ok(link_key or key, link, text)
    )


def pop(
    key: ChainKey,
    session_id: str,
    head: Head,
    popped: Link,
    text: str,
    link_key: ChainKey | None = None,
) -> Head:
    """The head after its last item, the row (`popped`, `text`), went. That row must
    authenticate and be the head's `last`, so a pop never approves an item put in
    its place; the new `last` is its `prev`. A popped item put back no longer fits
    (its position is past `end`, or a later `seq` wrote there)."""
    if head.count == 0:
        raise ValueError("nothing to pop")
    if popped.ident != head.last or not _own_item(key, session_id, head, popped, text, link_key):
        raise ValueError("the popped item is not the session's authentic last one")
    moved = replace(head, end=head.end - 1, seq=head.seq + 1, last=popped.prev)
    return _sealed(key, session_id, moved)


def clear(key: ChainKey, session_id: str, head: Head) -> Head:
    """The head after every item went: a new epoch, so an item of an older one put
    back is told apart from tampering with the live ones."""
    epoch = head.epoch + 1
    g = genesis(key.vault_id, session_id, epoch)
    moved = replace(head, epoch=epoch, base=head.end, seq=head.seq + 1, floor=g, last=g)
    return _sealed(key, session_id, moved)


def purge(
    key: ChainKey,
    session_id: str,
    head: Head,
    last_purged: Link,
    text: str,
    link_key: ChainKey | None = None,
) -> Head:
    """The head after a TTL purge took the oldest items up to `last_purged`, whose link
    must authenticate over its own `text`; its ident becomes the floor."""
    if not _own_item(key, session_id, head, last_purged, text, link_key):
        raise ValueError("the purged item is not a live item of this session")
    base = last_purged.pos + 1
    last = last_purged.ident if base == head.end else head.last
    moved = replace(head, base=base, seq=head.seq + 1, floor=last_purged.ident, last=last)
    return _sealed(key, session_id, moved)


def remac(old: ChainKey, new: ChainKey, link: Link, old_text: str, new_text: str) -> Link | None:
    """The link of a row a rotation re-encrypted (old_text -> new_text): verified under
    the old key, then MACed under the new one over the new text; ident, prev, position
    and seq are kept, so no other row changes. None when it does not verify (the row
    is kept as it is and reported, as the rotation keeps an unreadable envelope)."""
    if not link_ok(old, link, old_text):
        return None
    prefix = new.link_prefix(True, link.tag, link.epoch)
    mac = _link_mac(prefix, link.pos, link.seq, link.prev, link.ident, new_text)
    if mac == link.ident:  # 2^-128; the encoding needs them different
        raise ValueError("chain MAC collision")
    return link._replace(mac=mac)


def remac_head(old: ChainKey, new: ChainKey, session_id: str, head: Head) -> Head | None:
    """The head under the new key, its state (and so its anchor) unchanged."""
    if not head_ok(old, session_id, head):
        return None
    return _sealed(new, session_id, head)
