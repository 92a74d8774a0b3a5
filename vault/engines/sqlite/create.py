"""`memvault init`: a new vault appears whole, or not at all.

The vault is built in `.memvault-init-<vault_id>.<kid>` beside the target (see
`files.create_temp`): key in the keyring, WAL mode, schema, meta, journal and
audit committed, the temporary file's last connection closed (SQLite removes
its `-wal` and `-shm`), fsynced; only then is it linked to the target's name
(never over an existing file) and the temporary name removed. A SIGKILL at any
instant leaves either no vault file or a whole vault, never a 0-byte file.

A kill before the link leaves a keyring entry that no vault uses and the
temporary file that names it. The next `init` in that folder reclaims both:
it deletes the entry the name records and destroys the file, once the file's
lock shows its writer is gone. A kill between the link and the unlink leaves a
whole vault with a second name, which the next `init` removes (the name only).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from vault import (
    chainanchor,
    crypto,
    durations,
    erase,
    files,
    keyjournal,
    paths,
    targets,
    testhooks,
)
from vault.engines.sqlite.db import VaultFile, audit
from vault.engines.sqlite.lifecycle import KeyLifecycle
from vault.engines.sqlite.schema import FILE_FORMAT, SQLITE_MAGIC, migrate, utcnow
from vault.errors import KeyProblem, NotAVault, OperationFailed, VaultError, VaultExists
from vault.keyjournal import CURRENT, entry_name
from vault.keys import KeyStore
from vault.keysource.store import (
    TransitStore,
    anchor_store,
    stage_first_key,
    unstage_first_key,
)
from vault.vaultops import new_identity, new_meta

# The vault class `create` builds (sqlite.vault.Vault, which calls it: a type variable, so
# that the two do not import each other).
V = TypeVar("V", bound=KeyLifecycle)

TEMP_TAG = "init"


def _token(vault_id: str, kid: str) -> str:
    """What the temporary file's name records: whose keyring entry it stands for."""
    return f"{vault_id}.{kid.replace(':', '.')}"  # ':' is no file-name character on Windows


def _entry_of(token: str) -> str | None:
    vault_id, _, kid = token.partition(".")
    scheme, _, fingerprint = kid.partition(".")
    if not vault_id.startswith("mv-") or not scheme or not fingerprint:
        return None
    return entry_name(vault_id, f"{scheme}:{fingerprint}")


def _looks_like_init(head: bytes) -> bool:
    return head == b"" or head.startswith(SQLITE_MAGIC)


def _destroy_with_side_files(tmp: Path) -> None:
    for p in paths.sidecars(tmp):
        with contextlib.suppress(OSError):
            erase.destroy(p)


def reclaim_interrupted(folder: Path, target: Path, keystore: KeyStore | None) -> int:
    """Undo what killed `init` runs left in `folder`; how many were reclaimed."""
    reclaimed = 0
    for tmp, token, st in files.stale_temps(folder, TEMP_TAG, _looks_like_init):
        if st.st_nlink > 1:
            # Linked into place before the kill: a whole vault's second name. Only the
            # name goes, and only when the other name is the vault being created here.
            with contextlib.suppress(OSError):
                if os.path.samefile(tmp, target):
                    os.unlink(tmp)
                    reclaimed += 1
            continue
        entry = _entry_of(token)
        if entry is not None:
            ks = keystore or KeyStore()
            with contextlib.suppress(VaultError):
                ks.delete(entry)
                chainanchor.forget(anchor_store(ks), entry.partition("/")[0])
        _destroy_with_side_files(tmp)
        reclaimed += 1
    if reclaimed:
        files.fsync_dir(folder)
    return reclaimed


def create(
    cls: type[V],
    opens: Callable[[Path, KeyStore | None], object],
    db: str | os.PathLike[str] | None,
    ttl: int | None,
    keystore: KeyStore | None,
) -> V:
    """Create the vault file and its random master key; refuse if anything is there.

    `opens(path, keystore)` opens an existing vault (`Vault.open`): it tells a vault
    already there from a file that is none.
    """
    path = paths.resolve_db_path(db)
    folder = path.absolute().parent
    if folder.is_dir():
        reclaim_interrupted(folder, path.absolute(), keystore)
    if path.exists():
        files.require_regular(path)  # a FIFO, device or folder: exit 3 without opening it
        try:
            opens(path, keystore)
        except NotAVault:
            raise VaultExists(
                f"{path} already exists and is not a memvault vault; memvault will not "
                "overwrite it (to encrypt a plaintext SQLiteSession file use `memvault "
                "import`)"
            ) from None
        except VaultError:
            pass
        raise VaultExists(
            f"a vault already exists at {path}; nothing was changed "
            "(`memvault status` describes it)"
        )
    targets.refuse_side_file(path, "new vault")  # SQLite would delete it at X's next open
    # lexists: a dangling link would make SQLite create its target.
    leftovers = [p for p in paths.sidecars(path)[1:] if os.path.lexists(p)]
    if leftovers:
        raise VaultExists(
            f"{leftovers[0]} exists without its database; move it away before creating a vault here"
        )
    ks = keystore or KeyStore()
    key, kid, vault_id = new_identity(ks)
    try:
        paths.ensure_private_folder(folder)
        fd, tmp = files.create_temp(folder, TEMP_TAG, _token(vault_id, kid))
    except OSError as exc:
        raise OperationFailed(
            f"cannot create {path} ({exc.strerror}); choose a writable "
            "folder with --db or MEMVAULT_DB"
        ) from None
    linked = False
    anchored = anchor_store(ks)
    try:
        # The key goes in first: a kill before the link leaves an unused keyring entry,
        # which the temporary file's name lets the next `init` reclaim.
        rows = stage_first_key(ks, vault_id, kid, key)  # a transit key: wrapped, for meta
        testhooks.failpoint("init-key-stored")
        _build(cls(tmp, ks), vault_id, kid, ttl, rows, key)
        # Born chained: no later file of it may say otherwise.
        try:
            chainanchor.mark_chained(anchored, vault_id)
        except KeyProblem as exc:  # a transit vault's, in the key service
            done = ks.drop_created_key() if isinstance(ks, TransitStore) else ""
            raise type(exc)(f"{exc.message}; {done or 'no vault was created'}") from None
        os.fsync(fd)
        testhooks.failpoint("init-built")
        if os.name == "nt":  # Windows unlinks no open file (and has no flock to keep)
            os.close(fd)
            fd = -1
        try:
            os.link(tmp, path)  # never over a file that appeared meanwhile
        except FileExistsError:
            raise VaultExists(
                f"a file appeared at {path} while creating the vault; nothing was changed"
            ) from None
        except OSError as exc:
            raise OperationFailed(
                f"cannot create {path} ({exc.strerror}); choose a writable "
                "folder with --db or MEMVAULT_DB"
            ) from None
        linked = True
        testhooks.failpoint("init-linked")
        os.unlink(tmp)
        files.fsync_dir(folder)
    except BaseException:
        if linked:  # the vault is whole at its name: only the second name goes
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        else:
            _destroy_with_side_files(tmp)
            with contextlib.suppress(VaultError):
                unstage_first_key(ks, vault_id, kid)
                chainanchor.forget(anchored, vault_id)
        raise
    finally:
        if fd >= 0:
            os.close(fd)  # last: the lock tells a later `init` that this one is alive
    # A transit vault's store is read from its meta, bound to the vault at its name.
    vault = cls(path, None if isinstance(ks, TransitStore) else ks)
    vault._sealer = crypto.Sealer(key)
    return vault


def _build(
    vault: VaultFile, vault_id: str, kid: str, ttl: int | None, rows: dict[str, str], key: str
) -> None:
    """The new vault's tables and meta, in its temporary file, committed: born chained,
    its vault head summing no session yet."""
    from vault import chain
    from vault.engines.sqlite import vaulthead

    with vault.connection() as conn:
        # Kept by the file; SQLite refuses to change it inside a transaction.
        conn.execute("PRAGMA journal_mode = WAL")
    with vault.write_transaction() as conn:
        migrate(conn)
        meta = {**new_meta(FILE_FORMAT, vault_id, kid, ttl, utcnow()), **rows}
        conn.executemany("INSERT INTO memvault_meta (key, value) VALUES (?, ?)", meta.items())
        keyjournal.record(conn, kid, CURRENT)
        vaulthead.start(conn, chain.chain_key(key, vault_id))
        audit(conn, "init", kid, ttl=durations.format_duration(ttl))
