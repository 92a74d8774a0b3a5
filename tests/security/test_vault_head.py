"""The vault head (vault.chainvault): every session's head summed under the chain key,
so that a session put back whole from an older copy, or added or removed whole, is
told apart, and a whole file put back is told apart by the point kept outside it.

Pure: real envelopes and real HMACs (tests.security.chainmodel), no keyring, no file.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security.chainmodel import VAULT_ID, Session
from vault import chain, chainvault, crypto
from vault.chaincheck import Tamper
from vault.chainvault import Point, VaultHead

SRC = "keyring@"  # the key source the vault heads here are sealed for
TRANSIT = "transit:days@transit"
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 3)),
            st.tuples(st.just("pop")),
            st.tuples(st.just("clear")),
            st.tuples(st.just("purge"), st.integers(1, 2)),
        ),
    ),
    max_size=12,
)


class Vault:
    """Sessions of one vault under one key, and its vault head moved by each write."""

    def __init__(self) -> None:
        master = crypto.generate_key()
        self.sessions = {sid: Session.new(sid, master=master) for sid in "abc"}
        self.key = self.sessions["a"].key
        self.vh = chainvault.new_vault_head(self.key, SRC)
        self.history: list[tuple[dict[str, chain.Head], VaultHead]] = []

    def heads(self) -> dict[str, chain.Head]:
        return {sid: s.head for sid, s in self.sessions.items() if s.head is not None}

    def apply(self, sid: str, op: tuple[Any, ...]) -> None:
        self.history.append((self.heads(), self.vh))
        s = self.sessions[sid]
        before = s.head
        s.apply(op)
        if s.head != before:
            self.vh = chainvault.moved(self.key, self.vh, sid, before, s.head, SRC)

    def judge(self, heads: dict[str, chain.Head] | None = None, **kw: Any) -> Tamper | None:
        heads = self.heads() if heads is None else heads
        return chainvault.judge(self.key, self.vh, heads, SRC, **kw)


def unbound(key: chain.ChainKey, vh: VaultHead) -> VaultHead:
    """`vh` as 0.2 sealed it (v1): its MAC over the same fields, bound to no key source."""
    data = chain.fields(
        b"memvault chain vault head v1",
        chain.utf8(key.vault_id),
        chain.utf8(key.kid),
        chain.num(vh.seq),
        vh.digest,
    )
    return VaultHead(vh.kid, vh.seq, vh.digest, key.mac(data), "v1")


@pytest.fixture
def busy() -> Vault:
    v = Vault()
    for sid, op in [("a", ("add", 3)), ("b", ("add", 2)), ("a", ("pop",)), ("c", ("add", 1))]:
        v.apply(sid, op)
    v.apply("b", ("add", 2))
    return v


@FAST
@given(OPS)
def test_every_legitimate_sequence_of_writes_keeps_the_vault_head_whole(
    ops: list[tuple[str, tuple[Any, ...]]],
) -> None:
    v = Vault()
    for sid, op in ops:
        v.apply(sid, op)
        assert v.judge() is None
        assert v.judge(anchor=v.vh.point()) is None
        assert v.vh.digest == chainvault.digest_of(v.key, v.heads())
    assert VaultHead.decode(v.vh.encode()) == v.vh


def test_a_session_put_back_whole_from_an_older_copy_is_a_rollback(busy: Vault) -> None:
    older_b = busy.history[-1][0]["b"]  # b's head before its last write, authentic
    assert chain.head_ok(busy.key, "b", older_b)
    assert busy.judge({**busy.heads(), "b": older_b}) is Tamper.ROLLED_BACK


def test_a_session_removed_or_added_whole_is_a_rollback(busy: Vault) -> None:
    heads = busy.heads()
    del heads["c"]
    assert busy.judge(heads) is Tamper.ROLLED_BACK
    other = Session.new("d", master=busy.sessions["a"].sealer.master_key)
    other.add(1)
    assert other.head is not None
    assert busy.judge({**busy.heads(), "d": other.head}) is Tamper.ROLLED_BACK


def test_a_whole_file_put_back_is_told_only_by_the_point_kept_outside(busy: Vault) -> None:
    heads, vh = busy.history[-2]
    older = chainvault.judge(busy.key, vh, heads, SRC)
    assert older is None  # consistent on its own
    rolled = chainvault.judge(busy.key, vh, heads, SRC, anchor=busy.vh.point())
    assert rolled is Tamper.FILE_ROLLED_BACK
    # A point at the same seq with another digest: a fork, not the live vault.
    fork = Point(busy.vh.seq, bytes(chain.MAC_BYTES))
    assert busy.judge(anchor=fork) is Tamper.FILE_ROLLED_BACK
    assert busy.judge(anchor=Point(busy.vh.seq - 1, vh.digest)) is None  # anchor behind


def test_an_edited_or_missing_vault_head_is_unauthenticated(busy: Vault) -> None:
    for vh in (
        VaultHead(busy.vh.kid, busy.vh.seq + 1, busy.vh.digest, busy.vh.mac),
        VaultHead(busy.vh.kid, busy.vh.seq, bytes(chain.MAC_BYTES), busy.vh.mac),
        None,
    ):
        assert chainvault.judge(busy.key, vh, busy.heads(), SRC) is Tamper.UNAUTHENTICATED
    with pytest.raises(ValueError):
        edited = VaultHead(busy.vh.kid, 9, busy.vh.digest, busy.vh.mac)
        chainvault.moved(busy.key, edited, "a", None, None, SRC)


@pytest.mark.parametrize("seq", ["9223372036854775808", "18446744073709551616", "01", "x"])
def test_a_vault_head_that_does_not_parse_decodes_to_none(busy: Vault, seq: str) -> None:
    parts = busy.vh.encode().split(".")
    parts[2] = seq
    assert VaultHead.decode(".".join(parts)) is None
    assert VaultHead.decode(busy.vh.encode()[:-2]) is None


def test_a_rotation_sums_the_vault_head_afresh_under_the_new_key(busy: Vault) -> None:
    new = chain.chain_key(crypto.generate_key(), VAULT_ID)
    moved_heads = {}
    for sid, head in busy.heads().items():
        again = chain.remac_head(busy.key, new, sid, head)
        assert again is not None
        moved_heads[sid] = again
    vh = chainvault.rekey(busy.key, new, busy.vh, busy.heads(), SRC)
    assert vh is not None
    assert chainvault.judge(new, vh, moved_heads, SRC) is None
    assert vh.seq == busy.vh.seq + 1 and vh.kid == new.kid
    # A rollback to before the rotation is behind the point taken after it.
    assert chainvault.judge(busy.key, busy.vh, busy.heads(), SRC, anchor=vh.point()) is (
        Tamper.FILE_ROLLED_BACK
    )
    stale = dict(busy.heads())
    del stale["a"]
    assert chainvault.rekey(busy.key, new, busy.vh, stale, SRC) is None


def test_a_vault_head_vouches_only_for_the_key_source_it_was_sealed_for(busy: Vault) -> None:
    # The source rows are no MAC's: a copy given another source's rows is told.
    assert chainvault.vault_head_ok(busy.key, busy.vh, SRC)
    assert chainvault.judge(busy.key, busy.vh, busy.heads(), TRANSIT) is Tamper.UNAUTHENTICATED
    with pytest.raises(ValueError):
        chainvault.moved(busy.key, busy.vh, "a", None, None, TRANSIT)
    assert chainvault.stepped(busy.key, busy.vh, TRANSIT, SRC) is None
    # A key move's step seals it for the source it moves to, and for that one only.
    moved = chainvault.stepped(busy.key, busy.vh, SRC, TRANSIT)
    assert moved is not None and moved.seq == busy.vh.seq + 1
    assert chainvault.judge(busy.key, moved, busy.heads(), TRANSIT) is None
    assert chainvault.judge(busy.key, moved, busy.heads(), SRC) is Tamper.UNAUTHENTICATED
    # The source stands in clear beside the MAC (a write reads it there): edited, it fails.
    assert VaultHead.decode(moved.encode()) == moved and moved.source == TRANSIT
    edited = VaultHead.decode(
        moved.encode().replace(moved.encode().split(".")[4], SRC.encode().hex())
    )
    assert edited is not None and edited.source == SRC
    assert not chainvault.vault_head_ok(busy.key, edited, edited.source)


def test_a_vault_head_from_before_the_source_was_bound_is_read_and_sealed_anew(
    busy: Vault,
) -> None:
    old = unbound(busy.key, busy.vh)
    assert VaultHead.decode(old.encode()) == old
    assert chainvault.judge(busy.key, old, busy.heads(), SRC) is None
    assert chainvault.judge(busy.key, old, busy.heads(), TRANSIT) is None  # vouches for none
    # Its next write seals it for the source: v2 from then on, the binding in force.
    after = chainvault.moved(busy.key, old, "c", None, None, SRC)
    assert after.version == "v2" and after.encode().startswith("v2.")
    assert chainvault.vault_head_ok(busy.key, after, SRC)
    assert not chainvault.vault_head_ok(busy.key, after, TRANSIT)
    # A v2 head relabelled v1 does not authenticate: the binding cannot be stripped.
    relabelled = VaultHead(after.kid, after.seq, after.digest, after.mac, "v1")
    assert not chainvault.vault_head_ok(busy.key, relabelled, TRANSIT)
