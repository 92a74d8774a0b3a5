"""Helpers for the crash tests: agent writers killed mid-write, and WAL surgery.

A checkpoint copies the WAL's pages into the database in page order, page 1 (with
the new page count) first, extending the file as it goes. `interrupt_checkpoint`
makes that state on purpose: what a process killed half-way through leaves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
WAL_HEADER = 32
FRAME_HEADER = 24

# An agent appending through the public API. It prints "ack N" once add_items has
# returned for item N: from then on the item must survive any crash.
WRITER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    import vault

    async def main() -> None:
        db, sid, start, count, size = sys.argv[1:6]
        every = float(os.environ.get("CRASHKIT_WRITER_EVERY", "0"))  # seconds between items
        session = vault.open_session(sid, db)
        print("ready", flush=True)
        for i in range(int(start), int(start) + int(count)):
            await session.add_items([{"role": "user", "content": item_text(sid, i, int(size))}])
            print("ack", i, flush=True)
            await asyncio.sleep(every)
        if "--die" in sys.argv:  # killed with its frames still in the WAL
            os.kill(os.getpid(), signal.SIGKILL)
        session.close()

    def item_text(sid: str, i: int, size: int) -> str:
        return f"{sid} item {i} " + "".join(chr(97 + (i * 7 + k) % 26) for k in range(size))

    asyncio.run(main())
    """
)


def item_text(sid: str, i: int, size: int) -> str:
    return f"{sid} item {i} " + "".join(chr(97 + (i * 7 + k) % 26) for k in range(size))


def writer_items(sid: str, start: int, count: int, size: int) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": item_text(sid, i, size)} for i in range(start, start + count)
    ]


def start_writer(
    db: Path | str,
    sid: str,
    start: int,
    count: int,
    size: int,
    *extra: str,
    wait: bool = True,
    every: float = 0.0,
) -> subprocess.Popen[str]:
    """Start an agent writer (on a vault file or a PostgreSQL URL), `every` seconds
    between its items; with `wait`, return once it has opened its session."""
    env = {k: v for k, v in os.environ.items() if k not in ("MEMVAULT_FAILPOINT", "MEMVAULT_DB")}
    env["CRASHKIT_WRITER_EVERY"] = str(every)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), sid, str(start), str(count), str(size), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.stdout is not None
    if not wait:
        return proc
    line = first_line(proc.stdout)
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the agent writer did not start: {line!r} {err[-2000:]}")
    return proc


def first_line(stream: IO[str]) -> str:
    """A child's first line, read straight from its pipe a byte at a time. A buffered
    readline would swallow the lines written right after it, and `communicate` (which
    reads the pipe itself) would never see them."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(stream.fileno(), 1)
        if not byte:
            break
        line += byte
    return line.decode()


def killed_cli(*args: str, failpoint: str | None = None, delay: float | None = None) -> int:
    """`memvault ARGS` in a process of its own, stopped at `failpoint` or killed by
    SIGKILL after `delay` seconds; its exit code (-SIGKILL when killed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MEMVAULT_FAILPOINT", "MEMVAULT_DB")}
    if failpoint:
        env["MEMVAULT_FAILPOINT"] = failpoint
    proc = subprocess.Popen(
        [sys.executable, "-m", "vault", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
    if delay is not None:
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=300)


def put_back(db: Path, image: bytes, vault_id: str, kid: str, key: str) -> None:
    """A vault file as it was built: its bytes back (no side files), and only its
    original key's entry in the keyring."""
    from tests.conftest import keyring_entries
    from vault.keyjournal import entry_name
    from vault.keys import KeyStore

    for suffix in ("-wal", "-shm", "-journal"):
        db.with_name(db.name + suffix).unlink(missing_ok=True)
    db.write_bytes(image)
    os.chmod(db, 0o600)
    ks = KeyStore()
    original = entry_name(vault_id, kid)
    for name in keyring_entries(vault_id):
        if name != original:
            ks.delete(name)
    ks.set(original, key)


def run_writer_to_death(db: Path, sid: str, start: int, count: int, size: int) -> int:
    """An agent writes `count` items, then dies by SIGKILL: returns how many were acked."""
    proc = start_writer(db, sid, start, count, size, "--die")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    return sum(1 for line in out.splitlines() if line.startswith("ack "))


def wal_of(db: Path) -> Path:
    return db.with_name(db.name + "-wal")


def committed_wal_pages(db: Path) -> dict[int, bytes]:
    """The newest committed copy of every page in the WAL (frames of its current salt)."""
    data = wal_of(db).read_bytes()
    if len(data) < WAL_HEADER:
        return {}
    page_size = int.from_bytes(data[8:12], "big")
    salts = data[16:24]
    pages: dict[int, bytes] = {}
    pending: dict[int, bytes] = {}
    off = WAL_HEADER
    while off + FRAME_HEADER + page_size <= len(data):
        frame = data[off : off + FRAME_HEADER]
        if frame[8:16] != salts:
            break
        pgno, commit = int.from_bytes(frame[0:4], "big"), int.from_bytes(frame[4:8], "big")
        pending[pgno] = data[off + FRAME_HEADER : off + FRAME_HEADER + page_size]
        if commit:
            pages.update(pending)
            pending.clear()
        off += FRAME_HEADER + page_size
    return pages


def header_pages(db: Path) -> tuple[int, int]:
    """(page size, page count) as the database file's header states them."""
    with open(db, "rb") as fh:
        header = fh.read(100)
    page_size = int.from_bytes(header[16:18], "big")
    return (65536 if page_size == 1 else page_size), int.from_bytes(header[28:32], "big")


def is_mid_checkpoint(db: Path) -> bool:
    """The header promises more pages than the file holds (page 1 written, the rest not)."""
    with contextlib.suppress(OSError):
        page_size, pages = header_pages(db)
        return pages * page_size > db.stat().st_size
    return False


def interrupt_checkpoint(db: Path, fraction: float) -> None:
    """Copy the WAL's pages into the database in page order, as a checkpoint does,
    and stop before the last `1 - fraction` of them: the file stays shorter than
    the page count that page 1 now states. The WAL and its index are left alone."""
    pages = committed_wal_pages(db)
    assert 1 in pages, "the WAL holds no page 1"
    order = sorted(pages)
    done = order[: max(1, int(len(order) * fraction))]
    page_size = len(pages[1])
    with open(db, "r+b") as fh:
        for pgno in done:
            fh.seek((pgno - 1) * page_size)
            fh.write(pages[pgno])


def integrity(db: Path) -> list[Any]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("PRAGMA integrity_check").fetchall()
