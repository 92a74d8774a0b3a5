"""Where the vault lives: one resolution used by the CLI and the library."""

from __future__ import annotations

import os
from pathlib import Path

from vault import files

ENV_DB = "MEMVAULT_DB"
APP_NAME = "memvault"
DB_NAME = "history.db"
# SQLite's side files; shred and the scrub scanner cover all of them.
SIDECAR_SUFFIXES = ("-wal", "-shm", "-journal")


def default_db_path() -> Path:
    """`<user data folder>/memvault/history.db`.

    appauthor=False: on Windows platformdirs would otherwise nest the app under an
    "author" folder of the same name (`%LOCALAPPDATA%\\memvault\\memvault`); other
    platforms ignore it. A vault already at that older Windows place is still used.
    """
    import platformdirs  # imported here: only needed when nothing else names the file

    chosen = Path(platformdirs.user_data_path(APP_NAME, appauthor=False)) / DB_NAME
    older = Path(platformdirs.user_data_path(APP_NAME)) / DB_NAME
    if older != chosen and not os.path.lexists(chosen) and os.path.lexists(older):
        return older
    return chosen


def postgres_url(db: str | os.PathLike[str] | None) -> str | None:
    """The PostgreSQL URL that `db` (--db, `db_path`) or else `$MEMVAULT_DB` names; None
    for a file path or the default. A prefix check: every command asks, so it costs no
    regex and no import (vault.engines.postgres.url reads a URL once one is named)."""
    if db is not None:
        if isinstance(db, bytes):
            return None
        text = os.fspath(db)
    else:
        text = os.environ.get(ENV_DB) or ""
    scheme, sep, _ = text.partition("://")
    if sep and scheme.lower().split("+", 1)[0] in ("postgres", "postgresql"):
        return text
    return None


def resolve_db_path(db: str | os.PathLike[str] | None = None) -> Path:
    """`--db PATH`, else `$MEMVAULT_DB`, else the platformdirs data folder.

    An explicit empty path (`--db "$UNSET"`) is refused rather than read as "the
    default": falling back would point `shred` or `revoke` at another vault. An
    empty `$MEMVAULT_DB` counts as unset, as shells treat empty variables.
    """
    url = postgres_url(db)
    if url is not None:
        from vault.engines.postgres.url import unsupported
        from vault.errors import BadInput

        raise BadInput(unsupported(url))
    if db is not None:
        if str(db) == "":
            from vault.errors import BadInput

            raise BadInput(
                "the vault path is empty (an unset shell variable?); give --db PATH, or "
                "leave --db out to use $MEMVAULT_DB or the default vault; nothing was changed"
            )
        chosen = Path(db)
    elif os.environ.get(ENV_DB):
        chosen = Path(os.environ[ENV_DB])
    else:
        chosen = default_db_path()
    require_text_path(chosen, "the vault path")
    # Follow symbolic links as SQLite does, so that the -wal/-shm beside the real file
    # are the ones shred overwrites and the real file is the one it unlinks.
    resolved = Path(os.path.realpath(chosen.expanduser()))
    kind = files.special(resolved)
    if kind:  # SQLite would block for ever reading a FIFO's "header"
        from vault.errors import NotAVault

        raise NotAVault(
            f"{resolved} is a {kind}, not a vault file; give the path of the vault "
            "with --db or MEMVAULT_DB; nothing was changed"
        )
    return resolved


def require_text_path(path: str | os.PathLike[str], what: str) -> None:
    """Refuse (exit 2) a path holding bytes that are not UTF-8, or too long for the OS.

    Python hands such bytes over as lone surrogates; SQLite's URI and every message
    that names the file need text, so they would fail half-way instead.
    """
    files.refuse_too_long(path, what)
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        from vault.errors import BadInput

        raise BadInput(
            f'{what} "{os.fsencode(path).decode("utf-8", "backslashreplace")}" is not '
            "valid UTF-8; rename the file (or its folder) to a UTF-8 name; nothing was changed"
        ) from None


def sidecars(db: Path) -> list[Path]:
    """The database followed by the files SQLite may keep beside it."""
    return [db, *(db.with_name(db.name + s) for s in SIDECAR_SUFFIXES)]


def ensure_private_folder(folder: Path) -> None:
    """Create missing folders 0700. An existing folder is the user's: left as it is."""
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700)
        os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask


def mode_of(path: Path) -> str | None:
    try:
        return oct(path.stat().st_mode & 0o777)
    except FileNotFoundError:
        return None
