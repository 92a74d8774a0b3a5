"""The history chain (vault.chain, vault.chaincheck): every single tampering of each
kind is named, no legitimate sequence of operations is ever called tampering.

Pure: real envelopes and real HMACs, no keyring, no file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.security.chainmodel import VAULT_ID, Session
from vault import chain, crypto
from vault.chaincheck import Row, Tamper, Verdict, check, check_tail

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 4)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("clear")),
    st.tuples(st.just("purge"), st.integers(1, 3)),
    st.tuples(st.just("rotate")),
)
HISTORY = st.lists(OPS, max_size=10)


def verdict(s: Session, rows: list[Row] | None = None, **kw: Any) -> Verdict:
    return check(s.keys, s.session_id, s.rows if rows is None else rows, s.head, **kw)


def session(ops: list[tuple[Any, ...]], at_least: int = 0) -> Session:
    s = Session.new()
    for op in ops:
        s.apply(op)
    if len(s.rows) < at_least:
        s.add(at_least - len(s.rows))
    return s


# --- no false alarm -----------------------------------------------------------------


@FAST
@given(HISTORY)
def test_every_legitimate_sequence_of_operations_checks_clean_after_each_step(
    ops: list[tuple[Any, ...]],
) -> None:
    s = Session.new()
    assert verdict(s).ok
    for op in ops:
        s.apply(op)
        assert verdict(s) == Verdict(), op
        assert verdict(s, anchor=s.head.anchor() if s.head else None).ok


@FAST
@given(HISTORY)
def test_links_and_heads_survive_their_own_encoding(ops: list[tuple[Any, ...]]) -> None:
    s = session(ops)
    for _, raw in s.rows:
        link = chain.Link.decode(raw)
        assert link is not None and link.encode() == raw
    if s.head is not None:
        assert chain.Head.decode(s.head.encode()) == s.head


def test_the_chain_is_deterministic() -> None:
    master = crypto.generate_key()
    key = chain.chain_key(master, VAULT_ID)
    assert chain.chain_key(master, VAULT_ID) == key
    head = chain.new_head(key, "s")
    texts = [crypto.Sealer(master).seal("s", {"n": i}) for i in range(3)]
    assert chain.extend(key, "s", head, texts) == chain.extend(key, "s", head, texts)


# --- every single tampering of each kind -------------------------------------------


@FAST
@given(HISTORY, st.data())
def test_any_swap_of_two_items_is_named_a_swap(ops: list[Any], data: st.DataObject) -> None:
    s = session(ops, at_least=2)
    i = data.draw(st.integers(0, len(s.rows) - 2))
    j = data.draw(st.integers(i + 1, len(s.rows) - 1))
    rows = list(s.rows)
    rows[i], rows[j] = rows[j], rows[i]
    assert verdict(s, rows) == Verdict(Tamper.SWAPPED, i)


@FAST
@given(HISTORY, st.data())
def test_any_duplicate_is_named_a_duplicate(ops: list[Any], data: st.DataObject) -> None:
    s = session(ops, at_least=1)
    rows = list(s.rows)
    copy = rows[data.draw(st.integers(0, len(rows) - 1))]
    rows.insert(data.draw(st.integers(0, len(rows))), copy)
    assert verdict(s, rows).kind is Tamper.DUPLICATED


@FAST
@given(HISTORY, st.integers(1, 3), st.integers(0, 4), st.data())
def test_an_item_put_back_after_pop_is_named_so(
    ops: list[Any], pops: int, adds: int, data: st.DataObject
) -> None:
    s = session(ops, at_least=pops)
    for _ in range(pops):
        s.pop()
    if adds:
        s.add(adds)
    rows = list(s.rows)
    back = data.draw(st.sampled_from(s.popped[-pops:]))
    how = data.draw(st.sampled_from(["insert", "replace"]))
    if how == "replace" and rows:
        rows[data.draw(st.integers(0, len(rows) - 1))] = back
    else:
        rows.insert(data.draw(st.integers(0, len(rows))), back)
    assert verdict(s, rows).kind is Tamper.REINSERTED_AFTER_POP


@FAST
@given(HISTORY, st.integers(0, 3), st.data())
def test_an_item_put_back_after_clear_is_named_so(
    ops: list[Any], adds: int, data: st.DataObject
) -> None:
    s = session(ops, at_least=1)
    s.clear()
    if adds:
        s.add(adds)
    rows = list(s.rows)
    back = data.draw(st.sampled_from(s.cleared))
    at = data.draw(st.integers(0, len(rows)))
    rows.insert(at, back)
    assert verdict(s, rows) == Verdict(Tamper.REINSERTED_AFTER_CLEAR, at)


@FAST
@given(HISTORY, st.integers(1, 3), st.data())
def test_an_item_put_back_after_a_ttl_purge_is_named_so(
    ops: list[Any], n: int, data: st.DataObject
) -> None:
    s = session(ops, at_least=n)
    s.purge(n)
    rows = list(s.rows)
    at = data.draw(st.integers(0, len(rows)))
    rows.insert(at, data.draw(st.sampled_from(s.purged[-n:])))
    assert verdict(s, rows) == Verdict(Tamper.REINSERTED_AFTER_PURGE, at)


@FAST
@given(HISTORY, st.data())
def test_any_item_deleted_from_the_middle_is_named_so(ops: list[Any], data: st.DataObject) -> None:
    s = session(ops, at_least=3)
    at = data.draw(st.integers(0, len(s.rows) - 2))
    rows = s.rows[:at] + s.rows[at + 1 :]
    assert verdict(s, rows) == Verdict(Tamper.DELETED, at)


@FAST
@given(HISTORY, st.data())
def test_any_cut_tail_is_named_so(ops: list[Any], data: st.DataObject) -> None:
    s = session(ops, at_least=1)
    keep = data.draw(st.integers(0, len(s.rows) - 1))
    assert verdict(s, s.rows[:keep]) == Verdict(Tamper.CUT_TAIL, keep)


@FAST
@given(HISTORY, HISTORY, st.data())
def test_an_item_moved_from_another_session_is_named_so(
    ops: list[Any], other_ops: list[Any], data: st.DataObject
) -> None:
    s = session(ops)
    other = Session("other", s.sealer, s.keys)
    for op in other_ops:
        if op[0] != "rotate":  # the vault's key is shared: rotate it from `s` only
            other.apply(op)
    if not other.rows:
        other.add(1)
    rows = list(s.rows)
    at = data.draw(st.integers(0, len(rows)))
    rows.insert(at, data.draw(st.sampled_from(other.rows)))
    assert verdict(s, rows) == Verdict(Tamper.MOVED, at)


@FAST
@given(HISTORY, st.lists(OPS, min_size=1, max_size=4), st.data())
def test_a_whole_session_put_back_from_an_older_copy_is_named_a_rollback(
    ops: list[Any], later: list[Any], data: st.DataObject
) -> None:
    s = session(ops, at_least=1)
    for op in later:
        s.apply(op)
    anchor = s.head.anchor() if s.head else None
    old_rows, old_head = data.draw(st.sampled_from(s.snapshots))
    assume(old_head is not None and anchor is not None and old_head.anchor() != anchor)
    assert check(s.keys, "s", old_rows, old_head, anchor) == Verdict(Tamper.ROLLED_BACK)


@FAST
@given(HISTORY, st.data())
def test_a_head_older_than_its_items_is_named_a_rollback(
    ops: list[Any], data: st.DataObject
) -> None:
    s = session(ops)
    old_head = s.head
    s.add(data.draw(st.integers(1, 3)))
    assume(old_head is not None)
    assert check(s.keys, "s", s.rows, old_head).kind in (
        Tamper.ROLLED_BACK,
        Tamper.REINSERTED_AFTER_POP,  # without an anchor, new items look like popped ones
    )
    assert check(s.keys, "s", s.rows, old_head, s.head.anchor() if s.head else None) == Verdict(
        Tamper.ROLLED_BACK
    )


@FAST
@given(HISTORY, st.data())
def test_any_changed_byte_of_a_row_makes_it_unauthenticated(
    ops: list[Any], data: st.DataObject
) -> None:
    s = session(ops, at_least=1)
    at = data.draw(st.integers(0, len(s.rows) - 1))
    text, raw = s.rows[at]
    assert raw is not None
    which = data.draw(st.sampled_from(["text", "link"]))
    target = text if which == "text" else raw
    k = data.draw(st.integers(0, len(target) - 1))
    ch = data.draw(st.sampled_from("A0g_-.:\"'"))
    assume(target[k] != ch)
    changed = target[:k] + ch + target[k + 1 :]
    rows = list(s.rows)
    rows[at] = (changed, raw) if which == "text" else (text, changed)
    assert verdict(s, rows) == Verdict(Tamper.UNAUTHENTICATED, at)


@FAST
@given(HISTORY, st.sampled_from(["vault", "session", "key"]))
def test_a_key_of_another_vault_or_session_never_verifies(ops: list[Any], which: str) -> None:
    s = session(ops, at_least=1)
    if which == "session":
        assert check(s.keys, "t", s.rows, s.head) == Verdict(Tamper.UNAUTHENTICATED)
        return
    if which == "vault":
        # This vault's own master key, derived for another vault id.
        keys = {kid: chain.chain_key(s.sealer.master_key, "f" * 32) for kid in s.keys}
    else:
        other = chain.chain_key(crypto.generate_key(), VAULT_ID)
        keys = {kid: dataclasses.replace(other, kid=kid) for kid in s.keys}
    assert check(keys, "s", s.rows, s.head) == Verdict(Tamper.UNAUTHENTICATED)
    # Even with the head taken on trust, no row authenticates.
    assert all(check(keys, "s", [r], s.head).kind is not None for r in s.rows)


# --- a named example of each kind ---------------------------------------------------


@pytest.fixture
def five() -> Session:
    s = Session.new()
    s.add(5)
    return s


def test_a_swap_of_two_items_is_detected(five: Session) -> None:
    r = five.rows
    assert verdict(five, [r[0], r[3], r[2], r[1], r[4]]) == Verdict(Tamper.SWAPPED, 1)


def test_a_swap_that_also_rewrites_the_positions_in_the_links_is_unauthenticated(
    five: Session,
) -> None:
    links = [chain.Link.decode(raw) for _, raw in five.rows]
    assert all(lk is not None for lk in links)
    b, c = links[1], links[2]
    assert b is not None and c is not None
    rows = list(five.rows)
    rows[1] = (five.rows[2][0], c._replace(pos=b.pos).encode())
    rows[2] = (five.rows[1][0], b._replace(pos=c.pos).encode())
    assert verdict(five, rows) == Verdict(Tamper.UNAUTHENTICATED, 1)


def test_a_duplicated_item_is_detected(five: Session) -> None:
    assert verdict(five, [*five.rows, five.rows[2]]).kind is Tamper.DUPLICATED


def test_an_item_popped_then_put_back_is_detected(five: Session) -> None:
    five.pop()
    assert verdict(five, [*five.rows, five.popped[-1]]) == Verdict(Tamper.REINSERTED_AFTER_POP, 4)


def test_an_item_popped_then_put_back_over_its_successor_is_detected(five: Session) -> None:
    five.pop()
    five.pop()
    five.add(2)
    rows = list(five.rows)
    rows[3] = five.popped[0]  # the one popped second sat at position 3
    assert verdict(five, rows) == Verdict(Tamper.REINSERTED_AFTER_POP, 3)


def test_an_item_cleared_then_put_back_is_detected(five: Session) -> None:
    five.clear()
    five.add(1)
    assert verdict(five, [five.cleared[0], *five.rows]) == Verdict(Tamper.REINSERTED_AFTER_CLEAR, 0)


def test_an_item_purged_then_put_back_is_detected(five: Session) -> None:
    five.purge(2)
    assert verdict(five, [five.purged[1], *five.rows]) == Verdict(Tamper.REINSERTED_AFTER_PURGE, 0)


def test_an_item_deleted_from_the_middle_is_detected(five: Session) -> None:
    assert verdict(five, five.rows[:2] + five.rows[3:]) == Verdict(Tamper.DELETED, 2)


def test_a_cut_tail_is_detected(five: Session) -> None:
    assert verdict(five, five.rows[:3]) == Verdict(Tamper.CUT_TAIL, 3)


def test_an_item_moved_from_another_session_is_detected(five: Session) -> None:
    other = Session("other", five.sealer, five.keys)
    other.add(1)
    rows = list(five.rows)
    rows[2] = other.rows[0]
    assert verdict(five, rows) == Verdict(Tamper.MOVED, 2)


def test_a_session_replaced_by_its_older_copy_is_detected(five: Session) -> None:
    old_rows, old_head = list(five.rows), five.head
    five.pop()
    five.add(1)
    assert five.head is not None
    assert check(five.keys, "s", old_rows, old_head) == Verdict()  # alone, it is consistent
    assert check(five.keys, "s", old_rows, old_head, five.head.anchor()) == Verdict(
        Tamper.ROLLED_BACK
    )


def test_a_row_with_no_link_or_a_forged_one_is_unauthenticated(five: Session) -> None:
    text, raw = five.rows[1]
    assert verdict(five, [five.rows[0], (text, None), *five.rows[2:]]) == Verdict(
        Tamper.UNAUTHENTICATED, 1
    )
    forged = five.sealer.seal("s", {"injected": True})
    assert verdict(five, [*five.rows[:4], (forged, five.rows[4][1])]) == Verdict(
        Tamper.UNAUTHENTICATED, 4
    )


@pytest.mark.parametrize("name", ["epoch", "pos", "seq", "tag", "prev", "ident"])
def test_editing_any_field_of_a_link_makes_it_unauthenticated(five: Session, name: str) -> None:
    text, raw = five.rows[2]
    link = chain.Link.decode(raw)
    assert link is not None
    value = getattr(link, name)
    edited = value + 1 if isinstance(value, int) else bytes([value[0] ^ 1]) + value[1:]
    fields = {name: edited}
    if name == "ident":
        fields["mac"] = edited  # as a freshly written link stores it
    rows = list(five.rows)
    rows[2] = (text, link._replace(**fields).encode())
    assert verdict(five, rows) == Verdict(Tamper.UNAUTHENTICATED, 2)


def test_an_unauthenticated_or_missing_head_is_tampering(five: Session) -> None:
    assert check(five.keys, "s", five.rows, None) == Verdict(Tamper.UNAUTHENTICATED)
    assert five.head is not None
    more = dataclasses.replace(five.head, end=five.head.end + 1)
    assert check(five.keys, "s", five.rows, more) == Verdict(Tamper.UNAUTHENTICATED)
    assert check(five.keys, "s", [], None) == Verdict()


def test_rows_under_a_key_no_longer_held_are_unauthenticated(five: Session) -> None:
    before_rotation = list(five.rows)
    five.rotate()
    current = {five.sealer.kid: five.key}  # the old version destroyed
    assert check(current, "s", five.rows, five.head) == Verdict()
    # A row's pre-rotation copy, put back once the old key is gone.
    rows = [before_rotation[0], *five.rows[1:]]
    assert check(current, "s", rows, five.head) == Verdict(Tamper.UNAUTHENTICATED, 0)


def test_a_rotation_re_macs_each_row_alone_and_refuses_a_forged_one(five: Session) -> None:
    new = crypto.Sealer(crypto.generate_key())
    new_key = chain.chain_key(new.master_key, VAULT_ID)
    text, raw = five.rows[0]
    link = chain.Link.decode(raw)
    assert link is not None
    stamped = crypto.rotate_row_stamped(five.sealer, new, "s", text)
    assert stamped is not None
    assert chain.remac(five.key, new_key, link, text, stamped[0]) is not None
    forged = five.sealer.seal("s", {"injected": True})
    assert chain.remac(five.key, new_key, link, forged, stamped[0]) is None


# --- a limited read checks its window only, and everything in it -----------------


def tampered(s: Session, data: st.DataObject) -> list[Row]:
    """The session's rows after one tampering of any kind, drawn."""
    rows = list(s.rows)
    spare = s.popped + s.cleared + s.purged
    kinds = ["cut", "delete", "duplicate", "byte"] + (["swap"] if len(rows) > 1 else [])
    kinds += ["insert"] if spare else []
    kind = data.draw(st.sampled_from(kinds))
    at = data.draw(st.integers(0, len(rows) - 1))
    if kind == "cut":
        return rows[:at]
    if kind == "delete":
        return rows[:at] + rows[at + 1 :]
    if kind == "duplicate":
        return rows[: at + 1] + [rows[at]] + rows[at + 1 :]
    if kind == "swap":
        j = data.draw(st.integers(0, len(rows) - 1).filter(lambda j: j != at))
        rows[at], rows[j] = rows[j], rows[at]
        return rows
    if kind == "insert":
        rows.insert(data.draw(st.integers(0, len(rows))), data.draw(st.sampled_from(spare)))
        return rows
    text, raw = rows[at]
    rows[at] = (text[:-3] + ("A" if text[-3] != "A" else "B") + text[-2:], raw)
    return rows


@FAST
@given(HISTORY, st.data())
def test_a_limited_read_finds_any_tampering_inside_its_window_and_nothing_outside(
    ops: list[Any], data: st.DataObject
) -> None:
    s = session(ops, at_least=1)
    for k in range(1, len(s.rows) + 1):
        assert check_tail(s.keys, "s", s.rows[-k:], s.head, k) == Verdict()
    rows = tampered(s, data)
    for k in range(1, len(s.rows) + 2):
        window = rows[-k:] if rows else []
        found = check_tail(s.keys, "s", window, s.head, k)
        if window == s.rows[-k:]:
            assert found == Verdict(), k  # the tampering lies before the window
        else:
            assert found.kind is not None, k
    assert check(s.keys, "s", rows, s.head).kind is not None


def test_a_limited_read_does_not_depend_on_the_rows_before_its_window() -> None:
    s = Session.new()
    s.add(50)
    window = s.rows[-20:]
    assert check_tail(s.keys, "s", window, s.head, 20) == Verdict()
    assert check_tail(s.keys, "s", [window[0], *window[2:]], s.head, 20).kind is not None


def test_any_str_chains_even_one_with_a_lone_surrogate() -> None:
    key = chain.chain_key(crypto.generate_key(), VAULT_ID)
    sid, text = "odd\udc80id", crypto.envelope_text(key.kid, "gAAAAA\udc80")
    links, head = chain.extend(key, sid, chain.new_head(key, sid), [text])
    rows = [(text, links[0].encode())]
    assert check({key.kid: key}, sid, rows, head) == Verdict()
    assert check({key.kid: key}, sid, [], head) == Verdict(Tamper.CUT_TAIL, 0)


# --- operations never approve what an attacker put in place ---------------------------


def test_a_pop_refuses_a_row_that_is_not_the_sessions_last(five: Session) -> None:
    """A, B popped, then C, D written; the attacker puts B back in C's place. Popping D
    would otherwise take its `before` from B's link and approve the history A, B."""
    five.pop()
    five.add(2)
    put_back = five.popped[-1]
    for text, raw in (put_back, five.rows[-2], (five.rows[-1][0], five.rows[-2][1])):
        link = chain.Link.decode(raw)
        assert link is not None
        with pytest.raises(ValueError):
            chain.pop(five.key, five.session_id, five._head(), link, text)
    assert five.head is not None and five.head.count == 6  # nothing moved


def test_a_purge_refuses_a_link_copied_from_a_fresh_item_onto_an_expired_row(
    five: Session,
) -> None:
    """Moving the base past fresh items would let the attacker delete them unseen."""
    expired_text = five.rows[0][0]
    fresh = chain.Link.decode(five.rows[3][1])
    assert fresh is not None
    with pytest.raises(ValueError):
        chain.purge(five.key, five.session_id, five._head(), fresh, expired_text)
    other = Session.new("other", master=five.sealer.master_key)
    other.add(4)
    foreign = chain.Link.decode(other.rows[3][1])
    assert foreign is not None  # authentic over its text, but another session's
    with pytest.raises(ValueError):
        chain.purge(five.key, five.session_id, five._head(), foreign, other.rows[3][0])


@pytest.mark.parametrize("count", [2**63, 2**64, 10**40])
def test_a_count_too_large_for_its_field_is_unauthenticated_not_a_crash(
    five: Session, count: int
) -> None:
    text, raw = five.rows[2]
    parts = raw.split(".")
    parts[2] = str(count)  # the position
    assert chain.Link.decode(".".join(parts)) is None
    assert verdict(five, [*five.rows[:2], (text, ".".join(parts)), *five.rows[3:]]) == Verdict(
        Tamper.UNAUTHENTICATED, 2
    )
    assert five.head is not None
    fields = five.head.encode().split(".")
    fields[5] = str(count)  # the seq
    assert chain.Head.decode(".".join(fields)) is None


def test_rows_under_two_keys_linked_each_under_its_own_check_clean_and_rotate() -> None:
    """An upgrade of a file whose rotation was cut off: some rows still under the old
    key, the rest under the new one, the head under the new one."""
    s = Session.new()
    old_sealer = s.sealer
    new_sealer = crypto.Sealer(crypto.generate_key())
    new_key = chain.chain_key(new_sealer.master_key, VAULT_ID)
    s.keys[new_key.kid] = new_key
    texts = [old_sealer.seal("s", {"n": i}) for i in range(3)]
    texts += [new_sealer.seal("s", {"n": i}) for i in range(3, 5)]
    item_keys = [s.keys[crypto.kid_of(t) or ""] for t in texts]
    links, head = chain.extend(new_key, "s", chain.new_head(new_key, "s"), texts, item_keys)
    rows = [(t, lk.encode()) for t, lk in zip(texts, links, strict=True)]
    assert check(s.keys, "s", rows, head).ok
    # Linked under the new key alone, the rows still under the old one do not verify.
    wrong, _ = chain.extend(new_key, "s", chain.new_head(new_key, "s"), texts)
    as_one = [(t, lk.encode()) for t, lk in zip(texts, wrong, strict=True)]
    assert check(s.keys, "s", as_one, head) == Verdict(Tamper.UNAUTHENTICATED, 0)
    # The rotation then moves the old rows with their links.
    old_key = s.keys[old_sealer.kid]
    for i in range(3):
        moved = crypto.rotate_row_stamped(old_sealer, new_sealer, "s", texts[i])
        assert moved is not None
        relinked = chain.remac(old_key, new_key, links[i], texts[i], moved[0])
        assert relinked is not None
        rows[i] = (moved[0], relinked.encode())
    assert check({new_key.kid: new_key}, "s", rows, head).ok
