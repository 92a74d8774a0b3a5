"""What a process knows of its vault file's anchor (vault.chainanchor): the entry's
parts (`Entry`) and the floor (`Floor`) every vault head this process reads is judged
against. Pure: no store, no file.
"""

from __future__ import annotations

import hmac as _hmac
import threading
from dataclasses import dataclass

from vault.chainvault import Point, behind

# How many of the vault heads it has seen a process keeps to judge the anchor by.
SEEN_MAX = 4096


@dataclass(frozen=True)
class Entry:
    """What an anchor entry holds: the point; `left` (`leave`) or `forked` marks; and
    `lifts`, how many times `restore` or `accept` have put the file past it on purpose
    (a process that saw the file before a lift does not judge it by what it saw)."""

    point: Point
    left: bool = False
    forked: bool = False
    lifts: int = 0


class Floor:
    """The newest point a process knows its vault file reached: the anchor as read when
    the key was loaded, raised by every vault head the process has since found matching
    its heads. A vault head behind it is a file put back from an older copy, including
    under a session that is open (its floor is then past the anchor).

    `exact`: a backup's, its own sealed point (it never takes a write), which its vault
    head must equal. `left`: the anchor of a key source the vault's keys moved away from
    (`leave`); `forked`: an anchor marked so (`advance`); no vault head passes either
    until `lift`. It keeps the points it passed (at most SEEN_MAX, by `seq`), to tell
    an anchor recorded of another history (`contradicts`), and the anchor's lift count
    when they were seen (`lifts`)."""

    def __init__(
        self,
        point: Point | None = None,
        *,
        exact: bool = False,
        left: bool = False,
        forked: bool = False,
        lifts: int = 0,
        source: str | None = None,
    ) -> None:
        self.point = point
        self.exact = exact
        self.left = left
        self.forked = forked
        self.lifts = lifts
        self.source = source  # the key source it was read through (vaulthead.store_source)
        self._seen: dict[int, bytes] = {}
        self._guard = threading.Lock()  # the SDK's reads run in worker threads

    def passes(self, point: Point) -> bool:
        """Whether a vault head at `point`, authentic and matching its heads, is not
        older than the floor; the floor moves up to it."""
        with self._guard:
            stopped = self.left or self.forked  # keys left the source the file names, or forked
            if self.exact:  # a backup's: its own point (None: made before seals were)
                return not stopped and (self.point is None or point == self.point)
            if stopped or (self.point is not None and behind(point, self.point)):
                return False
            self._saw(point)
            return True

    def _saw(self, point: Point) -> None:
        self.point = point
        self._seen.pop(point.seq, None)  # re-inserted last: the oldest sightings go first
        self._seen[point.seq] = point.digest
        if len(self._seen) > SEEN_MAX:
            del self._seen[next(iter(self._seen))]

    def contradicts(self, held: Entry) -> bool:
        """Whether the anchor `held` is at a `seq` where this process saw the file hold
        another point: one history has one point at each `seq`. Not after a lift this
        process did not see: what it saw before may be of a history put aside on purpose."""
        with self._guard:
            if held.lifts != self.lifts:
                self._seen.clear()
                self.lifts = held.lifts
                return False
            digest = self._seen.get(held.point.seq)
            return digest is not None and not _hmac.compare_digest(digest, held.point.digest)

    def fork(self) -> None:
        """This process found the file left the recorded history (`advance`)."""
        with self._guard:
            self.forked = True

    def relifted(self, lifts: int) -> None:
        """The anchor's lift count after this process's own record (`advance`): a lift
        of its own has put aside what it saw already (`lift`)."""
        with self._guard:
            self.lifts = lifts

    def lift(self, point: Point) -> None:
        """The file was put at `point`, past the anchor, on purpose (`restore`, `accept`):
        the floor from there, a left or forked mark cleared, what was seen before put aside."""
        with self._guard:
            self.left = self.forked = False
            self._seen.clear()
            self._saw(point)
