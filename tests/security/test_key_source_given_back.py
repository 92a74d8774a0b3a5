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
from pathlib import Path

import pytest

from tests import baoserver
from tests.keys.test_key_move import keyring_write, source_rows
from tests.keys.test_transit_vaults import cli_at, host_env, host_write, operator_env
from tests.security.test_transit_anchor import one_line, service
from tests.security.test_whole_file_rollback import copy_of, put_back
from vault import chainanchor
from vault.chaincheck import Tamper
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


def rolled_back(proc: object) -> bool:
    stdout = getattr(proc, "stdout", "")
    assert getattr(proc, "returncode", None) == 1, stdout + getattr(proc, "stderr", "")
    return Tamper.FILE_ROLLED_BACK.value in json.loads(stdout)["details"]["history_chain"][0]


def vault_id_of(db: Path) -> str:
    # Closed at once: a connection left open would make `restore` find the file in use.
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (vid,) = conn.execute("SELECT value FROM memvault_meta WHERE key = 'vault_id'").fetchone()
    return str(vid)


# How the attacker gives the rows back: as they were, or naming the same mount otherwise
# (no row: the default mount; a trailing slash, as `bao secrets list` spells it).
GIVEN = {
    "as-they-were": lambda rows: rows,
    "no-mount-row": lambda rows: {k: v for k, v in rows.items() if k != "transit_mount"},
    "slash": lambda rows: {**rows, "transit_mount": rows["transit_mount"] + "/"},
}


@pytest.mark.parametrize("given", GIVEN)
def test_a_keyring_days_copy_given_the_transit_days_rows_is_told(
    key: str, tmp_path: Path, vault_db: Path, given: str
) -> None:
    """The copy is newer than the point the move back left in the service; the mark
    there says the vault is no longer a transit vault, so no host takes it. Accepted on
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
    keyring_write(db, op, "s1", "k2, the turn a rollback takes away")
    put_back(older, vault_db)
    give_rows(vault_db, GIVEN[given](transit_rows))

    assert rolled_back(cli_at(db, host, "--json", "verify"))
    assert "older than the state memvault recorded" in one_line(cli_at(db, host, "show", "s1"), 1)
    one_line(cli_at(db, host, "pop", "s1", "--yes"), 1)
    # Taken on purpose, it is a transit vault again, and no longer marked.
    accepted = cli_at(db, host, "--json", "accept", "--yes")
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads(accepted.stdout)["matched"] is False
    assert cli_at(db, host, "verify").returncode == 0
    assert host_write(db, host, "s1", "after") == ["through the service", "k1", "after"]
    assert not chainanchor.floor(service(key), vault_id_of(vault_db)).left
    again = cli_at(db, op, "--json", "key", "move", f"transit:{key}")
    assert again.returncode == 0 and json.loads(again.stdout)["already"], again.stderr
    assert cli_at(db, host, "verify").returncode == 0


def test_the_keyring_a_move_leaves_is_not_marked(key: str, tmp_path: Path, vault_db: Path) -> None:
    """A keyring is one host's: marked, it would go on refusing the vault on this host
    after the vault came back to the keyring through another host, since this host
    keeps a version of the key for a backup. The recorded point stays, unmarked."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    assert cli_at(db, op, "backup", str(tmp_path / "b.db")).returncode == 0
    moved = cli_at(db, op, "--json", "key", "move", f"transit:{key}")
    assert moved.returncode == 0 and json.loads(moved.stdout)["kept_in_keyring"], moved.stderr
    kept = chainanchor.floor(KeyStore(), vault_id_of(vault_db))
    assert kept.point is not None and not kept.left


def test_a_vault_opened_before_another_process_moved_its_keys_is_no_alarm(
    key: str, tmp_path: Path, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its floor, read after the move from the service the file then no longer names,
    is left: the mark is not about this file."""
    from vault import Vault

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
    assert opened.history_verdict("s1") is None


def test_a_restore_over_a_source_whose_anchor_memvault_did_not_write_succeeds(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    assert cli_at(db, op, "backup", str(tmp_path / "b.db")).returncode == 0
    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    anchors, name = service(key), chainanchor.entry_name(vault_id_of(vault_db))
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
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    assert cli_at(db, op, "backup", str(tmp_path / "b.db")).returncode == 0
    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "t1")
    transit_days = copy_of(vault_db, tmp_path / "transit-days.db")
    restored = cli_at(db, op, "restore", str(tmp_path / "b.db"), "--yes")
    assert restored.returncode == 0, restored.stderr
    assert cli_at(db, op, "verify").returncode == 0
    put_back(transit_days, vault_db)

    assert rolled_back(cli_at(db, host, "--json", "verify"))
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
    assert not chainanchor.floor(service(key), vault_id_of(vault_db)).left


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
        assert cli_at(db, op, "key", "move", f"transit:{second}").returncode == 0
        other = host_env(tmp_path, baoserver.host_token(second))
        host_write(db, other, "s1", "b1")
        older = copy_of(vault_db, tmp_path / "older.db")
        host_write(db, other, "s1", "b2, the turn a rollback takes away")
        put_back(older, vault_db)
        give_rows(vault_db, first_rows)
        assert rolled_back(cli_at(db, host, "--json", "verify"))
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
    anchors, name = service(key), chainanchor.entry_name(vault_id_of(vault_db))
    anchors.get(name)
    anchors.set(name, "a1.5.zz.left")
    for args in (["verify"], ["show", "s1"]):
        proc = cli_at(db, host, *args)
        assert proc.returncode == 0 and "unexpected" not in proc.stderr, proc.stderr
    assert chainanchor.read(service(key), vault_id_of(vault_db)) is not None
