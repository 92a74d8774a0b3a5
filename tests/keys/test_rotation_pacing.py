"""Between two of the rotation's writes the lock stays free for a share of the time the
first held it, so that a writer in another process, polling from SQLite's busy handler,
finds it free. The rule, checked on the loop's own calls (no wall time judged); what
it buys is the bench's figure of a writer's longest wait."""

from __future__ import annotations

import time

from tests.keys.test_rotation_loop import NEW, OLD, Rows
from vault import rotation

HOLD = 0.03


class SlowRows(Rows):
    """Rows whose every write holds "the lock" for HOLD seconds; when each began and ended."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.writes: list[tuple[float, float]] = []

    def write_rows(self, *args: object) -> int | None:
        start = time.monotonic()
        time.sleep(HOLD)
        written = super().write_rows(*args)  # type: ignore[arg-type]
        self.writes.append((start, time.monotonic()))
        return written


def test_the_lock_stays_free_between_batches_for_a_share_of_its_last_hold() -> None:
    rows = SlowRows(40)
    moved = rotation.move_rows(rows, OLD, NEW, 0, None, batch=5, pause=0.001)
    assert moved.items == 40 and len(rows.writes) == 8
    for (_s, end), (start, _e) in zip(rows.writes, rows.writes[1:], strict=False):
        assert start - end >= HOLD * rotation.PAUSE_SHARE
