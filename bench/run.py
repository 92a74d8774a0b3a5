#!/usr/bin/env python3
"""memvault benchmarks: what the vault costs, side by side with the alternatives.

    scripts/with-keyring .venv/bin/python bench/run.py [--quick] [--json-out PATH]

Every figure is measured in one run, on the same data, with the alternatives
interleaved call by call (the order rotating from round to round). Times are
medians of several repetitions; a ratio is the median of the per-repetition
ratios. Absolute times on a shared machine are noisy; the ratios are what
count. See bench/README.md for what each figure means.

The benchmark needs a real keyring and refuses to run outside the private,
throwaway Secret Service that scripts/with-keyring starts. Every vault it
creates lives in a temporary folder and is shredded at the end, so its keyring
entries go away too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import gc
import json
import multiprocessing
import os
import platform
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_JSON = HERE / "results.json"

try:
    from cryptography.fernet import MultiFernet

    import vault
    from vault import crypto, paths
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore
    from vault.shred import shred
    from vault.store import DEFAULT_TTL, Vault
except ImportError as _exc:  # pragma: no cover - a setup problem, not a benchmark result
    sys.exit(
        f"bench: cannot import memvault ({_exc}); run scripts/bootstrap and use .venv/bin/python"
    )

try:
    import sqlcipher3  # type: ignore[import-not-found, import-untyped, unused-ignore]
except ImportError:  # reported as "unavailable", never faked
    sqlcipher3 = None

LIMIT = 20  # get_items(limit=20): the window an agent typically asks for
TURN = 2  # one turn's add_items: the user's message and the assistant's answer


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    quick: bool
    sizes: tuple[int, ...]  # items per session for reads and writes
    rot_items: int  # items in the vault that is rotated and shredded
    rot_sessions: int
    cli_items: int  # items in the vault `status` / `sessions` look at
    reps_read: int
    inner_read: int
    reps_limit: int
    inner_limit: int
    reps_write: int
    inner_write: int
    reps_cli: int
    reps_open: int
    reps_cold_open: int
    reps_rotate: int
    reps_shred: int
    scale: bool = False  # --scale: the million-item figures too
    scale_items: int = 1_000_000

    @classmethod
    def make(cls, quick: bool, scale: bool = False) -> Config:
        if quick:  # 10x smaller everywhere; CI runs it so that the script cannot rot
            return cls(
                scale=scale,
                scale_items=100_000,
                quick=True,
                sizes=(100, 1_000),
                rot_items=10_000,
                rot_sessions=10,
                cli_items=100,
                reps_read=5,
                inner_read=2,
                reps_limit=5,
                inner_limit=20,
                reps_write=7,
                inner_write=10,
                reps_cli=3,
                reps_open=5,
                reps_cold_open=2,
                reps_rotate=2,
                reps_shred=2,
            )
        return cls(
            scale=scale,
            quick=False,
            sizes=(1_000, 10_000),
            rot_items=100_000,
            rot_sessions=100,
            cli_items=1_000,
            reps_read=7,
            inner_read=3,
            reps_limit=9,
            inner_limit=100,
            reps_write=31,
            inner_write=20,
            reps_cli=9,
            reps_open=15,
            reps_cold_open=3,
            reps_rotate=3 if scale else 5,  # --scale: the million-item work takes long
            reps_shred=3,
        )


# --------------------------------------------------------------------------
# Data: agent turns of about 800 bytes of JSON each
# --------------------------------------------------------------------------
WORDS = tuple(
    " ".join(
        [
            "the agent reads the ticket and checks the build log before it answers with a short",
            "plan that names each file it will touch and why the test failed on the second run",
            "because the fixture kept a stale key so the vault refused the write and the user",
            "asked for a summary of what changed since yesterday including the release notes",
            "and the open questions",
        ]
    ).split(" ")
)


def _text(rng: random.Random, length: int) -> str:
    words: list[str] = []
    size = 0
    while size < length:
        w = rng.choice(WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:length]


def make_item(rng: random.Random, i: int) -> dict[str, Any]:
    """One Responses-API input item of 700-900 bytes of JSON, like an agent's turns."""
    target = rng.randint(700, 900)
    kind = i % 4
    call = f"call_{rng.getrandbits(96):024x}"
    item: dict[str, Any]
    if kind == 0:
        item = {"role": "user", "content": ""}
        key: tuple[Any, ...] = ("content",)
    elif kind == 1:
        item = {
            "type": "function_call",
            "id": f"fc_{rng.getrandbits(128):032x}",
            "call_id": call,
            "name": "search_notes",
            "arguments": "",
            "status": "completed",
        }
        key = ("arguments",)
    elif kind == 2:
        item = {"type": "function_call_output", "call_id": call, "output": ""}
        key = ("output",)
    else:
        item = {
            "id": f"msg_{rng.getrandbits(128):032x}",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "", "annotations": []}],
        }
        key = ("content", 0, "text")
    room = max(0, target - len(json.dumps(item)))
    text = _text(rng, room)
    if kind == 1:
        text = json.dumps({"query": text[: max(0, room - 14)]})
    holder: Any = item
    for k in key[:-1]:
        holder = holder[k]
    holder[key[-1]] = text
    return item


def make_items(n: int, seed: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for i in range(n):
        yield make_item(rng, i)


def chunked(it: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for x in it:
        batch.append(x)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


# --------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------
LOOP = asyncio.new_event_loop()


def run(coro: Any) -> Any:
    return LOOP.run_until_complete(coro)


def side_by_side(
    cases: dict[str, Callable[[], object]], reps: int, inner: int = 1, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each case, interleaved call by call.

    Each repetition is `inner` rounds; a round calls every case once, the order
    rotating from round to round, and each call is timed on its own. A burst of
    load from elsewhere on the machine so lands on all the cases of a round
    rather than on one case's whole sample. A sample is the mean call time over
    one repetition; the figures are medians of these samples.
    """
    names = list(cases)
    for _ in range(warmup):
        for n in names:
            cases[n]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    k = 0
    for _ in range(reps):
        total = dict.fromkeys(names, 0.0)
        gc.collect()
        gc.disable()
        try:
            for _ in range(inner):
                k += 1
                j = k % len(names)
                for n in names[j:] + names[:j]:
                    fn = cases[n]
                    t0 = time.perf_counter()
                    fn()
                    total[n] += time.perf_counter() - t0
        finally:
            gc.enable()
        for n in names:
            samples[n].append(total[n] / inner)
    return samples


def med(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass
class Figure:
    key: str
    label: str
    unit: str  # "s" or "MB"
    memvault: float | None
    comparisons: dict[str, float | None] = field(default_factory=dict)
    baseline: str | None = None  # the comparison the ratio is taken against
    ratio: float | None = None  # median of the per-repetition ratios (side by side)
    ratio_of_medians: float | None = None
    target: str = "report"
    limit: float | None = None  # the ratio (or the MB) the figure must stay under
    met: bool | None = None  # None: a figure to report, not a target
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)

    def judge(self) -> Figure:
        """The ratio: the median of the per-repetition ratios, each repetition measuring
        memvault and its baseline side by side (call by call); the ratio of the two
        medians is kept too, and a note says when the two disagree on the target."""
        if self.baseline is not None:
            base = self.comparisons.get(self.baseline)
            if self.memvault is not None and base:
                self.ratio_of_medians = self.memvault / base
            mv, other = self.samples.get("memvault"), self.samples.get(self.baseline)
            if mv and other and len(mv) == len(other):
                self.ratio = statistics.median(a / b for a, b in zip(mv, other, strict=True))
            else:
                self.ratio = self.ratio_of_medians
        value = self.ratio if self.baseline is not None else self.memvault
        if self.limit is not None and value is not None:
            self.met = value <= self.limit
            other_view = self.ratio_of_medians
            if other_view is not None and (other_view <= self.limit) != self.met:
                self.note += (
                    "; " if self.note else ""
                ) + f"borderline: the ratio of the medians is {other_view:.2f}×"
        return self


FIGURES: list[Figure] = []


def record(fig: Figure) -> Figure:
    FIGURES.append(fig.judge())
    print(
        f"  {fig.label}: {fmt_value(fig.memvault, fig.unit)}"
        + (f", ratio {fig.ratio:.2f}x" if fig.ratio is not None else ""),
        flush=True,
    )
    return fig


def from_samples(
    key: str,
    label: str,
    samples: dict[str, list[float]],
    baseline: str | None,
    target: str,
    limit: float | None,
    note: str = "",
    unavailable: tuple[str, ...] = (),
) -> Figure:
    comparisons = {k: med(v) for k, v in samples.items() if k != "memvault"}
    comparisons.update(dict.fromkeys(unavailable))  # printed as "unavailable", never faked
    return record(
        Figure(
            key=key,
            label=label,
            unit="s",
            memvault=med(samples.get("memvault")),
            comparisons=comparisons,
            baseline=baseline,
            target=target,
            limit=limit,
            note=note,
            samples=samples,
        )
    )


# --------------------------------------------------------------------------
# Files: the vaults and the alternatives, built fast (envelopes written directly)
# --------------------------------------------------------------------------
class Workspace:
    """A private temporary folder; every vault made here is shredded on exit."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="memvault-bench-"))
        os.chmod(self.dir, 0o700)
        self.vaults: list[tuple[Path, str]] = []
        self.kids: dict[Path, set[str]] = {}

    def new_vault(self, name: str) -> Vault:
        path = self.dir / name / "history.db"
        v = Vault.init(path, ttl=DEFAULT_TTL)
        self.vaults.append((path, v.vault_id))
        self.kids.setdefault(path, set()).add(v.sealer().kid)
        return v

    def child_env(self) -> dict[str, str]:
        """The environment of the commands timed: bytecode cached, as in a normal install.

        With PYTHONDONTWRITEBYTECODE set (as some CI and sandbox shells do), every
        `memvault` process would recompile vault/*.py (~30 ms) while the baseline's
        packages come precompiled from site-packages. A private pycache prefix lets both
        sides run from cached bytecode without writing into the source tree.
        """
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(self.dir / "pycache")
        return env

    def adopt(self, path: Path, vault_id: str) -> None:
        self.vaults.append((path, vault_id))

    def cleanup(self) -> None:
        ks = KeyStore()
        for path, _vid in self.vaults:
            if path.exists():
                with contextlib.suppress(Exception):
                    shred(path, ks)
        for path, vid in self.vaults:  # keys of vaults whose file is gone already
            for kid in self.kids.get(path, ()):
                with contextlib.suppress(Exception):
                    ks.delete(entry_name(vid, kid))
        shutil.rmtree(self.dir, ignore_errors=True)


SDK_DDL = (
    """CREATE TABLE IF NOT EXISTS agent_sessions (
        session_id TEXT PRIMARY KEY,
        created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
        updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP)""",
    """CREATE TABLE IF NOT EXISTS agent_messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id TEXT NOT NULL,
        message_data TEXT NOT NULL,
        created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
        FOREIGN KEY (session_id) REFERENCES agent_sessions (session_id) ON DELETE CASCADE)""",
    "CREATE INDEX IF NOT EXISTS idx_agent_messages_session_id ON agent_messages (session_id, id)",
)


def fill(conn: Any, rows: Iterable[tuple[str, str]]) -> int:
    """Insert (session_id, message_data) rows in one transaction; the SDK's own tables."""
    n = 0
    conn.execute("BEGIN")
    seen: set[str] = set()
    for batch in chunked(rows, 5_000):
        new = {sid for sid, _ in batch} - seen
        conn.executemany(
            "INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", [(s,) for s in new]
        )
        seen |= new
        conn.executemany(
            "INSERT INTO agent_messages (session_id, message_data) VALUES (?, ?)", batch
        )
        n += len(batch)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return n


def plain_db(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    for ddl in SDK_DDL:
        conn.execute(ddl)
    return conn


def cipher_key() -> str:
    return os.urandom(32).hex()


def cipher_db(path: Path, key_hex: str) -> Any:
    """A SQLCipher file with a raw 256-bit key (no passphrase KDF, like the vault's key)."""
    assert sqlcipher3 is not None
    conn = sqlcipher3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA key = \"x'{key_hex}'\"")
    conn.execute("PRAGMA journal_mode = WAL")
    for ddl in SDK_DDL:
        conn.execute(ddl)
    return conn


class CipherSession:
    """What SQLiteSession does, over a SQLCipher connection: the same SQL, the same JSON."""

    def __init__(self, conn: Any, session_id: str) -> None:
        self.conn = conn
        self.session_id = session_id

    def _get(self, limit: int | None) -> list[Any]:
        if limit is None:
            rows = self.conn.execute(
                "SELECT message_data FROM agent_messages WHERE session_id = ? ORDER BY id ASC",
                (self.session_id,),
            ).fetchall()
        else:
            rows = self.conn.execute(
                "SELECT message_data FROM agent_messages WHERE session_id = ? "
                "ORDER BY id DESC LIMIT ?",
                (self.session_id, limit),
            ).fetchall()[::-1]
        return [json.loads(r[0]) for r in rows]

    async def get_items(self, limit: int | None = None) -> list[Any]:
        return await asyncio.to_thread(self._get, limit)

    def _add(self, items: list[Any]) -> None:
        c = self.conn
        c.execute("BEGIN")
        c.execute(
            "INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", (self.session_id,)
        )
        c.executemany(
            "INSERT INTO agent_messages (session_id, message_data) VALUES (?, ?)",
            [(self.session_id, json.dumps(i)) for i in items],
        )
        c.execute(
            "UPDATE agent_sessions SET updated_at = CURRENT_TIMESTAMP WHERE session_id = ?",
            (self.session_id,),
        )
        c.execute("COMMIT")

    async def add_items(self, items: list[Any]) -> None:
        await asyncio.to_thread(self._add, items)


def unavailable_note() -> str:
    return "SQLCipher unavailable (pip install sqlcipher3-binary)"


# --------------------------------------------------------------------------
# 1-3. Reads and writes through the sessions
# --------------------------------------------------------------------------
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
        fill(conn, sealed)
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
        return vault.open_session(sid, main)

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


# --------------------------------------------------------------------------
# 4. The command line and open_session
# --------------------------------------------------------------------------
def memvault_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "memvault"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "vault"]


def runner(cmd: list[str], env: dict[str, str]) -> Callable[[], object]:
    def go() -> None:
        proc = subprocess.run(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")

    return go


def bench_cli(cfg: Config, ws: Workspace) -> None:
    print("command line ...", flush=True)
    sessions = 10
    # The figure is judged on a vault of cli_items; a vault ten times smaller shows how
    # much of it is fixed start-up cost and how much the per-item authentication.
    small_items = cfg.cli_items // 10
    vaults: dict[int, Vault] = {}
    for n in (cfg.cli_items, small_items):
        vaults[n] = ws.new_vault(f"cli-{n}")
        sealer = vaults[n].sealer()
        rows = (
            (f"chat-{i % sessions}", sealer.seal(f"chat-{i % sessions}", it))
            for i, it in enumerate(make_items(n, seed=11))
        )
        with contextlib.closing(sqlite3.connect(vaults[n].path, isolation_level=None)) as conn:
            fill(conn, rows)
    v = vaults[cfg.cli_items]
    mv = memvault_cmd()
    base = "import keyring, cryptography.fernet, click, sqlite3"
    env = ws.child_env()
    cases: dict[str, Callable[[], object]] = {
        "memvault --help": runner([*mv, "--help"], env),
        "python -c import": runner([sys.executable, "-c", base], env),
    }
    for n in (cfg.cli_items, small_items):
        for cmd in ("status", "sessions"):
            cases[f"memvault {cmd} {n}"] = runner([*mv, "--db", str(vaults[n].path), cmd], env)
    samples = side_by_side(cases, cfg.reps_cli, warmup=2)
    names = [("memvault --help", "cli_help", "`memvault --help` wall time")]
    for n in (cfg.cli_items, small_items):
        for cmd in ("status", "sessions"):
            names.append(
                (
                    f"memvault {cmd} {n}",
                    f"cli_{cmd}" + ("" if n == cfg.cli_items else f"_{n}"),
                    f"`memvault {cmd}` wall time ({n:,} items, {sessions} sessions)",
                )
            )
    for name, key, label in names:
        sub = {"memvault": samples[name], "python -c import": samples["python -c import"]}
        limit = 1.5 if key == "cli_help" else 1.3
        from_samples(
            key,
            label,
            sub,
            "python -c import",
            f"≤ {limit}× import",
            limit,
            f'baseline: python -c "{base}"',
        )

    print("open_session ...", flush=True)
    sid = "chat-0"

    def open_close() -> None:
        s = vault.open_session(sid, v.path)
        s.close()

    def open_key() -> None:
        Vault.open(v.path).sealer()

    open_close()  # the first call imports the Agents SDK: measured cold below
    samples = side_by_side(
        {"memvault": open_close, "Vault.open + key lookup": open_key}, cfg.reps_open, warmup=2
    )
    from_samples(
        "open_session_warm",
        "open_session() incl. keyring lookup (SDK already imported)",
        samples,
        None,
        "report ms",
        None,
        "comparison: the part spent in Vault.open() and the Secret Service lookup",
    )
    probe = (
        "import sys, time; t = time.perf_counter(); import vault; "
        "s = vault.open_session(sys.argv[1], sys.argv[2]); "
        "print(time.perf_counter() - t); s.close()"
    )
    cold: list[float] = []
    sdk: list[float] = []
    # A first run (not counted) fills the bytecode cache for the SDK's many modules.
    subprocess.run(
        [sys.executable, "-c", probe, sid, str(v.path)], check=True, env=env, capture_output=True
    )
    for _ in range(cfg.reps_cold_open):
        out = subprocess.run(
            [sys.executable, "-c", probe, sid, str(v.path)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        cold.append(float(out.stdout.strip().splitlines()[-1]))
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import time; t = time.perf_counter(); "
                "import agents.extensions.memory; print(time.perf_counter() - t)",
            ],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        sdk.append(float(out.stdout.strip().splitlines()[-1]))
    record(
        Figure(
            key="open_session_cold",
            label="open_session() first call in a new process (imports the SDK)",
            unit="s",
            memvault=med(cold),
            comparisons={"import agents alone": med(sdk)},
            target="report ms",
            samples={"memvault": cold, "import agents alone": sdk},
        )
    )


# --------------------------------------------------------------------------
# 5. Rotation, its memory, and shred
# --------------------------------------------------------------------------
# A small launcher runs the command and reports the command's own rusage. The child's
# max RSS cannot be taken from this (large) benchmark process directly: Linux carries the
# parent's high-water mark into a forked child's ru_maxrss across exec.
LAUNCHER = """
import json, os, subprocess, sys, time
t0 = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:])
_pid, status, usage = os.wait4(proc.pid, 0)
elapsed = time.perf_counter() - t0
with open(sys.argv[1], "w") as fh:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "seconds": elapsed,
               "maxrss_kib": usage.ru_maxrss}, fh)
"""


# An agent in another process, writing one item every 20 ms through vault.open_session:
# how long each add_items() took, and which were refused, while a rotation runs.
WRITER = """
import asyncio, json, sys, time
from pathlib import Path
import vault
db, ready, stop, out = sys.argv[1:5]
session = vault.open_session("writer", db)
waits, errors = [], []
async def main():
    await session.add_items([{"role": "user", "content": "warm-up"}])
    Path(ready).touch()
    i = 0
    while not Path(stop).exists():
        t = time.perf_counter()
        try:
            await session.add_items([{"role": "user", "content": f"turn {i}"}])
            waits.append(time.perf_counter() - t)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        i += 1
        await asyncio.sleep(0.02)
asyncio.run(main())
session.close()
Path(out).write_text(json.dumps({"waits": waits, "errors": errors}))
"""


def writer_during(db: str, env: dict[str, str], cmd: list[str]) -> tuple[float, dict[str, Any]]:
    """Run `cmd` (a rotation) while a writer process appends items to `db`: the command's
    wall seconds and the writer's {"waits": [seconds per add_items], "errors": [...]}."""
    with tempfile.TemporaryDirectory() as tmp:
        ready, stop, out = (Path(tmp) / name for name in ("ready", "stop", "out.json"))
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, db, str(ready), str(stop), str(out)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            while not ready.exists():  # the SDK's import takes seconds
                if proc.poll() is not None:
                    _o, err = proc.communicate()
                    raise RuntimeError(f"the writer failed: {err}")
                time.sleep(0.05)
            time.sleep(0.5)  # some writes before the rotation, for the median
            secs, _peak, _out = timed_child(cmd, env)
            time.sleep(0.5)
        except BaseException:
            # The stop file goes with the temporary folder: the writer would never see it.
            proc.kill()
            proc.communicate()
            raise
        stop.touch()
        _o, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the writer failed ({proc.returncode}): {err}")
        return secs, json.loads(out.read_text())


def timed_child(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of one command, measured by a launcher."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rusage.json"
        proc = subprocess.run(
            [sys.executable, "-c", LAUNCHER, str(report), *cmd],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr}")
        r = json.loads(report.read_text())
    if r["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r['rc']}): {proc.stderr}")
    return float(r["seconds"]), int(r["maxrss_kib"]) * 1024, proc.stdout


EXPIRED_EVERY = 10  # big vaults: every 10th item is past the TTL (purge's work)
EXPIRED_AGE = 40 * 86400  # older than the default TTL of 30 days
CHUNK = 10_000
_SEALER: Any = None


def _seal_init(master: str) -> None:
    global _SEALER
    _SEALER = crypto.Sealer(master)


def session_of(i: int, sessions: int) -> str:
    return "big" if sessions == 1 else f"chat-{i % sessions:03d}"


def _seal_chunk(job: tuple[int, int, int, int, int]) -> list[tuple[str, str]]:
    """Rows start..start+count of a big vault: items generated and sealed in a worker."""
    start, count, sessions, seed, now = job
    out = []
    for k, it in enumerate(make_items(count, seed=seed * 1_000_003 + start)):
        i = start + k
        sid = session_of(i, sessions)
        at = now - EXPIRED_AGE if i % EXPIRED_EVERY == 0 else now
        out.append((sid, _SEALER.seal(sid, it, at)))
    return out


def build_big(v: Vault, n: int, sessions: int, seed: int, unique: int | None = None) -> None:
    """A big vault built fast: envelopes sealed by two worker processes and written
    directly in one transaction (the guard triggers accept them: they are sealed
    under the vault's key). Every EXPIRED_EVERY-th item is stamped past the TTL.

    With `unique`, only that many rows are sealed and the sequence is written
    n / unique times over (one session: the copies stay valid tokens of it). Every
    row is still a row of its own that rotate, purge and shred process one by one.
    """
    now = int(time.time())
    m = n if unique is None else unique
    assert n % m == 0 and m % EXPIRED_EVERY == 0 and (unique is None or sessions == 1)
    jobs = [(s, min(CHUNK, m - s), sessions, seed, now) for s in range(0, m, CHUNK)]
    ctx = multiprocessing.get_context("fork")
    with (
        ctx.Pool(2, _seal_init, (v.sealer().master_key,)) as pool,
        contextlib.closing(sqlite3.connect(v.path, isolation_level=None)) as conn,
    ):
        if unique is None:
            fill(conn, (row for chunk in pool.imap(_seal_chunk, jobs) for row in chunk))
        else:
            sealed = [row for chunk in pool.imap(_seal_chunk, jobs) for row in chunk]
            fill(conn, (row for _ in range(n // m) for row in sealed))


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
    rss: list[float] = []
    inproc: list[float] = []
    wall: list[float] = []  # the command alone, without the launcher's own start-up

    def mv_rotate() -> None:
        secs, peak, out = timed_child(cmd, env)
        report = json.loads(out)
        assert report["items"] == n and report["scrubbed"], report
        rss.append(peak / 1e6)
        inproc.append(float(report["seconds"]))
        wall.append(secs)

    def rekey() -> None:
        assert cipher_conn is not None
        cipher_conn.execute(f"PRAGMA rekey = \"x'{cipher_key()}'\"")
        cipher_conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    cases: dict[str, Callable[[], object]] = {
        "memvault": mv_rotate,
        "bare MultiFernet loop": bare_loop,
    }
    if cipher_conn is not None:
        cases["SQLCipher rekey"] = rekey
    print(f"rotating {n:,} items ...", flush=True)
    samples = side_by_side(cases, cfg.reps_rotate, warmup=0)
    samples["memvault"] = wall
    note = "" if cipher_conn is not None else unavailable_note() + "; "
    from_samples(
        f"rotate_{n}",
        f"`memvault rotate` of {n:,} items, scrub included (wall, new process)",
        samples,
        "bare MultiFernet loop",
        "≤ 1.6× bare loop",
        1.6,
        note + f"in-process Vault.rotate(): {statistics.median(inproc):.2f} s",
        () if cipher_conn is not None else ("SQLCipher rekey",),
    )
    tokens.clear()
    REFERENCE["rotate_wall"] = statistics.median(wall)
    idle_rss = timed_child([*memvault_cmd(), "--db", str(v.path), "--json", "status"], env)[1]
    REFERENCE["status_rss"] = idle_rss / 1e6
    record(
        Figure(
            key=f"rotate_{n}_peak_rss",
            label=f"peak RSS of `memvault rotate`, {n:,} items",
            unit="MB",
            memvault=max(rss),
            comparisons={"`memvault status` on the same vault": idle_rss / 1e6},
            target="≤ 100 MB",
            limit=100.0,
            note="max over repetitions; os.wait4() rusage of the rotating process",
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
    waits = writes["waits"]
    record(
        Figure(
            key=f"writer_wait_rotate_{n}",
            label=f"longest `add_items` of a writer in another process while {n:,} items rotate",
            unit="s",
            memvault=max(waits) if waits else None,
            comparisons={
                "the rotation's wall time": secs,
                "median add_items": statistics.median(waits) if waits else None,
            },
            note=(
                f"{len(waits)} writes, {len(writes['errors'])} refused"
                + (f" ({writes['errors'][0]})" if writes["errors"] else "")
                + "; the rotation holds the write lock for its whole transaction"
            ),
        )
    )


# --------------------------------------------------------------------------
# 6. At scale (--scale): a million items
# --------------------------------------------------------------------------
def bench_scale(cfg: Config, ws: Workspace) -> None:
    """The million-item figures: status and sessions, limited reads, rotate, purge, shred.

    One session holds every item (the worst case for a limited read and for the
    per-session counts). The big operations run once each (minutes at this size):
    they are compared with the medians of the 100,000-item phase of the same run.
    """
    n = cfg.scale_items
    small = cfg.sizes[0]
    print(f"building a {n:,}-item vault (one session) ...", flush=True)
    t0 = time.perf_counter()
    big = ws.new_vault("scale")
    # 100,000 sealed items written ten times over (see build_big): minutes saved.
    build_big(big, n, 1, seed=7, unique=min(n, 100_000))
    built = time.perf_counter() - t0
    little = ws.new_vault("scale-small")
    build_big(little, small, 1, seed=7)
    size = sum(p.stat().st_size for p in paths.sidecars(big.path) if p.exists())
    print(f"  built in {built:.0f} s ({size / 1e6:.0f} MB)", flush=True)
    env = ws.child_env()
    mv = memvault_cmd()

    # status and sessions: wall time of a new process, against an absolute target.
    base = "import keyring, cryptography.fernet, click, sqlite3"
    cases: dict[str, Callable[[], object]] = {
        "status": runner([*mv, "--db", str(big.path), "status"], env),
        "sessions": runner([*mv, "--db", str(big.path), "sessions"], env),
        "python -c import": runner([sys.executable, "-c", base], env),
    }
    samples = side_by_side(cases, 5, warmup=1)
    for cmd in ("status", "sessions"):
        record(
            Figure(
                key=f"cli_{cmd}_{n}",
                label=f"`memvault {cmd}` wall time ({n:,} items)",
                unit="s",
                memvault=med(samples[cmd]),
                comparisons={"python -c import": med(samples["python -c import"])},
                target="≤ 1.0 s wall",
                limit=1.0,
                note=f"median of 5 new processes; file {size / 1e6:.0f} MB",
                samples={"memvault": samples[cmd]},
            )
        )

    # get_items(limit=20) on the million-item session against a 1,000-item session.
    big_s = vault.open_session("big", big.path)
    little_s = vault.open_session("big", little.path)
    assert len(run(big_s.get_items(LIMIT))) == len(run(little_s.get_items(LIMIT)))
    samples = side_by_side(
        {
            "memvault": lambda: run(big_s.get_items(LIMIT)),
            f"{small:,}-item session": lambda: run(little_s.get_items(LIMIT)),
        },
        cfg.reps_limit,
        inner=cfg.inner_limit,
        warmup=3,
    )
    big_s.close()
    little_s.close()
    from_samples(
        f"read_limit_{n}",
        f"get_items(limit={LIMIT}) on a session of {n:,} items",
        samples,
        f"{small:,}-item session",
        "≤ 1.25× at 1,000",
        1.25,
        "the same call on a session of 1,000 items of the same shape, side by side",
    )

    # rotate, purge, shred: one run each, peak RSS of the command's own process.
    def once(args: list[str]) -> tuple[float, float, dict[str, Any]]:
        secs, peak, out = timed_child([*mv, "--db", str(big.path), "--json", *args], env)
        return secs, peak / 1e6, json.loads(out)

    ref_n = cfg.rot_items
    print(f"rotating {n:,} items ...", flush=True)
    secs, peak, report = once(["rotate"])
    assert report["items"] == n and report["scrubbed"], report
    rot_ref = REFERENCE.get("rotate_wall")
    record(
        Figure(
            key=f"rotate_{n}",
            label=f"`memvault rotate` of {n:,} items, scrub included (wall, new process)",
            unit="s",
            memvault=secs,
            comparisons={f"rotate of {ref_n:,} items (median, this run)": rot_ref},
            baseline=f"rotate of {ref_n:,} items (median, this run)" if rot_ref else None,
            target="≤ 11× (linear)",
            limit=11.0 if rot_ref else None,
            note=f"one run; in-process {report['seconds']:.1f} s",
        )
    )
    record(
        Figure(
            key=f"rotate_{n}_peak_rss",
            label=f"peak RSS of `memvault rotate`, {n:,} items",
            unit="MB",
            memvault=peak,
            comparisons={"`memvault status`": REFERENCE.get("status_rss")},
            target="≤ 100 MB",
            limit=100.0,
            note="os.wait4() rusage of the rotating process",
        )
    )
    print(f"purging {n // EXPIRED_EVERY:,} expired of {n:,} items ...", flush=True)
    secs, peak, report = once(["purge", "--yes"])
    assert report["deleted"] == len(range(0, n, EXPIRED_EVERY)) and report["scrubbed"], report
    purge_ref = REFERENCE.get("purge_wall")
    ref_label = f"purge of {ref_n // EXPIRED_EVERY:,} of {ref_n:,} (this run)"
    record(
        Figure(
            key=f"purge_{n}",
            label=f"`memvault purge` of {n // EXPIRED_EVERY:,} expired of {n:,} items (wall)",
            unit="s",
            memvault=secs,
            comparisons={ref_label: purge_ref},
            baseline=ref_label if purge_ref else None,
            target="≤ 11× (linear)",
            limit=11.0 if purge_ref else None,
            note="one run each",
        )
    )
    record(
        Figure(
            key=f"purge_{n}_peak_rss",
            label=f"peak RSS of `memvault purge`, {n:,} items",
            unit="MB",
            memvault=peak,
            comparisons={"`memvault status`": REFERENCE.get("status_rss")},
            target="≤ 100 MB",
            limit=100.0,
            note="os.wait4() rusage of the purging process",
        )
    )
    print(f"shredding the {n:,}-item vault ...", flush=True)
    size = sum(p.stat().st_size for p in paths.sidecars(big.path) if p.exists())
    dd_target = ws.dir / "dd-scale.bin"
    shutil.copyfile(big.path, dd_target)
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
    dd_secs = time.perf_counter() - t0
    dd_target.unlink()
    secs, peak, report = once(["shred", "--yes"])
    assert report["items"] == n - len(range(0, n, EXPIRED_EVERY)), report
    record(
        Figure(
            key=f"shred_{n}",
            label=f"`memvault shred` of a {n:,}-item vault ({size / 1e6:.0f} MB, after purge)",
            unit="s",
            memvault=secs,
            comparisons={"dd same bytes, fsync": dd_secs},
            baseline="dd same bytes, fsync",
            target="report ratio",
            note="one run each; wall of a new process",
        )
    )
    record(
        Figure(
            key=f"shred_{n}_peak_rss",
            label=f"peak RSS of `memvault shred`, {n:,}-item vault",
            unit="MB",
            memvault=peak,
            target="report",
            note="os.wait4() rusage of the shredding process",
        )
    )


# --------------------------------------------------------------------------
# 7. PostgreSQL (--only postgres): the vault over SQLAlchemySession
# --------------------------------------------------------------------------
PG_URL_VARS = ("MEMVAULT_BENCH_POSTGRES_URL", "MEMVAULT_TEST_POSTGRES_URL")
PG_WRITERS = (1, 2, 4, 8)

# A writer process for the throughput figure: one session of its own, one turn per
# add_items, as many as it can acknowledge between the "go" file and the deadline.
PG_WRITER = """
import asyncio, json, sys, time
from pathlib import Path
import vault
url, sid, ready, go, seconds, out, turn = sys.argv[1:8]
session = vault.open_session(sid, url)
turn = json.loads(turn)
async def main():
    await session.add_items(turn)  # warm-up: imports, key, first connection
    Path(ready).touch()
    while not Path(go).exists():
        await asyncio.sleep(0.002)
    done, waits = 0, []
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        t = time.monotonic()
        await session.add_items(turn)
        waits.append(time.monotonic() - t)
        done += len(turn)
    Path(out).write_text(json.dumps({"items": done, "waits": waits}))
asyncio.run(main())
"""


def pg_url_from_env() -> str | None:
    for var in PG_URL_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


class PgSchemas:
    """Schemas of the benchmark's PostgreSQL server; each dropped (and its vault's keyring
    entries deleted) at the end."""

    def __init__(self, server: str) -> None:
        self.server = server.split("?", 1)[0]
        self.made: list[str] = []

    def url(self, name: str) -> str:
        schema = f"bench_{name}_{os.urandom(4).hex()}"
        self.made.append(schema)
        return f"{self.server}?schema={schema}"

    def sql(self, url: str, statement: str, *args: Any) -> list[Any]:
        import asyncpg

        from vault.pgurl import parse

        loc = parse(url)

        async def go() -> list[Any]:
            conn = await asyncpg.connect(loc.dsn, server_settings=loc.server_settings())
            try:
                return list(await conn.fetch(statement, *args))
            finally:
                await conn.close()

        return asyncio.run(go())

    def copy_rows(self, url: str, rows: Iterable[tuple[str, str]]) -> int:
        """(session_id, message_data) rows into the schema's SDK tables, with COPY (the
        vault's guard checks each row as it goes in)."""
        import asyncpg

        from vault.pgurl import parse

        loc = parse(url)

        async def go() -> int:
            conn = await asyncpg.connect(loc.dsn, server_settings=loc.server_settings())
            n = 0
            seen: set[str] = set()
            try:
                async with conn.transaction():
                    for batch in chunked(rows, 10_000):
                        new = {sid for sid, _ in batch} - seen
                        await conn.executemany(
                            "INSERT INTO agent_sessions (session_id) VALUES ($1) "
                            "ON CONFLICT DO NOTHING",
                            [(s,) for s in new],
                        )
                        seen |= new
                        await conn.copy_records_to_table(
                            "agent_messages", records=batch, columns=["session_id", "message_data"]
                        )
                        n += len(batch)
                await conn.execute("ANALYZE agent_messages")
            finally:
                await conn.close()
            return n

        return asyncio.run(go())

    def cleanup(self) -> None:
        ks = KeyStore()
        for schema in self.made:
            url = f"{self.server}?schema={schema}"
            with contextlib.suppress(Exception):
                if self.sql(url, "SELECT to_regclass('memvault_keys') IS NOT NULL")[0][0]:
                    vid = self.sql(url, "SELECT value FROM memvault_meta WHERE key = 'vault_id'")
                    for (kid,) in self.sql(url, "SELECT kid FROM memvault_keys"):
                        ks.delete(entry_name(vid[0][0], kid))
            with contextlib.suppress(Exception):
                self.sql(self.server, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def pg_seal_rows(master: str, n: int, sessions: int, seed: int) -> list[tuple[str, str]]:
    """The rows build_big writes into a file, sealed under a PostgreSQL vault's key."""
    now = int(time.time())
    jobs = [(s, min(CHUNK, n - s), sessions, seed, now) for s in range(0, n, CHUNK)]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2, _seal_init, (master,)) as pool:
        return [row for chunk in pool.imap(_seal_chunk, jobs) for row in chunk]


def bench_postgres(cfg: Config, ws: Workspace) -> None:
    server = pg_url_from_env()
    if not server:
        print(
            "postgres: skipped: no server; set MEMVAULT_BENCH_POSTGRES_URL to a "
            "postgresql+asyncpg:// URL (a schema of its own is created and dropped per "
            "figure), or run under scripts/with-postgres",
            flush=True,
        )
        return
    try:
        import asyncpg  # noqa: F401
        import sqlalchemy  # noqa: F401
    except ImportError:
        print("postgres: skipped: pip install 'memvault[postgres]'", flush=True)
        return
    schemas = PgSchemas(server)
    try:
        _pg_sessions(cfg, schemas)
        _pg_writers(cfg, schemas, ws)
        _pg_rotation(cfg, schemas, ws)
    finally:
        schemas.cleanup()


def _pg_sessions(cfg: Config, schemas: PgSchemas) -> None:
    from agents.extensions.memory import EncryptedSession
    from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.pool import NullPool

    from vault.pg import PgVault
    from vault.pgurl import parse

    print("postgres: building the read/write schemas ...", flush=True)
    url = schemas.url("main")
    v = PgVault.init(url, ttl=DEFAULT_TTL)
    sealer = v.sealer()
    ttl = v.ttl
    sids = {n: f"s{n}" for n in cfg.sizes}
    items = {n: list(make_items(n, seed=n)) for n in cfg.sizes}
    sealed = ((sids[n], sealer.seal(sids[n], it)) for n in cfg.sizes for it in items[n])
    schemas.copy_rows(url, sealed)
    # The bare EncryptedSession writes into a schema of its own, without the vault's guard.
    bare_url = schemas.url("bare")
    schemas.sql(server_only(bare_url), f'CREATE SCHEMA "{parse(bare_url).schema}"')
    engines: list[Any] = []

    def engine(where: str, pooled: bool = True) -> Any:
        loc = parse(where)
        extra: dict[str, Any] = {} if pooled else {"poolclass": NullPool}
        e = create_async_engine(
            loc.sqlalchemy_url, connect_args={"server_settings": loc.server_settings()}, **extra
        )
        engines.append(e)
        return e

    def bare(sid: str, where: str, pooled: bool = True, create: bool = False) -> Any:
        return EncryptedSession(
            session_id=sid,
            underlying_session=SQLAlchemySession(
                sid, engine=engine(where, pooled), create_tables=create
            ),
            encryption_key=sealer.master_key,
            ttl=ttl,  # type: ignore[arg-type]
        )

    run(bare("x", bare_url, create=True).get_items())  # the SDK creates its tables
    base = "bare EncryptedSession"
    nopool = "bare EncryptedSession, NullPool"

    def cases(n: int, where: str) -> dict[str, Any]:
        sid = sids[n]
        return {
            "memvault": vault.open_session(sid, url),
            base: bare(sid, where),
            nopool: bare(sid, where, pooled=False),
        }

    note = (
        "the vault's session opens a connection per operation (NullPool); "
        f"'{base}' uses SQLAlchemy's default pool"
    )
    try:
        sess = {n: cases(n, url) for n in cfg.sizes}
        for n in cfg.sizes:  # correctness first: every reader returns the same history
            for name, s in sess[n].items():
                assert run(s.get_items()) == items[n], f"{name} did not return the {n} items"
        print("postgres: reads ...", flush=True)
        for n in cfg.sizes:
            samples = side_by_side(
                {k: (lambda s=s: run(s.get_items())) for k, s in sess[n].items()},
                min(cfg.reps_read, 5),
                inner=1,
                warmup=1,
            )
            from_samples(
                f"pg_read_all_{n}",
                f"PostgreSQL: get_items() full history, {n:,} items",
                samples,
                base,
                "report",
                None,
                note,
            )
            samples = side_by_side(
                {k: (lambda s=s: run(s.get_items(LIMIT))) for k, s in sess[n].items()},
                min(cfg.reps_limit, 5),
                inner=max(1, min(cfg.inner_limit // 4, 5)),
                warmup=2,
            )
            from_samples(
                f"pg_read_limit_{n}",
                f"PostgreSQL: get_items(limit={LIMIT}), {n:,} items",
                samples,
                base,
                "report",
                None,
                note,
            )
        print("postgres: writes ...", flush=True)
        turn = list(make_items(TURN, seed=7))
        n = cfg.sizes[-1]
        writers = cases(n, bare_url)
        writers["memvault"] = vault.open_session(sids[n], url)
        samples = side_by_side(
            {k: (lambda s=s: run(s.add_items(turn))) for k, s in writers.items()},
            min(cfg.reps_write, 9),
            inner=max(1, min(cfg.inner_write // 2, 5)),
            warmup=2,
        )
        from_samples(
            f"pg_add_turn_{n}",
            f"PostgreSQL: add_items({TURN} items) into {n:,} items, guard on",
            samples,
            base,
            "report",
            None,
            note + "; each call commits; the bare sessions write a schema without the guard",
        )
    finally:
        for e in engines:
            with contextlib.suppress(Exception):
                run(e.dispose())


def server_only(url: str) -> str:
    return url.split("?", 1)[0]


def _pg_writers(cfg: Config, schemas: PgSchemas, ws: Workspace) -> None:
    from vault.pg import PgVault

    url = schemas.url("writers")
    PgVault.init(url, ttl=DEFAULT_TTL)
    seconds = 1.0 if cfg.quick else 5.0
    turn = json.dumps(list(make_items(TURN, seed=7)))
    env = ws.child_env()
    print(f"postgres: writers' throughput ({seconds:g} s per count) ...", flush=True)
    for k in (1, 2) if cfg.quick else PG_WRITERS:
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            procs = []
            try:
                for j in range(k):
                    args = [url, f"w{k}-{j}", str(t / f"ready{j}"), str(t / "go"), str(seconds)]
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-c", PG_WRITER, *args, str(t / f"out{j}.json"), turn],
                            stderr=subprocess.PIPE,
                            text=True,
                            env=env,
                        )
                    )
                while not all((t / f"ready{j}").exists() for j in range(k)):
                    for p in procs:
                        if p.poll() not in (None, 0):
                            _o, err = p.communicate()
                            raise RuntimeError(f"a writer failed: {err}")
                    time.sleep(0.05)
                (t / "go").touch()
                for p in procs:
                    _o, err = p.communicate(timeout=600)
                    if p.returncode != 0:
                        raise RuntimeError(f"a writer failed ({p.returncode}): {err}")
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            outs = [json.loads((t / f"out{j}.json").read_text()) for j in range(k)]
        total = sum(o["items"] for o in outs) / seconds
        waits = [w for o in outs for w in o["waits"]]
        record(
            Figure(
                key=f"pg_writers_{k}",
                label=f"PostgreSQL: writers' throughput, {k} process{'es' if k > 1 else ''}",
                unit="items/s",
                memvault=total,
                target="report",
                note=(
                    f"items acknowledged per second, all writers together (one turn of {TURN} "
                    f"items per add_items, a session each); median add_items "
                    f"{fmt_value(statistics.median(waits), 's')}, longest "
                    f"{fmt_value(max(waits), 's')}"
                ),
            )
        )


def _pg_rotation(cfg: Config, schemas: PgSchemas, ws: Workspace) -> None:
    from vault.pg import PgVault

    n = cfg.rot_items // 5 if cfg.quick else cfg.rot_items  # quick: CI only checks it runs
    print(f"postgres: building {n:,}-item vaults (PostgreSQL and SQLite) ...", flush=True)
    url = schemas.url("rotate")
    pv = PgVault.init(url, ttl=DEFAULT_TTL)
    schemas.copy_rows(url, pg_seal_rows(pv.sealer().master_key, n, cfg.rot_sessions, 99))
    fv = ws.new_vault("pg-compare")
    build_big(fv, n, cfg.rot_sessions, seed=99)
    env = ws.child_env()
    mv = memvault_cmd()
    walls: dict[str, list[float]] = {"memvault": [], "SQLite file": []}
    inproc: list[float] = []

    def rotate(where: str, name: str) -> Callable[[], object]:
        def go() -> None:
            secs, _peak, out = timed_child([*mv, "--db", where, "--json", "rotate"], env)
            report = json.loads(out)
            assert report["items"] == n, report
            walls[name].append(secs)
            if name == "memvault":
                inproc.append(float(report["seconds"]))

        return go

    print(f"postgres: rotating {n:,} items, PostgreSQL and SQLite side by side ...", flush=True)
    side_by_side(
        {"memvault": rotate(url, "memvault"), "SQLite file": rotate(str(fv.path), "SQLite file")},
        2,
        warmup=0,
    )
    from_samples(
        f"pg_rotate_{n}",
        f"PostgreSQL: `memvault rotate` of {n:,} items (wall, new process)",
        walls,
        "SQLite file",
        "report",
        None,
        f"online, batches of 500; in-process PgVault.rotate(): {statistics.median(inproc):.2f} s; "
        "the SQLite file's rotation includes its scrub",
    )
    print(f"postgres: rotating {n:,} items with a writer in another process ...", flush=True)
    secs, writes = writer_during(url, env, [*mv, "--db", url, "--json", "rotate"])
    failed = ""
    try:
        fsecs, fwrites = writer_during(
            str(fv.path), env, [*mv, "--db", str(fv.path), "--json", "rotate"]
        )
    except RuntimeError as exc:  # reported as such, never estimated
        fsecs, fwrites = None, {"waits": [], "errors": []}
        failed = "; the SQLite rotation failed: " + " ".join(str(exc).split())[-160:]
    waits, fwaits = writes["waits"], fwrites["waits"]
    record(
        Figure(
            key=f"pg_writer_wait_rotate_{n}",
            label=(
                "PostgreSQL: longest `add_items` of a writer in another process while "
                f"{n:,} items rotate"
            ),
            unit="s",
            memvault=max(waits) if waits else None,
            comparisons={
                "SQLite, same items": max(fwaits) if fwaits else None,
                "PostgreSQL rotation wall": secs,
                "SQLite rotation wall": fsecs,
                "PostgreSQL median add_items": statistics.median(waits) if waits else None,
            },
            note=(
                f"PostgreSQL {len(waits)} writes, {len(writes['errors'])} refused; SQLite "
                f"{len(fwaits)} writes, {len(fwrites['errors'])} refused"
                + (f" ({writes['errors'][0]})" if writes["errors"] else "")
                + failed
            ),
        )
    )


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------
def fmt_value(x: float | None, unit: str) -> str:
    if x is None:
        return "unavailable"
    if unit == "MB":
        return f"{x:.0f} MB"
    if unit == "x":
        return f"{x:.2f}×"
    if unit == "items/s":
        return f"{x:,.0f} items/s"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.1f} ms" if x < 0.1 else f"{x * 1e3:.0f} ms"
    return f"{x:.2f} s"


def table(figs: list[Figure]) -> str:
    head = ["figure", "memvault", "compared with", "ratio", "target", "result"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in figs:
        comps = []
        for name, val in f.comparisons.items():
            text = f"{name} {fmt_value(val, f.unit)}"
            if (
                f.unit == "s"
                and val
                and f.memvault is not None
                and name != f.baseline
                and f.baseline is not None
            ):
                text += f" ({f.memvault / val:.2f}×)"
            comps.append(text)
        ratio = f"{f.ratio:.2f}×" if f.ratio is not None else "—"
        result = "report" if f.met is None else ("met" if f.met else "**missed**")
        if f.met is None and f.limit is not None:
            result = "unavailable"
        lines.append(
            "| "
            + " | ".join(
                [
                    f.label,
                    fmt_value(f.memvault, f.unit),
                    "; ".join(comps) or "—",
                    ratio,
                    f.target,
                    result,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    def version(dist: str) -> str | None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as v

        try:
            return v(dist)
        except PackageNotFoundError:
            return None

    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "sqlite": sqlite3.sqlite_version,
        "keyring_backend": KeyStore().name,
        "packages": {
            d: version(d)
            for d in ("memvault", "openai-agents", "cryptography", "keyring", "sqlcipher3-binary")
        },
    }
    if sqlcipher3 is not None:
        with contextlib.closing(sqlcipher3.connect(":memory:")) as c:
            info["sqlcipher"] = c.execute("PRAGMA cipher_version").fetchone()[0]
    return info


PHASES: dict[str, Callable[[Config, Workspace], None]] = {
    "sessions": bench_sessions,
    "cli": bench_cli,
    "rotation": bench_rotation,
    "scale": bench_scale,
    "postgres": bench_postgres,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10x smaller everywhere (CI)")
    ap.add_argument(
        "--scale",
        action="store_true",
        help="also the million-item figures (a 1.4 GB vault; with --quick, 100,000 items)",
    )
    ap.add_argument(
        "--json-out",
        type=Path,
        default=DEFAULT_JSON,
        metavar="PATH",
        help=f"where to write the figures as JSON (default {DEFAULT_JSON.relative_to(ROOT)})",
    )
    ap.add_argument(
        "--only",
        choices=PHASES,
        action="append",
        help="run only this group of figures (repeatable; default: all)",
    )
    args = ap.parse_args(argv)
    if os.environ.get("MEMVAULT_IN_PRIVATE_KEYRING") != "1":
        print(
            "bench: refusing to run outside a private keyring (it would create and destroy "
            "keys in yours); run: scripts/with-keyring .venv/bin/python bench/run.py",
            file=sys.stderr,
        )
        return 3
    cfg = Config.make(args.quick, args.scale)
    os.environ.pop("MEMVAULT_DB", None)
    started = time.perf_counter()
    info = machine()
    print(
        f"memvault benchmark ({'quick' if cfg.quick else 'full'}) on {info['nproc']} x "
        f"{info['cpu']}, Python {info['python']}",
        flush=True,
    )
    ws = Workspace()
    try:
        for name, phase in PHASES.items():
            if name == "scale" and not cfg.scale:
                continue
            if not args.only or name in args.only:
                phase(cfg, ws)
    finally:
        ws.cleanup()
        LOOP.close()
    info["seconds"] = round(time.perf_counter() - started, 1)
    info["quick"] = cfg.quick
    info["config"] = asdict(cfg)
    md = table(FIGURES)
    print()
    print(md)
    missed = [f.key for f in FIGURES if f.met is False]
    print(f"\n{len(missed)} target(s) missed" + (f": {', '.join(missed)}" if missed else ""))
    doc = {"machine": info, "figures": [asdict(f) for f in FIGURES], "missed": missed}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {args.json_out} ({info['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
