"""The read cache serves the PostgreSQL session too: a repeated read decrypts only what
is new, and a change made by another process is seen (vault.readcache)."""

from __future__ import annotations

import asyncio
from typing import Any

from cryptography.fernet import Fernet

from tests.conftest import run_cli, user
from tests.pgserver import MARKS

pytestmark = MARKS


def test_a_repeated_read_decrypts_only_what_is_new_and_sees_other_processes(
    pg_vault: Any, pg_url: str, monkeypatch: Any
) -> None:
    import vault

    count = [0]
    real = Fernet.decrypt

    def counted(self: Fernet, *a: Any, **kw: Any) -> bytes:
        count[0] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(Fernet, "decrypt", counted)

    def read(s: Any) -> tuple[list[Any], int]:
        before = count[0]
        items = asyncio.run(s.get_items())
        return items, count[0] - before

    s = vault.open_session("s", pg_url)
    asyncio.run(s.add_items([user(f"item {i}") for i in range(10)]))
    first, n1 = read(s)
    asyncio.run(s.add_items([user("one more")]))
    second, n2 = read(s)
    assert (len(first), n1) == (10, 10)
    assert (len(second), n2) == (11, 1) and second[:10] == first
    got, n3 = read(s)
    got[0]["content"] = "changed by the caller"
    assert read(s)[0] == second and n3 == 0

    assert run_cli("--db", pg_url, "pop", "s", "-n", "2").code == 0
    after_pop, n4 = read(s)
    assert after_pop == second[:9] and n4 == 0
    r = run_cli("--db", pg_url, "rotate", "--yes")
    assert r.code == 0, r
    rotated, n5 = read(s)
    assert rotated == second[:9] and n5 >= 9  # new tokens: decrypted again
    assert read(s) == (rotated, 0)  # and kept from then on
    fresh = vault.open_session("s", pg_url, read_cache=False)
    assert asyncio.run(fresh.get_items()) == rotated

    # The session's own pop, clear and close drop what it kept.
    assert len(s._reads) == 9
    asyncio.run(s.pop_item())
    assert len(s._reads) == 0
    read(s)
    assert len(s._reads) == 8
    asyncio.run(s.clear_session())
    assert len(s._reads) == 0 and read(s) == ([], 0)
    asyncio.run(s.add_items([user("kept until close")]))
    read(s)
    assert len(s._reads) == 1
    s.close()
    assert len(s._reads) == 0
