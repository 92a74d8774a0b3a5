"""Group `rotation`: rotation, its memory, purge and shred of a 100,000-item vault.

The online rotation (`memvault rotate`, whose cryptography runs in one worker process
per core at this size) runs side by side with the bare single-process
`MultiFernet.rotate` loop and with 0.2's rotation in one transaction (bench.onetx),
for its wall time and for a writer's longest wait; its memory is that of all its
processes together.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from cryptography.fernet import MultiFernet

from bench.common import Config, Figure, from_samples, med, record, side_by_side, sqlcipher3
from bench.data import make_items
from bench.procs import memvault_cmd, timed_child, timed_tree, writer_during
from bench.workspace import (
    CHUNK,
    EXPIRED_EVERY,
    Workspace,
    build_big,
    cipher_db,
    cipher_key,
    fill,
    session_of,
    unavailable_note,
)
from vault import crypto, paths
from vault.engines.sqlite.shred import shred
from vault.engines.sqlite.vault import Vault
from vault.keyjournal import entry_name
from vault.keys import KeyStore

ONE_TX = "one transaction (0.2)"
# Figures of the 100,000-item phase that the scale phase compares with.
REFERENCE: dict[str, float] = {}


def bench_rotation(cfg: Config, ws: Workspace) -> None:
    n = cfg.rot_items
    print(f"building a {n:,}-item vault ...", flush=True)
    v = ws.new_vault("rotate")
    sealer = v.sealer()
    sid_of = [session_of(i, cfg.rot_sessions) for i in range(n)]
    build_big(v, n, cfg.rot_sessions, seed=99)
    cipher_conn = None
    if sqlcipher3 is not None:
        cipher_conn = cipher_db(ws.dir / "cipher-rotate.db", cipher_key())
        fill(
            cipher_conn,
            (
                (sid_of[s + k], json.dumps(it))
                for s in range(0, n, CHUNK)
                for k, it in enumerate(make_items(min(CHUNK, n - s), seed=99 * 1_000_003 + s))
            ),
        )

    # The same tokens, for the bare loop: what MultiFernet.rotate alone costs.
    with contextlib.closing(sqlite3.connect(v.path)) as conn:
        tokens = [
            (sid, json.loads(data)["payload"].encode())
            for sid, data in conn.execute(
                "SELECT session_id, message_data FROM agent_messages ORDER BY id"
            )
        ]
    new_key = crypto.generate_key()
    multi = {
        sid: MultiFernet([crypto.session_fernet(new_key, sid), sealer.fernet(sid)])
        for sid in set(sid_of)
    }

    def bare_loop() -> None:
        for sid, tok in tokens:
            multi[sid].rotate(tok)

    env = ws.child_env()
    cmd = [*memvault_cmd(), "--db", str(v.path), "--json", "rotate"]
    rss: list[float] = []  # all the rotation's processes: the sum of their own peaks
    top: list[float] = []  # the largest sum of their RSS seen at one instant
    own: list[float] = []  # the rotating process alone
    procs: list[int] = []
    inproc: list[float] = []
    wall: list[float] = []  # the command alone, without the launcher's own start-up

    def mv_rotate() -> None:
        secs, memory, out = timed_tree(cmd, env)
        report = json.loads(out)
        assert report["items"] == n and report["scrubbed"], report
        rss.append(memory["sum"] / 1e6)
        top.append(memory["top"] / 1e6)
        own.append(memory["root"] / 1e6)
        procs.append(memory["processes"])
        inproc.append(float(report["seconds"]))
        wall.append(secs)

    single = [sys.executable, "-m", "bench.onetx", str(v.path)]
    single_wall: list[float] = []

    def one_transaction() -> None:
        secs, _peak, out = timed_child(single, env)
        report = json.loads(out)
        assert report["items"] == n and report["scrubbed"], report
        single_wall.append(secs)

    def rekey() -> None:
        assert cipher_conn is not None
        cipher_conn.execute(f"PRAGMA rekey = \"x'{cipher_key()}'\"")
        cipher_conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    cases: dict[str, Callable[[], object]] = {
        "memvault": mv_rotate,
        ONE_TX: one_transaction,
        "bare MultiFernet loop": bare_loop,
    }
    if cipher_conn is not None:
        cases["SQLCipher rekey"] = rekey
    print(f"rotating {n:,} items ...", flush=True)
    samples = side_by_side(cases, cfg.reps_rotate, warmup=0)
    samples["memvault"] = wall
    samples[ONE_TX] = single_wall
    note = "" if cipher_conn is not None else unavailable_note() + "; "
    from_samples(
        f"rotate_{n}",
        f"`memvault rotate` of {n:,} items, scrub included (wall, new process, "
        f"{max(procs) - 1} worker processes)",
        samples,
        "bare MultiFernet loop",
        "≤ 1.2× bare loop",
        1.2,
        note + f"in-process Vault.rotate(): {statistics.median(inproc):.2f} s; the bare loop is "
        "one process",
        () if cipher_conn is not None else ("SQLCipher rekey",),
    )
    from_samples(
        f"rotate_{n}_online",
        f"online `memvault rotate` of {n:,} items against 0.2's one transaction (wall)",
        {"memvault": wall, ONE_TX: single_wall},
        ONE_TX,
        "≤ 1.2× one transaction",
        1.2,
        "both in a new process, interleaved; batches of 2,000 rows read and encrypted "
        "outside the write lock",
    )
    tokens.clear()
    REFERENCE["rotate_wall"] = statistics.median(wall)
    idle_rss = timed_child([*memvault_cmd(), "--db", str(v.path), "--json", "status"], env)[1]
    REFERENCE["status_rss"] = idle_rss / 1e6
    record(
        Figure(
            key=f"rotate_{n}_peak_rss",
            label=f"peak memory of `memvault rotate` and its workers together, {n:,} items",
            unit="MB",
            memvault=max(rss),
            comparisons={
                "largest sum of their RSS at one instant": max(top),
                "the rotating process alone": max(own),
                "`memvault status` on the same vault": idle_rss / 1e6,
            },
            target="≤ 150 MB",
            limit=150.0,
            note=f"max over repetitions of the sum of each of its {max(procs)} processes' own "
            "peak RSS (VmHWM, its process tree polled in /proc every 10 ms; an upper bound "
            "of their peak together)",
            samples={"memvault": rss},
        )
    )
    # Purge of the expired tenth, on a copy (the original goes on to the shred figure).
    purge_copy = ws.dir / "purge-copy" / "history.db"
    purge_copy.parent.mkdir(mode=0o700)
    shutil.copyfile(v.path, purge_copy)
    ws.adopt(purge_copy, v.vault_id)
    secs, peak, out = timed_child(
        [*memvault_cmd(), "--db", str(purge_copy), "--json", "purge", "--yes"], env
    )
    report = json.loads(out)
    assert report["deleted"] == len(range(0, n, EXPIRED_EVERY)) and report["scrubbed"], report
    REFERENCE["purge_wall"] = secs
    record(
        Figure(
            key=f"purge_{n}_peak_rss",
            label=f"peak RSS of `memvault purge`, {n // EXPIRED_EVERY:,} expired of {n:,} items",
            unit="MB",
            memvault=peak / 1e6,
            comparisons={"`memvault status` on the same vault": idle_rss / 1e6},
            target="≤ 100 MB",
            limit=100.0,
            note=f"one run, {secs:.2f} s wall; os.wait4() rusage of the purging process",
        )
    )
    if cipher_conn is not None:
        cipher_conn.close()

    # Shred: fresh copies of the rotated vault, the key put back before each one.
    print(f"shredding {n:,}-item vaults ...", flush=True)
    rotated = Vault.open(v.path).sealer()
    master, kid = rotated.master_key, rotated.kid
    vault_id = v.vault_id
    ks = KeyStore()
    sizes: list[int] = []
    copies = iter(range(1_000))

    def mv_shred() -> None:
        folder = ws.dir / f"shred-{next(copies)}"
        folder.mkdir(mode=0o700)
        target = folder / "history.db"
        shutil.copyfile(v.path, target)
        ws.adopt(target, vault_id)
        ks.set(entry_name(vault_id, kid), master)
        size = sum(p.stat().st_size for p in paths.sidecars(target) if p.exists())
        t0 = time.perf_counter()
        report = shred(target, ks)
        t = time.perf_counter() - t0
        assert report["items"] == n and report["key_destroyed"], report
        sizes.append(size)
        shred_times.append(t)

    shred_times: list[float] = []
    dd_times: list[float] = []
    dd_target = ws.dir / "dd.bin"

    def dd() -> None:
        size = v.path.stat().st_size
        shutil.copyfile(v.path, dd_target)
        t0 = time.perf_counter()
        subprocess.run(
            [
                "dd",
                "if=/dev/zero",
                f"of={dd_target}",
                "bs=1M",
                f"count={size}",
                "iflag=count_bytes",
                "conv=notrunc,fsync",
                "status=none",
            ],
            check=True,
        )
        dd_times.append(time.perf_counter() - t0)
        dd_target.unlink()

    # Timed inside each case (the copies are set up outside the clock).
    side_by_side({"memvault": mv_shred, "dd": dd}, cfg.reps_shred, warmup=0)
    # The original is shredded at clean-up; its key goes with it.
    ks.set(entry_name(vault_id, kid), master)
    record(
        Figure(
            key=f"shred_{n}",
            label=f"shred() of a {n:,}-item vault ({statistics.median(sizes) / 1e6:.0f} MB)",
            unit="s",
            memvault=med(shred_times),
            comparisons={"dd same bytes, fsync": med(dd_times)},
            baseline="dd same bytes, fsync",
            target="report ratio",
            note="dd if=/dev/zero conv=notrunc,fsync over a file of the vault's size",
            samples={"memvault": shred_times, "dd same bytes, fsync": dd_times},
        )
    )
    # Last: the writer's items change the vault the figures above count on.
    print(f"rotating {n:,} items with a writer in another process ...", flush=True)
    secs, writes = writer_during(str(v.path), env, cmd)
    one_secs, one_writes = writer_during(str(v.path), env, single)
    waits, one_waits = writes["waits"], one_writes["waits"]
    record(
        Figure(
            key=f"writer_wait_rotate_{n}",
            label=f"longest `add_items` of a writer in another process while {n:,} items rotate",
            unit="s",
            memvault=max(waits) if waits else None,
            comparisons={
                f"{ONE_TX}, longest": max(one_waits) if one_waits else None,
                "the online rotation's wall time": secs,
                f"{ONE_TX}'s wall time": one_secs,
                "median add_items": statistics.median(waits) if waits else None,
            },
            target="≤ 1 s",
            limit=1.0,
            note=(
                f"{len(waits)} writes, {len(writes['errors'])} refused"
                + (f" ({writes['errors'][0]})" if writes["errors"] else "")
                + "; the online rotation holds the write lock only to write a batch, "
                "0.2's for its whole transaction"
            ),
        )
    )
