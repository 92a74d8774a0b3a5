"""A restore's leftovers beside the vault, and how the next open ends a cut-off one.

`vault.engines.sqlite.restore` makes a restore; this module is what every open of a vault
needs of it (two `lstat`s when there is nothing to do), kept apart so that
`vault.engines.sqlite.vault` can call it without importing the restore itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from vault import erase, files, paths

NEW_SUFFIX = ".restore-new"
OLD_SUFFIX = ".restore-old"


def state_names(live: Path) -> tuple[Path, Path]:
    """(the new copy, the replaced vault's second name) of a restore at `live`."""
    return live.with_name(live.name + NEW_SUFFIX), live.with_name(live.name + OLD_SUFFIX)


@contextlib.contextmanager
def folder_lock(folder: Path, wait: bool) -> Iterator[bool]:
    """An advisory lock on the vault's folder; yields whether it is held.

    False when another process holds it and `wait` is false, or the folder cannot be
    opened. Without flock (Windows) nothing is locked: yields `wait`, so a restore
    goes on and an open leaves a restore's files to the next restore.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover (Windows)
        yield wait
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def _same_file(a: Path, b: Path) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except FileNotFoundError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def destroy_with_sides(path: Path) -> None:
    """Overwrite and unlink a file and its SQLite side files (never following a link)."""
    for p in reversed(paths.sidecars(path)):
        with contextlib.suppress(FileNotFoundError):
            erase.destroy(p)


def finish(live: Path) -> str | None:
    """End a restore of `live` that was cut off; what was done, or None (nothing to do,
    or a restore is running). Two `lstat`s when there is nothing to do."""
    new, old = state_names(live)
    if not (os.path.lexists(new) or os.path.lexists(old)):
        return None
    with folder_lock(live.absolute().parent, wait=False) as mine:
        if not mine:
            return None  # a restore is running: it finishes its own work
        return finish_locked(live)


def finish_locked(live: Path) -> str | None:
    new, old = state_names(live)
    done = None
    if _same_file(new, live):
        # A restore into an empty path, cut off after linking its copy into place.
        os.unlink(new)
        done = "finished"
    elif os.path.lexists(new):
        # Cut off before the rename: the old vault is still the live one.
        if _same_file(old, live):
            os.unlink(old)  # only a second name of the live vault
        elif os.path.lexists(old) and not os.path.lexists(live):
            os.rename(old, live)  # moved aside (no hard links here): put back
        destroy_with_sides(new)
        done = "rolled back"
    elif os.path.lexists(old):
        if _same_file(old, live):
            os.unlink(old)
            done = "rolled back"
        elif os.path.lexists(live):
            destroy_with_sides(old)  # the restored vault is in place: the replaced one goes
            done = "finished"
        else:
            os.rename(old, live)  # the vault's name is empty: the old vault goes back
            done = "rolled back"
    files.fsync_dir(live.absolute().parent)
    return done
