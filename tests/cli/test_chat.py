"""`memvault chat`, offline: the real command in a subprocess, stdin piped, with the SDK's
ScriptedModel injected through MEMVAULT_CHAT_TEST_MODEL (the test-only hook)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import assistant, raw_bytes, run_cli, user
from vault.demo import user_texts

FACTORY = "tests.cli.test_chat:scripted_model"
CODE = "ZEPHYR-4821"


def scripted_model() -> Any:
    """The factory the chat subprocess loads: a ScriptedModel that records every input
    (to $CHAT_TEST_LOG, one JSON line per call) and answers from what it is given."""
    from agents.testing import ModelStep, ScriptedModel, assistant_message

    def respond(call: Any) -> Any:
        log = os.environ.get("CHAT_TEST_LOG")
        if log:
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(call.input, default=str) + "\n")
        texts = user_texts(call.input)
        last = texts[-1] if texts else ""
        if "FAIL" in last:
            return RuntimeError("the scripted model was told to fail")
        return [assistant_message(f"heard {last!r} after {len(texts) - 1} earlier message(s)")]

    return ScriptedModel([ModelStep.respond(respond) for _ in range(20)])


def chat(session: str, lines: list[str], log: Path, *args: str) -> Any:
    return run_cli(
        "chat",
        session,
        *args,
        input="".join(line + "\n" for line in lines),
        env={"MEMVAULT_CHAT_TEST_MODEL": FACTORY, "CHAT_TEST_LOG": str(log)},
    )


def calls(log: Path) -> list[Any]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def items(vault: Any, session: str) -> list[Any]:
    found, expired, unreadable = type(vault).open(vault.path).items(session)
    assert (expired, unreadable) == (0, 0)
    return found


def texts_of(found: list[Any]) -> list[str]:
    out = []
    for item in found:
        content = item.get("content")
        if isinstance(content, str):
            out.append(content)
        else:
            out.extend(c.get("text", "") for c in content or [] if isinstance(c, dict))
    return out


# --------------------------------------------------------------------------
@pytest.mark.slow
def test_second_run_resumes_the_first(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    log1, log2 = tmp_path / "run1.jsonl", tmp_path / "run2.jsonl"
    r1 = chat("carnet", [f"My code name is {CODE}.", "/exit"], log1)
    assert r1.code == 0, r1
    assert "new session carnet" in r1.out
    assert f"assistant> heard 'My code name is {CODE}.' after 0 earlier message(s)" in r1.out
    assert "test model" in r1.err  # the hook says it is in use
    stored = items(vault, "carnet")
    assert len(stored) == 2
    assert stored[0] == user(f"My code name is {CODE}.")
    assert stored[1]["role"] == "assistant"
    assert CODE.encode() not in raw_bytes(vault_db)  # encrypted at rest

    r2 = chat("carnet", ["What was my code name?", "/exit"], log2)
    assert r2.code == 0, r2
    assert "resumed session carnet: 2 item(s) loaded (1 turn(s))" in r2.out
    (model_input,) = calls(log2)
    # The second process's model was given the first process's conversation.
    assert CODE in json.dumps(model_input)
    assert user_texts(model_input) == [f"My code name is {CODE}.", "What was my code name?"]
    assert "after 1 earlier message(s)" in r2.out
    assert CODE not in json.dumps(calls(log1)[0][:-1])  # the first run started empty
    assert len(items(vault, "carnet")) == 4
    assert "holds 4 item(s)" in r2.out


def test_without_openai_api_key_exit_4_one_line(vault: Any) -> None:
    assert "OPENAI_API_KEY" not in os.environ  # conftest removes it
    r = run_cli("chat", "carnet", input="hello\n/exit\n")
    assert r.code == 4, r
    assert r.err.count("\n") == 1 and "Traceback" not in r.err
    assert r.err.startswith("memvault: error: OPENAI_API_KEY is not set")
    assert r.out == ""
    assert vault.session_ids() == []


@pytest.mark.slow
def test_undo_removes_the_reply_and_the_message(vault: Any, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    r = chat("carnet", ["/undo", "first", "second", "/undo", "third", "/exit"], log)
    assert r.code == 0, r
    assert "nothing to undo" in r.out
    assert "undid the last turn (2 item(s) removed)" in r.out
    stored = items(vault, "carnet")
    assert len(stored) == 4
    texts = texts_of(stored)
    assert not [t for t in texts if "second" in t]  # neither the message nor its reply
    assert [i.get("role") for i in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[0] == user("first") and stored[2] == user("third")
    # The model of the turn after /undo no longer saw "second".
    assert user_texts(calls(log)[-1]) == ["first", "third"]


@pytest.mark.slow
def test_clear_empties_the_session(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    from tests.conftest import add_items

    add_items(vault_db, "other", [user("another session"), assistant("ok")])
    log = tmp_path / "log.jsonl"
    r = chat("carnet", [f"remember {CODE}", "/clear", "what do you remember?", "/exit"], log)
    assert r.code == 0, r
    assert "cleared session carnet (2 item(s) deleted)" in r.out
    assert user_texts(calls(log)[-1]) == ["what do you remember?"]
    stored = items(vault, "carnet")
    assert len(stored) == 2 and stored[0] == user("what do you remember?")
    assert CODE not in json.dumps(stored)
    assert items(vault, "other") == [user("another session"), assistant("ok")]
    assert [e for e in vault.audit_log() if e["event"] == "clear"][0]["items"] == 2


@pytest.mark.slow
def test_a_failed_model_call_leaves_the_history_whole(vault: Any, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    r = chat("carnet", ["hello", "please FAIL now", "still there?", "/exit"], log)
    assert r.code == 0, r
    assert r.err.count("memvault: error: the model call failed") == 1
    assert "Traceback" not in r.err
    stored = items(vault, "carnet")
    assert [s.get("role") for s in stored] == ["user", "assistant", "user", "assistant"]
    assert "please FAIL now" not in json.dumps(stored)
    assert user_texts(calls(log)[-1]) == ["hello", "still there?"]


def test_help_has_an_example() -> None:
    r = run_cli("chat", "--help")
    assert r.code == 0, r
    assert "Usage: memvault chat" in r.out and "Example" in r.out
    assert "/undo" in r.out and "OPENAI_API_KEY" in r.out
