"""The vaults and the alternatives' files, built fast (envelopes written directly)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.common import sqlcipher3
from bench.data import chunked, make_items
from vault import crypto
from vault.engines.sqlite.shred import shred
from vault.engines.sqlite.vault import DEFAULT_TTL, Vault
from vault.keyjournal import entry_name
from vault.keys import KeyStore


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


def fill(conn: Any, rows: Iterable[tuple[str, str]], sealer: Any = None) -> int:
    """Insert (session_id, message_data) rows in one transaction; the SDK's own tables.
    Into a vault file, `sealer` (the key the rows are sealed with) links each row to its
    session's history chain, as the vault's guard requires."""
    key = None
    if sealer is not None:
        from vault import chainops

        (vault_id,) = conn.execute(
            "SELECT value FROM memvault_meta WHERE key = 'vault_id'"
        ).fetchone()
        key = chainops.key_of(sealer, vault_id)
    n = 0
    conn.execute("BEGIN")
    seen: set[str] = set()
    for batch in chunked(rows, 5_000):
        new = {sid for sid, _ in batch} - seen
        conn.executemany(
            "INSERT OR IGNORE INTO agent_sessions (session_id) VALUES (?)", [(s,) for s in new]
        )
        seen |= new
        if key is None:
            conn.executemany(
                "INSERT INTO agent_messages (session_id, message_data) VALUES (?, ?)", batch
            )
        else:
            from vault.engines.sqlite import chainrows

            chainrows.insert_rows(conn, key, batch)
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


EXPIRED_EVERY = 10  # big vaults: every 10th item is past the TTL (purge's work)
EXPIRED_AGE = 40 * 86400  # older than the default TTL of 30 days
CHUNK = 10_000
_SEALER: Any = None


def seal_init(master: str) -> None:
    global _SEALER
    _SEALER = crypto.Sealer(master)


def session_of(i: int, sessions: int) -> str:
    return "big" if sessions == 1 else f"chat-{i % sessions:03d}"


def seal_chunk(job: tuple[int, int, int, int, int]) -> list[tuple[str, str]]:
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
    sealer = v.sealer()
    with (
        ctx.Pool(2, seal_init, (v.sealer().master_key,)) as pool,
        contextlib.closing(sqlite3.connect(v.path, isolation_level=None)) as conn,
    ):
        if unique is None:
            fill(conn, (row for chunk in pool.imap(seal_chunk, jobs) for row in chunk), sealer)
        else:
            sealed = [row for chunk in pool.imap(seal_chunk, jobs) for row in chunk]
            fill(conn, (row for _ in range(n // m) for row in sealed), sealer)
