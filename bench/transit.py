"""Group `transit` (--only transit): open_session() of a vault whose key is wrapped by a
transit key (one unwrap through OpenBao per process and key version), side by side with
the same vault's key in the keyring. Needs an OpenBao (or HashiCorp Vault) server:
`scripts/with-openbao` gives one; without it the group is skipped, saying why."""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import vault
from bench.common import Config, Figure, from_samples, med, record, run, side_by_side
from bench.data import make_items
from bench.workspace import Workspace, fill
from vault.engines.sqlite.vault import Vault

ADDR_VAR, TOKEN_VAR = "MEMVAULT_TEST_BAO_ADDR", "MEMVAULT_TEST_BAO_TOKEN"
ITEMS = 20  # what a one-turn agent reads back at the start of a run


def bench_transit(cfg: Config, ws: Workspace) -> None:
    addr, token = os.environ.get(ADDR_VAR), os.environ.get(TOKEN_VAR)
    if not addr or not token:
        print(
            f"transit: skipped: no OpenBao server; run under scripts/with-openbao (or set "
            f"{ADDR_VAR} and {TOKEN_VAR})",
            flush=True,
        )
        return
    try:
        import hvac  # noqa: F401
    except ImportError:
        print("transit: skipped: pip install 'memvault[transit]'", flush=True)
        return
    key = "memvault-bench-" + secrets.token_hex(6)
    with _service(addr, token):
        try:
            _bench(cfg, ws, key)
        finally:
            from vault.keysource.transit import Transit

            with contextlib.suppress(Exception):
                Transit(key).delete_key()


@contextlib.contextmanager
def _service(addr: str, token: str) -> Iterator[None]:
    """VAULT_ADDR and VAULT_TOKEN for this process and its children, then as they were."""
    saved = {k: os.environ.get(k) for k in ("VAULT_ADDR", "VAULT_TOKEN")}
    os.environ.update(VAULT_ADDR=addr, VAULT_TOKEN=token)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _filled(ws: Workspace, name: str) -> Vault:
    v = ws.new_vault(name)
    sealer = v.sealer()
    rows = (("chat", sealer.seal("chat", it)) for it in make_items(ITEMS, seed=5))
    with contextlib.closing(sqlite3.connect(v.path, isolation_level=None)) as conn:
        fill(conn, rows, sealer)
    return v


def _bench(cfg: Config, ws: Workspace, key: str) -> None:
    from vault.keymove import move

    print("transit: open_session, transit against keyring ...", flush=True)
    in_keyring = _filled(ws, "transit-keyring").path
    in_transit = _filled(ws, "transit-transit").path
    move(Vault.open(in_transit), f"transit:{key}")

    def opener(path: Path) -> Callable[[], object]:
        # A new session object each call: its vault loads the key once (a keyring
        # lookup, or one transit unwrap), as a new process would.
        def go() -> None:
            s = vault.open_session("chat", path)
            assert len(run(s.get_items())) == ITEMS
            s.close()

        return go

    samples = side_by_side(
        {"memvault": opener(in_transit), "keyring": opener(in_keyring)},
        cfg.reps_open,
        warmup=2,
    )
    from_samples(
        "open_session_transit",
        f"open_session() + a {ITEMS}-item read, key unwrapped by transit (SDK imported)",
        samples,
        "keyring",
        "report",
        None,
        "baseline: the same with the key in the keyring; one transit decrypt per open",
    )
    probe = (
        "import sys, time; t = time.perf_counter(); import asyncio, vault; "
        "s = vault.open_session('chat', sys.argv[1]); asyncio.run(s.get_items()); "
        "print(time.perf_counter() - t); s.close()"
    )
    env = ws.child_env()
    cold: dict[str, list[float]] = {"memvault": [], "keyring": []}
    for path in (in_transit, in_keyring):  # not counted: fills the bytecode cache
        subprocess.run(
            [sys.executable, "-c", probe, str(path)], check=True, env=env, capture_output=True
        )
    for _ in range(cfg.reps_cold_open):
        for name, path in (("memvault", in_transit), ("keyring", in_keyring)):
            out = subprocess.run(
                [sys.executable, "-c", probe, str(path)],
                capture_output=True, text=True, check=True, env=env,
            )  # fmt: skip
            cold[name].append(float(out.stdout.strip().splitlines()[-1]))
    record(
        Figure(
            key="open_session_transit_cold",
            label=f"open_session() + a {ITEMS}-item read in a new process, transit key",
            unit="s",
            memvault=med(cold["memvault"]),
            comparisons={"keyring": med(cold["keyring"])},
            baseline="keyring",
            target="report",
            samples=cold,
        )
    )
