"""Group `sessions`: reads and writes through the sessions, side by side."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import vault
from bench.common import (
    LIMIT,
    TURN,
    Config,
    Figure,
    from_samples,
    med,
    record,
    run,
    side_by_side,
    sqlcipher3,
)
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


def bench_sessions(cfg: Config, ws: Workspace) -> None:
    from agents import SQLiteSession
    from agents.extensions.memory import EncryptedSession

    print("building the read/write files ...", flush=True)
    v = ws.new_vault("main")
    main = v.path
    sealer = v.sealer()
    ttl = v.ttl
    sids = {n: f"s{n}" for n in cfg.sizes}
    items = {n: list(make_items(n, seed=n)) for n in cfg.sizes}

    sealed = [(sids[n], sealer.seal(sids[n], it)) for n in cfg.sizes for it in items[n]]
    with contextlib.closing(sqlite3.connect(main, isolation_level=None)) as conn:
        fill(conn, sealed, sealer)
    # The bare EncryptedSession writes into a file without the vault's triggers.
    bare_path = ws.dir / "bare.db"
    with contextlib.closing(plain_db(bare_path)) as conn:
        fill(conn, sealed)
    del sealed
    plaintext = [(sids[n], json.dumps(it)) for n in cfg.sizes for it in items[n]]
    plain_path = ws.dir / "plain.db"
    with contextlib.closing(plain_db(plain_path)) as conn:
        fill(conn, plaintext)
    cipher_conn = None
    if sqlcipher3 is not None:
        cipher_conn = cipher_db(ws.dir / "cipher.db", cipher_key())
        fill(cipher_conn, plaintext)
    del plaintext

    def mv_session(sid: str) -> Any:
        # Every read decrypts every item, as a session's first read does: the repeated
        # read, served by the cache, is group `cache`'s figure.
        return vault.open_session(sid, main, read_cache=False)

    def bare_session(sid: str, path: Path) -> Any:
        return EncryptedSession(
            session_id=sid,
            underlying_session=SQLiteSession(sid, path),
            encryption_key=sealer.master_key,
            ttl=ttl,  # type: ignore[arg-type]
        )

    opened: list[Any] = []

    def readers(n: int) -> dict[str, Any]:
        sid = sids[n]
        r: dict[str, Any] = {
            "memvault": mv_session(sid),
            # Bare EncryptedSession reads the very same rows of the vault file.
            "bare EncryptedSession": bare_session(sid, main),
            "plain SQLiteSession": SQLiteSession(sid, plain_path),
        }
        if cipher_conn is not None:
            r["SQLCipher"] = CipherSession(cipher_conn, sid)
        opened.extend(x for x in r.values() if hasattr(x, "close"))
        return r

    def getter(session: Any, limit: int | None) -> Callable[[], object]:
        return lambda: run(session.get_items(limit))

    def adder(session: Any, items: list[Any]) -> Callable[[], object]:
        return lambda: run(session.add_items(items))

    note = "" if cipher_conn is not None else unavailable_note()
    missing: tuple[str, ...] = () if cipher_conn is not None else ("SQLCipher",)
    sess = {n: readers(n) for n in cfg.sizes}
    for n in cfg.sizes:  # correctness first: every reader returns the same history
        for name, s in sess[n].items():
            got = run(s.get_items())
            assert got == items[n], f"{name} did not return the {n} items"
            assert run(s.get_items(LIMIT)) == items[n][-LIMIT:], name

    print("full history reads ...", flush=True)
    for n in cfg.sizes:
        samples = side_by_side(
            {k: getter(s, None) for k, s in sess[n].items()},
            cfg.reps_read,
            inner=cfg.inner_read,
            warmup=2,
        )
        from_samples(
            f"read_all_{n}",
            f"get_items() full history, {n:,} items",
            samples,
            "bare EncryptedSession",
            "≤ 1.05× bare",
            1.05,
            note,
            missing,
        )

    print(f"get_items(limit={LIMIT}) ...", flush=True)
    limit_med: dict[int, dict[str, float | None]] = {}
    for n in cfg.sizes:
        samples = side_by_side(
            {k: getter(s, LIMIT) for k, s in sess[n].items()},
            cfg.reps_limit,
            inner=cfg.inner_limit,
            warmup=3,
        )
        limit_med[n] = {k: med(x) for k, x in samples.items()}
        from_samples(
            f"read_limit_{n}",
            f"get_items(limit={LIMIT}), {n:,} items",
            samples,
            "bare EncryptedSession",
            "≤ 1.10× bare",
            1.10,
            note,
            missing,
        )
    lo, hi = cfg.sizes[0], cfg.sizes[-1]

    def growth(name: str) -> float | None:
        a, b = limit_med[lo].get(name), limit_med[hi].get(name)
        return b / a if a and b else None

    record(
        Figure(
            key="read_limit_flatness",
            label=f"get_items(limit={LIMIT}) growth, {lo:,} → {hi:,} items",
            unit="x",
            memvault=growth("memvault"),
            comparisons={k: growth(k) for k in limit_med[lo] if k != "memvault"},
            target="flat: ≤ 1.25×",
            limit=1.25,
            note="time at the largest N over time at the smallest N (1.00 = perfectly flat)",
        )
    )

    print(f"add_items ({TURN} items, one turn) ...", flush=True)
    turn = list(make_items(TURN, seed=7))
    for n in cfg.sizes:
        sid = sids[n]
        writers: dict[str, Any] = {
            "memvault": mv_session(sid),
            "bare EncryptedSession": bare_session(sid, bare_path),
            "plain SQLiteSession": SQLiteSession(sid, plain_path),
        }
        if cipher_conn is not None:
            writers["SQLCipher"] = CipherSession(cipher_conn, sid)
        opened.extend(x for x in writers.values() if hasattr(x, "close"))
        samples = side_by_side(
            {k: adder(s, turn) for k, s in writers.items()},
            cfg.reps_write,
            inner=cfg.inner_write,
            warmup=2,
        )
        from_samples(
            f"add_turn_{n}",
            f"add_items({TURN} items) into {n:,} items, triggers on",
            samples,
            "bare EncryptedSession",
            "≤ 1.10× bare",
            1.10,
            note + ("; " if note else "") + "each call commits (WAL, synchronous=FULL)",
            missing,
        )
    for s in opened:
        with contextlib.suppress(Exception):
            s.close()
    if cipher_conn is not None:
        cipher_conn.close()
