"""`memvault search`: decrypt, scan, print hits; no index, nothing written. Real
subprocesses, real keyring, real SQLite; plus the one reading of an item's text."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    add_items,
    assistant,
    insert_sealed,
    raw_bytes,
    run_cli,
    user,
)
from tests.files.test_export import CALL, OUTPUT, REPLY, give_keys, one_line, take_keys, tamper
from vault.export import ItemText, item_text


@pytest.fixture
def history(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "chat-1", [user("What is the weather in Lyon?"), CALL, OUTPUT, REPLY])
    add_items(vault_db, "chat-2", [user("Remember NORD-17."), assistant("Noted: nord-17.")])


def test_hits_are_one_line_each_with_session_position_role_and_excerpt(history: None) -> None:
    r = run_cli("search", "NORD-17")
    assert r.code == 0, r
    assert r.out.splitlines() == [
        "chat-2 #1 user: Remember NORD-17.",
        "chat-2 #2 assistant: Noted: nord-17.",  # case-insensitive
    ]
    assert r.err == ""
    lyon = run_cli("search", "lyon", "chat-1").out.splitlines()
    assert [line.split(":")[0] for line in lyon] == [
        "chat-1 #1 user",
        "chat-1 #2 tool call",
        "chat-1 #4 assistant",
    ]
    assert lyon[1].startswith('chat-1 #2 tool call: get_weather({"city": "Lyon"') and lyon[
        1
    ].endswith("…")
    assert run_cli("search", "get_weather").out.startswith("chat-1 #2 tool call: get_weather(")
    out = run_cli("search", "yyyy").out.splitlines()
    assert len(out) == 1 and out[0].startswith("chat-1 #3 tool output: sunny yyy")
    assert out[0].endswith("y…")
    assert len(out[0]) < 120  # an excerpt, not the 500-character output


def test_json_document(history: None) -> None:
    r = run_cli("--json", "search", "--regex", r"nord-\d+", "chat-2")
    assert r.code == 0, r
    doc = r.json()
    assert doc["pattern"] == r"nord-\d+" and doc["regex"] is True
    assert (doc["sessions"], doc["items"], doc["expired_skipped"], doc["unreadable"]) == (
        ["chat-2"],
        2,
        0,
        0,
    )
    assert [(h["session_id"], h["position"], h["role"], h["excerpt"]) for h in doc["hits"]] == [
        ("chat-2", 1, "user", "Remember NORD-17."),
        ("chat-2", 2, "assistant", "Noted: nord-17."),
    ]
    assert all(h["timestamp"].endswith("Z") and h["expired"] is False for h in doc["hits"])


def test_no_match_is_exit_1_with_a_note_on_stderr(history: None) -> None:
    r = run_cli("search", "zebra")
    assert r.code == 1, r
    assert r.out == ""
    assert r.err.strip() == "no item matches 'zebra' (6 items searched in 2 sessions)"
    j = run_cli("--json", "search", "zebra")
    assert j.code == 1 and j.json()["hits"] == [] and j.err == ""


def test_bad_patterns_are_usage_errors(history: None) -> None:
    one_line(run_cli("search", "--regex", "(unclosed"), 2, "bad regular expression", "--regex")
    one_line(run_cli("search", ""), 2, "pattern is empty")
    j = run_cli("--json", "search", "--regex", "[")
    assert j.code == 2 and j.json()["exit_code"] == 2
    # Without --regex the same text is looked for as it is; after --, even an option's name.
    assert run_cli("search", "(unclosed").code == 1
    dash = run_cli("search", "--", "--force")
    assert dash.code == 1 and "no item matches '--force'" in dash.err


def test_regex_too_large_to_compile_is_a_usage_error(history: None) -> None:
    # A repeat count past the compiler's integer, and a nesting past its stack.
    one_line(run_cli("search", "--regex", "a{99999999999}"), 2, "too large to compile")
    one_line(run_cli("search", "--regex", "(" * 5000 + ")" * 5000), 2, "too large to compile")


def test_expired_items_are_skipped_unless_asked_for(vault: Any, vault_db: Path) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "s", [user("old PLAN-B")], now - 7200)  # the TTL is 1 h
    insert_sealed(vault_db, "s", [user("new plan-c")], now)
    r = run_cli("search", "plan-b")
    assert r.code == 1 and "--include-expired also searches 1 expired" in r.err
    r = run_cli("--json", "search", "plan-", "--include-expired")
    assert r.code == 0, r
    assert [(h["position"], h["expired"]) for h in r.json()["hits"]] == [(1, True), (2, False)]
    assert r.json()["expired_skipped"] == 0


def test_a_session_with_an_unreadable_item_is_refused_not_searched(
    vault: Any, vault_db: Path
) -> None:
    # In a chained session an item that fails authentication is tampering: the session's
    # history is not searched at all (`show --include-tampered` reads it, marked).
    add_items(vault_db, "s", [user("alpha one"), user("alpha two"), user("alpha three")])
    tamper(vault_db, "s", 1)
    r = run_cli("search", "alpha")
    assert r.code == 1 and r.out == "", r
    assert "does not verify (unauthenticated)" in r.err
    assert len(r.err.strip().splitlines()) == 1


def test_search_writes_nothing(history: None, vault_db: Path, tmp_path: Path) -> None:
    folder = vault_db.parent
    before = (sorted(os.listdir(folder)), raw_bytes(vault_db), sorted(os.listdir(tmp_path)))
    assert run_cli("search", "lyon").code == 0
    assert run_cli("search", "zebra", "--include-expired").code == 1
    after = (sorted(os.listdir(folder)), raw_bytes(vault_db), sorted(os.listdir(tmp_path)))
    assert after == before


def test_missing_session_missing_key_and_revoked_vault(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    one_line(run_cli("search", "x", "s", "nope"), 1, "no session 'nope'")
    saved = take_keys(vault.vault_id)
    one_line(run_cli("search", "x"), 4, "key")
    give_keys(saved)
    assert run_cli("search", "x").code == 0
    assert run_cli("revoke", "--yes").code == 0
    one_line(run_cli("search", "x"), 4, "revoked")


def test_excerpts_never_replay_terminal_control_sequences(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("before \x1b]0;pwned\x07 NEEDLE\tafter\nnext line")])
    r = run_cli("search", "needle")
    assert r.code == 0, r
    assert "\x1b" not in r.out and "\x07" not in r.out
    assert r.out == "s #1 user: before \\x1b]0;pwned\\x07 NEEDLE after next line\n"


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        (user("hi"), ItemText("user", "hi")),
        (
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_image"}],
            },
            ItemText("user", "a\n[input_image]"),
        ),
        (REPLY, ItemText("assistant", "It is sunny in Lyon.")),
        (
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "refusal", "refusal": "no"}],
            },
            ItemText("assistant", "no"),
        ),
        (CALL, ItemText("tool call", CALL["arguments"], "get_weather")),
        (OUTPUT, ItemText("tool output", OUTPUT["output"])),
        (
            {"type": "function_call_output", "output": [{"type": "input_text", "text": "parts"}]},
            ItemText("tool output", "parts"),
        ),
        (
            {"type": "file_search_call", "queries": ["q1"]},
            ItemText("tool call", '["q1"]', "file_search"),
        ),
        (
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]},
            ItemText("reasoning", "thinking"),
        ),
        (
            {"type": "compaction", "x": 1},
            ItemText("compaction", json.dumps({"type": "compaction", "x": 1})),
        ),
        ("bare", ItemText("item", "bare")),
    ],
)
def test_item_text_reads_each_kind_of_item(item: Any, expected: ItemText) -> None:
    assert item_text(item) == expected
