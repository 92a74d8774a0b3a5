"""A session of a vault as the engines will keep it, in memory: real envelopes
(vault.crypto) and real links (vault.chain), maintained by the chain's pure
functions on every operation, with what each removal took kept for the attacks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from vault import chain, crypto
from vault.chaincheck import Row

VAULT_ID = "0123456789abcdef0123456789abcdef"
_counter = itertools.count()


@dataclass
class Session:
    session_id: str
    sealer: crypto.Sealer
    keys: dict[str, chain.ChainKey]  # every chain key this vault ever had, by kid
    vault_id: str = VAULT_ID
    rows: list[Row] = field(default_factory=list)
    head: chain.Head | None = None
    popped: list[Row] = field(default_factory=list)
    cleared: list[Row] = field(default_factory=list)
    purged: list[Row] = field(default_factory=list)
    snapshots: list[tuple[list[Row], chain.Head | None]] = field(default_factory=list)

    @classmethod
    def new(cls, session_id: str = "s", master: str | None = None) -> Session:
        sealer = crypto.Sealer(master or crypto.generate_key())
        key = chain.chain_key(sealer.master_key, VAULT_ID)
        return cls(session_id, sealer, {key.kid: key})

    @property
    def key(self) -> chain.ChainKey:
        return self.keys[self.sealer.kid]

    def _snap(self) -> None:
        self.snapshots.append((list(self.rows), self.head))

    def _head(self) -> chain.Head:
        return self.head or chain.new_head(self.key, self.session_id)

    def add(self, n: int) -> None:
        self._snap()
        texts = [self.sealer.seal(self.session_id, {"n": next(_counter)}) for _ in range(n)]
        links, self.head = chain.extend(self.key, self.session_id, self._head(), texts)
        self.rows += [(t, lk.encode()) for t, lk in zip(texts, links, strict=True)]

    def pop(self) -> None:
        if not self.rows:
            return
        self._snap()
        text, raw = self.rows[-1]
        popped = chain.Link.decode(raw)
        assert popped is not None
        self.head = chain.pop(self.key, self.session_id, self._head(), popped, text)
        self.popped.append(self.rows.pop())

    def clear(self) -> None:
        self._snap()
        self.head = chain.clear(self.key, self.session_id, self._head())
        self.cleared += self.rows
        self.rows = []

    def purge(self, n: int) -> None:
        n = min(n, len(self.rows))
        if n == 0:
            return
        self._snap()
        text, raw = self.rows[n - 1]
        last = chain.Link.decode(raw)
        assert last is not None
        self.head = chain.purge(self.key, self.session_id, self._head(), last, text)
        self.purged += self.rows[:n]
        del self.rows[:n]

    def rotate(self) -> None:
        """Every row re-encrypted (crypto.rotate_row_stamped) and re-MACed, in any order."""
        self._snap()
        new = crypto.Sealer(crypto.generate_key())
        new_key = chain.chain_key(new.master_key, self.vault_id)
        self.keys[new_key.kid] = new_key
        moved: list[Row] = []
        for text, raw in reversed(self.rows):  # order does not matter: no cascade
            stamped = crypto.rotate_row_stamped(self.sealer, new, self.session_id, text)
            link = chain.Link.decode(raw)
            assert stamped is not None and link is not None
            relinked = chain.remac(self.key, new_key, link, text, stamped[0])
            assert relinked is not None
            moved.append((stamped[0], relinked.encode()))
        self.rows = moved[::-1]
        if self.head is not None:
            self.head = chain.remac_head(self.key, new_key, self.session_id, self.head)
        self.sealer = new

    def apply(self, op: tuple[Any, ...]) -> None:
        getattr(self, op[0])(*op[1:])
