"""A transit vault's anchor, held by the key service (vault.keysource.transitanchor):
a file put back from an older copy is told on every host, hosts recording at once keep
the newer point, a policy without the anchor's path is told so, and `key move` carries
the anchor between the keyring and the service. Real OpenBao server, real keyring for
the operator, real `memvault` subprocesses for hosts that hold only a token."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests import baoserver
from tests.conftest import ROOT
from tests.keys.test_key_move import keyring_write
from tests.keys.test_transit_vaults import (
    cli_at,
    host_env,
    host_write,
    operator_env,
    transit_vault,
)
from tests.security.test_history_chain_operations_approve_nothing import rows, sql
from tests.security.test_whole_file_rollback import copy_of, file_seq, put_back
from vault import chainanchor
from vault.chain import MAC_BYTES
from vault.chaincheck import Tamper
from vault.chainvault import Point
from vault.keys import KeyStore
from vault.keysource.transitanchor import ServiceAnchor

pytestmark = [pytest.mark.secret_service, *baoserver.MARKS]

# The agent's session on another host, in a process of its own: argv = db, session.
SESSION_READS = """
import asyncio, sys
import vault
async def main():
    s = vault.open_session(sys.argv[2], sys.argv[1])
    try:
        await s.get_items()
    except vault.HistoryTampered as exc:
        print("tampered:", exc.kind)
asyncio.run(main())
"""


def service(key: str) -> ServiceAnchor:
    return ServiceAnchor(baoserver.admin_transit(key))


def vault_id(db: Path) -> str:
    import sqlite3

    # Closed at once: a connection left open would make `restore` find the file in use.
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (vid,) = conn.execute("SELECT value FROM memvault_meta WHERE key = 'vault_id'").fetchone()
    return str(vid)


def told(proc: subprocess.CompletedProcess[str], kind: Tamper = Tamper.FILE_ROLLED_BACK) -> None:
    """`verify --json` exited 1, and its first history problem is of `kind`."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert kind.value in json.loads(proc.stdout)["details"]["history_chain"][0], proc.stdout


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_a_transit_file_put_back_from_an_older_copy_is_told_on_every_host(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    _, writer = transit_vault(db, key, tmp_path, "first")
    older = copy_of(vault_db, tmp_path / "older.db")
    host_write(db, writer, "s1", "the turn a rollback takes away")
    # The session recorded its state in the service as it closed, on a host with no keyring.
    assert chainanchor.read(service(key), vault_id(vault_db)) is not None
    put_back(older, vault_db)
    seq = file_seq(vault_db)

    other = host_env(tmp_path, baoserver.host_token(key))
    verdict = cli_at(db, other, "--json", "verify")
    told(verdict)
    assert "older than the state memvault recorded" in one_line(cli_at(db, other, "show", "s1"), 1)
    session = subprocess.run(
        [sys.executable, "-c", SESSION_READS, db, "s1"],
        capture_output=True, text=True, env=other, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert session.returncode == 0, session.stderr[-2000:]
    assert session.stdout.strip() == f"tampered: {Tamper.FILE_ROLLED_BACK.value}"
    # No write carries it forward; accepted on purpose, it is the vault again.
    one_line(cli_at(db, other, "pop", "s1", "--yes"), 1)
    assert file_seq(vault_db) == seq
    assert cli_at(db, other, "accept", "--yes").returncode == 0
    assert cli_at(db, other, "verify").returncode == 0
    assert host_write(db, other, "s1", "after") == ["first", "after"]


def test_a_transit_file_rewritten_to_look_unchained_is_refused_not_linked_again(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """Its links, heads and vault head deleted, a row taken out, and the file marked as
    not yet upgraded: the service's anchor says it was chained, so no host links it."""
    db = str(vault_db)
    _, host = transit_vault(db, key, tmp_path, "A0")
    for i in range(1, 4):
        host_write(db, host, "s1", f"A{i}")
    for statement in (
        "DELETE FROM agent_messages WHERE id = (SELECT min(id) + 1 FROM agent_messages)",
        "UPDATE agent_messages SET chain = NULL",
        "DELETE FROM memvault_chain_heads",
        "DELETE FROM memvault_vault_head",
        "UPDATE memvault_meta SET value = 'building' WHERE key = 'chain'",
    ):
        sql(vault_db, statement)
    other = host_env(tmp_path, baoserver.host_token(key))
    for args in (["verify"], ["show", "s1"], ["show", "s1", "--include-tampered"]):
        assert "never chained" in one_line(cli_at(db, other, *args), 1)
    assert all(link is None for _i, _t, link in rows(vault_db, "s1"))  # nothing linked


def test_a_host_whose_policy_lacks_the_anchor_is_told_which_path(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    transit_vault(db, key, tmp_path, "kept")
    token = baoserver.token_with(baoserver.HOST_POLICY_WITHOUT_ANCHOR.format(key=key))
    line = one_line(cli_at(db, host_env(tmp_path, token), "show", "s1"), 4)
    assert f"secret/data/memvault/transit/{key}/{vault_id(vault_db)}" in line, line
    assert "host policy" in line and token not in line


def test_the_anchor_mount_is_the_hosts_setting_and_a_missing_one_is_told(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    transit_vault(db, key, tmp_path, "kept")
    elsewhere = {**operator_env(tmp_path), "MEMVAULT_ANCHOR_MOUNT": "no-such-kv"}
    line = one_line(cli_at(db, elsewhere, "show", "s1"), 4)
    assert "no KV version 2 engine at mount no-such-kv/" in line, line
    assert baoserver.ADMIN_TOKEN not in line


def test_hosts_recording_at_once_keep_the_newer_point(key: str) -> None:
    vid = "mv-" + secrets.token_hex(12)
    first, second = service(key), service(key)
    newer = Point(9, secrets.token_bytes(MAC_BYTES))
    assert first.get(chainanchor.entry_name(vid)) is None  # read, then another host records
    assert chainanchor.advance(second, vid, newer) == newer
    with pytest.raises(chainanchor.Raced):
        first.set(chainanchor.entry_name(vid), chainanchor.encode(Point(5, b"\0" * MAC_BYTES)))

    class Interleaved(ServiceAnchor):
        """Another host records between this one's read and its write, once."""

        raced = False

        def get(self, name: str) -> str | None:
            text = super().get(name)
            if not self.raced:
                self.raced = True
                second.get(chainanchor.entry_name(vid))  # its version, for the write
                second.set(chainanchor.entry_name(vid), chainanchor.encode(Point(20, newer.digest)))
            return text

    # `advance` reads again after a race and keeps the newer point.
    assert (
        chainanchor.advance(Interleaved(baoserver.admin_transit(key)), vid, Point(15, b"")).seq
        == 20
    )
    assert chainanchor.read(service(key), vid) == Point(20, newer.digest)
    assert chainanchor.forget(first, vid) is True
    assert chainanchor.read(service(key), vid) is None
    assert chainanchor.advance(first, vid, newer) == newer  # set again after its deletion


def test_a_key_move_carries_the_anchor_between_keyring_and_service(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """Each move steps the file's vault head once and records it in both sources."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "on the keyring")
    vid = vault_id(vault_db)
    on_keyring = chainanchor.read(KeyStore(), vid)
    assert on_keyring is not None and on_keyring.seq == file_seq(vault_db)

    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    in_service = chainanchor.read(service(key), vid)
    assert in_service is not None and in_service.seq == file_seq(vault_db) == on_keyring.seq + 1
    assert chainanchor.read(KeyStore(), vid) is None  # a transit vault keeps none there
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "through the service")
    in_service = chainanchor.read(service(key), vid)
    assert in_service is not None and in_service.seq == file_seq(vault_db)

    assert cli_at(db, op, "key", "move", "keyring").returncode == 0
    back = chainanchor.read(KeyStore(), vid)
    assert back is not None and back.seq == file_seq(vault_db) == in_service.seq + 1
    assert chainanchor.read(service(key), vid) == back


def test_a_copy_from_the_vaults_transit_days_put_back_after_it_moved_back_is_told(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """The copy opens as a transit vault, judged by the service's anchor: the move back
    stepped the file past the copy's very state and recorded that in the service."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "through the service")
    transit_days = copy_of(vault_db, tmp_path / "transit-days.db")  # the state moved back
    assert cli_at(db, op, "key", "move", "keyring").returncode == 0
    keyring_write(db, op, "s1", "on the keyring again")
    put_back(transit_days, vault_db)

    verdict = cli_at(db, host, "--json", "verify")
    told(verdict)
    one_line(cli_at(db, host, "pop", "s1", "--yes"), 1)


def test_shred_of_a_transit_vault_deletes_its_anchor(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    transit_vault(db, key, tmp_path, "kept")
    vid = vault_id(vault_db)
    assert chainanchor.read(service(key), vid) is not None
    assert cli_at(db, operator_env(tmp_path), "shred", "--yes").returncode == 0
    assert chainanchor.read(service(key), vid) is None


UNCHAIN = (
    "UPDATE agent_messages SET chain = NULL",
    "DELETE FROM memvault_chain_heads",
    "DELETE FROM memvault_vault_head",
    "UPDATE memvault_meta SET value = 'building' WHERE key = 'chain'",
)


def test_an_older_copy_given_a_fresh_vault_id_is_refused_not_linked(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """A transit vault's id is bound to no key: rewritten, the file finds no anchor of its
    own, but its transit key anchors a vault already, so no host links it."""
    db = str(vault_db)
    _, host = transit_vault(db, key, tmp_path, "A0")
    older = copy_of(vault_db, tmp_path / "older.db")
    host_write(db, host, "s1", "A1")
    put_back(older, vault_db)
    for statement in UNCHAIN:
        sql(vault_db, statement)
    sql(vault_db, "UPDATE memvault_meta SET value = ? WHERE key = 'vault_id'", "mv-" + "0" * 24)
    other = host_env(tmp_path, baoserver.host_token(key))
    for args in (["verify"], ["show", "s1"]):
        assert "never chained" in one_line(cli_at(db, other, *args), 1)
    assert all(link is None for _i, _t, link in rows(vault_db, "s1"))


def test_a_restore_from_the_keyring_days_then_a_move_to_transit_is_no_false_alarm(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """The service's anchor from the vault's earlier transit stay is ahead of the
    restored file: the move sets it to the keyring's, it does not keep the higher."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    assert cli_at(db, op, "backup", str(tmp_path / "b.db")).returncode == 0
    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    host = host_env(tmp_path, baoserver.host_token(key))
    for i in range(3):
        host_write(db, host, "s1", f"t{i}")
    for side in [vault_db, *(vault_db.with_name(vault_db.name + s) for s in ("-wal", "-shm"))]:
        side.unlink(missing_ok=True)  # the disk is lost: the backup goes back in its place
    assert cli_at(db, op, "restore", str(tmp_path / "b.db"), "--yes").returncode == 0
    keyring_write(db, op, "s1", "k2")
    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    verdict = cli_at(db, host, "verify")
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    assert host_write(db, host, "s1", "t3") == ["k1", "k2", "t3"]


def test_a_host_shredding_a_stray_copy_leaves_the_live_vaults_anchor(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    _, host = transit_vault(db, key, tmp_path, "A0")
    older = copy_of(vault_db, tmp_path / "older.db")
    host_write(db, host, "s1", "A1")
    spare = copy_of(vault_db, tmp_path / "spare.db")
    shred = cli_at(str(spare), host, "--json", "shred", "--yes")
    assert shred.returncode == 0, shred.stderr
    # A host may not delete the transit key: the key, and so the anchor, are kept.
    report = json.loads(shred.stdout)
    assert report["transit_key"] == "kept" and "bao kv delete" in report["transit_key_fix"]
    assert chainanchor.read(service(key), vault_id(vault_db)) is not None
    put_back(older, vault_db)
    assert cli_at(db, host, "verify").returncode == 1


def test_revoke_with_the_fleet_pages_operator_token_deletes_the_anchor(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    db = str(vault_db)
    transit_vault(db, key, tmp_path, "kept")
    vid = vault_id(vault_db)
    operator_hcl, _ = baoserver.fleet_page_policies(key)
    env = {**operator_env(tmp_path), "VAULT_TOKEN": baoserver.token_with(operator_hcl)}
    revoked = cli_at(db, env, "--json", "revoke", "--yes")
    assert revoked.returncode == 0, revoked.stderr
    assert json.loads(revoked.stdout)["transit_key"] == "deleted"
    assert chainanchor.read(service(key), vid) is None


def test_an_init_that_may_not_record_the_anchor_leaves_no_vault_and_says_so(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    from tests.keys.test_transit_vault_failures import has_vault, key_exists

    operator_hcl, _ = baoserver.fleet_page_policies(key)
    without = operator_hcl + baoserver.HOST_POLICY_WITHOUT_ANCHOR.format(key=key)
    env = {**operator_env(tmp_path), "VAULT_TOKEN": baoserver.token_with(without)}
    made = cli_at(str(vault_db), env, "init", "--key-source", f"transit:{key}")
    line = one_line(made, 4)
    assert "anchor" in line and "no vault was created" in line, line
    assert f"the transit key {key} that init created was deleted" in line, line
    assert not has_vault(str(vault_db)) and not key_exists(key)


def test_a_copy_from_the_keyring_days_put_back_after_a_move_to_transit_is_told(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """A backup keeps the keyring's version, so the copy opens through the keyring: the
    point the move recorded there, one past the copy's, is kept with it."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    keyring_write(db, op, "s1", "k1")
    assert cli_at(db, op, "backup", str(tmp_path / "b.db")).returncode == 0
    keyring_days = copy_of(vault_db, tmp_path / "keyring-days.db")
    keyring_write(db, op, "s1", "k2, the turn a rollback takes away")
    moved = cli_at(db, op, "--json", "key", "move", f"transit:{key}")
    assert moved.returncode == 0 and json.loads(moved.stdout)["kept_in_keyring"], moved.stderr
    host_write(db, host_env(tmp_path, baoserver.host_token(key)), "s1", "t1")
    put_back(keyring_days, vault_db)
    verdict = cli_at(db, op, "--json", "verify")
    told(verdict)


def test_a_move_back_cut_off_after_its_switch_and_run_again_still_tells_a_transit_days_copy(
    key: str, tmp_path: Path, vault_db: Path
) -> None:
    """The second run finds the keys moved already: it records the file's point in the
    source the last move left, as the first run would have after its switch."""
    db, op = str(vault_db), operator_env(tmp_path)
    assert cli_at(db, op, "init").returncode == 0
    assert cli_at(db, op, "key", "move", f"transit:{key}").returncode == 0
    host = host_env(tmp_path, baoserver.host_token(key))
    host_write(db, host, "s1", "through the service")
    transit_days = copy_of(vault_db, tmp_path / "transit-days.db")
    cut = cli_at(
        db, {**op, "MEMVAULT_FAILPOINT": "key-move-after-switch"}, "key", "move", "keyring"
    )
    assert cut.returncode < 0, cut.stderr  # killed just after its switch committed
    again = cli_at(db, op, "--json", "key", "move", "keyring")
    assert again.returncode == 0 and json.loads(again.stdout)["already"], again.stderr
    keyring_write(db, op, "s1", "on the keyring")
    put_back(transit_days, vault_db)
    verdict = cli_at(db, host, "--json", "verify")
    told(verdict)
