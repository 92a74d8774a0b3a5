"""SIGKILL `memvault key move` (keyring to transit, and back) at each named step and at
random instants, on a real OpenBao server, a file vault and a PostgreSQL vault: the vault
is then readable through the source its meta names (by a host with no keyring, or with
the key service down), and running the command again finishes the move."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import baoserver
from tests.conftest import ROOT, keyring_entries
from tests.keys.test_key_move import WHERE, init_keyring, source_rows
from tests.keys.test_transit_vault_failures import closed_port_addr
from tests.keys.test_transit_vault_lifecycle import ok, shown
from tests.keys.test_transit_vaults import cli_at, host_env

pytestmark = [pytest.mark.crash, *baoserver.MARKS]
KILLED = -signal.SIGKILL
TO_TRANSIT = ["key-move-after-new-source", "key-move-after-switch", "key-move-after-tidy-one"]
TO_KEYRING = ["key-move-after-new-source", "key-move-after-switch"]
N_RANDOM_KILLS = 3


@pytest.fixture
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return str(tmp_path / "vault" / "history.db")


class Moves:
    """One vault (made anew for each kill) and what its reads and moves need."""

    def __init__(self, db: str, key: str, tmp_path: Path) -> None:
        self.db, self.key, self.tmp_path = db, key, tmp_path
        self.n = 0

    def fresh(self, to: str) -> tuple[dict[str, str], str]:
        """A vault holding one item, in the keyring (to move to transit) or moved to
        transit (to move back); the operator's environment and the vault id."""
        # A file: a new one each time; PostgreSQL: the same schema, shredded after each.
        if not self.db.startswith("postgresql"):
            self.db = str(self.tmp_path / f"vault-{self.n}" / "history.db")
        self.n += 1
        op, made = init_keyring(self.db, self.tmp_path)
        if to == "keyring":
            ok(cli_at(self.db, op, "key", "move", self.target("transit")))
        return op, made["vault_id"]

    def target(self, to: str) -> str:
        return f"transit:{self.key}" if to == "transit" else "keyring"

    def readable(self, op: dict[str, str], label: str) -> None:
        """Through the source the meta names, and only that one."""
        if source_rows(self.db).get("key_source") == f"transit:{self.key}":
            env = host_env(self.tmp_path, baoserver.host_token(self.key))
        else:
            env = {**op, "VAULT_ADDR": closed_port_addr()}
        assert shown(self.db, env) == ["one"], label

    def finished(self, op: dict[str, str], vault_id: str, to: str, label: str) -> None:
        again = ok(cli_at(self.db, op, "--json", "key", "move", self.target(to)))
        assert again["to"] == self.target(to), (label, again)
        rows = source_rows(self.db)
        if to == "transit":
            assert rows["key_source"] == f"transit:{self.key}", label
            assert keyring_entries(vault_id) == {}, label  # the rerun tidied the keyring
        else:
            assert rows == {}, label
        self.readable(op, label)


@pytest.mark.parametrize("db", WHERE, indirect=True)
@pytest.mark.parametrize(
    ("to", "point"),
    [("transit", p) for p in TO_TRANSIT] + [("keyring", p) for p in TO_KEYRING],
)
def test_a_move_killed_at_each_step_leaves_a_readable_vault_that_a_rerun_finishes(
    db: str, key: str, tmp_path: Path, to: str, point: str
) -> None:
    m = Moves(db, key, tmp_path)
    op, vault_id = m.fresh(to)
    cut = cli_at(m.db, {**op, "MEMVAULT_FAILPOINT": point}, "key", "move", m.target(to))
    assert cut.returncode == KILLED, cut.stderr
    m.readable(op, point)
    m.finished(op, vault_id, to, point)
    ok(cli_at(m.db, op, "shred", "--yes"))


@pytest.mark.parametrize("db", WHERE, indirect=True)
@pytest.mark.parametrize("to", ["transit", "keyring"])
def test_a_move_killed_at_random_instants_leaves_a_readable_vault_that_a_rerun_finishes(
    db: str, key: str, tmp_path: Path, to: str
) -> None:
    m = Moves(db, key, tmp_path)
    op, _ = m.fresh(to)
    started = time.monotonic()
    ok(cli_at(m.db, op, "key", "move", m.target(to)))
    took = time.monotonic() - started
    ok(cli_at(m.db, op, "shred", "--yes"))
    rng = random.Random(int(os.environ.get("MEMVAULT_CRASH_SEED", "20")))
    env = {k: v for k, v in op.items() if k != "MEMVAULT_FAILPOINT"}
    for n in range(N_RANDOM_KILLS):
        op, vault_id = m.fresh(to)
        delay = rng.uniform(0.0, took)
        proc = subprocess.Popen(
            [sys.executable, "-m", "vault", "--db", m.db, "key", "move", m.target(to)],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        label = f"random kill {n} after {delay:.3f}s"
        m.readable(op, label)
        m.finished(op, vault_id, to, label)
        ok(cli_at(m.db, op, "shred", "--yes"))
