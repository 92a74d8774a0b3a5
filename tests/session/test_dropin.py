"""`vault.open_session` is a drop-in for `SQLiteSession`: the SDK's session settings
behave as they do on a plain SQLiteSession, and the SDK's compaction wrapper works
over it (offline: a scripted model and a scripted `responses.compact` client)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, Runner, SessionSettings, SQLiteSession
from agents.memory import OpenAIResponsesCompactionSession
from agents.testing import ScriptedModel, assistant_message

import vault as vault_pkg
from tests.conftest import ScriptedCompactor, raw_bytes, rows
from vault import Vault


def _script() -> ScriptedModel:
    return ScriptedModel([[assistant_message(f"answer {n}")] for n in range(3)])


async def _three_turns(session: Any) -> tuple[list[Any], list[Any]]:
    """Three turns through the Runner: what the model was sent each time, and the history."""
    model = _script()
    agent = Agent(name="t", instructions="be brief", model=model)
    for n in range(3):
        await Runner.run(agent, f"question {n}", session=session)
    inputs = [json.loads(json.dumps(call.input, default=str)) for call in model.calls]
    return inputs, await session.get_items()


@pytest.mark.parametrize("settings", [SessionSettings(limit=2), {"limit": 2}])
def test_session_settings_limit_behaves_as_on_a_plain_sqlite_session(
    vault: Any, vault_db: Path, tmp_path: Path, settings: Any
) -> None:
    async def go() -> None:
        ours = vault_pkg.open_session("chat", vault_db, session_settings=settings)
        plain = SQLiteSession("chat", tmp_path / "plain.db", session_settings=settings)
        assert ours.session_settings == plain.session_settings == SessionSettings(limit=2)
        our_inputs, our_items = await _three_turns(ours)
        plain_inputs, plain_items = await _three_turns(plain)
        # The Runner sent the model the same (limited) history, turn by turn.
        assert our_inputs == plain_inputs
        assert our_items == plain_items and len(our_items) == 2
        assert our_items[-1]["content"][0]["text"] == "answer 2"
        assert await ours.get_items(limit=3) == await plain.get_items(limit=3)
        # The limit is a read default only: every item is stored, sealed.
        assert len(await plain.get_items(limit=100)) == len(rows(vault_db)) == 6
        assert len(await ours.get_items(limit=100)) == 6
        ours.close()
        plain.close()

    asyncio.run(go())
    assert b"question 0" not in raw_bytes(vault_db)


def test_without_session_settings_the_history_is_unlimited(vault: Any, vault_db: Path) -> None:
    async def go() -> None:
        s = vault_pkg.open_session("chat", vault_db)
        assert s.session_settings == SessionSettings()
        _, items = await _three_turns(s)
        assert len(items) == 6
        s.close()

    asyncio.run(go())


def test_vault_session_takes_the_same_settings(vault: Any) -> None:
    s = vault.session("chat", session_settings=SessionSettings(limit=1))
    assert s.session_settings == SessionSettings(limit=1)
    assert s.underlying_session.session_settings == SessionSettings(limit=1)
    s.close()


@pytest.mark.parametrize("ttl", [3600, None], ids=["ttl-1h", "ttl-never"])
def test_compaction_session_over_the_vault_compacts_and_keeps_it_sealed(
    vault_db: Path, ttl: int | None
) -> None:
    v = Vault.init(vault_db, ttl=ttl)
    compactor = ScriptedCompactor("summary: asked the question", role="user")

    async def go() -> tuple[ScriptedModel, list[Any]]:
        inner = vault_pkg.open_session("chat", vault_db)
        session = OpenAIResponsesCompactionSession(
            "chat",
            underlying_session=inner,
            client=compactor.client,  # type: ignore[arg-type]
            should_trigger_compaction=lambda context: True,
        )
        model = ScriptedModel([[assistant_message("first")], [assistant_message("second")]])
        agent = Agent(name="t", instructions="be brief", model=model)
        # Turn one; the SDK compacts right after storing it.
        await Runner.run(agent, "the question", session=session)
        assert len(compactor.calls) == 1
        fresh = vault_pkg.open_session("chat", vault_db)
        compacted = await fresh.get_items()
        fresh.close()
        # Turn two is sent the compacted history, read back through the vault.
        await Runner.run(agent, "next", session=session)
        inner.close()
        return model, compacted

    model, compacted = asyncio.run(go())
    assert len(compacted) == 1
    assert compacted[0]["content"][0]["text"] == "summary: asked the question"
    assert "summary: asked the question" in json.dumps(model.calls[1].input, default=str)
    assert "the question" not in json.dumps(model.calls[1].input, default=str).replace(
        "summary: asked the question", ""
    )
    # What compaction stored went through the vault: sealed under its key, the old
    # history removed through its audited clear, nothing readable in the files.
    kid = v.sealer().kid
    assert all(json.loads(r)["kid"] == kid for r in rows(vault_db))
    assert any(e["event"] == "clear" for e in v.audit_log())
    data = raw_bytes(vault_db)
    assert b"summary: asked" not in data and b"the question" not in data


def test_manual_run_compaction_replaces_the_history_through_the_vault(
    vault: Any, vault_db: Path
) -> None:
    compactor = ScriptedCompactor("summary of two turns", role="user")

    async def go() -> list[Any]:
        inner = vault_pkg.open_session("chat", vault_db)
        session = OpenAIResponsesCompactionSession(
            "chat",
            inner,
            client=compactor.client,  # type: ignore[arg-type]
        )
        await session.add_items(
            [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "reply one"},
                {"role": "user", "content": "two"},
            ]
        )
        await session.run_compaction({"force": True, "compaction_mode": "input"})
        items = await vault_pkg.open_session("chat", vault_db).get_items()
        inner.close()
        return items

    items = asyncio.run(go())
    assert len(compactor.calls) == 1
    sent = json.dumps(compactor.calls[0]["input"])
    assert "reply one" in sent and "two" in sent
    assert [i["content"][0]["text"] for i in items] == ["summary of two turns"]
    assert len(rows(vault_db)) == 1 and b"reply one" not in raw_bytes(vault_db)
