"""The plaintext a killed `export --force` may leave, and where to look for it.

`export --force` streams into a `.memvault-export-*` file beside its target and
renames it into place; a kill leaves that file, with plaintext in it. Each folder a
forced export of a vault writes in is recorded in that vault's audit trail (event
`export-folder`, before the first byte), so the next export or shred of the same
vault destroys such leftovers in every one of those folders, not only beside its
own target. Light on purpose: `shred` imports it, and must not pay for `export`.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vault import erase

EVENT = "export-folder"
TEMP_TAG = "export"  # `--force` writes `.memvault-export-*` beside the target, then renames it
MD_TITLE = "# memvault export\n"


def looks_like_export(head: bytes) -> bool:
    """An export's first bytes, or none (a writer killed before its first write)."""
    return head == b"" or head.startswith((b'{"session_id": ', MD_TITLE.encode()))


def remove_stale_exports(folder: Path) -> list[dict[str, Any]]:
    """Destroy the plaintext that killed `export --force` runs left in `folder`.

    Only files memvault made there and no live export is writing (files.stale_temps).
    """
    return erase.remove_stale_temps(folder, TEMP_TAG, looks_like_export)


def recorded(log: Iterable[dict[str, Any]]) -> set[Path]:
    """The folders an audit trail (`Vault.audit_log()` rows) says forced exports wrote in."""
    return {Path(r["to"]) for r in log if r.get("event") == EVENT and isinstance(r.get("to"), str)}


def recorded_in_file(conn: sqlite3.Connection) -> set[Path]:
    """`recorded`, read straight from a vault file's audit table (for shred, which may
    meet a file it cannot open as a vault); none when the table cannot be read."""
    rows: list[dict[str, Any]] = []
    with contextlib.suppress(sqlite3.Error):
        for (details,) in conn.execute(
            "SELECT details FROM memvault_audit WHERE event = ?", (EVENT,)
        ):
            with contextlib.suppress(ValueError, RecursionError):
                doc = json.loads(details)
                if isinstance(doc, dict):
                    rows.append({"event": EVENT, **doc})
    return recorded(rows)


def clean(folders: Iterable[Path]) -> list[dict[str, Any]]:
    """`remove_stale_exports` in each folder, once."""
    removed: list[dict[str, Any]] = []
    for folder in sorted(set(folders)):
        removed += remove_stale_exports(folder)
    return removed
