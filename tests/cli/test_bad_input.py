"""Bad input at the edges: the documented exit code, one line, nothing changed.

Empty or undecodable paths and session ids, an unusable lock timeout, counts too
large for SQLite, source files that are not UTF-8, and recovery kits that ask scrypt
for more than memvault ever uses.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    CLIResult,
    add_items,
    assistant,
    key_entry,
    raw_bytes,
    run_cli,
    user,
)

NOT_UTF8 = "\udcff"  # how Python hands over the byte 0xff from the command line


def one_line(r: CLIResult, code: int, *needles: str) -> None:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("memvault: error: ")
    assert "Traceback" not in r.err and "unexpected error" not in r.err, r.err
    for n in needles:
        assert n in r.err, (n, r.err)


def untouched(vault: Any, db: Path, before: bytes) -> None:
    assert raw_bytes(db) == before
    assert vault.sealer(refresh=True)  # the key is still in the keyring


# --------------------------------------------------------------------------
# --db "" and MEMVAULT_DB=""
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ("--db", "", "shred", "--yes"),
        ("shred", "--yes", "--db", ""),
        ("--db=", "revoke", "--yes"),
        ("--db", "", "status"),
        ("--db", "", "init"),
    ],
)
@pytest.mark.sweep
def test_an_empty_db_path_is_a_usage_error(
    vault: Any, vault_db: Path, args: tuple[str, ...]
) -> None:
    add_items(vault_db, "s", [user("keep me")])
    before = raw_bytes(vault_db)
    r = run_cli(*args)  # MEMVAULT_DB names the vault: an empty --db must not fall back to it
    one_line(r, 2, "the vault path is empty")
    untouched(vault, vault_db, before)


def test_an_empty_memvault_db_counts_as_unset(tmp_path: Path) -> None:
    env = {"MEMVAULT_DB": "", "XDG_DATA_HOME": str(tmp_path / "xdg")}
    r = run_cli("--json", "status", env=env)
    one_line(r, 3, str(tmp_path / "xdg" / "memvault" / "history.db"))


def test_a_db_path_that_is_not_utf8(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    r = run_cli("--db", str(tmp_path / f"a{NOT_UTF8}.db"), "init")
    one_line(r, 2, "is not valid UTF-8")
    r = run_cli("status", env={"MEMVAULT_DB": str(tmp_path / f"b{NOT_UTF8}.db")})
    one_line(r, 2, "is not valid UTF-8")
    assert [p.name for p in tmp_path.iterdir()] == [vault_db.parent.name]


# --------------------------------------------------------------------------
# MEMVAULT_LOCK_TIMEOUT
# --------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["abc", "inf", "-inf", "nan", "1e308", "-5", "864001"])
@pytest.mark.sweep
def test_an_unusable_lock_timeout_is_a_usage_error(vault: Any, vault_db: Path, value: str) -> None:
    add_items(vault_db, "s", [user("keep me")])
    kid = vault.sealer().kid
    before = raw_bytes(vault_db)
    for args in (("status",), ("rotate",), ("pop", "s")):
        r = run_cli(*args, env={"MEMVAULT_LOCK_TIMEOUT": value})
        one_line(r, 2, "MEMVAULT_LOCK_TIMEOUT", "nothing was changed")
    untouched(vault, vault_db, before)
    assert vault.sealer(refresh=True).kid == kid


def test_a_usable_lock_timeout_still_works(vault: Any) -> None:
    for value in ("0", "2.5", "", "86400"):
        assert run_cli("status", env={"MEMVAULT_LOCK_TIMEOUT": value}).code == 0, value


# --------------------------------------------------------------------------
# Counts beyond SQLite's 64-bit integers
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ("pop", "s", "-n", "100000000000000000000000000"),
        ("pop", "s", "-n", str(2**63)),
        ("show", "s", "--limit", "100000000000000000000000000"),
        ("show", "s", "--limit", str(2**63)),
    ],
)
@pytest.mark.sweep
def test_a_huge_count_is_a_usage_error(vault: Any, vault_db: Path, args: tuple[str, ...]) -> None:
    add_items(vault_db, "s", [user("one"), assistant("two")])
    before = raw_bytes(vault_db)
    one_line(run_cli(*args), 2, "is not in the range")
    untouched(vault, vault_db, before)


def test_the_largest_count_sqlite_takes_still_works(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "s", [user("one"), assistant("two")])
    r = run_cli("show", "s", "--limit", str(2**63 - 1))
    assert r.code == 0 and "#2 assistant: two" in r.out, r


# --------------------------------------------------------------------------
# Session ids that are not text
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ("show", f"s{NOT_UTF8}"),
        ("pop", f"s{NOT_UTF8}"),
        ("clear", f"s{NOT_UTF8}", "--yes"),
        ("chat", NOT_UTF8),
    ],
)
@pytest.mark.sweep
def test_a_session_id_that_is_not_utf8(vault: Any, vault_db: Path, args: tuple[str, ...]) -> None:
    add_items(vault_db, "s", [user("keep me")])
    before = raw_bytes(vault_db)
    one_line(run_cli(*args), 2, "the session id is not valid UTF-8")
    untouched(vault, vault_db, before)


def _plain_source(path: Path, sessions: dict[str, list[Any]]) -> None:
    from tests.files.test_import import make_plain

    make_plain(path, sessions)


def test_import_of_a_session_id_that_is_not_utf8(vault: Any, tmp_path: Path) -> None:
    src = tmp_path / "plain.db"
    _plain_source(src, {"a": [user("x")]})
    one_line(
        run_cli("import", str(src), "--session", NOT_UTF8), 2, "the session id is not valid UTF-8"
    )
    one_line(run_cli("import", str(tmp_path / f"p{NOT_UTF8}.db")), 2, "is not valid UTF-8")
    assert vault.session_ids() == []


# --------------------------------------------------------------------------
# Import: text that is not UTF-8, lone surrogates
# --------------------------------------------------------------------------
def _corrupt(src: Path, sql: str) -> None:
    conn = sqlite3.connect(src)
    with conn:
        conn.execute(sql)
    conn.close()


@pytest.mark.parametrize(
    ("sql", "needle"),
    [
        # Invalid UTF-8 inside an item (a stray 0xff).
        (
            "UPDATE agent_messages SET message_data = CAST(X'7B22726F6C65223A2275736572222C22636F6E"
            "74656E74223A2278FF227D' AS TEXT) WHERE id = (SELECT max(id) FROM agent_messages "
            "WHERE session_id = 'b')",
            "an item of session 'b'",
        ),
        # A session id whose bytes are a UTF-8-encoded surrogate (CESU): not UTF-8.
        (
            "UPDATE agent_sessions SET session_id = CAST(X'62EDA080' AS TEXT) "
            "WHERE session_id = 'b'",
            "a session id",
        ),
        (
            "UPDATE agent_messages SET session_id = CAST(X'62FF' AS TEXT) WHERE session_id = 'b'",
            "a session id",
        ),
        # Valid JSON whose escape is a lone surrogate.
        (
            'UPDATE agent_messages SET message_data = \'{"role": "user", "content": '
            '"x\\ud800y"}\' WHERE id = '
            "(SELECT max(id) FROM agent_messages WHERE session_id = 'b')",
            "lone surrogate",
        ),
    ],
)
def test_import_refuses_text_that_is_not_unicode(
    vault: Any, vault_db: Path, tmp_path: Path, sql: str, needle: str
) -> None:
    src = tmp_path / "plain.db"
    _plain_source(src, {"a": [user("first"), assistant("ok")], "b": [user("second")]})
    _corrupt(src, sql)
    before = raw_bytes(vault_db)
    r = run_cli("import", str(src))
    one_line(r, 1, needle, "nothing was imported")
    assert vault.session_ids() == []  # not even the good session "a"
    assert raw_bytes(vault_db) == before


# --------------------------------------------------------------------------
# Recovery kits that ask for too much memory or work
# --------------------------------------------------------------------------
def _kit_with(tmp_path: Path, n: int, r: int, p: int) -> Path:
    """A real kit of this vault (its true ids) with other scrypt parameters."""
    kit = tmp_path / "kit.json"
    if not kit.exists():
        res = run_cli(
            "key", "export", "--passphrase-stdin", str(kit), input="correct horse battery staple\n"
        )
        assert res.code == 0, res
    doc = json.loads(kit.read_text())
    doc["kdf"].update(n=n, r=r, p=p)
    out = tmp_path / f"kit-{n}-{r}-{p}.json"
    out.write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize(
    ("n", "r", "p"),
    [
        (2**20, 32, 16),  # 4 GiB and minutes before this bound: the reported attack
        (2**20, 8, 1),  # 1 GiB of memory
        (2**18, 16, 1),  # 512 MiB
        (2**16, 8, 16),  # 64 MiB, but p=16 stacks the work (8 times ours)
        (2**17, 8, 8),  # 8 times the work of our own kits
    ],
)
@pytest.mark.sweep
def test_key_import_refuses_a_costly_kit_before_deriving(
    vault: Any, tmp_path: Path, n: int, r: int, p: int
) -> None:
    kit = _kit_with(tmp_path, n, r, p)
    assert vault.keystore.delete(key_entry(vault))
    started = time.monotonic()
    res = run_cli(
        "key", "import", "--passphrase-stdin", str(kit), input="wrong passphrase\n", timeout=60
    )
    one_line(res, 1, "asks scrypt for", "memvault never writes such a kit", "nothing was changed")
    assert time.monotonic() - started < 60
    assert vault.keystore.get(key_entry(vault)) is None


def test_kdf_bounds_admit_our_own_kits() -> None:
    from vault import kit

    memory, work = kit.kdf_cost(kit.SCRYPT_N, kit.SCRYPT_R, kit.SCRYPT_P)
    assert memory <= kit.MAX_KDF_MEMORY and work <= kit.MAX_KDF_WORK
    assert memory > 128 * 2**20 - 1  # 128 MiB, as documented
    kit.check_kdf_cost(2**17, 8, 4, Path("k"))  # four times ours: still "a few seconds"
    with pytest.raises(kit.OperationFailed):
        kit.check_kdf_cost(2**19, 8, 1, Path("k"))


# --------------------------------------------------------------------------
# A FIFO where a file is expected: refused at once, never a process blocked for ever
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("--db", "{fifo}", "status"), 3, "is a FIFO (named pipe), not a vault file"),
        (("--db", "{fifo}", "init"), 3, "is a FIFO (named pipe), not a vault file"),
        (
            ("key", "import", "--passphrase-stdin", "{fifo}"),
            2,
            "is a FIFO (named pipe); give the path of the recovery",
        ),
        (("import", "{fifo}"), 2, "is a FIFO (named pipe); give the path of a SQLiteSession"),
    ],
)
def test_a_fifo_is_refused_without_blocking(
    vault: Any, tmp_path: Path, args: tuple[str, ...], code: int, needle: str
) -> None:
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run_cli(*(a.format(fifo=fifo) for a in args), timeout=60)
    one_line(r, code, needle)
    assert vault.session_ids() == []
