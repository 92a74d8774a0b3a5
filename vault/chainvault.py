"""The vault head: one authenticated summary of every session's head (vault.chain).

A session's head vouches for its rows, but a session's rows and head put back
together from an older copy, or a session removed whole, are consistent on their
own. The vault head closes that: its `digest` is the XOR, over the sessions, of a
MAC of each head's key-independent state (`Head.anchor()`), under the chain key,
so one write moves it in O(1) (out with the session's old state, in with the new)
and no one without the key can compute or combine the terms. The head itself is
MACed with its `seq`, which every chained write of the vault increments.

What the vault head cannot tell is a whole file put back, every head and the vault
head together: that is what the point kept outside the file (`Point`, the anchor
of docs/history-chain.md) is compared with. Pure: no I/O, no engine.
"""

from __future__ import annotations

import hmac as _hmac
from collections.abc import Mapping
from dataclasses import dataclass

from vault import crypto
from vault.chain import (
    MAC_BYTES,
    Anchor,
    ChainKey,
    Head,
    count_of,
    fields,
    head_ok,
    hex_text,
    num,
    unhex,
    utf8,
)
from vault.chaincheck import Tamper

VAULT_HEAD_VERSION = "v2"  # sealed with the key source the file names
# Written before 0.3 binds the source: still read, never written (the next write seals
# v2). Such a head vouches for no source: docs/history-chain.md, "Key source".
UNBOUND_VERSION = "v1"
# A vault head starts at seq 1: its point (chainanchor) is then never the anchor's
# "chained" mark, Point(0, ZERO), so an anchor past that mark says a vault head exists.
FIRST_SEQ = 1
_TERM_DOMAIN = b"memvault chain vault term v1"
_UNBOUND_DOMAIN = b"memvault chain vault head v1"
_VAULT_HEAD_DOMAIN = b"memvault chain vault head v2"
_BACKUP_DOMAIN = b"memvault chain backup point v2"
BACKUP_POINT_VERSION = "b2"
ZERO = bytes(MAC_BYTES)


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Point:
    """What the anchor outside the file keeps of a vault head: no key needed to compare
    it, nothing secret in it."""

    seq: int
    digest: bytes


@dataclass(frozen=True)
class VaultHead:
    kid: str
    seq: int
    digest: bytes
    mac: bytes
    version: str = VAULT_HEAD_VERSION
    # The key source it is sealed for, in clear beside the MAC that covers it (v2), so
    # that an agent's write checks it without reading the meta; None: a 0.2 head.
    source: str | None = None

    def point(self) -> Point:
        return Point(self.seq, self.digest)

    def encode(self) -> str:
        parts = [self.version, self.kid, str(self.seq), hex_text(self.digest)]
        if self.version != UNBOUND_VERSION:
            parts.append(hex_text(utf8(self.source or "")))
        return ".".join([*parts, hex_text(self.mac)])

    @classmethod
    def decode(cls, text: str | None) -> VaultHead | None:
        if text is None:
            return None
        parts = text.split(".")
        version = parts[0]
        if (version, len(parts)) not in ((VAULT_HEAD_VERSION, 6), (UNBOUND_VERSION, 5)):
            return None
        if not crypto.looks_like_kid(parts[1]):
            return None
        try:
            seq, digest, mac = count_of(parts[2]), unhex(parts[3]), unhex(parts[-1])
            source = _source_text(parts[4]) if len(parts) == 6 else None
        except ValueError:  # UnicodeDecodeError too
            return None
        if len(digest) != MAC_BYTES or len(mac) != MAC_BYTES:
            return None
        return cls(parts[1], seq, digest, mac, version, source)


def _source_text(text: str) -> str:
    """A v2 head's source field: the canonical hex of UTF-8 text (ValueError if not)."""
    raw = bytes.fromhex(text)
    if raw.hex() != text:
        raise ValueError("not a source field")
    return raw.decode()


def term(key: ChainKey, session_id: str, anchor: Anchor | None) -> bytes:
    """A session's term of the digest: nothing for a session with no head."""
    if anchor is None:
        return ZERO
    nums = (anchor.epoch, anchor.base, anchor.end, anchor.seq)
    data = fields(_TERM_DOMAIN, utf8(key.vault_id), utf8(session_id), *map(num, nums))
    return key.mac(data + anchor.last)


def _sealed(key: ChainKey, seq: int, digest: bytes, source: str) -> VaultHead:
    """`source` is the key source the file's meta names (vault.engines.sqlite.vaulthead
    `bound_source`): rows that no MAC covers, so a copy given another source's rows no
    longer matches its own vault head."""
    data = fields(_VAULT_HEAD_DOMAIN, utf8(key.vault_id), utf8(key.kid), num(seq), digest)
    mac = key.mac(data + fields(utf8(source)))
    return VaultHead(key.kid, seq, digest, mac, VAULT_HEAD_VERSION, source)


def vault_head_ok(key: ChainKey, vh: VaultHead, source: str) -> bool:
    if key.kid != vh.kid:
        return False
    if vh.version == UNBOUND_VERSION:
        data = fields(_UNBOUND_DOMAIN, utf8(key.vault_id), utf8(key.kid), num(vh.seq), vh.digest)
        return _hmac.compare_digest(key.mac(data), vh.mac)
    if vh.source != source:  # the clear copy a write reads must say what the MAC does
        return False
    return _hmac.compare_digest(_sealed(key, vh.seq, vh.digest, source).mac, vh.mac)


def digest_of(key: ChainKey, heads: Mapping[str, Head]) -> bytes:
    """The digest of these session heads, computed afresh (verify; a rotation)."""
    out = ZERO
    for session_id, head in heads.items():
        out = _xor(out, term(key, session_id, head.anchor()))
    return out


def new_vault_head(
    key: ChainKey, source: str, heads: Mapping[str, Head] | None = None
) -> VaultHead:
    """The vault head over `heads` (none: an empty vault), at FIRST_SEQ."""
    return _sealed(key, FIRST_SEQ, digest_of(key, heads or {}), source)


def matches(key: ChainKey, vh: VaultHead, heads: Mapping[str, Head], source: str) -> bool:
    """Whether `vh` authenticates under `key` and sums exactly these heads. Each head's
    own MAC is its session's check (vault.chaincheck), not this one: a forged head is
    named there, and its term, keyed, cannot be made to fit the digest."""
    return vault_head_ok(key, vh, source) and _hmac.compare_digest(digest_of(key, heads), vh.digest)


def rekey(
    old: ChainKey, new: ChainKey, vh: VaultHead, heads: Mapping[str, Head], source: str
) -> VaultHead | None:
    """The vault head under a rotation's new key, one write later; None when it does not
    match `heads` under the old one (it is then kept as it is, and still reported)."""
    if not matches(old, vh, heads, source):
        return None
    return _sealed(new, vh.seq + 1, digest_of(new, heads), source)


def accepted(
    key: ChainKey, vh: VaultHead | None, heads: Mapping[str, Head], source: str, past: int = 0
) -> VaultHead:
    """The vault head over the heads as they stand, on purpose (`memvault accept`, a
    `restore`): one write past the stored head and past `past`, the anchor's `seq`, so
    that the state taken is newer than anything recorded of the vault."""
    seq = max(0 if vh is None else vh.seq, past) + 1
    return _sealed(key, seq, digest_of(key, heads), source)


def moved(
    key: ChainKey,
    vh: VaultHead,
    session_id: str,
    before: Head | None,
    after: Head | None,
    source: str,
) -> VaultHead:
    """The vault head after one write moved a session's head from `before` to `after`
    (None: no head), in the write's own transaction."""
    if not vault_head_ok(key, vh, source):
        raise ValueError("the vault head does not authenticate")
    old = term(key, session_id, None if before is None else before.anchor())
    new = term(key, session_id, None if after is None else after.anchor())
    return _sealed(key, vh.seq + 1, _xor(_xor(vh.digest, old), new), source)


def stepped(key: ChainKey, vh: VaultHead, source: str, to: str) -> VaultHead | None:
    """The same state one write later, sealed for the source `to` (a `key move`'s switch:
    every point recorded of the vault before it is then behind the file); None when
    `vh` does not authenticate for `source`. The digest is kept: a mismatch stays one."""
    return _sealed(key, vh.seq + 1, vh.digest, to) if vault_head_ok(key, vh, source) else None


def bound(key: ChainKey, vh: VaultHead, source: str) -> VaultHead | None:
    """A 0.2 vault head (`UNBOUND_VERSION`) sealed for `source` at the same point, so that
    the anchor and the backups' seals still name its state; None for any other."""
    if vh.version != UNBOUND_VERSION or not vault_head_ok(key, vh, source):
        return None
    return _sealed(key, vh.seq, vh.digest, source)


def judge(
    key: ChainKey,
    vh: VaultHead | None,
    heads: Mapping[str, Head],
    source: str,
    anchor: Point | None = None,
) -> Tamper | None:
    """What is wrong with the vault as a whole, or None. `heads` are the sessions'
    stored heads (each judged on its own by vault.chaincheck); `source` the key source
    the file names; `anchor` is the point kept outside the file, if any."""
    if vh is None or not vault_head_ok(key, vh, source):
        return Tamper.UNAUTHENTICATED
    if any(not head_ok(key, sid, h) for sid, h in heads.items()):
        return Tamper.UNAUTHENTICATED
    if not _hmac.compare_digest(digest_of(key, heads), vh.digest):
        # A session put back from an older copy (rows and head), added or removed whole.
        return Tamper.ROLLED_BACK
    if anchor is not None and behind(vh.point(), anchor):
        return Tamper.FILE_ROLLED_BACK  # the whole file is older than what was seen of it
    return None


def behind(point: Point, anchor: Point) -> bool:
    """Whether a vault head at `point` is older than `anchor`: a lower `seq`, or the same
    one with another digest (a fork: each write of the vault moves `seq` by one, so one
    history has one digest at each `seq`)."""
    return point.seq < anchor.seq or (
        point.seq == anchor.seq and not _hmac.compare_digest(point.digest, anchor.digest)
    )


def seal_backup(key: ChainKey, backup_id: str, source: str, point: Point) -> str:
    """The text a backup keeps of its own vault head (`backup_point` in its meta): the
    point, MACed with the backup's id and the live vault's place (`source`), so that no
    one without the key can mark an older copy of the live file as a backup of its own
    state, nor unmark the copy's place to pass it off there as a backup."""
    data = fields(_BACKUP_DOMAIN, utf8(key.vault_id), utf8(key.kid), utf8(backup_id), utf8(source))
    mac = key.mac(data + fields(num(point.seq), point.digest))
    return ".".join(
        [BACKUP_POINT_VERSION, key.kid, str(point.seq), hex_text(point.digest), hex_text(mac)]
    )


def backup_point(
    keys: Mapping[str, ChainKey], backup_id: str, source: str, text: str
) -> Point | None:
    """The point a backup's `backup_point` seals, or None when it does not authenticate
    under `keys` (or is not one)."""
    parts = text.split(".")
    if len(parts) != 5 or parts[0] != BACKUP_POINT_VERSION or parts[1] not in keys:
        return None
    try:
        point = Point(count_of(parts[2]), unhex(parts[3]))
    except ValueError:
        return None
    if len(point.digest) != MAC_BYTES:
        return None
    sealed = seal_backup(keys[parts[1]], backup_id, source, point)
    return point if _hmac.compare_digest(sealed.encode(), text.encode()) else None
