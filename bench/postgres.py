"""Group `postgres` (--only postgres): the vault over SQLAlchemySession."""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import vault
from bench.common import (
    LIMIT,
    TURN,
    Config,
    Figure,
    fmt_value,
    from_samples,
    record,
    run,
    side_by_side,
)
from bench.data import make_items
from bench.pgserver import (
    PG_BARE_WRITER,
    PG_WRITER,
    PG_WRITERS,
    PgSchemas,
    pg_seal_rows,
    pg_url_from_env,
    server_only,
)
from bench.procs import memvault_cmd, timed_child, writer_during
from bench.workspace import Workspace, build_big
from vault.engines.sqlite.vault import DEFAULT_TTL

PG_SESSION_LIMIT = 1.2  # a 20-item read, a one-turn write: against the pooled bare session
PG_WRITERS_LIMIT = 0.8  # writers' throughput at 4 processes: against the pooled bare session
BARE_WRITERS = "bare EncryptedSession"


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

    from vault.engines.postgres.url import parse
    from vault.engines.postgres.vault import PgVault

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
            # Every read decrypts every item (the read cache's figure is its own, below).
            "memvault": vault.open_session(sid, url, read_cache=False),
            base: bare(sid, where),
            nopool: bare(sid, where, pooled=False),
        }

    note = (
        "the vault's session pools connections per event loop and reads the vault's kid "
        f"and TTL at each checkout; '{base}' uses SQLAlchemy's default pool"
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
                f"≤ {PG_SESSION_LIMIT}×",
                PG_SESSION_LIMIT,
                note,
            )
        _pg_cached_read(cfg, url, sids[cfg.sizes[-1]])
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
            f"≤ {PG_SESSION_LIMIT}×",
            PG_SESSION_LIMIT,
            note + "; each call commits; the bare sessions write a schema without the guard",
        )
    finally:
        for e in engines:
            with contextlib.suppress(Exception):
                run(e.dispose())


def _pg_cached_read(cfg: Config, url: str, sid: str) -> None:
    """The read cache on PostgreSQL: a repeated full read against a first one (the same
    session's cache dropped before each), side by side."""
    print("postgres: the read cache ...", flush=True)
    cached = vault.open_session(sid, url)
    first = vault.open_session(sid, url)

    def first_read() -> object:
        first.forget_reads()
        return run(first.get_items())

    assert run(cached.get_items()) == first_read()
    samples = side_by_side(
        {"memvault": lambda: run(cached.get_items()), "memvault, first read": first_read},
        min(cfg.reps_read, 5),
        inner=1,
        warmup=1,
    )
    from_samples(
        "pg_cached_read",
        "PostgreSQL: get_items() full history again, cache warm",
        samples,
        "memvault, first read",
        "report",
        None,
        "the rows are still fetched every time; only their decryption is saved",
    )


def _pg_writers(cfg: Config, schemas: PgSchemas, ws: Workspace) -> None:
    from vault.engines.postgres.url import parse
    from vault.engines.postgres.vault import PgVault

    url = schemas.url("writers")
    key = PgVault.init(url, ttl=DEFAULT_TTL).sealer().master_key
    # The bare SDK sessions write a schema of their own, without the vault's guard.
    bare_url = schemas.url("bare_writers")
    schemas.sql(server_only(bare_url), f'CREATE SCHEMA "{parse(bare_url).schema}"')
    _sdk_tables(bare_url)
    seconds = 1.0 if cfg.quick else 5.0
    reps = 1 if cfg.quick else 3
    turn = json.dumps(list(make_items(TURN, seed=7)))
    env = ws.child_env()
    kinds = {"memvault": (PG_WRITER, url), BARE_WRITERS: (PG_BARE_WRITER, bare_url)}
    print(
        f"postgres: writers' throughput ({seconds:g} s per count, {reps} round(s), the vault "
        "and the bare SDK session in turn) ...",
        flush=True,
    )
    for k in (1, 2, 4) if cfg.quick else PG_WRITERS:
        samples: dict[str, list[float]] = {name: [] for name in kinds}
        waits: list[float] = []
        for r in range(reps):
            order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
            for name in order:
                script, where = kinds[name]
                outs = _writers(script, where, k, seconds, turn, key, env, f"{name[:4]}{k}.{r}")
                samples[name].append(sum(o["items"] for o in outs) / seconds)
                if name == "memvault":
                    waits += [w for o in outs for w in o["waits"]]
        record(
            Figure(
                key=f"pg_writers_{k}",
                label=f"PostgreSQL: writers' throughput, {k} process{'es' if k > 1 else ''}",
                unit="items/s",
                memvault=statistics.median(samples["memvault"]),
                comparisons={BARE_WRITERS: statistics.median(samples[BARE_WRITERS])},
                baseline=BARE_WRITERS,
                target=f"≥ {PG_WRITERS_LIMIT}×" if k == 4 else "report",
                limit=PG_WRITERS_LIMIT if k == 4 else None,
                at_least=True,
                note=(
                    f"items acknowledged per second, all writers together (one turn of {TURN} "
                    f"items per add_items, a session each), median of {reps} round(s), the "
                    f"ratio vault / bare per round; the vault's median add_items "
                    f"{fmt_value(statistics.median(waits), 's')}, longest "
                    f"{fmt_value(max(waits), 's')}"
                ),
                samples=samples,
            )
        )


def _sdk_tables(url: str) -> None:
    """The SDK's tables, made by the SDK (create_tables=True) once, before the writers
    start: eight writers each creating them would race."""
    from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
    from sqlalchemy.ext.asyncio import create_async_engine

    from vault.engines.postgres.url import parse

    loc = parse(url)
    engine = create_async_engine(
        loc.sqlalchemy_url, connect_args={"server_settings": loc.server_settings()}
    )

    async def create() -> None:
        await SQLAlchemySession("x", engine=engine, create_tables=True).get_items()
        await engine.dispose()

    run(create())


def _writers(
    script: str,
    url: str,
    k: int,
    seconds: float,
    turn: str,
    key: str,
    env: dict[str, str],
    tag: str,
) -> list[dict[str, Any]]:
    """k writer processes started together, each writing for `seconds`: their reports."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        procs = []
        try:
            for j in range(k):
                args = [url, f"w{tag}-{j}", str(t / f"ready{j}"), str(t / "go"), str(seconds)]
                p = subprocess.Popen(
                    [sys.executable, "-c", script, *args, str(t / f"out{j}.json"), turn],
                    stdin=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                assert p.stdin is not None
                p.stdin.write(key + "\n")  # only the bare writer reads it
                p.stdin.flush()  # closed by communicate()
                procs.append(p)
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
        return [json.loads((t / f"out{j}.json").read_text()) for j in range(k)]


def _pg_rotation(cfg: Config, schemas: PgSchemas, ws: Workspace) -> None:
    from vault.engines.postgres.vault import PgVault

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
