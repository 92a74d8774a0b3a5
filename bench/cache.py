"""Group `cache`: the read cache (vault.readcache) on the agent's own pattern.

Before each turn the runner reads the whole history; after it, it adds the turn. So
each round here adds one turn (untimed) to every session, then times one full read of
each, in an order drawn afresh: memvault's repeated read (its cache warm from the round
before), memvault's first read (its cache dropped just before), the bare SDK
EncryptedSession and SQLCipher over the same items.
"""

from __future__ import annotations

import contextlib
import json
import random
import sqlite3
import time
from typing import Any

import vault
from bench.common import TURN, Config, from_samples, run, sqlcipher3
from bench.data import make_items
from bench.workspace import (
    CipherSession,
    Workspace,
    cipher_db,
    cipher_key,
    fill,
    plain_db,
    unavailable_note,
)

REPEATED = "memvault"  # the figure's own: the repeated read
FIRST = "memvault, first read"
BARE = "bare EncryptedSession"


def bench_cache(cfg: Config, ws: Workspace) -> None:
    from agents import SQLiteSession
    from agents.extensions.memory import EncryptedSession

    n = cfg.sizes[-1]
    print(f"cache: building a {n:,}-item session ...", flush=True)
    v = ws.new_vault("cache")
    sealer = v.sealer()
    items = list(make_items(n, seed=n))
    sid = "cached"
    with contextlib.closing(sqlite3.connect(v.path, isolation_level=None)) as conn:
        fill(conn, [(sid, sealer.seal(sid, it)) for it in items], sealer)
    bare_path = ws.dir / "cache-bare.db"
    with contextlib.closing(plain_db(bare_path)) as conn:
        fill(conn, [(sid, sealer.seal(sid, it)) for it in items])
    cipher_conn = None
    if sqlcipher3 is not None:
        cipher_conn = cipher_db(ws.dir / "cache-cipher.db", cipher_key())
        fill(cipher_conn, [(sid, json.dumps(it)) for it in items])

    cached = vault.open_session(sid, v.path)
    first = vault.open_session(sid, v.path)
    sessions: dict[str, Any] = {
        REPEATED: cached,
        FIRST: first,
        BARE: EncryptedSession(
            session_id=sid,
            underlying_session=SQLiteSession(sid, bare_path),
            encryption_key=sealer.master_key,
            ttl=v.ttl,  # type: ignore[arg-type]
        ),
    }
    if cipher_conn is not None:
        sessions["SQLCipher"] = CipherSession(cipher_conn, sid)

    def first_read() -> object:
        first.forget_reads()  # the cache as a new session has it: empty
        first.underlying_session.chain.memo = None
        return run(first.get_items())

    reads = {
        name: (first_read if name == FIRST else (lambda s=s: run(s.get_items())))
        for name, s in sessions.items()
    }
    for name, s in sessions.items():  # correctness first
        if name != FIRST:
            assert run(s.get_items()) == items, f"{name} did not return the {n} items"
    assert first_read() == items
    # Many rounds: a full collection of the cyclic GC (some 100 ms once the SDK is
    # imported) lands on one read of a round, whichever it is; the median sees through it.
    rounds = max(cfg.reps_read * 4, 20)
    print(f"cache: one turn added, then a full read, {rounds} rounds ...", flush=True)
    turn = list(make_items(TURN, seed=11))
    samples: dict[str, list[float]] = {name: [] for name in reads}
    writers = [s for name, s in sessions.items() if name != FIRST]
    for _ in range(rounds):
        for s in writers:  # the turn the runner stores after the model answered
            run(s.add_items(turn))
        order = list(reads)
        random.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            reads[name]()
            samples[name].append(time.perf_counter() - t0)
    got = run(cached.get_items())
    assert got == run(sessions[BARE].get_items()) and len(got) > n
    note = "" if cipher_conn is not None else unavailable_note()
    missing: tuple[str, ...] = () if cipher_conn is not None else ("SQLCipher",)
    from_samples(
        f"cache_repeated_read_{n}",
        f"get_items() after one new turn, {n:,} items, cache warm",
        samples,
        "SQLCipher" if cipher_conn is not None else BARE,
        "≤ SQLCipher's read of the same items",
        1.0 if cipher_conn is not None else None,  # judged against SQLCipher only
        note,
        missing,
    )
    first_samples = {"memvault": samples[FIRST], BARE: samples[BARE]}
    from_samples(
        f"cache_first_read_{n}",
        f"get_items() first read of a session, {n:,} items, chain check included",
        first_samples,
        BARE,
        "≤ 1.10× bare",
        1.10,
    )
    for s in sessions.values():
        with contextlib.suppress(Exception):
            s.close()
    if cipher_conn is not None:
        cipher_conn.close()
