"""The session ids that shell completion offers, read without the key.

Session ids are plaintext in the vault file, so completing them needs no key: this
module reads them with a read-only SQLite connection and never touches the keyring,
never imports the Agents SDK, never creates a file, and answers nothing at all on
any error. Imports nothing of the command line, so its parameter types can use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vault import files, paths
from vault.engines.sqlite.db import peek
from vault.engines.sqlite.schema import SESSIONS_TABLE
from vault.textsafe import escape_line

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

# Enough for any menu a shell shows; a vault with a million sessions still answers fast.
MAX_CANDIDATES = 1000
# Completion runs at each TAB: it never waits long for a lock.
COMPLETION_TIMEOUT = 1.0


def complete_session_ids(db: str | None, incomplete: str) -> list[CompletionItem]:
    """The session ids starting with `incomplete`; [] on any error, silently."""
    from click.shell_completion import CompletionItem

    try:
        ids = session_ids(db, incomplete)
    except Exception:  # a TAB never prints an error, let alone a traceback
        return []
    return [CompletionItem(i) for i in ids]


def session_ids(db: str | None, prefix: str = "") -> list[str]:
    """Session ids of the vault at `db` (resolved as every command does), read-only.

    Never creates a file: a missing vault is [] (`vault.engines.sqlite.db.peek` says how it reads
    without writing); a read that fails is [] too; completion never writes a row.
    """
    path = paths.resolve_db_path(db)
    if not path.is_file() or files.odd_entries(paths.sidecars(path)):
        return []
    conn = peek(path, COMPLETION_TIMEOUT)
    try:
        rows = conn.execute(
            f"SELECT session_id FROM {SESSIONS_TABLE} WHERE substr(session_id, 1, ?) = ? "
            "ORDER BY session_id LIMIT ?",
            (len(prefix), prefix, MAX_CANDIDATES),
        ).fetchall()
    finally:
        conn.close()
    # One candidate per line in the shell protocol, which the shell shows and inserts as it
    # is: an id holding a control character (a line break, ESC...) cannot be offered.
    return [r[0] for r in rows if isinstance(r[0], str) and escape_line(r[0]) == r[0]]
