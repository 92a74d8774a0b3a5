"""A vault file opens, is created and is verified as the one vault type the commands call
(`vault.engine.AnyVault`), through the one place that picks the engine; its PostgreSQL
twin is tests/postgres/test_one_vault_type_on_a_url.py."""

from __future__ import annotations

from pathlib import Path

from vault.engines.sqlite.shred import shred


def test_a_file_is_created_opened_and_verified_as_the_one_vault_type(vault_db: Path) -> None:
    from vault.engine import AnyVault
    from vault.engines.registry import init_vault, open_vault, verify_vault

    created = init_vault(vault_db, ttl=3600)
    try:
        opened = open_vault(vault_db)
        assert isinstance(created, AnyVault)
        assert isinstance(opened, AnyVault)
        assert (opened.backend, opened.stays, opened.backup_note) == ("sqlite", "file", None)
        assert opened.vault_id == created.vault_id
        assert opened.ttl == 3600
        assert [i.session_id for i in opened.sessions()] == []
        assert list(opened.row_batches()) == []
        assert opened.scrub() is True
        assert verify_vault(vault_db).ok
    finally:
        shred(vault_db)
