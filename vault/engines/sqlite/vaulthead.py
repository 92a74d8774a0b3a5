"""The vault head stored in a vault file (vault.chainvault): the one row of
`memvault_vault_head`, moved in the transaction of every write that moves a session's
head (a table of its own: an agent's write reads no meta row).

A session's rows and head put back together from an older copy are consistent with
each other; a session removed or added whole leaves no row to judge. The vault head
sums every head under the chain key, so either no longer matches it. The sum cannot
say which session changed: a mismatch is the vault's (`Tamper.VAULT_MISMATCH`), and
every session of the file is refused until the vault is restored, or its state is
accepted on purpose (`accept`). What a vault head cannot tell, a whole file put back,
is the anchor's (vault.chainanchor). The SQL only, inside the caller's transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping

from vault import chainops, chainvault
from vault.chain import ChainKey, Head, head_ok
from vault.chaincheck import Tamper
from vault.chainfloor import Floor
from vault.chainops import CHAIN_META, ON
from vault.chainvault import Point, VaultHead
from vault.engines.sqlite.db import set_meta
from vault.engines.sqlite.schema import GUARD_MESSAGE, session_exists_sql
from vault.errors import HistoryTampered, VaultBusy
from vault.keys import KeyStore
from vault.keysource.store import KEYRING, MOUNT, SOURCE, TransitStore, mount_of

HEADS_TABLE = "memvault_chain_heads"
VAULT_HEAD_TABLE = "memvault_vault_head"  # one row, id 1 (schema m010)
# m010's, again for `accept`: a file whose table was dropped gets it back on purpose.
_TABLE_SQL = (
    f"CREATE TABLE IF NOT EXISTS {VAULT_HEAD_TABLE} "
    "(id INTEGER PRIMARY KEY CHECK (id = 1), head TEXT NOT NULL)"
)
# Vault heads this process found matching, with the heads they summed: the same vault
# head over the very same heads is the same verdict, so a read pays one SELECT of the
# heads, not an HMAC per session. Every head is compared, not only the reader's: a
# session and the vault head put back together are told only by the others' heads.
_VOUCHED: dict[tuple[str, str, str], dict[str, str]] = {}
_VOUCHED_MAX = 8


def _meta(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM memvault_meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def chain_state(conn: sqlite3.Connection) -> str | None:
    """ON, BUILDING, or None for a file m010 has not migrated yet."""
    return _meta(conn, CHAIN_META)


def chained(conn: sqlite3.Connection) -> bool:
    """Whether every session of the file is chained (the upgrade has finished). A vault
    head says so too: one is written only as a build ends, so a file that has one and
    says otherwise (its meta row rewritten or deleted) is judged as chained."""
    return chain_state(conn) == ON or exists(conn)


def bound_source(meta: Mapping[str, str]) -> str:
    """The key source a vault head is sealed with: the one these meta rows name, its
    mount spelled as the service spells it. The rows are no MAC's, so a copy given
    another source's rows (to be opened through it) no longer matches its vault head."""
    rows = dict(meta)
    return f"{rows.get(SOURCE, KEYRING)}@{mount_of(rows) or ''}"


def store_source(ks: KeyStore) -> str:
    """`bound_source` of the meta rows `ks` is the source of."""
    return bound_source(ks.source_rows() if isinstance(ks, TransitStore) else {})


# What `_bound` gives a file holding a source row twice (its table rebuilt without its
# key): no vault head is sealed for it, whichever row a reader would take.
_AMBIGUOUS = "\0two key sources"


def _bound(conn: sqlite3.Connection) -> str:
    """`bound_source` of the file's meta, in the caller's transaction or snapshot: the
    one a `key move` switched together with the vault head."""
    sql = "SELECT key, value FROM memvault_meta WHERE key IN (?, ?)"
    rows = [(str(k), str(v)) for k, v in conn.execute(sql, (SOURCE, MOUNT))]
    if len({k for k, _ in rows}) != len(rows):
        return _AMBIGUOUS
    return bound_source(dict(rows))


def _to_seal(conn: sqlite3.Connection, where: str) -> str:
    """`_bound`, to seal a vault head for: refused for a file naming two sources, which
    would otherwise be taken as it is (`accept`, an upgrade's build) and then pass."""
    source = _bound(conn)
    if source == _AMBIGUOUS:
        raise HistoryTampered(
            f"{where} holds its key source row twice (its meta table was rewritten), so "
            "its state cannot be taken as it is; restore the vault from a backup; nothing "
            "was changed",
            "",
            Tamper.VAULT_MISMATCH.value,
        )
    return source


def _sealed_for(conn: sqlite3.Connection, vh: VaultHead) -> str:
    """The source a write checks `vh` against and seals it for: its own (v2, in clear
    beside the MAC that covers it), so that an agent's write reads no meta row (readers
    compare it with the rows); a 0.2 head's, the file's rows, read once (then v2)."""
    if vh.version == chainvault.UNBOUND_VERSION or vh.source is None:
        return _bound(conn)
    return vh.source


def _through(conn: sqlite3.Connection, floor: Floor | None) -> str:
    """The file's `_bound` source, refused (VaultBusy) when it is not the one `floor` was
    read through: the file names another key source than the one this process loaded
    its key and floor through (another process's `key move`, or rows changed under it),
    and judged by this floor a copy of that source's days could pass. Two source rows
    are left to the vault head, which no source they give matches."""
    source = _bound(conn)
    if floor is None or floor.source in (None, source) or source == _AMBIGUOUS:
        return source  # two source rows: told by the vault head, which none can match
    raise VaultBusy(
        "the vault file names another key source than the one this process opened it "
        "through (a `memvault key move` since, or its key source rows changed); nothing "
        "was read or changed; open the vault again (run the command again, or open a new "
        "session)"
    )


def file_kid(conn: sqlite3.Connection) -> str:
    return _meta(conn, "kid") or ""


def stored_heads(conn: sqlite3.Connection) -> dict[str, str]:
    return {str(s): str(h) for s, h in conn.execute(f"SELECT session_id, head FROM {HEADS_TABLE}")}


def _stored(conn: sqlite3.Connection) -> str | None:
    try:
        row = conn.execute(f"SELECT head FROM {VAULT_HEAD_TABLE} WHERE id = 1").fetchone()
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):
            raise
        return None  # dropped: as missing
    return None if row is None else str(row[0])


def exists(conn: sqlite3.Connection) -> bool:
    return _stored(conn) is not None


def _decoded(heads: Mapping[str, str]) -> dict[str, Head]:
    # A head that does not decode adds nothing to the sum, here as when it was summed;
    # its session's own check names it.
    out = {}
    for sid, text in heads.items():
        head = Head.decode(text)
        if head is not None:
            out[sid] = head
    return out


def _write(conn: sqlite3.Connection, vh: VaultHead) -> None:
    conn.execute(
        f"INSERT INTO {VAULT_HEAD_TABLE} (id, head) VALUES (1, ?) "
        "ON CONFLICT(id) DO UPDATE SET head = excluded.head",
        (vh.encode(),),
    )


def move(
    conn: sqlite3.Connection,
    key: ChainKey,
    session_id: str,
    before: Head | None,
    after: Head,
    where: str,
    floor: Floor | None = None,
) -> Point | None:
    """The vault head after one session's head went from `before` to `after`; its point
    (None while the upgrade's build has written none). `floor`: refused as
    `refuse_behind` would, from the one read and check of the vault head."""
    text = _stored(conn)
    if text is None:
        if chained(conn):
            raise chainops.tampered(session_id, Tamper.VAULT_MISMATCH, where)
        return None  # the upgrade's build sums every head when it ends (`start`)
    vh = VaultHead.decode(text)
    source = None if vh is None else _sealed_for(conn, vh)
    if source is not None and floor is not None:
        # Before the key id: a session opened through a source its keys have left (another
        # process's `key move`, then a rotation) is told to open the vault again
        # (VaultBusy), not sent to reload a key that source no longer holds.
        _refuse_other_source(conn, floor, source, session_id, where)
    if vh is not None and vh.kid != key.kid and file_kid(conn) != key.kid:
        # A rotation moved the vault head with every session's: the session's key is
        # stale, as the guard says of its items, and the session reloads it and retries.
        raise sqlite3.IntegrityError(GUARD_MESSAGE)
    try:
        if vh is None or source is None:
            raise ValueError("no vault head")
        moved = chainvault.moved(key, vh, session_id, before, after, source)  # authenticated
        if floor is not None and not floor.passes(vh.point()):
            raise chainops.tampered(session_id, Tamper.FILE_ROLLED_BACK, where)
        _write(conn, moved)
        return moved.point()
    except ValueError:
        raise chainops.tampered(session_id, Tamper.VAULT_MISMATCH, where) from None


def start(conn: sqlite3.Connection, key: ChainKey) -> None:
    """The file is chained from here: its vault head sums the heads it has (none for a
    new vault), and the meta says so, in the same transaction."""
    source = _to_seal(conn, "the vault file")
    _write(conn, chainvault.new_vault_head(key, source, _decoded(stored_heads(conn))))
    set_meta(conn, **{CHAIN_META: ON})


def rekey(
    conn: sqlite3.Connection, old: ChainKey, new: ChainKey, heads: Mapping[str, str]
) -> Point | None:
    """At a rotation's switch: the vault head summed afresh under the new key, checked
    first under the old one against `heads` as they were before the switch re-MACed
    them. One that does not match is kept as it is: still reported, never laundered.
    The new one's point (None: kept)."""
    vh = VaultHead.decode(_stored(conn))
    moved = None if vh is None else chainvault.rekey(old, new, vh, _decoded(heads), _bound(conn))
    if moved is None:
        return None
    _write(conn, moved)
    return moved.point()


def unbound(conn: sqlite3.Connection) -> bool:
    """Whether the file's vault head is 0.2's, bound to no key source (`bind`)."""
    vh = VaultHead.decode(_stored(conn))
    return vh is not None and vh.version == chainvault.UNBOUND_VERSION


def bind(conn: sqlite3.Connection, keys: Mapping[str, ChainKey], through: str) -> None:
    """A 0.2 vault head sealed anew (`chainvault.bound`) for the key source `through`,
    the one the process loaded its key through, if the file names it in this
    transaction: from then on a copy given another source's rows no longer matches."""
    vh = VaultHead.decode(_stored(conn))
    key = None if vh is None else keys.get(vh.kid)
    sealed = None if vh is None or key is None else chainvault.bound(key, vh, through)
    if sealed is not None and _bound(conn) == through:
        _write(conn, sealed)


def step(conn: sqlite3.Connection, key: ChainKey, to: Mapping[str, str]) -> None:
    """One write past the stored vault head, its digest kept (`chainvault.stepped`), sealed
    for the source the meta `to` names (a `key move`'s, before its switch writes them);
    nothing when none authenticates under `key` for the source the file names now."""
    vh = VaultHead.decode(_stored(conn))
    source = _bound(conn)
    stepped = None if vh is None else chainvault.stepped(key, vh, source, bound_source(to))
    if stepped is not None:
        _write(conn, stepped)


def verdict(
    conn: sqlite3.Connection, keys: Mapping[str, ChainKey], floor: Floor | None = None
) -> Tamper | None:
    """Whether the vault head matches every head of the file, in the caller's snapshot,
    and is not older than `floor` (the anchor, as the process knows it; None: no anchor).
    Asked of a chained file only (`chained`: each caller has just read it)."""
    text = _stored(conn)
    vh = VaultHead.decode(text)
    key = None if vh is None else keys.get(vh.kid)
    if text is None or vh is None or key is None:
        return Tamper.VAULT_MISMATCH
    heads, source = stored_heads(conn), _through(conn, floor)
    if _VOUCHED.get((key.vault_id, source, text)) != heads:
        if not chainvault.matches(key, vh, _decoded(heads), source):
            return Tamper.VAULT_MISMATCH
        if len(_VOUCHED) >= _VOUCHED_MAX:
            _VOUCHED.clear()
        _VOUCHED[(key.vault_id, source, text)] = heads
    if floor is not None and not floor.passes(vh.point()):
        return Tamper.FILE_ROLLED_BACK
    return None


def refuse_behind(
    conn: sqlite3.Connection, key: ChainKey, floor: Floor, session_id: str, where: str
) -> None:
    """Before a write: refuse a file whose vault head is behind `floor`. Written to, it
    would move on from the older state, past the anchor, and the rollback would be lost.
    Nor is it judged by `floor` once its vault head is sealed for another key source
    than the one `floor` was read through (VaultBusy, as `_through`); no meta row read."""
    vh = VaultHead.decode(_stored(conn))
    if vh is None:
        return
    source = _sealed_for(conn, vh)
    _refuse_other_source(conn, floor, source, session_id, where)
    if chainvault.vault_head_ok(key, vh, source) and not floor.passes(vh.point()):
        raise chainops.tampered(session_id, Tamper.FILE_ROLLED_BACK, where)


def _refuse_other_source(
    conn: sqlite3.Connection, floor: Floor, source: str, session_id: str, where: str
) -> None:
    if floor.source is not None and source != floor.source:
        # Rows naming that source too: a move since (VaultBusy, from `_through`). Else
        # the vault head or the rows were changed: the mismatch every reader tells.
        _through(conn, floor)
        raise chainops.tampered(session_id, Tamper.VAULT_MISMATCH, where)


def authentic(
    conn: sqlite3.Connection, keys: Mapping[str, ChainKey], through: str | None = None
) -> VaultHead | None:
    """The file's vault head, if it authenticates under `keys` for the key source
    `through` (None: the one the rows name): a state memvault wrote, whatever the file
    holds now (what the anchor and a backup's seal record)."""
    vh = VaultHead.decode(_stored(conn))
    key = None if vh is None else keys.get(vh.kid)
    source = _bound(conn) if through is None else through
    if vh is None or key is None or not chainvault.vault_head_ok(key, vh, source):
        return None
    return vh


def _listed(conn: sqlite3.Connection, session_id: str) -> bool:
    return conn.execute(session_exists_sql("?"), (session_id, session_id)).fetchone() is not None


def accept(
    conn: sqlite3.Connection, key: ChainKey, where: str, anchor: Point | None = None
) -> tuple[int, bool, Point]:
    """The vault head summed afresh over the heads as they stand, on purpose: the way to
    take as it is a vault whose sessions no longer match it, or a file older than its
    `anchor` (the new vault head goes past it). Refused while a session's own head does
    not authenticate (that session's check names it; `clear --include-unreadable`
    deletes it on purpose). Returns the number of sessions, whether the stored vault
    head matched them already, not behind the anchor, and the point written."""
    heads = stored_heads(conn)
    decoded = _decoded(heads)
    for sid in heads:
        head = decoded.get(sid)
        if head is None or not head_ok(key, sid, head):
            # `clear` needs the session's rows or its row in agent_sessions to find it.
            fix = (
                f"delete that session's history on purpose with `memvault clear {sid!r} "
                "--include-unreadable` first, or restore the vault from a backup"
                if _listed(conn, sid)
                else "restore the vault from a backup"
            )
            raise HistoryTampered(
                f"session {sid!r} of {where} has a head that does not authenticate, so the "
                f"vault's state cannot be accepted; {fix}; nothing was changed",
                sid,
                Tamper.UNAUTHENTICATED.value,
            )
    vh, source = VaultHead.decode(_stored(conn)), _to_seal(conn, where)
    conn.execute(_TABLE_SQL)
    matched = vh is not None and chainvault.matches(key, vh, decoded, source)
    if vh is not None and anchor is not None and chainvault.behind(vh.point(), anchor):
        matched = False
    past = 0 if anchor is None else anchor.seq
    written = chainvault.accepted(key, vh, decoded, source, past)
    _write(conn, written)
    return len(heads), matched, written.point()
