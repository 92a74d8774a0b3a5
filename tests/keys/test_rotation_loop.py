"""vault.rotation's loop, over rows held in memory: the failure paths an engine rarely
shows (a row changed between a batch's read and its write, a rotation another process
ended, a run resumed after another's kill). The file vault's own tests run the same
loop on real files (tests/keys/test_online_rotation.py, the crash campaign)."""

from __future__ import annotations

from collections.abc import Callable

from vault import crypto, rotation

OLD = crypto.Sealer(crypto.generate_key())
NEW = crypto.Sealer(crypto.generate_key())


class Rows:
    """`RotationRows` over a dict; `before_write` runs once, as a writer would between a
    batch's read and its write."""

    def __init__(self, n: int) -> None:
        self.data = {i: ("s", OLD.seal("s", {"n": i})) for i in range(1, n + 1)}
        self.rotating = True
        self.progress = 0
        self.before_write: Callable[[], None] | None = None

    def read_rows(self, after: int, limit: int, naming: str | None = None) -> list[rotation.Row]:
        found = [
            (i, sid, text)
            for i, (sid, text) in sorted(self.data.items())
            if i > after and (naming is None or naming in text)
        ]
        return found[:limit]

    def write_rows(
        self, old_kid: str, new_kid: str, updates: list[rotation.Update], progress: int | None
    ) -> int | None:
        hook, self.before_write = self.before_write, None
        if hook is not None:
            hook()
        if not self.rotating:
            return None
        written = 0
        for text, row_id, was in updates:
            if row_id in self.data and self.data[row_id][1] == was:
                self.data[row_id] = (self.data[row_id][0], text)
                written += 1
        if progress is not None:
            self.progress = progress
        return written

    def kids(self) -> set[str | None]:
        return {crypto.kid_of(text) for _, text in self.data.values()}


def opened(rows: Rows) -> list[object]:
    return [NEW.open(sid, text, None).item for _, (sid, text) in sorted(rows.data.items())]


def test_a_row_changed_between_read_and_write_is_moved_by_the_stragglers_pass() -> None:
    rows = Rows(10)

    def writer() -> None:  # the row is rewritten (still under the old key) meanwhile
        rows.data[2] = ("s", OLD.seal("s", {"n": 2, "edited": True}))

    rows.before_write = writer
    moved = rotation.move_rows(rows, OLD, NEW, 0, None, batch=4, pause=0)
    assert rows.kids() == {NEW.kid}
    assert moved.stragglers == 1 and moved.items == 9 and not moved.superseded
    assert opened(rows)[1] == {"n": 2, "edited": True}


def test_a_deleted_row_is_skipped_and_nothing_else_is_lost() -> None:
    rows = Rows(10)
    rows.before_write = lambda: rows.data.pop(3)
    moved = rotation.move_rows(rows, OLD, NEW, 0, None, batch=4, pause=0)
    assert rows.kids() == {NEW.kid} and len(rows.data) == 9
    assert moved.items == 9 and moved.stragglers == 0
    assert opened(rows) == [{"n": i} for i in range(1, 11) if i != 3]


def test_a_rotation_another_process_ended_stops_writing() -> None:
    rows = Rows(10)

    def ended() -> None:
        rows.rotating = False

    rows.before_write = ended
    moved = rotation.move_rows(rows, OLD, NEW, 0, None, batch=4, pause=0)
    assert moved.superseded
    assert rows.kids() == {OLD.kid}  # nothing written after the end


def test_a_resumed_run_starts_after_the_progress_and_then_looks_at_every_row() -> None:
    rows = Rows(10)
    rows.progress = 6  # an earlier run's batches got this far; it skipped row 2
    for i in (1, 3, 4, 5, 6):
        rows.data[i] = ("s", crypto.rotate_row_stamped(OLD, NEW, "s", rows.data[i][1])[0])  # type: ignore[index]
    moved = rotation.move_rows(rows, OLD, NEW, rows.progress, None, batch=4, pause=0)
    assert moved.items == 4 and moved.stragglers == 1
    assert rows.kids() == {NEW.kid} and rows.progress == 10
    assert opened(rows) == [{"n": i} for i in range(1, 11)]


def test_unreadable_rows_under_the_old_key_stay_and_are_counted_once() -> None:
    rows = Rows(6)
    text = rows.data[4][1]
    rows.data[4] = ("s", text[:-8] + "AAAAAA" + text[-2:])  # the token no longer authenticates
    moved = rotation.move_rows(rows, OLD, NEW, 0, None, batch=4, pause=0)
    assert moved.unreadable == 1 and moved.items == 5 and moved.stragglers == 0
    assert crypto.kid_of(rows.data[4][1]) == OLD.kid
