"""The fast paths of 0.2's performance work read and write exactly what the slow ones do.

- `crypto.split_envelope` answers only where `parse_envelope` (json.loads) agrees;
- `crypto.rotate_row_stamped` makes what `MultiFernet([new, old]).rotate` makes: the
  same plaintext, the same timestamp, a row the SDK's format accepts;
- `schema.ITEM_TIME`, the SQL that reads a token's timestamp for `status`, agrees
  with Fernet's own timestamp, and so does the window `schema.ITEM_WINDOW` indexes;
- `status` counts exactly the items whose timestamps are before the cut-off, on
  either side of it within one window and across windows;
- `purge` reads in batches and still deletes exactly the expired items.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import MultiFernet
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import insert_sealed, rows, user
from vault import crypto
from vault.engines.sqlite.schema import ITEM_TIME, ITEM_WINDOW, WINDOW_SECONDS, window_start

OLD = crypto.Sealer(crypto.generate_key())
NEW = crypto.Sealer(crypto.generate_key())


def as_parsed(message_data: str) -> tuple[str, str] | None:
    env = crypto.parse_envelope(message_data)
    return None if env is None else (env["kid"], env["payload"])


@settings(max_examples=200, deadline=None)
@given(kid=st.text(max_size=30), payload=st.text(max_size=60))
def test_split_envelope_never_disagrees_with_json(kid: str, payload: str) -> None:
    for row in (
        crypto.envelope_text(kid, payload),
        json.dumps({"__enc__": 1, "v": 1, "kid": kid, "payload": payload}),
        json.dumps({"__enc__": 1, "v": 1, "kid": kid, "payload": payload}, ensure_ascii=False),
    ):
        split = crypto.split_envelope(row)
        if split is not None:
            assert split == as_parsed(row), row


def test_split_envelope_reads_sealed_rows_and_leaves_the_rest_to_json() -> None:
    row = OLD.seal("s", user("hello"), 1_700_000_000)
    assert row == json.dumps(json.loads(row))  # seal writes json.dumps's own text
    assert crypto.split_envelope(row) == as_parsed(row)
    env = json.loads(row)
    reordered = json.dumps({k: env[k] for k in ("payload", "kid", "v", "__enc__")})
    assert crypto.split_envelope(reordered) is None
    assert crypto.payload_of(reordered) == env["payload"]
    # A control character json.loads refuses: not an envelope on either path.
    tampered = row.replace("gAAAAA", "gAAAAA\u0001", 1)
    assert crypto.parse_envelope(tampered) is None
    assert crypto.split_envelope(tampered) is None and crypto.payload_of(tampered) is None
    assert OLD.open("s", tampered, None).state is crypto.ItemState.UNREADABLE


# Named ids: a parameter's value as its id would differ between two collections (parallel
# workers must collect the same tests), since one of them is the current time.
@pytest.mark.parametrize(
    "ts",
    [0, 1, 1_700_000_000, int(time.time()), 2**36 - 1],
    ids=["zero", "one", "fixed", "now", "max"],
)
def test_rotated_row_matches_multifernet_rotate(ts: int) -> None:
    item = {"role": "user", "content": "naïve ünïcode " * 20}
    row = OLD.seal("s", item, ts)
    rotated, stamp = crypto.rotate_row_stamped(OLD, NEW, "s", row)  # type: ignore[misc]
    reference = MultiFernet([NEW.fernet("s"), OLD.fernet("s")]).rotate(
        json.loads(row)["payload"].encode()
    )
    env = json.loads(rotated)
    assert stamp == ts == NEW.fernet("s").extract_timestamp(env["payload"].encode())
    assert NEW.fernet("s").extract_timestamp(reference) == ts
    assert NEW.fernet("s").decrypt(env["payload"].encode()) == NEW.fernet("s").decrypt(reference)
    assert env == {"__enc__": 1, "v": 1, "kid": NEW.kid, "payload": env["payload"]}
    assert rotated == json.dumps(env)
    assert NEW.open("s", rotated, None).item == item


def test_rotation_keeps_other_envelope_layouts_and_refuses_foreign_rows() -> None:
    env = json.loads(OLD.seal("s", user("x"), 1_700_000_000))
    odd = json.dumps({k: env[k] for k in ("payload", "kid", "v", "__enc__")})
    rotated, _ = crypto.rotate_row_stamped(OLD, NEW, "s", odd)  # type: ignore[misc]
    assert list(json.loads(rotated)) == ["payload", "kid", "v", "__enc__"]
    assert NEW.open("s", rotated, None).item == user("x")
    assert crypto.rotate_row_stamped(NEW, OLD, "s", OLD.seal("s", user("x"))) is None
    assert crypto.rotate_row_stamped(OLD, NEW, "other", OLD.seal("s", user("x"))) is None
    assert crypto.rotate_row_stamped(OLD, NEW, "s", "{not json") is None


@settings(max_examples=100, deadline=None)
@given(ts=st.integers(min_value=0, max_value=2**36 - 1))
def test_item_time_sql_reads_the_token_timestamp(ts: int) -> None:
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        for row in (OLD.seal("s", {"n": 1}, ts), json.dumps(json.loads(OLD.seal("s", {}, ts)))):
            got = conn.execute(f"SELECT {ITEM_TIME} FROM (SELECT ? AS message_data)", (row,))
            assert got.fetchone()[0] == ts


@settings(max_examples=100, deadline=None)
@given(ts=st.integers(min_value=0, max_value=2**36 - 1))
def test_item_window_sql_names_the_window_of_the_token_timestamp(ts: int) -> None:
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        row = OLD.seal("s", {"n": 1}, ts)
        chars = conn.execute(f"SELECT {ITEM_WINDOW} FROM (SELECT ? AS message_data)", (row,))
        assert window_start(chars.fetchone()[0]) == ts - ts % WINDOW_SECONDS


def test_status_counts_exactly_the_items_before_the_cut_off(vault: Any, vault_db: Path) -> None:
    start = 1_800_000_000 - 1_800_000_000 % WINDOW_SECONDS
    cutoff = start + WINDOW_SECONDS - 100  # late in its window: the next one starts before now
    now = cutoff + 3600  # the vault's TTL is 1h
    times = [cutoff - 3 * WINDOW_SECONDS, cutoff - WINDOW_SECONDS, start, cutoff - 2, cutoff - 1]
    times += [cutoff, cutoff + 1, start + WINDOW_SECONDS, now]
    for i, at in enumerate(times):
        insert_sealed(vault_db, "s", [user(f"item {i}")] * (i + 1), at)
    want = sum(i + 1 for i, at in enumerate(times) if at < cutoff)
    (info,) = vault.sessions(now=now)
    assert (info.items, info.expired_unverified) == (sum(range(1, len(times) + 1)), want)
    items, expired, unreadable = vault.items("s", now=now)  # authenticated: the same count
    assert (expired, unreadable) == (want, 0)


def test_item_time_sql_is_null_for_rows_without_a_token() -> None:
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        for row in ("{not json", json.dumps(user("plain")), ""):
            got = conn.execute(f"SELECT {ITEM_TIME} FROM (SELECT ? AS message_data)", (row,))
            assert got.fetchone()[0] is None
            got = conn.execute(f"SELECT {ITEM_WINDOW} FROM (SELECT ? AS message_data)", (row,))
            assert window_start(got.fetchone()[0]) is None


def test_purge_across_batches_deletes_exactly_the_expired(vault: Any, vault_db: Path) -> None:
    now = int(time.time())
    # 2,500 items, more than two batches of 1,000, expired ones spread over all of them:
    # each of five sessions starts with its expired items (a purge takes a prefix).
    for chunk in range(5):
        fresh = [user(f"keep {chunk}-{i}") for i in range(400)]
        old = [user(f"old {chunk}-{i}") for i in range(100)]
        insert_sealed(vault_db, f"s{chunk}", old, now - 7200)  # ttl is 1h
        insert_sealed(vault_db, f"s{chunk}", fresh, now)
    report = vault.purge(now=now)
    assert report.counts == {"deleted": 500, "kept": 2000, "unreadable": 0}
    for chunk in range(5):
        left = [crypto.parse_envelope(r) for r in rows(vault_db, f"s{chunk}")]
        assert len(left) == 400
        items, expired, unreadable = vault.items(f"s{chunk}", now=now)
        assert (expired, unreadable) == (0, 0)
        assert all(i["content"].startswith("keep") for i in items) and len(items) == 400


def test_status_counts_a_forged_old_timestamp_as_expired_but_purge_keeps_it(
    vault: Any, vault_db: Path
) -> None:
    """The counts are unverified, as they say: a token whose timestamp was rewritten
    (its HMAC now fails) counts as expired in `status`; `purge`, which authenticates,
    does not delete it and counts it unreadable."""
    import base64

    from tests.conftest import run_cli

    now = int(time.time())
    insert_sealed(vault_db, "s", [user("real")], now)
    env = json.loads(rows(vault_db, "s")[0])
    raw = bytearray(base64.urlsafe_b64decode(env["payload"]))
    raw[1:9] = (now - 7 * 86400).to_bytes(8, "big")  # a week old: past the 1h TTL
    env["payload"] = base64.urlsafe_b64encode(bytes(raw)).decode()
    with contextlib.closing(sqlite3.connect(vault_db)) as conn, conn:
        conn.execute("UPDATE agent_messages SET message_data = ?", (json.dumps(env),))
    st = run_cli("--json", "status").json()
    assert (st["items"], st["expired_unverified"]) == (1, 1)
    [info] = vault.sessions()
    assert (info.items, info.expired_unverified) == (1, 1)
    assert vault.purge().counts == {"deleted": 0, "kept": 0, "unreadable": 1}
    assert len(rows(vault_db, "s")) == 1
