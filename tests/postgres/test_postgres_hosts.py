"""Agents on several hosts sharing a PostgreSQL vault while it rotates online.

Each "host" is a process of its own with its own agent session
(`vault.open_session(id, URL)`); the rotation is `memvault rotate` (or, where its
steps must be timed, `PgVault.rotate` in a process of its own, marking each step
through `vault.testhooks.failpoint`). Kill instants and the waiting bound are
calibrated on the rotation's observed progress and on durations measured in the
same run, never on absolute times.

Run with `scripts/with-postgres scripts/test -m postgres`. A failing random-kill
run prints its seed; MEMVAULT_PG_KILL_SEED=<seed> replays it.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, run_cli
from tests.pgserver import MARKS, SERVER_URL, bulk_insert, entries_left, raw_kids, sql

pytestmark = MARKS
KILLED = -signal.SIGKILL
ENV_SEED = "MEMVAULT_PG_KILL_SEED"


@pytest.fixture
def url() -> Iterator[str]:
    """A vault in a fresh schema of the test server; schema and keyring entries go after."""
    from vault.engines.postgres.vault import PgVault
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    schema = "h_" + secrets.token_hex(6)
    where = f"{SERVER_URL}?schema={schema}"
    PgVault.init(where, ttl=None)
    yield where
    ks = KeyStore()
    vault_id = sql(where, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")[0]["value"]
    for (kid,) in sql(where, "SELECT kid FROM memvault_keys"):
        ks.delete(entry_name(vault_id, kid))
    sql(SERVER_URL, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MEMVAULT_FAILPOINT", "MEMVAULT_DB")}
    env.update(extra)
    return env


def prefill(url: str, n: int, sessions: int = 10) -> dict[str, list[str]]:
    """n items sealed under the vault's key, inserted with COPY (the guard checks each
    row); {session id: contents in order}."""
    contents: dict[str, list[str]] = {}
    texts = []
    for i in range(n):
        sid = f"bulk-{i % sessions}"
        text = f"{sid} item {i} " + "x" * 200
        contents.setdefault(sid, []).append(text)
        texts.append((sid, text))
    bulk_insert(url, texts)
    return contents


def meta(url: str) -> dict[str, str]:
    return {r["key"]: r["value"] for r in sql(url, "SELECT key, value FROM memvault_meta")}


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# An agent on its own host: appends one item at a time through its own session and
# prints "ack <i> <start> <end>" (monotonic seconds, the same clock in every process on
# Linux) once add_items has returned: from then on the item must be there. First it
# times the key reload a rotation makes it do ("reload <seconds>"), for the slack.
WRITER = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    import vault

    async def main() -> None:
        url, sid, stop = sys.argv[1:4]
        session = vault.open_session(sid, url)
        reload = 0.0
        for _ in range(3):
            t = time.monotonic()
            await asyncio.to_thread(session._refresh)
            reload = max(reload, time.monotonic() - t)
        print("reload", reload, flush=True)
        i = 0
        while not Path(stop).exists():
            text = f"{sid} item {i}"
            t0 = time.monotonic()
            await session.add_items([{"role": "user", "content": text}])
            t1 = time.monotonic()
            print("ack", i, f"{t0:.6f}", f"{t1:.6f}", flush=True)
            i += 1
            await asyncio.sleep(0.005)
        session.close()

    asyncio.run(main())
    """
)


class Writer:
    """One writer process and what it acknowledged, read as it goes."""

    def __init__(self, url: str, sid: str, stop: Path, err: Path) -> None:
        self.sid = sid
        self.err_path = err
        self.acks: list[tuple[int, float, float]] = []
        self.reload = 0.0
        self._err = open(err, "w")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, url, sid, str(stop)],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=ROOT,
            env=child_env(MEMVAULT_LOCK_TIMEOUT="120"),
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if parts and parts[0] == "ack":
                self.acks.append((int(parts[1]), float(parts[2]), float(parts[3])))
            elif parts and parts[0] == "reload":
                self.reload = float(parts[1])

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"writer {self.sid} died: {self.stderr()}")
        return True

    def acked_after(self, t: float) -> int:
        return sum(1 for _i, t0, _t1 in self.acks if t0 > t)

    def stderr(self) -> str:
        return self.err_path.read_text()[-3000:]

    def finish(self) -> list[str]:
        """Wait for the writer to stop; the contents it acknowledged, in order."""
        rc = self.proc.wait(timeout=300)
        self._thread.join(60)
        self._err.close()
        assert rc == 0, f"writer {self.sid} failed ({rc}): {self.stderr()}"
        assert [i for i, _a, _b in self.acks] == list(range(len(self.acks)))
        return [f"{self.sid} item {i}" for i, _a, _b in self.acks]

    def waits_within(self, start: float, end: float) -> list[float]:
        """How long each add_items that overlapped [start, end] took."""
        return [t1 - t0 for _i, t0, t1 in self.acks if t1 > start and t0 < end]


def start_writers(url: str, tmp: Path, n: int) -> tuple[list[Writer], Path]:
    stop = tmp / "stop"
    writers = [Writer(url, f"host-{k}", stop, tmp / f"writer-{k}.err") for k in range(n)]
    # Each has imported the SDK, opened its session and acknowledged a few items.
    wait_until(lambda: all(w.alive() and len(w.acks) >= 3 for w in writers), "the writers")
    return writers, stop


def stop_writers(writers: list[Writer], stop: Path) -> dict[str, list[str]]:
    stop.touch()
    return {w.sid: w.finish() for w in writers}


def fresh_session_contents(url: str, sid: str) -> list[str]:
    import vault

    async def read() -> list[Any]:
        return list(await vault.open_session(sid, url).get_items())

    return [i["content"] for i in asyncio.run(read())]


def assert_all_there(url: str, expected: dict[str, list[str]]) -> None:
    """Each session holds exactly the expected items, in order, readable through a fresh
    session and through `memvault show` in another process."""
    for sid, contents in expected.items():
        assert fresh_session_contents(url, sid) == contents, sid
        r = run_cli("--db", url, "--json", "show", sid)
        assert r.code == 0, r
        doc = r.json()
        assert doc["unreadable"] == 0, (sid, doc["unreadable"])
        assert [i["content"] for i in doc["items"]] == contents, sid


def assert_one_key_left(url: str) -> str:
    current = meta(url)["kid"]
    assert set(raw_kids(url)) == {current}
    assert entries_left(url) == {k: k == current for k in entries_left(url)}
    return current


@pytest.mark.slow
def test_writers_on_several_hosts_lose_nothing_while_another_rotates(
    url: str, tmp_path: Path
) -> None:
    n = 8_000  # 16 batches of 500
    bulk = prefill(url, n)
    old_kid = meta(url)["kid"]
    writers, stop = start_writers(url, tmp_path, 3)
    try:
        t_start = time.monotonic()
        r = run_cli("--db", url, "--json", "rotate", timeout=600)
        t_end = time.monotonic()
        assert r.code == 0, r
        report = r.json()
        assert report["old_kid"] == old_kid and report["unreadable"] == 0
        assert report["items"] >= n
        # Some items of every writer after the rotation, under the new key.
        marks = {w.sid: len(w.acks) for w in writers}
        wait_until(
            lambda: all(w.alive() and len(w.acks) >= marks[w.sid] + 3 for w in writers),
            "writes after the rotation",
        )
    finally:
        acked = stop_writers(writers, stop)
    # The writers really wrote while the rotation ran (else this proves nothing).
    during = {w.sid: len(w.waits_within(t_start, t_end)) for w in writers}
    assert all(k >= 1 for k in during.values()), during
    assert sum(len(c) for c in acked.values()) > 9
    # 0 lost acknowledged writes, none twice, every item readable; one key left.
    assert_all_there(url, acked)
    for sid in ("bulk-0", "bulk-9"):
        assert fresh_session_contents(url, sid) == bulk[sid]
    total = sql(url, "SELECT count(*) AS n FROM agent_messages")[0]["n"]
    assert total == n + sum(len(c) for c in acked.values())
    new_kid = assert_one_key_left(url)
    assert new_kid == report["new_kid"] != old_kid
    assert "rotation" not in run_cli("--db", url, "--json", "status").json()


def test_a_write_in_flight_across_the_switch_is_rotated_not_lost(url: str) -> None:
    """A writer whose guard check passed under the old key but which commits only after
    the switch: its row is invisible to the batches until then. The switch must wait for
    it, or the row commits under a key whose entry the rotation then destroys."""
    import asyncpg

    from vault.engines.postgres.url import parse
    from vault.engines.postgres.vault import PgVault

    prefill(url, 3, sessions=1)
    sealer = PgVault.open(url).sealer()
    loc = parse(url)
    in_flight = {"role": "user", "content": "written across the switch"}

    async def go() -> tuple[int | None, bool]:
        conn = await asyncpg.connect(loc.dsn, server_settings=loc.server_settings())
        try:
            tr = conn.transaction()
            await tr.start()
            await conn.execute(
                "INSERT INTO agent_messages (session_id, message_data) VALUES ('bulk-0', $1)",
                sealer.seal("bulk-0", in_flight),
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", "vault", "--db", url, "--json", "rotate"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=child_env(MEMVAULT_LOCK_TIMEOUT="300"),
            )
            waited = False
            deadline = time.monotonic() + 300
            # Until the rotation waits for this transaction's lock, or ends without it.
            while proc.poll() is None and time.monotonic() < deadline:
                waited = bool(
                    await conn.fetchval(
                        "SELECT count(*) FROM pg_locks WHERE NOT granted "
                        "AND relation = 'agent_messages'::regclass"
                    )
                )
                if waited:
                    break
                await asyncio.sleep(0.02)
            await tr.commit()
            await asyncio.to_thread(proc.wait, 300)
            _out, err = proc.communicate()
            assert proc.returncode == 0, err
            return proc.returncode, waited
        finally:
            await conn.close()

    _rc, waited = asyncio.run(go())
    r = run_cli("--db", url, "--json", "show", "bulk-0")
    assert r.code == 0, r
    assert r.json()["unreadable"] == 0, "the in-flight write was left under the destroyed key"
    assert r.json()["items"][-1] == in_flight
    assert waited  # the switch waited for the write in flight
    assert_one_key_left(url)


# The rotation in a process of its own, each of its steps marked with the time it was
# reached (the library calls testhooks.failpoint at each): "<step> <monotonic seconds>".
ROTATOR = textwrap.dedent(
    """
    import sys, time
    from vault import testhooks
    from vault.engines.postgres.vault import PgVault

    def mark(name: str) -> None:
        print(name, f"{time.monotonic():.6f}", flush=True)

    url, batch = sys.argv[1], int(sys.argv[2])
    vault = PgVault.open(url)
    vault.sealer()
    testhooks.failpoint = mark
    mark("begin")
    report = vault.rotate(batch=batch)
    mark("end")
    print("items", report.counts["items"], flush=True)
    """
)


@pytest.mark.slow
def test_writers_never_wait_longer_than_one_batch_of_the_rotation(url: str, tmp_path: Path) -> None:
    n, batch = 10_000, 250  # 40 batches
    prefill(url, n)
    writers, stop = start_writers(url, tmp_path, 3)
    try:
        # Writes before the rotation: what one add_items costs here and now.
        marks = {w.sid: len(w.acks) for w in writers}
        wait_until(
            lambda: all(w.alive() and len(w.acks) >= marks[w.sid] + 10 for w in writers),
            "writes before the rotation",
        )
        before = [t1 - t0 for w in writers for _i, t0, t1 in w.acks[3:]]
        proc = subprocess.run(
            [sys.executable, "-c", ROTATOR, url, str(batch)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=child_env(MEMVAULT_LOCK_TIMEOUT="300"),
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        marks = {w.sid: len(w.acks) for w in writers}
        wait_until(
            lambda: all(w.alive() and len(w.acks) >= marks[w.sid] + 3 for w in writers),
            "writes after the rotation",
        )
    finally:
        acked = stop_writers(writers, stop)
    steps = [(line.split()[0], float(line.split()[1])) for line in proc.stdout.splitlines()]
    at = dict(steps)
    # Each transaction of the rotation that writers can meet: the switch (from the new
    # entry stored to the switch committed) and each batch (from the previous step).
    chain = [
        t
        for name, t in steps
        if name in ("pg-rotate-after-pending", "pg-rotate-after-switch", "pg-rotate-after-batch")
    ]
    transactions = [b - a for a, b in zip(chain, chain[1:], strict=False)]
    assert len(transactions) >= n // batch, steps[:5]
    longest_tx = max(transactions)
    start, end = at["pg-rotate-after-pending"], at["pg-rotate-after-finish"]
    span = end - start
    waits = [x for w in writers for x in w.waits_within(start, end)]
    worst = max(waits)
    # One add_items during a rotation may be refused once by the guard, reload the key
    # and write again, besides waiting for the one transaction it met: twice a normal
    # write, a key reload, and that transaction, with a generous margin on each.
    slack = 3 * max(before) + 2 * max(w.reload for w in writers)
    summary = (
        f"worst writer wait {worst:.3f}s; longest rotation transaction {longest_tx:.3f}s "
        f"of {len(transactions)}; rotation {span:.3f}s; slack {slack:.3f}s "
        f"(normal write max {max(before):.3f}s, key reload max "
        f"{max(w.reload for w in writers):.3f}s); {len(waits)} writes during it"
    )
    print(summary)
    assert worst <= 2 * longest_tx + slack, summary
    assert worst < span / 3, summary
    assert len(waits) >= 3 * 3, "the writers hardly wrote during the rotation"
    assert_all_there(url, acked)
    assert_one_key_left(url)


@pytest.mark.slow
@pytest.mark.crash
def test_sigkill_of_rotate_at_random_instants_loses_nothing_and_resumes(
    url: str,
) -> None:
    import asyncpg

    from vault import crypto
    from vault.engines.postgres.rotate import kid_of
    from vault.engines.postgres.url import parse
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    seed = int(os.environ.get(ENV_SEED, time.time_ns() % 2**32))
    rng = random.Random(seed)
    n = 6_000  # 12 batches of 500
    bulk = prefill(url, n)
    ids = [r["id"] for r in sql(url, "SELECT id FROM agent_messages ORDER BY id")]
    loc = parse(url)
    ks = KeyStore()
    vault_id = meta(url)["vault_id"]

    def check(label: str) -> dict[str, str]:
        """0 items lost; every item decrypts under a key the journal records and the
        keyring still holds."""
        rows = sql(url, "SELECT session_id, message_data FROM agent_messages ORDER BY id")
        assert len(rows) == n, label
        sealers: dict[str, crypto.Sealer] = {}
        for (kid,) in sql(url, "SELECT kid FROM memvault_keys"):
            key = ks.get(entry_name(vault_id, kid))
            if key is not None:
                sealers[kid] = crypto.Sealer(key)
        for sid, data in rows:
            sealer = sealers.get(kid_of(data) or "")
            assert sealer is not None, f"{label}: a row under a key no longer kept"
            opened = sealer.open(sid, data, None)
            assert opened.state is crypto.ItemState.READABLE, label
        return meta(url)

    async def rotate_and_kill(target: int | None, extra_share: float) -> tuple[int, list[int]]:
        """`memvault rotate`, SIGKILLed once its committed progress reaches `target` and
        then a share of one observed batch's time; None: let it finish. (rc, progress seen)"""
        conn = await asyncpg.connect(loc.dsn, server_settings=loc.server_settings())
        proc = subprocess.Popen(
            [sys.executable, "-m", "vault", "--db", url, "--json", "rotate"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=child_env(),
        )
        seen: list[int] = []
        changes: list[float] = []
        try:
            while proc.poll() is None:
                value = await conn.fetchval(
                    "SELECT value FROM memvault_meta WHERE key = 'rotation_progress'"
                )
                if value is not None and (not seen or int(value) != seen[-1]):
                    seen.append(int(value))
                    changes.append(time.monotonic())
                if target is not None and seen and seen[-1] >= target:
                    # One batch's time as observed in this run (the first value seen may
                    # be the previous run's, read before this process even started).
                    per_batch = (
                        (changes[-1] - changes[1]) / (len(changes) - 2) if len(changes) > 2 else 0
                    )
                    await asyncio.sleep(extra_share * per_batch)
                    proc.send_signal(signal.SIGKILL)
                    break
                await asyncio.sleep(0.005)
            _out, err = await asyncio.to_thread(proc.communicate, None, 300)
        finally:
            await conn.close()
        if proc.returncode not in (0, KILLED):
            raise AssertionError(f"rotate failed ({proc.returncode}): {err[-2000:]}")
        return proc.returncode, seen

    killed = resumed = 0
    log: list[str] = []
    try:
        for chain in range(2):
            before = meta(url)
            switched: dict[str, str] | None = None
            last_progress = 0
            for k in range(3):
                # A random point between where the rotation stands and its last rows.
                low = max(last_progress, ids[0])
                target = low + int(rng.uniform(0.1, 0.6) * (ids[-1] - low))
                rc, seen = asyncio.run(rotate_and_kill(target, rng.random()))
                label = (
                    f"seed={seed} chain {chain} kill {k} at id {target}: rc={rc} seen={seen[-3:]}"
                )
                state = check(label)
                label += (
                    f" -> kid={state['kid'][4:12]} from={state.get('rotating_from', '-')[4:12]}"
                )
                label += f" progress={state.get('rotation_progress')}"
                log.append(label)
                assert seen == sorted(seen), label  # progress only moves forward
                if rc != KILLED:
                    break  # the rotation finished before the kill: a new chain
                killed += 1
                if "rotating_from" not in state:
                    if switched is not None:
                        break  # killed after its end: the rotation is over, a new chain
                    continue  # killed before the switch
                if switched is None:
                    switched = state
                    assert (
                        state["kid"] != before["kid"] and state["rotating_from"] == before["kid"]
                    ), label
                else:
                    # The same rotation carried on from where the last run stopped.
                    assert (state["kid"], state["rotating_from"]) == (
                        switched["kid"],
                        switched["rotating_from"],
                    ), label
                    assert seen and seen[0] >= last_progress, label
                    if int(state["rotation_progress"]) > last_progress:
                        resumed += 1  # the resumed run moved rows on before its kill
                last_progress = int(state["rotation_progress"])
            # The next `memvault rotate` finishes the rotation that was cut off.
            still_old = None
            if switched is not None and "rotating_from" in meta(url):
                still_old = raw_kids(url).count(switched["rotating_from"])
            r = run_cli("--db", url, "--json", "rotate", timeout=600)
            assert r.code == 0, (log, r)
            report = r.json()
            log.append(f"chain {chain} finished: items={report['items']}")
            if still_old is not None:
                assert switched is not None
                assert report["new_kid"] == switched["kid"], log
                assert report["items"] == still_old, log  # resumed, not started over
                assert still_old < n, log
            check(f"seed={seed} chain {chain} finished")
            assert_one_key_left(url)
            assert "rotating_from" not in meta(url)
    except AssertionError as exc:
        raise AssertionError(f"seed={seed} (replay: {ENV_SEED}={seed}): {exc}; {log}") from exc
    print(f"seed={seed} killed={killed} resumed={resumed} {log}")
    assert killed >= 3, f"seed={seed}: the kills did not land inside the rotations: {log}"
    assert resumed >= 1, f"seed={seed}: no kill landed in a resumed rotation: {log}"
    for sid in ("bulk-0", "bulk-5"):
        assert fresh_session_contents(url, sid) == bulk[sid]
    r = run_cli("--db", url, "--json", "show", "bulk-3")
    assert r.code == 0 and r.json()["unreadable"] == 0, r
    assert [i["content"] for i in r.json()["items"]] == bulk["bulk-3"]
