"""Windows (and old-Python) fallbacks, exercised on Linux by taking the POSIX-only
attributes away: os.fchmod (Windows only from Python 3.13), os.O_NOFOLLOW (POSIX
only), and platformdirs' Windows layout (an "author" folder unless appauthor=False).
Each test runs the real code path with the attribute gone."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import add_items, key_entry, user
from vault import erase, files, kit, paths

REAL_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@pytest.fixture
def open_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The flags of every os.open call, to prove O_NOFOLLOW really was not used."""
    seen: list[int] = []
    real_open = os.open

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        seen.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    yield seen


@pytest.fixture
def strict_umask() -> Iterator[None]:
    # 0o377: a new file comes out 0400; only an explicit chmod makes it 0600.
    old = os.umask(0o377)
    try:
        yield
    finally:
        os.umask(old)


def no_nofollow(seen: list[int]) -> bool:
    return all(not flags & REAL_NOFOLLOW for flags in seen)


# --------------------------------------------------------------------------
# No os.fchmod: chmod by path
# --------------------------------------------------------------------------
def test_private_file_is_0600_without_fchmod(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, strict_umask: None
) -> None:
    monkeypatch.delattr(os, "fchmod")
    target = files.write_private(tmp_path / "receipt.json", b'{"shredded": true}\n')
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_bytes() == b'{"shredded": true}\n'


def test_replacing_a_kit_without_fchmod_gives_0600(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    old = tmp_path / "kit.json"
    old.write_text("old kit\n")
    old.chmod(0o644)
    monkeypatch.delattr(os, "fchmod")
    kit.write_kit_file(old, '{"format": "memvault-recovery-kit"}\n', force=True)
    assert stat.S_IMODE(old.stat().st_mode) == 0o600
    assert old.read_text() == '{"format": "memvault-recovery-kit"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["kit.json"]  # no temporary left


# --------------------------------------------------------------------------
# No os.O_NOFOLLOW: lstat first, O_EXCL, and the fstat identity check
# --------------------------------------------------------------------------
def test_a_private_file_never_goes_through_a_link_without_O_NOFOLLOW(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, open_flags: list[int]
) -> None:
    monkeypatch.delattr(os, "O_NOFOLLOW")
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's data\n")
    link = tmp_path / "kit.json"
    link.symlink_to(victim)
    dangling = tmp_path / "receipt.json"
    dangling.symlink_to(tmp_path / "would-be-created.txt")

    with pytest.raises(FileExistsError):
        files.write_private(link, b"secret")
    with pytest.raises(FileExistsError):
        files.write_private(dangling, b"secret")
    assert victim.read_text() == "someone else's data\n"
    assert not (tmp_path / "would-be-created.txt").exists()
    # The CLI-facing writer refuses it the same way, in words.
    with pytest.raises(kit.OperationFailed, match="already exists"):
        kit.write_kit_file(link, "{}\n")
    assert victim.read_text() == "someone else's data\n"

    new = files.write_private(tmp_path / "new.json", b"fine")
    assert new.read_bytes() == b"fine" and stat.S_IMODE(new.stat().st_mode) == 0o600
    assert open_flags and no_nofollow(open_flags)


def test_overwrite_and_unlink_without_O_NOFOLLOW(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, open_flags: list[int]
) -> None:
    monkeypatch.delattr(os, "O_NOFOLLOW")
    doomed = tmp_path / "history.db-wal"
    doomed.write_bytes(b"ciphertext" * 1000)
    keep = os.open(doomed, os.O_RDONLY)  # to look at the bytes after the unlink
    try:
        report = erase.destroy(doomed, header=b"memvault shredded")
        assert report == {"name": "history.db-wal", "size": 10000, "kind": "file"}
        assert not doomed.exists()
        left = os.pread(keep, 20000, 0)
    finally:
        os.close(keep)
    assert left == b"memvault shredded" + bytes(10000 - 17)

    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's data\n")
    link = tmp_path / "history.db-shm"
    link.symlink_to(victim)
    report = erase.destroy(link)
    assert report is not None and report["kind"] == "symbolic link"
    assert not os.path.lexists(link)
    assert victim.read_text() == "someone else's data\n"  # the target is never written
    assert open_flags and no_nofollow(open_flags)


def test_vault_init_and_shred_without_fchmod_or_O_NOFOLLOW(
    monkeypatch: pytest.MonkeyPatch, vault_db: Path, open_flags: list[int]
) -> None:
    from vault import Vault
    from vault.engines.sqlite.vault import shred

    monkeypatch.delattr(os, "fchmod")
    monkeypatch.delattr(os, "O_NOFOLLOW")
    v = Vault.init(vault_db, ttl=3600)
    assert stat.S_IMODE(vault_db.stat().st_mode) == 0o600
    assert stat.S_IMODE(vault_db.parent.stat().st_mode) == 0o700
    add_items(vault_db, "s1", [user("the code name is NORD-42")])
    entry = key_entry(v)
    assert v.keystore.get(entry)

    report = shred(vault_db)
    assert report["key_destroyed"] is True, report
    assert not any(os.path.lexists(p) for p in paths.sidecars(vault_db))
    assert v.keystore.get(entry) is None
    assert open_flags and no_nofollow(open_flags)


# --------------------------------------------------------------------------
# platformdirs on Windows: no "memvault\\memvault"
# --------------------------------------------------------------------------
@pytest.fixture
def windows_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """platformdirs' real Windows class, its known-folder lookup pointed at tmp_path."""
    import platformdirs
    import platformdirs.windows

    local = tmp_path / "AppData" / "Local"
    monkeypatch.setattr(platformdirs, "PlatformDirs", platformdirs.windows.Windows)
    monkeypatch.setattr(platformdirs.windows, "get_win_folder", lambda _csidl: str(local))
    monkeypatch.delenv("MEMVAULT_DB", raising=False)
    return local


def test_windows_default_vault_has_no_author_folder(windows_dirs: Path) -> None:
    assert paths.default_db_path() == windows_dirs / "memvault" / "history.db"
    assert paths.resolve_db_path() == windows_dirs / "memvault" / "history.db"


def test_windows_vault_at_the_older_place_is_still_found(windows_dirs: Path) -> None:
    older = windows_dirs / "memvault" / "memvault" / "history.db"
    older.parent.mkdir(parents=True)
    older.write_bytes(b"")
    assert paths.default_db_path() == older
    # Once a vault exists at the new place, the new place wins.
    (windows_dirs / "memvault" / "history.db").write_bytes(b"")
    assert paths.default_db_path() == windows_dirs / "memvault" / "history.db"


def test_linux_default_vault_place_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    import platformdirs

    monkeypatch.delenv("MEMVAULT_DB", raising=False)
    assert paths.default_db_path() == platformdirs.user_data_path("memvault") / "history.db"
