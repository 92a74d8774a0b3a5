"""The vault's own envelope code and the SDK's EncryptedSession agree, both ways; and
every SDK internal the agent session relies on (vault/engines/sqlite/session.py and
sqlitesession.py) is still there and still behaves."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keyring
import pytest
from agents import Agent, Runner, SQLiteSession
from agents.extensions.memory import EncryptedSession
from agents.testing import ScriptedModel, assistant_message
from cryptography.fernet import Fernet

import vault as vault_pkg
from tests.conftest import add_items, assistant, key_entry, rows, user
from vault import crypto, durations
from vault.errors import NotAVault


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
        ("3600s", 3600),
        ("never", None),
        (" 7D ", 604800),
    ],
)
def test_durations(text: str, seconds: int | None) -> None:
    assert durations.parse_duration(text) == seconds
    if seconds is not None:
        assert durations.parse_duration(durations.format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "abc", "5x", "-1", "0", "1.5h", "99999999d", "3600", "1"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        durations.parse_duration(text)


# -- The SDK internals the agent session's modules rely on -----------------------------
# Each one is listed in session.py's or sqlitesession.py's docstring; each has its shape checked
# here and its behaviour checked below, so an SDK release that renames or changes one
# fails this file before it can fail a user.

SDK_METHODS: dict[str, str] = {
    "SQLiteSession._configure_connection": "(conn)",
    "SQLiteSession._init_db_for_connection": "(self, conn)",
    "SQLiteSession._get_connection": "(self)",
    "SQLiteSession._check_not_closed": "(self)",
    "SQLiteSession._close_connections_from_exited_threads": "(self)",
    "SQLiteSession._pop_item_with_validation": "(self, validate=None)",
    "SQLiteSession._insert_items": "(self, conn, items)",
    "SQLiteSession._locked_connection": "(self)",
    "SQLiteSession._write_connection": "(self)",
    "SQLiteSession._get_compaction_snapshot": "(self, limit, *, prune_prefix=None)",
    "EncryptedSession._unwrap": "(self, item)",
    "EncryptedSession._get_compaction_snapshot": "(self, limit)",
    "EncryptedSession.get_items": "(self, limit=None, *, wrapper=None)",
    "EncryptedSession.add_items": "(self, items, *, wrapper=None)",
    "EncryptedSession.pop_item": "(self, *, wrapper=None)",
    "EncryptedSession.clear_session": "(self, *, wrapper=None)",
}
SDK_ATTRIBUTES: dict[str, type] = {
    "SQLiteSession._local": threading.local,
    "SQLiteSession._connections": set,
    "SQLiteSession._connection_owners": dict,
    "SQLiteSession._connections_lock": type(threading.Lock()),
    "EncryptedSession.cipher": Fernet,
    "EncryptedSession._kid": str,
    "EncryptedSession.ttl": int,
}
# The public Session API and constructor arguments: documented, not internals. (The
# `wrapper` keyword of the overridden methods is listed above, under EncryptedSession.)
PUBLIC_NAMES = {
    "session_id",
    "underlying_session",
    "db_path",
    "session_settings",
    "get_items",
    "add_items",
    "pop_item",
    "clear_session",
    "close",
}


def _shape(fn: Any) -> str:
    """A signature without annotations, e.g. "(self, limit=None, *, wrapper=None)"."""
    sig = inspect.signature(fn)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def _sdk_class(name: str) -> type:
    return {"SQLiteSession": SQLiteSession, "EncryptedSession": EncryptedSession}[name]


def _bare_instances() -> dict[str, Any]:
    plain = SQLiteSession("probe")
    return {
        "SQLiteSession": plain,
        "EncryptedSession": EncryptedSession("probe", plain, crypto.generate_key(), ttl=60),
    }


def test_session_docstring_lists_exactly_the_internals_tested_here() -> None:
    from vault.engines.sqlite import session, sqlitesession

    docs = (session.__doc__ or "") + (sqlitesession.__doc__ or "")
    listed = set(re.findall(r"`((?:SQLiteSession|EncryptedSession)\.\w+)", docs))
    assert listed == set(SDK_METHODS) | set(SDK_ATTRIBUTES)


def test_every_sdk_name_the_session_code_touches_is_listed() -> None:
    """A new override or a new read of an SDK attribute must join the list (and get a test)."""
    from vault import readcache
    from vault.engines.sqlite import session, sqlitesession

    used = set()
    for module in (session, sqlitesession, readcache):  # CachedReads: a base of VaultSession
        source = inspect.getsource(module)
        code = source[source.index('"""', 3) + 3 :]  # the code, without the module docstring
        used |= set(re.findall(r"\.(\w+)\b", code))
    overridden = {
        name
        for cls in (sqlitesession.VaultSQLiteSession, session.VaultSession, readcache.CachedReads)
        for name, value in vars(cls).items()
        if inspect.isfunction(value) or isinstance(value, staticmethod)
    }
    listed = set(SDK_METHODS) | set(SDK_ATTRIBUTES)
    for cls_name, instance in _bare_instances().items():
        sdk = set(dir(_sdk_class(cls_name))) | set(vars(instance))
        for name in (used | overridden) & sdk:
            if name.startswith("__") or name in PUBLIC_NAMES:
                continue
            assert f"{cls_name}.{name}" in listed, f"{cls_name}.{name} is not listed"


@pytest.mark.parametrize("qualified", sorted(SDK_METHODS))
def test_sdk_method_keeps_its_signature(qualified: str) -> None:
    from vault.engines.sqlite import session, sqlitesession

    cls_name, name = qualified.split(".")
    sdk = _sdk_class(cls_name)
    assert _shape(getattr(sdk, name)) == SDK_METHODS[qualified]
    ours = sqlitesession.VaultSQLiteSession if sdk is SQLiteSession else session.VaultSession
    if name in vars(ours):  # an override takes what the SDK passes it
        assert _shape(getattr(ours, name)) == SDK_METHODS[qualified]
    if name == "_configure_connection":  # called on the class as well as on instances
        assert isinstance(inspect.getattr_static(sdk, name), staticmethod)
        assert isinstance(inspect.getattr_static(ours, name), staticmethod)


@pytest.mark.parametrize("qualified", sorted(SDK_ATTRIBUTES))
def test_sdk_attribute_keeps_its_type(qualified: str) -> None:
    cls_name, name = qualified.split(".")
    assert isinstance(getattr(_bare_instances()[cls_name], name), SDK_ATTRIBUTES[qualified])


def test_sdk_configures_each_connection_through_the_hook(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_configure_connection`: the vault's pragmas and the SDK's WAL, on every connection."""
    monkeypatch.setenv("MEMVAULT_LOCK_TIMEOUT", "7")
    s = vault_pkg.open_session("s", vault_db)
    conn = s.underlying_session._get_connection()
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 7000
    assert conn.execute("PRAGMA secure_delete").fetchone()[0] == 1
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s.close()


def test_sdk_creates_its_schema_only_through_the_hook(tmp_path: Path) -> None:
    """`_init_db_for_connection`: overriding it keeps the SDK from creating tables."""
    calls: list[sqlite3.Connection] = []

    class NoSchema(SQLiteSession):
        def _init_db_for_connection(self, conn: sqlite3.Connection) -> None:
            calls.append(conn)

    def tables(db: Path) -> set[str]:
        conn = sqlite3.connect(db)
        try:
            return {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        finally:
            conn.close()

    NoSchema("s", tmp_path / "probe.db").close()
    SQLiteSession("s", tmp_path / "plain.db").close()
    assert len(calls) == 1
    assert "agent_messages" not in tables(tmp_path / "probe.db")
    assert "agent_messages" in tables(tmp_path / "plain.db")


def test_sdk_reads_and_writes_through_get_connection(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    """`_get_connection`: our check runs before every read and write the SDK makes."""
    add_items(vault_db, "s", [user("x")])
    s = vault_pkg.open_session("s", vault_db)
    copy = tmp_path / "copy.db"
    shutil.copyfile(vault_db, copy)
    os.replace(copy, vault_db)  # same bytes, another file: the session must notice
    for call in (s.get_items, lambda: s.add_items([user("y")]), s.pop_item):
        with pytest.raises(NotAVault, match="replaced"):
            asyncio.run(call())
    s.close()


def test_sdk_refuses_a_closed_session(vault: Any, vault_db: Path) -> None:
    """`_check_not_closed`: a closed vault session fails as a closed SQLiteSession does."""
    s = vault_pkg.open_session("s", vault_db)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.underlying_session._check_not_closed()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(s.get_items())


def test_sdk_connection_registry_closes_what_our_get_connection_opened(
    vault: Any, vault_db: Path
) -> None:
    """`_local`, `_connections`, `_connection_owners`, `_connections_lock`,
    `_close_connections_from_exited_threads`: the SDK's close() and its cleanup of
    exited threads see the connections our `_get_connection` opens."""
    s = vault_pkg.open_session("s", vault_db)
    u = s.underlying_session
    opened: list[sqlite3.Connection] = []
    worker = threading.Thread(target=lambda: opened.append(u._get_connection()))
    worker.start()
    worker.join()
    (theirs,) = opened
    with u._connections_lock:
        assert theirs in u._connections and u._connection_owners[theirs] is worker
    mine = u._get_connection()  # opening one closes the exited thread's
    assert u._local.connection is mine and theirs not in u._connections
    with pytest.raises(sqlite3.ProgrammingError):
        theirs.execute("SELECT 1")
    s.close()
    with pytest.raises(sqlite3.ProgrammingError):
        mine.execute("SELECT 1")


def test_sdk_add_items_commits_as_the_last_step_of_its_write_block(tmp_path: Path) -> None:
    """VaultSQLiteSession passes the point an `add_items` wrote to the floor once the
    SDK's `_write_connection` block ends without raising: so that block must end with
    its COMMIT, as it does in the SDK's `add_items`."""
    ended: list[bool] = []

    class Probe(SQLiteSession):
        @contextlib.contextmanager
        def _write_connection(self) -> Iterator[sqlite3.Connection]:
            with super()._write_connection() as conn:
                yield conn
                ended.append(conn.in_transaction)

    probe = Probe("probe", tmp_path / "probe.db")
    try:
        asyncio.run(probe.add_items([{"role": "user", "content": "x"}]))
    finally:
        probe.close()
    assert ended == [False]  # the block ran, and no transaction was left open after it


def test_sdk_pop_authenticates_before_it_deletes(vault: Any, vault_db: Path) -> None:
    """`_pop_item_with_validation`: an item that fails authentication is not removed."""
    from cryptography.fernet import InvalidToken

    add_items(vault_db, "s", [user("kept")])
    forged = {
        "__enc__": 1,
        "v": 1,
        "kid": vault.sealer().kid,  # passes the triggers, fails the HMAC
        "payload": Fernet(Fernet.generate_key()).encrypt(b'{"role": "user"}').decode(),
    }
    conn = sqlite3.connect(vault_db)
    with conn:
        conn.execute(
            "INSERT INTO agent_messages (session_id, message_data, chain) VALUES (?, ?, 'x')",
            ("s", json.dumps(forged)),
        )
    conn.close()
    s = vault_pkg.open_session("s", vault_db)
    with pytest.raises(InvalidToken):
        asyncio.run(s.pop_item())
    assert len(rows(vault_db, "s")) == 2
    s.close()


def test_sdk_compaction_snapshot_is_none_for_our_sqlite_session(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    """`SQLiteSession._get_compaction_snapshot`: no raw-SQL replacement behind the vault."""
    add_items(vault_db, "s", [user("x")])
    s = vault_pkg.open_session("s", vault_db)
    plain = SQLiteSession("s", tmp_path / "plain.db")

    async def go() -> tuple[Any, Any]:
        await plain.add_items([user("x")])
        return (
            await s.underlying_session._get_compaction_snapshot(10),
            await plain._get_compaction_snapshot(10),
        )

    ours, theirs = asyncio.run(go())
    assert ours is None and theirs is not None and theirs.items == [user("x")]
    s.close()
    plain.close()


def test_sdk_seals_and_opens_with_cipher_and_kid() -> None:
    """`cipher` and `_kid`: what the session sets is what the SDK seals and opens with."""
    key = Fernet.generate_key()
    plain = SQLiteSession("s")
    s = EncryptedSession("s", plain, crypto.generate_key(), ttl=60)
    s.cipher = Fernet(key)
    s._kid = "mv1:0123456789abcdef"

    async def go() -> tuple[list[Any], list[Any], list[Any]]:
        await s.add_items([user("x")])
        stored = await plain.get_items()
        readable = await s.get_items()
        s.cipher = Fernet(Fernet.generate_key())
        return stored, readable, await s.get_items()

    stored, readable, with_another_key = asyncio.run(go())
    assert stored[0]["kid"] == "mv1:0123456789abcdef"
    assert json.loads(Fernet(key).decrypt(stored[0]["payload"])) == user("x")
    assert readable == [user("x")] and with_another_key == []


def test_sdk_opens_every_row_through_unwrap() -> None:
    """`_unwrap`: get_items and pop_item open each stored row through it."""
    seen: list[Any] = []

    class Probe(EncryptedSession):
        def _unwrap(self, item: Any) -> Any:
            seen.append(item["kid"])
            return {"opened": item["kid"]}

    s = Probe("s", SQLiteSession("s"), crypto.generate_key(), ttl=60)

    async def go() -> tuple[Any, Any]:
        await s.add_items([user("x"), user("y")])
        return await s.get_items(), await s.pop_item()

    items, popped = asyncio.run(go())
    assert items == [{"opened": "hkdf-v1"}] * 2 and popped == {"opened": "hkdf-v1"}
    assert len(seen) == 3


def test_sdk_compaction_snapshot_needs_a_number_for_ttl(vault_db: Path) -> None:
    """`EncryptedSession._get_compaction_snapshot` computes `now - ttl`: a vault that never
    expires (ttl None) needs our override, which still reads."""
    from vault import Vault

    Vault.init(vault_db, ttl=None)
    add_items(vault_db, "s", [user("x")])
    s = vault_pkg.open_session("s", vault_db)
    assert s.ttl is None
    with pytest.raises(TypeError):
        asyncio.run(EncryptedSession._get_compaction_snapshot(s, 10))
    assert asyncio.run(s._get_compaction_snapshot(10)) is None  # no snapshot: full replace
    assert s.ttl is None and asyncio.run(s.get_items()) == [user("x")]
    s.close()


def test_sdk_reads_ttl_on_every_call_and_none_means_never() -> None:
    """`ttl`: a changed TTL applies at the next read; None reads items of any age."""
    key = crypto.generate_key()
    plain = SQLiteSession("s")
    old = json.loads(crypto.Sealer(key).seal("s", user("old"), int(time.time()) - 7200))
    s = EncryptedSession("s", plain, key, ttl=3600)

    async def go() -> tuple[list[Any], list[Any]]:
        await plain.add_items([old])
        expired = await s.get_items()
        s.ttl = None  # type: ignore[assignment]
        return expired, await s.get_items()

    assert asyncio.run(go()) == ([], [user("old")])


def test_sdk_passes_the_run_context_as_wrapper(vault: Any, vault_db: Path) -> None:
    """The `wrapper` keyword: the Runner hands it to our overrides, which pass it on."""
    from agents import RunContextWrapper

    from vault import Vault
    from vault.engines.sqlite.session import VaultSession

    seen: list[Any] = []

    class Recording(VaultSession):
        async def get_items(self, limit: int | None = None, *, wrapper: Any = None) -> Any:
            seen.append(("get", wrapper))
            return await super().get_items(limit, wrapper=wrapper)

        async def add_items(self, items: list[Any], *, wrapper: Any = None) -> None:
            seen.append(("add", wrapper))
            await super().add_items(items, wrapper=wrapper)

    s = Recording(Vault.open(vault_db), "s")
    model = ScriptedModel([[assistant_message("hi")]])
    asyncio.run(Runner.run(Agent(name="t", model=model), "hello", session=s))
    assert {kind for kind, _ in seen} == {"get", "add"}
    assert all(isinstance(w, RunContextWrapper) for _, w in seen), seen
    assert asyncio.run(s.get_items())[0] == {"content": "hello", "role": "user"}
    s.close()


def test_sdk_add_items_inserts_through_insert_items_in_its_transaction(tmp_path: Path) -> None:
    """`_insert_items`: the SDK's add_items calls it with its connection inside the write
    transaction it then commits, so the links and the head commit with the rows."""
    seen: list[bool] = []

    class Probe(SQLiteSession):
        def _insert_items(self, conn: sqlite3.Connection, items: list[Any]) -> None:
            super()._insert_items(conn, items)
            seen.append(conn.in_transaction)

    s = Probe("s", tmp_path / "plain.db")
    asyncio.run(s.add_items([user("x"), user("y")]))
    assert seen == [True]
    assert len(asyncio.run(s.get_items())) == 2
    s.close()


def test_sdk_locked_connection_is_the_threads_connection(tmp_path: Path) -> None:
    """`_locked_connection`: yields `_get_connection()`'s connection, under the session's lock."""
    s = SQLiteSession("s", tmp_path / "plain.db")
    with s._locked_connection() as conn:
        assert conn is s._get_connection()
    s.close()
