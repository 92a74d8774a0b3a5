"""`memvault export`: the decrypted history written out, as a person runs it (real
subprocesses, real keyring, real SQLite), and the library's streaming write."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

import keyring
import pytest

from tests.conftest import (
    CLIResult,
    add_items,
    assistant,
    insert_sealed,
    keyring_entries,
    raw_bytes,
    rows,
    run_cli,
    user,
)
from vault import Vault
from vault.errors import OperationFailed
from vault.export import plan_export, run_export

WARNING = "warning: the export is plaintext"

CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": json.dumps({"city": "Lyon", "note": "x" * 300}),
}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny " + "y" * 500}
REPLY = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "It is sunny in Lyon.", "annotations": []}],
}


def one_line(r: CLIResult, code: int, *needles: str) -> None:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("memvault: error: "), r.err
    assert "Traceback" not in r.err
    for n in needles:
        assert n in r.err, (n, r.err)


def take_keys(vault_id: str) -> dict[str, str]:
    """Remove every keyring entry of the vault (whatever their names); return them."""
    taken = keyring_entries(vault_id)
    for name in taken:
        keyring.delete_password("memvault", name)
    assert taken
    return taken


def give_keys(taken: dict[str, str]) -> None:
    for name, secret in taken.items():
        keyring.set_password("memvault", name, secret)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text("utf-8").split("\n") if line]


def tamper(db: Path, session_id: str, index: int) -> None:
    """Make one stored item fail authentication (its token's tail altered)."""
    conn = sqlite3.connect(db)
    with conn:
        ids = [
            r[0]
            for r in conn.execute(
                "SELECT id FROM agent_messages WHERE session_id = ? ORDER BY id", (session_id,)
            )
        ]
        data = json.loads(rows(db, session_id)[index])
        data["payload"] = data["payload"][:-8] + "A" * 8
        conn.execute(
            "UPDATE agent_messages SET message_data = ? WHERE id = ?",
            (json.dumps(data), ids[index]),
        )
    conn.close()


@pytest.fixture
def history(vault: Any, vault_db: Path) -> dict[str, list[Any]]:
    """Two sessions written through the real SDK session."""
    written = {
        "chat-1": [user("What is the weather in Lyon?"), CALL, OUTPUT, REPLY],
        "chat-2": [user("Remember NORD-17."), assistant("Noted: NORD-17.")],
    }
    for sid, items in written.items():
        add_items(vault_db, sid, items)
    return written


def test_jsonl_export_holds_every_item_with_its_session_position_and_seal_time(
    vault: Any, vault_db: Path, history: dict[str, list[Any]], tmp_path: Path
) -> None:
    sealed_at = int(time.time()) - 600  # within the 1 h TTL
    insert_sealed(vault_db, "chat-3", [user("sealed at a chosen time")], sealed_at)
    out = tmp_path / "all.jsonl"
    r = run_cli("export", "--all", "-o", str(out))
    assert r.code == 0, r
    lines = jsonl(out)
    by_session: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        assert set(line) == {"session_id", "position", "timestamp", "expired", "item"}
        by_session.setdefault(line["session_id"], []).append(line)
    assert [x["item"] for x in by_session["chat-1"]] == history["chat-1"]
    assert [x["item"] for x in by_session["chat-2"]] == history["chat-2"]
    assert [x["position"] for x in by_session["chat-1"]] == [1, 2, 3, 4]
    (third,) = by_session["chat-3"]
    assert third["timestamp"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(sealed_at))
    assert not any(x["expired"] for x in lines)
    assert "exported 7 items of 3 sessions as jsonl" in r.out
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    # Only what was asked for: one session.
    one = tmp_path / "one.jsonl"
    assert run_cli("export", "chat-2", "chat-2", "-o", str(one)).code == 0
    assert [x["item"] for x in jsonl(one)] == history["chat-2"]


def test_markdown_export_shows_roles_texts_and_tool_calls_shortened(
    history: dict[str, list[Any]], tmp_path: Path
) -> None:
    out = tmp_path / "h.md"
    r = run_cli("export", "chat-1", "chat-2", "--format", "md", "-o", str(out))
    assert r.code == 0, r
    md = out.read_text("utf-8")
    assert md.index("## Session `chat-1`") < md.index("## Session `chat-2`")
    assert "**1. user** · " in md and "> What is the weather in Lyon?" in md
    assert "**2. tool call** · " in md
    call_line = next(line for line in md.splitlines() if "`get_weather`(" in line)
    assert '{"city": "Lyon"' in call_line and call_line.endswith("…)")
    assert len(call_line) < 200  # the 300-character argument is abbreviated
    output_line = next(line for line in md.splitlines() if line.startswith("> sunny"))
    assert output_line.endswith("…") and len(output_line) < 400
    assert "> It is sunny in Lyon." in md and "**4. assistant**" in md
    assert "> Noted: NORD-17." in md
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_stdout_export_and_the_plaintext_warning_in_every_mode(
    history: dict[str, list[Any]], tmp_path: Path
) -> None:
    r = run_cli("export", "chat-2", "-o", "-")
    assert r.code == 0, r
    assert [json.loads(line)["item"] for line in r.out.splitlines()] == history["chat-2"]
    assert WARNING in r.err and "to stdout" in r.err  # the summary goes to stderr too
    md = run_cli("export", "chat-2", "--format", "md", "-o", "-")
    assert md.code == 0 and "> Remember NORD-17." in md.out and WARNING in md.err
    f = run_cli("--json", "export", "chat-2", "-o", str(tmp_path / "x.jsonl"))
    assert f.code == 0 and WARNING in f.err
    assert f.err.count("\n") == 1  # the warning is the only line on stderr


def test_json_summary_and_json_refused_with_stdout(
    history: dict[str, list[Any]], tmp_path: Path
) -> None:
    out = tmp_path / "x.md"
    r = run_cli("export", "--all", "--format", "md", "-o", str(out), "--json")
    assert r.code == 0, r
    assert r.json() == {
        "path": str(out),
        "format": "md",
        "sessions": ["chat-1", "chat-2"],
        "items": 6,
        "expired_skipped": 0,
        "expired_included": 0,
        "unreadable": 0,
    }
    s = run_cli("--json", "export", "chat-1", "-o", "-")
    one_line(s, 2, "--json does not apply to `export -o -`")
    assert s.json()["exit_code"] == 2  # the failure document is all stdout holds


def test_an_earlier_export_is_replaced_only_with_force(
    history: dict[str, list[Any]], tmp_path: Path
) -> None:
    out = tmp_path / "old.jsonl"
    assert run_cli("export", "chat-1", "-o", str(out)).code == 0
    before = out.read_bytes()
    out.chmod(0o644)
    r = run_cli("export", "chat-2", "-o", str(out))
    one_line(r, 2, "already exists", "--force")
    assert out.read_bytes() == before and WARNING not in r.err
    r = run_cli("export", "chat-2", "-o", str(out), "--force")
    assert r.code == 0, r
    assert [x["item"] for x in jsonl(out)] == history["chat-2"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # the old mode did not carry over
    md = tmp_path / "old.md"
    assert run_cli("export", "chat-1", "--format", "md", "-o", str(md)).code == 0
    assert run_cli("export", "chat-2", "-o", str(md), "--force").code == 0
    assert [x["item"] for x in jsonl(md)] == history["chat-2"]


def test_force_never_replaces_a_file_that_is_not_an_export(
    history: dict[str, list[Any]], tmp_path: Path
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    one_line(
        run_cli("export", "chat-2", "-o", str(notes), "--force"),
        2,
        "not a memvault export",
        "--force replaces only",
    )
    assert notes.read_text() == "keep me\n"
    other = tmp_path / "app.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    before = other.read_bytes()
    one_line(run_cli("export", "--all", "-o", str(other), "--force"), 2, "a SQLite database")
    assert other.read_bytes() == before
    # Its side file would be taken for the database's own journal.
    one_line(run_cli("export", "--all", "-o", f"{other}-wal"), 2, "side file of the SQLite")
    assert not Path(f"{other}-wal").exists()
    empty = tmp_path / "empty.jsonl"  # what an export of no item leaves
    empty.write_bytes(b"")
    assert run_cli("export", "chat-2", "-o", str(empty), "--force").code == 0


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_symlink_at_the_output_is_refused_and_its_target_untouched(
    history: dict[str, list[Any]], tmp_path: Path, force: list[str]
) -> None:
    target = tmp_path / "target.txt"
    target.write_text("precious\n")
    target.chmod(0o644)
    link = tmp_path / "out.jsonl"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "nowhere.txt")
    for path in (link, dangling):
        one_line(run_cli("export", "chat-1", "-o", str(path), *force), 2, "symbolic link")
        assert path.is_symlink()
    assert target.read_text() == "precious\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not (tmp_path / "nowhere.txt").exists()


def test_refusals_leave_no_file(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "s", [user("x")])
    out = tmp_path / "out.jsonl"
    one_line(run_cli("export", "-o", str(out)), 2, "name the sessions", "--all")
    one_line(run_cli("export", "s", "--all", "-o", str(out)), 2, "--all")
    one_line(run_cli("export", "s", "nope", "-o", str(out)), 1, "no session 'nope'")
    one_line(run_cli("export", "s", "-o", str(tmp_path / "no-such-dir" / "x")), 2, "does not exist")
    one_line(run_cli("export", "s", "-o", str(tmp_path)), 2, "folder")
    missing_o = run_cli("export", "s")
    assert missing_o.code == 2 and "-o" in missing_o.err
    assert not out.exists()


def test_no_key_in_the_keyring_and_a_revoked_vault_are_key_errors(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("x")])
    out = tmp_path / "out.jsonl"
    saved = take_keys(vault.vault_id)
    before = raw_bytes(vault_db)
    one_line(run_cli("export", "s", "-o", str(out)), 4, "key")
    one_line(run_cli("export", "s", "-o", "-"), 4, "key")
    assert not out.exists() and raw_bytes(vault_db) == before
    give_keys(saved)
    assert run_cli("revoke", "--yes").code == 0
    one_line(run_cli("export", "--all", "-o", str(out)), 4, "revoked")
    assert not out.exists()


def test_expired_items_are_left_out_unless_asked_for(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    now = int(time.time())
    insert_sealed(vault_db, "s", [user("old news")], now - 7200)  # the TTL is 1 h
    insert_sealed(vault_db, "s", [user("fresh")], now)
    out = tmp_path / "a.jsonl"
    r = run_cli("export", "s", "-o", str(out))
    assert r.code == 0, r
    assert [(x["position"], x["item"]) for x in jsonl(out)] == [(2, user("fresh"))]
    assert "1 expired item left out" in r.out
    full = tmp_path / "b.jsonl"
    r = run_cli("--json", "export", "s", "--include-expired", "-o", str(full))
    assert r.code == 0, r
    assert [(x["item"], x["expired"]) for x in jsonl(full)] == [
        (user("old news"), True),
        (user("fresh"), False),
    ]
    assert (r.json()["expired_skipped"], r.json()["expired_included"]) == (0, 1)
    md = run_cli("export", "s", "--include-expired", "--format", "md", "-o", "-")
    assert "**1. user** · " in md.out and ", expired" in md.out


def test_unreadable_items_are_counted_never_written(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("one"), user("two SECRET-TWO"), user("three")])
    tamper(vault_db, "s", 1)
    out = tmp_path / "out.jsonl"
    # In a chained session an item that fails authentication is tampering: refused first,
    # before any file is made...
    r = run_cli("--json", "export", "s", "-o", str(out))
    assert r.code == 1 and "does not verify (unauthenticated)" in r.out, r
    assert not out.exists()
    # ...and with --include-tampered, exported marked, the item counted, never written.
    r = run_cli("--json", "export", "s", "-o", str(out), "--include-tampered")
    assert r.code == 1, r
    assert r.json()["unreadable"] == 1 and r.json()["items"] == 2
    assert "1 item of the exported sessions failed authentication" in r.err
    assert [(x["position"], x["item"], x["tampered"]) for x in jsonl(out)] == [
        (1, user("one"), "unauthenticated"),
        (3, user("three"), "unauthenticated"),
    ]
    assert "SECRET-TWO" not in out.read_text()


def test_a_failure_half_way_removes_the_new_file_and_keeps_the_old(
    vault: Any, vault_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_items(vault_db, "a", [user("a1"), user("a2")])
    add_items(vault_db, "b", [user("b1")])
    v = Vault.open(vault_db)
    real = v.opened_items

    def failing(session_id: str, *args: Any, **kwargs: Any) -> Any:
        if session_id == "b":
            raise OperationFailed("disk gone")
        return real(session_id, *args, **kwargs)

    monkeypatch.setattr(v, "opened_items", failing)
    new = tmp_path / "new.jsonl"
    with pytest.raises(OperationFailed):
        run_export(v, plan_export(v, [], True, new))
    assert not new.exists()
    old = tmp_path / "old.jsonl"
    previous = (
        '{"session_id": "a", "position": 1, "timestamp": null, "expired": false, "item": 1}\n'
    )
    old.write_text(previous)
    with pytest.raises(OperationFailed):
        run_export(v, plan_export(v, [], True, old, force=True))
    assert old.read_text() == previous
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".memvault-")) == []


def test_the_export_is_streamed_not_built_in_memory(
    vault: Any, vault_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first session alone is larger than a write chunk: its lines must be on
    # disk before the second session is even read.
    add_items(vault_db, "a", [user(f"{i} " + "z" * 2000) for i in range(60)])
    add_items(vault_db, "b", [user("last")])
    v = Vault.open(vault_db)
    real = v.opened_items
    out = tmp_path / "stream.jsonl"
    on_disk_before_b: list[int] = []

    def watching(session_id: str, *args: Any, **kwargs: Any) -> Any:
        if session_id == "b":
            on_disk_before_b.append(os.stat(out).st_size)
        return real(session_id, *args, **kwargs)

    monkeypatch.setattr(v, "opened_items", watching)
    result = run_export(v, plan_export(v, [], True, out))
    assert (result.items, result.sessions) == (61, ["a", "b"])
    assert on_disk_before_b and on_disk_before_b[0] >= 64 * 1024
    assert len(jsonl(out)) == 61


def test_the_cli_offers_exactly_the_formats_the_library_writes() -> None:
    from vault import export
    from vault.cli import data as cli_data

    assert cli_data.FORMATS == export.FORMATS
