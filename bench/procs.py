"""Commands timed as new processes: wall time, peak RSS, and a writer running alongside."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


# A small launcher runs the command and reports the command's own rusage. The child's
# max RSS cannot be taken from this (large) benchmark process directly: Linux carries the
# parent's high-water mark into a forked child's ru_maxrss across exec.
# With "tree" (for a command that starts processes of its own, the rotation's workers)
# it also walks the command's process tree in /proc every 10 ms and keeps each
# process's VmHWM (its own peak RSS; monotonic, so a late reading loses nothing but the
# last 10 ms of a process's life) and the largest sum of VmRSS seen at one instant.
# os.wait4's ru_maxrss would give the largest single process of the tree, not the sum.
LAUNCHER = """
import json, os, subprocess, sys, threading, time
from pathlib import Path

def kids(pid):
    out = []
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(p) for p in f.read_text().split()]
        except OSError:
            pass
    return out

def mem(pid):
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    d = {l.split(":")[0]: l.split()[1] for l in lines if l.startswith(("VmHWM", "VmRSS"))}
    return (int(d["VmHWM"]), int(d["VmRSS"])) if len(d) == 2 else None

report, tree, cmd = sys.argv[1], sys.argv[2] == "tree", sys.argv[3:]
peaks, top = {}, [0]
t0 = time.perf_counter()
proc = subprocess.Popen(cmd)
done = threading.Event()

def watch():
    while not done.is_set():
        todo, now = [proc.pid], 0
        while todo:
            pid = todo.pop()
            m = mem(pid)
            if m:
                peaks[pid] = max(peaks.get(pid, 0), m[0])
                now += m[1]
            todo += kids(pid)
        top[0] = max(top[0], now)
        time.sleep(0.01)

if tree:
    threading.Thread(target=watch, daemon=True).start()
_pid, status, usage = os.wait4(proc.pid, 0)
elapsed = time.perf_counter() - t0
done.set()
with open(report, "w") as fh:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "seconds": elapsed,
               "maxrss_kib": usage.ru_maxrss, "root": proc.pid,
               "peaks_kib": peaks, "top_sum_kib": top[0]}, fh)
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


def _launched(cmd: list[str], env: dict[str, str], mode: str) -> tuple[dict[str, Any], str]:
    """The launcher's report on one run of `cmd` (mode "one" or "tree"), and its stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rusage.json"
        proc = subprocess.run(
            [sys.executable, "-c", LAUNCHER, str(report), mode, *cmd],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr}")
        r: dict[str, Any] = json.loads(report.read_text())
    if r["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r['rc']}): {proc.stderr}")
    return r, proc.stdout


def timed_child(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of one command, measured by a launcher."""
    r, out = _launched(cmd, env, "one")
    return float(r["seconds"]), int(r["maxrss_kib"]) * 1024, out


def timed_tree(cmd: list[str], env: dict[str, str]) -> tuple[float, dict[str, Any], str]:
    """Wall seconds, memory of the command's whole process tree and its stdout.

    The memory: {"sum": the sum of every process's own peak RSS (bytes; an upper bound
    of the tree's peak), "top": the largest sum of RSS seen at one instant, "root": the
    command's own peak, "processes": how many were seen} (Linux: /proc)."""
    r, out = _launched(cmd, env, "tree")
    peaks = {int(pid): kib * 1024 for pid, kib in r["peaks_kib"].items()}
    # The command's own peak: wait4's ru_maxrss is the larger of its own and its largest
    # waited child's; the larger of that and the polled one errs on the high side.
    peaks[r["root"]] = max(peaks.get(r["root"], 0), int(r["maxrss_kib"]) * 1024)
    memory = {
        "sum": sum(peaks.values()),
        "top": int(r["top_sum_kib"]) * 1024,
        "root": peaks[r["root"]],
        "processes": len(peaks),
    }
    return float(r["seconds"]), memory, out
