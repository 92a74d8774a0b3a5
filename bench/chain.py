"""Group `chain`: what the history chain costs, side by side in one run.

`bench_chain` (the group): chains on and off in the same vault session. "Chains
off" is that session on the same file with only the chain's work taken out (bench
only; memvault has no such switch): its writes store a placeholder link, which
the guard accepts and no check would, and its reads return the rows without
judging them against the session's head. Both read the same rows and write
sessions of the same length, so the ratio is the chain's own cost. And `verify`'s
time per item at two sizes: linear if equal.

`python -m bench.chain [items]`: a micro-figure, the chain's cost per item beside
the envelope's, with no keyring and no file. Each pair is interleaved round by
round, and the median of the rounds is printed.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import vault
from bench.common import LIMIT, TURN, Config, Figure, from_samples, record, run, side_by_side
from bench.data import make_items
from bench.workspace import Workspace, fill
from vault import chain, crypto

ROUNDS = 7
VAULT_ID = "0" * 32


def _per_item(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / n * 1e6


def _check(key: chain.ChainKey, text: str, raw: str) -> bool:
    link = chain.Link.decode(raw)  # a read decodes the stored link too
    return link is not None and chain.link_ok(key, link, text)


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 2000
    sealer = crypto.Sealer(crypto.generate_key())
    key = chain.chain_key(sealer.master_key, VAULT_ID)
    items = list(make_items(n, seed=21))
    texts = [sealer.seal("s", item) for item in items]
    links, _ = chain.extend(key, "s", chain.new_head(key, "s"), texts)
    stored = [(t, lk.encode()) for lk, t in zip(links, texts, strict=True)]
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "add (seal vs link)": (
            lambda: [sealer.seal("s", item) for item in items],
            lambda: chain.extend(key, "s", chain.new_head(key, "s"), texts),
        ),
        "read (open vs check link)": (
            lambda: [sealer.open("s", t, None) for t in texts],
            lambda: [_check(key, t, raw) for t, raw in stored],
        ),
    }
    print(f"{n} items, median of {ROUNDS} rounds, microseconds per item")
    print(f"{'':28}{'Fernet':>10}{'chain':>10}{'chain/Fernet':>14}")
    for name, (fernet, link) in pairs.items():
        a, b = [], []
        for _ in range(ROUNDS):
            a.append(_per_item(fernet, n))
            b.append(_per_item(link, n))
        fa, fb = statistics.median(a), statistics.median(b)
        print(f"{name:28}{fa:10.1f}{fb:10.1f}{fb / fa:13.1%}")
    return 0


PLACEHOLDER = "-"  # not a link: a chains-on read of these rows would call them tampered


def _unchained_class(base: type) -> type:
    """The vault's SQLite session with the chain's steps replaced by none."""
    from vault.engines.sqlite import chainrows

    class Unchained(base):  # type: ignore[misc, valid-type]
        def _insert_items(self, conn: sqlite3.Connection, items: list[Any]) -> None:
            conn.execute(
                "INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", (self.session_id,)
            )
            conn.executemany(
                "INSERT INTO agent_messages (session_id, message_data, chain) VALUES (?, ?, ?)",
                [(self.session_id, json.dumps(item), PLACEHOLDER) for item in items],
            )
            conn.execute(
                "UPDATE agent_sessions SET updated_at = CURRENT_TIMESTAMP WHERE session_id = ?",
                (self.session_id,),
            )

        def _read_checked(self, wanted: int | None) -> list[Any]:
            with self._locked_connection() as conn:
                conn.execute("BEGIN")  # the same one snapshot as the chained read
                try:
                    rows = chainrows.session_rows(conn, self.session_id, wanted)
                    return [json.loads(text) for text, _link in rows]
                finally:
                    conn.execute("COMMIT")

    return Unchained


def _session(path: Any, sid: str, chained: bool) -> Any:
    s = vault.open_session(sid, path, read_cache=False)  # each read judges every row
    if not chained:
        inner = s.underlying_session
        inner.__class__ = _unchained_class(type(inner))
    return s


def bench_chain(cfg: Config, ws: Workspace) -> None:
    print("building the chain's files ...", flush=True)
    v = ws.new_vault("chain")
    sealer = v.sealer()
    items = {n: list(make_items(n, seed=n)) for n in cfg.sizes}
    rows = [
        (f"{tag}{n}", sealer.seal(f"{tag}{n}", it))
        for n in cfg.sizes
        for tag in ("on", "off")
        for it in items[n]
    ]
    with contextlib.closing(sqlite3.connect(v.path, isolation_level=None)) as conn:
        fill(conn, rows, sealer)
    del rows
    opened: list[Any] = []

    def pair(n: int) -> dict[str, Any]:
        # Reads: both sessions read the one chained session's rows.
        s = {"memvault": _session(v.path, f"on{n}", True)}
        s["memvault, chains off"] = _session(v.path, f"on{n}", False)
        opened.extend(s.values())
        return s

    note = "chains off: the same session with the chain's steps taken out (bench only)"
    for n in cfg.sizes:
        s = pair(n)
        for sess in s.values():  # correctness first
            assert run(sess.get_items()) == items[n]
        samples = side_by_side(
            {k: (lambda x=x: run(x.get_items())) for k, x in s.items()},
            cfg.reps_read,
            inner=cfg.inner_read,
            warmup=2,
        )
        from_samples(
            f"chain_read_all_{n}",
            f"chain's cost: get_items() full history, {n:,} items",
            samples,
            "memvault, chains off",
            "≤ 1.05× chains off",
            1.05,
            note,
        )
        samples = side_by_side(
            {k: (lambda x=x: run(x.get_items(LIMIT))) for k, x in s.items()},
            cfg.reps_limit,
            inner=cfg.inner_limit,
            warmup=3,
        )
        from_samples(
            f"chain_read_limit_{n}",
            f"chain's cost: get_items(limit={LIMIT}), {n:,} items",
            samples,
            "memvault, chains off",
            "report",
            None,
            note,
        )
    turn = list(make_items(TURN, seed=7))
    for n in cfg.sizes:
        writers = {
            "memvault": _session(v.path, f"on{n}", True),
            "memvault, chains off": _session(v.path, f"off{n}", False),
        }
        opened.extend(writers.values())
        samples = side_by_side(
            {k: (lambda x=x: run(x.add_items(turn))) for k, x in writers.items()},
            cfg.reps_write,
            inner=cfg.inner_write,
            warmup=2,
        )
        from_samples(
            f"chain_add_turn_{n}",
            f"chain's cost: add_items({TURN} items) into {n:,} items",
            samples,
            "memvault, chains off",
            "≤ 1.05× chains off",
            1.05,
            note + "; each call commits (WAL, synchronous=FULL)",
        )
    for x in opened:
        with contextlib.suppress(Exception):
            x.close()
    _verify_growth(cfg, ws)


def _verify_growth(cfg: Config, ws: Workspace) -> None:
    """`verify`'s time per item at the smallest and the largest size: linear if equal."""
    per_item: dict[int, float] = {}
    for n in (cfg.sizes[-1], cfg.sizes[-1] * 4):
        v = ws.new_vault(f"verify{n}")
        sealer = v.sealer()
        made = enumerate(make_items(n, seed=n))
        rows = [(f"s{i % 10}", sealer.seal(f"s{i % 10}", it)) for i, it in made]
        with contextlib.closing(sqlite3.connect(v.path, isolation_level=None)) as conn:
            fill(conn, rows, sealer)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            report = vault.Vault.verify(v.path)
            times.append(time.perf_counter() - t0)
            assert report.ok, report
        per_item[n] = sorted(times)[1] / n
    lo, hi = sorted(per_item)
    record(
        Figure(
            key="chain_verify_linear",
            label=f"verify's time per item, {lo:,} → {hi:,} items",
            unit="x",
            memvault=per_item[hi] / per_item[lo],
            comparisons={},
            target="linear: ≤ 1.25×",
            limit=1.25,
            note="time per item at the larger size over that at the smaller (1.00 = linear)",
        )
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
