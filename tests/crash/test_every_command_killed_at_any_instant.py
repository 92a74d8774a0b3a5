"""SIGKILL every command, and agents writing, at instants set by observed progress.

The vault starts each time from one image: items in the file, an agent that died
with its acknowledged items still in the WAL, and a large write transaction in the
WAL on top, so that whatever opens the vault first checkpoints megabytes. Each
command is killed (1) inside that checkpoint, spotted from the outside when the
file's header promises more pages than the file holds, (2) at random shares of its
own run as measured on this machine in this run, counted from the moment it opened
the database (its -shm appears), and (3) at each of its named failpoints. After
every kill the next command must open the vault, SQLite must find it whole, every
acknowledged item must read back, and what a destroying command did is either
done or not, never a lock-out. A killed `backup` leaves no file at its name or a
whole copy, and the next backup to that name works; a killed `init` (on a path
of its own) leaves no vault file or a whole vault, and the next `init` reclaims
the keyring entry it left. MEMVAULT_CRASH_SEED replays a run.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.chainkit import insert_chained
from tests.conftest import key_entries, keyring_entries, keyring_items, run_cli
from tests.crashkit import (
    ROOT,
    integrity,
    is_mid_checkpoint,
    run_writer_to_death,
    start_writer,
    wal_of,
    writer_items,
)
from vault import crypto
from vault.engines.sqlite.vault import Vault, shred
from vault.keyjournal import entry_name
from vault.keys import KeyStore

pytestmark = [pytest.mark.slow, pytest.mark.crash]

TTL = 30 * 86400
KILLED = -signal.SIGKILL
PASS = "correct horse battery staple"
SESSIONS = [f"s{i}" for i in range(4)]
AGENT_ACKS = 60
ITEM_SIZE = 2000
BULK_ITEMS, BULK_SIZE = 500, 12000  # ~6 MB of WAL: a checkpoint long enough to catch
WRITER_ITEMS = 200
WRITER_KILLS = 4
SEED = int(os.environ.get("MEMVAULT_CRASH_SEED", time.time_ns() % 2**32))
# MEMVAULT_CRASH_ONLY="backup,rotate" replays the kills of those commands alone.
ONLY = {c.strip() for c in os.environ.get("MEMVAULT_CRASH_ONLY", "").split(",") if c.strip()}


@dataclass
class Image:
    db: Path
    files: dict[str, bytes]
    vault_id: str
    key: str
    kit: Path
    plain: Path
    plain_bytes: bytes
    readable: dict[str, list[Any]]  # session -> items, every one acknowledged
    rows: int
    expired_rows: int
    imported: list[Any] = field(default_factory=list)


def _seal_rows(sealer: crypto.Sealer, sid: str, items: list[Any], at: int) -> list[tuple[str, str]]:
    return [(sid, sealer.seal(sid, item, at)) for item in items]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    folder = tmp_path_factory.mktemp("crashcmd")
    db = folder / "vault" / "history.db"
    v = Vault.init(db, ttl=TTL)
    sealer = v.sealer()
    now = int(time.time())
    readable = {
        sid: [{"role": "user", "content": f"{sid} {i} " + "z" * 300} for i in range(30)]
        for sid in SESSIONS
    }
    old = [{"role": "user", "content": f"old {i}"} for i in range(40)]
    rows = [r for sid, items in readable.items() for r in _seal_rows(sealer, sid, items, now)]
    rows += _seal_rows(sealer, "old", old, now - 40 * 86400)  # past the TTL: purge's work
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.executemany(
            "INSERT INTO agent_sessions (session_id) VALUES (?)", [(s,) for s in [*SESSIONS, "old"]]
        )
        insert_chained(conn, sealer, rows)
    assert (
        run_cli(
            "--db",
            str(db),
            "key",
            "export",
            "--passphrase-stdin",
            str(folder / "kit.json"),
            input=PASS + "\n",
        ).code
        == 0
    )
    # An agent dies with its acknowledged items in the WAL...
    acked = run_writer_to_death(db, "agent", 0, AGENT_ACKS, ITEM_SIZE)
    assert acked == AGENT_ACKS
    readable["agent"] = writer_items("agent", 0, acked, ITEM_SIZE)
    # ...and a big transaction lands in the WAL after it, never checkpointed.
    bulk = [
        {"role": "assistant", "content": f"bulk {i} " + "y" * BULK_SIZE} for i in range(BULK_ITEMS)
    ]
    readable["bulk"] = bulk
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO agent_sessions (session_id) VALUES ('bulk')")
    insert_chained(conn, sealer, _seal_rows(sealer, "bulk", bulk, now))
    conn.execute("COMMIT")
    # The files as a crash would leave them (the connection is still open).
    files = {p.name: p.read_bytes() for p in (db, wal_of(db))}
    conn.close()
    plain = folder / "plain.db"
    make_plain(plain, "imported", 30)
    yield Image(
        db=db,
        files=files,
        vault_id=v.vault_id,
        key=sealer.master_key,
        kit=folder / "kit.json",
        plain=plain,
        plain_bytes=plain.read_bytes(),
        readable=readable,
        rows=sum(len(x) for x in readable.values()) + len(old),
        expired_rows=len(old),
        imported=[{"role": "user", "content": f"plain {i}"} for i in range(30)],
    )
    with contextlib.suppress(Exception):
        shred(db)
    shutil.rmtree(folder, ignore_errors=True)


def make_plain(path: Path, sid: str, n: int) -> None:
    """A plaintext SQLiteSession file written by the real SDK."""
    import asyncio

    from agents import SQLiteSession

    async def go() -> None:
        s = SQLiteSession(sid, path)
        await s.add_items([{"role": "user", "content": f"plain {i}"} for i in range(n)])
        s.close()

    asyncio.run(go())


def restore(img: Image) -> None:
    for p in img.db.parent.iterdir():
        p.unlink()
    for name, data in img.files.items():
        (img.db.parent / name).write_bytes(data)
        os.chmod(img.db.parent / name, 0o600)
    img.plain.write_bytes(img.plain_bytes)
    for suffix in ("-wal", "-shm", "-journal"):
        img.plain.with_name(img.plain.name + suffix).unlink(missing_ok=True)
    (img.kit.parent / "exported.json").unlink(missing_ok=True)
    for p in img.kit.parent.glob("backup.db*"):
        p.unlink()
    for p in img.kit.parent.glob(".memvault-*"):
        p.unlink()
    ks = KeyStore()
    original = entry_name(img.vault_id, crypto.key_id(img.key))
    for name in keyring_entries(img.vault_id):
        if name != original:
            ks.delete(name)
    ks.set(original, img.key)


# --------------------------------------------------------------------------
# The commands, and what each may leave behind
# --------------------------------------------------------------------------
@dataclass
class Command:
    args: list[str]
    stdin: str = ""
    failpoints: tuple[str, ...] = ()
    kind: str = "keeps"  # keeps | pop | clear | purge | import | revoke | shred | backup
    random_kills: int = 1  # at random shares of its measured run; more where steps differ


def commands(img: Image) -> dict[str, Command]:
    kit, exported = str(img.kit), str(img.kit.parent / "exported.json")
    return {
        "status": Command(["status"]),
        "sessions": Command(["sessions"]),
        "show": Command(["show", "s0"]),
        "log": Command(["log"]),
        "ttl set": Command(["ttl", "35d"]),  # the old items stay expired
        "pop": Command(["pop", "s1", "-n", "2"], kind="pop", random_kills=2),
        "clear": Command(["clear", "s2", "--yes"], kind="clear", random_kills=2),
        "purge": Command(
            ["purge", "--yes"], failpoints=("purge-in-transaction",), kind="purge", random_kills=2
        ),
        "rotate": Command(
            ["rotate"],
            random_kills=2,
            failpoints=(
                "after-record-pending",
                "after-pending",
                "after-batch",
                "after-commit",
                "after-retired-deleted",
                "during-scrub",
            ),
        ),
        "revoke": Command(
            ["revoke", "--yes"],
            kind="revoke",
            random_kills=2,
            failpoints=("revoke-after-mark", "after-destroy-entry"),
        ),
        "import": Command(
            ["import", str(img.plain)],
            kind="import",
            random_kills=2,
            failpoints=("import-in-transaction",),
        ),
        "backup": Command(
            ["backup", str(img.kit.parent / "backup.db")],
            kind="backup",
            random_kills=2,
            failpoints=("backup-vacuumed", "backup-settled", "backup-copied"),
        ),
        "key export": Command(["key", "export", "--passphrase-stdin", exported], stdin=PASS + "\n"),
        "key import": Command(
            ["key", "import", kit, "--yes", "--passphrase-stdin"], stdin=PASS + "\n"
        ),
        "shred": Command(
            ["shred", "--yes"],
            kind="shred",
            random_kills=2,
            failpoints=("shred-after-key", "shred-after-rows", "shred-during-overwrite"),
        ),
    }


def check(img: Image, cmd: Command, label: str) -> str:
    """After a kill: the next command opens the vault and nothing acknowledged is lost.
    Returns which side of the command the vault is on."""
    st = run_cli("--db", str(img.db), "--json", "status")
    assert "truncated" not in st.err and "damaged" not in st.err, (label, st)
    if cmd.kind == "shred" and (st.code == 3 or not img.db.exists()):
        # Shredded, or a shred to finish: finishing it must work.
        if img.db.exists():
            assert "shred was interrupted" in st.err, (label, st)
            again = run_cli("--db", str(img.db), "shred", "--yes")
            assert again.code == 0, (label, again)
        assert not any(img.db.parent.iterdir()), label
        assert keyring_entries(img.vault_id) == {}, label
        return "after"
    assert st.code == 0, (label, st)
    assert integrity(img.db) == [("ok",)], label
    doc = st.json()
    if doc["key"] != "present and matching" and cmd.kind == "shred":
        # The key went first: the rest of the shred is to finish, and finishing works.
        again = run_cli("--db", str(img.db), "shred", "--yes")
        assert again.code == 0 and not any(img.db.parent.iterdir()), (label, again)
        assert keyring_entries(img.vault_id) == {}, label
        return "after"
    if doc["key"] != "present and matching":
        assert cmd.kind == "revoke" and doc["key"].startswith("key revoked"), (label, doc)
        if doc["key"] != "key revoked":  # a revoke to finish: finishing it must work
            assert run_cli("--db", str(img.db), "revoke", "--yes").code == 0, label
        assert keyring_entries(img.vault_id) == {}, label
        return "after"
    # The settled state of docs/keys.md: exactly the file's key version in the keyring.
    assert list(key_entries(img.vault_id)) == [entry_name(img.vault_id, doc["kid"])], label
    vault = Vault.open(img.db)
    got = {sid: vault.items(sid)[0] for sid in vault.session_ids()}
    got = {sid: items for sid, items in got.items() if items}
    rows = vault.count_items()  # the expired items count too: only purge deletes them
    want = dict(img.readable)
    done = after(img, cmd, want)
    rows_after = img.rows + sum(map(len, done.values())) - sum(map(len, want.values()))
    if cmd.kind == "purge":
        rows_after -= img.expired_rows
    sides = [
        side
        for side, expected, n in (("before", want, img.rows), ("after", done, rows_after))
        if got == expected and rows == n
    ]
    assert sides, (label, rows, {s: len(v) for s, v in got.items()})
    if cmd.kind == "backup":
        check_backup(img, label)
    return sides[-1]


def check_backup(img: Image, label: str) -> None:
    """No file at the backup's name, or a whole copy; and the next backup there works."""
    dest = img.kit.parent / "backup.db"
    if not dest.exists():
        again = run_cli("--db", str(img.db), "backup", str(dest))
        assert again.code == 0, (label, again)
    assert integrity(dest) == [("ok",)], label
    v = run_cli("--db", str(dest), "verify")
    assert v.code == 0, (label, v)
    copy = Vault.open(dest)
    assert {sid: copy.items(sid)[0] for sid in img.readable} == img.readable, label
    assert list(img.kit.parent.glob(".memvault-*")) == [], label  # nothing half-made left


def after(img: Image, cmd: Command, before: dict[str, list[Any]]) -> dict[str, list[Any]]:
    out = dict(before)
    if cmd.kind == "pop":
        out["s1"] = out["s1"][:-2]
    elif cmd.kind == "clear":
        del out["s2"]
    elif cmd.kind == "import":
        out["imported"] = img.imported
    return out


# --------------------------------------------------------------------------
# Killing
# --------------------------------------------------------------------------
def spawn(img: Image, cmd: Command, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {k: v for k, v in os.environ.items() if k != "MEMVAULT_FAILPOINT"}
    full.update(env or {})
    stdin = img.db.parent.parent / "stdin.txt"
    stdin.write_text(cmd.stdin)
    with open(stdin) as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "vault", "--db", str(img.db), *cmd.args],
            stdin=fh,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=full,
        )


def opened(img: Image, proc: subprocess.Popen[str]) -> float | None:
    """Wait until the process has opened the database (its -shm appears): that instant."""
    shm = img.db.with_name(img.db.name + "-shm")
    while proc.poll() is None:
        if shm.exists():
            return time.monotonic()
        time.sleep(0.0005)
    return None


def finish(proc: subprocess.Popen[str], kill: bool) -> int:
    if kill:
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=300)
    return proc.returncode


def kill_mid_checkpoint(img: Image, proc: subprocess.Popen[str]) -> bool:
    """SIGKILL as soon as the file is shorter than its header says; False if never seen."""
    while proc.poll() is None:
        if is_mid_checkpoint(img.db):
            finish(proc, kill=True)
            return proc.returncode == KILLED
        time.sleep(0.0002)  # a short nap: spinning would slow the command on a busy machine
    finish(proc, kill=False)
    return False


def measure(img: Image, cmd: Command, name: str) -> float:
    """One uninterrupted run from the image: its time from opening the file to exiting."""
    restore(img)
    proc = spawn(img, cmd)
    t0 = opened(img, proc)
    code = finish(proc, kill=False)
    end = time.monotonic()
    assert code == 0, (name, code)
    assert check(img, cmd, f"{name} uninterrupted") == "after"
    return end - (t0 or end)


def test_every_command_killed_at_every_kind_of_instant(image: Image) -> None:
    rng = random.Random(SEED)
    print(f"MEMVAULT_CRASH_SEED={SEED}")
    tally: collections.Counter[str] = collections.Counter()
    sides: dict[str, set[str]] = collections.defaultdict(set)
    chosen = {n: c for n, c in commands(image).items() if not ONLY or n in ONLY}
    for name, cmd in chosen.items():
        span = measure(image, cmd, name)
        # (1) inside the first checkpoint: up to three tries to catch it
        for attempt in range(3):
            restore(image)
            landed = kill_mid_checkpoint(image, spawn(image, cmd))
            label = f"seed={SEED} {name} checkpoint try {attempt}"
            sides[name].add(check(image, cmd, label))
            tally["kills"] += 1
            if landed:
                tally["inside a checkpoint"] += 1
                break
        # (2) random shares of its own measured run, stratified
        for i in range(cmd.random_kills):
            share = (i + rng.random()) / cmd.random_kills
            restore(image)
            proc = spawn(image, cmd)
            t0 = opened(image, proc)
            if t0 is not None:
                time.sleep(max(0.0, t0 + share * span - time.monotonic()))
            code = finish(proc, kill=True)
            label = f"seed={SEED} {name} at {share:.2f} of {span:.3f}s rc={code}"
            sides[name].add(check(image, cmd, label))
            tally["kills"] += 1
            tally["random, landed" if code == KILLED else "random, finished first"] += 1
        # (3) every named step
        for point in cmd.failpoints:
            restore(image)
            code = finish(spawn(image, cmd, {"MEMVAULT_FAILPOINT": point}), kill=False)
            assert code == KILLED, (name, point, code)
            sides[name].add(check(image, cmd, f"seed={SEED} {name} at {point}"))
            tally["kills"] += 1
            tally["named steps"] += 1
    print(f"seed={SEED} {dict(tally)} sides={ {k: sorted(v) for k, v in sides.items()} }")
    # The checkpoint kills really land there (each is aimed by watching the file).
    assert tally["inside a checkpoint"] >= len(chosen) // 2, dict(tally)


def test_agent_writers_killed_at_every_kind_of_instant(image: Image) -> None:
    rng = random.Random(SEED + 1)
    print(f"MEMVAULT_CRASH_SEED={SEED}")
    kills = collections.Counter[str]()
    for i in range(WRITER_KILLS):
        restore(image)
        # Writers open the vault (checkpointing the image's WAL) then append; each
        # kill is aimed at a state: inside that checkpoint, or after a random number
        # of acknowledged items (and whatever the writer had started since).
        proc = start_writer(image.db, "writer", 0, WRITER_ITEMS, ITEM_SIZE, wait=False)
        assert proc.stdout is not None
        acked = 0
        target = rng.randrange(1, WRITER_ITEMS)
        if i % 2 == 0:
            landed = False
            while proc.poll() is None and not (landed := is_mid_checkpoint(image.db)):
                time.sleep(0.0002)
            kills["inside a checkpoint" if landed else "checkpoint missed"] += 1
        else:
            for line in proc.stdout:
                acked += line.startswith("ack ")  # "ready" first, once it opened
                if acked >= target:
                    break
            kills["after acks"] += 1
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
        acked += sum(1 for line in out.splitlines() if line.startswith("ack "))
        label = f"seed={SEED} writer {i} acked={acked}"
        st = run_cli("--db", str(image.db), "--json", "status")
        assert st.code == 0 and "truncated" not in st.err, (label, st)
        assert integrity(image.db) == [("ok",)], label
        vault = Vault.open(image.db)
        for sid, items in image.readable.items():
            assert vault.items(sid)[0] == items, (label, sid)
        written = vault.items("writer")[0] if "writer" in vault.session_ids() else []
        assert len(written) >= acked, label  # every acknowledged item is there...
        assert written == writer_items("writer", 0, len(written), ITEM_SIZE), label  # ...whole
    print(f"seed={SEED} writer kills {dict(kills)}")


# --------------------------------------------------------------------------
# init
# --------------------------------------------------------------------------
def memvault_entries() -> set[str]:
    return {a.get("username", "") for a, _ in keyring_items() if a.get("service") == "memvault"}


def settle_after_killed_init(db: Path, before: set[str], label: str) -> None:
    """No vault file or a whole one; the next `init` works (or says one exists) and
    leaves exactly the new vault's key in the keyring and its file in the folder."""
    if db.exists():
        assert db.stat().st_size > 0, label  # never a 0-byte file
        st = run_cli("--db", str(db), "--json", "status")
        assert st.code == 0, (label, st)
        again = run_cli("--db", str(db), "init")
        assert again.code == 1 and "already exists" in again.err, (label, again)
    else:
        r = run_cli("--db", str(db), "init")
        assert r.code == 0, (label, r)
        st = run_cli("--db", str(db), "--json", "status")
        assert st.code == 0, (label, st)
    vault_id = st.json()["vault_id"]
    new = memvault_entries() - before  # its key, and its anchor (vault.chainanchor)
    assert new == {f"{vault_id}/{st.json()['kid']}", f"{vault_id}/anchor"}, (label, new)
    assert sorted(p.name for p in db.parent.iterdir()) == [db.name], label
    assert run_cli("--db", str(db), "shred", "--yes").code == 0, label
    assert memvault_entries() == before, label


@pytest.mark.parametrize("step", ["init-key-stored", "init-built", "init-linked"])
def test_init_killed_at_each_step_leaves_no_vault_or_a_whole_one(vault_db: Path, step: str) -> None:
    before = memvault_entries()
    r = run_cli("--db", str(vault_db), "init", env={"MEMVAULT_FAILPOINT": step})
    assert r.code == KILLED, r
    settle_after_killed_init(vault_db, before, step)


def test_init_killed_at_random_instants_leaves_no_vault_or_a_whole_one(vault_db: Path) -> None:
    rng = random.Random(SEED + 2)
    print(f"MEMVAULT_CRASH_SEED={SEED}")
    before = memvault_entries()
    argv = [sys.executable, "-m", "vault", "--db", str(vault_db), "init"]
    t0 = time.monotonic()
    assert subprocess.run(argv, cwd=ROOT, capture_output=True).returncode == 0
    span = time.monotonic() - t0
    assert run_cli("--db", str(vault_db), "shred", "--yes").code == 0
    kills = 6
    for i in range(kills):
        # Stratified over the run's second half: the first is the interpreter starting.
        share = 0.5 + (i + rng.random()) / (2 * kills)
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(share * span)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
        label = f"seed={SEED} init at {share:.2f} of {span:.3f}s"
        settle_after_killed_init(vault_db, before, label)
