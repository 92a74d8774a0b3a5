"""The history chain's anchor (vault.chainanchor) in the real keyring: the newest vault
head seen, kept outside the file, read by another process, moved forward only unless
on purpose, and gone with the vault's entries."""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT, keyring_entries
from vault import chainanchor, chainvault
from vault.chain import MAC_BYTES
from vault.chainvault import Point
from vault.keys import KeyStore

pytestmark = pytest.mark.secret_service

READ_IN_ANOTHER_PROCESS = """
import sys
from vault import chainanchor
from vault.keys import KeyStore
point = chainanchor.read(KeyStore(), sys.argv[1])
print(point.seq, point.digest.hex())
"""


def point(seq: int) -> Point:
    return Point(seq, secrets.token_bytes(MAC_BYTES))


def test_the_anchor_moves_forward_only_and_another_process_reads_it() -> None:
    ks, vault_id = KeyStore(), "mv-" + secrets.token_hex(12)
    assert chainanchor.read(ks, vault_id) is None
    first = point(5)
    assert chainanchor.advance(ks, vault_id, first) == first
    # Another process saw a newer state meanwhile: an older point leaves it.
    assert chainanchor.advance(ks, vault_id, point(4)) == first
    assert chainanchor.advance(ks, vault_id, point(5)) == first
    newer = point(9)
    assert chainanchor.advance(ks, vault_id, newer) == newer
    proc = subprocess.run(
        [sys.executable, "-c", READ_IN_ANOTHER_PROCESS, vault_id],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(newer.seq), newer.digest.hex()]
    assert set(keyring_entries(vault_id)) == {chainanchor.entry_name(vault_id)}
    assert chainanchor.forget(ks, vault_id) is True
    assert chainanchor.read(ks, vault_id) is None and keyring_entries(vault_id) == {}
    assert chainanchor.forget(ks, vault_id) is False


class SlowReads(KeyStore):
    """A keyring whose reads return late: another process records meanwhile."""

    def get(self, name: str) -> str | None:
        value = super().get(name)
        time.sleep(0.4)
        return value


def test_two_recorders_at_once_keep_the_newer_point_in_the_keyring() -> None:
    """The keyring has no check-and-set: without taking turns, the process that read
    first but set last would leave the older point."""
    vault_id, newer = "mv-" + secrets.token_hex(12), point(12)
    first = threading.Thread(target=chainanchor.advance, args=(SlowReads(), vault_id, newer))
    later = threading.Thread(target=chainanchor.advance, args=(SlowReads(), vault_id, point(10)))
    first.start()
    time.sleep(0.1)  # the later one reads while the first waits to set
    later.start()
    first.join(30)
    later.join(30)
    assert chainanchor.read(KeyStore(), vault_id) == newer
    chainanchor.forget(KeyStore(), vault_id)


def test_a_file_behind_its_anchor_is_judged_rolled_back() -> None:
    from tests.security.test_vault_head import SRC, Vault

    v = Vault()
    v.apply("a", ("add", 2))
    older = v.vh
    v.apply("b", ("add", 1))
    ks, vault_id = KeyStore(), "mv-" + secrets.token_hex(12)
    try:
        chainanchor.advance(ks, vault_id, v.vh.point())
        anchor = chainanchor.read(ks, vault_id)
        assert v.judge(anchor=anchor) is None
        older_heads = v.history[-1][0]
        rolled = chainvault.judge(v.key, older, older_heads, SRC, anchor=anchor)
        assert rolled is not None and rolled.value == "the whole vault put back from an older copy"
    finally:
        chainanchor.forget(ks, vault_id)


@pytest.mark.parametrize(
    "text",
    ["", "a1.1", "a2.1." + "00" * MAC_BYTES, "a1.01." + "00" * MAC_BYTES, "a1.1.00",
     "a1.99999999999999999999." + "00" * MAC_BYTES, "a1.1." + "zz" * MAC_BYTES,
     "a1.1." + "00" * MAC_BYTES + ".moved", "a1.1." + "00" * MAC_BYTES + ".left.left",
     "a1.1." + "00" * MAC_BYTES + ".l0", "a1.1." + "00" * MAC_BYTES + ".l01",
     "a1.1." + "00" * MAC_BYTES + ".left.forked", "a1.1." + "00" * MAC_BYTES + ".forked.l2",
     "a1.1." + "00" * MAC_BYTES + ".l2.l2"],
)  # fmt: skip
def test_an_anchor_memvault_did_not_write_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        chainanchor.decode(text)
    good = Point(3, bytes(range(MAC_BYTES)))
    assert chainanchor.decode(chainanchor.encode(good)) == good
    for marks in ({"left": True}, {"forked": True, "lifts": 2}, {"lifts": 1}):
        assert chainanchor.decode(chainanchor.encode(good, **marks)) == good  # type: ignore[arg-type]


def test_an_anchor_recorded_of_another_history_is_marked_forked_not_moved() -> None:
    """A process that saw the file hold one point at a `seq`, finding the anchor at that
    `seq` with another, records nothing and marks it: no later point passes until a
    lift, and a lift since the process read the anchor puts its sightings aside."""
    ks, vault_id = KeyStore(), "mv-" + secrets.token_hex(12)
    try:
        recorded, ours = point(5), point(5)
        chainanchor.advance(ks, vault_id, point(4))
        seen = chainanchor.floor(ks, vault_id)
        assert seen.passes(point(4)) is False  # another digest at the anchor's seq
        assert seen.passes(ours) and seen.passes(point(6))
        chainanchor.advance(ks, vault_id, recorded)  # another process, of another history
        with pytest.raises(chainanchor.Forked):
            chainanchor.advance(ks, vault_id, point(7), seen=seen)
        assert seen.forked and not seen.passes(point(8))
        assert chainanchor.read(ks, vault_id) == recorded
        fresh = chainanchor.floor(ks, vault_id)
        assert fresh.forked and not fresh.passes(point(8))
        assert chainanchor.advance(ks, vault_id, point(8)) == recorded  # the mark stays
        lifted = point(9)
        fresh.lift(lifted)
        assert chainanchor.advance(ks, vault_id, lifted, lifted=True, seen=fresh) == lifted
        assert not chainanchor.floor(ks, vault_id).forked
        # `seen` saw seq 5 hold `ours`; the anchor was lifted since: no fork told.
        chainanchor.replace(ks, vault_id, None)
        chainanchor.advance(ks, vault_id, recorded, lifted=True)
        assert chainanchor.advance(ks, vault_id, point(10), seen=seen) is not None
        assert chainanchor.read(ks, vault_id) is not None
    finally:
        chainanchor.forget(ks, vault_id)


def test_an_anchor_left_by_a_key_move_passes_no_file_until_lifted_on_purpose() -> None:
    ks, vault_id = KeyStore(), "mv-" + secrets.token_hex(12)
    try:
        chainanchor.leave(ks, vault_id)  # nothing recorded there: nothing to mark
        assert ks.get(chainanchor.entry_name(vault_id)) is None
        at_move = point(7)
        chainanchor.advance(ks, vault_id, at_move)
        chainanchor.leave(ks, vault_id)
        assert chainanchor.read(ks, vault_id) == at_move  # the point stays, marked
        floor = chainanchor.floor(ks, vault_id)
        assert floor.left and not floor.passes(point(8)) and not floor.passes(at_move)
        # A record, of an older point or a newer one, leaves the mark; only what
        # `restore` and `accept` write past it on purpose clears it.
        assert chainanchor.advance(ks, vault_id, point(6)) == at_move
        assert chainanchor.advance(ks, vault_id, point(8)) == at_move
        assert chainanchor.floor(ks, vault_id).left
        lifted = point(9)
        floor.lift(lifted)
        assert floor.passes(lifted) and not floor.passes(point(8))
        assert chainanchor.advance(ks, vault_id, lifted, lifted=True) == lifted
        assert not chainanchor.floor(ks, vault_id).left
        chainanchor.leave(ks, vault_id)
        chainanchor.replace(ks, vault_id, point(10))  # a move back to this source
        assert not chainanchor.floor(ks, vault_id).left
        ks.set(chainanchor.entry_name(vault_id), "a2.5.zz")
        chainanchor.leave(ks, vault_id)  # not memvault's: nothing to mark, no error
        assert ks.get(chainanchor.entry_name(vault_id)) == "a2.5.zz"
    finally:
        chainanchor.forget(ks, vault_id)
