"""Judging a session's rows against its head (vault.chain): the first problem and its kind.

Pure: the rows, the head, the chain keys and optionally the anchor kept outside the
file come in; a `Verdict` comes out. Each row is authenticated on its own first
(its link names its epoch, position, seq, session tag and the ident before it), so
the kind is named from authenticated facts, never guessed from the text.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from vault import crypto
from vault.chain import Anchor, ChainKey, Head, Link, head_ok, link_ok, session_tag


class Tamper(enum.Enum):
    UNAUTHENTICATED = "unauthenticated"  # a row or head whose MAC fails, or no link
    MOVED = "moved from another session"
    REINSERTED_AFTER_CLEAR = "re-inserted after clear"
    REINSERTED_AFTER_PURGE = "re-inserted after purge"
    REINSERTED_AFTER_POP = "re-inserted after pop"
    DUPLICATED = "duplicated"
    SWAPPED = "swapped"
    DELETED = "deleted from the middle"
    CUT_TAIL = "tail cut"
    ROLLED_BACK = "replaced by an older copy"
    # The vault's, not one session's: its vault head (vault.chainvault) does not sum its
    # sessions' heads, so one was put back whole, added or removed, which cannot be told.
    VAULT_MISMATCH = "a session put back from an older copy, added or removed whole"
    # The whole file, every head and the vault head together, is older than the state the
    # anchor kept outside it (vault.chainanchor) recorded, or than a backup's sealed point.
    FILE_ROLLED_BACK = "the whole vault put back from an older copy"


@dataclass(frozen=True)
class Verdict:
    """No problem (`kind` None), or the first one: its kind and the row's index in
    the stored order (None when it is about the head or the session as a whole)."""

    kind: Tamper | None = None
    index: int | None = None

    @property
    def ok(self) -> bool:
        return self.kind is None


OK = Verdict()
# (envelope text, link text) of each row, in the stored order (row id).
Row = tuple[str, str | None]


def _key(keys: Mapping[str, ChainKey], kid: str | None) -> ChainKey | None:
    return None if kid is None else keys.get(kid)


def _authentic(keys: Mapping[str, ChainKey], row: Row) -> Link | None:
    """The row's link if it authenticates under the key its envelope names."""
    text, raw = row
    link = Link.decode(raw)
    key = _key(keys, crypto.kid_of(text))
    if link is None or key is None or not link_ok(key, link, text):
        return None
    return link


def _live_idents(head: Head, links: Sequence[Link | None]) -> tuple[set[bytes], bool]:
    """The idents reachable from the head's `last` down the `prev` links, and whether
    the walk reached the floor (nothing live is missing)."""
    by_ident = {lk.ident: lk for lk in links if lk is not None}
    live: set[bytes] = set()
    cur = head.last
    while cur != head.floor and cur in by_ident and cur not in live:
        live.add(cur)
        cur = by_ident[cur].prev
    return live, cur == head.floor


def check(
    keys: Mapping[str, ChainKey],
    session_id: str,
    rows: Sequence[Row],
    head: Head | None,
    anchor: Anchor | None = None,
) -> Verdict:
    """The first problem of a session's stored rows, judged against its head.

    `keys` are the chain keys by kid (the current one, and the old one while a
    rotation moves rows); `anchor` is the newest state recorded outside the file
    for this session, if any: a head older than it is a rolled-back session.
    """
    if head is None:
        # No head: a session never written, or one whose head was deleted.
        return OK if not rows else _headless(keys, session_id, rows[0])
    first = _judge_head(keys, session_id, head, anchor)
    return first if first is not None else _rows(keys, session_id, rows, head)


def check_tail(
    keys: Mapping[str, ChainKey],
    session_id: str,
    rows: Sequence[Row],
    head: Head | None,
    limit: int,
    anchor: Anchor | None = None,
) -> Verdict:
    """Whether `rows`, what a `get_items(limit)` read found (the session's last stored
    rows, at most `limit`), are its head's last items, in order: a cost in `limit`,
    not in the history's length.

    A problem inside the window is found (its kind judged from the window alone;
    `check` over every row names it exactly); one before the window is `verify`'s.
    """
    if head is None:
        return OK if not rows else _headless(keys, session_id, rows[0])
    first = _judge_head(keys, session_id, head, anchor)
    if first is not None:
        return first
    want = max(min(limit, head.count), len(rows))
    if want >= head.count:
        return _rows(keys, session_id, rows, head)
    # The window's own head: it starts where the last `want` items start, and its
    # floor is what its first row links to (checked by that row's MAC).
    lead = _authentic(keys, rows[0]) if rows else None
    base = head.end - want
    floor = lead.prev if lead is not None and lead.pos == base else head.floor
    return _rows(keys, session_id, rows, replace(head, base=base, floor=floor))


def _judge_head(
    keys: Mapping[str, ChainKey], session_id: str, head: Head, anchor: Anchor | None
) -> Verdict | None:
    hkey = keys.get(head.kid)
    if hkey is None or not head_ok(hkey, session_id, head):
        return Verdict(Tamper.UNAUTHENTICATED)
    if anchor is not None and (
        head.seq < anchor.seq or (head.seq == anchor.seq and head.anchor() != anchor)
    ):
        return Verdict(Tamper.ROLLED_BACK)
    return None


def _rows(
    keys: Mapping[str, ChainKey], session_id: str, rows: Sequence[Row], head: Head
) -> Verdict:
    """The first problem of the rows, the head already authenticated."""
    tag = session_tag(keys[head.kid].vault_id, session_id)
    links = [_authentic(keys, row) for row in rows]
    ours = [
        lk if lk is not None and lk.tag == tag and lk.epoch == head.epoch else None for lk in links
    ]
    live, complete = _live_idents(head, ours)
    copies = Counter(lk.ident for lk in ours if lk is not None)
    newest = _newest_per_position(ours)
    prev = head.floor
    for i, lk in enumerate(links):
        kind = _alone(head, tag, lk)
        if kind is not None:
            return Verdict(kind, i)
        assert lk is not None  # _alone names every row that is not ours
        if copies[lk.ident] > 1:
            return Verdict(Tamper.DUPLICATED, i)
        if newest[lk.pos] != lk.seq or (complete and lk.ident not in live):
            return Verdict(Tamper.REINSERTED_AFTER_POP, i)  # another item holds its place
        want = head.base + i
        if lk.pos > want:
            later = any(o is not None and o.pos == want for o in ours[i + 1 :])
            return Verdict(Tamper.SWAPPED if later else Tamper.DELETED, i)
        if lk.pos < want:
            return Verdict(Tamper.REINSERTED_AFTER_POP, i)
        if lk.prev != prev:
            # At its place, but written after another item than the one before it:
            # the one before is an item that was popped, put back in its successor's place.
            return Verdict(Tamper.REINSERTED_AFTER_POP, max(i - 1, 0))
        prev = lk.ident
    if len(rows) < head.count:
        return Verdict(Tamper.CUT_TAIL, len(rows))
    if prev != head.last:
        return Verdict(Tamper.REINSERTED_AFTER_POP, len(rows) - 1)
    return OK


def _alone(head: Head, tag: bytes, lk: Link | None) -> Tamper | None:
    """What is wrong with an item by its own authenticated link, if anything."""
    if lk is None:
        return Tamper.UNAUTHENTICATED
    if lk.tag != tag:
        return Tamper.MOVED
    if lk.epoch < head.epoch:
        return Tamper.REINSERTED_AFTER_CLEAR
    if lk.epoch > head.epoch or lk.seq > head.seq:
        return Tamper.ROLLED_BACK  # the head is older than an item it should cover
    if lk.pos < head.base:
        return Tamper.REINSERTED_AFTER_PURGE
    if lk.pos >= head.end:
        return Tamper.REINSERTED_AFTER_POP
    return None


def _newest_per_position(links: Sequence[Link | None]) -> dict[int, int]:
    """Each position's highest seq: an item at a position is written again only after
    the one before was popped, so only the newest there can be live."""
    newest: dict[int, int] = {}
    for lk in links:
        if lk is not None and newest.get(lk.pos, -1) < lk.seq:
            newest[lk.pos] = lk.seq
    return newest


def _headless(keys: Mapping[str, ChainKey], session_id: str, first: Row) -> Verdict:
    """A session with rows but no head: its first row moved from another session, or
    the head itself is missing (tampering either way)."""
    lk = _authentic(keys, first)
    key = _key(keys, crypto.kid_of(first[0]))
    if lk is not None and key is not None and lk.tag != session_tag(key.vault_id, session_id):
        return Verdict(Tamper.MOVED, 0)
    return Verdict(Tamper.UNAUTHENTICATED)
