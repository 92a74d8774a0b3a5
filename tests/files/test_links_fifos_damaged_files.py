"""Files at the edges: links, FIFOs, devices, damaged vaults, the shred receipt.

Nothing memvault overwrites, writes or deletes is reached through a symbolic
link, a FIFO or a device; shred works on a damaged vault and checks everything
it needs before it destroys anything. Real subprocesses, real keyring.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import stat
from pathlib import Path
from typing import Any

import keyring
import pytest

from tests.cli.test_errors import as_ordinary_user, one_line
from tests.conftest import add_items, key_entry, keyring_entries, raw_bytes, run_cli, user
from tests.files.test_import import make_plain

SIDES = ("-wal", "-shm", "-journal")
VICTIM_TEXT = b"an unrelated file that memvault must never touch\n" * 50
FAIL_KEYRING = {"PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"}
# A command that hangs fails the test at this deadline instead of hanging the suite.
HANG = 60.0


def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_bytes(VICTIM_TEXT)
    return v


def gone(db: Path) -> bool:
    return not any(os.path.lexists(db.with_name(db.name + s)) for s in ("", *SIDES))


def meta(db: Path) -> dict[str, str]:
    conn = sqlite3.connect(db)
    try:
        return dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
    finally:
        conn.close()


def checkpoint(db: Path) -> None:
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


# --------------------------------------------------------------------------
# Side files that are links
# --------------------------------------------------------------------------
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.sweep
def test_link_planted_after_an_interrupted_shred_is_removed_not_followed(
    vault: Any, vault_db: Path, tmp_path: Path, side: str
) -> None:
    add_items(vault_db, "s", [user("x" * 500) for _ in range(5)])
    r = run_cli("shred", "--yes", env={"MEMVAULT_FAILPOINT": "shred-during-overwrite"})
    assert r.code == -9, r
    target = victim(tmp_path)
    link = vault_db.with_name(vault_db.name + side)
    if os.path.lexists(link):
        link.unlink()
    link.symlink_to(target)
    r = run_cli("--json", "shred", "--yes")
    assert r.code == 0, r
    assert target.read_bytes() == VICTIM_TEXT
    assert gone(vault_db)
    assert {"name": link.name, "size": 0, "kind": "symbolic link"} in r.json()["files"]


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.sweep
def test_link_beside_a_healthy_vault_is_never_written_through(
    vault: Any, vault_db: Path, tmp_path: Path, side: str
) -> None:
    add_items(vault_db, "s", [user("x")])
    checkpoint(vault_db)
    vid = vault.vault_id
    target = victim(tmp_path)
    link = vault_db.with_name(vault_db.name + side)
    if os.path.lexists(link):
        link.unlink()
    link.symlink_to(target)
    # Any other command refuses, naming the link, and writes nothing through it.
    one_line(run_cli("clear", "s", "--yes"), 1, link.name, "symbolic link", "move it away")
    assert target.read_bytes() == VICTIM_TEXT
    # shred removes the link itself and destroys the vault.
    r = run_cli("shred", "--yes")
    assert r.code == 0, r
    assert "symbolic link removed, not followed" in r.out
    assert target.read_bytes() == VICTIM_TEXT and gone(vault_db)
    assert keyring_entries(vid) == {}


def test_init_refuses_a_dangling_link_at_a_side_file(vault_db: Path, tmp_path: Path) -> None:
    vault_db.parent.mkdir()
    target = tmp_path / "would-be-created"
    vault_db.with_name(vault_db.name + "-wal").symlink_to(target)
    r = run_cli("init")
    assert r.code == 1 and "exists without its database" in r.err, r
    assert not target.exists() and not vault_db.exists()


def test_import_shred_source_refuses_a_linked_side_file(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    src = tmp_path / "carnet.db"
    make_plain(src, {"carnet-local": [user("keep me")]})
    target = victim(tmp_path)
    shm = src.with_name(src.name + "-shm")
    if os.path.lexists(shm):
        shm.unlink()
    shm.symlink_to(target)
    before = src.read_bytes()
    one_line(
        run_cli("import", str(src), "--shred-source", "--yes"),
        1,
        shm.name,
        "symbolic link",
        "nothing was imported",
    )
    assert target.read_bytes() == VICTIM_TEXT
    assert src.read_bytes() == before and shm.is_symlink()
    assert vault.session_ids() == []


# --------------------------------------------------------------------------
# FIFOs, devices, sockets
# --------------------------------------------------------------------------
def _special(tmp_path: Path, what: str) -> tuple[Path, Any]:
    if what == "FIFO":
        p = tmp_path / "fifo.db"
        os.mkfifo(p)
        return p, None
    if what == "socket":
        p = tmp_path / "sock.db"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        return p, s
    return Path("/dev/zero"), None


@pytest.mark.parametrize("what", ["FIFO", "socket", "device"])
@pytest.mark.parametrize(
    "args", [["status"], ["show", "s"], ["shred", "--yes"], ["sessions"], ["init"]]
)
@pytest.mark.sweep
def test_fifo_device_or_socket_is_not_a_vault(tmp_path: Path, what: str, args: list[str]) -> None:
    path, keep = _special(tmp_path, what)
    try:
        r = run_cli("--db", str(path), *args, timeout=HANG)
        word = "FIFO (named pipe)" if what == "FIFO" else what
        one_line(r, 3, f"is a {word}, not a vault file")
        assert stat.S_ISFIFO(path.stat().st_mode) if what == "FIFO" else True
    finally:
        if keep is not None:
            keep.close()


@pytest.mark.parametrize("what", ["FIFO", "device"])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.sweep
def test_fifo_or_device_at_a_side_file_is_refused_then_unlinked_by_shred(
    vault: Any, vault_db: Path, side: str, what: str
) -> None:
    add_items(vault_db, "s", [user("x")])
    checkpoint(vault_db)
    vid = vault.vault_id
    entry = vault_db.with_name(vault_db.name + side)
    if os.path.lexists(entry):
        entry.unlink()
    if what == "FIFO":
        os.mkfifo(entry)
    else:  # /dev/null's numbers: a character device (root may make one, as CI runs)
        os.mknod(entry, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    kind = stat.S_IFMT(os.lstat(entry).st_mode)
    # Never opened: a FIFO would block the command, SQLite would write to the device.
    one_line(run_cli("clear", "s", "--yes", timeout=HANG), 1, entry.name, "move it away")
    one_line(run_cli("show", "s", timeout=HANG), 1, entry.name, "move it away")
    assert stat.S_IFMT(os.lstat(entry).st_mode) == kind
    r = run_cli("--json", "shred", "--yes", timeout=HANG)
    assert r.code == 0, r
    assert entry.name in [f["name"] for f in r.json()["files"]]
    assert gone(vault_db) and keyring_entries(vid) == {}


def test_import_of_a_fifo_is_refused(vault: Any, tmp_path: Path) -> None:
    fifo = tmp_path / "carnet.db"
    os.mkfifo(fifo)
    one_line(run_cli("import", str(fifo), "--yes", timeout=HANG), 2, "is a FIFO")


# --------------------------------------------------------------------------
# The receipt
# --------------------------------------------------------------------------
def _intact(vault: Any, vault_db: Path, before: bytes) -> None:
    assert raw_bytes(vault_db) == before
    assert keyring.get_password("memvault", key_entry(vault))
    assert "shred_started" not in meta(vault_db)


def test_receipt_at_a_link_is_refused_before_anything_is_destroyed(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("x")])
    target = victim(tmp_path)
    link = tmp_path / "receipt.json"
    link.symlink_to(target)
    before = raw_bytes(vault_db)
    one_line(run_cli("shred", "--yes", "--receipt", str(link)), 2, "symbolic link")
    assert target.read_bytes() == VICTIM_TEXT
    _intact(vault, vault_db, before)


def test_existing_receipt_is_never_replaced(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    old = tmp_path / "receipt.json"
    old.write_text("an earlier receipt\n")
    old.chmod(0o644)
    before = raw_bytes(vault_db)
    one_line(run_cli("shred", "--yes", "--receipt", str(old)), 2, "already exists", "new file name")
    assert old.read_text() == "an earlier receipt\n"
    _intact(vault, vault_db, before)
    # A new name works, and the receipt is 0600 whatever the umask.
    new = tmp_path / "new-receipt.json"
    r = run_cli("shred", "--yes", "--receipt", str(new))
    assert r.code == 0, r
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    assert json.loads(new.read_text())["items"] == 1


def test_receipt_in_a_missing_folder_destroys_nothing(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("x")])
    before = raw_bytes(vault_db)
    one_line(
        run_cli("shred", "--yes", "--receipt", str(tmp_path / "no-such-dir" / "r.json")),
        2,
        "does not exist",
    )
    _intact(vault, vault_db, before)


# --------------------------------------------------------------------------
# Damaged vaults
# --------------------------------------------------------------------------
def test_shred_of_a_truncated_vault_destroys_its_key_and_files(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("y" * 3000) for _ in range(20)])
    checkpoint(vault_db)
    vid = vault.vault_id
    size = vault_db.stat().st_size
    with open(vault_db, "r+b") as fh:
        fh.truncate(size - 4096 * 3)
    r = run_cli("--json", "shred", "--yes")
    assert r.code == 0, r
    report = r.json()
    assert report["vault_id"] == vid and report["key_destroyed"] is True and report["damaged"]
    assert keyring_entries(vid) == {}
    assert gone(vault_db)


def test_shred_of_a_vault_with_a_damaged_page_one(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("z")])
    checkpoint(vault_db)
    vid = vault.vault_id
    with open(vault_db, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xa5" * 3996)  # page 1's b-tree (the schema) is garbage; the header is not
    assert run_cli("status").code != 0
    r = run_cli("shred", "--yes")
    assert r.code == 0, r
    assert "damaged file, contents not counted; key destroyed" in r.out
    assert keyring_entries(vid) == {}
    assert gone(vault_db)


def test_shred_of_a_vault_too_damaged_to_name_its_key_says_so(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("z")])
    checkpoint(vault_db)
    vid = vault.vault_id
    data = vault_db.read_bytes()
    data = data[:100] + b"\x00" * 3996 + data[4096:].replace(b"vault_id", b"xxxxxxxx")
    vault_db.write_bytes(data)
    r = run_cli("shred", "--yes")
    assert r.code == 0, r
    assert "key not destroyed" in r.out and "keyring entry (service `memvault`)" in r.out
    entries = keyring_entries(vid)
    assert entries  # not named, so not touched
    assert gone(vault_db)
    for name in entries:
        keyring.delete_password("memvault", name)


def test_shred_of_a_plain_file_still_refuses(vault_db: Path) -> None:
    vault_db.parent.mkdir()
    vault_db.write_bytes(b"my thesis, not a vault\n" * 100)
    one_line(run_cli("shred", "--yes"), 3, "not a SQLite database")
    assert vault_db.read_bytes() == b"my thesis, not a vault\n" * 100


# --------------------------------------------------------------------------
# Refused shreds leave nothing behind; interrupted ones show
# --------------------------------------------------------------------------
def test_shred_refused_by_the_keyring_leaves_no_marker(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("a"), user("b")])
    one_line(run_cli("shred", "--yes", env=FAIL_KEYRING), 4, "keyring")
    assert "shred_started" not in meta(vault_db)
    assert keyring.get_password("memvault", key_entry(vault))
    st = run_cli("--json", "status")
    assert st.code == 0 and st.json()["shred_interrupted"] is False, st
    add_items(vault_db, "s", [user("c"), user("d")])
    receipt = tmp_path / "receipt.json"
    r = run_cli("shred", "--yes", "--receipt", str(receipt))
    assert r.code == 0, r
    report = json.loads(receipt.read_text())
    assert (report["resumed"], report["items"], report["key_destroyed"]) == (False, 4, True)


def test_status_shows_an_interrupted_shred(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("a")])
    r = run_cli("shred", "--yes", env={"MEMVAULT_FAILPOINT": "shred-after-key"})
    assert r.code == -9, r
    st = run_cli("status")
    assert "shred      interrupted: run `memvault shred` again" in st.out, st
    assert run_cli("--json", "status").json()["shred_interrupted"] is True
    r = run_cli("--json", "shred", "--yes")
    assert r.code == 0 and r.json()["items"] == 1 and r.json()["resumed"], r


# --------------------------------------------------------------------------
# Checks before anything is destroyed or asked
# --------------------------------------------------------------------------
def test_shred_in_a_read_only_folder_destroys_nothing(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    before = raw_bytes(vault_db)
    vault_db.parent.chmod(0o555)
    try:
        one_line(as_ordinary_user("shred", "--yes"), 1, "not writable", "nothing was destroyed")
        assert raw_bytes(vault_db) == before
    finally:
        vault_db.parent.chmod(0o700)
    assert keyring.get_password("memvault", key_entry(vault))
    assert "shred_started" not in meta(vault_db)
    assert len(vault.session_ids()) == 1


def test_shred_checks_the_vault_exists_before_asking(vault_db: Path) -> None:
    r = run_cli("shred", input="y\n")
    one_line(r, 3, "no vault at")
    assert "Destroy" not in r.err


def test_shred_refuses_a_sqlite_file_that_is_no_vault_before_asking(tmp_path: Path) -> None:
    other = tmp_path / "app.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('keep me')")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    r = run_cli("--db", str(other), "shred", input="y\n")
    one_line(r, 3, "not a memvault vault")
    assert "Destroy" not in r.err and other.read_bytes() == before


def test_shred_prompt_names_the_vault(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    before = raw_bytes(vault_db)
    r = run_cli("shred", input="n\n")
    assert r.code == 1, r
    assert f"Destroy the vault {vault.vault_id} at {vault_db}" in r.err
    assert raw_bytes(vault_db) == before


def test_empty_receipt_path_destroys_nothing(vault: Any, vault_db: Path) -> None:
    # `--receipt "$UNSET"` must not mean "no receipt": the user asked for one.
    add_items(vault_db, "s", [user("x")])
    before = raw_bytes(vault_db)
    one_line(run_cli("shred", "--yes", "--receipt", ""), 2, "receipt path is empty")
    _intact(vault, vault_db, before)
