"""Worker processes for the rotation's cryptography (vault.rotationworker), one per core.

Processes, not threads: cryptography's Fernet does not release the GIL for tokens of
this size (two threads rotate slower than one; bench/README.md). Each worker is a new
interpreter (`subprocess`, not a fork of this process: it inherits no file descriptor
but its two pipes, no lock held by another thread, and shares no pages that would
make its memory look larger than it is). The keys go to it through its stdin at
start; a parent that dies closes that pipe, and the worker ends (vault.rotationworker).

Each worker has one thread here that sends it a task and reads the answer; the
rotation's own thread only submits batches and collects them, so it reads and writes
the database while the workers encrypt.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import IO

from vault import crypto
from vault.errors import OperationFailed
from vault.rotationworker import read_frame, write_frame

# (session_id, message_data) in; rotationworker.rotate_row's result out.
Task = list[tuple[str, str]]
Result = list[tuple[str, int] | int]

# The worker's start: load vault.crypto without the package's __init__, which would
# import the SQLite engine (vault.rotationworker says why); argv[1] is the package folder.
BOOT = (
    "import sys, types\n"
    "pkg = types.ModuleType('vault'); pkg.__path__ = [sys.argv[1]]\n"
    "sys.modules['vault'] = pkg\n"
    "from vault.rotationworker import main\n"
    "main()\n"
)
PACKAGE = str(Path(__file__).resolve().parent)
# Rows per task at most: a worker's memory holds a task and its answer (about 3 kB a
# row), so smaller tasks keep the workers' memory down, at a round trip each.
CHUNK = 500


AGAIN = "; the rows moved so far are kept: run `memvault rotate` again to finish"


class WorkerFailed(OperationFailed):
    """A worker died or failed; the rows written so far stay, the rotation is resumable."""


class _Worker:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin: IO[bytes] = proc.stdin
        self.stdout: IO[bytes] = proc.stdout
        self.tasks: queue.SimpleQueue[tuple[Task, Future[Result]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="rotation-worker", daemon=True)

    def _run(self) -> None:
        failure: BaseException | None = None
        while (item := self.tasks.get()) is not None:
            task, future = item
            if failure is None:
                try:
                    write_frame(self.stdin, task)
                    reply = read_frame(self.stdout)
                    if isinstance(reply, str):
                        raise WorkerFailed(f"a rotation worker failed ({reply}){AGAIN}")
                    future.set_result(reply)
                    continue
                except WorkerFailed as exc:
                    failure = exc
                except (OSError, EOFError, ValueError):
                    failure = WorkerFailed(
                        "a rotation worker process ended unexpectedly "
                        f"(exit status {self.proc.poll()}){AGAIN}"
                    )
            future.set_exception(failure)


class Pool:
    """`count` worker processes re-encrypting rows from `old` to `new`."""

    def __init__(self, old: crypto.Sealer, new: crypto.Sealer, count: int) -> None:
        self.workers: list[_Worker] = []
        try:
            for _ in range(count):
                self.workers.append(_Worker(_launch()))
            for w in self.workers:
                write_frame(w.stdin, (old.master_key, new.master_key))
                w.thread.start()
        except BaseException:
            self.close()
            raise

    def submit(self, rows: Task) -> list[Future[Result]]:
        """The rows cut into slices, dealt to the workers in turn; their results, in order."""
        step = min(CHUNK, -(-len(rows) // len(self.workers)))
        futures: list[Future[Result]] = []
        for k, i in enumerate(range(0, len(rows), step)):
            future: Future[Result] = Future()
            self.workers[k % len(self.workers)].tasks.put((rows[i : i + step], future))
            futures.append(future)
        return futures

    def close(self) -> None:
        """End the workers: their input closes, they exit; any still running is killed."""
        for w in self.workers:
            if w.thread.is_alive():
                w.tasks.put(None)
            with contextlib.suppress(OSError):
                w.stdin.close()
        for w in self.workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            if w.thread.ident is not None:  # (started)
                w.thread.join(timeout=5)
            with contextlib.suppress(OSError):
                w.stdout.close()
        self.workers = []


# What a worker needs of the environment to start Python: nothing else (not a token,
# not a database URL with its password) reaches a process that holds master keys.
WORKER_ENV = ("PATH", "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "SYSTEMROOT", "TMPDIR")


def _launch() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", BOOT, PACKAGE],
        env={k: v for k, v in os.environ.items() if k in WORKER_ENV},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # it reports failures through its stdout
        close_fds=True,  # only its pipes: the other workers' and the database's stay here
        # Its own session: a terminal's Ctrl-C is the rotation's to handle, not the worker's.
        start_new_session=os.name == "posix",
    )


def cores() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
