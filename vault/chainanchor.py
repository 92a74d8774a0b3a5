"""The anchor: the newest vault head (vault.chainvault) seen of a vault, kept outside
its file, in the keyring entry `<vault_id>/anchor` beside its keys.

A file put back whole from an older copy is consistent with itself; only a record
kept elsewhere tells it. The anchor holds a `Point` (the vault head's `seq` and
`digest`), nothing secret: a file whose head is behind it, or at its `seq` with
another digest, was rolled back. It only moves forward: `restore`, and `accept` of
a file put back by hand, write a vault head past it, which it then moves to. It is
written after the write it records has committed, so that a kill between the two
leaves it behind the file (a window, never a false alarm). Who moves it:
vault.engines.sqlite.anchoring; how a process judges by it: vault.chainfloor.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

from vault.chain import MAC_BYTES, count_of, hex_text, unhex
from vault.chainfloor import Entry, Floor
from vault.chainvault import ZERO, Point

ANCHOR_VERSION = "a1"
# What the anchor holds from the moment a vault's history is chained (its creation, or
# the end of the upgrade's build) until a vault head is recorded: its presence alone
# says the file must be chained, which a file can no longer say of itself once someone
# rewrote it as an unchained one.
CHAINED = Point(0, ZERO)


# How often `advance` reads again after another host recorded first.
RACE_TRIES = 5
# The mark of an anchor in a key source the vault's keys moved away from (`leave`).
LEFT = "left"
# The mark of an anchor whose recorded history a process found the file had left: a
# file put back, then written on by a process that had not seen the state recorded
# (`Forked`). No vault head passes it until `restore` or `accept`.
FORKED = "forked"
LOCK_NAME = "anchor.lock"  # in the user's cache folder: this host's turn to record


class Raced(Exception):
    """A store's `set` found the entry changed since it was read (the key service's
    check-and-set): another process recorded first."""


class Forked(Exception):
    """The anchor holds a point at a `seq` where this process saw the file hold another
    one: the file it is about to record went on from an older state than the anchor's
    (`advance`). The anchor is marked (`FORKED`), not moved."""


class Store(Protocol):
    """What the anchor needs of a keyring (vault.keys.KeyStore), or of the key service
    (vault.keysource.transitanchor.ServiceAnchor, whose `set` may raise `Raced`)."""

    def get(self, name: str) -> str | None: ...

    def set(self, name: str, key: str) -> None: ...

    def delete(self, name: str) -> bool: ...


def entry_name(vault_id: str) -> str:
    return f"{vault_id}/anchor"


def encode(point: Point, *, left: bool = False, forked: bool = False, lifts: int = 0) -> str:
    parts = [ANCHOR_VERSION, str(point.seq), hex_text(point.digest)]
    parts += [f"l{lifts}"] if lifts else []
    parts += [LEFT] if left else [FORKED] if forked else []
    return ".".join(parts)


def _encoded(entry: Entry) -> str:
    return encode(entry.point, left=entry.left, forked=entry.forked, lifts=entry.lifts)


def _parse(text: str) -> Entry:
    parts = text.split(".")
    if len(parts) < 3 or parts[0] != ANCHOR_VERSION:
        raise ValueError("not an anchor")
    seq, digest = count_of(parts[1]), unhex(parts[2])
    if len(digest) != MAC_BYTES:
        raise ValueError("not an anchor")
    rest, lifts = parts[3:], 0
    if rest and rest[0].startswith("l") and rest[0] != LEFT:
        lifts = count_of(rest.pop(0)[1:])
        if lifts == 0:
            raise ValueError("not an anchor")  # one spelling only: no lift count is none
    mark = rest.pop(0) if rest else None
    if rest or mark not in (None, LEFT, FORKED):
        raise ValueError("not an anchor")
    return Entry(Point(seq, digest), left=mark == LEFT, forked=mark == FORKED, lifts=lifts)


def _held(text: str | None) -> Entry | None:
    """What an entry holds, for a writer: one memvault did not write is written over, as
    every reader takes it for no anchor yet (vault.engines.sqlite.anchoring.floor_for)."""
    try:
        return None if text is None else _parse(text)
    except ValueError:
        return None


def decode(text: str) -> Point:
    """The point an anchor entry holds, marked or not. ValueError for one memvault did
    not write."""
    return _parse(text).point


def read(store: Store, vault_id: str) -> Point | None:
    """The vault's anchor, or None before its first one."""
    text = store.get(entry_name(vault_id))
    return None if text is None else decode(text)


def floor(store: Store, vault_id: str, *, named: bool = True, source: str | None = None) -> Floor:
    """The live file's floor: the anchor as it is now (none yet: a floor that passes the
    first point it is shown). `named`: whether the file still names the source `store`
    is; a left mark is about such a file only (a process may have chosen its source
    before a `key move` left it). `source`: that key source, which the file must go on
    naming to be judged by this floor. ValueError for an entry memvault did not write."""
    text = store.get(entry_name(vault_id))
    if text is None:
        return Floor(source=source)
    held = _parse(text)
    return Floor(
        held.point, left=held.left and named, forked=held.forked, lifts=held.lifts, source=source
    )


def advance(
    store: Store,
    vault_id: str,
    point: Point | Callable[[], Point | None],
    *,
    lifted: bool = False,
    held: bool | Callable[[], bool] = False,
    seen: Floor | None = None,
) -> Point | None:
    """Record `point` as the newest state seen, and return what the anchor holds now:
    a point behind the stored one leaves it as it is (another process saw a newer
    state). Nothing moves it back: `restore` and `accept` write a vault head past it,
    and only they (`lifted`) write over a left or forked mark. `held`: only an anchor
    that exists moves (None: there is none), for a file whose rows say it is revoked or
    being shredded: revoke and shred `forget` the anchor before the keys, so one still
    there is a mark not (yet) acted on, and one gone is not written again. A callable
    `held` is asked inside the turn: a mark committed while this waited for the turn,
    whose revoke forgot the anchor in the turn before, is seen. `seen`: the
    recording process's floor; an anchor at a `seq` where it saw the file hold another
    point is marked forked, so is `seen`, and `Forked` raised: the file went on from an older state
    than the one recorded, which a `seq` past the anchor's would otherwise launder.
    A callable `point` is the file's state read inside the turn (None: nothing to
    record, and None is returned): a state read before another process's `accept`,
    of the history it put aside, would be written over the lifted anchor, and every
    process would then report the file taken on purpose as rolled back.
    A keyring has no check-and-set: this host's processes take turns (`this_hosts_turn`).
    The key service's set is check-and-set, read again on a race with another host."""
    with this_hosts_turn():
        for _ in range(RACE_TRIES):
            # The file first, then its marks and the entry: each read after the one before.
            now = point() if callable(point) else point  # again after a race: it may move
            if now is None:
                return None
            marked = held() if callable(held) else held
            entry = _held(store.get(entry_name(vault_id)))
            if entry is None:
                if marked:
                    return None
                after = Entry(now, lifts=int(lifted))
            elif not lifted and seen is not None and seen.contradicts(entry):
                after = Entry(entry.point, forked=True, lifts=entry.lifts)
            elif now.seq <= entry.point.seq or ((entry.left or entry.forked) and not lifted):
                return entry.point
            else:
                after = Entry(now, lifts=entry.lifts + lifted)
            try:
                store.set(entry_name(vault_id), _encoded(after))
            except Raced:
                continue
            if after.forked and seen is not None:
                seen.fork()  # the recording process reads and writes the file no more
                raise Forked(vault_id)
            if seen is not None:
                seen.relifted(after.lifts)
            return now
        return read(store, vault_id)  # still racing: the others' points stand


@contextlib.contextmanager
def this_hosts_turn() -> Iterator[None]:
    """One process of this user on this host at a time reads and sets an anchor: an
    exclusive flock on `anchor.lock` in the user's cache folder. Waited for up to the
    keyring's deadline; not to be had (no flock, no folder, or the wait ran out), the
    caller goes on unlocked, and the races the turn closes are open again."""
    import platformdirs

    from vault import files, paths
    from vault.keys import keyring_timeout

    folder = platformdirs.user_cache_path(paths.APP_NAME, appauthor=False)
    try:
        paths.ensure_private_folder(folder)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | files.nofollow(), 0o600)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + keyring_timeout()
        while not files.try_lock(fd) and time.monotonic() < deadline:
            time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def replace(store: Store, vault_id: str, point: Point | None) -> None:
    """Set the anchor to `point` whatever it holds, or delete it (None): `key move`,
    before its switch, gives the source it moves to exactly the anchor of the one it
    leaves. No process records into a source before the vault's keys are there, so
    what it held is from an earlier stay, which a restore since may have left behind."""
    if point is None:
        forget(store, vault_id)
        return
    for _ in range(RACE_TRIES):
        store.get(entry_name(vault_id))  # the version a check-and-set write is against
        try:
            store.set(entry_name(vault_id), encode(point))
        except Raced:
            continue
        return


def leave(store: Store, vault_id: str) -> None:
    """Mark the anchor in a key source the vault's keys have just moved away from (`key
    move`, after recording the switch's point there). A file that still names that
    source is a copy from before the move, whatever its point: its key source and
    wrapped keys are meta rows no MAC covers, so one from a later state given them back
    would otherwise be judged by the point the move left there, which it passes. A
    move back replaces the mark (`replace`); `restore` and `accept` clear it on purpose
    (`advance` past it)."""
    for _ in range(RACE_TRIES):
        # Nothing recorded there (the move's record did not get through), or only an
        # entry memvault did not write: nothing to mark, a window as before the move.
        entry = _held(store.get(entry_name(vault_id)))
        if entry is None or entry.left or entry.forked:
            return
        try:
            store.set(entry_name(vault_id), encode(entry.point, left=True, lifts=entry.lifts))
        except Raced:
            continue
        return


def forget(store: Store, vault_id: str) -> bool:
    """Delete the anchor (shred and revoke destroy the vault's entries), in this host's
    turn: an `advance(held=True)` that found it is not let write it again after."""
    with this_hosts_turn():
        return store.delete(entry_name(vault_id))


def mark_chained(store: Store, vault_id: str) -> None:
    """Record that this vault's history is chained (kept if an anchor is already there)."""
    advance(store, vault_id, CHAINED)


@runtime_checkable
class Listing(Protocol):
    """A store that lists the vaults it anchors (the key service, per transit key)."""

    def vault_ids(self) -> list[str]: ...


def is_chained(store: Store, vault_id: str) -> bool:
    """Whether an anchor says this vault's history was chained: an unchained file of it
    was then put back from an older copy, or rewritten. Where the store lists the vaults
    of one transit key, another vault's anchor there says so too: a transit vault's
    `vault_id` is bound to no key (a keyring's entries are named by it), so a file
    rewritten with a fresh one would otherwise find no anchor and get linked."""
    if store.get(entry_name(vault_id)) is not None:
        return True
    if isinstance(store, Listing):
        others = (v for v in store.vault_ids() if v != vault_id)
        return any(store.get(entry_name(v)) is not None for v in others)
    return False
