"""A copy given back the meta rows of a key source the vault's keys have left.

The key source and the wrapped keys are meta rows no MAC covers: anyone who can write
the file can give a later copy the rows of an earlier stay, and the copy then opens
through that source. `key move` marks the anchor it leaves there (chainanchor.leave),
so that such a file is judged a copy from before the move, whatever its point; `accept`
takes it on purpose. Real OpenBao server, real keyring for the operator, real `memvault`
subprocesses for the hosts, which hold only a token."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests import baoserver
from tests.conftest import ROOT, user
from tests.keys.test_key_move import keyring_write, source_rows
from tests.keys.test_transit_vaults import (
    HOST_WRITES,
    cli_at,
    host_env,
    host_write,
    operator_env,
)
from tests.security.test_transit_anchor import one_line, service, told, vault_id
from tests.security.test_vault_head import unbound
from tests.security.test_whole_file_rollback import copy_of, file_seq, put_back
from vault import chain, chainanchor, chainvault
from vault.chaincheck import Tamper
from vault.chainvault import VaultHead
from vault.keyjournal import entry_name
from vault.keys import KeyStore

pytestmark = [pytest.mark.secret_service, *baoserver.MARKS]


def give_rows(db: Path, rows: dict[str, str]) -> None:
    """The file's key source rows replaced by `rows`, as an attacker with the file can."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute(
            "DELETE FROM memvault_meta WHERE key IN ('key_source', 'transit_mount') "
            "OR key LIKE 'wrapped_key:%'"
        )
        conn.executemany("INSERT INTO memvault_meta (key, value) VALUES (?, ?)", rows.items())
    finally:
        conn.close()


def moved_keeping_the_keyrings_key(
    db: str, op: dict[str, str], key: str, tmp_path: Path
) -> dict[str, str]:
    """A keyring vault with one turn, backed up, then moved to the transit key `key`:
    this host's keyring keeps the key for the backup. Returns the keyring days' source
    rows, as an attacker with the file can keep them."""
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    rows = source_rows(db)
    assert cli_at(db, op, "backup", str(tmp_path / "b.db")).returncode == 0
    moved = cli_at(db, op, "--json", "key", "move", f"transit:{key}")
    assert moved.returncode == 0 and json.loads(moved.stdout)["kept_in_keyring"], moved.stderr
    return rows


def keyring_master(db: Path) -> str:
    """The vault's current master key, from this host's keyring (the test's own)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        meta = dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
    master = KeyStore().get(entry_name(meta["vault_id"], meta["kid"]))
    assert master is not None
    return str(master)


def made_by_0_2(copy: Path, master: str) -> None:
    """The copy's vault head as 0.2 sealed it, bound to no key source: a copy made
    before this release, which only the anchor's mark tells."""
    with contextlib.closing(sqlite3.connect(copy, isolation_level=None)) as conn:
        (text,) = conn.execute("SELECT head FROM memvault_vault_head").fetchone()
        vh = VaultHead.decode(text)
        assert vh is not None and vh.version == "v2"
        old = unbound(chain.chain_key(master, vault_id(copy)), vh)
        conn.execute("UPDATE memvault_vault_head SET head = ?", (old.encode(),))


def stored_head(db: Path) -> VaultHead:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (text,) = conn.execute("SELECT head FROM memvault_vault_head").fetchone()
    vh = VaultHead.decode(text)
    assert vh is not None
    return vh


def test_a_vault_head_from_0_2_is_bound_to_its_source_by_the_first_command(
    tmp_path: Path, vault_db: Path
) -> None:
    """As the command loads the key, at the same point, so that the anchor and the
    backups' seals still name its state: a read-only command does it too, and a backup
    made by that first command is bound as well. A command that finds the write lock
    taken does not wait for it: a later one binds it."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    master = keyring_master(vault_db)
    made_by_0_2(vault_db, master)
    before = stored_head(vault_db)
    assert before.version == "v1"
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as writer:
        writer.execute("BEGIN IMMEDIATE")  # another process's write under way
        waited = cli_at(db, {**op, "MEMVAULT_LOCK_TIMEOUT": "600"}, "verify")
        assert waited.returncode == 0, waited.stderr  # cli_at's own timeout: no wait
        assert stored_head(vault_db) == before
    backed_up = cli_at(db, op, "backup", str(tmp_path / "b.db"))
    assert backed_up.returncode == 0, backed_up.stderr
    after = stored_head(vault_db)
    assert after.version == "v2" and after.point() == before.point()
    assert stored_head(tmp_path / "b.db").version == "v2"
    assert cli_at(db, op, "verify").returncode == 0
    key = chain.chain_key(master, vault_id(vault_db))
    assert chainvault.vault_head_ok(key, after, "keyring@")
    assert not chainvault.vault_head_ok(key, after, "transit:any@transit")


def test_a_backup_copied_from_a_0_2_vault_head_is_bound_as_it_is_sealed(
    tmp_path: Path, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live vault's open binds its head only if the write lock is free at once: the
    copy a backup took meanwhile is bound in the backup's own transaction, as its point
    is sealed into it."""
    from vault import Vault
    from vault.engines.sqlite.backup import mark_as_backup

    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    made_by_0_2(vault_db, keyring_master(vault_db))
    copy = copy_of(vault_db, tmp_path / "copy.db")  # taken before the open bound the live one
    live = Vault.open(db)
    floor = live.anchor_floor()
    with contextlib.closing(sqlite3.connect(copy, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        mark_as_backup(live.vault_id, "b1", db, sealer=live.sealer, floor=floor)(conn)
        conn.execute("COMMIT")
    bound = stored_head(copy)
    assert bound.version == "v2" and bound.point() == stored_head(vault_db).point()


def test_a_vault_heads_clear_source_edited_is_told_by_readers_and_writers(
    tmp_path: Path, vault_db: Path
) -> None:
    """A write checks the head's source where it stands in clear; a reader checks that
    it is the one the rows name, so the two never disagree about the same file."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    text = stored_head(vault_db).encode()
    parts = text.split(".")
    parts[4] = b"transit:elsewhere@transit".hex()
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("UPDATE memvault_vault_head SET head = ?", (".".join(parts),))
    told(cli_at(db, op, "--json", "verify"), Tamper.VAULT_MISMATCH)
    one_line(cli_at(db, op, "show", "s1"), 1)
    proc = subprocess.run(
        [sys.executable, "-c", HOST_WRITES, db, "s1", "k2", "any"],
        capture_output=True, text=True, env=op, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "do not match its vault head" in proc.stderr, proc.stderr


def test_rows_changed_under_an_open_session_do_not_stop_its_anchor(
    key: str, tmp_path: Path, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its writes go on (its vault head is still sealed for its source), and so do its
    records: a copy from between them, put back with the rows restored, is behind."""
    import asyncio

    import vault

    db, op = str(vault_db), operator_env(tmp_path)
    keyring_rows = moved_keeping_the_keyrings_key(db, op, key, tmp_path)
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "t1")
    transit_rows = source_rows(db)
    monkeypatch.setenv("VAULT_ADDR", op["VAULT_ADDR"])
    monkeypatch.setenv("VAULT_TOKEN", op["VAULT_TOKEN"])

    async def go() -> Path:
        session = vault.open_session("s1", db, anchor_every=0)
        try:
            give_rows(vault_db, keyring_rows)
            await session.add_items([{"role": "user", "content": "t2"}])
            older = copy_of(vault_db, tmp_path / "between.db")
            await session.add_items([{"role": "user", "content": "t3, taken away"}])
            return older
        finally:
            session.close()

    older = asyncio.run(go())
    put_back(older, vault_db)
    give_rows(vault_db, transit_rows)
    told(cli_at(db, host, "--json", "verify"))


def test_a_move_whose_key_cannot_be_loaded_moves_nothing(
    key: str, tmp_path: Path, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Switched without sealing its vault head for the new source, the vault would be a
    mismatch to every reader."""
    from vault import Vault, keymove
    from vault.errors import KeyProblem

    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    monkeypatch.setenv("VAULT_ADDR", op["VAULT_ADDR"])
    monkeypatch.setenv("VAULT_TOKEN", op["VAULT_TOKEN"])
    opened = Vault.open(db)

    def no_key(refresh: bool = False) -> None:
        raise KeyProblem("the key source did not answer")

    monkeypatch.setattr(opened, "sealer", no_key)
    with pytest.raises(KeyProblem, match="could not be loaded to seal the move"):
        keymove.move(opened, f"transit:{key}")
    assert source_rows(db) == {}
    assert cli_at(db, op, "verify").returncode == 0


# How the attacker gives the rows back: as they were, or naming the same mount otherwise
# (no row: the default mount; a trailing slash, as `bao secrets list` spells it).
GIVEN = {
    "as-they-were": lambda rows: rows,
    "no-mount-row": lambda rows: {k: v for k, v in rows.items() if k != "transit_mount"},
    "slash": lambda rows: {**rows, "transit_mount": rows["transit_mount"] + "/"},
}


@pytest.mark.parametrize(
    ("given", "made_by"),
    [("as-they-were", "0.2"), ("no-mount-row", "0.2"), ("slash", "0.2"), ("as-they-were", "0.3")],
)
def test_a_keyring_days_copy_given_the_transit_days_rows_is_told(
    key: str, tmp_path: Path, vault_db: Path, given: str, made_by: str
) -> None:
    """The copy is newer than the point the move back left in the service. Its vault
    head, sealed for the keyring, does not match the rows naming the transit key; one
    made by 0.2 is bound to no source, and the mark the move back left in the service
    tells it: the vault is no longer a transit vault, so no host takes it. Accepted on
    purpose, it is a transit vault again: a rerun of the move to it is no alarm."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "through the service")
    transit_rows = source_rows(db)
    assert cli_at(db, op, "key", "move", "keyring").returncode == 0
    keyring_write(db, op, "s1", "k1")
    older = copy_of(vault_db, tmp_path / "keyring-days.db")
    if made_by == "0.2":
        made_by_0_2(older, keyring_master(vault_db))
    keyring_write(db, op, "s1", "k2, the turn a rollback takes away")
    put_back(older, vault_db)
    give_rows(vault_db, GIVEN[given](transit_rows))

    refused = cli_at(db, host, "--json", "verify")
    if made_by == "0.2":
        told(refused)
        says = "older than the state memvault recorded"
    else:
        told(refused, Tamper.VAULT_MISMATCH)
        says = "do not match its vault head"
    assert says in one_line(cli_at(db, host, "show", "s1"), 1)
    one_line(cli_at(db, host, "pop", "s1", "--yes"), 1)
    # Taken on purpose, it is a transit vault again, and no longer marked.
    accepted = cli_at(db, host, "--json", "accept", "--yes")
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads(accepted.stdout)["matched"] is False
    assert cli_at(db, host, "verify").returncode == 0
    assert host_write(db, host, "s1", "after") == ["through the service", "k1", "after"]
    assert not chainanchor.floor(service(key), vault_id(vault_db)).left
    again = cli_at(db, op, "--json", "key", "move", f"transit:{key}")
    assert again.returncode == 0 and json.loads(again.stdout)["already"], again.stderr
    assert cli_at(db, host, "verify").returncode == 0


def test_a_transit_days_copy_given_the_keyring_days_rows_is_told_on_a_host_keeping_the_key(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """This host keeps the key in its keyring for a backup, and its keyring's anchor is
    the point of the move (unmarked: a keyring is one host's). The copy is past that
    point; its vault head, sealed for the transit key, no longer matches the rows that
    name the keyring. Accepted on purpose, it is a keyring vault again."""
    db, op = str(vault_db), operator_env(tmp_path)
    keyring_rows = moved_keeping_the_keyrings_key(db, op, key, tmp_path)
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "t1")
    older = copy_of(vault_db, tmp_path / "transit-days.db")
    host_write(db, host, "s1", "t2, the turn a rollback takes away")
    put_back(older, vault_db)
    give_rows(vault_db, keyring_rows)

    told(cli_at(db, op, "--json", "verify"), Tamper.VAULT_MISMATCH)
    assert "do not match its vault head" in one_line(cli_at(db, op, "show", "s1"), 1)
    one_line(cli_at(db, op, "pop", "s1", "--yes"), 1)
    accepted = cli_at(db, op, "--json", "accept", "--yes")
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads(accepted.stdout)["matched"] is False
    assert keyring_write(db, op, "s1", "after") == ["k1", "t1", "after"]
    assert cli_at(db, op, "verify").returncode == 0


def rebuilt_with_a_second_source_row(db: Path, rows: dict[str, str]) -> None:
    """`rows` added beside the file's own source rows: the meta table rebuilt without its
    key, indexed so that a lookup by key and a full scan find the rows in another order
    (a reader could then choose its key source by one and judge the vault by the other)."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        own = conn.execute("SELECT key, value FROM memvault_meta ORDER BY rowid").fetchall()
        conn.execute("BEGIN")
        conn.execute("DROP TABLE memvault_meta")
        conn.execute("CREATE TABLE memvault_meta (key TEXT, value TEXT NOT NULL)")
        conn.execute("CREATE INDEX m ON memvault_meta (key, value, value || value)")
        conn.executemany("INSERT INTO memvault_meta VALUES (?, ?)", [*own, *rows.items()])
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_a_copy_given_a_second_source_row_is_told(key: str, tmp_path: Path, vault_db: Path) -> None:
    db, op = str(vault_db), operator_env(tmp_path)
    moved_keeping_the_keyrings_key(db, op, key, tmp_path)
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "t1")
    older = copy_of(vault_db, tmp_path / "transit-days.db")
    host_write(db, host, "s1", "t2, the turn a rollback takes away")
    put_back(older, vault_db)
    rebuilt_with_a_second_source_row(vault_db, {"key_source": "keyring"})

    told(cli_at(db, op, "--json", "verify"), Tamper.VAULT_MISMATCH)
    one_line(cli_at(db, op, "show", "s1"), 1)
    # Not to be taken as it is: sealed for either row, the other would still open it.
    assert "source row twice" in one_line(cli_at(db, op, "accept", "--yes"), 1)
    told(cli_at(db, op, "--json", "verify"), Tamper.VAULT_MISMATCH)


@pytest.mark.parametrize("way", ["to-the-keyring", "back-to-transit"])
def test_a_session_whose_files_source_rows_change_under_it_serves_nothing(
    key: str, tmp_path: Path, vault_db: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """The session loaded its key and its floor through one source; the file then names
    the other (the same key, kept in this host's keyring for a backup). Judged by the
    floor it holds, a copy of the other source's days would pass: it reads nothing and
    says to open the vault again, and writes nothing to a file whose vault head is
    sealed for the other source (a write reads no meta row: the vault head says it).
    `to-the-keyring`: the live file given the keyring's rows. `back-to-transit`: a
    transit-days copy put back, given the keyring's rows while the session opened (so it
    chose the keyring and its older point), then its own."""
    import asyncio

    import vault
    from vault.errors import VaultBusy

    db, op = str(vault_db), operator_env(tmp_path)
    keyring_rows = moved_keeping_the_keyrings_key(db, op, key, tmp_path)
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "t1")
    transit_rows = source_rows(db)
    if way == "back-to-transit":
        older = copy_of(vault_db, tmp_path / "transit-days.db")
        host_write(db, host, "s1", "t2, the turn a rollback takes away")
        put_back(older, vault_db)
        give_rows(vault_db, keyring_rows)
    monkeypatch.setenv("VAULT_ADDR", op["VAULT_ADDR"])
    monkeypatch.setenv("VAULT_TOKEN", op["VAULT_TOKEN"])
    session = vault.open_session("s1", db)
    try:
        give_rows(vault_db, keyring_rows if way == "to-the-keyring" else transit_rows)
        with pytest.raises(VaultBusy, match="open the vault again"):
            asyncio.run(session.get_items())
        if way == "back-to-transit":  # nor is the older copy carried forward by a write
            with pytest.raises(VaultBusy, match="open the vault again"):
                asyncio.run(session.add_items([{"role": "user", "content": "not written"}]))
    finally:
        session.close()
    if way == "back-to-transit":
        told(cli_at(db, host, "--json", "verify"))  # opened again: the copy is told


def test_the_keyring_a_move_leaves_is_not_marked(key: str, tmp_path: Path, vault_db: Path) -> None:
    """A keyring is one host's: marked, it would go on refusing the vault on this host
    after the vault came back to the keyring through another host, since this host
    keeps a version of the key for a backup. The recorded point stays, unmarked."""
    db, op = str(vault_db), operator_env(tmp_path)
    moved_keeping_the_keyrings_key(db, op, key, tmp_path)
    kept = chainanchor.floor(KeyStore(), vault_id(vault_db))
    assert kept.point is not None and not kept.left


def test_a_vault_opened_before_another_process_moved_its_keys_is_no_alarm(
    key: str, tmp_path: Path, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its floor, read after the move from the service the file then no longer names,
    is left, but the mark is not about this file: it is told to open the vault again,
    not that the vault was tampered with; opened again, it reads."""
    from vault import Vault
    from vault.errors import VaultBusy

    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    host_write(db, host_env(tmp_path, baoserver.host_token(key)), "s1", "t1")
    monkeypatch.setenv("VAULT_ADDR", op["VAULT_ADDR"])
    monkeypatch.setenv("VAULT_TOKEN", op["VAULT_TOKEN"])
    opened = Vault.open(db)
    opened.sealer()
    assert cli_at(db, op, "key", "move", "keyring").returncode == 0
    assert chainanchor.floor(service(key), opened.vault_id).left
    with pytest.raises(VaultBusy, match="open the vault again"):
        opened.history_verdict("s1")
    assert Vault.open(db).history_verdict("s1") is None


@pytest.mark.parametrize("sid", ["s1", "fresh"], ids=["with-history", "new-session"])
def test_a_session_open_across_a_key_move_and_a_rotation_is_told_to_open_the_vault_again(
    key: str, tmp_path: Path, vault_db: Path, monkeypatch: pytest.MonkeyPatch, sid: str
) -> None:
    """Another process moves the keys to transit, then rotates: the session's key is
    stale, and the source it loaded it through is left. Its write is told to open the
    vault again, as a read is, and writes nothing; it is not sent to reload the key
    through a keyring that holds no new version. Opened again, it writes."""
    import asyncio

    import vault
    from vault.errors import VaultBusy

    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "t1")
    session = vault.open_session(sid, db)
    try:
        assert len(asyncio.run(session.get_items())) == (sid == "s1")
        assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
        assert cli_at(db, op, "rotate").returncode == 0
        before = file_seq(vault_db)
        with pytest.raises(VaultBusy, match="open the vault again"):
            asyncio.run(session.add_items([user("not written")]))
        assert file_seq(vault_db) == before
    finally:
        session.close()
    monkeypatch.setenv("VAULT_ADDR", op["VAULT_ADDR"])
    monkeypatch.setenv("VAULT_TOKEN", op["VAULT_TOKEN"])
    again = vault.open_session(sid, db)
    try:
        asyncio.run(again.add_items([user("written")]))
        assert asyncio.run(again.get_items())[-1] == user("written")
    finally:
        again.close()


def test_a_restore_over_a_source_whose_anchor_memvault_did_not_write_succeeds(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db, op = str(vault_db), operator_env(tmp_path)
    moved_keeping_the_keyrings_key(db, op, key, tmp_path)
    anchors, name = service(key), chainanchor.entry_name(vault_id(vault_db))
    anchors.get(name)  # the version its check-and-set write is against
    anchors.set(name, "a2.5.zz")
    restored = cli_at(db, op, "restore", str(tmp_path / "b.db"), "--yes")
    assert restored.returncode == 0, restored.stderr
    assert "Traceback" not in restored.stderr
    assert cli_at(db, op, "verify").returncode == 0


def test_a_copy_of_the_file_a_restore_from_another_source_replaced_is_told(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """A keyring backup restored over the vault's transit days: the transit file, put
    back, is judged by the service's anchor, which the restore marked as left."""
    db, op = str(vault_db), operator_env(tmp_path)
    moved_keeping_the_keyrings_key(db, op, key, tmp_path)
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "t1")
    transit_days = copy_of(vault_db, tmp_path / "transit-days.db")
    restored = cli_at(db, op, "restore", str(tmp_path / "b.db"), "--yes")
    assert restored.returncode == 0, restored.stderr
    assert cli_at(db, op, "verify").returncode == 0
    put_back(transit_days, vault_db)

    told(cli_at(db, host, "--json", "verify"))
    one_line(cli_at(db, host, "show", "s1"), 1)


@pytest.mark.parametrize(("made", "moved"), [("transit", "transit/"), ("/transit", "transit")])
def test_a_move_to_the_same_key_with_its_mount_spelled_otherwise_is_no_alarm(
    key: str, tmp_path: Path, vault_db: Path, made: str, moved: str
) -> None:
    db, op = str(vault_db), operator_env(tmp_path)
    init = cli_at(db, op, "init", "--key-source", f"transit:{key}", "--transit-mount", made)
    assert init.returncode == 0, init.stderr
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "t1")
    again = cli_at(db, op, "--json", "key", "move", f"transit:{key}", "--transit-mount", moved)
    assert again.returncode == 0 and json.loads(again.stdout)["already"], again.stderr
    assert cli_at(db, host, "verify").returncode == 0
    assert not chainanchor.floor(service(key), vault_id(vault_db)).left


def test_a_move_cut_off_after_its_switch_then_made_elsewhere_still_marks_the_first_key(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """The cut-off move can no longer be run again once the vault has moved on: the next
    move, whatever its target, marks the key the cut-off one left."""
    second = baoserver.key_name()
    try:
        db, op = str(vault_db), operator_env(tmp_path)
        assert cli_at(db, op, "init", "--key-source", f"transit:{key}").returncode == 0
        host = host_env(tmp_path, baoserver.host_token(key))
        host_write(db, host, "s1", "t1")
        first_rows = source_rows(db)
        cut = cli_at(
            db, {**op, "MEMVAULT_FAILPOINT": "key-move-after-switch"}, "key", "move", "keyring"
        )
        assert cut.returncode < 0, cut.stderr  # killed just after its switch committed
        keyring_write(db, op, "s1", "k1")
        master = keyring_master(vault_db)
        assert cli_at(db, op, "key", "move", f"transit:{second}").returncode == 0
        other = host_env(tmp_path, baoserver.host_token(second))
        host_write(db, other, "s1", "b1")
        older = copy_of(vault_db, tmp_path / "older.db")
        made_by_0_2(older, master)  # only the mark tells it (sealed now, its head would)
        host_write(db, other, "s1", "b2, the turn a rollback takes away")
        put_back(older, vault_db)
        give_rows(vault_db, first_rows)
        told(cli_at(db, host, "--json", "verify"))
    finally:
        baoserver.admin_transit(second).delete_key()


def test_an_anchor_entry_memvault_did_not_write_is_no_unexpected_error(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """Judged as no anchor yet, as every reader takes it, and written over by the next
    record: no command stops on it."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init", "--key-source", f"transit:{key}").returncode == 0
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "t1")
    anchors, name = service(key), chainanchor.entry_name(vault_id(vault_db))
    anchors.get(name)
    anchors.set(name, "a1.5.zz.left")
    for args in (["verify"], ["show", "s1"]):
        proc = cli_at(db, host, *args)
        assert proc.returncode == 0 and "unexpected" not in proc.stderr, proc.stderr
    assert chainanchor.read(service(key), vault_id(vault_db)) is not None
