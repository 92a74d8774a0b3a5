"""memvault benchmarks: what the vault costs, side by side with the alternatives.

    scripts/with-keyring .venv/bin/python bench/run.py [--quick] [--json-out PATH]

Every figure is measured in one run, on the same data, with the alternatives
interleaved call by call (in an order drawn afresh for each round). Times are
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
import contextlib
import datetime as _dt
import json
import os
import platform
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.cache import bench_cache
from bench.chain import bench_chain
from bench.cli import bench_cli
from bench.common import DEFAULT_JSON, FIGURES, LOOP, ROOT, Config, sqlcipher3, table
from bench.postgres import bench_postgres
from bench.rotation import bench_rotation
from bench.scale import bench_scale
from bench.sessions import bench_sessions
from bench.transit import bench_transit
from bench.workspace import Workspace
from vault.keys import KeyStore


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
    "chain": bench_chain,
    "cache": bench_cache,
    "cli": bench_cli,
    "rotation": bench_rotation,
    "scale": bench_scale,
    "postgres": bench_postgres,
    "transit": bench_transit,
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
