"""The online rotation's row loop, written once above the engines.

A rotation that has switched (the vault's `kid` is the new key; its meta names the
old key in `rotating_from` and the last row id done in `rotation_progress`) moves
its rows in batches, each one:

1. read after the progress id, no lock held (a snapshot; in WAL mode writers go on);
2. re-encrypted from the old key to the new (timestamps kept), still with no lock:
   the cryptography is the slow part, and it never keeps a writer waiting;
3. written in one short transaction under the engine's write lock, each row only
   if it still holds the text read in 1 (a writer may have deleted it meanwhile),
   with the progress id in the same transaction, so a kill resumes after it;
4. followed by a short pause with the lock released: SQLite's busy handler is not
   first come, first served, and a waiting writer must get its turn.

Readers meanwhile open each row with the key its envelope names (`RotatingSealer`);
writers use the new key from the switch on (the guard refuses
the old one). Rows a batch skipped because they changed are found again by the
stragglers pass, which looks at every row still naming the old key.

What an engine provides is `RotationRows`; the key-journal steps around the loop
(record, switch, finish, retire) are each engine's (vault.engines.sqlite.filerotation,
vault.engines.postgres.rotate). PostgreSQL locks rows, not the database, so its writers
wait only for the batch rows they touch, and it needs no pause.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cryptography.fernet import Fernet

from vault import crypto, rotationworker, testhooks
from vault.files import Progress

if TYPE_CHECKING:
    from vault.rotationpool import Result

# (id, session_id, message_data)
Row = tuple[int, str, str]
# (new message_data, id, the message_data the row must still hold)
Update = tuple[str, int, str]

DEFAULT_BATCH = 2000
# With the lock released after each batch: long enough for a waiting writer's busy
# handler to find it free, short beside a batch's cryptography (tens of ms).
DEFAULT_PAUSE = 0.002
# Below this many rows a rotation stays in this process (vault.rotation.parallel).
PARALLEL_MIN_ROWS = 20_000
# After a batch's write, the lock stays free for at least this share of the time the
# write held it (where the engine pauses at all). A writer in another process waits in
# SQLite's busy handler, which tries again up to 100 ms apart: a lock free only for the
# few ms between two back-to-back batches (the workers keep the next one ready) is
# rarely seen free, and a writer's wait grew past a second in the bench.
PAUSE_SHARE = 0.5


class RotatingSealer(crypto.Sealer):
    """The key of a vault whose rows a rotation is moving: it seals under the new key
    and opens each row with the key its envelope names, the new one or the old one.

    Both stay readable until every row has moved (vault.rotation); a row's kid is read
    unauthenticated only to pick the key, which then authenticates the row.
    """

    def __init__(self, new_master_key: str, old: crypto.Sealer) -> None:
        super().__init__(new_master_key)
        self.old = old

    def __repr__(self) -> str:
        return f"<RotatingSealer kid={self.kid} from={self.old.kid}>"

    def for_kid(self, kid: str | None) -> crypto.Sealer | None:
        if kid == self.old.kid:
            return self.old
        return super().for_kid(kid)

    def reader(self, session_id: str, message_data: str) -> Fernet:
        if crypto.kid_of(message_data) == self.old.kid:
            return self.old.fernet(session_id)
        return self.fernet(session_id)


class RotationRows(Protocol):
    """What the loop needs from an engine."""

    def read_rows(self, after: int, limit: int, naming: str | None = None) -> list[Row]:
        """At most `limit` rows with id > `after`, in id order, read with no write lock
        held; with `naming`, only rows whose text contains it."""
        ...

    def write_rows(
        self, old_kid: str, new_kid: str, updates: list[Update], progress: int | None
    ) -> int | None:
        """Under the write lock, in one transaction: each update applied only where the
        row still holds its old text, and the progress id set (unless None). Returns the
        rows written, or None, writing nothing, when the vault no longer rotates from
        `old_kid` to `new_kid` (another process finished this rotation)."""
        ...


@dataclass
class Moved:
    sessions: set[str] = field(default_factory=set)
    items: int = 0
    expired: int = 0
    unreadable: int = 0
    stragglers: int = 0
    superseded: bool = False  # another process finished the rotation meanwhile

    def counts(self) -> dict[str, int]:
        return {
            "sessions": len(self.sessions),
            "items": self.items,
            "expired": self.expired,
            "unreadable": self.unreadable,
            "stragglers": self.stragglers,
        }


def move_rows(
    rows: RotationRows,
    old: crypto.Sealer,
    new: crypto.Sealer,
    start: int,
    ttl: int | None,
    progress: Progress | None = None,
    batch: int = DEFAULT_BATCH,
    pause: float = DEFAULT_PAUSE,
    *,
    step: str = "after-batch",
    sweep: bool = False,
    rows_left: int = 0,
) -> Moved:
    """Move every row under `old` after id `start` to `new`, then the stragglers.

    `step` names the failpoint reached after each batch; `sweep` looks for stragglers
    even when no batch skipped a row (an engine whose writers are other hosts).
    `rows_left` (at most how many rows follow `start`; 0 when unknown) decides whether
    worker processes do the cryptography (`parallel`)."""
    cutoff = None if ttl is None else int(time.time()) - ttl
    moved = Moved()
    last, missed = start, 0
    with _encrypter(old, new, rows_left) as encrypt:
        # Pipelined: batch N+1 is read and handed to the workers before batch N is
        # collected and written, so the workers encrypt while this thread does the I/O.
        pending: tuple[list[Row], Encrypted] | None = None
        lock = _Turns(PAUSE_SHARE if pause > 0 else 0.0)
        while True:
            found = rows.read_rows(last, batch)
            if found:
                last = found[-1][0]
            ahead = (found, encrypt(found)) if found else None
            if pending is not None:
                done = _write(rows, old, new, *pending, cutoff, moved, lock)
                if done is None:
                    moved.superseded = True
                    return moved
                missed += done
                if progress:
                    progress(len(pending[0]))
                testhooks.failpoint(step)
                time.sleep(pause)
            if ahead is None:
                break
            pending = ahead
    if missed or start or sweep:
        # A full scan, so only when a batch skipped a row, or an earlier run's did.
        moved.stragglers = _stragglers(rows, old, new, batch, pause, moved)
    return moved


# A call that waits for a batch's `rotationworker.rotate_row` results, in row order.
Encrypted = Callable[[], "Result"]


@contextlib.contextmanager
def _encrypter(
    old: crypto.Sealer, new: crypto.Sealer, rows_left: int
) -> Iterator[Callable[[list[Row]], Encrypted]]:
    """A function that starts re-encrypting a batch: in worker processes when
    `parallel` says so, else here, at once."""
    workers = parallel(rows_left)
    pool = None
    if workers:
        from vault import rotationpool  # here: its imports cost every command ~30 ms

        # No worker could start (no interpreter to run, no process left): all here.
        with contextlib.suppress(OSError):
            pool = rotationpool.Pool(old, new, workers)

    def encrypt(found: list[Row]) -> Encrypted:
        if pool is None:
            out = [rotationworker.rotate_row(old, new, sid, data) for _id, sid, data in found]
            return lambda: out
        futures = pool.submit([(sid, data) for _id, sid, data in found])
        return lambda: [r for f in futures for r in f.result()]

    try:
        yield encrypt
    finally:
        if pool is not None:
            pool.close()


def parallel(rows_left: int) -> int:
    """How many worker processes a rotation of `rows_left` rows starts: none for a small
    vault (starting the workers would cost more than they save) or on one core; else
    one per core."""
    if rows_left < PARALLEL_MIN_ROWS:
        return 0
    from vault import rotationpool

    n = rotationpool.cores()
    return n if n > 1 else 0


@dataclass
class _Turns:
    """When the rotation's last write let go of the lock, and how long it held it."""

    share: float
    held: float = 0.0
    freed: float = 0.0

    def write(self, rows: RotationRows, *args: Any) -> int | None:
        time.sleep(max(0.0, self.freed + self.held * self.share - time.monotonic()))
        start = time.monotonic()
        written = rows.write_rows(*args)
        self.freed = time.monotonic()
        self.held = self.freed - start
        return written


def _write(
    rows: RotationRows,
    old: crypto.Sealer,
    new: crypto.Sealer,
    found: list[Row],
    encrypted: Encrypted,
    cutoff: int | None,
    moved: Moved,
    lock: _Turns,
) -> int | None:
    """Write one batch; the rows it skipped because they changed meanwhile, or None when
    another process finished the rotation."""
    updates: list[Update] = []
    for (row_id, sid, data), done in zip(found, encrypted(), strict=True):
        moved.sessions.add(sid)
        if done == rotationworker.UNREADABLE:
            moved.unreadable += 1  # kept as it is: a rotation deletes nothing
            continue
        if isinstance(done, int):
            continue  # written under the new key since the switch
        moved.items += 1
        if cutoff is not None and done[1] < cutoff:
            moved.expired += 1
        updates.append((done[0], row_id, data))
    written = lock.write(rows, old.kid, new.kid, updates, found[-1][0])
    if written is None:
        return None
    moved.items -= len(updates) - written  # changed meanwhile: the stragglers' now
    return len(updates) - written


def _stragglers(
    rows: RotationRows,
    old: crypto.Sealer,
    new: crypto.Sealer,
    batch: int,
    pause: float,
    moved: Moved,
) -> int:
    """Rows still under the old key anywhere: those a batch skipped (changed between its
    read and its write), or that a resumed rotation's earlier batches left. Unreadable
    rows under the old key stay as they are (counted by the batches already)."""
    done, last = 0, 0
    while True:
        found = rows.read_rows(last, batch, naming=old.kid)
        if not found:
            return done
        last = found[-1][0]
        updates: list[Update] = []
        for row_id, sid, data in found:
            if crypto.kid_of(data) != old.kid:
                continue  # the kid inside some other text: not an envelope under it
            stamped = crypto.rotate_row_stamped(old, new, sid, data)
            if stamped is not None:
                updates.append((stamped[0], row_id, data))
        if updates:
            written = rows.write_rows(old.kid, new.kid, updates, None)
            if written is None:
                moved.superseded = True
                return done
            done += written
            time.sleep(pause)
