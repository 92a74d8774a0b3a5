"""Nothing foreign enters the file: plaintext and other keys are refused by triggers."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from agents import SQLiteSession
from agents.extensions.memory import EncryptedSession
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import add_items, raw_bytes, rows, user
from vault import crypto
from vault.engines.sqlite import schema


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
        conn.execute(  # with a chain link, so that the envelope's clause is what refuses it
            "INSERT INTO agent_messages (session_id, message_data, chain) VALUES ('s', ?, 'x')",
            (data,),
        )
    with pytest.raises(sqlite3.IntegrityError), conn:
        conn.execute("UPDATE agent_messages SET message_data = ?", (data,))
    conn.close()
    assert len(rows(vault_db)) == 1 and json.loads(rows(vault_db)[0])["kid"] == vault.sealer().kid


# m008's clause (v2) against m003's (v1), on one in-memory database: a table guarded by each.
KID = "mv1:0123456789abcdef"
ENVELOPE_KEYS = ("__enc__", "v", "kid", "payload")


@pytest.fixture(scope="module")
def guards() -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.execute("CREATE TABLE memvault_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO memvault_meta VALUES ('kid', ?), ('other', 'x')", (KID,))
    message = schema.GUARD_MESSAGE.replace("'", "''")
    for table, clause in (("v1", schema._NOT_SEALED_V1), ("v2", schema._NOT_SEALED)):
        conn.execute(f"CREATE TABLE {table} (message_data TEXT)")
        conn.execute(
            f"CREATE TRIGGER {table}_guard BEFORE INSERT ON {table} WHEN {clause} "
            f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )
    yield conn
    conn.close()


def accepts(conn: sqlite3.Connection, table: str, data: str | None) -> bool:
    try:
        conn.execute(f"INSERT INTO {table} (message_data) VALUES (?)", (data,))
    except sqlite3.IntegrityError as exc:
        # Always the guard's own refusal: malformed JSON and NULL included.
        assert schema.GUARD_MESSAGE in str(exc), exc
        return False
    conn.execute(f"DELETE FROM {table}")
    return True


class Member(NamedTuple):
    label: str
    value: Any
    escaped: bool  # the label's first character written as a \\uXXXX escape


def object_text(members: list[Member]) -> str:
    # Written by hand: json.dumps cannot write a label twice or escape it needlessly.
    def label(m: Member) -> str:
        if m.escaped and m.label:
            return f'"\\u{ord(m.label[0]):04x}' + json.dumps(m.label[1:])[1:]
        return json.dumps(m.label)

    return "{" + ", ".join(f"{label(m)}: {json.dumps(m.value)}" for m in members) + "}"


def envelope_members() -> list[Member]:
    return [
        Member("__enc__", 1, False),
        Member("v", 1, False),
        Member("kid", KID, False),
        Member("payload", "gAAAAABn" + "x" * 20, False),
    ]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
    | st.sampled_from([1, 1.0, True, 2, "1", KID, "mv1:ffffffffffffffff", "gAAAAAx", "gAAAA"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from([*ENVELOPE_KEYS, "x"]), inner, max_size=3)
    ),
    max_leaves=6,
)
labels = st.sampled_from([*ENVELOPE_KEYS, "content", "__ENC__", "kid ", ""]) | st.text(max_size=6)


@st.composite
def objects(draw: st.DrawFn) -> list[Member]:
    """An envelope, then a few edits: a value changed, a member dropped, added,
    duplicated or renamed, a label escaped, the order shuffled."""
    members = envelope_members()
    for _ in range(draw(st.integers(0, 3))):
        edit = draw(st.sampled_from(["value", "drop", "add", "duplicate", "rename", "escape"]))
        if not members and edit != "add":
            continue
        i = draw(st.integers(0, max(len(members) - 1, 0)))
        if edit == "value":
            members[i] = members[i]._replace(value=draw(json_values))
        elif edit == "drop":
            del members[i]
        elif edit == "add":
            members.append(Member(draw(labels), draw(json_values), False))
        elif edit == "duplicate":
            value = draw(st.sampled_from([members[i].value]) | json_values)
            members.append(members[i]._replace(value=value))
        elif edit == "rename":
            members[i] = members[i]._replace(label=draw(labels))
        else:
            members[i] = members[i]._replace(escaped=True)
    return draw(st.permutations(members))


def sealed(members: list[Member]) -> bool:
    """What m008 admits, in Python: exactly the four members, each once, typed as the
    sealers write them (json.loads keeps the last of a label given twice, so a reader
    would see another envelope than a first-match check judged)."""
    found = [m.label for m in members]
    if sorted(found) != sorted(ENVELOPE_KEYS):
        return False
    env = {m.label: m.value for m in members}
    return (
        type(env["__enc__"]) is int
        and env["__enc__"] == 1
        and type(env["v"]) is int
        and env["kid"] == KID
        and isinstance(env["payload"], str)
        and env["payload"].startswith("gAAAAA")
    )


def judged_alike(members: list[Member]) -> bool:
    """Whether m003 and m008 must agree: everything but what m008 refuses on purpose
    (a duplicate label, __enc__ as true or 1.0, a fourth member that is not an integer
    v) and labels written with escapes, which SQLite 3.40's json_extract does not
    match but every JSON reader decodes (m008 judges the object they read)."""
    found = [m.label for m in members]
    env = {m.label: m.value for m in members}
    return not (
        len(set(found)) != len(found)
        or any(m.escaped for m in members)
        or type(env.get("__enc__")) in (bool, float)
        or ("v" in env and type(env["v"]) is not int)
        or (len(found) == 4 and "v" not in env)
    )


@settings(max_examples=600, deadline=None)
@given(members=objects())
def test_the_new_guard_admits_exactly_envelopes_and_agrees_with_m003s(
    guards: sqlite3.Connection, members: list[Member]
) -> None:
    data = object_text(members)
    new = accepts(guards, "v2", data)
    assert new == sealed(members), data
    if judged_alike(members):
        assert accepts(guards, "v1", data) == new, data
    elif new:
        # Never looser: only an escaped label can make m008 admit what m003 refused.
        assert accepts(guards, "v1", data) or any(m.escaped for m in members), data


not_objects = (
    st.none()
    | st.text(max_size=40)  # mostly invalid JSON
    | json_values.filter(lambda v: not isinstance(v, dict)).map(json.dumps)
    | st.lists(st.sampled_from(["__enc__", 1, "v", KID, "payload", "gAAAAAx"]), max_size=8).map(
        json.dumps
    )
    | st.builds(lambda n: object_text(envelope_members())[:n], st.integers(0, 80))
)


@settings(max_examples=300, deadline=None)
@given(data=not_objects)
def test_both_guards_refuse_anything_but_a_json_object(
    guards: sqlite3.Connection, data: str | None
) -> None:
    # A full envelope's text among the truncations is an object, and both admit it.
    whole = data == object_text(envelope_members())
    assert accepts(guards, "v1", data) is whole, data
    assert accepts(guards, "v2", data) is whole, data


ENC, V, KID_M, PAYLOAD = '"__enc__": 1', '"v": 1', f'"kid": "{KID}"', '"payload": "gAAAAAx"'


@pytest.mark.parametrize(
    "members",
    [
        # A label twice: m003's json_extract judged the first, json.loads keeps the last.
        [ENC, KID_M, PAYLOAD, '"payload": "plaintext"'],  # four members, as m003 counted
        [ENC, KID_M, PAYLOAD, '"p\\u0061yload": "plaintext"'],  # the same, escaped
        [ENC, KID_M, '"kid": "mv1:ffffffffffffffff"', PAYLOAD],
        # A fourth member that is not v: plaintext beside a sealed payload.
        [ENC, KID_M, PAYLOAD, '"content": "plaintext"'],
        [ENC, '"v": "plaintext"', KID_M, PAYLOAD],
        # __enc__ as sealers never write it (json_extract equated true and 1.0 with 1).
        ['"__enc__": true', V, KID_M, PAYLOAD],
        ['"__enc__": 1.0', V, KID_M, PAYLOAD],
    ],
    ids=[
        "payload-twice",
        "payload-twice-escaped",
        "kid-twice",
        "stray-fourth-member",
        "v-as-text",
        "enc-true",
        "enc-real",
    ],
)
def test_the_new_guard_refuses_what_m003s_let_in(
    guards: sqlite3.Connection, members: list[str]
) -> None:
    data = "{" + ", ".join(members) + "}"
    assert accepts(guards, "v1", data), data  # the hole m008 closes
    assert not accepts(guards, "v2", data), data
    # Control: the envelope as the sealers write it passes both.
    envelope = "{" + ", ".join([ENC, V, KID_M, PAYLOAD]) + "}"
    assert accepts(guards, "v1", envelope) and accepts(guards, "v2", envelope)


def test_an_escaped_label_is_judged_as_json_readers_decode_it(
    guards: sqlite3.Connection,
) -> None:
    # SQLite 3.40's json_extract matches labels by their raw text, so m003 refused an
    # envelope whose label was escaped; json_each decodes it, as json.loads does.
    data = "{" + ", ".join(['"__enc\\u005f_": 1', V, KID_M, PAYLOAD]) + "}"
    assert json.loads(data)["__enc__"] == 1
    assert accepts(guards, "v2", data)
    foreign = data.replace(KID, "mv1:ffffffffffffffff")
    assert not accepts(guards, "v2", foreign)


def parsed_members(text: str) -> list[Member] | None:
    """The top-level members of `text` as a strict JSON reader sees them, None when
    it is not a JSON object (json.loads refuses a NUL and whatever follows one)."""

    def refuse(constant: str) -> Any:
        raise ValueError(constant)  # NaN, Infinity: not JSON

    try:
        doc = json.loads(
            text, object_pairs_hook=lambda pairs: ("object", pairs), parse_constant=refuse
        )
    except ValueError:
        return None
    if not (isinstance(doc, tuple) and doc[0] == "object"):
        return None
    return [Member(label, value, False) for label, value in doc[1]]


HEAD = f'{{"__enc__": 1, "v": 1, "kid": "{KID}", "payload": "gAAAAA'
# What may stand where the token goes: base64 and the characters that break out of a
# JSON string or end the text (quote, backslash, NUL, braces, commas, escapes).
raw_tokens = st.lists(
    st.sampled_from(["A", "z", "9", "-", "_", "=", '"', "\\", "\x00", "}", "{", ",", ":", " "])
    | st.sampled_from(['", "x": "', '", "payload": "', "\\u0022", '\\"', "\\n", '"}', "\u00e9"])
    | st.text(max_size=3),
    max_size=8,
).map("".join)


@settings(max_examples=600, deadline=None)
@given(middle=raw_tokens, tail=st.sampled_from(['"}', '"} ', '"}\x00x', '"', "}", '"}}']))
def test_a_row_that_looks_sealed_is_admitted_only_when_it_is(
    guards: sqlite3.Connection, middle: str, tail: str
) -> None:
    """m008 admits a row in the sealers' layout without json_each: whatever stands in
    the token's place, it admits the row only if a JSON reader sees the envelope."""
    data = HEAD + middle + tail
    members = parsed_members(data)
    assert accepts(guards, "v2", data) == (members is not None and sealed(members)), data


def test_an_envelope_followed_by_a_nul_is_refused(guards: sqlite3.Connection) -> None:
    envelope = json.dumps({"__enc__": 1, "v": 1, "kid": KID, "payload": "gAAAAAx"})
    data = envelope + "\x00PLAINTEXT"
    assert accepts(guards, "v1", data)  # SQLite's JSON parser stops at the NUL
    assert not accepts(guards, "v2", data)
    assert accepts(guards, "v2", envelope)  # control


def test_sealed_rows_are_in_the_layout_the_guard_reads_without_json_each(
    vault: Any, vault_db: Path
) -> None:
    """The sealers' rows take m008's fast path: memvault's sessions (the SDK's
    EncryptedSession) and crypto.seal both write exactly its layout."""
    add_items(vault_db, "s", [user("through the SDK session")])
    sealer = vault.sealer()
    head = schema._SEALED_HEAD + sealer.kid + schema._SEALED_MID + "gAAAAA"
    written = [*rows(vault_db), sealer.seal("s", user("sealed directly"))]
    for data in written:
        assert data.startswith(head) and data.endswith(schema._SEALED_TAIL), data
        token = data[len(head) : -len(schema._SEALED_TAIL)]
        assert token and all(c.isalnum() or c in "-_=" for c in token), data
