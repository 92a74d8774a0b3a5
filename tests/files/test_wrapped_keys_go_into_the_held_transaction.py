"""A transit vault keeps its wrapped keys in the vault file (meta rows). One stored while
this process holds the file's write lock (a rotation's switch, a tidy) goes into that
very transaction: committed with it or rolled back with it, never waiting for the lock
its own process holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vault.engines.sqlite.wrapped import FileWrappedKeys


def test_a_wrapped_key_stored_under_the_write_lock_commits_or_rolls_back_with_it(
    vault: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A short lock timeout: a save through a connection of its own would fail busy.
    monkeypatch.setenv("MEMVAULT_LOCK_TIMEOUT", "0.5")
    store = FileWrappedKeys(vault)
    with pytest.raises(RuntimeError), vault.write_transaction():
        store.save(vault.vault_id, "mv1:aa", "vault:v1:rolled-back")
        assert store.load(vault.vault_id, "mv1:aa") == "vault:v1:rolled-back"
        raise RuntimeError("the switch failed")
    assert store.load(vault.vault_id, "mv1:aa") is None
    with vault.write_transaction():
        store.save(vault.vault_id, "mv1:bb", "vault:v1:kept")
    assert store.load(vault.vault_id, "mv1:bb") == "vault:v1:kept"
    with vault.write_transaction():
        assert store.drop(vault.vault_id, "mv1:bb") is True
        assert store.drop(vault.vault_id, "mv1:bb") is False


def test_a_wrapped_key_stored_outside_a_transaction_commits_on_its_own(
    vault: Any, vault_db: Path
) -> None:
    store = FileWrappedKeys(vault)
    with vault.connection() as reader:
        reader.execute("BEGIN")  # a read transaction holds no write lock: not used
        reader.execute("SELECT 1 FROM memvault_meta").fetchall()
        store.save(vault.vault_id, "mv1:cc", "vault:v1:own")
    assert FileWrappedKeys(type(vault).open(vault_db)).load(vault.vault_id, "mv1:cc") == (
        "vault:v1:own"
    )
    assert store.drop(vault.vault_id, "mv1:cc") is True
