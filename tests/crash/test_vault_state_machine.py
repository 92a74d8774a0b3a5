"""A Hypothesis state machine over the vault (issue 3, point 6).

Rules: add (sealed at a chosen Fernet timestamp, or through the real SDK
session), get (with and without a limit), pop, clear, purge, a moving clock,
rotate, a crash inside a rotation at each of its steps, and crash-and-reopen.
Everything is checked against a plain model (per session, a list of
(item, timestamp)). Invariants after every step: the vault's answers match the
model, every stored envelope carries the file's kid, and the integrity check
passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import vault.testhooks as testhooks
from tests.chainkit import insert_chained
from tests.conftest import key_entries, keyring_entries
from vault import crypto
from vault.engines.sqlite.vault import Vault, shred
from vault.errors import UnknownSession
from vault.keyjournal import entry_name
from vault.keys import KeyStore

TTL = 1000
SESSIONS = st.sampled_from(["alpha", "beta", "gamma"])
ROTATION_STEPS = [
    "after-record-pending",
    "after-pending",
    "after-batch",
    "after-commit",
    "after-retired-deleted",
    "during-scrub",
]


class SimulatedCrash(BaseException):
    """Raised at a failpoint: the rotation stops dead there (nothing catches it)."""


class VaultMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="memvault-sm-"))
        self.db = self.folder / "v" / "history.db"
        self.vault = Vault.init(self.db, ttl=TTL)
        self.vault_id = self.vault.vault_id
        self.keystore = KeyStore()
        self.clock = int(time.time())
        self.model: dict[str, list[tuple[Any, int]]] = {}
        self.serial = 0

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            shred(self.db)
        with contextlib.suppress(Exception):
            for name in keyring_entries(self.vault_id):
                self.keystore.delete(name)
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- helpers --------------------------------------------------------
    def _next_item(self, sid: str) -> dict[str, Any]:
        self.serial += 1
        return {"role": "user", "content": f"{sid} #{self.serial}"}

    def _visible(self, sid: str, rows: list[tuple[Any, int]] | None = None) -> list[Any]:
        rows = self.model[sid] if rows is None else rows
        return [item for item, ts in rows if ts + TTL >= self.clock]

    def _conn(self) -> contextlib.closing[sqlite3.Connection]:
        return contextlib.closing(sqlite3.connect(self.db, isolation_level=None))

    # -- rules ----------------------------------------------------------
    @rule(sid=SESSIONS, ages=st.lists(st.integers(0, 2 * TTL), min_size=1, max_size=4))
    def add(self, sid: str, ages: list[int]) -> None:
        """Seal at chosen timestamps (some already expired) and insert, as the SDK does."""
        sealer = self.vault.sealer()
        batch = [(self._next_item(sid), self.clock - age) for age in ages]
        with self._conn() as conn:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", (sid,))
            insert_chained(conn, sealer, [(sid, sealer.seal(sid, item, ts)) for item, ts in batch])
            conn.execute("COMMIT")
        self.model.setdefault(sid, []).extend(batch)

    @rule(sid=SESSIONS)
    def add_through_sdk_session(self, sid: str) -> None:
        """A real VaultSession write, stamped by the real clock (ours never runs behind it)."""
        item = self._next_item(sid)

        async def go() -> None:
            s = self.vault.session(sid)
            await s.add_items([item])
            s.close()

        asyncio.run(go())
        with self._conn() as conn:
            data = conn.execute(
                "SELECT message_data FROM agent_messages WHERE session_id = ? "
                "ORDER BY id DESC LIMIT 1",
                (sid,),
            ).fetchone()[0]
        ts = crypto.token_timestamp(data)
        assert ts is not None and abs(ts - time.time()) < 60
        self.clock = max(self.clock, ts)
        self.model.setdefault(sid, []).append((item, ts))

    @rule(sid=SESSIONS, limit=st.none() | st.integers(1, 6))
    def get(self, sid: str, limit: int | None) -> None:
        if sid not in self.model:
            with pytest.raises(UnknownSession):
                self.vault.items(sid, limit, now=self.clock)
            return
        rows = self.model[sid] if limit is None else self.model[sid][-limit:]
        visible = self._visible(sid, rows)
        assert self.vault.items(sid, limit, now=self.clock) == (
            visible,
            len(rows) - len(visible),
            0,
        )

    @rule(sid=SESSIONS, n=st.integers(1, 4))
    def pop(self, sid: str, n: int) -> None:
        if sid not in self.model:
            with pytest.raises(UnknownSession):
                self.vault.pop(sid, n)
            return
        rows = self.model[sid]
        expected = [item for item, _ in reversed(rows[-n:])]  # newest first, expired too
        assert self.vault.pop(sid, n).items == expected
        del rows[max(0, len(rows) - n) :]

    @rule(sid=SESSIONS)
    def clear(self, sid: str) -> None:
        if sid not in self.model:
            with pytest.raises(UnknownSession):
                self.vault.clear(sid)
            return
        assert self.vault.clear(sid).deleted == len(self.model.pop(sid))

    @rule()
    def purge(self) -> None:
        total = sum(len(rows) for rows in self.model.values())
        report = self.vault.purge(now=self.clock)
        kept = 0
        for rows in self.model.values():
            # Each session's oldest expired items, up to its first fresh one: the history
            # chain records a purge as a new base (an expired item after it waits).
            gone = 0
            while gone < len(rows) and rows[gone][1] + TTL < self.clock:
                gone += 1
            del rows[:gone]
            kept += len(rows)
        assert report.counts == {"deleted": total - kept, "kept": kept, "unreadable": 0}

    @rule(seconds=st.integers(0, 3 * TTL // 2))
    def advance_clock(self, seconds: int) -> None:
        self.clock += seconds

    @rule()
    def rotate(self) -> None:
        old_kid = self.vault.sealer().kid
        report = self.vault.rotate()
        assert report.counts["old_kid"] == old_kid
        assert report.counts["new_kid"] == self.vault.meta()["kid"] != old_kid
        assert report.counts["items"] == sum(len(rows) for rows in self.model.values())
        assert report.counts["sessions"] == sum(1 for rows in self.model.values() if rows)
        assert report.counts["unreadable"] == 0

    @rule(step=st.sampled_from(ROTATION_STEPS))
    def crash_during_rotation(self, step: str) -> None:
        old_kid = self.vault.meta()["kid"]

        def crash(name: str) -> None:
            if name == step:
                raise SimulatedCrash(name)

        # The after-batch step is reached once per batch of rows: never on an empty vault.
        reached = step != "after-batch" or any(self.model.values())
        real = testhooks.failpoint
        testhooks.failpoint = crash
        try:
            if reached:
                with pytest.raises(SimulatedCrash):
                    self.vault.rotate()
            else:
                self.vault.rotate()
        finally:
            testhooks.failpoint = real
        # From the switch on, the file uses the new key (its rows move in batches).
        committed = step not in ("after-record-pending", "after-pending") or not reached
        assert (self.vault.meta()["kid"] != old_kid) == committed
        self._reopen()

    @rule()
    def crash_and_reopen(self) -> None:
        self._reopen()

    def _reopen(self) -> None:
        """Forget every in-memory object (cached key included) and open the file afresh."""
        self.vault = Vault.open(self.db)
        sealer = self.vault.sealer()  # finishes or undoes an interrupted rotation
        assert sealer.kid == self.vault.meta()["kid"]
        # The settled state of docs/keys.md: exactly the file's key version in the
        # keyring, and no pending or retired version left in the journal.
        name = entry_name(self.vault_id, sealer.kid)
        assert key_entries(self.vault_id) == {name: sealer.master_key}
        states = [v.state for v in self.vault.key_versions() if v.kid != sealer.kid]
        assert set(states) <= {"destroyed"}, states
        assert self.vault.meta().get("scrub_pending") != "1"

    # -- invariants -----------------------------------------------------
    @invariant()
    def envelopes_carry_the_files_kid_and_file_is_sound(self) -> None:
        with self._conn() as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            kid = conn.execute("SELECT value FROM memvault_meta WHERE key = 'kid'").fetchone()[0]
            kids = {
                json.loads(d)["kid"]
                for (d,) in conn.execute("SELECT message_data FROM agent_messages")
            }
            count = conn.execute("SELECT count(*) FROM agent_messages").fetchone()[0]
        assert kids <= {kid}
        assert count == sum(len(rows) for rows in self.model.values())

    @precondition(lambda self: bool(self.model))
    @invariant()
    def every_session_matches_the_model(self) -> None:
        assert self.vault.session_ids() == sorted(self.model)
        for sid in self.model:
            visible = self._visible(sid)
            assert self.vault.items(sid, now=self.clock) == (
                visible,
                len(self.model[sid]) - len(visible),
                0,
            )
            assert self.vault.history_verdict(sid) is None  # no false alarm, ever


@pytest.mark.slow
def test_vault_state_machine() -> None:
    run_state_machine_as_test(
        VaultMachine,
        settings=settings(
            max_examples=25,
            stateful_step_count=20,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
