"""Where a command may write a file: never over the vault, never over a database.

Every command that writes a file (`export -o`, `key export`, `backup`, `shred
--receipt`) checks its target here before it writes anything, and `import` checks
its source (`--shred-source` would destroy it). The files of a vault are the ones
`paths.sidecars` names: the database and its `-wal`, `-shm` and `-journal`.

A target is judged by what it is, not by how it is spelled: by device and inode
where it exists (so a symbolic link, a hard link or a `..` detour to the vault is
the vault), and where it does not exist (a `-journal` usually does not) by the
folder it would land in, found by device and inode too, and its name. Names are
compared case-insensitively, as macOS and Windows folders do by default.

`--force` replaces only a file of the kind the command writes, which the command
recognises from its first bytes; it never replaces a SQLite database (a vault, a
backup, another program's data) or one of its side files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from vault import files, paths
from vault.engines.sqlite.restorestate import NEW_SUFFIX, OLD_SUFFIX
from vault.engines.sqlite.schema import SQLITE_MAGIC
from vault.errors import BadInput

# Enough of an existing file to recognise it (a kit is at most 64 KiB).
HEAD_BYTES = 64 * 1024 + 1
# What a command says of an existing file it was asked to replace: None when the file
# is of its own kind (it may be replaced), else what the file is, for the message.
Recognise = Callable[[bytes], str | None]

_ROLES = {"": "file", "-wal": "-wal file", "-shm": "-shm file", "-journal": "-journal"}


def _identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(device, inode) of what `path` names, links followed; None if nothing is there."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def vault_file_at(path: str | os.PathLike[str], vault_path: Path | None) -> Path | None:
    """The vault's file (database or side file) that `path` is, or would create; else None."""
    if vault_path is None:  # a PostgreSQL vault has no file
        return None
    members = paths.sidecars(vault_path)
    here = _identity(path)
    if here is not None:
        return next((m for m in members if _identity(m) == here), None)
    # Nothing there yet: where would a new file land? realpath follows the links of the
    # folders and a dangling link at the name itself.
    landing = Path(os.path.realpath(path))
    folder = _identity(landing.parent)
    if folder is None or folder != _identity(vault_path.parent):
        return None
    name = landing.name.casefold()
    return next((m for m in members if m.name.casefold() == name), None)


def refuse_vault_file(path: str | os.PathLike[str], vault_path: Path | None, what: str) -> None:
    """Raise BadInput (exit 2) when `path` is the vault's database or one of its side files."""
    member = vault_file_at(path, vault_path)
    if member is None or vault_path is None:
        return
    role = _ROLES[member.name[len(vault_path.name) :]]
    also = "" if str(path) == str(member) else f" ({files.shown(member)})"
    raise BadInput(
        f"{files.shown(path)} is the vault's own {role}{also}; {what}; give another file "
        "name; nothing was written"
    )


def over_vault(what: str) -> str:
    """Why a target of a command that writes `what` may not be a vault file."""
    return f"the {what} would be written over the vault"


# Why an import source may not be a vault file.
NOT_A_SOURCE = "a vault is not a plaintext SQLiteSession file, and --shred-source would destroy it"


def _database_side_file(target: Path, suffixes: tuple[str, ...]) -> Path | None:
    """The SQLite database that `target` would be a side file of (`X-wal` beside X)."""
    for suffix in suffixes:
        if target.name.endswith(suffix) and len(target.name) > len(suffix):
            base = target.with_name(target.name[: -len(suffix)])
            try:
                if files.read_head(base, len(SQLITE_MAGIC)) == SQLITE_MAGIC:
                    return base
            except OSError:
                continue
    return None


def refuse_side_file(target: Path, what: str) -> None:
    """Refuse (exit 2) a name SQLite gives a side file of an existing database (`X-wal`
    beside the database X): opening X would take the file for its own, and reset or
    delete it. The same for the other names something else deletes: a restore's, and
    memvault's temporary files."""
    if Path(target).name.startswith(files.TEMP_PREFIX):
        # A later backup, export or init in that folder takes it for a killed writer's
        # leftover, and destroys it.
        raise BadInput(
            f"{files.shown(target)}: names starting with {files.TEMP_PREFIX} are memvault's "
            f"temporary files, which a later command deletes; give another name for the "
            f"{what}; nothing was written"
        )
    base = _database_side_file(target, paths.SIDECAR_SUFFIXES)
    if base is not None:
        raise BadInput(
            f"{files.shown(target)} is a side file of the SQLite database {files.shown(base)}, "
            f"which would take the {what} for its own; give another file name; nothing was "
            "written"
        )
    # The next open of a vault X takes `X.restore-new` or `X.restore-old` for what a
    # cut-off restore left, and destroys it.
    base = _database_side_file(target, (NEW_SUFFIX, OLD_SUFFIX))
    if base is not None:
        raise BadInput(
            f"{files.shown(target)} is the name a restore of {files.shown(base)} works under, "
            f"and that vault's next open would delete the {what}; give another file name; "
            "nothing was written"
        )


def check_target(
    path: str | os.PathLike[str],
    what: str,
    vault_path: Path | None,
    force_flag: str | None = None,
    replace: bool = False,
    recognise: Recognise | None = None,
    kind: str = "",
) -> Path:
    """Refuse (exit 2), before anything is written, a target the command must not write.

    Refused whatever the options: the vault's database or a side file of it (by
    identity), a side file of any other SQLite database. Refused as
    `files.check_new_file` refuses: an existing name (unless `replace`), a link, FIFO,
    device or folder, a missing or read-only folder. With `replace`, an existing file
    is replaced only when `recognise(its first bytes)` says it is of `kind` (what the
    command writes); never a SQLite database.
    """
    if str(path) == "":
        return files.check_new_file(path, what)  # its own words for an empty path
    paths.require_text_path(path, f"the {what} path")  # too long, or not UTF-8: exit 2
    target = Path(path)
    refuse_vault_file(target, vault_path, over_vault(what))
    refuse_side_file(target, what)
    if replace and force_flag is not None and os.path.isfile(target) and not target.is_symlink():
        try:
            head = files.read_head(target, HEAD_BYTES)
        except OSError as exc:
            raise BadInput(
                f"cannot read {files.shown(target)} to see what it is ({exc.strerror}); "
                f"{force_flag} replaces only {kind}; give a new file name for the {what}"
            ) from None
        found = "a SQLite database" if head.startswith(SQLITE_MAGIC) else None
        if found is None and recognise is not None:
            found = recognise(head)
        if found is not None:
            raise BadInput(
                f"{files.shown(target)} is {found}; {force_flag} replaces only {kind}, never "
                f"another file; give a new file name for the {what}; nothing was written"
            )
    return files.check_new_file(target, what, force_flag, replace)


def vault_path_of(vault: object) -> Path | None:
    """The file of a file vault; None for a PostgreSQL vault (its `path` is a URL)."""
    where = getattr(vault, "path", None)
    return where if isinstance(where, Path) else None
