"""An open agent session's part in the anchor (vault.chainanchor): it records the
vault's state outside the file when it closes, and after a write once `anchor_every`
seconds have passed since it last did (both engines; PostgreSQL keeps no anchor yet,
so there it records nothing).

A file put back from an older copy is told by the anchor only as far as the anchor
has been moved: what a session wrote since its last record is the window a rollback
can hide in. `anchor_every = 0` records after every write (a keyring write each, a
few milliseconds); the default keeps that to one per minute. SECURITY.md, "Rollback".
"""

from __future__ import annotations

import time
from typing import Protocol

# Seconds between two records of a writing session (issue: "at least every 60 s").
ANCHOR_EVERY = 60.0


class _Anchors(Protocol):
    def record_anchor(self) -> object: ...


class AnchorClock:
    """A base of the agent session: `anchor_every` is per session, settable."""

    anchor_every: float = ANCHOR_EVERY
    _anchored_at: float | None = None  # None: not yet; the first write records
    _vault: _Anchors

    async def _wrote(self) -> None:
        """After a write that committed: record the anchor if it is due."""
        now = time.monotonic()
        if self._anchored_at is not None and now - self._anchored_at < self.anchor_every:
            return
        self._anchored_at = now
        import asyncio  # here: `vault` is imported by every command, few run a session

        await asyncio.to_thread(self._vault.record_anchor)

    def _anchor_at_close(self) -> None:
        self._vault.record_anchor()
