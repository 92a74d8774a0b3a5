"""A PostgreSQL vault is created, opened and verified as the one vault type the commands
call (`vault.engine.AnyVault`), as a file is (tests/files/test_one_vault_type_over_both_engines.py).

Run with `scripts/with-postgres scripts/test -q -m postgres`.
"""

from __future__ import annotations

from tests.pgserver import MARKS

pytestmark = MARKS


def test_a_url_is_created_opened_and_verified_as_the_one_vault_type(pg_url: str) -> None:
    from vault.engine import AnyVault
    from vault.engines.registry import init_vault, open_vault, verify_vault

    created = init_vault(pg_url, ttl=3600)
    opened = open_vault(pg_url)
    assert isinstance(created, AnyVault)
    assert isinstance(opened, AnyVault)
    assert (opened.backend, opened.stays) == ("postgresql", "rows")
    assert opened.backup_note and "pg_dump" in opened.backup_note
    assert opened.vault_id == created.vault_id
    assert opened.ttl == 3600
    assert [i.session_id for i in opened.sessions()] == []
    assert list(opened.row_batches()) == []
    assert opened.scrub() is True
    assert verify_vault(pg_url).ok
