"""The vault's own envelope code and the SDK's EncryptedSession agree, both ways."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import keyring
import pytest
from agents import Agent, Runner, SQLiteSession
from agents.extensions.memory import EncryptedSession
from agents.testing import ScriptedModel, assistant_message

import vault as vault_pkg
from tests.conftest import add_items, assistant, key_entry, rows, user
from vault import crypto, durations


def test_open_session_is_the_sdks_encrypted_session(vault: Any, vault_db: Path) -> None:
    s = vault_pkg.open_session("chat", vault_db)
    assert isinstance(s, EncryptedSession)
    assert isinstance(s.underlying_session, SQLiteSession)
    assert Path(s.underlying_session.db_path) == vault_db
    assert s.ttl == 3600


def test_usable_as_runner_session(vault: Any, vault_db: Path) -> None:
    async def go() -> list[Any]:
        s = vault_pkg.open_session("chat", vault_db)
        model = ScriptedModel([[assistant_message("hi there")], [assistant_message("again")]])
        agent = Agent(name="t", instructions="be brief", model=model)
        await Runner.run(agent, "hello", session=s)
        await Runner.run(agent, "second", session=s)
        # The second turn's model input carries the first turn from the vault.
        assert "hello" in json.dumps(model.calls[1].input)
        return await s.get_items()

    items = asyncio.run(go())
    assert len(items) == 4
    assert all(json.loads(r)["kid"] == vault.sealer().kid for r in rows(vault_db))


def test_sdk_reads_what_the_vault_wrote(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("written by the vault"), assistant("ok")])
    key = keyring.get_password("memvault", key_entry(vault))
    assert key

    async def go() -> list[Any]:
        bare = EncryptedSession("s", SQLiteSession("s", vault_db), encryption_key=key, ttl=3600)
        return await bare.get_items()

    assert asyncio.run(go()) == [user("written by the vault"), assistant("ok")]


def test_vault_code_reads_what_the_sdk_wrote(tmp_path: Path) -> None:
    key = crypto.generate_key()
    db = tmp_path / "sdk.db"

    async def go() -> None:
        bare = EncryptedSession("s", SQLiteSession("s", db), encryption_key=key, ttl=3600)
        await bare.add_items(
            [
                user("from the SDK"),
                {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c1"},
            ]
        )

    asyncio.run(go())
    conn = sqlite3.connect(db)
    data = [r[0] for r in conn.execute("SELECT message_data FROM agent_messages ORDER BY id")]
    conn.close()
    sealer = crypto.Sealer(key)
    opened = [sealer.open("s", d, 3600) for d in data]
    assert [o.state for o in opened] == [crypto.ItemState.READABLE] * 2
    assert opened[0].item == user("from the SDK")
    assert opened[1].item["call_id"] == "c1"
    # Same derivation, so the vault's sealed rows have the SDK's shape exactly.
    mine = json.loads(sealer.seal("s", user("x")))
    theirs = json.loads(data[0])
    assert list(mine) == list(theirs) and mine["v"] == theirs["v"] == 1
    assert theirs["kid"] == "hkdf-v1" and mine["kid"] == crypto.key_id(key)


def test_key_id_is_one_way_and_stable() -> None:
    key = crypto.generate_key()
    kid = crypto.key_id(key)
    assert kid == crypto.key_id(key) and kid.startswith("mv1:") and len(kid) == 20
    assert key not in kid and crypto.key_id(crypto.generate_key()) != kid


def test_ttl_is_judged_on_fernet_time_without_sleeping() -> None:
    s = crypto.Sealer(crypto.generate_key())
    row = s.seal("s", user("x"), now=1_000_000)
    assert s.open("s", row, ttl=60, now=1_000_059).state is crypto.ItemState.READABLE
    assert s.open("s", row, ttl=60, now=1_000_061).state is crypto.ItemState.EXPIRED
    assert s.open("s", row, ttl=None, now=9_000_000).state is crypto.ItemState.READABLE
    other = crypto.Sealer(crypto.generate_key())
    assert other.open("s", row, ttl=60, now=1_000_000).state is crypto.ItemState.UNREADABLE
    assert s.open("other-session", row, ttl=60, now=1_000_000).state is crypto.ItemState.UNREADABLE


def test_expired_items_are_skipped_by_the_session(vault: Any, vault_db: Path) -> None:
    import time

    from tests.conftest import insert_sealed

    insert_sealed(vault_db, "s", [user("old")], int(time.time()) - 7200)
    insert_sealed(vault_db, "s", [user("new")], int(time.time()))

    async def go() -> list[Any]:
        return await vault_pkg.open_session("s", vault_db).get_items()

    assert asyncio.run(go()) == [user("new")]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("15m", 900),
        ("12h", 43200),
        ("30d", 2592000),
        ("2w", 1209600),
        ("3600", 3600),
        ("never", None),
        (" 7D ", 604800),
    ],
)
def test_durations(text: str, seconds: int | None) -> None:
    assert durations.parse_duration(text) == seconds
    if seconds is not None:
        assert durations.parse_duration(durations.format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "abc", "5x", "-1", "0", "1.5h", "99999999d"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        durations.parse_duration(text)
