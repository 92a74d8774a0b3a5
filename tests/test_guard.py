"""Nothing foreign enters the file: plaintext and other keys are refused by triggers."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from agents import SQLiteSession
from agents.extensions.memory import EncryptedSession

from tests.conftest import add_items, raw_bytes, rows, user
from vault import crypto


def test_bare_sqlite_session_is_refused(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("sealed")])
    before = rows(vault_db)

    async def go() -> None:
        bare = SQLiteSession("s", vault_db)
        await bare.add_items([user("PLAINTEXT-SECRET")])

    with pytest.raises(sqlite3.IntegrityError, match="memvault: refused"):
        asyncio.run(go())
    assert rows(vault_db) == before
    assert b"PLAINTEXT-SECRET" not in raw_bytes(vault_db)


def test_encrypted_session_with_another_key_is_refused(vault: Any, vault_db: Path) -> None:
    async def go() -> None:
        other = EncryptedSession(
            "s", SQLiteSession("s", vault_db), encryption_key=crypto.generate_key(), ttl=60
        )
        await other.add_items([user("under another key")])

    with pytest.raises(sqlite3.IntegrityError, match="memvault: refused"):
        asyncio.run(go())
    assert rows(vault_db) == []


def test_vault_session_is_accepted(vault: Any, vault_db: Path) -> None:
    # Control for the two refusals above: the right key and kid do get in.
    add_items(vault_db, "s", [user("ok")])
    assert len(rows(vault_db)) == 1


@pytest.mark.parametrize(
    "data",
    [
        "plain text",
        json.dumps(user("a plaintext item")),
        "[1, 2]",
        json.dumps({"__enc__": 1, "v": 1, "kid": "KID", "payload": "not a fernet token"}),
        json.dumps(
            {"__enc__": 1, "v": 1, "kid": "KID", "payload": "gAAAAAx", "content": "smuggled"}
        ),
        json.dumps({"__enc__": 1, "v": 1, "kid": "mv1:0000000000000000", "payload": "gAAAAAx"}),
    ],
)
def test_trigger_rejects_malformed_rows(vault: Any, vault_db: Path, data: str) -> None:
    data = data.replace("KID", vault.sealer().kid)
    add_items(vault_db, "s", [user("x")])
    conn = sqlite3.connect(vault_db)
    with pytest.raises(sqlite3.IntegrityError), conn:
        conn.execute(
            "INSERT INTO agent_messages (session_id, message_data) VALUES ('s', ?)", (data,)
        )
    with pytest.raises(sqlite3.IntegrityError), conn:
        conn.execute("UPDATE agent_messages SET message_data = ?", (data,))
    conn.close()
    assert len(rows(vault_db)) == 1 and json.loads(rows(vault_db)[0])["kid"] == vault.sealer().kid
