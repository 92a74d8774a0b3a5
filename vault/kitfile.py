"""Where a recovery kit is written: the kit file's one writer and its target check.

Apart from vault.kit (the format and the two operations) so that each stays small;
vault.kit re-exports both names.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from vault import files, targets
from vault.errors import BadInput, OperationFailed

if TYPE_CHECKING:
    from vault.engine import AnyVault

KIT_FORMAT = "memvault-recovery-kit"


def write_kit_file(path: str | os.PathLike[str], text: str, force: bool = False) -> Path:
    """Create `path` 0600 with `text`, fsynced; never follows or clobbers an existing file
    unless `force`, and then replaces it atomically (a new 0600 file renamed over it)."""
    target = Path(path)
    if target.is_dir():
        raise BadInput(f"{target} is a folder; give a file name for the recovery kit")
    with contextlib.suppress(OSError):
        mode = os.lstat(target).st_mode
        if force and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            # --force replaces an old kit, never a FIFO or a device such as /dev/null
            raise BadInput(f"{target} is a {files.kind(mode)}; give a file name for the kit")
    try:
        return files.write_private(target, text.encode("utf-8"), replace=force)
    except FileExistsError:
        raise OperationFailed(
            f"{target} already exists; choose another file name, or pass --force to replace it"
        ) from None
    except OSError as exc:
        raise OperationFailed(
            f"cannot write {target} ({exc.strerror}); no kit was written"
        ) from None


def check_kit_target(vault: AnyVault, path: str | os.PathLike[str], force: bool = False) -> Path:
    """Refuse (exit 2) a kit path that is the vault or a database, or, with `force`, an
    existing file that is not a recovery kit of this vault. Asked before the passphrase."""
    vault_id = vault.vault_id

    def recognise(head: bytes) -> str | None:
        try:
            doc = json.loads(head.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return "not a recovery kit"
        if not isinstance(doc, dict) or doc.get("format") != KIT_FORMAT:
            return "not a recovery kit"
        if doc.get("vault_id") != vault_id:
            return "a recovery kit of another vault"
        return None

    return targets.check_target(
        path,
        "recovery kit",
        targets.vault_path_of(vault),
        force_flag="--force",
        replace=force,
        recognise=recognise,
        kind="a recovery kit of this vault",
    )
