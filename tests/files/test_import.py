"""`memvault import`: plaintext SQLiteSession files (made by the real SDK) into the vault."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, add_items, assistant, raw_bytes, run_cli, run_on_terminal, user

MARK = "PLAINTEXT-MARK-7731"

CARNET = {
    "carnet-local": [
        user(f"{MARK} remember the code name NORD-42"),
        assistant("Noted: NORD-42."),
        user("and the café is « Le Zèbre » 🦓"),
        assistant("Noted the café."),
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": f"{MARK} tool output"},
    ],
    "autre-session": [user(f"{MARK} another session"), assistant("ok")],
}


def make_plain(
    path: Path,
    sessions: dict[str, list[Any]],
    sessions_table: str = "agent_sessions",
    messages_table: str = "agent_messages",
) -> None:
    """Write a plaintext file with the real SDK SQLiteSession (and close it)."""
    from agents import SQLiteSession

    async def go() -> None:
        for sid, items in sessions.items():
            s = SQLiteSession(
                sid, path, sessions_table=sessions_table, messages_table=messages_table
            )
            for item in items:  # one add per item: ids follow the order, as in a chat
                await s.add_items([item])
            s.close()

    asyncio.run(go())


def read_plain(
    path: Path,
    sid: str,
    sessions_table: str = "agent_sessions",
    messages_table: str = "agent_messages",
) -> list[Any]:
    from agents import SQLiteSession

    async def go() -> list[Any]:
        s = SQLiteSession(sid, path, sessions_table=sessions_table, messages_table=messages_table)
        try:
            return list(await s.get_items())
        finally:
            s.close()

    return asyncio.run(go())


def vault_items(db: Path, sid: str) -> list[Any]:
    from vault import Vault

    items, expired, unreadable = Vault.open(db).items(sid)
    assert (expired, unreadable) == (0, 0)
    return items


def sdk_items(db: Path, sid: str) -> list[Any]:
    """Read back through the real EncryptedSession (vault.open_session)."""
    import vault as vault_pkg

    async def go() -> list[Any]:
        s = vault_pkg.open_session(sid, db)
        try:
            return list(await s.get_items())
        finally:
            s.close()

    return asyncio.run(go())


def one_line_error(r: Any) -> str:
    assert r.err.count("\n") == 1, r
    assert r.err.startswith("memvault: error: "), r
    assert "Traceback" not in r.err
    return str(r.err)


def source_files(src: Path) -> list[Path]:
    return [src.with_name(src.name + s) for s in ("", "-wal", "-shm", "-journal")]


# --------------------------------------------------------------------------
def test_import_everything_keeps_order_and_counts(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    src = tmp_path / "carnet.db"
    make_plain(src, CARNET)
    before = src.read_bytes()

    r = run_cli("--json", "import", str(src))
    assert r.code == 0, r
    report = r.json()
    assert report["items"] == 8
    assert {s["session_id"]: s["items"] for s in report["sessions"]} == {
        "carnet-local": 6,
        "autre-session": 2,
    }
    assert report["tables"] == {"sessions": "agent_sessions", "messages": "agent_messages"}
    assert report["source_shredded"] is None

    for sid, items in CARNET.items():
        assert vault_items(vault_db, sid) == items  # same items, same order
        assert sdk_items(vault_db, sid) == items  # and the SDK's EncryptedSession agrees
    # Sealed with the vault's current key; no plaintext reached the vault's bytes.
    assert MARK.encode() not in raw_bytes(vault_db)
    assert "Zèbre".encode() not in raw_bytes(vault_db)
    kid = vault.meta()["kid"]
    with sqlite3.connect(vault_db) as conn:
        kids = {
            json.loads(d)["kid"] for (d,) in conn.execute("SELECT message_data FROM agent_messages")
        }
    assert kids == {kid}
    # The source is left as it was (without --shred-source).
    assert src.read_bytes() == before
    assert read_plain(src, "carnet-local") == CARNET["carnet-local"]
    # The audit trail records counts, never content.
    events = [e for e in vault.audit_log() if e["event"] == "import"]
    assert sorted(e["items"] for e in events) == [2, 6]
    assert all(e["kid"] == kid for e in events)
    assert MARK not in json.dumps(vault.audit_log())

    human = run_cli("log")
    assert human.code == 0 and "import" in human.out


def test_human_output_and_new_session_keeps_working(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    src = tmp_path / "carnet.db"
    make_plain(src, {"carnet-local": CARNET["carnet-local"]})
    r = run_cli("import", str(src))
    assert r.code == 0, r
    assert "imported 6 items in 1 session" in r.out
    assert "verified" in r.out
    # An agent keeps writing to the imported session through the vault.
    add_items(vault_db, "carnet-local", [user("after the import")])
    assert vault_items(vault_db, "carnet-local") == [
        *CARNET["carnet-local"],
        user("after the import"),
    ]


def test_custom_table_names_are_detected(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    src = tmp_path / "app.db"
    make_plain(src, CARNET, sessions_table="carnet_sessions", messages_table="carnet_messages")
    r = run_cli("--json", "import", str(src))
    assert r.code == 0, r
    assert r.json()["tables"] == {"sessions": "carnet_sessions", "messages": "carnet_messages"}
    for sid, items in CARNET.items():
        assert vault_items(vault_db, sid) == items


def test_several_table_pairs_need_naming(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    src = tmp_path / "app.db"
    make_plain(src, {"default-one": [user("in the default tables")]})
    make_plain(
        src,
        {"custom-one": [user("in the custom tables")]},
        sessions_table="my_sessions",
        messages_table="my_messages",
    )

    r = run_cli("import", str(src))
    assert r.code == 1, r
    err = one_line_error(r)
    assert "several" in err and "my_sessions/my_messages" in err
    assert vault.session_ids() == []

    r = run_cli(
        "import", str(src), "--sessions-table", "my_sessions", "--messages-table", "my_messages"
    )
    assert r.code == 0, r
    assert vault.session_ids() == ["custom-one"]
    assert vault_items(vault_db, "custom-one") == [user("in the custom tables")]

    # Naming one table is enough when the other is found through the foreign key.
    r = run_cli("import", str(src), "--messages-table", "agent_messages")
    assert r.code == 0, r
    assert vault.session_ids() == ["custom-one", "default-one"]

    r = run_cli("import", str(src), "--sessions-table", "nope", "--messages-table", "my_messages")
    assert r.code == 1 and "no table 'nope'" in one_line_error(r)


def test_one_session(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    src = tmp_path / "carnet.db"
    make_plain(src, CARNET)
    r = run_cli("import", str(src), "--session", "autre-session")
    assert r.code == 0, r
    assert vault.session_ids() == ["autre-session"]
    assert vault_items(vault_db, "autre-session") == CARNET["autre-session"]

    r = run_cli("import", str(src), "--session", "missing")
    assert r.code == 1, r
    err = one_line_error(r)
    assert "no session 'missing'" in err and "carnet-local" in err
    assert vault.session_ids() == ["autre-session"]


def test_refuses_a_session_already_in_the_vault(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "carnet-local", [user("the vault's own item")])
    src = tmp_path / "carnet.db"
    make_plain(src, CARNET)
    r = run_cli("import", str(src))
    assert r.code == 1, r
    err = one_line_error(r)
    assert "'carnet-local' already exists in the vault" in err
    assert "nothing was imported" in err
    # Nothing at all was imported, not even the session that did not clash.
    assert vault.session_ids() == ["carnet-local"]
    assert vault_items(vault_db, "carnet-local") == [user("the vault's own item")]
    # The other one can still be imported on its own.
    r = run_cli("import", str(src), "--session", "autre-session")
    assert r.code == 0, r


def test_refuses_what_is_not_a_plaintext_sqlitesession_file(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a database\n")
    r = run_cli("import", str(text))
    assert r.code == 1 and "not a SQLite database" in one_line_error(r)

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        conn.execute("INSERT INTO notes (body) VALUES ('x')")
    conn.close()
    r = run_cli("import", str(other))
    assert r.code == 1 and "not a SQLiteSession file" in one_line_error(r)

    r = run_cli("import", str(vault_db))
    assert r.code == 2 and "the vault's own file" in one_line_error(r)

    from vault import Vault
    from vault.engines.sqlite.vault import shred

    second = tmp_path / "second" / "vault.db"
    Vault.init(second)
    try:
        r = run_cli("import", str(second))
        assert r.code == 1 and "is a memvault vault" in one_line_error(r)
    finally:
        shred(second)

    # A file written by the bare SDK EncryptedSession holds envelopes, not plaintext.
    from agents import SQLiteSession
    from agents.extensions.memory import EncryptedSession
    from cryptography.fernet import Fernet

    enc_path = tmp_path / "encrypted.db"

    async def write_encrypted() -> None:
        s = EncryptedSession(
            session_id="enc",
            underlying_session=SQLiteSession("enc", enc_path),
            encryption_key=Fernet.generate_key().decode(),
            ttl=600,
        )
        await s.add_items([user("sealed by the SDK")])
        s.underlying_session.close()

    asyncio.run(write_encrypted())
    r = run_cli("import", str(enc_path))
    assert r.code == 1 and "encrypted envelopes" in one_line_error(r)

    # A row that is not JSON is named, and nothing is imported.
    bad = tmp_path / "bad.db"
    make_plain(bad, {"s": [user("one"), user("two")]})
    with sqlite3.connect(bad) as conn:
        conn.execute("UPDATE agent_messages SET message_data = 'not json' WHERE id = 2")
    conn.close()
    r = run_cli("import", str(bad))
    assert r.code == 1 and "row 2 of session 's'" in one_line_error(r)

    r = run_cli("import", str(tmp_path / "absent.db"))
    assert r.code == 2 and "no file at" in one_line_error(r)
    assert not (tmp_path / "absent.db").exists()

    assert vault.session_ids() == []
    assert vault.count_items() == 0


def test_refuses_rows_no_export_or_session_could_give_back(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    """NaN, Infinity and 1e999 (which Python reads as inf) are not RFC 8259 JSON, so an
    export could not write them; JSON nested deeper than the parser goes cannot be read
    back at all (it raised RecursionError). Each source is refused naming the row."""
    hostile = {
        "nan": '{"role": "user", "content": NaN}',
        "infinity": '{"role": "user", "content": [-Infinity]}',
        "1e999": '{"role": "user", "content": 1e999}',
        "deep": "[" * 5000 + "]" * 5000,
    }
    wrong = {}
    for name, data in hostile.items():
        src = tmp_path / f"{name}.db"
        make_plain(src, {"s": [user("one"), user("two")]})
        with sqlite3.connect(src) as conn:
            conn.execute("UPDATE agent_messages SET message_data = ? WHERE id = 2", (data,))
        conn.close()
        r = run_cli("import", str(src))
        if r.code != 1 or r.err.count("\n") != 1 or "row 2 of session 's'" not in r.err:
            wrong[name] = r
    assert wrong == {}
    assert vault.session_ids() == []
    assert vault.count_items() == 0


def test_a_row_with_a_number_too_long_to_read_is_refused_saying_so(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    # json.loads raises a plain ValueError for more digits than Python converts: the
    # refusal said the row held NaN or an infinite number.
    src = tmp_path / "long.db"
    make_plain(src, {"s": [user("one"), user("two")]})
    with sqlite3.connect(src) as conn:
        conn.execute(
            "UPDATE agent_messages SET message_data = ? WHERE id = 2", ("[" + "1" * 5000 + "]",)
        )
    conn.close()
    r = run_cli("import", str(src))
    assert r.code == 1, r
    err = one_line_error(r)
    assert "row 2 of session 's'" in err and "digits" in err and "NaN" not in err, err
    assert vault.count_items() == 0


@pytest.mark.slow
def test_a_killed_import_never_leaves_half_a_session(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    """SIGKILL after the first batch of a 1200-item session: that session is absent."""
    src = tmp_path / "big.db"
    big = [user(f"{MARK} item {i}") if i % 2 == 0 else assistant(f"reply {i}") for i in range(1200)]
    make_plain(src, {"a-small": [user("small one")]})
    conn = sqlite3.connect(src)  # faster than 1200 SDK calls, same rows the SDK writes
    with conn:
        conn.execute("INSERT INTO agent_sessions (session_id) VALUES ('b-big')")
        conn.executemany(
            "INSERT INTO agent_messages (session_id, message_data) VALUES (?, ?)",
            [("b-big", json.dumps(i)) for i in big],
        )
    conn.close()
    assert read_plain(src, "b-big") == big

    r = run_cli("import", str(src), env={"MEMVAULT_FAILPOINT": "import-in-transaction"})
    assert r.code == -9, r  # killed inside the first session's transaction
    assert vault.session_ids() == []
    assert vault.count_items() == 0

    r = run_cli("import", str(src), "--session", "a-small")
    assert r.code == 0, r
    r = run_cli(
        "import",
        str(src),
        "--session",
        "b-big",
        env={"MEMVAULT_FAILPOINT": "import-in-transaction"},
    )
    assert r.code == -9, r
    assert vault.session_ids() == ["a-small"]  # nothing of b-big, not one row
    assert vault.count_items() == 1

    r = run_cli("--json", "import", str(src), "--session", "b-big")
    assert r.code == 0, r
    assert r.json()["items"] == 1200
    assert vault_items(vault_db, "b-big") == big


def _crashed_writer(path: Path, items: list[Any]) -> None:
    """A process that writes through SQLiteSession and dies without closing: -wal and
    -shm stay behind, the items only in the WAL, as after a crash."""
    code = (
        "import asyncio, json, os, sys\n"
        "from agents import SQLiteSession\n"
        "async def go():\n"
        "    s = SQLiteSession('crashed', sys.argv[1])\n"
        "    await s.add_items(json.loads(sys.argv[2]))\n"
        "    os._exit(0)\n"
        "asyncio.run(go())\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(path), json.dumps(items)],
        check=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.mark.slow
def test_shred_source_leaves_no_file_and_no_plaintext(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src" / "carnet.db"
    src.parent.mkdir()
    items = [user(f"{MARK} secret {i}") for i in range(5)]
    _crashed_writer(src, items)
    wal = src.with_name(src.name + "-wal")
    assert wal.exists() and MARK.encode() in wal.read_bytes()
    # Open descriptors keep the inodes reachable after unlink: they show what was left on
    # them (a hard link would be a second name, which the import refuses to write through).
    held = {p.name: os.open(p, os.O_RDONLY) for p in source_files(src) if p.exists()}

    def left(fd: int) -> bytes:
        return os.pread(fd, os.fstat(fd).st_size, 0)

    assert MARK.encode() in b"".join(left(fd) for fd in held.values())

    r = run_cli("--json", "import", str(src), "--shred-source", "--yes")
    assert r.code == 0, r
    report = r.json()
    assert report["items"] == 5
    shredded = report["source_shredded"]
    assert shredded["rows"] == 5
    assert {f["name"] for f in shredded["files"]} >= {"carnet.db", "carnet.db-wal"}

    assert [p for p in source_files(src) if p.exists()] == []
    assert list(src.parent.iterdir()) == []
    for name, fd in held.items():
        data = left(fd)
        os.close(fd)
        assert MARK.encode() not in data, name
        assert data.count(0) == len(data), f"{name} was not overwritten with zeros"
    assert vault_items(vault_db, "crashed") == items
    assert MARK.encode() not in raw_bytes(vault_db)
    shred_events = [e for e in vault.audit_log() if e["event"] == "source-shred"]
    assert len(shred_events) == 1 and shred_events[0]["rows"] == 5


def test_shred_source_refusals(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    src = tmp_path / "carnet.db"
    make_plain(src, CARNET)
    before = src.read_bytes()

    # No --yes and no answer: nothing imported, nothing destroyed.
    r = run_cli("import", str(src), "--shred-source", input="")
    assert r.code == 1, r
    assert "aborted" in r.err
    assert vault.session_ids() == [] and src.read_bytes() == before

    # --session while other sessions would be destroyed with the file.
    r = run_cli("import", str(src), "--session", "carnet-local", "--shred-source", "--yes")
    assert r.code == 1 and "other session" in one_line_error(r)
    assert vault.session_ids() == [] and src.read_bytes() == before

    # The source is still open in another process (an agent): busy, exit 5.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1]); c.execute('SELECT count(*) FROM agent_messages')\n"
            "print('open', flush=True); time.sleep(60)\n",
            str(src),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        r = run_cli("import", str(src), "--shred-source", "--yes")
        assert r.code == 5, r
        assert "in use by another process" in one_line_error(r)
    finally:
        holder.kill()
        holder.wait()
    assert vault.session_ids() == [] and src.exists()
    assert read_plain(src, "carnet-local") == CARNET["carnet-local"]

    # Tables the import does not carry over would be destroyed: refused.
    with sqlite3.connect(src) as conn:
        conn.execute("CREATE TABLE app_settings (k TEXT, v TEXT)")
    conn.close()
    r = run_cli("import", str(src), "--shred-source", "--yes")
    assert r.code == 1 and "app_settings" in one_line_error(r)
    assert vault.session_ids() == []
    assert read_plain(src, "autre-session") == CARNET["autre-session"]


def test_verification_failure_rolls_the_session_back(
    vault: Any, vault_db: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """If what the vault holds differs from the source, the session is rolled back.

    The only in-process test here: a sealer that silently alters one item stands in for
    a bug between reading and writing; the read-back inside the transaction catches it.
    """
    import pytest

    from vault import crypto
    from vault.errors import OperationFailed
    from vault.importer import Importer

    src = tmp_path / "carnet.db"
    make_plain(src, {"carnet-local": CARNET["carnet-local"]})
    real_seal = crypto.Sealer.seal

    def altering_seal(self: Any, session_id: str, item: Any, now: int | None = None) -> str:
        if isinstance(item, dict) and item.get("content") == "Noted: NORD-42.":
            item = {**item, "content": "Noted: NORD-43."}
        return real_seal(self, session_id, item, now)

    monkeypatch.setattr(crypto.Sealer, "seal", altering_seal)
    with Importer(vault, src) as importer, pytest.raises(OperationFailed) as info:
        importer.run()
    assert "verification of session 'carnet-local' failed" in info.value.message
    assert vault.session_ids() == []
    assert vault.count_items() == 0
    assert not [e for e in vault.audit_log() if e["event"] == "import"]


def test_progress_bar_on_a_terminal(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    src = tmp_path / "carnet.db"
    make_plain(src, CARNET)
    code, out = run_on_terminal(["import", str(src)], [])
    assert code == 0, out
    assert b"importing" in out and b"100%" in out
    assert vault_items(vault_db, "carnet-local") == CARNET["carnet-local"]


def test_help_has_an_example_and_import_does_not_load_the_sdk(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    r = run_cli("import", "--help")
    assert r.code == 0 and "Example" in r.out and "memvault import carnet.db" in r.out

    src = tmp_path / "carnet.db"
    make_plain(src, CARNET)
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['memvault', 'import', {str(src)!r}]\n"
        "try:\n    runpy.run_module('vault', run_name='__main__')\n"
        "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print(sorted(m for m in sys.modules if m == 'agents' or m.startswith('agents.')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert vault.session_ids() == ["autre-session", "carnet-local"]
