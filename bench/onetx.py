"""0.2's rotation, every row re-encrypted in one transaction under the write lock:
the bench's baseline for the online rotation (`python -m bench.onetx DB` prints
its report as `memvault --json rotate` does). A copy of the library's former
code, built on its public pieces; the library itself rotates online only.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

from vault import chainops, crypto, keyjournal
from vault.engines.sqlite import chainrows
from vault.engines.sqlite.db import audit, read_meta, row_batches, set_meta
from vault.engines.sqlite.schema import MESSAGES_TABLE, utcnow
from vault.engines.sqlite.vault import Vault
from vault.errors import VaultBusy
from vault.keyjournal import CURRENT, PENDING, RETIRED, entry_name
from vault.keyload import refuse_revoked
from vault.results import Report


def rotate_in_one_transaction(v: Vault, scrub: bool = True) -> Report:
    """0.2's rotation: every row re-encrypted in one transaction under the write
    lock. Kept for the bench only, to compare the online rotation with."""
    started = time.monotonic()
    new = crypto.Sealer(crypto.generate_key())
    for _attempt in range(5):
        old = v.sealer(refresh=True)
        with v.write_transaction() as conn:
            refuse_revoked(read_meta(conn, v.path))
            keyjournal.record(conn, new.kid, PENDING)
        counts = _reencrypt(v, old, new)
        if counts is not None:
            break
    else:
        raise VaultBusy(f"{v.path} kept changing key during the rotation; try again")
    return v._settle(old, new, counts, scrub, started)


def _reencrypt(v: Vault, old: crypto.Sealer, new: crypto.Sealer) -> dict[str, int] | None:
    """The one-transaction rotation's work: store the new entry and re-encrypt every
    row under the write lock. None, changing nothing, when the file moved on since `old` was
    loaded or our pending record was tidied away."""
    ks = v.keystore
    ttl = v.ttl
    cutoff = None if ttl is None else int(time.time()) - ttl
    items = expired = unreadable = 0
    sessions: set[str] = set()
    stored = committed = False
    with v.connection() as conn:
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("BEGIN IMMEDIATE")
        meta = read_meta(conn, v.path)
        refuse_revoked(meta)
        states = {k.kid: k.state for k in keyjournal.versions(conn)}
        if meta["kid"] != old.kid or states.get(new.kid) != PENDING:
            return None
        vault_id = meta["vault_id"]
        # The history chain moves with the rows, as in the online rotation: a fair baseline.
        chain_keys = (chainops.key_of(old, vault_id), chainops.key_of(new, vault_id))
        try:
            ks.set(entry_name(vault_id, new.kid), new.master_key)
            stored = True
            set_meta(conn, kid=new.kid, rotated_at=utcnow(), scrub_pending="1")
            keyjournal.record(conn, old.kid, RETIRED)
            keyjournal.record(conn, new.kid, CURRENT)
            chainrows.remac_heads(conn, *chain_keys)
            for batch in row_batches(conn):
                links: dict[int, str | None] = dict(
                    conn.execute(
                        f"SELECT id, chain FROM {MESSAGES_TABLE} WHERE id BETWEEN ? AND ?",
                        (batch[0][0], batch[-1][0]),
                    ).fetchall()
                )
                updates = []
                for row_id, sid, data in batch:
                    sessions.add(sid)
                    stamped = crypto.rotate_row_stamped(old, new, sid, data)
                    if stamped is None:
                        unreadable += 1  # kept as it is: nothing is deleted by a rotation
                        continue
                    rotated, ts = stamped  # ts from the token: no second parse of the row
                    items += 1
                    if cutoff is not None and ts < cutoff:
                        expired += 1
                    updates.append((rotated, row_id, data))
                conn.executemany(
                    f"UPDATE {MESSAGES_TABLE} SET message_data = ?, chain = ? "
                    "WHERE id = ? AND message_data = ? AND chain IS ?",
                    chainrows.remac_updates(*chain_keys, updates, links),
                )
            audit(
                conn,
                "rotate",
                new.kid,
                old_kid=old.kid,
                items=items,
                expired=expired,
                unreadable=unreadable,
                sessions=len(sessions),
            )
            committed = True  # from here the outcome of a failure is unknown
            conn.execute("COMMIT")
        finally:
            if stored and not committed:
                # Still holding the lock and nothing committed: no row uses the new
                # key, so its entry goes (the journal's pending record is tidied by
                # the next open). After a failed COMMIT the entry stays for `tidy`
                # to judge against the file.
                with contextlib.suppress(Exception):
                    conn.execute("ROLLBACK")
                with contextlib.suppress(Exception):
                    ks.delete(entry_name(vault_id, new.kid))
    return {
        "sessions": len(sessions),
        "items": items,
        "expired": expired,
        "unreadable": unreadable,
    }


def main() -> None:
    report = rotate_in_one_transaction(Vault.open(sys.argv[1]))
    print(json.dumps(report.counts))


if __name__ == "__main__":
    main()
