"""Where the vault lives: one resolution used by the CLI and the library."""

from __future__ import annotations

import os
from pathlib import Path

ENV_DB = "MEMVAULT_DB"
APP_NAME = "memvault"
DB_NAME = "history.db"
# SQLite's side files; shred and the scrub scanner cover all of them.
SIDECAR_SUFFIXES = ("-wal", "-shm", "-journal")


def default_db_path() -> Path:
    import platformdirs  # imported here: only needed when nothing else names the file

    return Path(platformdirs.user_data_path(APP_NAME)) / DB_NAME


def resolve_db_path(db: str | os.PathLike[str] | None = None) -> Path:
    """`--db PATH`, else `$MEMVAULT_DB`, else the platformdirs data folder."""
    if db is not None and str(db) != "":
        chosen = Path(db)
    elif os.environ.get(ENV_DB):
        chosen = Path(os.environ[ENV_DB])
    else:
        chosen = default_db_path()
    # Follow symbolic links as SQLite does, so that the -wal/-shm beside the real file
    # are the ones shred overwrites and the real file is the one it unlinks.
    return Path(os.path.realpath(chosen.expanduser()))


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
