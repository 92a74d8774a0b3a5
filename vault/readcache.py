"""An open session's read cache: each stored item decrypted once, then served from memory.

The runner reads the whole history before every turn, so without a cache every turn
decrypts every item again. An item's Fernet token never changes while the item is
stored (a rotation writes a new token), so the plaintext of a token that authenticated
once is kept under that token: a later read decrypts only tokens it has not seen.

What it does not change:
- Which rows are stored is read every time, in the read's own snapshot, by the engine
  (the file engine skips the unchanged prefix with the history chain's authenticated
  head: vault.engines.sqlite.chainsession). So pop, clear, purge, a rotation, a revoke
  and other processes' writes are seen as without the cache.
- The TTL is judged at every read, from the token's authenticated time, by Fernet's
  rules (`live`).
- Every read returns new objects (`json.loads` of the kept plaintext): a caller that
  mutates what it got never changes what the next read returns.

A read keeps only the tokens it met (`reading`), so the plaintext of an item popped,
cleared or purged leaves the cache at the session's next read; an expired token is
never decrypted, as Fernet refuses it first; `clear` drops everything (the session's
own pop and clear, and close). At most `MAX_ITEMS` are kept:
a longer history is read past that without keeping more. SECURITY.md, "The read cache".
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

from cryptography.fernet import Fernet, InvalidToken

from vault import crypto

# A bound on memory, not on speed: 50,000 items of a few KB each is a few hundred MB.
MAX_ITEMS = 50_000


class Kept(NamedTuple):
    """A decrypted item: its plaintext JSON text, stripped (empty: it authenticated but
    is no JSON item, which the SDK skips), and the token's authenticated time."""

    text: str
    stamp: int


# The C scanner behind json.loads, without its two Python frames: a kept text parsed once
# already (crypto.decode_item), so it is one JSON value with no whitespace around it.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def live(stamp: int, ttl: int | None, now: int) -> bool:
    """Whether Fernet would still open a token stamped `stamp` under `ttl` at `now`."""
    if ttl is None:
        return True
    return stamp + ttl >= now and now + crypto.MAX_CLOCK_SKEW >= stamp


def token_of(envelope: Any) -> str | None:
    """The Fernet token of an SDK envelope, or None for anything else."""
    if type(envelope) is dict and envelope.get("__enc__") == 1:
        token = envelope.get("payload")
        if type(token) is str:
            return token
    return None


class ReadCache:
    """The decrypted items of one open session, by token."""

    def __init__(self) -> None:
        self.max_items = MAX_ITEMS
        self._kept: dict[str, Kept] = {}
        self._met: set[str] | None = None  # the tokens a full read met so far
        self._guard = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def item(self, token: str, cipher: Fernet, ttl: int | None) -> tuple[bool, Any]:
        """(True, the item, or None when expired or no JSON item) for a token that is
        kept, or that authenticates under `cipher` now and is kept from here on;
        (False, None) when it does not authenticate: the caller opens it its own way."""
        kept = self._kept.get(token)
        if kept is None:
            return self._opened(token, cipher, ttl)
        if ttl is not None and not live(kept.stamp, ttl, int(time.time())):
            with self._guard:  # expired while kept: its plaintext goes now
                self._kept.pop(token, None)
            return True, None
        met = self._met  # inline, not _meet: this is the hot path, once per item read
        if met is not None:
            met.add(token)
        return True, (_scan(kept.text, 0)[0] if kept.text else None)

    def _opened(self, token: str, cipher: Fernet, ttl: int | None) -> tuple[bool, Any]:
        """`item` for a token not kept yet: judged, decrypted and kept."""
        try:
            stamp = crypto.token_time(token)
        except ValueError:
            return False, None
        if ttl is not None and not live(stamp, ttl, int(time.time())):
            return True, None  # refused before decrypting, as Fernet does: never kept
        try:
            plain = cipher.decrypt(token.encode("ascii", "replace"))
        except InvalidToken:
            return False, None
        try:
            text = plain.decode("utf-8")
            opened = json.loads(text)
            text = text.strip(" \t\n\r")  # JSON's own whitespace, for _scan
        except (ValueError, RecursionError):
            # Authenticated, yet no JSON item (as crypto.decode_item judges it): skipped,
            # as the SDK skips it.
            text, opened = "", None
        with self._guard:
            if len(self._kept) < self.max_items:
                self._kept[token] = Kept(text, stamp)
        self._meet(token)
        return True, opened

    def _meet(self, token: str) -> None:
        met = self._met
        if met is not None:
            met.add(token)

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around one read: what it did not meet is dropped, as no longer stored, or out
        of a limited read's window (a read that fails drops nothing)."""
        met: set[str] = set()
        self._met = met
        try:
            yield
        except BaseException:
            self._met = None
            raise
        with self._guard:
            if self._met is met:
                self._kept = {t: k for t, k in self._kept.items() if t in met}
                self._met = None

    def clear(self) -> None:
        with self._guard:
            self._kept = {}
            self._met = None


class CachedReads:
    """The read cache in an agent session (both engines' VaultSession): `_unwrap`, the
    EncryptedSession hook that opens each envelope read, looks in the cache first, and
    hands what it cannot open to `_open_envelope` (the session's own, uncached)."""

    cipher: Fernet
    ttl: int
    _reads: ReadCache | None = None

    @property
    def read_cache(self) -> bool:
        """Whether this session keeps what it decrypted (on by default); set it False to
        drop what is kept and decrypt every item on every read."""
        return self._reads is not None

    @read_cache.setter
    def read_cache(self, on: bool) -> None:
        if not on:
            self.forget_reads()
        self._reads = (self._reads if self._reads is not None else ReadCache()) if on else None

    def forget_reads(self) -> None:
        """Drop every kept plaintext (the session's own pop and clear, and close)."""
        if self._reads is not None:
            self._reads.clear()

    def _open_envelope(self, item: Any) -> Any:
        raise NotImplementedError

    def _unwrap(self, item: Any) -> Any:
        reads, token = self._reads, token_of(item)
        if reads is not None and token is not None:
            found, opened = reads.item(token, self.cipher, self.ttl)
            if found:
                return opened
        return self._open_envelope(item)

    def _reading(self) -> AbstractContextManager[None]:
        """The context of a read: it prunes the cache to what it met."""
        return self._reads.reading() if self._reads is not None else nullcontext()
