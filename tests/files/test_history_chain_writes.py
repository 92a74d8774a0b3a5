"""Every write path of the file engine keeps the history chain in its own transaction:
after each, `memvault verify` (a real subprocess) finds no tampering and an agent
session reads the whole history. The upgrade links an older file's rows, resumably,
and moves the file to a format older releases refuse."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import vault as vault_pkg
from tests.conftest import ROOT, add_items, assistant, insert_sealed, run_cli, user
from vault import Vault, chainanchor, rotation
from vault.engines.sqlite.schema import FILE_FORMAT, m008_guard_triggers_text_first
from vault.keys import KeyStore


def verifies(db: Path) -> None:
    r = run_cli("--json", "--db", str(db), "verify")
    assert r.code == 0, r
    assert r.json()["problems"]["history_chain"] == 0


def items(db: Path, sid: str, limit: int | None = None) -> list[Any]:
    async def go() -> list[Any]:
        s = vault_pkg.open_session(sid, db)
        try:
            return list(await s.get_items(limit))
        finally:
            s.close()

    return asyncio.run(go())


def head_of(db: Path, sid: str) -> str | None:
    conn = sqlite3.connect(db)
    try:
        row = conn.execute(
            "SELECT head FROM memvault_chain_heads WHERE session_id = ?", (sid,)
        ).fetchone()
        return None if row is None else str(row[0])
    finally:
        conn.close()


def test_a_new_vault_is_chained_in_the_new_format(vault: Vault, vault_db: Path) -> None:
    meta = vault.meta()
    assert meta["format"] == FILE_FORMAT == "memvault/4"
    assert meta["chain"] == "on"


def older_reader_accepts(fmt: str, accepted: tuple[str, ...]) -> bool:
    """The check every release's `Vault.open` makes of the meta's format, as 0.2.0's
    vault/store.py wrote it: `if meta.get("format") not in (FORMAT, LEGACY_FORMAT):`
    raise NotAVault ("unknown memvault format ...; upgrade memvault")."""
    return fmt in accepted


def test_releases_before_the_chain_refuse_an_upgraded_file(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    # What each older release's open accepts: 0.2.0 (vault/schema.py at v0.2.0: FORMAT
    # "memvault/2", LEGACY_FORMAT "memvault/1"), and 0.3 before the chain ("memvault/3"
    # added). A file upgraded by this one, and a new one, are refused by both.
    released = {
        "0.2.0": ("memvault/2", "memvault/1"),
        "0.3 unchained": ("memvault/3", "memvault/2", "memvault/1"),
    }
    add_items(vault_db, "s", [user("one")])
    _unchain(vault_db, keep_heads_of=set())
    conn = sqlite3.connect(vault_db)
    with conn:  # as the release before the chain left it
        conn.execute("UPDATE memvault_meta SET value = 'memvault/3' WHERE key = 'format'")
        conn.execute("DELETE FROM memvault_migrations WHERE name = 'm010_history_chain'")
        conn.execute("DELETE FROM memvault_meta WHERE key = 'chain'")
        conn.execute("DROP TABLE memvault_chain_heads")
        conn.execute("DROP TABLE memvault_vault_head")
        m008_guard_triggers_text_first(conn)  # its guard, which names no chain column
        conn.execute("ALTER TABLE agent_messages DROP COLUMN chain")
    conn.close()
    assert older_reader_accepts("memvault/3", released["0.3 unchained"])  # before: its own
    assert run_cli("show", "s").code == 0  # this release upgrades it
    for accepted in released.values():
        assert not older_reader_accepts(Vault.open(vault_db).meta()["format"], accepted)
    verifies(vault_db)


def test_a_row_without_a_link_is_refused_by_the_guard(vault: Vault, vault_db: Path) -> None:
    sealed = vault.sealer().seal("s", user("no link"))
    conn = sqlite3.connect(vault_db)
    with pytest.raises(sqlite3.IntegrityError, match="refused"), conn:
        conn.execute(
            "INSERT INTO agent_messages (session_id, message_data) VALUES ('s', ?)", (sealed,)
        )
    conn.close()

    from agents import SQLiteSession
    from agents.extensions.memory import EncryptedSession

    async def bare_sdk_writer() -> None:
        sdk = SQLiteSession("s", vault_db)
        s = EncryptedSession("s", sdk, vault.sealer().master_key, ttl=3600)
        s._kid = vault.sealer().kid  # even under the right key id
        try:
            await s.add_items([user("from the bare SDK")])
        finally:
            sdk.close()

    with pytest.raises(sqlite3.IntegrityError, match="refused"):
        asyncio.run(bare_sdk_writer())


def test_the_sdk_session_writes_pops_and_clears_on_the_chain(vault: Vault, vault_db: Path) -> None:
    async def go() -> None:
        s = vault_pkg.open_session("s", vault_db)
        try:
            await s.add_items([user("a"), assistant("b")])
            await s.add_items([user("c")])
            assert (await s.pop_item()) == user("c")
            await s.add_items([user("d"), assistant("e")])
            assert [i["content"] for i in await s.get_items(2)] == ["d", "e"]
            await s.clear_session()
            await s.add_items([user("after the clear")])  # what compaction's replace does
        finally:
            s.close()

    asyncio.run(go())
    verifies(vault_db)
    assert items(vault_db, "s") == [user("after the clear")]


def test_pop_and_clear_commands_keep_the_chain(vault: Vault, vault_db: Path) -> None:
    add_items(vault_db, "s", [user(f"s{i}") for i in range(6)])
    add_items(vault_db, "t", [user(f"t{i}") for i in range(3)])
    assert run_cli("pop", "s", "-n", "2").code == 0
    verifies(vault_db)
    assert run_cli("pop", "t", "-n", "5", "--yes").code == 0  # more than there are
    assert run_cli("clear", "s", "--yes").code == 0
    verifies(vault_db)
    add_items(vault_db, "s", [user("new")])
    add_items(vault_db, "t", [user("again")])
    verifies(vault_db)
    assert items(vault_db, "s") == [user("new")] and items(vault_db, "t") == [user("again")]


def test_purge_is_recorded_by_the_chain(vault: Vault, vault_db: Path) -> None:
    old = int(time.time()) - 7200  # the vault's TTL is an hour
    insert_sealed(vault_db, "s", [user("old 1"), user("old 2")], at=old)
    add_items(vault_db, "s", [user("fresh")])
    insert_sealed(vault_db, "t", [user("gone")], at=old)
    r = run_cli("--json", "purge", "--yes")
    assert r.code == 0 and r.json()["deleted"] == 3, r
    verifies(vault_db)
    assert items(vault_db, "s") == [user("fresh")]
    add_items(vault_db, "t", [user("after the purge")])
    verifies(vault_db)


def test_an_expired_item_after_a_fresh_one_waits_for_those_before_it(
    vault: Vault, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user("fresh")])
    insert_sealed(vault_db, "s", [user("older stamp, later row")], at=int(time.time()) - 7200)
    r = run_cli("--json", "purge", "--yes")
    assert r.code == 0 and r.json()["deleted"] == 0 and r.json()["kept"] == 2, r
    verifies(vault_db)


def test_import_writes_the_chain(vault: Vault, vault_db: Path, tmp_path: Path) -> None:
    from agents import SQLiteSession

    src = tmp_path / "plain.db"

    async def plain() -> None:
        sdk = SQLiteSession("imported", src)
        await sdk.add_items([user(f"plain {i}") for i in range(4)])
        sdk.close()

    asyncio.run(plain())
    assert run_cli("import", str(src), "--yes").code == 0
    verifies(vault_db)
    add_items(vault_db, "imported", [user("after")])
    verifies(vault_db)
    assert len(items(vault_db, "imported")) == 5


@pytest.mark.parametrize("workers", [False, True], ids=["in-process", "worker-processes"])
def test_rotation_re_macs_every_row(
    vault: Vault, vault_db: Path, monkeypatch: pytest.MonkeyPatch, workers: bool
) -> None:
    add_items(vault_db, "s", [user(f"s{i}") for i in range(5)])
    vault.pop("s")
    add_items(vault_db, "t", [user("t")])
    if workers:
        monkeypatch.setattr(rotation, "PARALLEL_MIN_ROWS", 1)
        assert rotation.parallel(10) > 0, "a machine with one core cannot run this case"
    before = vault.sealer().kid
    Vault.open(vault_db).rotate()
    assert Vault.open(vault_db).meta()["kid"] != before
    verifies(vault_db)
    assert len(items(vault_db, "s")) == 4
    add_items(vault_db, "s", [user("after the rotation")])
    verifies(vault_db)


CUT_OFF_ROTATION = """
import os, sys
from vault import Vault, chainanchor, rotation
rotation.DEFAULT_BATCH = 3
os.environ["MEMVAULT_FAILPOINT"] = "after-batch"
Vault.open(sys.argv[1]).rotate()
"""


def test_a_rotation_cut_off_between_batches_leaves_every_row_verifiable(
    vault: Vault, vault_db: Path
) -> None:
    add_items(vault_db, "s", [user(f"s{i}") for i in range(10)])
    proc = subprocess.run(
        [sys.executable, "-c", CUT_OFF_ROTATION, str(vault_db)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILLed after its first batch
    conn = sqlite3.connect(vault_db)
    kids = {
        r[0] for r in conn.execute("SELECT json_extract(message_data, '$.kid') FROM agent_messages")
    }
    conn.close()
    assert len(kids) == 2, "the kill should leave rows under both keys"
    verifies(vault_db)  # read-only: the rotation is still cut off
    assert len(items(vault_db, "s")) == 10  # this open finishes it
    verifies(vault_db)


def test_a_restored_backup_verifies_and_takes_new_items(
    vault: Vault, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("before the backup")])
    backup = tmp_path / "b.db"
    assert run_cli("backup", str(backup)).code == 0
    add_items(vault_db, "s", [user("after the backup")])
    assert run_cli("restore", str(backup), "--yes").code == 0
    verifies(vault_db)
    add_items(vault_db, "s", [user("after the restore")])
    verifies(vault_db)
    assert items(vault_db, "s") == [user("before the backup"), user("after the restore")]


def _unchain(db: Path, keep_heads_of: set[str]) -> None:
    """The file as m010 leaves it, or as a build cut off after some sessions leaves it;
    and its keyring as it is then: with no anchor yet (the build's end sets it)."""
    conn = sqlite3.connect(db, isolation_level=None)
    (vault_id,) = conn.execute("SELECT value FROM memvault_meta WHERE key = 'vault_id'").fetchone()
    chainanchor.forget(KeyStore(), vault_id)
    conn.execute("UPDATE memvault_meta SET value = 'building' WHERE key = 'chain'")
    conn.execute("DELETE FROM memvault_vault_head")  # written only as the build ends
    for sid in [r[0] for r in conn.execute("SELECT session_id FROM memvault_chain_heads")]:
        if sid not in keep_heads_of:
            conn.execute("DELETE FROM memvault_chain_heads WHERE session_id = ?", (sid,))
            conn.execute("UPDATE agent_messages SET chain = NULL WHERE session_id = ?", (sid,))
    conn.close()


def test_an_upgrade_cut_off_after_some_sessions_resumes_with_the_rest(
    vault: Vault, vault_db: Path
) -> None:
    add_items(vault_db, "a", [user("a1"), user("a2")])
    add_items(vault_db, "b", [user("b1"), user("b2"), user("b3")])
    kept = head_of(vault_db, "a")
    _unchain(vault_db, keep_heads_of={"a"})
    assert run_cli("sessions").code == 0  # needs no key: links nothing
    assert head_of(vault_db, "b") is None
    verifies(vault_db)  # the first command holding the key links the rest (verify too)
    assert head_of(vault_db, "a") == kept and head_of(vault_db, "b") is not None
    assert [i["content"] for i in items(vault_db, "b")] == ["b1", "b2", "b3"]


def kids_of(db: Path) -> set[str]:
    conn = sqlite3.connect(db)
    try:
        sql = "SELECT json_extract(message_data, '$.kid') FROM agent_messages"
        return {str(r[0]) for r in conn.execute(sql)}
    finally:
        conn.close()


def test_an_upgrade_amid_a_cut_off_rotation_links_each_row_under_its_own_key(
    vault: Vault, vault_db: Path
) -> None:
    """A file of the format before the chain, whose rotation was cut off between batches:
    the upgrade links each row under the key its envelope names, so the rows still under
    the old key verify, and the rotation then moves them with their links."""
    add_items(vault_db, "s", [user(f"s{i}") for i in range(10)])
    proc = subprocess.run(
        [sys.executable, "-c", CUT_OFF_ROTATION, str(vault_db)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len(kids_of(vault_db)) == 2, "the kill should leave rows under both keys"
    _unchain(vault_db, keep_heads_of=set())
    # The first command holding the key links the rows, then finishes the rotation,
    # which moves each old row with its link: every row verifies.
    verifies(vault_db)
    assert kids_of(vault_db) == {Vault.open(vault_db).meta()["kid"]}
    assert [i["content"] for i in items(vault_db, "s")] == [f"s{i}" for i in range(10)]
    verifies(vault_db)


def test_a_row_whose_link_was_edited_moves_to_the_new_key_and_stays_readable(
    vault: Vault, vault_db: Path
) -> None:
    """One edited link makes the session tampered, before and after a rotation; the
    rotation still moves that row to the new key, so the authentic item it holds is not
    lost when the old key is destroyed."""
    add_items(vault_db, "s", [user("one"), user("two"), user("three")])
    conn = sqlite3.connect(vault_db, isolation_level=None)
    (row_id, link) = conn.execute(
        "SELECT id, chain FROM agent_messages WHERE session_id = 's' ORDER BY id LIMIT 1 OFFSET 1"
    ).fetchone()
    edited = link[:-1] + ("0" if link[-1] != "0" else "1")
    conn.execute("UPDATE agent_messages SET chain = ? WHERE id = ?", (edited, row_id))
    conn.close()
    assert run_cli("verify").code == 1
    assert run_cli("rotate").code == 0
    new = Vault.open(vault_db).meta()["kid"]
    assert kids_of(vault_db) == {new}
    r = run_cli("--json", "verify")
    assert r.code == 1 and r.json()["problems"]["history_chain"] == 1, r
    r = run_cli("--json", "show", "s", "--include-tampered")
    assert r.code == 0, r
    assert [i["content"] for i in r.json()["items"]] == ["one", "two", "three"], r
