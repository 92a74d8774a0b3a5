"""The few ways memvault touches files outside SQLite, each written once.

A name beside the vault (`history.db-wal`, a receipt, a kit) may be a symbolic
link, a FIFO or a device that someone planted. Nothing here follows a link or
opens anything but a regular file: a private file is created with O_NOFOLLOW
(or renamed into place), a file to destroy is checked with `lstat` and opened
with O_NOFOLLOW, and a vault path is checked with `stat` before SQLite opens it
(opening a FIFO would block for ever).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from vault.errors import BadInput, NotAVault

NONBLOCK = getattr(os, "ONONBLOCK", 0)  # a FIFO swapped in after lstat must not block us
# Flags for opening a name that `lstat` said is a regular file. O_NOFOLLOW is POSIX
# only (not on Windows): every open below also checks with lstat first.
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0) | NONBLOCK


def nofollow() -> int:
    """O_NOFOLLOW where the platform has it, else 0 (looked up at each call)."""
    return getattr(os, "O_NOFOLLOW", 0)


def _chmod_private(fd: int, path: str | os.PathLike[str]) -> None:
    """Mode 0600 whatever the umask did: by descriptor where os.fchmod exists, else by
    path (Windows before Python 3.13, where chmod only sets the read-only flag: the
    folder's ACL is what keeps others out, see SECURITY.md)."""
    fchmod = getattr(os, "fchmod", None)
    if fchmod is not None:
        fchmod(fd, 0o600)
    else:
        os.chmod(path, 0o600)


# Told how much more work is done (bytes overwritten, rows rewritten): drives progress bars.
Progress = Callable[[int], None]


def kind(mode: int) -> str:
    """What a file-system entry is, in words a user knows."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def special(path: str | os.PathLike[str]) -> str | None:
    """'FIFO (named pipe)', 'socket' or 'device' for such a path (followed), else None.

    Regular files, folders and missing paths are None: each caller has its own word
    for those. Only `stat`: opening a FIFO to look at it would block for ever.
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return kind(mode)


def fsync_dir(folder: Path) -> None:
    """Make a create, rename or unlink in `folder` durable."""
    with contextlib.suppress(OSError):  # not every platform lets you open a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def require_regular(path: Path) -> None:
    """Raise NotAVault unless `path` is a regular file; `stat` only, never `open`.

    Missing files are the caller's business (FileNotFoundError propagates).
    """
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise NotAVault(f"{path} is a folder, not a vault file; give the vault's file path")
    if not stat.S_ISREG(mode):
        raise NotAVault(
            f"{path} is a {kind(mode)}, not a vault file; point --db or MEMVAULT_DB at "
            "the vault's file"
        )


def odd_entries(paths: list[Path]) -> list[tuple[Path, str]]:
    """The names among `paths` that exist and are not plain regular files.

    Links are not followed. A regular file with a second name (a hard link) counts:
    SQLite and a shred would write through it into the other name's contents.
    """
    out = []
    for p in paths:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            out.append((p, kind(st.st_mode)))
        elif st.st_nlink > 1:
            out.append((p, f"hard link (a file with {st.st_nlink} names)"))
    return out


# Longer than this, a path in a message is cut: a 5,000-character name is one line still.
_SHOWN_CHARS = 120


def shown(path: str | os.PathLike[str]) -> str:
    """`path` for a message: whole when short, else its start and its length."""
    text = str(path)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[: _SHOWN_CHARS // 2]}... ({len(text)} characters)"


def refuse_too_long(path: str | os.PathLike[str], what: str) -> None:
    """Refuse (exit 2) a path the OS cannot take as a name (ENAMETOOLONG).

    Asked once, up front: otherwise every later `stat` or `open` of it raises OSError.
    """
    try:
        os.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise BadInput(
                f"{what} {shown(path)} is longer than this system allows for a file name; "
                "give a shorter path; nothing was changed"
            ) from None
    except ValueError:  # a NUL byte: the caller's own checks name it
        pass


def read_head(path: Path, size: int) -> bytes:
    """The first `size` bytes of a regular file, never through a link or a FIFO."""
    fd = os.open(path, os.O_RDONLY | NO_FOLLOW | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.read(fd, size)
    finally:
        os.close(fd)


def check_new_file(
    path: str | os.PathLike[str], what: str, force_flag: str | None = None, replace: bool = False
) -> Path:
    """Refuse (exit 2) a path where `write_private` could not create a new file.

    Run before anything irreversible, so that a bad path costs nothing. A command
    that can replace an existing regular file names its option in `force_flag`
    (said in the refusal) and passes `replace` when it was given; a link, FIFO,
    device or folder is refused all the same.
    """
    if str(path) == "":
        raise BadInput(f"the {what} path is empty (an unset shell variable?); give a file name")
    target = Path(path)
    try:
        mode: int | None = os.lstat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise BadInput(f"cannot use {shown(target)} for the {what} ({exc.strerror})") from None
    if mode is not None and not (stat.S_ISREG(mode) and replace and force_flag is not None):
        if stat.S_ISREG(mode) and force_flag is not None:
            raise BadInput(
                f"{target} already exists; give a new file name for the {what}, or pass "
                f"{force_flag} to replace it"
            )
        if stat.S_ISREG(mode):
            raise BadInput(
                f"{target} already exists; an existing file is never replaced; give a new "
                f"file name for the {what}"
            )
        raise BadInput(f"{target} is a {kind(mode)}; give the name of a new file for the {what}")
    folder = target.absolute().parent
    if not folder.is_dir():
        raise BadInput(
            f"the folder {folder} does not exist; create it or choose another folder for the {what}"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadInput(f"the folder {folder} is not writable; choose another folder for the {what}")
    return target


def write_all(fd: int, data: bytes | Iterable[bytes]) -> None:
    for chunk in [data] if isinstance(data, bytes) else data:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


# A file memvault builds beside its target and renames into place is named
# `.memvault-<tag>-<token>` and flock'ed by its writer until then: a kill leaves a name
# a later command recognises, and the lock tells a dead writer's leftover from a live one.
TEMP_PREFIX = ".memvault-"
_TOKEN = re.compile(r"[A-Za-z0-9_.:-]{1,120}")


def temp_name(tag: str, token: str | None = None) -> str:
    """The name of a temporary file of kind `tag` (a random token unless one is given)."""
    return f"{TEMP_PREFIX}{tag}-{token or secrets.token_hex(8)}"


def try_lock(fd: int) -> bool:
    """Take an exclusive flock without waiting; True where the platform has no flock."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory lock; the name, owner and header still count
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def create_temp(folder: Path, tag: str, token: str | None = None) -> tuple[int, Path]:
    """A new 0600 `.memvault-<tag>-<token>` in `folder`, locked while its descriptor is open.

    Close the descriptor only after the file is renamed into place or removed.
    """
    tmp = folder / temp_name(tag, token)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow() | getattr(os, "O_BINARY", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        _chmod_private(fd, tmp)
        try_lock(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd, tmp


def stale_temps(
    folder: Path, tag: str, looks_ours: Callable[[bytes], bool]
) -> Iterator[tuple[Path, str, os.stat_result]]:
    """The leftovers of killed writers of kind `tag` in `folder`: (path, token, stat).

    Only what memvault made and nobody is writing: the name pattern, a regular file
    (never a link, FIFO or device; nothing is followed), owned by this user, whose
    first bytes `looks_ours` accepts, and whose lock nobody holds. A file with a
    second name is yielded too (its stat says so): the caller decides.
    """
    prefix = f"{TEMP_PREFIX}{tag}-"
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return
    for name in names:
        token = name[len(prefix) :]
        if not name.startswith(prefix) or not _TOKEN.fullmatch(token):
            continue
        path = folder / name
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != getattr(os, "getuid", lambda: -1)():
                continue
            fd = os.open(path, os.O_RDONLY | NO_FOLLOW | getattr(os, "O_BINARY", 0))
        except OSError:
            continue
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not try_lock(fd):
                continue
            if not looks_ours(os.read(fd, 64)):
                continue
            yield path, token, now
        except OSError:
            continue
        finally:
            os.close(fd)


def write_private(
    path: str | os.PathLike[str],
    data: bytes | Iterable[bytes],
    replace: bool = False,
    tag: str = "write",
) -> Path:
    """Create `path` 0600 holding `data`, fsynced, folder fsynced.

    `data` may be an iterable of chunks, written as they come (an export streams
    through here); if it raises, the new file is removed and, with `replace`, the
    old one is left as it was.

    Without `replace`, a new file only (O_CREAT | O_EXCL | O_NOFOLLOW): an existing
    name, link or not, raises FileExistsError. With `replace`, a new 0600 file
    `.memvault-<tag>-...` (see `create_temp`) in the same folder is renamed over the
    old name, so the old file's mode, owner or link target never carry over; a kill
    leaves that file for `remove_stale_temps`. Raises OSError; callers phrase it.
    """
    target = Path(path)
    folder = target.absolute().parent
    if replace:
        fd, tmp = create_temp(folder, tag)
        try:
            write_all(fd, data)
            os.fsync(fd)
            if os.name == "nt":  # Windows renames no open file (and has no flock to keep)
                os.close(fd)
                fd = -1
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            if fd >= 0:
                os.close(fd)  # after the rename: the lock covers the file until it is named
    else:
        if not nofollow() and os.path.lexists(target):
            # O_CREAT | O_EXCL alone already refuses any existing name, a link included
            # (POSIX; CREATE_NEW on Windows): this check only names the case early.
            raise FileExistsError(errno.EEXIST, "the name exists", str(target))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow() | getattr(os, "O_BINARY", 0)
        fd = os.open(target, flags, 0o600)
        try:
            _chmod_private(fd, target)
            write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(target)
            raise
        os.close(fd)
    fsync_dir(folder)
    return target
