"""Human output shows control characters escaped; --json and JSON Lines stay exact.

An item, a session id, a path or a value read from the file can hold what a
terminal acts on: ESC sequences (OSC 52 writes the clipboard, CSI clears the
screen), C1 controls, DEL, or a newline that would forge a row of a table.
Without --json every command prints them escaped (newline and tab survive only
inside item text); with --json, and in a JSON Lines export, they come back exact.

Hypothesis draws session ids, item texts and backup names from such characters
and runs every printing command in-process against a vault whose own folder name
is hostile too; a few real `python -m vault` subprocesses check the same bytes.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import add_items, assistant, run_cli, user
from vault.textsafe import escape_line, escape_text

# What a terminal acts on: C0, DEL, C1 (ESC is C0's 0x1b).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
CONTROL_IN_TEXT = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # newline and tab allowed
OSC52 = "\x1b]52;c;aGVsbG8=\x07"  # writes "hello" to the clipboard
CLEAR = "\x1b[2J\x1b[H"
PIECES = [
    "\x1b",
    OSC52,
    CLEAR,
    "\x9b2J",  # C1 CSI
    "\x9d0;title\x9c",  # C1 OSC, C1 ST
    "\n",
    "\r",
    "\t",
    "\x00",
    "\x07",
    "\x08",
    "\x7f",
    "\x85",
    "\u2028",
    "\u202e",
    "\nforged   9  0  -\n",  # what a forged row of `sessions` would look like
]
HOSTILE = st.lists(
    st.one_of(st.sampled_from(PIECES), st.text(st.characters(codec="utf-8"), max_size=3)),
    min_size=1,
    max_size=5,
).map("".join)
FOLDER = "vault \x1b[31mred\x1b[0m\n\x9b2J\x7f\tend"


def one_line_each(out: str) -> list[str]:
    """The lines of `out`: no control character in any, newline only between them."""
    assert out.endswith("\n") or out == "", repr(out)
    lines = out.split("\n")[:-1]
    for line in lines:
        assert not CONTROL.search(line), repr(line)
    return lines


def code_span(text: str) -> str:
    """CommonMark's code span of `text`: fenced by more backticks than any run in it,
    padded with a space when it starts or ends with one (an id may hold backticks)."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def safe_text(out: str) -> None:
    assert not CONTROL_IN_TEXT.search(out), repr(out)


class World:
    """A vault in a folder whose name holds control characters, and a counter for names."""

    def __init__(self, root: Path) -> None:
        from vault import Vault

        self.root = root
        self.db = root / FOLDER / "history.db"
        Vault.init(self.db, ttl=3600)
        self.serial = itertools.count()
        self.session_ids: list[str] = []

    def run(self, *args: str, input: str = "", db: Path | None = None) -> Any:
        from vault.cli import cli

        where = ["--db", str(db or self.db)]
        result = CliRunner().invoke(cli, [*where, *args], input=input, prog_name="memvault")
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise AssertionError(args) from result.exception
        return result


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    root = Path(tempfile.mkdtemp(prefix="memvault-escape-"))
    try:
        yield World(root)
    finally:
        from vault.engines.sqlite.vault import shred

        shred(root / FOLDER / "history.db")
        shutil.rmtree(root, ignore_errors=True)


def error_line(result: Any, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    (line,) = one_line_each(result.stderr)
    assert line.startswith("memvault: error: "), line
    return line


@pytest.mark.slow
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ids=st.lists(HOSTILE, min_size=1, max_size=2), texts=st.lists(HOSTILE, min_size=1, max_size=3)
)
@example(ids=["`"], texts=["\x1b"])  # a backtick in an id: a wider code span (seen in a run)
def test_every_printing_command_escapes_what_a_terminal_acts_on(
    world: World, ids: list[str], texts: list[str]
) -> None:
    n = next(world.serial)
    mark = f"mark{n}q"
    sids = [f"{sid}~{n}.{i}" for i, sid in enumerate(ids)]  # distinct, hostile from the start
    written = [
        user(f"{t}{mark}") if i % 2 == 0 else assistant(f"{t}{mark}") for i, t in enumerate(texts)
    ]
    for sid in sids:
        add_items(world.db, sid, written)
    world.session_ids += sids

    # sessions: one row per session, whatever the ids hold; each id shown escaped.
    rows = one_line_each(world.run("sessions").stdout)[1:-1]  # header and footnote
    assert len(rows) == len(world.session_ids), rows
    for sid in sids:
        assert sum(r.startswith(escape_line(sid) + " ") for r in rows) >= 1, (sid, rows)

    for sid in sids:
        # show: the item text keeps its newlines and tabs, nothing else; no extra line.
        out = world.run("show", "--", sid).stdout
        safe_text(out)
        expected = [
            f"#{i} {item['role']}: {escape_text(item['content'])}"
            for i, item in enumerate(written, 1)
        ]
        assert out == "".join(line + "\n" for line in expected)

        # the Markdown export to stdout: the same rule (it is read with `cat`).
        md = world.run("export", "--format", "md", "-o", "-", "--", sid)
        assert md.exit_code == 0, md.stderr
        safe_text(md.stdout)
        assert f"## Session {code_span(escape_line(sid))}" in md.stdout
        one_line_each(md.stderr)

    # search: one line per hit, the session id escaped.
    found = world.run("search", mark)
    hits = one_line_each(found.stdout)
    assert len(hits) == len(sids) * len(written), hits
    for sid in sids:
        assert sum(h.startswith(f"{escape_line(sid)} #") for h in hits) == len(written)

    # A backup to a hostile name; then status, verify, log and key list, which print
    # the vault's own (hostile) path and the backup's.
    name = ids[0].replace("/", "_").replace("\x00", "_")
    dest = world.root / f"backup {name}~{n}.db"
    printed = {}
    for args in (["backup", str(dest)], ["status"], ["verify"], ["log"], ["key", "list"]):
        result = world.run(*args)
        assert result.exit_code == 0, (args, result.stderr)
        printed[args[0]] = "\n".join(one_line_each(result.stdout))
        one_line_each(result.stderr)
    for command in ("backup", "status", "verify"):
        assert escape_line(str(world.db)) in printed[command] or command == "backup"
    for command in ("backup", "log", "key"):
        assert escape_line(str(dest)) in printed[command]

    # The questions name the vault's path and the session: answered no, on two lines.
    asked = world.run("revoke", input="n\n")
    question, _refusal = one_line_each(asked.stderr)
    assert asked.exit_code == 1 and escape_line(str(world.db)) in question
    asked = world.run("clear", "--", sids[0], input="n\n")
    assert asked.exit_code == 1 and len(one_line_each(asked.stderr)) == 2

    # Errors: one line, escaped, whatever the value they quote.
    error_line(world.run("show", "--", f"{sids[0]}~missing"), 1)
    missing = world.root / f"{name}~{n}" / "none.db"
    line = error_line(world.run("status", db=missing), 3)
    assert " ".join(escape_line(str(missing)).split()) in line  # runs of spaces folded
    error_line(world.run(f"nope{ids[0]}"), 2)  # no such command

    # --json: the exact characters.
    listed = json.loads(world.run("--json", "sessions").stdout)
    assert sorted(r["session_id"] for r in listed) == sorted(world.session_ids)
    for sid in sids:
        shown = json.loads(world.run("--json", "show", "--", sid).stdout)
        assert shown["session_id"] == sid and shown["items"] == written
        # Lines end at "\n" only: NEL (\x85) and U+2028 stay raw inside JSON strings.
        lines = world.run("export", "-o", "-", "--", sid).stdout.split("\n")[:-1]
        assert [json.loads(line)["item"] for line in lines] == written
        assert {json.loads(line)["session_id"] for line in lines} == {sid}


# --------------------------------------------------------------------------
# The real command, in subprocesses
# --------------------------------------------------------------------------
def test_a_newline_in_a_session_id_cannot_forge_a_row(vault: Any, vault_db: Path) -> None:
    forger = "real\nforged-session                  7        0  2026-01-01T00:00:00Z"
    add_items(vault_db, forger, [user("x")])
    r = run_cli("sessions")
    assert r.code == 0, r
    header, row, footnote = one_line_each(r.out)
    assert row.startswith("real\\nforged-session "), row
    assert [s["session_id"] for s in run_cli("--json", "sessions").json()] == [forger]


def test_show_never_replays_an_items_escape_sequences(vault: Any, vault_db: Path) -> None:
    text = f"copy this{OSC52}{CLEAR}\x9b2J\x7f\tcolumn\nline two\r"
    add_items(vault_db, "s", [user(text)])
    r = run_cli("show", "s")
    assert r.code == 0, r
    assert r.out == (
        "#1 user: copy this\\x1b]52;c;aGVsbG8=\\x07\\x1b[2J\\x1b[H\\x9b2J\\x7f\tcolumn\n"
        "line two\\r\n"
    )
    assert run_cli("--json", "show", "s").json()["items"] == [user(text)]


def test_search_prints_the_session_id_escaped(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, f"s{CLEAR}x", [user("the needle")])
    r = run_cli("search", "needle")
    assert r.code == 0, r
    assert r.out == "s\\x1b[2J\\x1b[Hx #1 user: the needle\n"


def test_pop_and_clear_name_the_session_escaped(vault: Any, vault_db: Path) -> None:
    sid = f"s{CLEAR}\nx"
    add_items(vault_db, sid, [user("one"), assistant("two")])
    r = run_cli("pop", "--", sid)
    assert r.code == 0 and one_line_each(r.out) == ["removed 1 item from s\\x1b[2J\\x1b[H\\nx"], r
    r = run_cli("clear", "--yes", "--", sid)
    assert r.code == 0 and one_line_each(r.out)[0].startswith("cleared s\\x1b[2J\\x1b[H\\nx: "), r


def test_rotate_key_list_and_forget_show_a_backups_path_escaped(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "s", [user("hello")])
    dest = tmp_path / f"b{OSC52}\n{CLEAR}.db"
    shown = "b\\x1b]52;c;aGVsbG8=\\x07\\n\\x1b[2J\\x1b[H.db"
    assert run_cli("backup", str(dest)).code == 0
    old_kid = run_cli("--json", "status").json()["kid"]
    for args in (["rotate", "--yes"], ["key", "list"], ["key", "forget", old_kid, "--yes"]):
        r = run_cli(*args)
        assert r.code == 0, (args, r)
        assert sum(shown in line for line in one_line_each(r.out) + one_line_each(r.err)) >= 1, r


def test_error_lines_show_the_values_they_quote_escaped(tmp_path: Path) -> None:
    missing = tmp_path / f"a{OSC52}\nb" / "history.db"
    r = run_cli("--db", str(missing), "status")
    assert r.code == 3, r
    (line,) = one_line_each(r.err)
    assert "a\\x1b]52;c;aGVsbG8=\\x07\\nb" in line, line
    r = run_cli(f"{CLEAR}nope")
    assert r.code == 2, r
    (line,) = one_line_each(r.err)
    assert "No such command '\\x1b[2J\\x1b[Hnope'" in line, line


def test_a_markdown_export_is_escaped_and_a_json_lines_one_exact(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    text = f"{OSC52}hi\x85\tthere\nnext"
    add_items(vault_db, f"s{CLEAR}", [assistant(text)])
    md, jsonl = tmp_path / "out.md", tmp_path / "out.jsonl"
    assert run_cli("export", "--all", "--format", "md", "-o", str(md)).code == 0
    doc = md.read_text(encoding="utf-8")
    safe_text(doc)
    assert "## Session `s\\x1b[2J\\x1b[H`" in doc
    assert "> \\x1b]52;c;aGVsbG8=\\x07hi\\x85\tthere\n> next\n" in doc
    assert run_cli("export", "--all", "-o", str(jsonl)).code == 0
    (record,) = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").split("\n")[:-1]]
    assert (record["session_id"], record["item"]) == (f"s{CLEAR}", assistant(text))


def hostile_model() -> Any:
    """A model (loaded by the chat subprocess) whose replies carry escape sequences."""
    from agents.testing import ModelStep, ScriptedModel, assistant_message

    return ScriptedModel(
        [ModelStep.respond(lambda _call: [assistant_message(f"ok{OSC52}{CLEAR}\tdone")])] * 3
    )


def test_chat_prints_the_models_escape_sequences_escaped(vault: Any) -> None:
    r = run_cli(
        "chat",
        f"c{CLEAR}",
        input="hello\n",
        env={"MEMVAULT_CHAT_TEST_MODEL": f"{__name__}:hostile_model"},
    )
    assert r.code == 0, r
    safe_text(r.out)
    assert "ok\\x1b]52;c;aGVsbG8=\\x07\\x1b[2J\\x1b[H\tdone" in r.out
    assert "session c\\x1b[2J\\x1b[H" in r.out


# --------------------------------------------------------------------------
# The helper itself
# --------------------------------------------------------------------------
@given(st.lists(st.one_of(st.sampled_from(PIECES), st.characters(codec="utf-8"))).map("".join))
def test_escaping_leaves_nothing_a_terminal_acts_on_and_ordinary_text_alone(text: str) -> None:
    line, body = escape_line(text), escape_text(text)
    assert not CONTROL.search(line) and "\u2028" not in line and "\u202e" not in line
    assert not CONTROL_IN_TEXT.search(body)
    assert escape_line(line) == line and escape_text(body) == body  # never escaped twice
    if not CONTROL.search(text) and not re.search("[\u2028\u202e]", text):
        assert line == body == text


@pytest.mark.parametrize("char", [chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]])
def test_an_escaped_character_reads_as_pythons_repr_writes_it(char: str) -> None:
    assert escape_line(char) == repr(char)[1:-1]
    assert escape_text(char) == (char if char in "\n\t" else repr(char)[1:-1])
