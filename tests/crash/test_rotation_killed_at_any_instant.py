"""SIGKILL the online rotation at random instants and at every named step.

One vault of 10,000 items in 25 sessions is built once per module (envelopes
written directly in one transaction), then its file bytes and key are restored
before every kill. The rotation switches keys in one short transaction, then moves
the rows in batches of their own (vault.rotation), so most kills land with rows
under both keys. After each kill the *next command* (`memvault --json status`, a
fresh process: the rotating process is gone) must finish or undo the rotation, and
then: 0 items lost (an agent's acknowledged writes too, where one ran), every
item decrypts to its original, timestamps unchanged, `PRAGMA integrity_check`
ok, every envelope under the file's kid, exactly the keyring entries the state
table of docs/keys.md says a settled vault has (one, `<vault_id>/<kid>`, holding
the file's key) and a journal with no pending or retired version, and, once the
rotation committed, none of the old ciphertext left in the files.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.chainkit import insert_chained
from tests.conftest import authenticated_counts, key_entries, keyring_entries, raw_bytes, run_cli
from tests.crashkit import first_line, put_back, start_writer, writer_items
from vault import crypto
from vault.engines.sqlite.vault import Vault, shred
from vault.keyjournal import entry_name
from vault.keys import KeyStore

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]
N_ITEMS = 10_000
N_SESSIONS = 25
N_RANDOM_KILLS = 32
PROGRESS_EVERY = 50  # rows between two progress lines of a rotation
TTL = 30 * 86400
KILLED = -signal.SIGKILL
TOKEN_PREFIX = re.compile(rb"gAAAAA[A-Za-z0-9_\-]{34}")


# --------------------------------------------------------------------------
# The big vault, built once, restored before every kill
# --------------------------------------------------------------------------
@dataclass
class BigVault:
    db: Path
    vault_id: str
    # Kept out of failure reports: a key, and bulk that would bury the message.
    key: str = field(repr=False)
    kid: str
    image: bytes = field(repr=False)
    expected: dict[str, list[Any]] = field(repr=False)
    timestamps: dict[int, int] = field(repr=False)
    old_prefixes: set[bytes] = field(repr=False)


def _item(rng: random.Random, sid: str, i: int) -> dict[str, Any]:
    words = " ".join(
        rng.choice(["alpha", "bravo", "charlie", "delta", "echo", "fox"])
        for _ in range(rng.randrange(3, 30))
    )
    role = "user" if i % 2 == 0 else "assistant"
    return {"role": role, "content": f"{sid} turn {i}: {words}"}


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BigVault]:
    folder = tmp_path_factory.mktemp("crash")
    db = folder / "vault" / "history.db"
    v = Vault.init(db, ttl=TTL)
    sealer = v.sealer()
    vault_id = v.vault_id
    rng = random.Random(20240601)
    now = int(time.time())
    expected: dict[str, list[Any]] = collections.defaultdict(list)
    rows = []
    for i in range(N_ITEMS):
        sid = f"session-{rng.randrange(N_SESSIONS):02d}" if i >= N_SESSIONS else f"session-{i:02d}"
        item = _item(rng, sid, i)
        expected[sid].append(item)
        # Ages up to a week: all readable under the 30-day TTL, all distinct timestamps.
        rows.append((sid, sealer.seal(sid, item, now - rng.randrange(0, 7 * 86400))))
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO agent_sessions (session_id) VALUES (?)", [(s,) for s in sorted(expected)]
        )
        insert_chained(conn, sealer, rows)
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        stored = conn.execute("SELECT id, message_data FROM agent_messages").fetchall()
    timestamps = {rid: crypto.token_timestamp(data) for rid, data in stored}
    assert len(timestamps) == N_ITEMS and None not in timestamps.values()
    for p in (db.with_name(db.name + s) for s in ("-wal", "-shm", "-journal")):
        assert not p.exists() or p.stat().st_size == 0
    image = db.read_bytes()
    old_prefixes = set(TOKEN_PREFIX.findall(image))
    assert len(old_prefixes) == N_ITEMS  # the scanner sees every token of the original key
    yield BigVault(
        db=db,
        vault_id=vault_id,
        key=sealer.master_key,
        kid=sealer.kid,
        image=image,
        expected=dict(expected),
        timestamps=timestamps,  # type: ignore[arg-type]
        old_prefixes=old_prefixes,
    )
    with contextlib.suppress(Exception):
        shred(db)
    shutil.rmtree(folder, ignore_errors=True)


def restore(big: BigVault) -> None:
    """The vault as built: file bytes back, only the original key's entry in the keyring."""
    put_back(big.db, big.image, big.vault_id, big.kid, big.key)
    original = entry_name(big.vault_id, big.kid)
    assert key_entries(big.vault_id) == {original: big.key}


# --------------------------------------------------------------------------
# What must hold after every kill
# --------------------------------------------------------------------------
@dataclass
class Outcome:
    old_entry_before: bool  # the original key's entry, right after the kill
    new_entry_before: bool  # an entry of a new key, right after the kill
    rotated: bool
    moving_before: bool = False  # switched, rows still to move, right after the kill


BYSTANDER = textwrap.dedent(
    """
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("SELECT count(*) FROM memvault_meta").fetchone()
    print("ready", flush=True)
    sys.stdin.read()
    """
)


@contextlib.contextmanager
def bystander(db: Path) -> Iterator[None]:
    """An idle process with the file open, like an agent. Without it the last connection
    to close would checkpoint and delete the WAL by itself, hiding a scrub left undone."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BYSTANDER, str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def check_after_kill(
    big: BigVault, label: str, extra: dict[str, list[Any]] | None = None
) -> Outcome:
    """`extra`: sessions an agent wrote during the rotation, with its acknowledged items."""
    with bystander(big.db):
        return _check_after_kill(big, label, extra or {})


def _check_after_kill(big: BigVault, label: str, extra: dict[str, list[Any]]) -> Outcome:
    expected = {**big.expected, **extra}
    n_items = sum(len(items) for items in expected.values())
    with contextlib.closing(sqlite3.connect(big.db)) as conn:
        moving = conn.execute("SELECT 1 FROM memvault_meta WHERE key = 'rotating_from'").fetchone()
    before = key_entries(big.vault_id)
    original = entry_name(big.vault_id, big.kid)
    old_before, new_before = original in before, any(n != original for n in before)

    # The next command, in a fresh process: it finishes or undoes the rotation.
    st = run_cli("--db", str(big.db), "--json", "status")
    assert st.code == 0, (label, st)
    doc = st.json()
    if doc["key"] != "present and matching":
        # What the keyring held (names and key ids, never the keys): tells a keyring that
        # lost or doubled an entry apart from memvault misjudging a healthy one.
        held = {name: crypto.key_id(key) for name, key in keyring_entries(big.vault_id).items()}
        pytest.fail(
            f"{label}: key {doc['key']!r}: {doc.get('key_problem')}; file kid "
            f"{doc.get('kid')}; keyring held {held}; right after the kill it held {sorted(before)}"
        )
    assert doc["items"] == n_items and doc["expired_unverified"] == 0, (label, doc)
    assert authenticated_counts(big.db) == (n_items, 0, 0), label
    assert doc["sessions"] == len(expected), (label, doc)
    assert doc["scrub_pending"] is False, (label, doc)

    with contextlib.closing(sqlite3.connect(big.db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)], label
        meta = dict(conn.execute("SELECT key, value FROM memvault_meta").fetchall())
        stored = conn.execute("SELECT id, message_data FROM agent_messages").fetchall()
    file_kid = meta["kid"]
    assert len(stored) == n_items, label
    kids = collections.Counter(json.loads(data)["kid"] for _, data in stored)
    assert kids == {file_kid: n_items}, (label, kids)
    # Rotation never extends life, even when it is cut off: every timestamp is the original.
    changed = [
        rid
        for rid, data in stored
        if rid in big.timestamps and crypto.token_timestamp(data) != big.timestamps[rid]
    ]
    assert changed == [], (label, changed[:5])

    # The settled state of docs/keys.md: one entry, the file's key version, and a journal
    # with that version current and every other one destroyed.
    entries = key_entries(big.vault_id)
    name = entry_name(big.vault_id, file_kid)
    assert list(entries) == [name], (label, sorted(entries))
    assert crypto.key_id(entries[name]) == file_kid, label
    with contextlib.closing(sqlite3.connect(big.db)) as conn:
        journal = dict(conn.execute("SELECT kid, state FROM memvault_keys").fetchall())
    assert journal.pop(file_kid) == "current", (label, journal)
    assert set(journal.values()) <= {"destroyed"}, (label, journal)

    # Every item decrypts to its original, in order, in every session.
    fresh = Vault.open(big.db)
    assert fresh.session_ids() == sorted(expected), label
    for sid, items in expected.items():
        got, expired, unreadable = fresh.items(sid)
        assert (expired, unreadable) == (0, 0), (label, sid)
        assert got == items, (label, sid)

    rotated = file_kid != big.kid
    if rotated:
        # The interrupted scrub was finished by the next command: no old ciphertext anywhere.
        left = big.old_prefixes & set(TOKEN_PREFIX.findall(raw_bytes(big.db)))
        assert not left, (label, len(left))
    return Outcome(old_before, new_before, rotated, moving is not None)


# --------------------------------------------------------------------------
# Kills
# --------------------------------------------------------------------------
ROTATOR = textwrap.dedent(
    """
    import sys, time
    import vault.crypto as crypto
    import vault.testhooks as testhooks
    from vault.engines.sqlite.vault import Vault
    v = Vault.open(sys.argv[1])
    v.sealer()
    t0 = time.monotonic()
    # Progress, for the parent to time its kill on: each named step as it is reached,
    # and every ROWS rows re-encrypted.
    testhooks.failpoint = lambda name: print(name, time.monotonic() - t0, flush=True)
    rotate_row = crypto.rotate_row_stamped
    done = 0

    def counting(*args, **kwargs):
        global done
        out = rotate_row(*args, **kwargs)
        done += 1
        if done % ROWS == 0:
            print("rows", done, flush=True)
        return out

    crypto.rotate_row_stamped = counting
    print("ready", flush=True)
    v.rotate()
    print("done", time.monotonic() - t0, flush=True)
    """
).replace("ROWS", str(PROGRESS_EVERY))


def start_rotator(db: Path, script: str = ROTATOR) -> subprocess.Popen[str]:
    """`script` rotating `db` in a new process, once it printed "ready"."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "MEMVAULT_FAILPOINT"},
    )
    assert proc.stdout is not None
    line = first_line(proc.stdout)
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the rotating process did not start: {line!r} {err[-2000:]}")
    return proc


def kill_when(
    proc: subprocess.Popen[str],
    reached: Callable[[str, float], bool],
    then_wait: Callable[[dict[str, float]], float],
) -> str:
    """SIGKILL the rotator once its progress reaches a point (plus a wait derived
    from the marks seen); returns the last progress line read."""
    assert proc.stdout is not None
    seen: dict[str, float] = {}
    last = ""
    for line in proc.stdout:
        name, value = line.split()
        seen[name] = float(value)
        last = line.strip()
        if reached(name, float(value)):
            time.sleep(then_wait(seen))
            break
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    return last


@pytest.mark.slow
def test_sigkill_at_random_instants(big: BigVault) -> None:
    seed = int(os.environ.get("MEMVAULT_CRASH_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)

    # One uninterrupted rotation first (it, too, must lose nothing): when each step
    # after the commit begins, to spread the late kills over them.
    restore(big)
    proc = start_rotator(big.db)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    marks = {name: float(t) for name, t in (line.split() for line in out.splitlines())}
    assert marks["rows"] == N_ITEMS
    assert marks["after-commit"] < marks["after-retired-deleted"] < marks["done"]
    assert check_after_kill(big, "uninterrupted").rotated

    # Kill instants are set by progress, not by the clock, so that a slow (busy)
    # machine shifts them with the work: most when a random number of rows has been
    # re-encrypted (switched, the rest of the rows still under the old key), the rest a
    # random share of the way through deleting the old key or the scrub.
    before = N_RANDOM_KILLS * 3 // 4
    after = N_RANDOM_KILLS - before
    targets: list[tuple[str, Callable[[str, float], bool], Callable[[dict[str, float]], float]]]
    targets = []
    for i in range(before):
        rows = max(PROGRESS_EVERY, int((i + rng.random()) / before * N_ITEMS * 0.9))
        targets.append(
            (
                f"after {rows} rows",
                lambda name, v, rows=rows: name == "rows" and v >= rows,
                lambda seen: 0.0,
            )
        )
    for i in range(after):
        step, following = (
            ("after-commit", "after-retired-deleted")
            if i % 2 == 0
            else ("after-retired-deleted", "done")
        )
        share = (i // 2 + rng.random()) / ((after + 1) // 2)
        span = marks[following] - marks[step]
        targets.append(
            (
                f"{share:.2f} of the way from {step}",
                lambda name, v, step=step: name == step,
                lambda seen, share=share, span=span: share * span,
            )
        )
    outcomes: collections.Counter[str] = collections.Counter()
    killed = 0
    for i, (where, reached, then_wait) in enumerate(targets):
        restore(big)
        proc = start_rotator(big.db)
        last = kill_when(proc, reached, then_wait)
        label = f"seed={seed} kill {i} {where} (last seen {last!r}) rc={proc.returncode}"
        o = check_after_kill(big, label)
        if proc.returncode != KILLED:
            outcomes["finished before the kill"] += 1
            continue
        killed += 1
        if not o.rotated:
            outcomes["new key stored, not switched" if o.new_entry_before else "before it"] += 1
        elif o.moving_before:
            outcomes["switched, rows under both keys"] += 1
        else:
            outcomes["finished, old key kept" if o.old_entry_before else "old key deleted"] += 1

    summary = f"seed={seed} marks={marks} killed={killed} outcomes={dict(outcomes)}"
    print(summary)
    # The kills really landed inside the rotation: amid its batches, and after them.
    assert killed >= N_RANDOM_KILLS // 2, summary
    assert outcomes["switched, rows under both keys"] >= N_RANDOM_KILLS // 4, summary
    assert outcomes["finished, old key kept"] + outcomes["old key deleted"] >= 1, summary


N_WRITER_KILLS = 6
WRITER_ITEMS = 1500
WRITER_SIZE = 40


@pytest.mark.slow
def test_sigkill_amid_the_batches_with_an_agent_writing_loses_no_acknowledged_item(
    big: BigVault,
) -> None:
    """An agent in another process appends all along; the rotator is killed amid its
    batches. Every item the agent saw acknowledged is there, under the one key left."""
    seed = int(os.environ.get("MEMVAULT_CRASH_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    moving = 0
    for i in range(N_WRITER_KILLS):
        restore(big)
        writer = start_writer(big.db, "agent", 0, WRITER_ITEMS, WRITER_SIZE)
        proc = start_rotator(big.db)
        rows = max(PROGRESS_EVERY, int((i + rng.random()) / N_WRITER_KILLS * N_ITEMS * 0.9))
        last = kill_when(proc, lambda name, v, rows=rows: name == "rows" and v >= rows, lambda s: 0)
        out, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err[-2000:]
        acked = sum(1 for line in out.splitlines() if line.startswith("ack "))
        assert acked == WRITER_ITEMS, out[-500:]
        label = f"seed={seed} writer kill {i} after {rows} rows (last seen {last!r})"
        o = check_after_kill(big, label, {"agent": writer_items("agent", 0, acked, WRITER_SIZE)})
        assert o.rotated, label
        moving += o.moving_before
    # Most kills left rows under both keys for the next command (some rotations ended
    # on their own, or the agent, opening after the kill, finished them).
    assert moving >= 1, f"seed={seed}"


FAILPOINTS = {
    # name: (old entry, new entry right after the kill, rotation switched)
    "after-record-pending": (True, False, False),
    "after-pending": (True, True, False),
    "after-switch": (True, True, True),
    "after-batch": (True, True, True),
    "after-commit": (True, True, True),
    "after-retired-deleted": (False, True, True),
    "during-scrub": (False, True, True),
}


@pytest.mark.parametrize("point", list(FAILPOINTS))
def test_sigkill_at_each_named_step(big: BigVault, point: str) -> None:
    restore(big)
    r = run_cli("--db", str(big.db), "rotate", env={"MEMVAULT_FAILPOINT": point})
    assert r.code == KILLED, r  # the failpoint fired: the process died there

    outcome = check_after_kill(big, point)

    assert (outcome.old_entry_before, outcome.new_entry_before, outcome.rotated) == (
        FAILPOINTS[point]
    )


def test_killed_again_while_recovering(big: BigVault) -> None:
    """A rotation killed after its commit, then the recovering command killed mid-scrub."""
    restore(big)
    r = run_cli("--db", str(big.db), "rotate", env={"MEMVAULT_FAILPOINT": "after-commit"})
    assert r.code == KILLED, r
    again = run_cli("--db", str(big.db), "status", env={"MEMVAULT_FAILPOINT": "during-scrub"})
    assert again.code == KILLED, again  # the next open was finishing the scrub

    outcome = check_after_kill(big, "killed twice")

    assert outcome.rotated


class Interleaving(KeyStore):
    """A keystore that runs `before_delete` once, just as it is about to delete an entry."""

    def __init__(self, before_delete: Callable[[], None]) -> None:
        super().__init__()
        self.before_delete: Callable[[], None] | None = before_delete

    def delete(self, name: str) -> bool:
        hook, self.before_delete = self.before_delete, None
        if hook is not None:
            hook()
        return super().delete(name)


def test_a_rotation_during_another_ones_clean_up_is_never_stranded(big: BigVault) -> None:
    """A second rotation, started while the first deletes its old key and killed right
    after its own commit, must not lose its key to either one's clean-up."""
    restore(big)
    env = {"MEMVAULT_FAILPOINT": "after-commit", "MEMVAULT_LOCK_TIMEOUT": "2"}
    second: list[Any] = []

    def rotate_again() -> None:  # the first rotation committed: a second one runs now
        second.append(run_cli("--db", str(big.db), "rotate", env=env))

    first = Vault.open(big.db, keystore=Interleaving(rotate_again))
    first.rotate()
    assert second, "the interleaving hook never ran"
    assert second[0].code == KILLED, second[0]  # it ran to its own commit

    outcome = check_after_kill(big, "interleaved rotations")
    assert outcome.rotated


def _revoke_hook(big: BigVault, results: list[Any]) -> Callable[[], None]:
    def hook() -> None:
        results.append(
            run_cli(
                "--db",
                str(big.db),
                "--json",
                "revoke",
                "--yes",
                env={"MEMVAULT_LOCK_TIMEOUT": "2"},
            )
        )

    return hook


def test_a_revoke_during_a_rotations_clean_up_leaves_no_key(big: BigVault) -> None:
    """Revoke while a committed rotation deletes its old key: no key may come back."""
    restore(big)
    revoke: list[Any] = []
    # A revoke runs just as the rotation deletes the retired key.
    rotator = Vault.open(big.db, keystore=Interleaving(_revoke_hook(big, revoke)))
    with contextlib.suppress(Exception):
        rotator.rotate()
    assert revoke and revoke[0].code == 0, revoke
    assert keyring_entries(big.vault_id) == {}
    assert run_cli("--db", str(big.db), "--json", "status").json()["key"] == "key revoked"


def test_a_revoke_during_the_next_opens_clean_up_waits_or_wins(big: BigVault) -> None:
    """Revoke racing the clean-up a later open does after a crashed rotation."""
    restore(big)
    r = run_cli("--db", str(big.db), "rotate", env={"MEMVAULT_FAILPOINT": "after-commit"})
    assert r.code == KILLED, r
    assert len(key_entries(big.vault_id)) == 2  # the new key's and the retired one's
    revoke: list[Any] = []
    # A revoke runs just as this open deletes the retired key.
    opener = Vault.open(big.db, keystore=Interleaving(_revoke_hook(big, revoke)))
    with contextlib.suppress(Exception):
        opener.sealer()
    assert revoke, "the interleaving hook never ran"
    if revoke[0].code == 0:
        # The revoke went through: no key may come back.
        assert keyring_entries(big.vault_id) == {}
        assert run_cli("--db", str(big.db), "--json", "status").json()["key"] == "key revoked"
    else:
        # The open held the write lock: the revoke waited and gave up; the vault is intact.
        assert revoke[0].code == 5, revoke[0]
        check_after_kill(big, "revoke refused during the clean-up")
