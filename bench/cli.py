"""Group `cli`: the command line's start-up and open_session()."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
from collections.abc import Callable

import vault
from bench.common import Config, Figure, from_samples, med, record, side_by_side
from bench.data import make_items
from bench.procs import memvault_cmd, runner
from bench.workspace import Workspace, fill
from vault.engines.sqlite.vault import Vault


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
            fill(conn, rows, sealer)
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
