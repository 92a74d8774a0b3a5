"""What the SDK session's SQLite calls raise and read, made safe for the vault, and
how the session tells that its file is still the one it opened.

An error is both the vault's (its message and exit code) and the SDK's `sqlite3`
class; a stored row the SDK's decoding would crash on reaches it as a row it skips.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import TYPE_CHECKING, Any

from vault import crypto
from vault.engines.sqlite.db import translate
from vault.errors import NotAVault, VaultError

if TYPE_CHECKING:
    from pathlib import Path


_BOTH: dict[tuple[type[VaultError], type[sqlite3.Error]], type[VaultError]] = {}


def also_sqlite(err: VaultError, exc: sqlite3.Error) -> VaultError:
    """`err` (its message and exit code) as an instance of `exc`'s sqlite3 class too.

    Code written against the SDK catches the `sqlite3.Error` subclass SQLiteSession
    raises (OperationalError for "database is locked" or a missing table); the CLI
    catches VaultError. A drop-in must satisfy both, so its errors are both.
    """
    if isinstance(err, sqlite3.Error):
        return err
    key = (type(err), type(exc))
    cls = _BOTH.get(key)
    if cls is None:
        name = type(err).__name__
        cls = _BOTH[key] = type(name, key, {"__module__": __name__, "__qualname__": name})
    both = cls.__new__(cls, *err.args)  # not __init__: subclasses' signatures differ
    both.args = err.args
    both.__dict__.update(err.__dict__)  # its message, and any field a subclass adds
    # As sqlite3 sets them, so `except sqlite3.Error` code can still read the cause's code.
    both.sqlite_errorcode = getattr(exc, "sqlite_errorcode", None)  # type: ignore[attr-defined]
    both.sqlite_errorname = getattr(exc, "sqlite_errorname", None)  # type: ignore[attr-defined]
    return both


def sdk_error(exc: sqlite3.Error, path: Path) -> VaultError:
    """The vault's error for an SQLite failure in a session call, of the SDK's type too."""
    if isinstance(exc, VaultError):
        return exc  # translated already, further down the same call
    return also_sqlite(translate(exc, path), exc)


def undecodable_rows_as_none(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> tuple[Any, ...]:
    """The SDK's row decoding (get_items, pop, compaction) skips a row whose `json.loads`
    raises JSONDecodeError or TypeError, but not RecursionError or a plain ValueError: a
    row nested deeper than the parser's stack (`[` x 5000) or holding a number of more
    digits than Python converts, storable by anyone who can write the file, would end
    the agent's read. Such a row reaches the SDK as None, which it skips as corrupt."""
    if (
        len(row) == 1
        and isinstance(row[0], str)
        and cursor.description[0][0] == "message_data"
        and crypto.split_envelope(row[0]) is None  # what `seal` writes: the fast, common case
    ):
        try:
            json.loads(row[0])
        except json.JSONDecodeError:
            pass  # the SDK skips it itself
        except (ValueError, RecursionError):
            return (None,)
    return row


def file_identity(path: Path) -> tuple[int, int]:
    """The file at `path` (device, inode): NotAVault when it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NotAVault(
            f"the vault at {path} is gone (shredded or moved) since this "
            "session was opened; nothing was read or written"
        ) from None
    return st.st_dev, st.st_ino


def check_identity(path: Path, identity: tuple[int, int]) -> None:
    if file_identity(path) != identity:
        raise NotAVault(
            f"the vault at {path} was replaced since this session was opened; "
            "nothing was read or written; open a new session"
        )
