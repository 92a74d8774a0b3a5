"""A fleet on a transit PostgreSQL vault, on real OpenBao and PostgreSQL servers: host A
rotates 100,000 items while hosts B and C write. Every host is a process with no
keyring at all, holding only a token. No write is refused, no host exits non-zero, and
afterwards every acknowledged item is readable from every host."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import baoserver, pgserver
from tests.crashkit import first_line
from tests.keys.test_transit_vaults import cli_at, host_env, init_transit
from tests.postgres.test_postgres_hosts import prefill

pytestmark = [*baoserver.MARKS, *pgserver.MARKS, pytest.mark.slow]

ITEMS = 100_000

# Writes items through the library's session until the stop file appears; one "ack N T"
# line per item the session acknowledged, T its time. argv = location, session id, stop file.
WRITER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    import vault

    async def main() -> None:
        db, sid, stop = sys.argv[1:4]
        session = vault.open_session(sid, db)
        print("ready", flush=True)
        i = 0
        while not os.path.exists(stop) or i < 20:
            await session.add_items([{"role": "user", "content": f"{sid} item {i}"}])
            print("ack", i, time.time(), flush=True)
            i += 1
            await asyncio.sleep(0.01)
        session.close()
        assert "keyring" not in sys.modules, "a keyring was loaded"

    asyncio.run(main())
    """
)


def test_host_a_rotates_while_b_and_c_write_and_every_host_reads_everything(
    key: str, tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = init_transit(pg_url, key, tmp_path)
    # The test fills the vault as an operator would: through the transit key.
    monkeypatch.setenv("VAULT_ADDR", baoserver.ADDR)
    monkeypatch.setenv("VAULT_TOKEN", baoserver.ADMIN_TOKEN)
    contents = prefill(pg_url, ITEMS)
    hosts = {h: host_env(tmp_path, baoserver.host_token(key)) for h in "ABC"}
    stop = tmp_path / "stop"
    writers = {
        h: subprocess.Popen(
            [sys.executable, "-c", WRITER, pg_url, f"host-{h}", str(stop)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=hosts[h],
        )  # fmt: skip
        for h in "BC"
    }
    try:
        for h, proc in writers.items():
            assert proc.stdout is not None
            line = first_line(proc.stdout)
            assert line.strip() == "ready", (h, line, proc.stderr.read() if proc.stderr else "")
        began = time.time()
        rotated = cli_at(pg_url, hosts["A"], "--json", "rotate")
        ended = time.time()
        assert rotated.returncode == 0, rotated.stderr
        report = json.loads(rotated.stdout)
        assert report["old_kid"] == made["kid"] and report["items"] >= ITEMS
    finally:
        stop.touch()
    acked: dict[str, list[str]] = {}
    for h, proc in writers.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (h, err[-2000:])
        acks = [line.split()[1:] for line in out.splitlines() if line.startswith("ack ")]
        acked[f"host-{h}"] = [f"host-{h} item {i}" for i, _ in acks]
        assert len(acks) >= 20
        # The writes went on through A's rotation, not only before and after it.
        during = [i for i, t in acks if began < float(t) < ended]
        assert len(during) >= 10, (h, len(during), ended - began)
    for h, env in hosts.items():
        for sid, items in acked.items():
            shown = cli_at(pg_url, env, "--json", "show", sid)
            assert shown.returncode == 0, (h, shown.stderr)
            assert [i["content"] for i in json.loads(shown.stdout)["items"]] == items, (h, sid)
        sample = cli_at(pg_url, env, "--json", "show", "bulk-3")
        assert sample.returncode == 0, (h, sample.stderr)
        assert [i["content"] for i in json.loads(sample.stdout)["items"]] == contents["bulk-3"]
    checked = cli_at(pg_url, hosts["B"], "--json", "verify")
    assert checked.returncode == 0, checked.stderr[-2000:]
