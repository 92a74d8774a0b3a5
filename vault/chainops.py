"""The history chain as the engines use it: chain keys of a sealer, a stored head
authenticated before it is moved, and a verdict turned into `HistoryTampered`.

Engine-neutral: an engine reads and writes the link and head texts (the file's are in
vault.engines.sqlite.chainrows); what they mean is here and in vault.chain /
vault.chaincheck. Design: docs/history-chain.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from vault import chain, chainanchor, crypto
from vault.chain import ChainKey, Head, Link
from vault.chaincheck import Tamper, Verdict
from vault.errors import HistoryTampered

# The meta row that says whether every session of the vault is chained: "building"
# from the upgrade's migration until the first open with the key has linked the rows
# the vault had before, then "on".
CHAIN_META = "chain"
ON, BUILDING = "on", "building"


@functools.lru_cache(maxsize=16)
def _key(master_key: str, vault_id: str) -> ChainKey:
    # Cached: HKDF per call would cost more than the HMACs of a short read, and a
    # ChainKey keeps the keyed prefixes its next use needs.
    return chain.chain_key(master_key, vault_id)


def key_of(sealer: crypto.Sealer, vault_id: str) -> ChainKey:
    return _key(sealer.master_key, vault_id)


def keys_for(sealer: crypto.Sealer, vault_id: str) -> dict[str, ChainKey]:
    """The chain keys a read needs, by kid: the sealer's, and while an online rotation
    moves rows (a RotatingSealer) the old key's too."""
    keys = {sealer.kid: key_of(sealer, vault_id)}
    old = getattr(sealer, "old", None)
    if isinstance(old, crypto.Sealer):
        keys[old.kid] = key_of(old, vault_id)
    return keys


def tampered(session_id: str, kind: Tamper | str, where: str) -> HistoryTampered:
    what = kind.value if isinstance(kind, Tamper) else kind
    if kind is Tamper.VAULT_MISMATCH:
        return HistoryTampered(
            f"the sessions of {where} do not match its vault head ({what}; which one "
            f"cannot be told), so session {session_id!r} was not read or changed; restore "
            "the vault from a backup, or take it as it is now with `memvault accept` "
            "(`memvault verify` lists what is wrong)",
            session_id,
            what,
        )
    if kind is Tamper.FILE_ROLLED_BACK:
        spared = (
            f"session {session_id!r} was not read or changed"
            if session_id
            else "no history was changed"
        )
        return HistoryTampered(
            f"{where} is older than the state memvault recorded of it outside the file "
            f"({what}), so {spared}; put the newer file back, restore a backup with "
            "`memvault restore` (a backup copied over the vault: move it elsewhere first), "
            "or take this one as it is with `memvault accept`",
            session_id,
            what,
        )
    return HistoryTampered(
        f"the history of session {session_id!r} in {where} does not verify ({what}); "
        "nothing was read or changed; restore the vault from a backup "
        "(`memvault verify` lists what is wrong; `show --include-tampered` reads it marked)",
        session_id,
        what,
    )


def refuse_unchained(
    store: chainanchor.Store | None, vault_id: str, where: str, state: Callable[[], str | None]
) -> None:
    """Before the upgrade links a file's rows: refuse when the vault's anchor says its
    history was chained already. The file was then put back from a copy older than its
    upgrade, or rewritten to look unchained, and linking it would vouch for whatever
    order someone gave its rows. `state` reads the file's chain state afresh: another
    process may have finished the build (and set the anchor) since this one looked."""
    if store is not None and chainanchor.is_chained(store, vault_id) and state() != ON:
        raise rewritten_unchained(where)


def rewritten_unchained(where: str) -> HistoryTampered:
    return HistoryTampered(
        f"{where} says its history was never chained, but this vault's history is "
        "chained since its upgrade: the file was put back from an older copy or "
        "rewritten, and nothing was linked or changed; restore a backup with "
        "`memvault restore`, which accepts the backup's state on purpose",
        "",
        Tamper.ROLLED_BACK.value,
    )


def refuse(verdict: Verdict, session_id: str, where: str) -> None:
    refuse_kind(verdict.kind, session_id, where)


def refuse_kind(kind: Tamper | None, session_id: str, where: str) -> None:
    if kind is not None:
        raise tampered(session_id, kind, where)


def head_to_move(key: ChainKey, session_id: str, stored: str | None, where: str) -> Head:
    """The session's head before a write changes it: the stored one, authenticated under
    the current chain key (a rotation re-MACs every head at its switch), or a new one
    when the session was never written. A forged or missing-key head refuses the write."""
    if stored is None:
        return chain.new_head(key, session_id)
    head = Head.decode(stored)
    if head is None or not chain.head_ok(key, session_id, head):
        raise tampered(session_id, Tamper.UNAUTHENTICATED, where)
    return head


def link_of(text: str | None, session_id: str, where: str) -> Link:
    link = Link.decode(text)
    if link is None:
        raise tampered(session_id, Tamper.UNAUTHENTICATED, where)
    return link


def pop_head(
    key: ChainKey,
    session_id: str,
    head: Head,
    popped: Sequence[tuple[str, str | None]],
    where: str,
    link_keys: Mapping[str, ChainKey] | None = None,
) -> Head:
    """The head after the newest rows went: `popped` are their (envelope text, link),
    newest first. Each must be the head's authentic last item in turn (its link
    checked under the key its envelope names, from `link_keys`), so that a pop never
    approves an item an attacker put in its place."""
    for text, raw in popped:
        link = link_of(raw, session_id, where)
        link_key = (link_keys or {}).get(crypto.kid_of(text) or "", key)
        try:
            head = chain.pop(key, session_id, head, link, text, link_key)
        except ValueError:
            raise tampered(session_id, Tamper.UNAUTHENTICATED, where) from None
    return head


def remac_all(old: ChainKey, new: ChainKey, heads: Mapping[str, str]) -> list[tuple[str, str]]:
    """(head text, session id) of every head re-MACed from `old` to `new`; a head that
    does not authenticate under `old` is left as it is (verify reports it)."""
    out = []
    for sid, text in heads.items():
        head = Head.decode(text)
        moved = None if head is None else chain.remac_head(old, new, sid, head)
        if moved is not None:
            out.append((moved.encode(), sid))
    return out
