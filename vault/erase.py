"""The one overwrite-and-unlink: what memvault destroys, it overwrites first.

A regular file is overwritten in place (header, then zeros) and fsynced before it
is unlinked; a link, FIFO or device is unlinked without being opened or followed.
`remove_stale_temps` applies it to what killed writers left (vault.files names
and recognises those leftovers).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vault import files
from vault.files import Progress


def overwrite(path: Path, header: bytes = b"", progress: Progress | None = None) -> int | None:
    """Overwrite a regular file in place with `header` then zeros, and fsync it.

    Returns its size, or None when `path` is missing or not a regular file (a link
    is never followed, a FIFO or device never opened).
    """
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(before.st_mode):
        return None
    # Without O_NOFOLLOW (Windows) a link swapped in after the lstat would be followed:
    # the fstat identity check below then refuses to write (the target is another
    # file), so the one race left is the open itself (no FIFO or device exists there
    # to be opened by accident; Ofiles.NONBLOCK keeps a FIFO from blocking elsewhere).
    fd = os.open(path, os.O_RDWR | files.nofollow() | files.NONBLOCK | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (
            before.st_dev,
            before.st_ino,
        ):
            raise OSError(errno.EAGAIN, "the file was replaced while being shredded", str(path))
        size = st.st_size
        head = header[:size]
        files.write_all(fd, head)
        done = len(head)
        if progress:
            progress(done)
        chunk = bytes(1 << 20)
        while done < size:
            n = os.write(fd, chunk[: min(len(chunk), size - done)])
            done += n
            if progress:
                progress(n)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size


def destroy(
    path: Path, header: bytes = b"", progress: Progress | None = None
) -> dict[str, Any] | None:
    """Overwrite then unlink a regular file; unlink any other entry without opening it.

    A symbolic link is removed, never followed: its target is left untouched. A
    folder is refused (IsADirectoryError). Returns {"name", "size", "kind"}, or None
    when nothing was there. The caller fsyncs the folder.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "a folder is in the way", str(path))
    size = overwrite(path, header, progress) if stat.S_ISREG(mode) else None
    os.unlink(path)
    return {"name": path.name, "size": size or 0, "kind": files.kind(mode)}


def remove_stale_temps(
    folder: Path,
    tag: str,
    looks_ours: Callable[[bytes], bool],
    names: Callable[[Path], list[Path]] = lambda p: [p],
) -> list[dict[str, Any]]:
    """Overwrite and unlink what killed writers of kind `tag` left in `folder`: for each,
    the `names` it stands for (`paths.sidecars` adds the files SQLite kept beside it).

    Returns what was destroyed, as `destroy` reports it.
    """
    removed = []
    for path, _token, st in files.stale_temps(folder, tag, looks_ours):
        if st.st_nlink > 1:
            continue  # a file with another name is not only ours: left alone
        for name in names(path):
            with contextlib.suppress(OSError):
                entry = destroy(name)
                if entry:
                    removed.append(entry)
    if removed:
        files.fsync_dir(folder)
    return removed
