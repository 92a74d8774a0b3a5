"""Group `scale` (--scale): the million-item figures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import vault
from bench.common import LIMIT, Config, Figure, from_samples, med, record, run, side_by_side
from bench.procs import memvault_cmd, runner, timed_child, timed_tree
from bench.rotation import REFERENCE
from bench.workspace import EXPIRED_EVERY, Workspace, build_big
from vault import paths


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
    # The rotation's workers count too: the memory of its whole process tree.
    secs, memory, out = timed_tree([*mv, "--db", str(big.path), "--json", "rotate"], env)
    report = json.loads(out)
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
            label=f"peak memory of `memvault rotate` and its workers together, {n:,} items",
            unit="MB",
            memvault=memory["sum"] / 1e6,
            comparisons={
                "the rotating process alone": memory["root"] / 1e6,
                "`memvault status`": REFERENCE.get("status_rss"),
            },
            target="≤ 150 MB",
            limit=150.0,
            note=f"the sum of each of its {memory['processes']} processes' own peak RSS "
            "(bench.procs.timed_tree)",
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
