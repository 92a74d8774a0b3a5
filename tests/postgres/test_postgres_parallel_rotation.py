"""A large rotation of a PostgreSQL vault re-encrypts in worker processes too: the loop
and its workers are the file vault's (tests/keys/test_parallel_rotation.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.pgserver import MARKS, raw_kids

pytestmark = MARKS

ITEMS = {sid: [{"role": "user", "content": f"{sid} turn {i}"} for i in range(60)] for sid in "ab"}


def test_a_large_postgres_rotation_re_encrypts_in_worker_processes(
    pg_vault: Any, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vault
    from vault import crypto, rotation, rotationpool
    from vault.engines.postgres.vault import PgVault

    async def write() -> None:
        for sid, items in ITEMS.items():
            await vault.open_session(sid, pg_url).add_items(items)

    asyncio.run(write())
    n = sum(len(items) for items in ITEMS.values())
    monkeypatch.setattr(rotation, "PARALLEL_MIN_ROWS", n)  # this vault is large enough
    monkeypatch.setattr(rotationpool, "cores", lambda: 2)
    here = 0
    rotate_row = crypto.rotate_row_stamped

    def counting(*args: Any) -> Any:
        nonlocal here
        here += 1
        return rotate_row(*args)

    monkeypatch.setattr(crypto, "rotate_row_stamped", counting)
    report = PgVault.open(pg_url).rotate(batch=20)
    assert report.counts["items"] == n
    assert here == 0  # not one row re-encrypted in this process

    assert set(raw_kids(pg_url)) == {PgVault.open(pg_url).sealer(refresh=True).kid}

    async def read() -> dict[str, list[Any]]:
        return {sid: await vault.open_session(sid, pg_url).get_items() for sid in ITEMS}

    assert asyncio.run(read()) == ITEMS
